r"""log C(T) of models with low-dimensional continuous locals: adaptive Gauss-Hermite
quadrature over each element's locals, tempered SMC over the globals only.

The tempered partition function (variational-tempering supplement, eq. 1) with globals
:math:`\beta` (unconstrained :math:`u`) and per-element locals :math:`z_n` (unconstrained
:math:`v_n \in \mathbb R^d`) is

.. math::

    C(T) = \int du\, p(u) \prod_n c_n(u, T), \qquad
    c_n(u, T) = \int dv_n\, \tilde p(v_n \mid u)\, e^{a_n(u, v_n, T)}

(notation of :mod:`numpyro_tempering.joint_smc`: :math:`\tilde p` the local's density,
:math:`p^{1/T}` for a tempered latent local, with its bijection's log-Jacobian; :math:`a_n`
the tempered sites' log normalisers). The locals are conditionally independent given the
globals, so for small :math:`d` each :math:`c_n` is a :math:`d`-dimensional integral,
computed here by **adaptive Gauss-Hermite quadrature** (Liu and Pierce 1994; the Laplace
approximation is its one-node case): at every :math:`u`, per-element damped Newton steps
from the linear predictor :math:`v_n^* + B_n(u - u^*)` of the joint mode
(:func:`~numpyro_tempering.joint_smc._joint_mode`), until each element's Newton decrement
:math:`\lVert R_n^{-1}\nabla_{v_n} g_n\rVert` (its distance to the mode in conditional
standard deviations, to second order) is below ``LOCAL_TOLERANCE`` or after
``LOCAL_NEWTON_STEPS`` steps, give the conditional mode :math:`m_n(u)` and the Cholesky
factor :math:`R_n(u)` of the conditional curvature :math:`H_{nn}` there (Liu and Pierce's
rule is centred at the mode and scaled by the curvature there), and with the probabilists'
Hermite nodes :math:`e_j` and weights :math:`w_j` (summing to 1; a tensor grid for
:math:`d > 1`)

.. math::

    \log \hat c_n(u, T) = \operatorname{logsumexp}_j \big[\log w_j + g_n(u, m_n + R_n^{-\top}
        e_j) - \log\mathcal N(e_j; 0, I) - \log|R_n|\big],

:math:`g_n` the log integrand. It is exact when the conditional is Gaussian (any node count)
and converges fast for smooth unimodal ones. The tempered SMC of
:mod:`numpyro_tempering.tempered_smc` then runs over :math:`u` alone (``d_g`` coordinates, not
``d_g + N d``: no HMC in high dimension), with the likelihood :math:`\sum_n \log\hat c_n` and
the mixture reference over :math:`u`: Laplace approximations of the marginal target
:math:`\log p(u) + \sum_n \log\hat c_n(u, T)` (Newton steps from the K joint modes' globals;
the joint modes' own Schur precisions are degenerate on a funnel, where the joint mode has
the locals' scale at 0), and from the marginal target's grid maxima (one global) or ray
points (several: :func:`~numpyro_tempering.tempered_smc.extra_starts`), so that a mode no
prior draw reaches is found as over the globals alone (a far minority component of a
mixture prior was 60-126 nats low, unflagged, while the starts were prior draws only). Its
evidence estimate is unbiased for :math:`\int p(u)\prod_n \hat c_n(u, T)`; the
missed-mass, grid and ray checks of the globals-only route
(:func:`~numpyro_tempering.tempered_smc.prior_check_at`,
:func:`~numpyro_tempering.tempered_smc.rays_beyond`) run on the same marginal target.

**The quadrature error is measured, not assumed.** It is deterministic: at the final
weighted particles of every replicate the sum :math:`\sum_n \log\hat c_n` is recomputed with
twice the nodes per dimension (``CHECK_FACTOR``), and the weighted mean of the difference
(the error of :math:`\log C` to first order, :math:`\log \mathbb E_{\pi}[e^\delta] \approx
\mathbb E_\pi[\delta]`) is reported per temperature
(:attr:`~numpyro_tempering.partition_function.LogPartitionEstimate.quadrature_error`),
added to the standard error, and a temperature where it exceeds ``QUAD_TOLERANCE`` is
flagged. A node where an element's log density is NaN (e.g. a log link's ``exp`` beyond
float32's range, :math:`\eta > 88.7`) counts as zero in :math:`\hat c_n`; the check counts
the share :math:`\ell_n` of the fine rule's weights at such nodes as the rule's Gaussian
weighs them, adding :math:`-\log(1 - \ell_n)` (a NaN check, e.g. every node NaN, is flagged
with its own warning). Both rules sit around one mode of each element's integrand; a second
mode tens of conditional standard deviations away lies beyond their nodes and would go
unseen by both. For d = 1 the check therefore also integrates each element with a **wide
rule**, the trapezoid rule in :math:`t` on the nodes :math:`e = \sinh t`, :math:`|t| \le`
``WIDE_REACH`` (~900 conditional standard deviations), and takes the larger of the two per
element: on a double well 28 standard deviations apart (N = 200, T = 3 and 10) the
estimate, 159-195 nats low with a standard error of 0.05, is now flagged with a measured
error of 175-193 nats (``tests/test_log_partition_locals.py``, N = 100). A mode beyond the
reach, or narrower than the wide rule's spacing where it lies (about an eighth of its
distance), can still escape.

**Served** (the default ``route="auto"`` of
:func:`~numpyro_tempering.partition_function.log_partition`, or ``route="quadrature"``):
models that :func:`~numpyro_tempering.joint_smc.unsupported` accepts, with ``d <= MAX_DIM``
(1) unconstrained local coordinates per element; larger ``d`` runs the joint SMC with
``route="quadrature"`` and falls back to the nested Monte Carlo, with a warning, by default.
Measured (float32, defaults, N = 500, T in {1, 1.5, 3, 10},
``benchmarks/log_partition_locals.py``, a shared 2-core machine): normal, log-normal and
Gamma(3) locals (``tests/test_log_partition_locals.py``) all within 0.015 nats of the
closed forms with standard errors 0.03-0.05, one SMC stage, measured quadrature errors
below 1e-4 (Gaussian) and 1.2e-3 to 2.1e-3 nats (Gamma), 32-49 s a first call and 9-16 s
a compiled one; on the Gamma local the joint SMC took 160 s (27-38 stages) and erred by
up to 0.51 nats with standard errors 0.36-0.42. A Poisson log link under a half-normal
global scale (a funnel, 4 points, ``poisson_log_link`` of the tests, against
``poisson_reference``): at T in {1.5, 3, 10} within +0.009 to +0.027 nats with standard
errors 0.023-0.040 (two keys), unflagged, one SMC stage, measured quadrature errors below
5e-4 nats; 89 s a first call at four temperatures and 32 s a compiled one (machine
otherwise idle; 82 s / 23 s before the fixes below, which gave NaN), 104-116 s a first
call at two temperatures on the loaded machine, of which about 80 s was XLA lowering and
compiling the runner. Tracing the target once per Newton pass, placement and final check
(not up to four times) then cut a first call at two temperatures from 114 s to 89 s on
the loaded machine (interleaved: lowering 15 -> 10 s, XLA compilation 62 -> 41 s, compiled
HLO 24 -> 12 MB; the run 31 s either way) and from 69 s to 52 s on a quieter one (lowering
13 -> 9 s, compilation 36 -> 23 s, run 15 s); the Gamma local at N = 500: 50 -> 40 s
(loaded) and 30 -> 25 s (quieter: lowering 10 -> 7 s, compilation 14 -> 11 s, run 2.5 s).
The joint SMC took 30 s / 15 s on the funnel and was 1.3-2.9 nats low. Its NaN replicates
had two causes: a node at a log rate in (86.9, 88.7] made the Poisson
normaliser's large-rate expansion overflow to :math:`+\infty` (``2 pi r`` in float32; fixed
in :mod:`numpyro_tempering.partition`), an infinite :math:`\log\hat c_n` at particles near
:math:`u = \log s = 3.5`; and one Newton step from the joint mode's predictor, which on the
funnel sits at its neck (:math:`s \approx e^{-7}`, :math:`\eta = 0`), stayed there near
:math:`s = e^{1.25}` at T = 10 (the log density is nearly flat at :math:`\eta = 0`: the step
was many widths long and every fraction of it was refused): the nodes were scaled by the
curvature at :math:`\eta = 0`, 15.5 wide for a conditional sd of 3.4 (:math:`\log\hat c_n`
off by 0.24 per element), or, where that curvature was negative, by the joint mode's
(1/1334 wide); quadrature error -0.024 at T = 10, flagged.

**Heavy left tails in the unconstrained space.** A Gamma(0.5) or Gamma(0.3) local (in
:math:`v = \log z`, a density :math:`e^{a v - r e^v}`) has prior draws at :math:`v \approx
-30` (or :math:`\log 0` when a float32 draw underflows), where the conditional is nearly
flat: the polish's Newton step from those draws was ~1e13, every fraction of it
overshot, the joint modes kept such elements in the tail and the nodes followed them
(N = 300, T in {2, 5, 10}: 260-400 nats low or NaN, flagged by the check). The polish now
caps its steps (:data:`~numpyro_tempering.joint_smc.LOCAL_MAX_STEP`) and starts non-finite
draws at 0: within 0.06 nats (shape 0.5) and 0.14 nats (shape 0.3) of the closed form,
with measured quadrature errors of 0.02-0.15 nats (Gauss-Hermite on a skewed integrand;
flagged above ``QUAD_TOLERANCE``) that cover them
(``test_the_polish_reaches_a_gamma_locals_mode_from_its_prior_draws``).

**A funnel's neck in float32.** Where an element's conditional is narrower than the float
spacing at its mode (a local scale :math:`\sigma = e^{-30}` about a location 5), its nodes
:math:`m_n + R_n^{-\top} e` round onto a few points, and every rule sums
:math:`w_x e^{x^2/2}` over a flat integrand: 2.4 nats per element too high, alike in both
rules, so the check saw nothing. A logit-normal Binomial(20) (:math:`\mu \sim
\mathcal N(0, 1)`, :math:`\sigma \sim` HalfNormal(1), N = 50) drew the SMC into the
neck: log C 105.6 and 150.3 against 37.11 and 81.59 at T = 1.5 and 3 (flagged, standard
errors ~240). An element whose nodes land further than ``NODE_RESOLUTION`` of their offset
from where they were meant now takes its Laplace value (exact there: its integrand is
constant across the conditional to float precision but for the Gaussian factor the curvature
carries); within 0.022 nats of float64 quadrature at N = 200 and T in {1.5, 3, 10}, unflagged
(docs/reproductions.md, "A logit-normal Binomial", and
``test_a_local_narrower_than_the_float_spacing_at_its_mode_takes_its_laplace_value``).

**Gradients.** The node placement :math:`(m_n(u), R_n(u))` is computed under
``stop_gradient``: the value of :math:`\log\hat c_n(u)` is exact for the rule, and its
gradient omits the placement's derivative, which is zero where the rule is exact (the value
does not depend on the placement) and small where it is accurate. HMC stays exact with such
a gradient (the leapfrog map is volume preserving and reversible for any position-dependent
force; the Metropolis step uses the true value), and the Newton steps are never
differentiated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.scipy.special import logsumexp
from numpy.polynomial.hermite_e import hermegauss

from numpyro_tempering.joint_smc import (
    _Frame,
    _Joint,
    _joint,
    _joint_mode,
    _local_curvature,
)
from numpyro_tempering.tempered_smc import (
    SMCRun,
    SMCSettings,
    _laplace,
    _smc,
    _solve_lower,
    _solve_upper,
    _Target,
    extra_starts,
    map_runs,
    prior_check_at,
    rays_beyond,
    run_size,
)

__all__ = [
    "MAX_DIM",
    "QUAD_TOLERANCE",
    "build_quadrature_runner",
    "local_dim",
    "nodes_per_dim",
    "quadrature_flags",
]

#: largest local dimension d (unconstrained coordinates per element) served by quadrature;
#: larger d runs the joint SMC over globals and locals (numpyro_tempering.joint_smc). The
#: code takes any d (a tensor grid), but d = 2 was measured too slow: a normal and a Gamma
#: local per element at N = 500 took 240 s a call with 8 x 8 nodes and erred by 0.4-0.5
#: nats (measured, flagged); the 16 x 16 nodes it needs cost 4x more
MAX_DIM = 1
#: Gauss-Hermite nodes per dimension, by d. d = 1: 20 nodes; a Gamma(3) local scale
#: (log-space integrand e^{a v - e^v}) errs by 2e-5 (16 nodes), 4e-6 (20), 1e-6 (24) nats
#: per element: 20 keeps N = 500 at 2e-3 nats for 60% of the cost of 32 nodes
NODES = {1: 20, 2: 16}
#: the quadrature check recomputes the sum of log c_n with this many times the nodes per dim
CHECK_FACTOR = 2
#: flag a temperature whose measured quadrature error of log C exceeds this (nats)
QUAD_TOLERANCE = 0.02
#: the check's wide rule (d = 1): a trapezoid in t on the nodes e = sinh(t), |t| <= WIDE_REACH
#: (sinh 7.5 ~ 900 conditional standard deviations from the placement) in steps of
#: WIDE_STEP (121 nodes): nodes a tenth of a standard deviation apart at the mode, and a
#: mode D standard deviations away seen with nodes about D / 8 apart
WIDE_REACH, WIDE_STEP = 7.5, 0.125
#: at most this many per-element Newton steps from the linear predictor to the conditional
#: mode, at every u (measured on the Poisson funnel at T = 10, whose joint mode's predictor
#: is the funnel's neck: 3 steps reach the mode wherever u carries mass, e^1 <= s <= e^2.25;
#: a Gaussian conditional takes 1). Under vmap every particle pays for the slowest, and
#: each step costs about 40% of the 20-node rule (a gradient, a curvature and the
#: fractions' log densities)
LOCAL_NEWTON_STEPS = 3
#: ... stopping once every element's Newton decrement sqrt(g^T H^-1 g) (its distance to the
#: mode in conditional standard deviations, to second order) is below this
LOCAL_TOLERANCE = 1e-2
#: ... each step taking the largest of these fractions of itself that raises the element's
#: log density (1/32: a start where the log density is nearly flat, whose Newton step is
#: many conditional widths long, still moves towards the mode)
LOCAL_FRACTIONS = (1.0, 0.5, 0.125, 1 / 32)
#: an element whose rule's nodes land, in float, further than this share of their offset
#: from where they were meant (offsets below the float spacing at the conditional mode) is
#: integrated by its Laplace value (:func:`_log_c_rules`); an offset off by a share r moves a
#: Gauss-Hermite node's Gaussian correction x^2/2 by about r x^2
NODE_RESOLUTION = 1e-3


def quadrature_flags(error: np.typing.ArrayLike) -> np.ndarray:
    """Temperatures whose measured quadrature error is NaN or exceeds ``QUAD_TOLERANCE``."""
    return ~(np.abs(np.asarray(error)) <= QUAD_TOLERANCE)


def nodes_per_dim(dim: int) -> int:
    """Gauss-Hermite nodes per dimension for a local dimension ``dim`` (<= ``MAX_DIM``)."""
    return NODES[dim]


def _rule(q: int, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tensor-grid probabilists' Gauss-Hermite rule: nodes ``(q^d, d)``, the log of the
    weights normalised to sum 1 minus ``log N(e; 0, I)`` at the nodes (so that
    ``sum_j exp(corr_j) f(e_j) N(e_j)`` integrates ``f N`` and ``sum_j exp(corr_j) g(e_j)``
    integrates ``g``), and the log of the normalised weights."""
    x, w = hermegauss(q)
    w = w / w.sum()
    grid = np.stack(np.meshgrid(*([x] * dim), indexing="ij"), -1).reshape(-1, dim)
    log_w = np.sum(np.log(np.stack(np.meshgrid(*([w] * dim), indexing="ij"), -1)
                          .reshape(-1, dim)), -1)
    log_n = -0.5 * np.sum(grid**2, -1) - 0.5 * dim * math.log(2 * math.pi)
    return grid, log_w - log_n, log_w


class _Placement(NamedTuple):
    mode: jax.Array  # (N, d) conditional mode of the locals given u
    low: jax.Array  # (N, d, d) Cholesky factor R_n of the conditional curvature


def _wide_rule() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The check's wide rule for d = 1 in :func:`_rule`'s format: the trapezoid rule in t of
    :math:`\\int g(e)\\,de = \\int g(\\sinh t)\\cosh t\\,dt` (``WIDE_REACH``, ``WIDE_STEP``),
    exponentially accurate for a smooth integrand whose mass lies within the reach."""
    t = np.arange(-WIDE_REACH, WIDE_REACH + WIDE_STEP / 2, WIDE_STEP)
    grid = np.sinh(t)[:, None]
    corr = np.log(WIDE_STEP * np.cosh(t))
    log_w = corr - 0.5 * grid[:, 0] ** 2
    return grid, corr, log_w - np.logaddexp.reduce(log_w)


def _placement(joint: _Joint, frame: _Frame, u: jax.Array, t: jax.Array,
               steps: int | None = None) -> _Placement:
    """The conditional modes of the locals given ``u`` and the Cholesky factors of the
    curvature there, by per-element damped Newton steps from the joint mode's linear
    predictor (the elements are independent given the globals) until every element's
    Newton decrement is below ``LOCAL_TOLERANCE`` with a positive definite curvature, or
    ``steps`` (default ``LOCAL_NEWTON_STEPS``) steps. Each element takes the largest of
    ``LOCAL_FRACTIONS`` of its step that raises its own log density, or stays; where its
    curvature is not positive definite the step and the factor use the shifted curvature of
    :func:`~numpyro_tempering.joint_smc._local_curvature` (not the joint mode's factor: on a
    funnel that belongs to another scale of the locals)."""
    steps = LOCAL_NEWTON_STEPS if steps is None else steps
    v0 = frame.v + jnp.einsum("nda,a->nd", frame.coupling, u - frame.u)

    def el(w: jax.Array) -> jax.Array:
        value = joint.log_density(u, w, t)[1]
        return jnp.where(jnp.isnan(value), -jnp.inf, value)

    def local(w: jax.Array) -> tuple:
        g, low, ok = _local_curvature(joint, t, u, w)
        half = jax.vmap(_solve_lower)(low, g)  # R^{-1} g: |.|^2 is the Newton decrement
        near = ok & (jnp.sum(half**2, -1) <= LOCAL_TOLERANCE**2)  # nan: not near
        return half, low, ~jnp.all(near)

    def cond(carry: tuple) -> jax.Array:
        *_, pending, i = carry
        return pending & (i < steps)

    def body(carry: tuple) -> tuple:
        w, f, half, low, _, i = carry
        # not capped (unlike the polish from prior draws): from the joint mode's predictor a
        # long step is a real one (the funnel at s = e^2: 24.6 to the conditional mode)
        dv = jax.vmap(lambda r, a: _solve_upper(r.T, a))(low, half)  # H^{-1} g
        dv = jnp.where(jnp.isfinite(dv), dv, 0.0)
        fracs = jnp.asarray(LOCAL_FRACTIONS, w.dtype)[:, None, None]
        cands = w + fracs * dv  # (F, N, d): one vectorised evaluation of every fraction
        f_c = jax.vmap(el)(cands)  # (F, N)
        better = jnp.isfinite(f_c) & (f_c > f)
        first = jnp.argmax(better, 0)  # the largest fraction that raises the log density
        take = jnp.any(better, 0) & (i >= 0)  # pass -1 only evaluates (see below)
        pick = jnp.take_along_axis(cands, first[None, :, None], 0)[0]
        new_w = jnp.where(take[:, None], pick, w)
        new_f = jnp.where(take, jnp.take_along_axis(f_c, first[None], 0)[0], f)
        new_f = jnp.where(i >= 0, new_f, f_c[0])  # pass -1: the log density at the start
        return (new_w, new_f, *local(new_w), i + 1)

    # pass -1 takes no step (its step is 0: every candidate is the start) and only
    # evaluates the log density, score and curvature at the start, so that they are traced
    # (and compiled) once, inside the loop, not also before it
    n, d = v0.shape
    carry = (v0, jnp.full((n,), -jnp.inf, v0.dtype), jnp.zeros((n, d), v0.dtype),
             jnp.broadcast_to(jnp.eye(d, dtype=v0.dtype), (n, d, d)), jnp.ones((), bool),
             -jnp.ones((), jnp.int32))
    v, _, _, low, _, _ = jax.lax.while_loop(cond, body, carry)
    return _Placement(v, low)


def _log_c(joint: _Joint, place: _Placement, u: jax.Array, t: jax.Array,
           rule: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple:
    """:func:`_log_c_rules` of one rule."""
    return _log_c_rules(joint, place, u, t, (rule,))[0]


def _log_c_rules(joint: _Joint, place: _Placement, u: jax.Array, t: jax.Array,
                 rules: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]) -> list[tuple]:
    """Per rule: the per-element ``log c-hat_n`` ``(N,)`` by the rule at the placement, the
    rest of L_T (the sites outside the plate, which do not depend on the locals), and per
    element the share of the rule's normalised weights at nodes where the log density is
    NaN or ``+inf`` (counted as zero in ``log c-hat_n``: e.g. a log link's ``exp`` beyond
    float32's range, which is NaN, or ``+inf`` where XLA simplifies ``log(exp(v))`` to ``v``
    in the prior of a LogNormal local ``s`` but not in a likelihood scale ``s / sqrt(tau)``
    that overflowed; the quadrature check counts them as the rule's Gaussian would). The log density
    is evaluated once, at all the rules' nodes together: each evaluation site is a copy of
    the model's likelihood in the compiled program (a series normaliser inlined once per
    site dominated the compilation of a Poisson log-link model)."""
    d = place.mode.shape[1]
    # the rules' nodes, then the mode itself (e = 0: the Laplace value, see below)
    grid = jnp.asarray(np.concatenate([rule[0] for rule in rules] + [np.zeros((1, d))]),
                       u.dtype)
    log_det = jnp.sum(jnp.log(jnp.diagonal(place.low, axis1=1, axis2=2)), -1)  # (N,)

    def at(e: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        shift = jax.vmap(lambda r: _solve_upper(r.T, e))(place.low)  # (N, d)
        v = place.mode + shift
        _, el, rest = joint.log_density(u, v, t)
        # how far the node the log density saw, v - mode in float, is from the one meant
        off = jnp.max(jnp.abs((v - place.mode) - shift), -1) / jnp.max(jnp.abs(shift), -1)
        return el, rest, jnp.where(jnp.any(shift != 0, -1), off, 0.0)

    el_all, rest, off = jax.vmap(at)(grid)  # (J, N), (J,), (J, N)
    # an element whose conditional is narrower than the float spacing at its mode (a funnel's
    # neck: a scale s ~ e^-30 about a location 5, in float32) sees its nodes rounded onto a
    # few points: the rule then sums e^(x^2/2) w_x for a flat integrand, nats too high per
    # element (+2.4 on a logit-normal Binomial, measured), and every rule alike, so that the
    # check cannot see it. Its integrand is then constant across its conditional to float
    # precision but for its Gaussian factor, which the Laplace value integrates exactly
    unresolved = jnp.max(off[: len(rules[0][0])], 0) > NODE_RESOLUTION  # (N,)
    laplace = el_all[-1] + 0.5 * d * math.log(2 * math.pi) - log_det
    out, start = [], 0
    for nodes, corr, log_w in rules:
        el = el_all[start:start + len(nodes)]
        start += len(nodes)
        bad = jnp.isnan(el) | (el == jnp.inf)
        lost = logsumexp(jnp.where(bad, jnp.asarray(log_w, u.dtype)[:, None], -jnp.inf), 0)
        el = jnp.where(bad, -jnp.inf, el)
        log_c = logsumexp(el + jnp.asarray(corr, u.dtype)[:, None], axis=0) - log_det
        log_c = jnp.where(unresolved, laplace, log_c)
        out.append((log_c, rest[0], jnp.where(unresolved, 0.0, jnp.exp(lost))))
    return out


def _quad_target(joint: _Joint, frame: _Frame, temperature: jax.Array, q: int) -> tuple:
    """The SMC target over ``u`` (``_Target``: the globals' prior and ``sum_n log c-hat_n``)
    and the quadrature check ``u -> sum_n log c-hat_n(2q nodes) - sum_n log c-hat_n(q)``
    (``check(u, True)``: also the per-element ``log c-hat_n(q)`` and the rest of L_T, the
    target's pieces, so that the SMC's final outputs are taken from the check, not
    evaluated again)."""
    d = frame.v.shape[1]
    rule, fine = _rule(q, d), _rule(CHECK_FACTOR * q, d)
    wide = _wide_rule() if d == 1 else None

    def init(key: jax.Array) -> jax.Array:
        return joint.init(key)[0]

    def log_prior(u: jax.Array) -> jax.Array:
        return joint.log_density(u, frame.v, temperature)[0]

    def place(u: jax.Array, t: jax.Array) -> _Placement:
        return jax.tree.map(jax.lax.stop_gradient,
                            _placement(joint, frame, jax.lax.stop_gradient(u), t))

    def pieces(u: jax.Array, t: jax.Array) -> tuple:
        el, rest, _ = _log_c(joint, place(u, t), u, t, rule)
        return jnp.sum(el) + rest, el, rest

    def check(u: jax.Array, elements: bool = False) -> jax.Array | tuple:
        rules = (rule, fine) if wide is None else (rule, fine, wide)
        (coarse, rest, _), (finer, _, lost), *beyond = _log_c_rules(
            joint, place(u, temperature), u, temperature, rules)
        # the fine rule's nodes where the log density is NaN (counted as zero) are counted
        # as the rule's Gaussian weighs them: log c_n is then higher by -log(1 - lost_n)
        best = finer - jnp.log1p(-lost)
        if beyond:  # mass beyond both rules' reach (another mode): the wide rule
            best = jnp.maximum(best, beyond[0][0])
        value = jnp.sum(best) - jnp.sum(coarse)
        return (value, coarse, rest) if elements else value

    return _Target(init, log_prior, pieces), check


def build_quadrature_runner(
    marked: Callable, args: tuple, kwargs: dict, plate: str, fallback: object,
    global_names: tuple[str, ...], settings: SMCSettings, per_element: bool,
) -> Callable:
    """``(key, temperatures) -> SMCRun`` (with ``quad_error`` ``(R, M)``): quadrature over
    the locals, SMC over the globals, every temperature and R replicates vectorised (the
    interface of :func:`~numpyro_tempering.tempered_smc.build_runner`)."""

    def run(key: jax.Array, temps: jax.Array) -> SMCRun:
        key_fixed, key_runs = random.split(key)
        joint = _joint(marked, args, kwargs, plate, fallback, global_names, key_fixed)
        key_starts, key_prior = random.split(random.fold_in(key_fixed, 1))
        starts = jax.vmap(joint.init)(random.split(key_starts, settings.num_starts))
        d = starts[1].shape[-1]
        q = nodes_per_dim(d)

        def frames_at(t: jax.Array) -> _Frame:
            return jax.vmap(lambda u, v: _joint_mode(joint, t, u, v, polish=True))(*starts)

        frames = jax.lax.map(frames_at, temps)  # fields (M, K, ...)

        def best(frame: _Frame) -> _Frame:
            k = jnp.argmax(frame.log_evidence)
            return jax.tree.map(lambda a: a[k], frame)

        draws = jax.vmap(lambda k: joint.init(k)[0])(
            random.split(random.fold_in(key_starts, 1), 256))

        def reference(t: jax.Array, frame: _Frame) -> tuple:
            # Laplace components of the marginal target over u (Newton on log p(u) + sum_n
            # log c-hat_n from each joint mode's u): the joint modes' Schur precisions are
            # degenerate where the joint mode is (a funnel: the scale of the locals -> 0);
            # and from the grid's or the rays' starts, as over the globals alone
            target, _ = _quad_target(joint, best(frame), t, q)
            both = jnp.concatenate([frame.u, extra_starts(target, t, frame.u, draws)])
            return jax.vmap(lambda u: _laplace(target, t, u))(both)

        refs = jax.lax.map(lambda a: reference(*a), (temps, frames))  # (M, K, d_g[, d_g])

        def one(k: jax.Array, t: jax.Array, frame: _Frame, ref: tuple) -> tuple:
            target, check = _quad_target(joint, best(frame), t, q)
            return _smc(target, settings, k, t, ref, per_element,
                        final=lambda u: check(u, True), top=True)

        keys = random.split(key_runs, settings.num_replicates)
        first = _quad_target(joint, best(jax.tree.map(lambda a: a[0], frames)), temps[0], q)[0]
        size = run_size(first, temps[0], key_fixed, settings.num_particles)
        *out, quad, top = map_runs(lambda k, t, fr: one(k, t, *fr), keys, temps,
                                   (frames, refs), size)
        prior_draws = jax.vmap(lambda k: joint.init(k)[0])(
            random.split(key_prior, settings.num_prior_draws))

        def prior_check(t: jax.Array, frame: _Frame) -> tuple:
            target, _ = _quad_target(joint, best(frame), t, q)
            return prior_check_at(target, t, prior_draws, batch_size=64)

        prior_log_c, prior_ess, grows, ray_max = jax.lax.map(lambda a: prior_check(*a),
                                                             (temps, frames))
        return SMCRun(*out, prior_log_c, prior_ess, quad_error=quad, tail_grows=grows,
                      ray_beyond=rays_beyond(ray_max, top, prior_draws.shape[-1]))

    return run


def local_dim(marked: Callable, args: tuple, kwargs: dict, plate: str,
              global_names: tuple[str, ...]) -> int:
    """d, the locals' unconstrained coordinates per element (the model must be one that
    :func:`~numpyro_tempering.joint_smc.unsupported` accepts)."""
    from numpyro_tempering.joint_smc import _layout
    from numpyro_tempering.structure import structure_trace

    layout = _layout(structure_trace(marked, args, kwargs), plate, global_names)
    assert not isinstance(layout, str), layout
    return layout.dim
