r"""Tempered log-partition functions :math:`\log C(T)` of any NumPyro model, over a ladder.

The tempered joint of annealed VI (Mandt et al. 2016, eq. 4) is
:math:`p(\beta)\, p(x, z \mid \beta)^{1/T} / C(T)`, with (variational-tempering supplement,
eq. 1)

.. math::

    C(T) = \int d\beta\, p(\beta) \prod_{n=1}^N \int dx_n\, dz_n\, p(x_n, z_n \mid \beta)^{1/T}.

Annealed VI can ignore :math:`C(T)`; multicanonical VI cannot (eq. 13 and 18): it needs
:math:`\log C(T_m)` for every temperature of its ladder. This module estimates it for any
model, vectorised over the whole ladder, reading the model's structure from its trace.

**Two estimators.** :func:`log_partition` defaults to ``method="smc"``: :math:`\log C(T)` is
the evidence of a model with prior :math:`p(\beta)` (the globals) and log-likelihood
:math:`L_T(\beta) = \sum_n \log c_n(\beta, T)` (the closed-form per-element normalisers
below, given the globals), estimated by blackjax's adaptive tempered SMC with R independent
replicates (:mod:`numpyro_tempering.tempered_smc`, which says why blackjax's SMC and not our
own). When **continuous local latents** (inside ``plate``) change the contributions, the
SMC integrates the locals too (see :func:`log_partition`): by default (``route="auto"``,
or ``route="quadrature"``) one-dimensional locals by adaptive Gauss-Hermite quadrature over
each element's local given the globals and SMC over the globals only
(:mod:`numpyro_tempering.local_quadrature`, Liu and Pierce 1994), with ``route="joint"`` by
one SMC over both (:mod:`numpyro_tempering.joint_smc`, opt-in, any dimension). The target is
:math:`p(\beta)\prod_n \tilde p(z_n\mid\beta) e^{a_n(\beta, z_n, T)}` (a tempered latent
local as its unnormalised :math:`p^{1/T}`), whose evidence is :math:`C(T)` (supplement
eq. 1), and tempered SMC's evidence estimate is unbiased for it (Del Moral 2004; Chopin
and Papaspiliopoulos 2020; with the quadrature, for :math:`C(T)` with each element's
integral replaced by its rule, whose deterministic error is measured and reported) --
unlike the nested average of eq. 7, whose log is low by many nats at realistic N. It falls
back to ``method="prior"`` with a warning naming the reason for discrete globals, locals
that matter of more than one dimension per element without ``route="joint"``, discrete
locals, ``plate=None`` with locals that matter, and subsampled plates, and returns the exact
value when the contributions do not depend on the globals. ``method="prior"`` is plain
Monte Carlo over the globals drawn from the prior, described in the rest of this docstring;
the per-element contributions :math:`\log c_n` are computed by the same code for all.
The prior estimator:

* **Which factors are tempered**: the sites a :class:`~numpyro_tempering.temper` handler
  selects (``sites`` / ``latent`` / ``exclude``, default: every observed site). The model is
  run under ``temper(model, 1.0, ...)``, which only *marks* them.
* **Tempered sites are integrated in closed form** with the registry of
  :mod:`numpyro_tempering.partition`: a tempered *observed* site contributes
  :math:`\log Z_x(T) = \log\int p(x \mid \text{parents})^{1/T} dx`; a tempered *latent* site
  :math:`z` contributes :math:`\log Z_z(T)` given its parents and is then **drawn from its
  normalised tempered law** :math:`p(z \mid \cdot)^{1/T} / Z_z`, so that its children are
  integrated conditionally on it. This is exact in expectation, because
  :math:`\int p(z)^{1/T} f(z)\, dz = Z_z(T)\, \mathbb{E}_{p^{1/T}/Z_z}[f(z)]`.
* **Untempered latent sites are drawn from the prior** (supplement eq. 2-3: the globals
  :math:`\beta \sim p(\beta)`; and, for LDA, the per-document :math:`\theta_d \sim p(\theta)`,
  eq. 7). An untempered *observed* site (e.g. a prior penalty written as ``numpyro.factor``
  and left out with ``exclude``) is an importance weight :math:`e^{\log p}`.
* **Nested per-plate averaging** (supplement eq. 7): with ``plate="data"`` the latent sites
  outside the plate are *globals* (one draw per outer sample :math:`s`) and those inside it
  are *locals*, redrawn ``num_inner`` times (:math:`k`) independently for every element
  :math:`n` given the globals. With :math:`a_{skn}(T)` the log contribution of element
  :math:`n` (sum of the log normalisers and weights of its sites),

  .. math::

      \log \hat C(T) = \log \frac{1}{S}\sum_s \exp\Big\{\sum_n \log\frac{1}{K}\sum_k
          e^{a_{skn}(T)}\Big\}.

  Given the globals the elements are independent, so the product over :math:`n` of the
  inner means is an unbiased estimate of :math:`\prod_n \mathbb{E}_{z_n}[\cdot]`, and
  :math:`\hat C(T)` is unbiased for :math:`C(T)` (its log is not, see below). With
  ``plate=None`` the whole model is one element: untempered latents are the globals and
  the tempered latents are redrawn ``num_inner`` times.

  Unbiased for :math:`C`, the estimate is **biased in log**:
  :math:`\mathbb{E}[\log\hat C] \le \log C` (Jensen), with a gap that grows with the
  variance of the per-draw products :math:`\prod_n \frac1K\sum_k e^{a_{skn}}`. With local
  latents that variance is largest at ``num_inner=1`` (a product of N single draws), where
  :math:`\log\hat C` is typically far too low; the element-wise average is unbiased only for
  :math:`C`, never for :math:`\log C` or :math:`\log c_n`. ``log_partition`` warns when local
  latents that change the contributions are averaged with ``num_inner=1``.

Every temperature uses the same random numbers (common random numbers), so the estimated
:math:`\log C(T)` is a smooth function of :math:`T`.

:math:`\log C` depends on the model's *structure and sizes* only, not on the data values:
call the model with data of the right shape (the values are never read, except by
untempered observed sites). Subsampled plates are extrapolated by their scale ``N/B``
(each site's ``scale`` is a multiplicity: the log normaliser is multiplied by it, it is not
part of the power ``1/T``); for an exact value (and for per-element values) run the model
on the full plate.

Also here: the analytic (MAP) approximation of supplement eq. 4 (globals at their prior
mean), the two Jensen bounds of supplement eq. 8, and :class:`ModelSizes`, the sizes a
log C was computed for (checked by the multicanonical objective and handler).

**log C(1) = 0.** A normalised model has :math:`C(1) = 1`: at :math:`T = 1` every tempered
site's normaliser :math:`\log Z(1) = \log\int p = 0`. The estimators check this for every
tempered site on every draw (``T = 1`` is evaluated even if not in the ladder) and raise
``ValueError`` naming a site whose :math:`|\log Z(1)|` exceeds ``1e-3`` per element (an
inaccurate tempering rule, or an unnormalised density such as a ``Delta`` with a
``log_density``). Untempered observed sites (importance weights) make :math:`C(1) \ne 1`
legitimately and are not checked.

**What is refused** (``ValueError`` naming the sites):

* a tempered ``numpyro.factor`` (NumPyro's ``Unit``): a factor is an unnormalised
  log-density with no variable to integrate, so :math:`\int dx\, p(x \mid \beta)^{1/T}`
  has no meaning (the Monte Carlo average would be the tempered evidence of the prior, not a
  normaliser). Write the likelihood as a distribution with ``obs=``; ``exclude`` a factor
  that belongs to the prior (it is then an importance weight); or give log C yourself
  (:meth:`~numpyro_tempering.ladder.Ladder.with_log_partition_values`);
* ``numpyro.param`` sites in the model: log C depends on their values, so a log C computed
  once (a :class:`~numpyro_tempering.ladder.Ladder`) goes stale as soon as SVI changes
  them. Make them constants or model arguments.

**Trust** (``method="prior"``; for ``"smc"`` see
:func:`~numpyro_tempering.tempered_smc.flag_smc`). Plain Monte Carlo over the globals from
the prior collapses when the integrand
:math:`p(\beta)\prod_n c_n(\beta, T)` is peaked (realistic N): a few draws carry all the
weight, the estimate is off by up to hundreds of nats, and the delta-method standard error
-- itself a function of those few draws -- stays small. Each :class:`LogPartitionEstimate`
therefore carries, per temperature, the Kish effective sample size ``ess`` of the outer
draws and the Pareto :math:`\hat k` of their weights (the tail-shape diagnostic of Pareto
smoothed importance sampling, Vehtari et al. 2024, JMLR 25(72); :math:`\hat k > 0.5` means
the weights have no finite variance, so the standard error means nothing). A temperature
is **flagged** (:func:`flag_untrusted`, :attr:`LogPartitionEstimate.flagged`) if any draw is
non-finite, or if the draws are not all equal and ``ess < 10`` (``S/2`` for ``S < 20``),
``ess < 1%`` of the draws, or :math:`\hat k > \min(1 - 1/\log_{10} S, 0.7)`;
``log_partition`` then warns (``UserWarning`` naming the temperatures). The estimate is
kept, not repaired: increase ``num_samples``, use a closed form, or bracket log C with
:func:`jensen_bounds` (lower bounds) and :func:`analytic_log_partition`.

**Per-element normalisers** (``plate="data"`` on the full plate):
:attr:`LogPartitionEstimate.element_log_c`, shape ``(M, N)``, the per-element
:math:`\log c_n(T)` that a per-element multicanonical temperature needs. When the
elements' normalisers do not depend on the globals (e.g. observed sites with closed forms
and fixed scales) :math:`C = \prod_n c_n` and these are exact. Otherwise no exact split
exists (:math:`C = \mathbb{E}_\beta \prod_n c_n(\beta)` is not a product); the returned
split is :math:`\log \bar c_n + \delta / N` with :math:`\bar c_n = \mathbb{E}_\beta[c_n]`
(the element's own normaliser averaged over the prior, same draws) and
:math:`\delta = \log C - \sum_n \log \bar c_n` spread evenly, so that
:math:`\sum_n \log c_n = \log C` always, elements that differ (noise scales, document
lengths) get different values, and identical elements get :math:`\log C / N`.

**Joint tempering** (``joint=True``, as in :class:`~numpyro_tempering.temper`): an observed
mixture site whose discrete local is summed out is tempered as
:math:`\log\sum_k p(x, z = k \mid \beta)^{1/T}`; its normaliser
:math:`\sum_k w_k^{1/T} Z_k(T)` is a closed form of the registry
(:mod:`numpyro_tempering.partition`).

Example:
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro_tempering.partition_function import log_partition
    >>> def model(x):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     with numpyro.plate("data", x.shape[0]):
    ...         numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
    >>> est = log_partition(jax.random.PRNGKey(0), model, jnp.array([1.0, 4.0]), jnp.zeros(3))
    >>> # closed form: N [(1 - 1/T)/2 log(2 pi) + 1/2 log T]
    >>> [round(float(v), 4) for v in est.log_c]
    [0.0, 4.1471]
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as npd
from jax import lax, random
from jax.extend.core import Literal
from jax.scipy.special import logsumexp
from numpyro.distributions.distribution import Unit
from numpyro.handlers import seed, substitute, trace
from numpyro.primitives import Messenger

from numpyro_tempering.conjugate import collapse_locals, collapsible_locals
from numpyro_tempering.engine import _element_log_lik
from numpyro_tempering.handlers import TEMPERED, Selection, temper
from numpyro_tempering.partition import (
    _BINOMIAL_TERMS,
    SERIES_LAWS,
    Fallback,
    binomial_terms,
    tempered,
)
from numpyro_tempering.schedules import check_temperature
from numpyro_tempering.structure import ModelSizes as ModelSizes  # importable from here too
from numpyro_tempering.structure import (
    model_params,
    nothing_tempered,
    plate_not_found,
    sizes_from_trace,
    stale_params_message,
    structure_trace,
)
from numpyro_tempering.structure import model_sizes as model_sizes

__all__ = [
    "LOG_Z1_TOL",
    "MIN_ESS",
    "MIN_ESS_FRACTION",
    "JensenBounds",
    "LogPartitionEstimate",
    "analytic_log_partition",
    "flag_untrusted",
    "jensen_bounds",
    "log_partition",
    "METHODS",
    "pareto_k",
    "pareto_k_threshold",
]

# -----------------------------------------------------------------------------------------
# The sampling handler
# -----------------------------------------------------------------------------------------


class _tempered_prior(Messenger):
    """Run a (marked) model drawing tempered latents from their tempered laws.

    At a site marked tempered: record ``scale * log Z(T)`` of its distribution given its
    parents and, if latent, replace its distribution by the normalised tempered one (the
    default sampler then draws from it); ``site_log_z`` keeps the ``log Z(T)`` farthest
    from 0 of each tempered site, with its sign (for the ``log Z(1) = 0`` check). At an
    untempered observed site: record ``scale * log p(value)`` (an importance weight).
    Untempered latents are left alone (drawn from the prior, or substituted by an outer
    handler).
    """

    def __init__(self, fn: Callable, temperature: Any, fallback: Fallback = None) -> None:
        self.temperature = temperature
        self.fallback = fallback
        self.records: list[tuple[dict, jax.Array, bool]] = []
        self.site_log_z: dict[str, jax.Array] = {}
        self.plate_sizes: dict[str, int] = {}  # full sizes (frames only carry the subsample)
        super().__init__(fn)

    def __enter__(self):
        self.records = []
        self.site_log_z = {}
        self.plate_sizes = {}
        return super().__enter__()

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "plate":
            self.plate_sizes[msg["name"]] = msg["args"][0]
        if msg["type"] != "sample":
            return
        is_tempered = bool(msg["infer"].get(TEMPERED, False))
        fn = msg["fn"]
        if is_tempered:
            try:
                contribution, law = tempered(fn, self.temperature, fallback=self.fallback)
            except NotImplementedError as err:
                raise NotImplementedError(
                    f"log C: cannot temper site '{msg['name']}' ({type(fn).__name__}): {err}"
                ) from err
            if not msg["is_observed"]:
                msg["fn"] = law
            size = math.prod(jnp.shape(contribution))
            self.site_log_z[msg["name"]] = (
                _farthest_from_zero(jnp.ravel(contribution), 0) if size
                else jnp.zeros((), contribution.dtype)
            )
        elif msg["is_observed"]:
            contribution = fn.log_prob(msg["value"])
        else:
            return
        scale = msg.get("scale")
        if scale is not None:
            contribution = scale * contribution
        site = {"name": msg["name"], "fn": fn, "cond_indep_stack": list(msg["cond_indep_stack"])}
        self.records.append((site, contribution, is_tempered))


class _prior_mean(Messenger):
    """Set the given latent sites to the mean of their (prior) distribution."""

    def __init__(self, fn: Callable, is_global: Callable[[dict], bool]) -> None:
        self.is_global = is_global
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or msg["is_observed"] or not self.is_global(msg):
            return
        fn = msg["fn"]
        if fn.support.is_discrete:
            raise ValueError(
                f"analytic_log_partition: global site '{msg['name']}' is discrete "
                f"({type(fn).__name__}); its prior mean is not a value of the site. Use "
                "log_partition (Monte Carlo over the globals) instead."
            )
        msg["value"] = jnp.broadcast_to(fn.mean, fn.shape())


# -----------------------------------------------------------------------------------------
# Structure
# -----------------------------------------------------------------------------------------


def _in_plate(site: dict, plate: str | None) -> bool:
    return plate is not None and any(f.name == plate for f in site["cond_indep_stack"])


def _global_rule(plate: str | None) -> Callable[[dict], bool]:
    """Whether a latent site is a global (drawn once per outer sample)."""
    if plate is None:
        return lambda msg: not msg["infer"].get(TEMPERED, False)
    return lambda msg: not _in_plate(msg, plate)


def _unwrapped(fn: Any) -> Any:
    while isinstance(fn, (npd.ExpandedDistribution, npd.MaskedDistribution, npd.Independent)):
        fn = fn.base_dist
    return fn


class _Structure(NamedTuple):
    sizes: ModelSizes
    local_latents: tuple[str, ...]  # redrawn num_inner times per element
    untempered_observed: tuple[str, ...]  # importance weights (C(1) != 1 legitimately)
    series: bool = False  # a tempered site's normaliser is a series (partition.SERIES_LAWS)
    # tempered Binomial sites, whose counts _largest_binomial_count reads (none when a plate
    # is subsampled: one run's counts are then not all the data's)
    binomial_sites: tuple[str, ...] = ()


def _probe(marked: Callable, args: tuple, kwargs: dict, plate: str | None) -> _Structure:
    """Validate the structure of the marked model and return its sizes and site roles."""
    tr = structure_trace(marked, args, kwargs)
    params = model_params(tr)
    if params:
        raise ValueError(stale_params_message(params, "log C"))
    samples = {n: s for n, s in tr.items() if s["type"] == "sample"}
    tempered_sites = {n: s for n, s in samples.items() if s["infer"].get(TEMPERED, False)}
    factors = sorted(n for n, s in tempered_sites.items() if isinstance(_unwrapped(s["fn"]), Unit))
    if factors:
        raise ValueError(
            f"log C: tempered site(s) {factors} are numpyro.factor terms. A factor is an "
            "unnormalised log-density with no variable to integrate, so the normaliser "
            "int dx p(x | beta)^(1/T) of log C(T) does not exist for it (a Monte Carlo average "
            "would give the tempered evidence of the prior instead). Write the likelihood as "
            "a distribution with obs=..., exclude the factor from tempering (exclude=...) if "
            "it belongs to the prior, or give log C yourself: "
            "Ladder.with_log_partition_values(log_c, sizes=model_sizes(...))."
        )
    if not tempered_sites:
        raise nothing_tempered(tr, "log C")
    plates = sorted(n for n, s in tr.items() if s["type"] == "plate")
    if plate is not None:
        if plate not in plates:
            raise plate_not_found(plate, plates)
        outside = [n for n, s in tempered_sites.items() if not _in_plate(s, plate)]
        if outside:
            raise ValueError(
                f"tempered site(s) {outside} are not inside plate '{plate}': nested averaging "
                "over a plate needs every tempered site in that plate (use plate=None)."
            )
    is_global = _global_rule(plate)
    return _Structure(
        sizes=sizes_from_trace(tr),
        local_latents=tuple(
            sorted(n for n, s in samples.items() if not s["is_observed"] and not is_global(s))
        ),
        untempered_observed=tuple(
            sorted(n for n, s in samples.items() if s["is_observed"] and n not in tempered_sites)
        ),
        series=any(isinstance(_unwrapped(s["fn"]), SERIES_LAWS)
                   for s in tempered_sites.values()),
        binomial_sites=() if _subsampled_in(tr) else tuple(sorted(
            n for n, s in tempered_sites.items()
            if isinstance(_unwrapped(s["fn"]), (npd.BinomialProbs, npd.BinomialLogits)))),
    )


def _marked(model: Callable, selection: Selection) -> Callable:
    return temper(model, 1.0, sites=selection)


def _check_temperatures(temperatures: Any) -> jax.Array:
    temps = np.asarray(temperatures, dtype=np.float64)
    if temps.ndim == 0:
        temps = temps[None]
    if temps.ndim != 1 or temps.size == 0:
        raise ValueError(
            f"`temperatures` must be a non-empty 1-D array, got shape {np.shape(temperatures)}."
        )
    check_temperature(temps, "temperatures")
    return jnp.asarray(temps, dtype=jnp.result_type(float))


def _with_one(temps: jax.Array) -> jax.Array:
    """The ladder with T = 1 appended if it is not in it (for the log Z(1) = 0 check)."""
    if np.any(np.asarray(temps) == 1.0):
        return temps
    return jnp.concatenate([temps, jnp.ones((1,), temps.dtype)])


def _check_count(value: int, name: str, minimum: int = 1) -> int:
    if int(value) != value or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


# -----------------------------------------------------------------------------------------
# Nested Monte Carlo
# -----------------------------------------------------------------------------------------


class _Inner(NamedTuple):
    elements: jax.Array  # (E,) per-element log contributions, without the multiplicity N/B
    rest: jax.Array  # () contributions outside the plate
    multiplicity: jax.Array  # () N/B of a subsampled plate
    site_log_z: dict  # name -> () log Z(T) farthest from 0 of each tempered site


def _contributions(
    marked: Callable,
    temperature: jax.Array,
    key: jax.Array,
    fixed: dict,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    fallback: Fallback,
) -> _Inner:
    """One inner draw at one T.

    The element contributions are returned *without* the multiplicity N/B of a subsampled
    plate: the nested estimate is (N/B) sum_n log mean_k exp(a_kn), and scaling inside the
    inner log-mean-exp would estimate log E[exp((N/B) a)] instead.
    """
    handler = _tempered_prior(marked, temperature, fallback)
    substitute(seed(handler, key), data=fixed)(*args, **kwargs)
    zero = jnp.zeros((), temperature.dtype)
    elements, rest, multiplicity = zero, zero, jnp.ones((), temperature.dtype)
    for site, value, _ in handler.records:
        if _in_plate(site, plate):
            per_element = _element_log_lik(site, value, plate)
            size = handler.plate_sizes[plate]
            multiplicity = jnp.asarray(size / per_element.shape[-1], temperature.dtype)
            elements = elements + per_element / multiplicity
        elif plate is None:
            elements = elements + jnp.sum(value)
        else:
            rest = rest + jnp.sum(value)
    return _Inner(jnp.atleast_1d(elements), rest, multiplicity, handler.site_log_z)


def _fixed_values(
    marked: Callable, key: jax.Array, args: tuple, kwargs: dict, plate: str | None, at_mean: bool
) -> dict:
    """The outer draw: values of the global latents (and the plates' subsample indices)."""
    is_global = _global_rule(plate)
    fn = _prior_mean(marked, is_global) if at_mean else marked
    tr = trace(seed(fn, key)).get_trace(*args, **kwargs)
    fixed = {}
    for name, site in tr.items():
        if site["type"] == "plate":
            fixed[name] = site["value"]
        elif site["type"] == "sample" and not site["is_observed"] and is_global(site):
            fixed[name] = site["value"]
    return fixed


def _log_mean_exp(x: jax.Array, axis: int) -> jax.Array:
    return logsumexp(x, axis=axis) - math.log(x.shape[axis])


class _Draw(NamedTuple):
    log_c: jax.Array  # (M,) log C estimate given this outer draw
    mean_log: jax.Array  # (M,) sum_n mean_k a_kn (+ rest): for the E-log Jensen bound
    element_log_mean: jax.Array  # (M, E) log mean_k exp(a_kn)
    rest_log_mean: jax.Array  # (M,)
    site_log_z: dict  # name -> (M,) log Z(T) farthest from 0 of each tempered site


def _draws(
    rng_key: jax.Array,
    marked: Callable,
    temperatures: jax.Array,
    args: tuple,
    kwargs: dict,
    *,
    plate: str | None,
    num_samples: int,
    num_inner: int,
    batch_size: int | None,
    fallback: Fallback,
    at_mean: bool = False,
) -> _Draw:
    """All outer draws, each at every temperature: arrays with leading axis S."""

    def one(key: jax.Array) -> _Draw:
        key_outer, key_inner = random.split(key)
        fixed = _fixed_values(marked, key_outer, args, kwargs, plate, at_mean)

        def run(t: jax.Array, k: jax.Array) -> _Inner:
            return _contributions(marked, t, k, fixed, args, kwargs, plate, fallback)

        inner_keys = random.split(key_inner, num_inner)
        # same inner keys at every temperature (common random numbers)
        inner = jax.vmap(jax.vmap(run, (None, 0)), (0, None))(temperatures, inner_keys)
        el, rest = inner.elements, inner.rest
        mult = inner.multiplicity[0, 0]  # N/B, the same for every draw
        element_lme = mult * _log_mean_exp(el, axis=1)  # (M, E), scaled after the average
        rest_lme = _log_mean_exp(rest, axis=1)  # (M,)
        return _Draw(
            log_c=element_lme.sum(-1) + rest_lme,
            mean_log=mult * el.mean(1).sum(-1) + rest.mean(1),
            element_log_mean=element_lme,
            rest_log_mean=rest_lme,
            site_log_z=jax.tree.map(lambda v: _farthest_from_zero(v, 1), inner.site_log_z),
        )

    keys = random.split(rng_key, num_samples)
    return lax.map(one, keys, batch_size=batch_size or num_samples)


def _locals_matter(
    rng_key: jax.Array,
    model: Callable,
    selection: Selection,
    temperatures: jax.Array,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    fallback: Fallback,
) -> bool:
    """Whether two independent inner draws (same globals) give different contributions.
    Entries that are NaN, or the same infinity in both draws, say nothing and are skipped:
    one temperature where the normalisers diverge (+inf in both) made the whole spread NaN,
    "no", and the locals were then held fixed at every temperature of the call (a finite
    rung 0.84 nats off, unflagged). Compiled once per model, selection and argument
    structure (:func:`_cached_jit`), not at every call (1.2-1.5 s a call on 2 cores)."""

    def make(marked: Callable, args: tuple, kwargs: dict) -> Callable:
        def spread(key: jax.Array, temps: jax.Array) -> jax.Array:
            key_outer, key_a, key_b = random.split(key, 3)
            fixed = _fixed_values(marked, key_outer, args, kwargs, plate, False)

            def run(t: jax.Array, k: jax.Array) -> jax.Array:
                inner = _contributions(marked, t, k, fixed, args, kwargs, plate, fallback)
                return jnp.concatenate([inner.elements, inner.rest[None]])

            a = jax.vmap(run, (0, None))(temps, key_a)
            b = jax.vmap(run, (0, None))(temps, key_b)
            finite = jnp.isfinite(a) & jnp.isfinite(b)
            rel = jnp.where(finite, jnp.abs(a - b) / (1.0 + jnp.abs(a)), 0.0)
            # one draw infinite, the other finite: they differ
            one_infinite = (jnp.isinf(a) != jnp.isinf(b)) & ~jnp.isnan(a) & ~jnp.isnan(b)
            return jnp.max(jnp.where(one_infinite, jnp.inf, rel))

        return spread

    spread = _cached_jit("locals_matter", model, selection, args, kwargs, (plate, fallback),
                         make)
    return bool(spread(rng_key, temperatures) > math.sqrt(np.finfo(temperatures.dtype).eps))


def _prepare(
    model: Callable,
    temperatures: Any,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    selection: Selection,
) -> tuple[Callable, jax.Array, _Structure]:
    marked = _marked(model, selection)
    temps = _check_temperatures(temperatures)
    structure = _probe(marked, args, kwargs, plate)
    return marked, temps, structure


#: largest ``abs(log Z(1))`` per element accepted for a tempered site (a normalised density has 0)
LOG_Z1_TOL = 1e-3


def _farthest_from_zero(v: jax.Array, axis: int) -> jax.Array:
    """The entries of ``v`` farthest from 0 along ``axis``, with their signs (NaN wins)."""
    return jnp.squeeze(jnp.take_along_axis(v, jnp.expand_dims(jnp.argmax(jnp.abs(v), axis), axis),
                                           axis), axis)


def _check_log_z_one(site_log_z: dict, temps: jax.Array, who: str) -> list[str]:
    """Raise for tempered sites with a finite ``|log Z(1)| > LOG_Z1_TOL`` on some element (too
    large or too small: either way every log C(T) built on it would be off); return the sites
    whose normaliser at T = 1 is NaN (counted as non-finite draws by the caller)."""
    one = int(np.argmax(np.asarray(temps) == 1.0))

    def worst(v) -> float:  # the element farthest from 0, with its sign (nan if any is nan)
        v = jnp.ravel(jnp.asarray(v)[..., one])
        return float(_farthest_from_zero(v, 0)) if v.size else 0.0

    values = {n: worst(v) for n, v in site_log_z.items()}
    wrong = {n: v for n, v in values.items() if np.isfinite(v) and abs(v) > LOG_Z1_TOL}
    if wrong:
        found = ", ".join(f"'{n}' {v:+.4g}" for n, v in sorted(wrong.items()))
        raise ValueError(
            f"{who}: at T = 1 the tempered normaliser log Z(1) = log int p(x) dx of site(s) "
            f"{found} (the element farthest from 0), where a normalised density has exactly 0 "
            "(C(1) = 1). The "
            "site's tempering rule is inaccurate (e.g. a numerical fallback), its density "
            "is not normalised (e.g. a Delta with a log_density), or the model given is "
            "already tempered (a `temper` handler inside it makes the density p^(1/T0): "
            "give the untempered model); every log C(T) built on it would be off."
        )
    return sorted(n for n, v in values.items() if np.isnan(v))


# -----------------------------------------------------------------------------------------
# Trust
# -----------------------------------------------------------------------------------------

#: flag a temperature whose outer draws have an effective sample size below this ...
MIN_ESS = 10.0
#: ... or below this fraction of the number of draws
MIN_ESS_FRACTION = 0.01


def pareto_k_threshold(num_samples: int) -> float:
    r""":math:`\min(1 - 1/\log_{10} S, 0.7)`: the largest Pareto :math:`\hat k` for which
    ``S`` importance draws give a usable estimate (Vehtari et al. 2024, section 3)."""
    return min(1.0 - 1.0 / math.log10(max(num_samples, 11)), 0.7)


def _psis_k(log_weights: np.ndarray) -> float:
    """ArviZ's Pareto k-hat of one vector of log weights (its warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import arviz as az

        _, k = az.psislw(log_weights.copy(), reff=1.0)
    k = float(np.asarray(k))
    return k if np.isfinite(k) else np.nan


def pareto_k(log_weights: jax.typing.ArrayLike) -> np.ndarray:
    r"""Pareto :math:`\hat k` of importance weights, per column of ``log_weights`` ``(S, M)``.

    The shape of a generalised Pareto fitted to the largest
    :math:`\min(S/5, 3\sqrt S)` weights, as ArviZ's ``psislw`` computes it (PSIS, Vehtari
    et al. 2024). :math:`\hat k < 0.5`: the weights have a finite variance and a standard
    error means something; above :func:`pareto_k_threshold` the estimate is unusable. NaN
    where it cannot be estimated: fewer than 5 tail draws (``S < 25``), all weights equal,
    or non-finite weights.

    Example:
        >>> import numpy as np
        >>> u = np.random.default_rng(0).uniform(size=(4000, 1))
        >>> round(float(pareto_k(-0.8 * np.log(u))[0]), 1)  # weights u^-0.8: k = 0.8
        0.8
    """
    lw = np.asarray(log_weights, dtype=np.float64)
    lw = lw[:, None] if lw.ndim == 1 else lw
    s = lw.shape[0]
    out = np.full(lw.shape[1], np.nan)
    if math.ceil(min(s / 5.0, 3.0 * math.sqrt(s))) < 5:
        return out
    for m in range(lw.shape[1]):
        col = lw[:, m]
        if np.all(np.isfinite(col)) and np.ptp(col) > 0:
            out[m] = _psis_k(col)
    return out


def _ess_floor(num_samples: float) -> float:
    return max(min(MIN_ESS, num_samples / 2.0), MIN_ESS_FRACTION * num_samples)


def flag_untrusted(
    ess: jax.typing.ArrayLike,
    pareto_k: jax.typing.ArrayLike | None,
    num_samples: int,
    num_nonfinite: jax.typing.ArrayLike | None = None,
) -> np.ndarray:
    r"""Temperatures whose Monte Carlo log C cannot be trusted (boolean, per temperature).

    Flagged: any non-finite draw; or, unless all draws are equal (``ess == S``: the estimate
    is deterministic), an effective sample size below ``MIN_ESS`` (10; ``S/2`` if
    ``S < 20``) or below ``MIN_ESS_FRACTION`` (1%) of ``S``, or a Pareto
    :math:`\hat k` above :func:`pareto_k_threshold`.

    Example:
        >>> flag_untrusted([100.0, 1.2, 60.0], [float("nan"), 0.9, 0.3], 100).tolist()
        [False, True, False]
    """
    ess = np.asarray(ess, dtype=np.float64)
    s = float(num_samples)
    random_ = ~(ess >= s * (1.0 - 1e-6))
    flagged = random_ & ~(ess >= _ess_floor(s))  # NaN ESS: flagged
    if pareto_k is not None:
        k = np.asarray(pareto_k, dtype=np.float64)
        flagged |= random_ & (np.nan_to_num(k, nan=-np.inf) > pareto_k_threshold(num_samples))
    if num_nonfinite is not None:
        flagged |= np.asarray(num_nonfinite) > 0
    return flagged


def _rounded(values: np.ndarray, digits: int) -> list[float]:
    return [round(float(v), digits) for v in values]


def _warn_untrusted(est: LogPartitionEstimate, nan_sites: list[str]) -> None:
    flagged = est.flagged
    if not np.any(flagged):
        return
    num = est.num_samples
    temps = np.asarray(est.temperatures)[flagged]
    ess = np.asarray(est.ess)[flagged]
    k = np.asarray(est.pareto_k)[flagged]
    bad = np.asarray(est.num_nonfinite)[flagged]
    show = slice(0, 8)
    more = f" (and {temps.size - 8} more)" if temps.size > 8 else ""
    reasons = []
    if np.any(bad > 0):
        sites = f"; site(s) {nan_sites} give NaN normalisers" if nan_sites else ""
        reasons.append(f"non-finite draws {bad[show].tolist()} of S = {num}{sites}")
    if np.any(np.isfinite(ess)):
        reasons.append(
            f"effective sample size {_rounded(ess[show], 1)} of S = {num} outer draws "
            f"(need >= {_ess_floor(num):g})"
        )
    if np.any(np.isfinite(k)):
        reasons.append(
            f"Pareto k {_rounded(k[show], 2)} (need <= {pareto_k_threshold(num):.2f}: "
            "above it the draws' weights have no usable variance)"
        )
    warnings.warn(
        "log_partition: the Monte Carlo estimate of log C(T) cannot be trusted at "
        f"T = {_rounded(temps[show], 4)}{more}: " + "; ".join(reasons) + ". When a few "
        "draws dominate, log_c can be off by far more than its stderr, which is then "
        "meaningless too. The estimate is kept (see .ess, .pareto_k, .flagged; a Ladder "
        "keeps them): increase num_samples, give a closed form "
        "(Ladder.with_log_partition_values), or bracket log C with jensen_bounds (lower "
        "bounds) and analytic_log_partition.",
        UserWarning,
        stacklevel=3,
    )


def _warn_single_inner(local: tuple[str, ...]) -> None:
    warnings.warn(
        f"log_partition: local latent site(s) {list(local)} change the per-element "
        "contributions and are averaged with num_inner=1 (one draw per element and outer "
        "draw). The estimate is unbiased for C but its log is biased low, by up to the gap "
        "between log C and the Jensen bound E[log] (see jensen_bounds), and each element's "
        "log c_n is a single draw: increase num_inner.",
        UserWarning,
        stacklevel=3,
    )


# -----------------------------------------------------------------------------------------
# Public estimators
# -----------------------------------------------------------------------------------------


class LogPartitionEstimate(NamedTuple):
    r"""Monte Carlo estimate of :math:`\log C(T)` at every temperature of a ladder.

    Attributes:
        temperatures: ``(M,)``.
        log_c: ``(M,)`` the estimate :math:`\log \frac1S\sum_s \hat C_s(T)`.
        stderr: ``(M,)`` delta-method Monte Carlo standard error of ``log_c``:
            :math:`\mathrm{sd}(\hat C_s) / (\sqrt{S}\, \overline{\hat C_s})` (meaningless
            where the temperature is ``flagged``).
        ess: ``(M,)`` Kish effective sample size of the outer draws
            :math:`(\sum_s \hat C_s)^2 / \sum_s \hat C_s^2` (a small ESS flags heavy tails,
            i.e. a standard error that is itself unreliable).
        num_nonfinite: ``(M,)`` number of outer draws whose log contribution is NaN or
            +inf. These are *not* dropped: ``log_c`` is then NaN/inf, and
            :class:`~numpyro_tempering.ladder.Ladder` refuses it.
        sizes: the :class:`ModelSizes` the estimate is for.
        pareto_k: ``(M,)`` Pareto :math:`\hat k` of the outer draws (:func:`pareto_k`).
        num_samples: S, the number of outer draws.
        element_log_c: ``(M, N)`` per-element :math:`\log c_n(T)` of the ``plate`` (see the
            module docstring), or ``None`` (``plate=None``, or a subsampled plate).
        plate: the plate of ``element_log_c``.
        method: ``"smc"`` (tempered SMC, :mod:`numpyro_tempering.tempered_smc`) or
            ``"prior"`` (plain Monte Carlo over the globals from the prior; also used when
            the contributions do not depend on the globals, which makes it exact).
        replicate_log_c: ``(R, M)`` independent unbiased estimates :math:`\hat C_r(T)`, as
            logs, that ``log_c`` averages: the SMC replicates (``"smc"``) or the outer
            draws (``"prior"``, R = S), for diagnostics of one's own.
        num_stages: ``(M,)`` mean number of SMC stages per replicate (``"smc"``).
        acceptance: ``(M,)`` mean HMC acceptance rate of the last stage (``"smc"``).
        num_particles: P, particles per replicate (``"smc"``).
        selection: the :class:`~numpyro_tempering.handlers.Selection` of tempered sites
            the estimate is for.
        tempering_param: ``(M,)`` smallest :math:`\lambda` the replicates reached
            (``"smc"``): below 1 where the stage cap ``max_stages`` stopped a run (its
            ``log_c`` is then NaN and the temperature flagged).
        prior_log_c: ``(M,)`` the missed-mass check (``"smc"``): log of the mean of
            :math:`e^{L_T}` over prior draws (:func:`~numpyro_tempering.tempered_smc.
            missed_mass`).
        missed_mass: ``(M,)`` where that check says the SMC missed mass (flagged, and
            ``stderr`` raised to at least the shortfall).
        route: ``"ladder"`` (one SMC run along the whole ladder,
            :mod:`numpyro_tempering.ladder_smc`), ``"per-temperature"`` (one SMC per
            temperature), ``"joint"`` (one SMC per temperature over globals and locals,
            :mod:`numpyro_tempering.joint_smc`) or ``"quadrature"`` (quadrature over
            one-dimensional locals and SMC over the globals,
            :mod:`numpyro_tempering.local_quadrature`) for ``"smc"``; ``None`` otherwise.
        quadrature_error: ``(M,)`` with the quadrature over the locals: the measured error of
            ``log_c`` from the quadrature (the change of :math:`\sum_n \log\hat c_n` with
            twice the nodes, averaged over the final weighted particles and the replicates),
            already added to ``stderr``; a temperature where it exceeds
            :data:`~numpyro_tempering.local_quadrature.QUAD_TOLERANCE` is flagged.
        divergent: ``(M,)`` where :math:`\log C(T) = +\infty` exactly: a tempered site's
            normaliser :math:`\int p(x \mid \beta)^{1/T} dx` is :math:`+\infty` (its
            integral diverges, e.g. a Student-t likelihood with ``(df + 1) / T <= 1``) at
            the prior draws of the globals; there ``log_c`` is ``+inf``, ``stderr`` 0, and
            the temperature is not flagged (a warning names it; a
            :class:`~numpyro_tempering.ladder.Ladder` refuses it: the multicanonical model
            is improper at that rung).
        tail_grows: ``(M,)`` (``"smc"``: every route; ``"quadrature"`` and ``"joint"``
            follow the integrand over the globals with the locals integrated out, by their
            quadrature or, for ``"joint"``, each element's Laplace approximation) where
            the tempered integrand over the globals does not decay far from the prior's
            centre
            (:func:`~numpyro_tempering.tempered_smc.tail_grows`), as a code: 1 where it
            grows without slowing, and :math:`\log C(T)` is then most likely
            :math:`+\infty` although every particle's value is finite (the likelihood's
            tempered normalisers outgrow the prior, e.g. a precision whose prior is too
            light at 0); 2 where it still rises up to where the model's log density stops
            being finite (an overflow: mass out of reach in this dtype); else 0. Flagged
            where nonzero, with an infinite ``stderr``.
        collapsed: the Beta locals integrated in closed form
            (:mod:`numpyro_tempering.conjugate`), sorted; ``()`` if none.

    For ``"smc"``, ``log_c`` is :math:`\log\frac1R\sum_r \hat C_r`, ``stderr`` the
    delta-method standard error across the R replicates, ``ess`` the final-stage effective
    sample size of the particles (mean over replicates), ``num_nonfinite`` the number of
    non-finite replicates (``log_c`` is then NaN), and ``flagged`` is :func:`flag_smc
    <numpyro_tempering.tempered_smc.flag_smc>`.
    """

    temperatures: jax.Array
    log_c: jax.Array
    stderr: jax.Array
    ess: jax.Array
    num_nonfinite: jax.Array
    sizes: ModelSizes
    pareto_k: np.ndarray | None = None
    num_samples: int | None = None
    element_log_c: jax.Array | None = None
    plate: str | None = None
    method: str = "prior"
    replicate_log_c: np.ndarray | None = None
    num_stages: np.ndarray | None = None
    acceptance: np.ndarray | None = None
    num_particles: int | None = None
    selection: Selection | None = None
    tempering_param: np.ndarray | None = None
    prior_log_c: np.ndarray | None = None
    missed_mass: np.ndarray | None = None
    route: str | None = None
    quadrature_error: np.ndarray | None = None
    divergent: np.ndarray | None = None
    tail_grows: np.ndarray | None = None
    collapsed: tuple[str, ...] = ()

    def _missed_or_quadrature(self) -> np.ndarray | None:
        flags = [np.asarray(f, bool) for f in (self.missed_mass, self.tail_grows)
                 if f is not None]
        if self.quadrature_error is not None:
            from numpyro_tempering.local_quadrature import quadrature_flags

            flags.append(quadrature_flags(self.quadrature_error))
        return np.logical_or.reduce(flags) if flags else None

    @property
    def flagged(self) -> np.ndarray:
        """Per temperature: whether the estimate cannot be trusted (:func:`flag_untrusted`,
        or :func:`~numpyro_tempering.tempered_smc.flag_smc` for ``method="smc"``)."""
        exact = np.zeros(np.shape(self.temperatures), bool) if self.divergent is None else (
            np.asarray(self.divergent))
        if self.method == "smc":
            from numpyro_tempering.tempered_smc import flag_smc

            return flag_smc(
                self.ess,
                self.num_particles,
                self.replicate_log_c,
                self.acceptance,
                self.num_nonfinite,
                # T = 1 is exact where the SMC set log C(1) = 0 (no importance weights)
                exact=((np.asarray(self.temperatures) == 1.0)
                       & np.all(np.asarray(self.replicate_log_c) == 0.0, axis=0)) | exact,
                missed=self._missed_or_quadrature(),
            )
        if self.num_samples is None:  # built by hand: only non-finite draws can be judged
            return (np.asarray(self.num_nonfinite) > 0) & ~exact
        flags = flag_untrusted(self.ess, self.pareto_k, self.num_samples, self.num_nonfinite)
        return np.asarray(flags) & ~exact


def _summarise(log_c_s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Estimate, delta-method SE, ESS and non-finite count from per-draw log C, shape (S, M)."""
    num = log_c_s.shape[0]
    bad = jnp.isnan(log_c_s) | (log_c_s == jnp.inf)
    log_c = logsumexp(log_c_s, axis=0) - math.log(num)
    top = jnp.max(log_c_s, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(log_c_s - top)  # relative weights C_s / max
    mean = w.mean(0)
    var = jnp.sum((w - mean) ** 2, axis=0) / (num - 1)
    stderr = jnp.sqrt(var / num) / mean
    ess = jnp.sum(w, 0) ** 2 / jnp.sum(w**2, 0)
    return log_c, stderr, ess, bad.sum(0)


def _element_split(draws: _Draw, log_c: jax.Array) -> jax.Array:
    """Per-element log c_n: log mean_s c_sn plus an even share of log C - sum_n of those."""
    num = draws.element_log_mean.shape[0]
    element = logsumexp(draws.element_log_mean, axis=0) - math.log(num)  # (M, E)
    gap = log_c - element.sum(-1)
    return element + (gap / element.shape[-1])[:, None]


def _prior_estimate(
    rng_key: jax.Array,
    model: Callable,
    selection: Selection,
    temps: jax.Array,
    structure: _Structure,
    args: tuple,
    kwargs: dict,
    *,
    num_samples: int,
    num_inner: int,
    plate: str | None,
    batch_size: int | None,
    fallback: Fallback,
) -> tuple[LogPartitionEstimate, list[str], bool, list[str]]:
    """The plain Monte Carlo estimate (method ``"prior"``), without its warnings; also the
    sites whose normaliser at T = 1 is NaN, whether every draw gave the same value
    (contributions free of the globals: exact), and the sites whose normaliser is +inf at
    some temperature (``divergent``). Checks ``log Z(1) = 0``."""
    num_temps = temps.shape[0]
    per_element = plate is not None

    def summarise(draws: _Draw) -> tuple:
        log_c, stderr, ess, bad = _summarise(draws.log_c)
        element = _element_split(draws, log_c) if per_element else None
        site_log_z = jax.tree.map(lambda v: _farthest_from_zero(v, 0), draws.site_log_z)
        return draws.log_c, log_c, stderr, ess, bad, element, site_log_z

    run = _compiled_draws(
        "prior", model, selection, args, kwargs, summarise, plate=plate, fallback=fallback,
        num_samples=num_samples, num_inner=num_inner, batch_size=batch_size,
    )

    run_temps = _with_one(temps)
    log_c_s, log_c, stderr, ess, bad, element, site_log_z = run(rng_key, run_temps)
    nan_sites = _check_log_z_one(site_log_z, run_temps, "log C")
    infinite = sorted(n for n, v in site_log_z.items()
                      if np.any(np.asarray(v)[..., :num_temps] == np.inf))
    if element is not None and element.shape[-1] != structure.sizes.plate_size(plate):
        warnings.warn(
            f"log_partition: no per-element log c_n for plate '{plate}', which the model "
            f"subsamples (a run visits {element.shape[-1]} of its "
            f"{structure.sizes.plate_size(plate)} elements); run the model on the full plate "
            "for them (a per-element multicanonical temperature needs them).",
            UserWarning,
            stacklevel=3,
        )
        element = None  # a subsampled plate: only B of the N elements were visited
    cut = slice(0, num_temps)
    est = LogPartitionEstimate(
        temps,
        log_c[cut],
        stderr[cut],
        ess[cut],
        bad[cut],
        structure.sizes,
        pareto_k=pareto_k(np.asarray(log_c_s)[:, cut]),
        num_samples=num_samples,
        element_log_c=None if element is None else element[cut],
        plate=plate if element is not None else None,
        replicate_log_c=np.asarray(log_c_s)[:, cut],
        selection=selection,
    )
    est = _with_divergent(est, np.any(np.asarray(log_c_s)[:, cut] == np.inf, axis=0))
    with np.errstate(invalid="ignore"):  # inf - inf where divergent: not constant
        constant = bool(np.all(
            np.ptp(np.asarray(log_c_s), axis=0) <= 1e-5 * (1.0 + np.abs(np.asarray(log_c)))))
    return est, nan_sites, constant, infinite


#: compiled estimators (tempered SMC, prior Monte Carlo, analytic, Jensen), per model,
#: tempering selection, budget and argument structure: compiled once per model and shape
_SMC_CACHE: dict = {}
_SMC_CACHE_SIZE = 32
#: XLA options of the compiled SMC estimator
SMC_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
#: ... and for the quadrature over the locals (:mod:`numpyro_tempering.local_quadrature`)
QUAD_COMPILER_OPTIONS = {"xla_backend_optimization_level": 3}


def _compiled_draws(
    tag: str,
    model: Callable,
    selection: Selection,
    args: tuple,
    kwargs: dict,
    summarise: Callable[[_Draw], Any],
    **settings: Any,
) -> Callable:
    """``(key, temps) -> summarise(_draws(key, marked, temps, ..., **settings))``, compiled
    once per ``tag`` (which names ``summarise``), model, selection, settings and argument
    structure (:func:`_cached_jit`)."""

    def make(marked: Callable, args: tuple, kwargs: dict) -> Callable:
        return lambda key, temps: summarise(_draws(key, marked, temps, args, kwargs, **settings))

    extra = tuple(sorted(settings.items()))
    return _cached_jit(tag, model, selection, args, kwargs, extra, make)


def _cached_jit(
    tag: str,
    model: Callable,
    selection: Selection,
    args: tuple,
    kwargs: dict,
    extra: tuple,
    make: Callable,
    compiler_options: dict | None = None,
) -> Callable:
    """``(key, temps) -> make(marked, args, kwargs)(key, temps)``, compiled once per ``tag``,
    model, tempering selection, ``extra`` settings and argument structure: array arguments
    are traced (so other data of the same shapes reuse the compiled function), anything else
    is part of the cache key (unhashable arguments: no caching)."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(v, (jax.Array, np.ndarray)) for v in leaves]
    static = tuple(None if a else v for v, a in zip(leaves, is_array, strict=True))
    shapes = tuple(
        (jnp.shape(v), jnp.result_type(v)) if a else None
        for v, a in zip(leaves, is_array, strict=True)
    )

    def build() -> Callable:
        def run(key: jax.Array, temps: jax.Array, dynamic: list, *state: Any) -> Any:
            it = iter(dynamic)
            full = [next(it) if a else v for v, a in zip(static, is_array, strict=True)]
            a, k = jax.tree.unflatten(treedef, full)
            return make(_marked(model, selection), a, k)(key, temps, *state)

        return jax.jit(run, compiler_options=compiler_options)

    dynamic = [v for v, a in zip(leaves, is_array, strict=True) if a]
    try:
        # the Binomial terms of partition.binomial_terms are baked into the program
        cache_key = (tag, model, selection, extra, treedef, static, shapes,
                     _BINOMIAL_TERMS.get())
        hash(cache_key)
    except TypeError:
        cache_key = None
    if cache_key is None:
        fn = build()
    else:
        fn = _SMC_CACHE.get(cache_key)
        if fn is None:
            if len(_SMC_CACHE) >= _SMC_CACHE_SIZE:
                _SMC_CACHE.pop(next(iter(_SMC_CACHE)))
            fn = _SMC_CACHE[cache_key] = build()
    return lambda key, temps, *state: fn(key, temps, dynamic, *state)


def _smc_runner(
    model: Callable,
    selection: Selection,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    fallback: Fallback,
    global_names: tuple[str, ...],
    settings: Any,
    per_element: bool,
    ladder: bool = False,
    local: str | None = None,
    series: bool = False,
) -> Any:
    """Compiled once per model, selection, budget and argument structure
    (:func:`_cached_jit`): ``(key, temps) -> SMCRun`` of the per-temperature route (with
    ``local="joint"``: the joint SMC over globals and locals,
    :mod:`numpyro_tempering.joint_smc`; ``local="quadrature"``: quadrature over the locals
    and SMC over the globals, :mod:`numpyro_tempering.local_quadrature`), or
    with ``ladder`` the ``(init, advance)`` pair of
    :func:`~numpyro_tempering.ladder_smc.build_ladder_runner`."""
    from numpyro_tempering.joint_smc import build_joint_runner
    from numpyro_tempering.ladder_smc import build_ladder_runner
    from numpyro_tempering.local_quadrature import build_quadrature_runner
    from numpyro_tempering.tempered_smc import build_runner

    extra = (plate, fallback, global_names, settings, per_element, local)
    per_temperature = {None: build_runner, "joint": build_joint_runner,
                       "quadrature": build_quadrature_runner}[local]

    def compiled(tag: str, pick: Callable, options: dict | None) -> Callable:
        def make(marked: Callable, a: tuple, k: dict) -> Callable:
            build = build_ladder_runner if ladder else per_temperature
            return pick(build(marked, a, k, plate, fallback, global_names, settings,
                              per_element))

        return _cached_jit(tag, model, selection, args, kwargs, extra, make, options)

    if not ladder:
        # XLA's backend optimisations more than double the compile time of the SMC loop
        # (30 s -> 12 s on 2 cores) for a ~30% slower run: level 0 pays for itself
        # ... but not for the quadrature over the locals, whose many node evaluations per
        # particle run 2.5x slower at level 0 (gamma local, N = 500: 36 s against 14 s a
        # call, for a compile that is no longer): XLA's default level, asked for explicitly
        # (so that a process-wide XLA_FLAGS level 0, as in the test suite, does not apply)
        # ... nor for a series normaliser (``series``: Binomial(10) logistic regression,
        # N = 300, 4 temperatures: 46 s against 70 s, and 4 s against 44 s a second call)
        fast = local == "quadrature" or series
        options = QUAD_COMPILER_OPTIONS if fast else SMC_COMPILER_OPTIONS
        return compiled("smc", lambda run: run, options)
    # the ladder's stage loop: default optimisation (level 0 made it 6x slower for a 10%
    # shorter compile)
    return (compiled("ladder-init", lambda pair: pair[0], None),
            compiled("ladder", lambda pair: pair[1], None))


def _global_sites(marked: Callable, args: tuple, kwargs: dict, plate: str | None) -> tuple:
    """(continuous global latent names, discrete global latent names) of the marked model."""
    tr = structure_trace(marked, args, kwargs)
    is_global = _global_rule(plate)
    names = [
        n for n, s in tr.items()
        if s["type"] == "sample" and not s["is_observed"] and is_global(s)
    ]
    discrete = tuple(n for n in names if tr[n]["fn"].support.is_discrete)
    return tuple(n for n in names if n not in discrete), discrete


def _refuse_fixed_globals(marked: Callable, args: tuple, kwargs: dict, names: tuple) -> None:
    """A ``ValueError`` naming the continuous global latents whose value does not depend on
    the random key (a ``handlers.substitute`` around the model fixed it, or a ``Delta``):
    the SMC integrates over every global latent with values of its own, which override an
    inner ``substitute``, so log C came out as if the site were not fixed (found by a
    probe). Read off the jaxpr of one prior run: nothing is compiled."""
    if not names:
        return

    def run(key: jax.Array) -> list:
        tr = trace(seed(marked, key)).get_trace(*args, **kwargs)
        return [tr[n]["value"] for n in names]

    jaxpr = jax.make_jaxpr(run)(random.PRNGKey(0)).jaxpr
    tainted = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    fixed = [n for n, v in zip(names, jaxpr.outvars, strict=True)
             if isinstance(v, Literal) or v not in tainted]
    if fixed:
        raise ValueError(
            f"log_partition: the global latent site(s) {fixed} have a value that does not "
            "depend on the random key (fixed by handlers.substitute, or a Delta); "
            "log_partition integrates over every global latent and would ignore it. To fix "
            "a global, condition on it (handlers.condition(model, {name: value}) with "
            "sites= naming the tempered observations), or make it an argument of the model."
        )


def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"log_partition: the tempered SMC estimator cannot handle this model ({reason}); "
        "falling back to method='prior' (plain Monte Carlo over the globals from the prior, "
        "which is unreliable for a peaked integrand: check .flagged, .ess and .pareto_k).",
        UserWarning,
        stacklevel=3,
    )


#: the accuracy contract's standard error (nats): above it log_partition warns, even where
#: the replicates agree well enough not to be flagged
MAX_STDERR = 0.1


def _warn_imprecise(est: LogPartitionEstimate) -> None:
    """Warn where a temperature's standard error exceeds ``MAX_STDERR`` but is not flagged
    (flagged ones have their own warning)."""
    se = np.asarray(est.stderr, np.float64)
    wide = ~np.asarray(est.flagged, bool) & np.isfinite(se) & (se > MAX_STDERR)
    if not np.any(wide):
        return
    show = slice(0, 8)
    reps = ""
    if est.replicate_log_c is not None:
        rows = np.asarray(est.replicate_log_c).T[wide][:4]
        reps = f" (replicates' log C-hat_r {[_rounded(r, 2) for r in rows]})"
    warnings.warn(
        f"log_partition: standard error {_rounded(se[wide][show], 3)} nats > {MAX_STDERR} at "
        f"T = {_rounded(np.asarray(est.temperatures)[wide][show], 4)}: the estimate is "
        f"imprecise{reps}; increase num_particles / num_replicates / num_mcmc_steps.",
        UserWarning,
        stacklevel=3,
    )


def _warn_untrusted_smc(est: LogPartitionEstimate, max_stages: int | None = None) -> None:
    from numpyro_tempering.tempered_smc import MAX_REPLICATE_SD

    _warn_imprecise(est)
    flagged = est.flagged
    if not np.any(flagged):
        return
    temps = np.asarray(est.temperatures)
    reps = np.asarray(est.replicate_log_c)[:, flagged]
    with np.errstate(invalid="ignore"):
        spread = (
            np.std(reps, axis=0, ddof=1) if reps.shape[0] > 1 else np.full(reps.shape[1], 0.0)
        )
    show = slice(0, 8)
    reasons = []
    lam = est.tempering_param
    if lam is not None and np.any(capped := flagged & (np.asarray(lam) < 1.0)):
        reasons.append(
            f"at T = {_rounded(temps[capped][show], 4)} the SMC stopped at the stage cap "
            f"(max_stages = {max_stages}) with lambda = "
            f"{_rounded(np.asarray(lam)[capped][show], 4)} < 1 (log C is NaN there; "
            "method='prior' is the fallback)"
        )
    if est.missed_mass is not None and np.any(missed := flagged & est.missed_mass):
        rays = missed & np.isinf(np.asarray(est.stderr))  # only the rays see it (ladder)
        if est.tail_grows is not None:
            rays &= ~np.asarray(est.tail_grows, bool)
        if np.any(drawn := missed & ~rays):
            reasons.append(
                f"at T = {_rounded(temps[drawn][show], 4)} prior draws see more mass than the "
                f"SMC (log C from prior draws "
                f"{_rounded(np.asarray(est.prior_log_c)[drawn][show], 3)} > SMC "
                f"{_rounded(np.asarray(est.log_c)[drawn][show], 3)}): a mode was missed; "
                "the standard error is raised to at least the shortfall"
            )
        if np.any(rays):
            reasons.append(
                f"at T = {_rounded(temps[rays][show], 4)} points on the tail check's rays have "
                "a higher tilted density than every particle: a mode was missed (the "
                "standard error is infinite: the shortfall is unknown)"
            )
    if est.tail_grows is not None:
        from numpyro_tempering.tempered_smc import GROWS, RISES_UNSEEN, TAIL_DOUBLINGS

        code = np.asarray(est.tail_grows)
        if np.any(grows := flagged & (code == GROWS)):
            reasons.append(
                f"at T = {_rounded(temps[grows][show], 4)} the tempered integrand over the "
                f"globals still grows {2 ** (TAIL_DOUBLINGS - 1)} prior scales from the "
                "prior's centre (or as far as it is finite), without slowing: log C(T) is "
                "most likely +inf (the likelihood's tempered normalisers outgrow the prior "
                "there, e.g. a precision or scale whose prior is too light at its boundary) "
                "and the finite estimate means nothing; the standard error is set to inf"
            )
        if np.any(unseen := flagged & (code == RISES_UNSEEN)):
            reasons.append(
                f"at T = {_rounded(temps[unseen][show], 4)} the tempered integrand over the "
                "globals still rises where the model's log density stops being finite "
                "(an overflow, e.g. a log link's exp(eta) beyond the float range): the mass "
                "beyond is not counted and log C(T) may be far higher; the standard error is "
                "set to inf (float64, jax.config.update('jax_enable_x64', True), reaches "
                "further)"
            )
    if est.quadrature_error is not None:
        from numpyro_tempering.local_quadrature import QUAD_TOLERANCE, quadrature_flags

        quad = np.asarray(est.quadrature_error)
        if np.any(lost := flagged & np.isnan(quad)):
            reasons.append(
                f"at T = {_rounded(temps[lost][show], 4)} the quadrature check over the "
                "locals is NaN (the model's log density is NaN at every quadrature node of "
                "an element at some final particle): the quadrature error is unknown"
            )
        if np.any(inexact := flagged & np.isfinite(quad) & quadrature_flags(quad)):
            reasons.append(
                f"at T = {_rounded(temps[inexact][show], 4)} the quadrature over the locals "
                f"changes log C by {_rounded(quad[inexact][show], 3)} nats with twice the "
                f"nodes (tolerance {QUAD_TOLERANCE}; added to the standard error): the "
                "locals' conditionals are far from Gaussian, or the model's log density is "
                "NaN at nodes that carry weight (e.g. a log link's exp beyond the float "
                "range; counted as the rule's Gaussian weighs them)"
            )
    warnings.warn(
        "log_partition: the tempered SMC estimate of log C(T) cannot be trusted at "
        f"T = {_rounded(temps[flagged][show], 4)}: replicate spread (sd of log C-hat_r) "
        f"{_rounded(spread[show], 3)} (need <= {MAX_REPLICATE_SD}), final-stage ESS "
        f"{_rounded(np.asarray(est.ess)[flagged][show], 1)} of P = {est.num_particles} "
        "particles, last-stage acceptance "
        f"{_rounded(np.asarray(est.acceptance)[flagged][show], 2)}, "
        f"non-finite replicates {np.asarray(est.num_nonfinite)[flagged][show].tolist()}. "
        + "".join(r[0].upper() + r[1:] + ". " for r in reasons)
        + "Increase num_particles / num_replicates / num_mcmc_steps, or give a closed form "
        "(Ladder.with_log_partition_values).",
        UserWarning,
        stacklevel=3,
    )


#: temperatures per compiled SMC call: the progress bar advances by this many rungs, and a
#: slow rung holds up only the rungs of its own chunk (they run in lock step)
SMC_CHUNK = 8


def _in_chunks(call: Callable, temps: jax.Array, progress_bar: bool, desc: str) -> Any:
    """``call(chunk, keep) -> (SMCRun, stages)`` over chunks of ``SMC_CHUNK`` temperatures
    (the last one padded with its last temperature, so one compiled function serves every
    chunk; ``keep`` of its rungs are real), joined, with a tqdm progress bar over the rungs
    showing the mean and largest ``stages``."""
    num = temps.shape[0]
    size = min(num, SMC_CHUNK)
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=num, desc=desc, unit="rung")
    pieces = []
    try:
        for start in range(0, num, size):
            chunk = temps[start : start + size]
            pad = size - chunk.shape[0]
            if pad:
                chunk = jnp.concatenate([chunk, jnp.repeat(chunk[-1:], pad)])
            out, stages = call(chunk, size - pad)
            pieces.append(jax.device_get(out))
            if bar is not None:
                stages = np.asarray(stages)
                bar.set_postfix(stages=f"{stages.mean():.1f}", max_stages=int(stages.max()))
                bar.update(size - pad)
    finally:
        if bar is not None:
            bar.close()
    return _concatenated(pieces, num)


def _run_in_chunks(runner: Callable, key: jax.Array, temps: jax.Array, progress_bar: bool):
    """``runner(key, temps)`` over chunks of ``SMC_CHUNK`` temperatures (:func:`_in_chunks`;
    the bar shows the stages per rung). Every chunk gets the same key: the result is the same
    as one call over all temperatures (common random numbers across the rungs)."""

    def call(chunk: jax.Array, keep: int) -> tuple:
        out = runner(key, chunk)
        return out, np.asarray(out.num_stages)[:, :keep]

    return _in_chunks(call, temps, progress_bar, "log C(T), tempered SMC")


def _run_ladder(
    runners: tuple[Callable, Callable], key: jax.Array, temps: jax.Array, progress_bar: bool
):
    """One sequential run over the ascending rungs ``temps``
    (:mod:`numpyro_tempering.ladder_smc`), ``SMC_CHUNK`` rungs per compiled call
    (:func:`_in_chunks`; a repeated rung takes no stage), the particles carried from call to
    call; the bar shows the stages so far."""
    init, advance = runners
    carry = [init(key, temps[: min(temps.shape[0], SMC_CHUNK)])]

    def call(chunk: jax.Array, keep: int) -> tuple:
        out, carry[0] = advance(key, chunk, carry[0])
        return out, carry[0].stages

    return _in_chunks(call, temps, progress_bar, "log C(T), tempered SMC along the ladder")


def _concatenated(pieces: list, num: int) -> Any:
    """The chunks' ``SMCRun`` outputs joined along the temperatures, padding dropped."""

    def cat(*parts: Any) -> np.ndarray:
        axis = 0 if np.ndim(parts[0]) == 1 else 1  # (M,) or (R, M[, E])
        return np.take(np.concatenate(parts, axis=axis), np.arange(num), axis=axis)

    return jax.tree.map(cat, *pieces)


def _smc_estimate(
    rng_key: jax.Array,
    model: Callable,
    marked: Callable,
    selection: Selection,
    temps: jax.Array,
    structure: _Structure,
    args: tuple,
    kwargs: dict,
    global_names: tuple[str, ...],
    settings: Any,
    plate: str | None,
    fallback: Fallback,
    progress_bar: bool = False,
    ladder: bool = False,
    local: str | None = None,
) -> LogPartitionEstimate:
    from numpyro_tempering.tempered_smc import combine, missed_mass

    per_element = plate is not None and (
        structure.sizes.plate_size(plate) == _visited_size(marked, args, kwargs, plate)
    )
    runner_args = (model, selection, args, kwargs, plate, fallback, global_names, settings,
                   per_element)
    if ladder:
        order = np.argsort(np.asarray(temps), kind="stable")
        runners = _smc_runner(*runner_args, ladder=True)
        out = _run_ladder(runners, rng_key, temps[order], progress_bar)
        back = np.argsort(order)
        behind = np.cumsum(np.asarray(out.num_stages), axis=1)[:, back]  # stages up to a rung
        out = jax.tree.map(
            lambda v: np.take(v, back, axis=0 if np.ndim(v) == 1 else 1), out
        )
    else:
        out = _run_in_chunks(_smc_runner(*runner_args, local=local, series=structure.series),
                             rng_key, temps, progress_bar)
        behind = np.asarray(out.num_stages)
    # log C(1) = 0 exactly (every log Z(1) was checked), unless untempered observed sites
    # (importance weights) make C(1) != 1: then T = 1 is estimated like any other rung
    one = (np.asarray(temps) == 1.0) & (not structure.untempered_observed)
    reps = np.where(one[None, :], 0.0, np.asarray(out.log_z, np.float64))
    log_c, stderr, bad = (np.asarray(v) for v in combine(jnp.asarray(reps)))
    # floating-point floor: every stage adds a rounding of the size eps |log C| to log C-hat
    # (the replicates' spread does not see it where the stages' weights are constant)
    eps = float(jnp.finfo(temps.dtype).eps)
    floor = eps * np.abs(log_c) * np.sqrt(np.maximum(behind.max(0), 1))
    stderr = np.where(one, 0.0, np.maximum(stderr, floor))
    prior_log_c = np.asarray(out.prior_log_c, np.float64)
    missed = missed_mass(
        log_c, stderr, prior_log_c, np.asarray(out.prior_ess), settings.num_prior_draws
    ) & ~one
    # never a small standard error around a value that misses mass: at least the shortfall
    stderr = np.where(missed, np.maximum(stderr, prior_log_c - log_c), stderr)
    if out.ray_beyond is not None:  # the rays see a region no particle reached: the
        # shortfall is unknown
        beyond = np.asarray(out.ray_beyond, bool) & ~one & np.isfinite(log_c)
        stderr = np.where(beyond, np.inf, stderr)
        missed = missed | beyond
    grows = None
    if out.tail_grows is not None:  # log C most likely +inf, or mass out of reach: no
        # finite error bar means much
        grows = np.where(one, 0, np.asarray(out.tail_grows)).astype(np.int8)
        stderr = np.where(grows > 0, np.inf, stderr)
    quad_error = None
    if out.quad_error is not None:  # deterministic: added to the standard error
        quad_error = np.where(one, 0.0, np.mean(np.asarray(out.quad_error, np.float64), 0))
        stderr = stderr + np.abs(quad_error)
    element = None
    if per_element:
        with warnings.catch_warnings():  # every replicate NaN at a rung: NaN, flagged
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(np.asarray(out.element_mean, np.float64), axis=0)  # (M, E)
        element = mean + ((log_c - mean.sum(-1)) / mean.shape[-1])[:, None]
        element = np.where(one[:, None], 0.0, element)
    return LogPartitionEstimate(
        temps,
        jnp.asarray(log_c, temps.dtype),
        jnp.asarray(stderr, temps.dtype),
        jnp.asarray(np.asarray(out.ess).mean(0), temps.dtype),
        jnp.asarray(bad),
        structure.sizes,
        pareto_k=np.full(temps.shape[0], np.nan),
        num_samples=settings.num_particles,
        element_log_c=None if element is None else jnp.asarray(element, temps.dtype),
        plate=plate if per_element else None,
        method="smc",
        replicate_log_c=reps,
        num_stages=np.asarray(out.num_stages).mean(0),
        acceptance=np.asarray(out.acceptance).min(0),
        num_particles=settings.num_particles,
        selection=selection,
        tempering_param=np.where(one, 1.0, np.asarray(out.tempering_param).min(0)),
        prior_log_c=prior_log_c,
        missed_mass=missed,
        route="ladder" if ladder else local or "per-temperature",
        quadrature_error=quad_error,
        tail_grows=grows,
    )


def _subsampled_plates(marked: Callable, args: tuple, kwargs: dict) -> list[str]:
    """Names of the plates a run visits only a subsample of."""
    return _subsampled_in(structure_trace(marked, args, kwargs))


def _subsampled_in(tr: dict) -> list[str]:
    """Names of the plates of the trace ``tr`` that its run visited only a subsample of."""
    return sorted(
        n
        for n, site in tr.items()
        if site["type"] == "plate" and int(jnp.shape(site["value"])[0]) != int(site["args"][0])
    )


def _visited_size(marked: Callable, args: tuple, kwargs: dict, plate: str) -> int:
    """Number of elements of ``plate`` a run visits (its subsample size)."""
    tr = structure_trace(marked, args, kwargs)
    return int(jnp.shape(tr[plate]["value"])[0])


METHODS = ("smc", "prior")
ROUTES = ("auto", "ladder", "per-temperature", "joint", "quadrature")
#: ``route="auto"`` walks the ladder in one run from this many temperatures on (all >= 1)
LADDER_MIN_RUNGS = 8


def _largest_binomial_count(model: Callable, args: tuple, kwargs: dict,
                            sites: tuple[str, ...]) -> int | None:
    """The largest count of the tempered Binomial ``sites`` plus one, for counts that are
    data (traced in the compiled runners, where the normaliser would otherwise run the
    series' loop: 144 terms for a Binomial(20)), found by running the model once on its
    data; ``None`` without such sites (:attr:`_Structure.binomial_sites`: none either when a
    plate is subsampled), when the run fails, or when a count is at least
    ``partition._BINOMIAL_ONE_CHUNK``. Under :func:`~numpyro_tempering.partition.binomial_terms`
    a count that differs in another run (a count drawn from a discrete latent, which the
    SMC refuses) gives NaN."""
    from numpyro_tempering.partition import _BINOMIAL_ONE_CHUNK

    if not sites:
        return None
    try:
        tr = trace(seed(model, 0)).get_trace(*args, **kwargs)
        most = max(float(np.max(np.asarray(_unwrapped(tr[n]["fn"]).total_count, np.float64),
                                initial=0.0)) for n in sites)
    except Exception:  # a model that runs only under jit: the series' loop
        return None
    return int(most) + 1 if np.isfinite(most) and most < _BINOMIAL_ONE_CHUNK else None


def log_partition(
    rng_key: jax.Array,
    model: Callable,
    temperatures: jax.typing.ArrayLike,
    *args: Any,
    method: str = "smc",
    num_samples: int = 100,
    num_inner: int = 1,
    plate: str | None = None,
    sites: str | Collection[str] | Callable | Selection | None = None,
    latent: str | Collection[str] = (),
    exclude: str | Collection[str] = (),
    joint: bool = False,
    batch_size: int | None = None,
    fallback: Fallback = None,
    num_particles: int = 256,
    num_replicates: int = 4,
    num_mcmc_steps: int = 4,
    max_stages: int = 100,
    progress_bar: bool = True,
    route: str = "auto",
    **kwargs: Any,
) -> LogPartitionEstimate:
    r"""Estimate :math:`\log C(T)` at every temperature (supplement eq. 1-3 and 7).

    ``method="smc"`` (default): adaptive tempered SMC over the globals
    (:mod:`numpyro_tempering.tempered_smc`), ``num_replicates`` independent runs of
    ``num_particles`` particles per temperature, with standard errors from the replicates.
    Before it, a plain Monte Carlo probe (16 prior draws) checks :math:`\log Z(1) = 0` for
    every tempered site, and when the contributions are the same for every draw of the
    globals (they do not depend on them) its exact value is returned instead (``method``
    ``"prior"``, ``stderr`` 0). Beta locals read only as the ``probs`` of one tempered
    Bernoulli or Binomial site are first integrated in closed form
    (:mod:`numpyro_tempering.conjugate`: the rat-tumour model's shape); other continuous
    local latents that change the contributions are integrated by default
    (``route="auto"`` or ``"quadrature"``): one-dimensional locals (per element, on the
    unconstrained space) by adaptive Gauss-Hermite quadrature given the globals and tempered
    SMC over the globals
    (:mod:`numpyro_tempering.local_quadrature`; the quadrature error is measured, added to
    ``stderr`` and flagged above 0.02 nats, ``quadrature_error``). ``route="joint"``
    (opt-in, any dimension) runs one SMC over globals and locals jointly
    (:mod:`numpyro_tempering.joint_smc`); both run one SMC per temperature. The quadrature
    meets the contract on Gaussian, log-normal and Gamma locals at N = 500 in 32-49 s where
    the joint SMC misses it on the Gamma (``tests/test_log_partition_locals.py``,
    ``benchmarks/log_partition_locals.py``), and on a Poisson log link under a half-normal
    scale (a funnel) within 0.03 nats, where the joint SMC is 1.3-2.9 nats low; that
    model's first call takes 89-116 s (mostly XLA compiling the runner; 23-33 s once
    compiled). Locals of more dimensions per element without ``route="joint"``, and routes
    that do not integrate locals (``"ladder"``, ``"per-temperature"``), fall back to
    ``method="prior"`` (nested Monte Carlo, supplement eq. 7: biased low in log) with a
    warning that names the sites and the routes. Models the SMC cannot
    handle -- discrete globals, discrete locals, locals with ``plate=None``, subsampled
    plates -- fall back to ``method="prior"`` with a ``UserWarning`` naming the sites or the
    reason; a model without globals uses it directly (no outer integral).

    **Routes** (``"smc"``): with ``route="auto"`` a ladder of ``LADDER_MIN_RUNGS`` (8) or
    more temperatures, all >= 1, is walked in **one sequential run** per replicate (not
    with locals that matter, nor with untempered observed sites: their importance weights
    make :math:`C(1) \ne 1`, which the ladder's start from the prior cannot see)
    (``route="ladder"``, :mod:`numpyro_tempering.ladder_smc`: from the prior at T = 1
    through every rung in :math:`1/T`, log C read off at each); shorter ladders, or ones
    with T < 1, run one SMC per temperature (``route="per-temperature"``). On the paper's
    100-rung ladder at N = 2000 the ladder route took 99 stages in all and was within 0.01
    nats of the closed form at every rung (``benchmarks/log_partition_ladder.py``). A
    ladder that the missed-mass or ray check flags, or whose replicates disagree by more
    than ``MAX_REPLICATE_SD`` (a mode no prior draw reaches, e.g. the far minority
    component of a mixture prior), is run again one SMC per temperature, whose Newton
    starts from the grid or the rays can reach it (``route`` of the result says which
    ran).

    Error bars (``"smc"``): bias-aware (the log of a mean of replicates is biased low by
    about :math:`s_\delta^2/2`; replicates that disagree by several nats give a standard
    error of that size, not the delta method's at most 1), at least the float rounding
    :math:`\epsilon |\log C| \sqrt{\text{stages}}`, and **correlated across the rungs**:
    in the per-temperature route every temperature uses the same random numbers, in the
    ladder route each rung's estimate is the previous one's times more weights, so
    differences :math:`\log C(T_i) - \log C(T_j)` are more accurate than the standard errors
    suggest and sums less; :func:`~numpyro_tempering.tempered_smc.replicate_covariance` of
    ``replicate_log_c`` gives the covariance. Time is bounded (``max_stages``), and mass
    that prior draws see but the SMC missed is flagged
    (:func:`~numpyro_tempering.tempered_smc.missed_mass`).

    ``method="prior"``: the plain Monte Carlo estimator of the module docstring
    (``num_samples * num_inner * M`` model runs, ``batch_size`` outer samples at a time).

    Both warn (``UserWarning`` naming the temperatures) where the estimate cannot be
    trusted (:attr:`LogPartitionEstimate.flagged`).

    Args:
        rng_key: PRNG key.
        model: the *untempered* NumPyro model.
        temperatures: the ladder, shape ``(M,)`` (any positive values).
        *args: model arguments (data of the right shape; values are not read).
        **kwargs: model keyword arguments (likewise).
        method: ``"smc"`` or ``"prior"``.
        num_samples: number S of outer draws of the globals (``"prior"``; >= 2).
        num_inner: number K of inner draws of the locals per outer draw and element.
        plate: name of the plate whose elements are averaged separately (the data plate;
            eq. 7), and whose per-element :math:`\log c_n(T)` are returned. ``None``: the
            whole model is one element.
        sites, latent, exclude, joint: which sites are tempered and how, as in
            :class:`~numpyro_tempering.temper` (default: the observed sites).
        batch_size: outer draws evaluated at once (``"prior"``; default: all).
        fallback: passed to :func:`~numpyro_tempering.partition.tempered` for
            distributions without a closed form (``"quadrature"`` or ``"enumerate"``).
        num_particles: P, SMC particles per replicate (``"smc"``).
        num_replicates: R, independent SMC runs per temperature (``"smc"``; >= 2).
        num_mcmc_steps: HMC steps per particle and SMC stage (``"smc"``).
        max_stages: cap on the SMC stages per run (``"smc"``): a run stopped by it gives
            NaN at its temperature, which is flagged, and the warning says so (with the
            :math:`\lambda` reached); the cap bounds the run time of every call.
        progress_bar: show a tqdm progress bar over the rungs (``"smc"``; as NumPyro's
            ``MCMC``, on by default), with the mean and largest number of SMC stages.
        route: ``"auto"``, ``"ladder"`` (one run along the ladder; all temperatures >= 1,
            else a ``ValueError``; ``max_stages`` then caps the stages *between* rungs),
            ``"per-temperature"`` (``"smc"``; see Routes above), ``"joint"`` or
            ``"quadrature"`` (models with continuous locals that change the contributions,
            see above; a ``ValueError`` for others).

    Returns:
        :class:`LogPartitionEstimate`.

    Example:
        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> def model(x):  # Bernoulli: C(T) = E_p[(p^(1/T) + (1 - p)^(1/T))^N]
        ...     p = numpyro.sample("p", dist.Uniform(0.0, 1.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Bernoulli(p), obs=x)
        >>> est = log_partition(jax.random.PRNGKey(0), model, jnp.array([1.0, 2.0]),
        ...                     jnp.zeros(5), method="prior", num_samples=1000)
        >>> round(float(est.log_c[0]), 5), bool(est.stderr[1] < 0.01), est.flagged.tolist()
        (0.0, True, [False, False])
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}.")
    if route not in ROUTES:
        raise ValueError(f"`route` must be one of {ROUTES}, got {route!r}.")
    options = dict(num_samples=num_samples, num_inner=num_inner, plate=plate,
                   batch_size=batch_size, fallback=fallback, num_particles=num_particles,
                   num_replicates=num_replicates, num_mcmc_steps=num_mcmc_steps,
                   max_stages=max_stages, progress_bar=progress_bar, route=route)
    selection = Selection.of(sites, latent, exclude, joint)
    prepared = _prepare(model, temperatures, args, kwargs, plate, selection)
    collapsed = collapsible_locals(prepared[0], args, kwargs, selection)
    if not collapsed:
        return _log_partition(rng_key, model, temperatures, args, kwargs, method=method,
                              selection=selection, prepared=prepared, **options)
    # Beta locals read only by a Binomial: integrated in closed form; a tempered one is hidden
    # from temper now (its reader's normaliser tempers it), so the selection loses its name
    inner = dataclasses.replace(selection, latent=selection.latent - set(collapsed))
    est = _log_partition(rng_key, collapse_locals(model, collapsed), temperatures, args,
                         kwargs, method=method, selection=inner, **options)
    return est._replace(selection=selection if est.selection is not None else None,
                        collapsed=tuple(sorted(collapsed)))


def _log_partition(
    rng_key: jax.Array,
    model: Callable,
    temperatures: jax.typing.ArrayLike,
    args: tuple,
    kwargs: dict,
    *,
    method: str,
    selection: Selection,
    num_samples: int,
    num_inner: int,
    plate: str | None,
    batch_size: int | None,
    fallback: Fallback,
    num_particles: int,
    num_replicates: int,
    num_mcmc_steps: int,
    max_stages: int,
    progress_bar: bool,
    route: str,
    prepared: tuple | None = None,
) -> LogPartitionEstimate:
    """:func:`log_partition` for a model (collapsed or not) and a selection; ``prepared``:
    :func:`_prepare`'s result for them, if the caller has it."""
    num_samples = _check_count(num_samples, "num_samples", 2)
    num_inner = _check_count(num_inner, "num_inner")
    num_particles = _check_count(num_particles, "num_particles", 2)
    num_replicates = _check_count(num_replicates, "num_replicates", 2)
    num_mcmc_steps = _check_count(num_mcmc_steps, "num_mcmc_steps")
    max_stages = _check_count(max_stages, "max_stages")
    if batch_size is not None:
        batch_size = _check_count(batch_size, "batch_size")
    marked, temps, structure = prepared or _prepare(model, temperatures, args, kwargs, plate,
                                                    selection)
    with binomial_terms(_largest_binomial_count(model, args, kwargs,
                                                structure.binomial_sites)):
        key_probe = random.fold_in(rng_key, 1)
        prior_kwargs = dict(num_inner=num_inner, plate=plate, batch_size=batch_size,
                            fallback=fallback)

        locals_known: list[bool] = []

        def locals_matter() -> bool:
            if not locals_known:
                locals_known.append(
                    bool(structure.local_latents)
                    and _locals_matter(key_probe, model, selection, temps, args, kwargs, plate,
                                       fallback)
                )
            return locals_known[0]

        def prior() -> LogPartitionEstimate:
            est, nan_sites, _, infinite = _prior_estimate(
                rng_key, model, selection, temps, structure, args, kwargs,
                num_samples=num_samples, **prior_kwargs)
            _warn_untrusted(est, nan_sites)
            _warn_divergent(est, infinite)
            if num_inner == 1 and locals_matter():
                _warn_single_inner(structure.local_latents)
            return est

        if method == "prior":
            return prior()
        global_names, discrete = _global_sites(marked, args, kwargs, plate)
        _refuse_fixed_globals(marked, args, kwargs, global_names)
        if not global_names and not discrete:
            return prior()  # no outer integral: the nested average over the locals only
        if discrete:
            _warn_fallback(f"discrete global site(s) {list(discrete)}")
            return prior()
        locals_joint = locals_matter()
        local_route = route in ("joint", "quadrature")
        if local_route and not locals_joint:
            raise ValueError(
                f"`route`={route!r} integrates continuous local latents that change the "
                "per-element contributions; this model has none (use route='auto')."
            )
        if locals_joint and route not in ("auto", "joint", "quadrature"):
            _warn_fallback(
                f"local latent site(s) {list(structure.local_latents)} change the per-element "
                f"contributions, which route={route!r} does not integrate; route='auto' (or "
                "'quadrature') integrates one-dimensional ones by adaptive Gauss-Hermite "
                "quadrature with SMC over the globals (numpyro_tempering.local_quadrature) and "
                "route='joint' any by one SMC over globals and locals "
                "(numpyro_tempering.joint_smc)"
            )
            return prior()
        if locals_joint:
            from numpyro_tempering.joint_smc import unsupported

            reason = unsupported(marked, args, kwargs, plate, global_names,
                                 _subsampled_plates(marked, args, kwargs))
            if reason is not None:
                _warn_fallback(
                    f"local latent site(s) {list(structure.local_latents)} change the per-element "
                    "contributions, and the joint SMC over globals and locals "
                    f"(numpyro_tempering.joint_smc) cannot serve them: {reason}"
                )
                return prior()
            from numpyro_tempering.local_quadrature import MAX_DIM, local_dim

            dim = local_dim(marked, args, kwargs, plate, global_names)
            quadrature = route in ("auto", "quadrature") and 0 < dim <= MAX_DIM
            local = "quadrature" if quadrature else "joint"
            if route == "auto" and not quadrature:
                _warn_fallback(
                    f"local latent site(s) {list(structure.local_latents)} change the per-element "
                    f"contributions with {dim} unconstrained coordinates per element; the "
                    f"default quadrature over the locals serves at most {MAX_DIM}, and the joint "
                    "SMC over globals and locals (route='joint', numpyro_tempering.joint_smc) is "
                    "opt-in: on a Gamma local at N = 500 it took 160 s and erred by up to 0.5 "
                    "nats, with standard errors that cover it"
                )
                return prior()
        else:
            local = None
        probe, _, constant, infinite = _prior_estimate(
            random.fold_in(rng_key, 2), model, selection, temps, structure, args, kwargs,
            num_samples=16, **prior_kwargs)
        if constant and not locals_joint:
            from numpyro_tempering.tempered_smc import depends_on_globals

            # equal values at the probe's draws are not enough (a spike no draw reached)
            if not depends_on_globals(marked, args, kwargs, plate, fallback, global_names,
                                      float(np.max(temps))):
                _warn_divergent(probe, infinite)
                return probe  # the contributions do not depend on the globals: exact
        subsampled = _subsampled_plates(marked, args, kwargs)
        if subsampled:
            _warn_fallback(
                f"subsampled plate(s) {subsampled}: the SMC would integrate one fixed subsample; "
                "the fallback draws a subsample per prior draw and scales its normalisers by "
                "N/B, which is exact only for identical elements (elements that differ, e.g. in "
                "noise scale or length, add the subsample's noise to log C and bias it: "
                "e^(N/B sum of B) is not unbiased for the product of all N); run the model on "
                "the full plates"
            )
            return prior()
        from numpyro_tempering.tempered_smc import SMCSettings

        settings = SMCSettings(
            num_particles=num_particles,
            num_replicates=num_replicates,
            num_mcmc_steps=num_mcmc_steps,
            max_stages=max_stages,
        )
        hot = bool(np.all(np.asarray(temps) >= 1.0))
        if route == "ladder" and not hot:
            bad = np.asarray(temps)[np.asarray(temps) < 1.0].tolist()
            raise ValueError(
                f"`route`='ladder' walks from T = 1 (the prior) to hotter rungs; temperatures "
                f"{bad} are below 1: use route='per-temperature'."
            )
        weights = list(structure.untempered_observed)
        if route == "ladder" and weights:
            raise ValueError(
                f"`route`='ladder' starts at T = 1 from the prior, whose log C(1) = 0; the "
                f"untempered observed site(s) {weights} are importance weights that make "
                "C(1) != 1 (and the prior no exact draw of the T = 1 target): use "
                "route='per-temperature' (route='auto' does)."
            )
        ladder = route == "ladder" or (
            route == "auto" and hot and temps.shape[0] >= LADDER_MIN_RUNGS and not locals_joint
            and not weights
        )
        est = _smc_estimate(
            rng_key, model, marked, selection, temps, structure, args,
            kwargs, global_names, settings, plate, fallback, progress_bar, ladder, local,
        )
        if ladder and route == "auto" and _ladder_missed(est):
            # the one-run ladder starts from the prior: a mode that no prior draw reaches is seen
            # by the missed-mass check only; one SMC per temperature starts from Newton runs
            # (and, with one global, the grid's maxima; with more, the rays) that can reach it
            est = _smc_estimate(
                rng_key, model, marked, selection, temps, structure, args,
                kwargs, global_names, settings, plate, fallback, progress_bar, False, local,
            )
        divergent = np.asarray(probe.divergent, bool)
        if est.prior_log_c is not None:  # the 16 probe draws can miss a divergent region that
            # the missed-mass check's prior draws reach (Student-t df ~ 1 + Gamma(5, 1) at
            # T = 3: infinite where df <= 2, prior mass 0.004; it was NaN, blamed on the cap)
            divergent = divergent | (np.asarray(est.prior_log_c) == np.inf)
        est = _with_divergent(est, divergent)
        _warn_untrusted_smc(est, settings.max_stages)
        _warn_divergent(est, infinite)
        return est


def _ladder_missed(est: LogPartitionEstimate) -> bool:
    """Whether the ladder route missed a mode at some rung: the missed-mass check says so,
    or its replicates disagree by more than ``MAX_REPLICATE_SD`` (some replicates' particles
    reached a mode and others not: a mixture prior's far minority component, 70-80 nats
    apart)."""
    from numpyro_tempering.tempered_smc import MAX_REPLICATE_SD

    reps = np.asarray(est.replicate_log_c, np.float64)
    with np.errstate(invalid="ignore"):
        spread = np.std(reps, axis=0, ddof=1) if reps.shape[0] > 1 else np.zeros(reps.shape[1])
    return bool(np.any(est.missed_mass) or np.any(np.isfinite(spread)
                                                  & (spread > MAX_REPLICATE_SD)))


def _with_divergent(est: LogPartitionEstimate, divergent: np.ndarray) -> LogPartitionEstimate:
    """``est`` with log C = +inf (exact, standard error 0) where the prior draws found a
    tempered site's normaliser infinite."""
    divergent = np.asarray(divergent, bool)
    return est._replace(
        log_c=np.where(divergent, np.inf, np.asarray(est.log_c)),
        stderr=np.where(divergent, 0.0, np.asarray(est.stderr)),
        divergent=divergent,
    )


def _warn_divergent(est: LogPartitionEstimate, sites: list[str]) -> None:
    if est.divergent is None or not np.any(est.divergent):
        return
    temps = np.asarray(est.temperatures)[np.asarray(est.divergent)]
    which = f"site(s) {sites}" if sites else "a tempered site (at some prior draws)"
    warnings.warn(
        f"log_partition: log C(T) = +inf at T = {_rounded(temps[:8], 4)}: the tempered "
        f"normaliser int p(x | globals)^(1/T) dx of {which} is infinite there (the "
        "integral diverges: a density with tails too heavy for that temperature, e.g. a "
        "Student-t with (df + 1) / T <= 1). The tempered model is improper at these "
        "temperatures: leave them out of a Ladder.",
        UserWarning,
        stacklevel=3,
    )


def analytic_log_partition(
    rng_key: jax.Array,
    model: Callable,
    temperatures: jax.typing.ArrayLike,
    *args: Any,
    num_inner: int = 1,
    plate: str | None = None,
    sites: str | Collection[str] | Callable | Selection | None = None,
    latent: str | Collection[str] = (),
    exclude: str | Collection[str] = (),
    joint: bool = False,
    fallback: Fallback = None,
    **kwargs: Any,
) -> jax.Array:
    r"""Analytic (MAP-type) approximation of :math:`\log C(T)`, supplement eq. 4.

    The integral over the globals is replaced by its integrand at
    :math:`\beta^* = \mathbb{E}_{p}[\beta]`, the prior mean (set site by site, so a
    hierarchical global uses the means of its parents):

    .. math::

        \log C(T) \approx \sum_n \log \int dx_n\, dz_n\, p(x_n, z_n \mid \beta^*)^{1/T},

    which for a conditionally conjugate model is eq. 4,
    :math:`N\,(a_l(\beta^*/T) - a_l(\beta^*)/T)` (the printed eq. 4 has the sign flipped).
    Tempered sites are integrated in closed form; latent locals, if any, are still averaged
    by Monte Carlo (``num_inner`` draws, key ``rng_key``), so the result is deterministic
    when the locals are all integrated in closed form. Good for sharply peaked priors and
    large data; a discrete global is an error (its mean is not one of its values).
    Arguments, refusals and the ``log Z(1) = 0`` check as in :func:`log_partition`;
    returns an array of shape ``(M,)``.

    Example:
        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> def model(x):
        ...     p = numpyro.sample("p", dist.Beta(2.0, 6.0))  # prior mean 1/4
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Bernoulli(p), obs=x)
        >>> approx = analytic_log_partition(jax.random.PRNGKey(0), model, jnp.array([2.0]),
        ...                                 jnp.zeros(5))
        >>> round(float(approx[0]), 5) == round(5 * float(jnp.log(0.25**0.5 + 0.75**0.5)), 5)
        True
    """
    num_inner = _check_count(num_inner, "num_inner")
    selection = Selection.of(sites, latent, exclude, joint)
    _, temps, _ = _prepare(model, temperatures, args, kwargs, plate, selection)

    def summarise(draws: _Draw) -> tuple[jax.Array, dict]:
        return draws.log_c[0], jax.tree.map(lambda v: v[0], draws.site_log_z)

    run = _compiled_draws(
        "analytic", model, selection, args, kwargs, summarise, plate=plate, fallback=fallback,
        num_samples=1, num_inner=num_inner, batch_size=None, at_mean=True,
    )
    run_temps = _with_one(temps)
    log_c, site_log_z = run(rng_key, run_temps)
    _check_log_z_one(site_log_z, run_temps, "analytic log C")
    return log_c[: temps.shape[0]]


class JensenBounds(NamedTuple):
    r"""The two Jensen bounds of supplement eq. 8, generalised to any model.

    With :math:`f_n = \exp a_n` the contribution of element :math:`n` (e.g. a document:
    :math:`(\sum_v (\sum_k \theta_k \beta_{kv})^{1/T})^{N_d}` for LDA):

    Attributes:
        mean_log: :math:`\mathbb{E}_{\beta}\sum_n \mathbb{E}_{z_n}[\log f_n]` (eq. 8, first
            line). A lower bound of :math:`\log C(T)`: Jensen for the concave log, twice.
        log_mean: :math:`\sum_n \log \mathbb{E}_{\beta, z_n}[f_n]` (eq. 8, second line).
            The supplement calls it an *upper* bound; it is neither in general (elements
            whose contributions move in opposite directions with :math:`\beta` can put it
            above :math:`\log C`, see :func:`jensen_bounds`), but for exchangeable
            elements it is a **lower** bound too: :math:`C = \mathbb{E}_\beta[g(\beta)^N] \ge
            (\mathbb{E}_\beta\, g)^N` because :math:`x \mapsto x^N` is convex
            (:math:`g = \mathbb{E}_{z}f`); it is the tighter of the two
            (:math:`\log \mathbb{E} \ge \mathbb{E} \log`). Both equal :math:`\log C` when
            :math:`f_n` does not depend on the latents (e.g. Normal likelihoods with known
            scale).
        mean_log_stderr: Monte Carlo standard error of ``mean_log``.
    """

    mean_log: jax.Array
    log_mean: jax.Array
    mean_log_stderr: jax.Array


def jensen_bounds(
    rng_key: jax.Array,
    model: Callable,
    temperatures: jax.typing.ArrayLike,
    *args: Any,
    num_samples: int = 100,
    num_inner: int = 1,
    plate: str | None = None,
    sites: str | Collection[str] | Callable | Selection | None = None,
    latent: str | Collection[str] = (),
    exclude: str | Collection[str] = (),
    joint: bool = False,
    batch_size: int | None = None,
    fallback: Fallback = None,
    **kwargs: Any,
) -> JensenBounds:
    r"""Monte Carlo estimates of the Jensen bounds of supplement eq. 8 (see
    :class:`JensenBounds`). ``mean_log`` is always a lower bound of :math:`\log C(T)`;
    ``log_mean`` is one when the elements' contributions rise and fall together with the
    globals (exchangeable elements: :math:`\mathbb E[g^N] \ge (\mathbb E g)^N`), **not in
    general**: for :math:`x_n \sim \mathcal N(0, e^{b c_n})` with :math:`c_n = \pm 1`
    alternating, :math:`\log C` does not depend on :math:`b` while ``log_mean`` exceeds it
    by :math:`N(1 - 1/T)^2/2` (``tests/test_log_partition.py``).

    Same draws, arguments and refusals as :func:`log_partition`; memory ``O(S M E)`` for
    ``E`` plate elements.

    Example:
        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> def model(x):
        ...     p = numpyro.sample("p", dist.Uniform(0.0, 1.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Bernoulli(p), obs=x)
        >>> key, temps = jax.random.PRNGKey(0), jnp.array([3.0])
        >>> b = jensen_bounds(key, model, temps, jnp.zeros(8), num_samples=2000, plate="data")
        >>> c = log_partition(key, model, temps, jnp.zeros(8), num_samples=2000, plate="data")
        >>> bool(b.mean_log[0] < b.log_mean[0] < c.log_c[0])
        True
    """
    num_samples = _check_count(num_samples, "num_samples", 2)
    num_inner = _check_count(num_inner, "num_inner")
    selection = Selection.of(sites, latent, exclude, joint)
    _, temps, _ = _prepare(model, temperatures, args, kwargs, plate, selection)

    def summarise(draws: _Draw) -> JensenBounds:
        log_s = math.log(num_samples)
        log_mean = (logsumexp(draws.element_log_mean, axis=0) - log_s).sum(-1) + (
            logsumexp(draws.rest_log_mean, axis=0) - log_s
        )
        mean_log = draws.mean_log.mean(0)
        se = draws.mean_log.std(0, ddof=1) / math.sqrt(num_samples)
        return JensenBounds(mean_log, log_mean, se)

    run = _compiled_draws(
        "jensen", model, selection, args, kwargs, summarise, plate=plate, fallback=fallback,
        num_samples=num_samples, num_inner=num_inner, batch_size=batch_size,
    )
    return run(rng_key, temps)
