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
  (p\, e^{L_T})^{\lambda}`, :math:`\lambda: 0 \to 1`, from a **mixture reference**
  :math:`q = \alpha\, p + \frac{1-\alpha}{K}\sum_k \mathcal N(m_k, \Sigma_k)`: the prior
  with weight ``prior_weight`` (:math:`\alpha = 0.1`) and K (``num_starts`` = 8) Laplace
  approximations of the tilted target (the weights rounded to whole particles: each
  component gets exactly its share of the particles, a stratified draw from q, so that how
  many particles a far mode's component gets is not random), each from damped Newton
  steps started at its own prior draw (covariance the inverse Hessian inflated by
  ``REFERENCE_INFLATION**2``; the unit matrix if the curvature is not positive definite).
  One Laplace start sees one mode (issue 20: log C too low by log 2 on two equal modes,
  with a standard error of 0.01); K starts put particles in every mode whose basin a
  prior draw falls in, the prior component covers the rest, and the incremental weights
  give each mode its mass. With one global coordinate, ``GRID_STARTS`` more Newton runs
  start from the largest local maxima of the tilted target on a grid of ``GRID_POINTS`` over
  the prior's centre :math:`\pm` ``GRID_REACH`` prior sds (fine at the centre, coarser with
  the distance): a narrow mode whose basin no prior draw reaches (width 0.1 at 5 prior sds,
  dominant at N = 500) was missed by 47-97 nats with a standard error of 0.05 and no flag,
  and so was the minority component of a mixture prior 27 of its sds away (weight 0.001,
  which 36% of the keys' 1024 prior draws never visit: 60-126 nats low) while the grid
  reached 8 sds. With several global coordinates, ``RAY_STARTS`` Newton runs start from the
  points of the tail check's rays (:func:`_rays`) where the tilted target is largest, when
  it is larger there than at every prior start (that minority component, as one coordinate
  of two: 60-126 nats low, unflagged, for the same keys). One more Newton run starts at the
  origin of the unconstrained space, where a linear predictor is 0 (:func:`extra_starts`: a
  logistic regression on unscaled covariates has its whole log C in a spike there). Each
  stage picks the next :math:`\lambda` so that the incremental weights keep an ESS of
  ``target_ess`` of the particles, resamples (systematic), and moves the particles with
  ``num_mcmc_steps`` HMC steps targeting the current stage. The product of the stages' mean
  incremental weights is an unbiased estimate of :math:`\int q\, (p e^{L_T} / q) = C(T)`.
  Starting from the Laplace components and not from the prior alone
  (``SMCSettings(reference="prior")``) matters: at realistic N the tilted target sits far in
  the prior's tail (a shift of :math:`N(1 - 1/T) v^2` in the log-scale of a log-normal prior
  of sd :math:`v`: 90 prior sds in the tests), and the number of stages of a path from the
  prior grows with that distance (200 stages were not enough at N = 2000, 540 prior sds),
  while from :math:`q` one to a few stages suffice.
* **Missed mass is checked** (:func:`missed_mass`): the mean of :math:`e^{L_T}` over
  ``num_prior_draws`` prior draws is unbiased for :math:`C(T)` (its log biased low); an SMC
  estimate clearly below it has missed a mode, and is flagged.
* **Bounded**: at most ``max_stages`` stages (a run stopped there gives NaN and is
  flagged), ``NEWTON_STEPS`` Newton steps, and blackjax's bisection for the next
  :math:`\lambda` (100 halvings). No LAPACK: the linear algebra is plain ``jax.numpy``
  (:func:`_cholesky`), because XLA's CPU LAPACK kernels deadlocked the vectorised loop.
* **On NumPyro's unconstrained space**: each global is mapped by
  ``biject_to(support)`` (``numpyro.infer.util``'s ``_unconstrain_reparam``, which also adds
  the log-Jacobian to the prior), so HMC needs no boundaries.
* **Gradient-based moves that mix every global**: HMC (``num_integration_steps`` leapfrog
  steps) with a diagonal inverse mass matrix set at each stage to the weighted variance of
  the particle cloud (capped by the widest Laplace component's variances: the cloud's
  variance spans the gaps between modes), and a step size adapted between stages from the
  previous stage's acceptance rate (target 0.65). A global that the tempered factor barely
  touches keeps its prior-scale variance in the mass matrix, so it still moves.
* **Vectorised** over the temperatures and over ``R`` independent replicates (``vmap``)
  while their particles' arrays stay small, in groups run one after the other beyond that
  (:func:`map_runs`), compiled once per model, selection and shapes and cached
  (``_CACHE``).

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
import warnings
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
    "depends_on_globals",
    "extra_starts",
    "flag_smc",
    "kish",
    "missed_mass",
    "prior_check_at",
    "rays_beyond",
    "replicate_covariance",
    "t_factor",
]

#: flag a temperature whose replicates' log C-hat have a standard deviation above this (nats):
#: beyond it the replicates disagree and their delta-method standard error is meaningless
MAX_REPLICATE_SD = 1.0
#: ... or whose final-stage HMC moves accept less than this fraction (particles stuck)
MIN_ACCEPTANCE = 0.05
#: ... or that was estimated with fewer particles than this (too few to trust the ESS solve)
MIN_PARTICLES = 32
#: missed-mass check: the prior draws' ESS needed to trust their standard error
MIN_PRIOR_ESS = 20.0
#: the Laplace reference's covariance is the inverse Hessian times this squared
REFERENCE_INFLATION = 1.5
#: one global coordinate: Newton runs also start from the GRID_STARTS largest local maxima
#: of log p(u) + L_T(u) (those within GRID_START_DROP nats of the largest) on GRID_POINTS
#: points over the prior draws' median +- GRID_REACH of their robust sds (as far as the tail
#: check's rays), spaced GRID_CENTRE_STEP sd at the centre and growing with the distance
#: (a sinh map: 0.04 sd at 5 sds, 0.15 sd at 30 sds; a bump of width 0.1 sd at 5 sds is
#: seen by two to three points)
GRID_STARTS = 4
GRID_START_DROP = 30.0
GRID_POINTS = 2049
#: a +inf of the tilted density on the grid or the rays counts as a divergence only within
#: this many robust prior scales of the draws' median (prior mass beyond: below e^-800,
#: under float64's smallest number); further out it is dropped like a NaN: a closed form
#: overflows there first (a Gamma rate e^-87 in float32, rate / T a subnormal flushed to
#: 0, log Z = +inf; a covariance s^2 Sigma at s = e^45), and one such point made a finite
#: log C "+inf", unflagged (found by a probe)
DIVERGENCE_REACH = 40.0
GRID_REACH = 512.0
GRID_CENTRE_STEP = 1.0 / 32.0
#: several global coordinates: Newton runs also start from the RAY_STARTS points of the
#: tail check's rays (each coordinate, both ways, out to 512 robust prior scales) where the
#: tilted target is largest, if it is larger there than at every prior start
RAY_STARTS = 2
#: points per doubling of the rays that the ray starts and the ray check look at (the tail
#: check reads the doublings alone): a component 20 prior sds out along an axis with a
#: width of 5% of its distance fell between two doublings (4.8 and 9.6 sds for one at 6 of
#: width 0.3) and was missed, unflagged; 4 per doubling put a point within 1.2 widths of it
RAY_DENSITY = 4
#: the ray check (:func:`rays_beyond`): a ray point whose log p + L_T exceeds the
#: largest at the particles by more than D/2 + RAY_MARGIN nats lies where no particle went
RAY_MARGIN = 5.0
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
        max_stages: cap on the SMC stages: a run that has not reached lambda = 1 after this
            many stages gives NaN, and the temperature is flagged with the lambda reached
            (``SMCRun.tempering_param``); this bounds the run time of every call.
        reference: ``"laplace"`` (the mixture reference of the module docstring) or
            ``"prior"`` (a path from the prior).
        num_starts: K, damped Newton runs from K prior draws, one Laplace component each.
        prior_weight: weight of the prior in the mixture reference (the rest is shared
            evenly by the K Laplace components).
        num_prior_draws: prior draws of the missed-mass check (:func:`missed_mass`).
    """

    num_particles: int = 256
    num_replicates: int = 4
    num_mcmc_steps: int = 4
    num_integration_steps: int = 4
    target_ess: float = 0.5
    max_stages: int = 100
    reference: str = "laplace"
    num_starts: int = 8
    prior_weight: float = 0.1
    num_prior_draws: int = 1024


class SMCRun(NamedTuple):
    """Raw per-replicate output, arrays of shape ``(R, M)`` (``element_mean``: ``(R, M, E)``)."""

    log_z: jax.Array
    ess: jax.Array  # final-stage ESS of the particle weights
    num_stages: jax.Array
    acceptance: jax.Array  # mean HMC acceptance rate of the last stage
    element_mean: jax.Array | None
    tempering_param: jax.Array  # lambda reached (1 unless the stage cap stopped the run)
    prior_log_c: jax.Array  # (M,): log of the mean of e^{L_T} over prior draws
    prior_ess: jax.Array  # (M,): Kish ESS of those draws' weights
    quad_error: jax.Array | None = None  # (R, M): measured quadrature error of log C-hat
    tail_grows: jax.Array | None = None  # (M,): the integrand still grows far out (tail_grows)
    ray_beyond: jax.Array | None = None  # (M,): a ray point beats every particle (rays_beyond)


def flag_smc(
    ess: Any,
    num_particles: int,
    replicate_log_c: Any,
    acceptance: Any,
    num_nonfinite: Any,
    exact: Any = None,
    missed: Any = None,
) -> np.ndarray:
    r"""Temperatures whose tempered-SMC log C cannot be trusted (boolean, per temperature).

    Flagged: any non-finite replicate (NaN, or a run that did not reach :math:`\lambda = 1`);
    fewer than ``MIN_PARTICLES`` particles; a final-stage ESS below
    ``min(10, P/2)``; a mean HMC acceptance rate of the last stage below ``MIN_ACCEPTANCE``
    (degenerate particles: resampled copies that never move apart); or replicates whose
    :math:`\log\hat C_r` spread (standard deviation) exceeds ``MAX_REPLICATE_SD`` nats; or
    marked ``missed`` (:func:`missed_mass`). Temperatures marked ``exact`` (T = 1, where
    log C = 0 after the per-site check) are never flagged.

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
    if missed is not None:
        flagged |= np.asarray(missed, bool)
    if exact is not None:
        flagged &= ~np.asarray(exact, bool)
    return flagged


def missed_mass(
    log_c: Any, stderr: Any, prior_log_c: Any, prior_ess: Any, num_prior_draws: int
) -> np.ndarray:
    r"""Temperatures where the SMC missed probability mass that prior draws see (boolean).

    The plain Monte Carlo average of :math:`e^{L_T}` over ``num_prior_draws`` prior draws
    is unbiased for :math:`C(T)` and its log is biased *low*; an SMC estimate well below it
    has missed mass -- a mode its reference never put particles in. Flagged where the
    prior-draw estimate exceeds ``log_c`` by more than three combined standard errors plus
    0.05 nats while the draws' Kish ESS is at least ``MIN_PRIOR_ESS`` (so that their delta
    standard error :math:`\sqrt{(S/\mathrm{ESS} - 1)/S}` means something), or by more than
    :math:`\log 1000` nats whatever the ESS (Markov's inequality: an unbiased positive
    estimate exceeds :math:`1000\,C` with probability below 0.001).

    Example:
        >>> missed_mass([5.0, 5.0], [0.01, 0.01], [5.69, 5.01], [500.0, 500.0], 1024).tolist()
        [True, False]
    """
    log_c = np.asarray(log_c, np.float64)
    se = np.asarray(stderr, np.float64)
    excess = np.asarray(prior_log_c, np.float64) - log_c
    ess = np.asarray(prior_ess, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        se_prior = np.sqrt(np.maximum(num_prior_draws / ess - 1.0, 0.0) / num_prior_draws)
        sure = (ess >= MIN_PRIOR_ESS) & (excess > 3.0 * np.hypot(se, se_prior) + 0.05)
        missed = sure | (excess > math.log(1000.0))
    return np.where(np.isfinite(log_c), missed, False)


#: Student-t 97.5% quantiles for 1..10 degrees of freedom (beyond: Cornish-Fisher)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t_factor(num_replicates: int) -> float:
    """``t_{0.975, R-1} / z_{0.975}``: the factor that makes ``estimate +- 2 stderr`` a 95%
    interval when the standard error is estimated from R replicates (4 replicates: 1.62;
    without it, 2 of the sample's standard errors cover ~86% at R = 4, measured 80-93%).

    Example:
        >>> round(t_factor(4), 3), round(t_factor(1000), 3)
        (1.623, 1.001)
    """
    nu, z = num_replicates - 1, 1.959964
    if nu < 1:
        return math.nan
    if nu <= len(_T975):
        return _T975[nu - 1] / z
    t = z + (z**3 + z) / (4 * nu) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
    return t / z


def combine(replicate_log_c: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""``log mean_r C_r``, its bias-aware standard error and the non-finite count, per
    temperature, from replicates ``(R, M)``; any non-finite replicate makes the estimate NaN.

    The standard error is :math:`t_R \max(s_\delta, s_{\log}) + s_\delta^2 / 2`, with
    :math:`t_R` = :func:`t_factor` (Student's t for a standard error from R values):
    :math:`s_\delta = \mathrm{sd}_r(\hat C_r) / (\sqrt R\, \overline{\hat C})` the delta
    method for the log of the mean; :math:`s_{\log} = \mathrm{sd}_r(\log \hat C_r)/\sqrt R`
    the spread of the replicates' logs, which -- unlike :math:`s_\delta`, at most
    :math:`\sqrt{(R-1)/R}` -- says so when the replicates disagree by several nats; and
    :math:`s_\delta^2/2` the delta-method bias of the log of a mean (Jensen: low by about
    that much), added, not corrected, because it is itself estimated from R values.

    Example:
        >>> log_c, se, bad = combine(jnp.array([[0.0, 0.0], [0.02, 6.0]]))
        >>> [round(float(v), 3) for v in se]  # agreeing; 6 nats apart (R = 2: t factor 6.5)
        [0.065, 19.943]
    """
    num = replicate_log_c.shape[0]
    bad = ~jnp.isfinite(replicate_log_c)
    log_c = logsumexp(replicate_log_c, axis=0) - math.log(num)
    top = jnp.max(jnp.where(bad, -jnp.inf, replicate_log_c), axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(replicate_log_c - top)
    mean = w.mean(0)
    if num > 1:
        se_delta = jnp.sqrt(jnp.sum((w - mean) ** 2, axis=0) / (num - 1) / num) / mean
        se_log = jnp.std(replicate_log_c, axis=0, ddof=1) / math.sqrt(num)
        stderr = t_factor(num) * jnp.maximum(se_delta, se_log) + 0.5 * se_delta**2
    else:
        stderr = jnp.full_like(mean, jnp.nan)
    nbad = bad.sum(0)
    log_c = jnp.where(nbad > 0, jnp.nan, log_c)
    stderr = jnp.where(nbad > 0, jnp.nan, stderr)
    return log_c, stderr, nbad


def replicate_covariance(replicate_log_c: Any) -> np.ndarray:
    r"""Delta-method covariance ``(M, M)`` of ``log mean_r C_r(T_m)`` across the rungs, from
    the replicates ``(R, M)``: :math:`\mathrm{Cov}_r(\hat C_r(T_i)/\bar C(T_i),
    \hat C_r(T_j)/\bar C(T_j)) / R`.

    The rungs share their random numbers (replicate r uses the same keys at every
    temperature, and the Laplace starts and prior draws are common), so their errors are
    positively correlated: differences of :math:`\log C` between rungs are more accurate
    than the standard errors suggest, and a sum over rungs less.

    Example:
        >>> cov = replicate_covariance([[0.0, 0.1], [0.2, 0.3], [-0.1, 0.0]])
        >>> bool(cov[0, 1] > 0.9 * np.sqrt(cov[0, 0] * cov[1, 1]))
        True
    """
    reps = np.asarray(replicate_log_c, np.float64)
    num = reps.shape[0]
    w = np.exp(reps - np.max(reps, axis=0))
    rel = w / w.mean(0)
    return np.cov(rel, rowvar=False, ddof=1).reshape(reps.shape[1], reps.shape[1]) / num


# -----------------------------------------------------------------------------------------
# The target: prior of the globals (unconstrained) and L_T from the registry
# -----------------------------------------------------------------------------------------


class _Target(NamedTuple):
    init: Callable  # key -> flat unconstrained globals (a prior draw)
    log_prior: Callable  # u -> log p(u) (with the log-Jacobian)
    pieces: Callable  # (u, T) -> (L_T(u), per-element log c_n (E,), the rest of L_T)


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
        log_p = global_log_prior(tr, global_names, u.dtype)
        return log_p, {name: tr[name]["value"] for name in global_names}

    def log_prior(u: jax.Array) -> jax.Array:
        return constrained(u)[0]

    def pieces(u: jax.Array, temperature: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        _, values = constrained(u)
        inner = _contributions(
            marked, temperature, fixed_key, {**plate_values, **values}, args, kwargs, plate,
            fallback,
        )
        elements = inner.multiplicity * inner.elements
        return jnp.sum(elements) + inner.rest, elements, inner.rest

    return _Target(init, log_prior, pieces)


def depends_on_globals(
    marked: Callable, args: tuple, kwargs: dict, plate: str | None, fallback: Any,
    global_names: tuple[str, ...], temperature: float,
) -> bool:
    """Whether the tempered likelihood's log normaliser :math:`L_T(u)` depends on the
    globals in its traced program (JAX's dead-code elimination of the jaxpr: exact, and
    blind to values). A normaliser that does not (a Normal likelihood's mean) makes log C
    the same at every prior draw, and exactly so; one that does can still look constant at
    a handful of prior draws (a logistic regression on unscaled covariates, see
    :func:`extra_starts`), so values alone do not decide. Without JAX's private
    ``dce_jaxpr`` every model is taken to depend on them (the SMC then runs)."""
    try:
        from jax._src.interpreters.partial_eval import dce_jaxpr
    except ImportError:  # pragma: no cover - a JAX without it: assume a dependence
        return True
    with warnings.catch_warnings():  # e.g. NumPyro's about enumerating discrete locals
        warnings.simplefilter("ignore")
        target = _build_target(marked, args, kwargs, plate, fallback, global_names,
                               random.PRNGKey(0))
        u = target.init(random.PRNGKey(0))
        closed = jax.make_jaxpr(lambda u, t: target.pieces(u, t)[0])(
            u, jnp.asarray(temperature, u.dtype))
    _, used = dce_jaxpr(closed.jaxpr, [True], instantiate=False)
    return bool(used[0])


#: the runs of one call (replicates x temperatures) are vectorised together while all their
#: particles' largest array (:func:`largest_array` times the particles) stays within this
#: many elements, and beyond it in groups of that size, one group after the other: a
#: vectorised group makes arrays of (runs x particles x elements) that leave the cache
#: (a logistic regression, N = 1,000, 12 runs of 256 particles: 35 s a call vectorised,
#: 11.7 s one run at a time, the same numbers; docs/reproductions.md)
RUN_BUDGET = 2**18


def largest_array(fn: Callable, *example: Any) -> int:
    """The number of elements of the largest array that ``fn(*example)`` computes: the
    equations of its jaxpr and of the jaxprs inside them (loops, conditionals, calls),
    traced, never run.

    Example:
        >>> import jax.numpy as jnp
        >>> largest_array(lambda x: jnp.sum(jnp.outer(x, x)), jnp.ones(5))
        25
    """
    from jax.extend.core import subjaxprs

    def walk(jaxpr: Any) -> int:
        sizes = [math.prod(getattr(v.aval, "shape", ())) for eqn in jaxpr.eqns
                 for v in eqn.outvars]
        return max([0, *sizes, *(walk(sub) for sub in subjaxprs(jaxpr))])

    return walk(jax.make_jaxpr(fn)(*example).jaxpr)


def run_size(target: _Target, temperature: jax.Array, key: jax.Array,
             num_particles: int) -> int:
    """The elements of one SMC run's largest array: ``num_particles`` times the largest
    array of one evaluation of the ``target``'s prior and pieces (:func:`largest_array`, at
    a prior draw)."""
    return num_particles * largest_array(
        lambda u: (target.log_prior(u), target.pieces(u, temperature)), target.init(key))


def runs_per_group(num_runs: int, size: int) -> int:
    """How many of ``num_runs`` SMC runs of ``size`` elements (:func:`run_size`) to vectorise
    together: as many as fit ``RUN_BUDGET`` (at least 1), a divisor of ``num_runs`` (no
    remainder: ``lax.map`` would compile a second copy of the run for it).

    Example:
        >>> RUN_BUDGET, runs_per_group(12, 256_000), runs_per_group(12, 30_000)
        (262144, 1, 6)
        >>> runs_per_group(12, 2_560)  # a small model: every run vectorised
        12
    """
    return max(d for d in range(1, num_runs + 1)
               if num_runs % d == 0 and (d == 1 or d * size <= RUN_BUDGET))


def map_grouped(fn: Callable, xs: Any, size: int) -> Any:
    """``fn`` over the leading axis of ``xs``, vectorised in groups of :func:`runs_per_group`
    runs of ``size`` elements each, the groups one after the other (``lax.map``)."""
    num = jax.tree.leaves(xs)[0].shape[0]
    group = runs_per_group(num, size)
    return jax.vmap(fn)(xs) if group == num else jax.lax.map(fn, xs, batch_size=group)


def map_runs(one: Callable, keys: jax.Array, temps: jax.Array, per_temp: Any,
             size: int) -> Any:
    """``one(key, t, x)`` for every replicate's key of ``keys`` (R,) and every temperature
    ``t`` of ``temps`` (M,) with its slice ``x`` of ``per_temp`` (leading axis M, or None):
    the outputs with leading axes (R, M), the R M runs of ``size`` elements each
    (:func:`run_size`) in groups (:func:`map_grouped`)."""
    num_reps, num_temps = keys.shape[0], temps.shape[0]

    def run(index: tuple) -> Any:
        r, m = index
        return one(keys[r], temps[m], jax.tree.map(lambda a: a[m], per_temp))

    index = (jnp.repeat(jnp.arange(num_reps), num_temps), jnp.tile(jnp.arange(num_temps), num_reps))
    out = map_grouped(run, index, size)
    return jax.tree.map(lambda a: a.reshape((num_reps, num_temps, *a.shape[1:])), out)


# -----------------------------------------------------------------------------------------
# One SMC run
# -----------------------------------------------------------------------------------------


def _cholesky(a: jax.Array) -> jax.Array:
    """Lower Cholesky factor of a symmetric ``(D, D)`` matrix, in plain ``jax.numpy``
    (NaN where not positive definite).

    Not ``jnp.linalg.cholesky``: XLA's CPU LAPACK kernels (``potrf``, ``trsm``, ``getrf``)
    split a batch over the intra-op thread pool and block a pool thread until the pieces are
    done (``ParallelBatchMap``); two such calls running at once inside the vectorised SMC
    loop can block every pool thread, and the computation never returns at 0% CPU (issue 20:
    a gdb backtrace of the stalled breast-cancer regression showed both ``tf_XLAEigen``
    threads in ``TriMatrixEquationSolver`` -> ``ParallelBatchMap`` ->
    ``BlockingCounter::Wait``). ``D`` is the number of globals, so a loop over columns is
    cheap.
    """
    dim = a.shape[-1]
    idx = jnp.arange(dim)

    def column(j: jax.Array, low: jax.Array) -> jax.Array:
        row = jnp.where(idx < j, low[j], 0.0)
        diag = jnp.sqrt(a[j, j] - jnp.sum(row**2))
        col = (a[:, j] - low @ row) / diag
        col = jnp.where(idx > j, col, jnp.where(idx == j, diag, 0.0))
        return low.at[:, j].set(col)

    return jax.lax.fori_loop(0, dim, column, jnp.zeros_like(a))


def _solve_lower(low: jax.Array, b: jax.Array) -> jax.Array:
    """``low^{-1} b`` by forward substitution (plain ``jax.numpy``; see :func:`_cholesky`)."""
    dim = low.shape[-1]

    def step(i: jax.Array, x: jax.Array) -> jax.Array:
        return x.at[i].set((b[i] - low[i] @ x) / low[i, i])

    return jax.lax.fori_loop(0, dim, step, jnp.zeros_like(b))


def _solve_upper(up: jax.Array, b: jax.Array) -> jax.Array:
    """``up^{-1} b`` by back substitution for an upper-triangular ``up``."""
    dim = up.shape[-1]

    def step(k: jax.Array, x: jax.Array) -> jax.Array:
        i = dim - 1 - k
        return x.at[i].set((b[i] - up[i] @ x) / up[i, i])

    return jax.lax.fori_loop(0, dim, step, jnp.zeros_like(b))


def _value_grad_hessian(fn: Callable, u: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``fn(u)``, its gradient and its Hessian in one traced pass (forward over reverse:
    the Hessian's columns are the tangents of the gradient, whose primal is the value and
    the gradient): one copy of ``fn`` for XLA to compile, not three."""
    eye = jnp.eye(u.shape[-1], dtype=u.dtype)
    (f, g), (_, h) = jax.vmap(lambda e: jax.jvp(jax.value_and_grad(fn), (u,), (e,)),
                              out_axes=((None, None), (0, 0)))(eye)
    return f, g, h.T


def _newton(
    target: _Target, temperature: jax.Array, start: jax.Array, steps: int = NEWTON_STEPS
) -> tuple[jax.Array, jax.Array]:
    """The mode of ``log p + L_T`` by ``steps`` damped Newton steps from ``start``
    (Levenberg-Marquardt: a step that does not decrease ``-(log p + L_T)``, or whose damped
    Hessian is not positive definite, is refused and the damping raised), and the Hessian of
    ``-(log p + L_T)`` there. One loop of ``steps + 1`` passes, each evaluating the value,
    gradient and Hessian at one point (:func:`_value_grad_hessian`): pass 0 at ``start``,
    pass ``k`` at the candidate of step ``k``, kept (with its gradient and Hessian) where
    the step is taken, so that the model's Hessian is compiled once. Only plain
    ``jax.numpy`` linear algebra (:func:`_cholesky`)."""

    def neg(u: jax.Array) -> jax.Array:
        value = -(target.log_prior(u) + target.pieces(u, temperature)[0])
        return jnp.where(jnp.isfinite(value), value, jnp.inf)

    eye = jnp.eye(start.shape[-1], dtype=start.dtype)

    def newton(i: jax.Array, carry: tuple) -> tuple:
        u, f, g, h, lam, cand = carry
        f_c, g_c, h_c = _value_grad_hessian(neg, cand)
        ok = jnp.isfinite(f_c) & (f_c <= f) & jnp.all(jnp.isfinite(cand))
        take = ok | (i == 0)  # pass 0 evaluates the start
        lam = jnp.where(i == 0, lam, jnp.where(ok, lam / 10, lam * 10))
        u, f = jnp.where(take, cand, u), jnp.where(take, f_c, f)
        g, h = jnp.where(take, g_c, g), jnp.where(take, 0.5 * (h_c + h_c.T), h)
        damp = lam * (jnp.mean(jnp.abs(jnp.diag(h))) + 1.0)
        low = _cholesky(h + damp * eye)
        return u, f, g, h, lam, u - _solve_upper(low.T, _solve_lower(low, g))

    lam0 = jnp.asarray(1e-3, start.dtype)
    carry = (start, jnp.asarray(jnp.inf, start.dtype), jnp.zeros_like(start), eye, lam0, start)
    mode, _, _, hess, _, _ = jax.lax.fori_loop(0, steps + 1, newton, carry)
    return mode, hess


def _precision_factor(hess: jax.Array, inflation: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Lower Cholesky factor ``R`` of ``hess / inflation**2`` and whether it is usable
    (finite, positive definite)."""
    prec = _cholesky(hess / inflation**2)
    ok = jnp.all(jnp.isfinite(prec)) & jnp.all(jnp.diag(prec) > 0)
    return prec, ok


def _laplace(
    target: _Target, temperature: jax.Array, start: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Mode and the Cholesky factor ``R`` of the *precision* of the Laplace reference.

    The mode of ``log p + L_T`` is found by ``NEWTON_STEPS`` damped Newton steps
    (:func:`_newton`) from a prior draw ``start``. The reference is
    ``N(mode, (R R^T)^{-1})`` with ``R R^T`` the Hessian at the mode divided by
    ``REFERENCE_INFLATION**2``. A non-finite or non-positive-definite curvature falls back
    to the unit matrix: the SMC then corrects the poor reference at the price of more
    stages.
    """
    mode, hess = _newton(target, temperature, start)
    prec, ok = _precision_factor(hess, REFERENCE_INFLATION)
    eye = jnp.eye(start.shape[-1], dtype=start.dtype)
    return mode, jnp.where(ok, prec, eye)


def mean_acceptance(rate: jax.Array) -> jax.Array:
    """The mean of the HMC acceptance rates over particles and steps, a NaN rate (a proposal
    whose energy is NaN: a divergence) counted as a rejection. One such particle used to make
    the mean NaN, read as 0: the step size shrank by e^-0.65 at every stage that met one and
    the run was flagged for acceptance 0 (a logit-normal Binomial, docs/reproductions.md)."""
    acc = jnp.mean(jnp.where(jnp.isnan(rate), 0.0, rate))
    return jnp.where(jnp.isfinite(acc), acc, 0.0)


def _smc(
    target: _Target, settings: SMCSettings, key: jax.Array, temperature: jax.Array,
    reference: tuple[jax.Array, jax.Array] | None, per_element: bool,
    final: Callable | None = None, top: bool = False,
) -> tuple:
    """One adaptive tempered SMC run at one temperature: (log C-hat, final ESS, stages,
    last acceptance, E_final[log c_n] or None, lambda reached), and with ``final``
    (``x -> (value, the target's per-element log c_n, the rest of L_T)``, evaluated 64
    particles at a time; its pieces stand in for the target's) also the weighted mean of its
    value over the final particles; with ``top`` also the largest ``log p + L_T`` at the
    final particles (for :func:`rays_beyond`)."""
    num = settings.num_particles
    key_init, key_loop = random.split(key)
    if reference is None:  # path from the prior
        particles = jax.vmap(target.init)(random.split(key_init, num))
        local_var = jnp.full(particles.shape[-1], jnp.inf, particles.dtype)

        def log_ref(u: jax.Array) -> jax.Array:
            return target.log_prior(u)

        def loglik(u: jax.Array) -> jax.Array:
            value = target.pieces(u, temperature)[0]
            return jnp.where(jnp.isnan(value), -jnp.inf, value)

    else:  # path from the mixture reference q: pi_lambda = q^(1 - lambda) (p e^L)^lambda
        # q = (n_0 p + sum_k n_k N(mode_k, (R_k R_k^T)^{-1})) / P; a Laplace draw is
        # u = mode_k + R_k^{-T} eps, and log N_k needs R_k^T (u - mode_k) only, a matrix
        # product (no triangular solve inside the loop; see _cholesky)
        # the Laplace components cover the first `dim` coordinates; any further coordinates
        # (the standardised locals of numpyro_tempering.joint_smc) are N(0, I) in every
        # component, and target.log_prior includes their N(0, I) density
        modes, precs = reference
        n_starts, dim = modes.shape
        # stratified: exactly n_k particles from component k and q's weights n_k / P, so
        # that the draw is one from q and the estimate unbiased, without the multinomial
        # noise of how many particles a component gets (with a far mode held by one of
        # eleven components, that count's noise alone was ~0.2 nats of log C)
        n_prior = num if settings.prior_weight >= 1 else round(settings.prior_weight * num)
        counts = np.bincount(np.arange(num - n_prior) % n_starts, minlength=n_starts)
        with np.errstate(divide="ignore"):
            log_w_comp = jnp.asarray(np.log(counts / num), modes.dtype)  # -inf: no particle
        comp = jnp.asarray(np.concatenate([np.zeros(n_prior, int),
                                           np.arange(num - n_prior) % n_starts]))
        key_eps, key_prior, key_extra = random.split(key_init, 3)
        eps = random.normal(key_eps, (num, dim), modes.dtype)
        laplace = jax.vmap(lambda c, e: modes[c] + _solve_upper(precs[c].T, e))(comp, eps)
        from_prior = jnp.arange(num) < n_prior
        prior_draws = jax.vmap(target.init)(random.split(key_prior, num))
        num_extra = prior_draws.shape[-1] - dim
        ref_dim = dim  # (`dim` is rebound to the particles' dimension below)
        if num_extra:
            extra = random.normal(key_extra, (num, num_extra), modes.dtype)
            laplace = jnp.concatenate([laplace, extra], axis=-1)
        particles = jnp.where(from_prior[:, None], prior_draws, laplace)
        log_dets = jnp.sum(jnp.log(jax.vmap(jnp.diag)(precs)), -1)  # (K,)
        log_2pi = 0.5 * dim * math.log(2 * math.pi)
        dtype = modes.dtype
        # a bound on the HMC inverse mass matrix: the widest Laplace component's variances
        # (the particle cloud's variance spans the gaps between modes: too wide to move in)
        eye = jnp.eye(dim, dtype=modes.dtype)
        inv = jax.vmap(lambda r: jax.vmap(lambda e: _solve_lower(r, e))(eye))(precs)
        local_var = jnp.max(jnp.sum(inv**2, axis=-1), axis=0) / REFERENCE_INFLATION**2
        local_var = jnp.where(jnp.isfinite(local_var), local_var, jnp.inf)
        if num_extra:
            local_var = jnp.concatenate([local_var, jnp.full(num_extra, jnp.inf, dtype=dtype)])

        def log_ref(u: jax.Array) -> jax.Array:
            z = jnp.einsum("kd,kde->ke", u[:ref_dim] - modes, precs)
            log_n = -0.5 * jnp.sum(z**2, -1) + log_dets - log_2pi + log_w_comp
            if num_extra:
                log_n = log_n - 0.5 * jnp.sum(u[ref_dim:] ** 2) - 0.5 * num_extra * math.log(
                    2 * math.pi
                )
            if n_prior > 0:
                log_n = jnp.append(log_n, math.log(n_prior / num) + target.log_prior(u))
            return logsumexp(log_n)

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
        var = jnp.where(jnp.isfinite(var) & (var > 1e-12), jnp.minimum(var, local_var), 1.0)
        params = {"step_size": step[None], "inverse_mass_matrix": var[None]}
        new, info = kernel(sub, state, settings.num_mcmc_steps, params)
        acc = mean_acceptance(info.update_info.acceptance_rate)
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
    if final is not None:  # its per-element values are the target's (one evaluation)
        values, element, rest = jax.lax.map(final, state.particles, batch_size=64)
        if top:
            log_p = jax.vmap(target.log_prior)(state.particles)
            total = jnp.sum(element, -1) + rest
    elif per_element or top:  # one evaluation of the target for both
        log_p, (total, element, _) = jax.vmap(
            lambda u: (target.log_prior(u), target.pieces(u, temperature)))(state.particles)
    # particles of weight 0 (a NaN or -inf target: e.g. a global scale drawn at e^-209,
    # 0 in float32) carry nothing, and their NaN values must not reach the weighted means
    live = state.weights > 0
    if per_element:
        element = jnp.sum(jnp.where(live[:, None], state.weights[:, None] * element, 0.0), 0)
    else:
        element = None
    out = (log_z, ess, stages, acc, element, state.tempering_param)
    if final is not None:
        out = (*out, jnp.sum(jnp.where(live, state.weights * values, 0.0)))
    if top:
        f = log_p + total
        out = (*out, jnp.max(jnp.where(jnp.isnan(f), -jnp.inf, f)))
    return out


#: the tail check walks each global coordinate out to 2^(TAIL_DOUBLINGS - 1) robust prior
#: scales from the prior draws' median, doubling the distance
TAIL_DOUBLINGS = 10
#: :func:`tail_grows`: a ray's outer slope must be at least this fraction of its inner one
#: (1 for growth linear in the distance, more for faster growth; a normal prior's peak
#: ahead makes it fall towards 0 and then negative)
TAIL_SLOPE_RATIO = 0.9
#: :func:`tail_grows`'s codes: the integrand grows without slowing (log C most likely +inf);
#: it rises up to where it stops being finite (mass out of reach)
GROWS, RISES_UNSEEN = 1, 2


def _robust_centre_scale(draws: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per coordinate of ``draws`` (S, D): the median and the interquartile range / 1.349 (the
    sd of a normal prior, robust to a heavy-tailed one: a Cauchy prior's sample sd would be
    set by its largest draws), 1 where that is 0 or not finite."""
    q1, centre, q3 = jnp.percentile(draws, jnp.array([25.0, 50.0, 75.0]), axis=0)
    scale = (q3 - q1) / 1.349
    return centre, jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 1.0)


def _rays(draws: jax.Array, density: int = 1) -> jax.Array:
    """(2 D TAIL_DOUBLINGS density, D): points on the rays from the prior draws' median along
    each coordinate, both ways, at 1, 2, 4, ... robust prior scales
    (:func:`_robust_centre_scale`), with ``density`` points per doubling (``2^(j /
    density)``: every ``density``-th point is one of the doublings), the distance growing
    fastest along the last axis."""
    centre, scale = _robust_centre_scale(draws)
    dim = draws.shape[-1]
    steps = 2.0 ** (jnp.arange(TAIL_DOUBLINGS * density, dtype=draws.dtype) / density)
    signs = jnp.array([-1.0, 1.0], draws.dtype)
    offsets = (signs[:, None, None, None] * jnp.eye(dim, dtype=draws.dtype)[None, :, None, :]
               * steps[None, None, :, None] * scale)  # (2, D, K, D)
    return (centre + offsets).reshape(-1, dim)


def tail_grows(values: jax.Array) -> jax.Array:
    r"""Whether the log integrand :math:`\log p(u) + L_T(u)` on the rays of :func:`_rays`
    (``values``, ``(2 D TAIL_DOUBLINGS,)``) fails to decay along some ray, as a code:
    ``GROWS`` (1) where it is increasing over the ray's three farthest finite points and
    not slowing down there, ``RISES_UNSEEN`` (2) where it rises but slows, up to points past
    which it is not finite, else 0. (NaN and infinities are skipped: the farthest points can
    overflow a constraining transform or the model's own arithmetic, e.g. :math:`e^{-164}`
    is 0 in float32.)

    A proper prior decays far out, so only the tempered likelihood's normalisers can make
    the integrand grow: :math:`\log C(T) = +\infty` (e.g. a Gamma(10, 10) precision under
    50 normal points at T >= 1.7, where :math:`\prod_n Z_n \propto \tau^{-N(1 - 1/T)/2}`
    outgrows :math:`\tau^{9}` at 0, a growth linear in :math:`u = \log\tau`), which no
    finite sample of particles shows. A divergence's slope does not fall along the ray
    (linear in ``u``: constant; faster: rising), so ``GROWS`` asks the slope between the two
    farthest points to be at least ``TAIL_SLOPE_RATIO`` of the slope between the next two
    (distances ``2^k`` robust prior scales).

    A normal prior under normalisers that grow linearly in a coefficient,
    :math:`-u^2/2 + c u`, rises until :math:`u = c` and then falls: its integral is finite
    and its slope falls. Where the ray's farthest points are finite, it is then seen to
    fall; where the model stops being finite first (a Poisson log-link regression at T = 5
    peaks 21 prior sds out, where its rates overflow float32 past 17 sds) the peak and its
    mass are out of reach in this dtype: ``RISES_UNSEEN``, not a divergence. Still misread:
    a peak more than about ``16 x`` out seen only from finite points at ``x, 2x, 4x`` (as a
    divergence), and a growth logarithmic in the distance with every point finite (slope
    ratio 1/2, as finite).

    Example:
        >>> import jax.numpy as jnp
        >>> u = 2.0 ** jnp.arange(TAIL_DOUBLINGS)  # the rays' distances
        >>> up = jnp.tile(3 * u, 2)  # linear growth
        >>> int(tail_grows(up)), int(tail_grows(-up)), int(tail_grows(up.at[-1].set(jnp.nan)))
        (1, 0, 1)
        >>> peak = jnp.where(u <= 32, -u**2 / 2 + 40 * u, jnp.nan)  # a peak at 40, unseen
        >>> int(tail_grows(jnp.tile(peak, 2)))
        2
        >>> far = jnp.where(u <= 32, -u**2 / 2 + 136 * u, jnp.nan)  # 17 x 8 out: misread
        >>> int(tail_grows(jnp.tile(far, 2)))
        1
    """
    rays = values.reshape(-1, TAIL_DOUBLINGS)
    index = jnp.where(jnp.isfinite(rays), jnp.arange(TAIL_DOUBLINGS), -1)
    last, _ = jax.lax.top_k(index, 3)  # the three farthest finite points, farthest first
    enough = jnp.all(last >= 0, axis=1)
    far = jnp.take_along_axis(rays, jnp.maximum(last, 0), axis=1)
    dist = 2.0 ** last.astype(values.dtype)
    # strictly: a plateau is float saturation (a Dirichlet's stick-breaking at u ~ 17 in
    # float32: the simplex point and its Jacobian stop changing), not a growth; it called
    # Categorical observations under a Dirichlet prior "most likely +inf" at every T
    rising = enough & (far[:, 0] > far[:, 1]) & (far[:, 1] > far[:, 2])
    outer = (far[:, 0] - far[:, 1]) / (dist[:, 0] - dist[:, 1])
    inner = (far[:, 1] - far[:, 2]) / (dist[:, 1] - dist[:, 2])
    grows = rising & (outer >= TAIL_SLOPE_RATIO * inner)
    unseen = rising & (last[:, 0] < TAIL_DOUBLINGS - 1)
    return jnp.where(jnp.any(grows), GROWS, jnp.where(jnp.any(unseen), RISES_UNSEEN, 0))


def kish(log_w: jax.Array) -> jax.Array:
    """Kish's effective sample size of the weights ``e^log_w``."""
    w = jnp.exp(log_w - jnp.max(log_w))
    return jnp.sum(w) ** 2 / jnp.sum(w**2)


def prior_check_at(
    target: _Target, t: jax.Array, draws: jax.Array, batch_size: int = 256
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The missed-mass check's inputs (:func:`missed_mass`) at one temperature ``t``, from
    the prior ``draws`` (S, D): the log of the mean of :math:`e^{L_T}` over the draws, and
    their Kish ESS; whether the integrand still grows far out (:func:`tail_grows`, on the
    rays of :func:`_rays`); and its largest value on the rays and at the origin of the
    unconstrained space (for :func:`rays_beyond`; see :func:`extra_starts`).
    With one global coordinate, also the trapezoid rule for :math:`C(T)` on the grid of
    :func:`_grid` (spacing 1/32 prior sd at the centre, out to +- ``GRID_REACH`` sds), and
    whichever of the two is larger, with its points' Kish ESS: a mode no prior draw reaches
    is seen by the grid (the ladder route, whose particles come from the prior, missed a
    bump of width 0.1 at 5 prior sds by 13-97 nats with standard errors of 0.03 and no
    flag). The trapezoid is exact to rounding for a mode wider than a few grid steps; for a
    narrower one its error can reach the ratio of the grid's spacing to the mode's width,
    but its ESS is then below ``MIN_PRIOR_ESS`` and only a shortfall beyond log 1000 is
    flagged. A +inf on the grid or the rays beyond ``DIVERGENCE_REACH`` robust prior scales
    is dropped like a NaN (float overflow of a closed form, not a divergence).
    ``batch_size``: the target is evaluated at that many points at a time."""
    rays = jnp.concatenate([_rays(draws, RAY_DENSITY), jnp.zeros_like(draws[:1])])  # + origin
    num, num_rays = draws.shape[0], rays.shape[0]
    on_grid = draws.shape[-1] == 1
    grid, log_weights = _grid(draws) if on_grid else (None, None)
    points = jnp.concatenate([draws, rays, grid[:, None]] if on_grid else [draws, rays])
    # one evaluation site for every point (each is a copy of the model in the program)
    log_p, log_l = _in_batches(
        lambda u: (target.log_prior(u), target.pieces(u, t)[0]), points, batch_size)
    # a proper prior's log density is +inf only by overflow: an InverseGamma's at
    # u = log(lam) = -76 in float32 (its Jacobian x^-2 overflows), far out on a ray or the
    # grid, made the trapezoid +inf and log C "divergent" at every T, even T = 1
    log_p = jnp.where(log_p == jnp.inf, jnp.nan, log_p)
    on_rays = log_p[num:num + num_rays] + log_l[num:num + num_rays]
    centre, scale = _robust_centre_scale(draws)
    far = jnp.max(jnp.abs(rays - centre) / scale, axis=-1) > DIVERGENCE_REACH
    on_rays = jnp.where(far & (on_rays == jnp.inf), jnp.nan, on_rays)
    log_w, grows = log_l[:num], tail_grows(on_rays[:-1].reshape(-1, RAY_DENSITY)[:, 0])
    ray_max = jnp.max(jnp.where(jnp.isnan(on_rays), -jnp.inf, on_rays))
    log_w = jnp.where(jnp.isnan(log_w), -jnp.inf, log_w)
    log_mean = logsumexp(log_w) - math.log(num)
    if not on_grid:
        return log_mean, kish(log_w), grows, ray_max
    f = log_p[num + num_rays:] + log_l[num + num_rays:]
    far = jnp.abs(grid - centre[0]) > DIVERGENCE_REACH * scale[0]
    f = jnp.where(jnp.isnan(f) | (far & (f == jnp.inf)), -jnp.inf, f) + log_weights
    log_trap = logsumexp(f)
    use_grid = log_trap > log_mean
    return (jnp.where(use_grid, log_trap, log_mean),
            jnp.where(use_grid, kish(f), kish(log_w)), grows, ray_max)


def _prior_check(
    target: _Target, key_fixed: jax.Array, settings: SMCSettings, temps: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`prior_check_at` at every temperature of ``temps``, with ``num_prior_draws``
    prior draws."""
    key_prior = random.split(random.fold_in(key_fixed, 1))[1]
    draws = jax.vmap(target.init)(random.split(key_prior, settings.num_prior_draws))
    return jax.lax.map(lambda t: prior_check_at(target, t, draws), temps)


def rays_beyond(ray_max: jax.Array, particle_max: jax.Array, dim: int) -> jax.Array:
    r"""Whether a point of the tail check's rays (:func:`_rays`) has a tilted density
    :math:`\log p(u) + L_T(u)` (largest ``ray_max``, ``(M,)``) above the largest at the
    final particles (``particle_max``, ``(R, M)``, over every replicate) by more than
    ``dim / 2 + RAY_MARGIN`` nats: a region of higher density than any particle reached,
    i.e. a missed mode. (Draws from a D-dimensional Gaussian mode fall about D/2 nats below
    its peak, the best of P draws less; a ray point cannot beat the peak.) The ladder route
    walks from the prior and has no Newton starts on the rays; a mixture prior's far
    minority component, one coordinate of two, was missed there by 173 nats with a
    standard error of 0 and no flag. One SMC per temperature starts Newton runs from the
    rays (:func:`_ray_starts`) and is checked the same way, in case they did not reach it.

    Example:
        >>> import jax.numpy as jnp
        >>> rays_beyond(jnp.array([3.0, 30.0]), jnp.array([[2.0, 2.0], [1.0, 4.0]]), 4).tolist()
        [False, True]
    """
    return ray_max > jnp.max(particle_max, axis=0) + dim / 2 + RAY_MARGIN


def global_log_prior(tr: dict, global_names: tuple[str, ...], dtype: Any) -> jax.Array:
    """The globals' log density in unconstrained space from a trace run under
    ``_unconstrain_params``: each global's scaled log density plus its bijection's
    log-Jacobian site ``_<name>_log_det``."""
    log_p = jnp.zeros((), dtype)
    for name in global_names:
        for site_name in (name, f"_{name}_log_det"):
            site = tr.get(site_name)
            if site is None:
                continue
            lp = site["fn"].log_prob(site["value"])
            if site.get("scale") is not None:
                lp = site["scale"] * lp
            log_p = log_p + jnp.sum(lp)
    return log_p


def _grid_map() -> tuple[float, float]:
    """(A, h) of the grid's map ``x_k = A sinh(k h)``, ``k = -n..n`` (``2 n + 1 =
    GRID_POINTS``): spacing ``A h = GRID_CENTRE_STEP`` at 0 and ``A sinh(n h) = GRID_REACH``
    (``sinh(y) = c y`` for ``y = n h``, solved by fixed-point steps ``y = asinh(c y)``)."""
    n = (GRID_POINTS - 1) // 2
    c = GRID_REACH / (GRID_CENTRE_STEP * n)
    y = math.asinh(c)
    for _ in range(100):
        y = math.asinh(c * y)
    h = y / n
    return GRID_CENTRE_STEP / h, h


def _grid(draws: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(GRID_POINTS,) points and their trapezoid log-weights (the ends halved): the prior
    draws' median + their robust scale (one global, :func:`_robust_centre_scale`) times
    ``A sinh(k h)`` (:func:`_grid_map`), out to +- GRID_REACH scales."""
    centre, sd = _robust_centre_scale(draws[:, :1])
    a, h = _grid_map()
    n = (GRID_POINTS - 1) // 2
    s = h * jnp.arange(-n, n + 1, dtype=draws.dtype)
    points = centre[0] + sd[0] * a * jnp.sinh(s)
    ends = jnp.zeros(GRID_POINTS, draws.dtype).at[jnp.array([0, -1])].set(math.log(2.0))
    return points, jnp.log(sd[0] * a * h) + jnp.log(jnp.cosh(s)) - ends


def _log_tilted(target: _Target, temperature: jax.Array) -> Callable:
    """``u -> log p(u) + L_T(u)``, the tilted target's log density, NaN mapped to -inf."""

    def fn(u: jax.Array) -> jax.Array:
        value = target.log_prior(u) + target.pieces(u, temperature)[0]
        return jnp.where(jnp.isnan(value), -jnp.inf, value)

    return fn


def _in_batches(fn: Callable, points: jax.Array, batch_size: int) -> Any:
    """``fn`` at each of ``points`` (S, D), ``batch_size`` points at a time, the points padded
    to a multiple of it (``lax.map`` would evaluate a remainder at a second site, i.e. a
    second copy of ``fn`` in the compiled program)."""
    pad = -points.shape[0] % batch_size
    padded = jnp.concatenate([points, jnp.repeat(points[:1], pad, axis=0)])
    out = jax.lax.map(fn, padded, batch_size=batch_size)
    return jax.tree.map(lambda a: a[: points.shape[0]], out)


def _on_grid(target: _Target, t: jax.Array, grid: jax.Array) -> jax.Array:
    """log p(u) + L_T(u) at the grid's points (-inf where NaN), 256 points at a time."""
    return _in_batches(_log_tilted(target, t), grid[:, None], 256)


def _grid_starts(target: _Target, t: jax.Array, grid: jax.Array) -> jax.Array:
    """(GRID_STARTS, 1): the largest local maxima of the tilted target on the ``grid``
    points of :func:`_grid` (one global coordinate); where there are fewer maxima within
    ``GRID_START_DROP`` nats of the largest (a plateau of rounding far out is no mode), the
    largest again."""
    f = _on_grid(target, t, grid)
    low = jnp.full((1,), -jnp.inf, f.dtype)
    left, right = jnp.concatenate([low, f[:-1]]), jnp.concatenate([f[1:], low])
    peak = (f >= left) & (f >= right) & jnp.isfinite(f) & (f >= jnp.max(f) - GRID_START_DROP)
    score = jnp.where(peak, f, -jnp.inf)
    value, index = jax.lax.top_k(score, GRID_STARTS)
    index = jnp.where(jnp.isfinite(value), index, index[0])
    return grid[index][:, None]


def _ray_starts(target: _Target, t: jax.Array, rays: jax.Array, starts: jax.Array) -> jax.Array:
    """(RAY_STARTS, D): the points of the tail check's ``rays`` (:func:`_rays`) where the
    tilted target is largest, each kept where it is larger there than at every prior start
    of ``starts`` (a far mode's slope; else the first start again: a repeated component)."""
    f = jax.vmap(_log_tilted(target, t))(jnp.concatenate([rays, starts]))
    value, index = jax.lax.top_k(f[: rays.shape[0]], RAY_STARTS)
    better = jnp.isfinite(value) & (value > jnp.max(f[rays.shape[0]:]))
    return jnp.where(better[:, None], rays[index], starts[0])


def extra_starts(target: _Target, t: jax.Array, starts: jax.Array, draws: jax.Array
                 ) -> jax.Array:
    r"""The Newton starts beyond the prior ``starts`` (K, D) that reach modes no prior draw
    reaches, from the prior ``draws`` (S, D): one global coordinate, the grid's maxima
    (:func:`_grid_starts` on :func:`_grid`); several, the rays' highest points
    (:func:`_ray_starts` on :func:`_rays`); and the origin of the unconstrained space.

    The origin is where a linear predictor with unscaled covariates is 0: a logistic
    regression's coefficient under a N(0, 1) prior with covariates of order 10^4 has
    :math:`|b x_n| \gg 1` at every prior draw, where each Bernoulli normaliser
    :math:`p^{1/T} + (1 - p)^{1/T}` is 1 to rounding, and a spike of width ~T/10^4 around
    b = 0, where it is :math:`2^{1 - 1/T}` for every element (log C(1.5) = 103 nats at
    N = 500): no prior draw, ray or grid point comes near it."""
    origin = jnp.zeros_like(starts[:1])
    if starts.shape[-1] == 1:
        return jnp.concatenate([_grid_starts(target, t, _grid(draws)[0]), origin])
    return jnp.concatenate([_ray_starts(target, t, _rays(draws, RAY_DENSITY), starts), origin])


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

        key_starts = random.split(random.fold_in(key_fixed, 1))[0]
        if settings.reference == "laplace":
            starts = jax.vmap(target.init)(random.split(key_starts, settings.num_starts))
            draws = jax.vmap(target.init)(random.split(random.fold_in(key_starts, 1), 256))

            def laplace_all(t: jax.Array) -> tuple:
                both = jnp.concatenate([starts, extra_starts(target, t, starts, draws)])
                return jax.vmap(lambda u: _laplace(target, t, u))(both)

            refs = jax.vmap(laplace_all)(temps)  # (M, K, D), (M, K, D, D)
        else:
            refs = None

        def one(k: jax.Array, t: jax.Array, ref: Any) -> tuple:
            return _smc(target, settings, k, t, ref, per_element, top=True)

        size = run_size(target, temps[0], key_fixed, settings.num_particles)
        *out, top = map_runs(one, keys, temps, refs, size)
        prior_log_c, prior_ess, grows, ray_max = _prior_check(target, key_fixed, settings,
                                                              temps)
        dim = jax.eval_shape(target.init, key_fixed).shape[-1]
        return SMCRun(*out, prior_log_c, prior_ess, tail_grows=grows,
                      ray_beyond=rays_beyond(ray_max, top, dim))

    return run
