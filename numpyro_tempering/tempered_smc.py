r"""Tempered log-partition functions by adaptive tempered SMC over the globals.

:math:`\log C(T)` (variational-tempering supplement, eq. 1-3) is the *evidence* of a model
whose prior is the untempered prior of the globals :math:`p(\beta)` and whose "likelihood"
is the product of the closed-form per-element normalisers of the tempered sites,

.. math::

    C(T) = \int d\beta\, p(\beta)\, e^{L_T(\beta)}, \qquad
    L_T(\beta) = \sum_n \log c_n(\beta, T),

with :math:`\log c_n` the sum of the log normalisers :math:`\log Z(T)` of element
:math:`n`'s tempered sites given the globals (the registry of
:mod:`numpyro_tempering.partition`, computed by the same code as the plain Monte Carlo
estimator of :mod:`numpyro_tempering.partition_function`). For realistic N,
:math:`e^{L_T}` is sharply peaked and far in the prior's tail, so averaging it over prior
draws fails (the failure mode of issue 11). Here it is estimated like an evidence:

* **Adaptive tempered SMC** (Del Moral, Doucet and Jasra 2006; the ESS-adaptive schedule of
  Jasra et al. 2011) along the path :math:`\pi_\lambda \propto q^{1-\lambda}\,
  (p\, e^{L_T})^{\lambda}`, :math:`\lambda: 0 \to 1`, from a Gaussian reference :math:`q`:
  the Laplace approximation of the tilted target (mode by damped Newton steps, covariance
  the inverse Hessian inflated by ``REFERENCE_INFLATION**2``; the unit matrix if the
  curvature is not positive definite). Each stage picks the next :math:`\lambda` so that
  the incremental weights keep an ESS of ``target_ess`` of the particles, resamples
  (systematic), and moves the particles with ``num_mcmc_steps`` HMC steps targeting the
  current stage. The product of the stages' mean incremental weights is an unbiased
  estimate of :math:`\int q\, (p e^{L_T} / q) = C(T)`. Starting from :math:`q` and not
  from the prior (``SMCSettings(reference="prior")``) matters: at realistic N the tilted
  target sits far in the prior's tail (a shift of :math:`N(1 - 1/T) v^2` in the log-scale
  of a log-normal prior of sd :math:`v`: 90 prior sds in the tests), and the number of
  stages of a path from the prior grows with that distance (200 stages were not enough at
  N = 2000, 540 prior sds), while from :math:`q` one to a few stages suffice.
* **On NumPyro's unconstrained space**: each global is mapped by
  ``biject_to(support)`` (``numpyro.infer.util``'s ``_unconstrain_reparam``, which also adds
  the log-Jacobian to the prior), so HMC needs no boundaries.
* **Gradient-based moves that mix every global**: HMC (``num_integration_steps`` leapfrog
  steps) with a diagonal inverse mass matrix set at each stage to the weighted variance of
  the particle cloud, and a step size adapted between stages from the previous stage's
  acceptance rate (target 0.65). A global that the tempered factor barely touches keeps its
  prior-scale variance in the mass matrix, so it still moves.
* **Vectorised** over the temperatures and over ``R`` independent replicates (``vmap``),
  compiled once per model, selection and shapes and cached (``_CACHE``).

**Why blackjax's SMC and not our own.** ``blackjax.smc.adaptive_tempered`` is a maintained,
tested implementation of exactly this algorithm (the ESS root solve for the next
:math:`\lambda`, resampling, the unbiased normalising-constant increments, the weighted
particle bookkeeping, its HMC kernel); writing our own would duplicate it and its corner
cases (the sign bug of blackjax issue 914 in the ESS solve is one such). This module only
supplies the target (prior and :math:`L_T` from the registry), the stage loop with the
mass-matrix and step-size tuning, the replicates and the diagnostics.

**Error bars.** With replicates :math:`\hat C_r` (each unbiased for :math:`C`), the estimate
is :math:`\log \frac1R \sum_r \hat C_r` and its standard error the delta method across the
replicates, :math:`\mathrm{sd}_r(\hat C_r) / (\sqrt R\, \overline{\hat C})`. The log of an
unbiased estimate is biased **low** (Jensen), by about half the squared standard error of
the replicates' mean; the standard error is itself estimated from ``R`` values, so it is
trusted only when the replicates agree (see :func:`flag_smc`).

**Per-element pieces.** ``element_log_c`` is :math:`\mathbb{E}_{\pi_T}[\log c_n(\beta, T)]`
under the final weighted particles (the tilted target
:math:`\pi_T \propto p(\beta) e^{L_T(\beta)}`, averaged over the replicates) plus an even
share of :math:`\log C - \sum_n \mathbb{E}_{\pi_T}[\log c_n]`, so that the elements add up to
:math:`\log C`; elements whose normalisers do not depend on the globals get their exact
value plus the even share, identical elements get :math:`\log C / N`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import blackjax
import jax
import jax.numpy as jnp
import numpy as np
from blackjax.smc import adaptive_tempered, resampling
from jax import random
from jax.flatten_util import ravel_pytree
from jax.scipy.special import logsumexp
from numpyro.handlers import seed, trace
from numpyro.infer.util import _unconstrain_params, unconstrain_fn

__all__ = [
    "MAX_REPLICATE_SD",
    "MIN_ACCEPTANCE",
    "MIN_PARTICLES",
    "SMCSettings",
    "flag_smc",
]

#: flag a temperature whose replicates' log C-hat have a standard deviation above this (nats):
#: beyond it the replicates disagree and their delta-method standard error is meaningless
MAX_REPLICATE_SD = 1.0
#: ... or whose final-stage HMC moves accept less than this fraction (particles stuck)
MIN_ACCEPTANCE = 0.05
#: ... or that was estimated with fewer particles than this (too few to trust the ESS solve)
MIN_PARTICLES = 32
#: the Laplace reference's covariance is the inverse Hessian times this squared
REFERENCE_INFLATION = 1.5
#: damped Newton steps to the mode of the tilted target (the Laplace reference)
NEWTON_STEPS = 30


class SMCSettings(NamedTuple):
    """Budget of the tempered SMC estimator (hashable: part of the compilation cache key).

    Attributes:
        num_particles: P, particles per replicate.
        num_replicates: R, independent SMC runs per temperature (>= 2 for an error bar).
        num_mcmc_steps: HMC steps per particle and stage.
        num_integration_steps: leapfrog steps per HMC step.
        target_ess: fraction of P kept as the incremental weights' ESS at every stage.
        max_stages: a run that has not reached lambda = 1 after this many stages gives NaN.
    """

    num_particles: int = 256
    num_replicates: int = 4
    num_mcmc_steps: int = 4
    num_integration_steps: int = 4
    target_ess: float = 0.5
    max_stages: int = 200
    reference: str = "laplace"


class SMCRun(NamedTuple):
    """Raw per-replicate output, arrays of shape ``(R, M)`` (``element_mean``: ``(R, M, E)``)."""

    log_z: jax.Array
    ess: jax.Array  # final-stage ESS of the particle weights
    num_stages: jax.Array
    acceptance: jax.Array  # mean HMC acceptance rate of the last stage
    element_mean: jax.Array | None


def flag_smc(
    ess: Any,
    num_particles: int,
    replicate_log_c: Any,
    acceptance: Any,
    num_nonfinite: Any,
    exact: Any = None,
) -> np.ndarray:
    r"""Temperatures whose tempered-SMC log C cannot be trusted (boolean, per temperature).

    Flagged: any non-finite replicate (NaN, or a run that did not reach :math:`\lambda = 1`);
    fewer than ``MIN_PARTICLES`` particles; a final-stage ESS below
    ``min(10, P/2)``; a mean HMC acceptance rate of the last stage below ``MIN_ACCEPTANCE``
    (degenerate particles: resampled copies that never move apart); or replicates whose
    :math:`\log\hat C_r` spread (standard deviation) exceeds ``MAX_REPLICATE_SD`` nats.
    Temperatures marked ``exact`` (T = 1, where log C = 0 after the per-site check) are
    never flagged.

    Example:
        >>> flag_smc([128.0, 128.0], 256, [[0.0, 5.0], [0.0, 7.5]], [0.7, 0.7], [0, 0]).tolist()
        [False, True]
    """
    ess = np.asarray(ess, np.float64)
    reps = np.asarray(replicate_log_c, np.float64)
    flagged = np.asarray(num_nonfinite) > 0
    flagged |= int(num_particles) < MIN_PARTICLES
    flagged |= ~(ess >= min(10.0, num_particles / 2.0))
    flagged |= ~(np.asarray(acceptance, np.float64) >= MIN_ACCEPTANCE)
    if reps.shape[0] > 1:
        with np.errstate(invalid="ignore"):
            spread = np.std(reps, axis=0, ddof=1)
        flagged |= np.isfinite(spread) & (spread > MAX_REPLICATE_SD)
    if exact is not None:
        flagged &= ~np.asarray(exact, bool)
    return flagged


def combine(replicate_log_c: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``log mean_r C_r``, its delta-method standard error and the non-finite count, per
    temperature, from replicates ``(R, M)``; any non-finite replicate makes the estimate NaN."""
    num = replicate_log_c.shape[0]
    bad = ~jnp.isfinite(replicate_log_c)
    log_c = logsumexp(replicate_log_c, axis=0) - math.log(num)
    top = jnp.max(jnp.where(bad, -jnp.inf, replicate_log_c), axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(replicate_log_c - top)
    mean = w.mean(0)
    if num > 1:
        stderr = jnp.sqrt(jnp.sum((w - mean) ** 2, axis=0) / (num - 1) / num) / mean
    else:
        stderr = jnp.full_like(mean, jnp.nan)
    nbad = bad.sum(0)
    log_c = jnp.where(nbad > 0, jnp.nan, log_c)
    stderr = jnp.where(nbad > 0, jnp.nan, stderr)
    return log_c, stderr, nbad


# -----------------------------------------------------------------------------------------
# The target: prior of the globals (unconstrained) and L_T from the registry
# -----------------------------------------------------------------------------------------


class _Target(NamedTuple):
    init: Callable  # key -> flat unconstrained globals (a prior draw)
    log_prior: Callable  # u -> log p(u) (with the log-Jacobian)
    pieces: Callable  # (u, T) -> (L_T(u), per-element log c_n (E,))


def _build_target(
    marked: Callable,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    fallback: Any,
    global_names: tuple[str, ...],
    fixed_key: jax.Array,
) -> _Target:
    from numpyro_tempering.partition_function import _contributions, _fixed_values

    plates_and_globals = _fixed_values(marked, fixed_key, args, kwargs, plate, False)
    plate_values = {k: v for k, v in plates_and_globals.items() if k not in global_names}
    template = {k: plates_and_globals[k] for k in global_names}
    u_template = unconstrain_fn(seed(marked, fixed_key), args, kwargs, template)
    _, unravel = ravel_pytree(u_template)

    def init(key: jax.Array) -> jax.Array:
        values = _fixed_values(marked, key, args, kwargs, plate, False)
        values = {k: values[k] for k in global_names}
        u = unconstrain_fn(seed(marked, key), args, kwargs, values)
        return ravel_pytree(u)[0]

    def constrained(u: jax.Array) -> tuple[jax.Array, dict]:
        params = unravel(u)
        tr = trace(_unconstrain_params(seed(marked, fixed_key), params)).get_trace(
            *args, **kwargs
        )
        log_p = jnp.zeros((), u.dtype)
        for name in global_names:
            for site_name in (name, f"_{name}_log_det"):
                site = tr.get(site_name)
                if site is None:
                    continue
                lp = site["fn"].log_prob(site["value"])
                if site.get("scale") is not None:
                    lp = site["scale"] * lp
                log_p = log_p + jnp.sum(lp)
        return log_p, {name: tr[name]["value"] for name in global_names}

    def log_prior(u: jax.Array) -> jax.Array:
        return constrained(u)[0]

    def pieces(u: jax.Array, temperature: jax.Array) -> tuple[jax.Array, jax.Array]:
        _, values = constrained(u)
        inner = _contributions(
            marked, temperature, fixed_key, {**plate_values, **values}, args, kwargs, plate,
            fallback,
        )
        elements = inner.multiplicity * inner.elements
        return jnp.sum(elements) + inner.rest, elements

    return _Target(init, log_prior, pieces)


# -----------------------------------------------------------------------------------------
# One SMC run
# -----------------------------------------------------------------------------------------


def _laplace(
    target: _Target, temperature: jax.Array, start: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Mode and Cholesky factor of the inflated inverse Hessian of ``log p + L_T``.

    The mode is found by ``NEWTON_STEPS`` damped Newton steps (Levenberg-Marquardt: a step
    that does not decrease ``-(log p + L_T)`` is refused and the damping raised) from a prior
    draw ``start``. A non-finite or non-positive-definite curvature falls back to the unit
    matrix: the SMC then corrects the poor reference at the price of more stages.
    """

    def neg(u: jax.Array) -> jax.Array:
        value = -(target.log_prior(u) + target.pieces(u, temperature)[0])
        return jnp.where(jnp.isfinite(value), value, jnp.inf)

    eye = jnp.eye(start.shape[-1], dtype=start.dtype)

    def newton(_: Any, carry: tuple) -> tuple:
        u, f, lam = carry
        g = jax.grad(neg)(u)
        h = jax.hessian(neg)(u)
        h = 0.5 * (h + h.T)
        damp = lam * (jnp.mean(jnp.abs(jnp.diag(h))) + 1.0)
        new = u - jnp.linalg.solve(h + damp * eye, g)
        f_new = neg(new)
        ok = jnp.isfinite(f_new) & (f_new <= f) & jnp.all(jnp.isfinite(new))
        return jnp.where(ok, new, u), jnp.where(ok, f_new, f), jnp.where(ok, lam / 10, lam * 10)

    lam0 = jnp.asarray(1e-3, start.dtype)
    mode, _, _ = jax.lax.fori_loop(0, NEWTON_STEPS, newton, (start, neg(start), lam0))
    hess = jax.hessian(neg)(mode)
    hess = 0.5 * (hess + hess.T)
    cov = jnp.linalg.inv(hess) * REFERENCE_INFLATION**2
    chol = jnp.linalg.cholesky(cov)
    ok = jnp.all(jnp.isfinite(chol))
    return mode, jnp.where(ok, chol, eye)


def _smc(
    target: _Target, settings: SMCSettings, key: jax.Array, temperature: jax.Array,
    reference: tuple[jax.Array, jax.Array] | None, per_element: bool,
) -> tuple:
    """One adaptive tempered SMC run at one temperature: (log C-hat, final ESS, stages,
    last acceptance, E_final[log c_n] or None)."""
    num = settings.num_particles
    key_init, key_loop = random.split(key)
    if reference is None:  # path from the prior
        particles = jax.vmap(target.init)(random.split(key_init, num))

        def log_ref(u: jax.Array) -> jax.Array:
            return target.log_prior(u)

        def loglik(u: jax.Array) -> jax.Array:
            value = target.pieces(u, temperature)[0]
            return jnp.where(jnp.isnan(value), -jnp.inf, value)

    else:  # path from a Gaussian reference q: pi_lambda = q^(1 - lambda) (p e^L)^lambda
        mode, chol = reference
        eps = random.normal(key_init, (num, mode.shape[-1]), mode.dtype)
        particles = mode + eps @ chol.T
        log_det = jnp.sum(jnp.log(jnp.diag(chol)))

        def log_ref(u: jax.Array) -> jax.Array:
            z = jax.scipy.linalg.solve_triangular(chol, u - mode, lower=True)
            return -0.5 * jnp.sum(z**2) - log_det - 0.5 * z.shape[-1] * math.log(2 * math.pi)

        def loglik(u: jax.Array) -> jax.Array:
            value = target.log_prior(u) + target.pieces(u, temperature)[0] - log_ref(u)
            return jnp.where(jnp.isnan(value), -jnp.inf, value)

    dtype = particles.dtype
    dim = particles.shape[-1]
    hmc = functools.partial(
        blackjax.hmc.build_kernel(), num_integration_steps=settings.num_integration_steps
    )
    kernel = adaptive_tempered.build_kernel(
        log_ref,
        loglik,
        hmc,
        blackjax.hmc.init,
        resampling.systematic,
        settings.target_ess,
    )
    state = adaptive_tempered.init(particles)
    zero = jnp.zeros((), dtype)
    init_step = jnp.asarray(1.0 / max(dim, 1) ** 0.25, dtype)

    def cond(carry: tuple) -> jax.Array:
        state, _, _, stages, _, _, bad = carry
        return (state.tempering_param < 1.0) & (stages < settings.max_stages) & ~bad

    def body(carry: tuple) -> tuple:
        state, key, log_z, stages, step, _, _ = carry
        key, sub = random.split(key)
        w = state.weights[:, None]
        mean = jnp.sum(w * state.particles, 0)
        var = jnp.sum(w * (state.particles - mean) ** 2, 0)
        var = jnp.where(jnp.isfinite(var) & (var > 1e-12), var, 1.0)
        params = {"step_size": step[None], "inverse_mass_matrix": var[None]}
        new, info = kernel(sub, state, settings.num_mcmc_steps, params)
        acc = jnp.mean(info.update_info.acceptance_rate)
        acc = jnp.where(jnp.isfinite(acc), acc, 0.0)
        step = jnp.clip(step * jnp.exp(acc - 0.65), 1e-3, 2.0).astype(dtype)
        log_z = log_z + info.log_likelihood_increment
        bad = ~jnp.isfinite(log_z)
        return new, key, log_z, stages + 1, step, acc.astype(dtype), bad

    carry = (state, key_loop, zero, jnp.zeros((), jnp.int32), init_step, jnp.ones((), dtype),
             jnp.zeros((), bool))
    state, _, log_z, stages, _, acc, _ = jax.lax.while_loop(cond, body, carry)
    done = state.tempering_param >= 1.0
    log_z = jnp.where(done, log_z, jnp.nan)
    ess = 1.0 / jnp.sum(state.weights**2)
    element = None
    if per_element:
        element = jax.vmap(lambda u: target.pieces(u, temperature)[1])(state.particles)
        element = jnp.sum(state.weights[:, None] * element, 0)
    return log_z, ess, stages, acc, element


def build_runner(
    marked: Callable,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    fallback: Any,
    global_names: tuple[str, ...],
    settings: SMCSettings,
    per_element: bool,
) -> Callable:
    """``(key, temperatures) -> SMCRun``: every temperature, R replicates, vectorised."""

    def run(key: jax.Array, temps: jax.Array) -> SMCRun:
        key_fixed, key_runs = random.split(key)
        target = _build_target(marked, args, kwargs, plate, fallback, global_names, key_fixed)
        keys = random.split(key_runs, settings.num_replicates)

        if settings.reference == "laplace":
            start = target.init(key_fixed)
            refs = jax.vmap(lambda t: _laplace(target, t, start))(temps)
        else:
            refs = None

        def one(k: jax.Array, t: jax.Array, ref: Any) -> tuple:
            return _smc(target, settings, k, t, ref, per_element)

        out = jax.vmap(jax.vmap(one, (None, 0, 0)), (0, None, None))(keys, temps, refs)
        return SMCRun(*out)

    return run
