r"""log C(T) at every rung of a ladder from one sequential tempered SMC run (issue 20, scope 3).

The per-temperature route of :mod:`numpyro_tempering.tempered_smc` runs one SMC per
temperature, each from its own reference. Here one run per replicate walks the whole ladder
in :math:`b = 1/T`. Its targets are the tilted targets of the supplement (eq. 1-3),

.. math::

    \gamma_b(\beta) = p(\beta)\, e^{L_{1/b}(\beta)}, \qquad
    L_T(\beta) = \sum_n \log c_n(\beta, T), \qquad C(T) = \int \gamma_{1/T},

and it starts at :math:`b = 1`, where every :math:`\log c_n(\beta, 1) = 0` (checked per
site), so that :math:`\gamma_1` is the prior, :math:`C(1) = 1`, and particles are exact prior
draws. The rungs, sorted by decreasing :math:`b`, are stages of the schedule; where the
effective sample size of a step to the next rung would fall below ``target_ess`` of the
particles, intermediate stages are put in between (the ESS-adaptive schedule of Jasra et al.
2011, in :math:`b`). The product of the stages' mean incremental weights up to rung
:math:`m` is an unbiased estimate of :math:`C(T_m)` (Del Moral, Doucet and Jasra 2006,
Proposition 2 and section 3.3), so log C is read off at every rung of one run; ``R``
independent runs (replicates) give the standard error exactly as in the per-temperature route
(:func:`~numpyro_tempering.tempered_smc.combine`).

**Transport between stages.** A path in :math:`b` from the prior is long when the tilted
target moves far from it (90 prior standard deviations for the tests' log-normal scale at
T = 10): with plain reweighting the variance of :math:`\log \hat C` grows like the square of
that distance over the number of stages times the particles. Each stage therefore moves the
particles by a deterministic affine map before weighting them (escorted free-energy
estimation, Vaikuntanathan and Jarzynski 2011; annealed flow transport, Arbel, Matthews and
Doucet 2021; the weight below is the change of variables, re-derived here): with
:math:`m_b` the mode of :math:`\gamma_b` (a few damped Newton steps from the previous
stage's mode) and :math:`R_b R_b^\top` the Hessian of
:math:`-\log\gamma_b` there,

.. math::

    f(\beta) = m_{b'} + R_{b'}^{-\top} R_b^\top (\beta - m_b), \qquad
    w(\beta) = \frac{\gamma_{b'}(f(\beta))\, |\det \nabla f|}{\gamma_b(\beta)}, \qquad
    \log|\det\nabla f| = \sum_i \log (R_b)_{ii} - \sum_i \log (R_{b'})_{ii},

and :math:`\mathbb E_{\gamma_b / C_b}[w] = C_{b'} / C_b` exactly for any invertible
:math:`f` that does not depend on the particles (the map is built from the Newton chain
only; the b at which it is built is chosen from the particles' ESS, the usual adaptive
schedule of SMC, whose effect on the estimate is of order 1/P). For a Gaussian tilted
target the weights are constant; where the curvature is not
positive definite the map is the identity (plain reweighting). The particles are then
resampled (systematic) and moved by ``num_mcmc_steps`` HMC steps targeting
:math:`\gamma_{b'}`, with the tuning of the per-temperature route (diagonal mass matrix from
the weighted particle cloud, step size adapted from the acceptance rate).

**Schedule.** Each stage tries ``GROWTH`` (4) times the last accepted step in :math:`b`
(the whole remaining way to the next rung at most) and halves it, up to ``MAX_HALVINGS``
times, until the transported weights keep an ESS of ``target_ess`` of the particles; a rung
is always a stage.
``max_stages`` caps the *intermediate* stages of a run (a run therefore takes at most
:math:`M` + ``max_stages`` stages): rungs a run did not reach get NaN, are flagged, and their
``tempering_param`` is the fraction of the way in :math:`b` from 1 to the rung that was
covered.

**Errors are correlated across rungs** far more than in the per-temperature route: the
estimate at rung :math:`m` is the one at rung :math:`m - 1` times the next stages' weights,
so the errors accumulate along the ladder; the replicates are independent, and
:func:`~numpyro_tempering.tempered_smc.replicate_covariance` gives the covariance across
rungs from them.

Only temperatures :math:`T \ge 1` (:math:`b \le 1`); the per-temperature route serves others.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import blackjax
import jax
import jax.numpy as jnp
from blackjax.smc import from_mcmc, resampling, tempered
from jax import random
from jax.scipy.special import logsumexp

from numpyro_tempering.tempered_smc import (
    SMCRun,
    SMCSettings,
    _build_target,
    _log_tilted,
    _newton,
    _precision_factor,
    _prior_check,
    _solve_upper,
    _Target,
    map_grouped,
    mean_acceptance,
    rays_beyond,
    run_size,
)

__all__ = ["GROWTH", "MAX_HALVINGS", "MAX_STEP", "WARM_NEWTON_STEPS", "build_ladder_runner"]

#: halvings of a stage's step in b before the step is taken whatever its ESS
MAX_HALVINGS = 12
#: largest HMC step size (in units of the mass matrix's scales): leapfrog on a Gaussian is
#: unstable from 2 on, and a step size left to grow there between rungs made a stage's moves
#: all fail
MAX_STEP = 1.0
#: a stage first tries this many times the last accepted step in b
GROWTH = 4.0
#: damped Newton steps per stage, warm-started at the previous stage's mode
WARM_NEWTON_STEPS = 4


class LadderCarry(NamedTuple):
    """State of one replicate's run between rungs (every field batched over replicates)."""

    particles: jax.Array  # (P, D), equally weighted draws from gamma_beta
    beta: jax.Array  # current b = 1/T
    log_z: jax.Array  # log C-hat(1/beta) = log_z + comp
    comp: jax.Array  # compensation of the rounding of log_z (Neumaier summation)
    mode: jax.Array  # (D,) Newton mode of gamma_beta
    prec: jax.Array  # (D, D) Cholesky factor of the Hessian there
    ok: jax.Array  # whether prec is usable
    step_b: jax.Array  # last accepted step in b
    step: jax.Array  # HMC step size
    key: jax.Array
    stages: jax.Array  # stages so far
    extra: jax.Array  # intermediate (non-rung) stages so far
    ess: jax.Array  # ESS of the last stage's weights
    acc: jax.Array  # mean HMC acceptance of the last stage
    element: jax.Array  # (E,) weighted mean of log c_n at the last stage (or (0,))
    bad: jax.Array  # a non-finite log C-hat stopped the run


def _log_gamma_parts(target: _Target, beta: jax.Array) -> Callable:
    """``u -> (log p(u), per-element log c_n, the rest of L_{1/beta})``: the weights are
    differences of these taken *before* summing over the elements, so that their rounding is
    that of the (small) increments, not of :math:`L_T` (thousands of nats at N = 2000: a
    float32 bias of ~1e-4 nats per stage, 0.013 nats over the paper's ladder, otherwise)."""

    def fn(u: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        _, elements, rest = target.pieces(u, 1.0 / beta)
        return target.log_prior(u), elements, rest

    return fn


def _increment(cur: tuple, new: tuple) -> jax.Array:
    """``log gamma_new - log gamma_cur`` from :func:`_log_gamma_parts` outputs."""
    value = (new[0] - cur[0]) + jnp.sum(new[1] - cur[1]) + (new[2] - cur[2])
    return jnp.where(jnp.isnan(value), -jnp.inf, value)


def _ess(log_w: jax.Array) -> jax.Array:
    """Kish ESS of unnormalised log weights (0 when none is finite)."""
    ess = jnp.exp(2 * logsumexp(log_w) - logsumexp(2 * log_w))
    return jnp.where(jnp.isfinite(ess), ess, 0.0)


def _stage(
    target: _Target, settings: SMCSettings, per_element: bool, b_rung: jax.Array,
    carry: LadderCarry,
) -> LadderCarry:
    """One stage towards ``b_rung``: choose the next b, transport and weight, resample, move."""
    num = settings.num_particles
    u = carry.particles
    dim = u.shape[-1]
    eye = jnp.eye(dim, dtype=u.dtype)
    parts_cur = jax.vmap(_log_gamma_parts(target, carry.beta))(u)
    remaining = carry.beta - b_rung

    def weigh(db: jax.Array) -> tuple:
        full = db >= remaining
        b_new = jnp.where(full, b_rung, carry.beta - db)
        temp = 1.0 / b_new
        mode, hess = _newton(target, temp, carry.mode, WARM_NEWTON_STEPS)
        prec, ok = _precision_factor(hess)
        use = carry.ok & ok
        # A = R_new^{-T} R_cur^T column by column (no LAPACK: see tempered_smc._cholesky)
        safe = jnp.where(use, prec, eye)
        amap = jax.vmap(lambda col: _solve_upper(safe.T, col), 1, 1)(carry.prec.T)
        amap = jnp.where(use, amap, eye)
        shift_from = jnp.where(use, carry.mode, 0.0)
        shift_to = jnp.where(use, mode, 0.0)
        log_det = jnp.where(
            use, jnp.sum(jnp.log(jnp.diag(carry.prec))) - jnp.sum(jnp.log(jnp.diag(safe))), 0.0
        )
        moved = shift_to + (u - shift_from) @ amap.T
        parts_new = jax.vmap(_log_gamma_parts(target, b_new))(moved)
        log_w = jax.vmap(_increment)(parts_cur, parts_new) + log_det
        elements = parts_new[1] if per_element else jnp.zeros((num, 0), u.dtype)
        return db, b_new, mode, prec, ok, moved, log_w, _ess(log_w), elements

    # a do-while: the first pass tries GROWTH times the last step, each further pass halves it
    # (``weigh`` is traced once)
    empty = jax.eval_shape(weigh, remaining)
    empty = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), empty)
    first = jnp.minimum(GROWTH * carry.step_b, remaining)

    def short(c: tuple) -> jax.Array:
        trial, passes = c
        return (passes == 0) | (
            (trial[7] < settings.target_ess * num) & (passes <= MAX_HALVINGS)
        )

    def halve(c: tuple) -> tuple:
        trial, passes = c
        return weigh(jnp.where(passes == 0, first, 0.5 * trial[0])), passes + 1

    (db, b_new, mode, prec, ok, moved, log_w, ess, elements), _ = jax.lax.while_loop(
        short, halve, (empty, jnp.zeros((), jnp.int32))
    )
    # compensated (Neumaier) sum of the increments: log C-hat reaches thousands of nats,
    # where a float32 addition rounds by ~1e-3
    inc = logsumexp(log_w) - math.log(num)
    log_z = carry.log_z + inc
    comp = carry.comp + jnp.where(
        jnp.abs(carry.log_z) >= jnp.abs(inc),
        (carry.log_z - log_z) + inc,
        (inc - log_z) + carry.log_z,
    )
    weights = jax.nn.softmax(log_w)
    weights = jnp.where(jnp.isfinite(weights), weights, 1.0 / num)
    element = jnp.sum(weights[:, None] * elements, 0)

    # resample and move: HMC targeting gamma_{b_new}, mass matrix from the weighted cloud
    key, sub = random.split(carry.key)
    mean = jnp.sum(weights[:, None] * moved, 0)
    var = jnp.sum(weights[:, None] * (moved - mean) ** 2, 0)
    var = jnp.where(jnp.isfinite(var) & (var > 1e-12), var, 1.0)
    hmc = functools.partial(
        blackjax.hmc.build_kernel(), num_integration_steps=settings.num_integration_steps
    )
    move = from_mcmc.build_kernel(hmc, blackjax.hmc.init, resampling.systematic)
    params = {"step_size": carry.step[None], "inverse_mass_matrix": var[None]}
    new, info = move(
        sub,
        tempered.TemperedSMCState(moved, weights, 0.0),
        settings.num_mcmc_steps,
        params,
        _log_tilted(target, 1.0 / b_new),
        lambda x: jnp.zeros((), u.dtype),
    )
    acc = mean_acceptance(info.update_info.acceptance_rate).astype(u.dtype)
    step = jnp.clip(carry.step * jnp.exp(acc - 0.65), 1e-3, MAX_STEP).astype(u.dtype)
    return LadderCarry(
        new.particles, b_new, log_z, comp, mode, prec, ok, db, step, key, carry.stages + 1,
        carry.extra + (b_new != b_rung).astype(jnp.int32), ess, acc, element,
        ~jnp.isfinite(log_z + comp),
    )


def _segment(
    target: _Target, settings: SMCSettings, per_element: bool, carry: LadderCarry,
    b_rung: jax.Array,
) -> tuple[LadderCarry, tuple]:
    """Stages until the run reaches ``b_rung`` (or the cap stops it); the rung's read-out."""
    before = carry.stages

    def go_on(c: LadderCarry) -> jax.Array:
        return (c.beta > b_rung) & (c.extra < settings.max_stages) & ~c.bad

    carry = jax.lax.while_loop(
        go_on, functools.partial(_stage, target, settings, per_element, b_rung), carry
    )
    reached = (carry.beta <= b_rung) & ~carry.bad
    covered = jnp.where(b_rung < 1.0, (1.0 - carry.beta) / (1.0 - b_rung), 1.0)
    out = (
        jnp.where(reached, carry.log_z + carry.comp, jnp.nan),
        carry.ess,
        carry.stages - before,
        carry.acc,
        carry.element,
        jnp.where(reached, 1.0, jnp.clip(covered, 0.0, 1.0)).astype(carry.log_z.dtype),
        jnp.max(jax.vmap(_log_tilted(target, 1.0 / carry.beta))(carry.particles)),
    )
    return carry, out


def build_ladder_runner(
    marked: Callable,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    fallback: Any,
    global_names: tuple[str, ...],
    settings: SMCSettings,
    per_element: bool,
) -> tuple[Callable, Callable]:
    """``(init, advance)``: ``init(key, temps) -> carry`` starts R replicates at the prior
    (``temps`` only fixes the dtype), ``advance(key, temps, carry) -> (SMCRun, carry)``
    walks them through the rungs ``temps`` (sorted ascending, all >= 1) and reads log C off
    at each; called chunk by chunk with the same ``key`` (which fixes the target and the
    prior draws of the missed-mass check), it is one run over the whole ladder."""

    def setup(key: jax.Array) -> tuple[_Target, jax.Array, jax.Array]:
        key_fixed, key_runs = random.split(key)
        target = _build_target(marked, args, kwargs, plate, fallback, global_names, key_fixed)
        return target, key_fixed, key_runs

    def init(key: jax.Array, temps: jax.Array) -> LadderCarry:
        target, key_fixed, key_runs = setup(key)
        dtype = temps.dtype
        one = jnp.ones((), dtype)
        start = target.init(random.fold_in(key_fixed, 2))
        mode, hess = _newton(target, one, start)
        prec, ok = _precision_factor(hess)
        num_el = target.pieces(start, one)[1].shape[0] if per_element else 0

        def replicate(key_rep: jax.Array) -> LadderCarry:
            key_init, key_loop = random.split(key_rep)
            particles = jax.vmap(target.init)(random.split(key_init, settings.num_particles))
            dim = particles.shape[-1]
            return LadderCarry(
                particles.astype(dtype), one, jnp.zeros((), dtype), jnp.zeros((), dtype), mode,
                prec, ok,
                jnp.asarray(jnp.inf, dtype), jnp.asarray(1.0 / max(dim, 1) ** 0.25, dtype),
                key_loop, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                jnp.asarray(float(settings.num_particles), dtype), one,
                jnp.zeros((num_el,), dtype), jnp.zeros((), bool),
            )

        return jax.vmap(replicate)(random.split(key_runs, settings.num_replicates))

    def advance(key: jax.Array, temps: jax.Array, carry: LadderCarry) -> tuple:
        target, key_fixed, _ = setup(key)
        segment = functools.partial(_segment, target, settings, per_element)

        def run(c: LadderCarry) -> tuple:
            return jax.lax.scan(segment, c, 1.0 / temps)

        size = run_size(target, temps[0], key_fixed, settings.num_particles)
        carry, (log_z, ess, stages, acc, element, lam, top) = map_grouped(run, carry, size)
        prior_log_c, prior_ess, grows, ray_max = _prior_check(target, key_fixed, settings,
                                                              temps)
        out = SMCRun(
            log_z, ess, stages, acc, element if per_element else None, lam, prior_log_c,
            prior_ess, tail_grows=grows,
            ray_beyond=rays_beyond(ray_max, top, carry.particles.shape[-1]),
        )
        return out, carry

    return init, advance
