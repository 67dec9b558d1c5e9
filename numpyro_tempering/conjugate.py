r"""Local latents that log C(T) integrates in closed form: a Beta local read only as the
success probability of one tempered Bernoulli or Binomial site.

For a local :math:`p_n \sim \mathrm{Beta}(a_n, b_n)` (its parameters any function of the
globals) whose only reader is a tempered observed site :math:`y_n \sim
\mathrm{Binomial}(n_n, p_n)` (Bernoulli: :math:`n_n = 1`), the element's factor of the
tempered partition function (variational-tempering supplement, eq. 1; notation of
:mod:`numpyro_tempering.joint_smc`) is, with :math:`h = 1/T`,

.. math::

    c_n(a, b, T) = \int_0^1 dp\, \mathrm{Beta}(p; a, b) \sum_{y=0}^{n}
        \mathrm{Binomial}(y \mid n, p)^{h}
    = \sum_{y=0}^{n} \binom{n}{y}^{h} \frac{B(a + h y,\, b + h (n - y))}{B(a, b)},

exact: Beta moments of :math:`p^{hy}(1 - p)^{h(n - y)}`. :func:`log_partition
<numpyro_tempering.partition_function.log_partition>` finds such pairs
(:func:`collapsible_locals`) and runs the model with each pair replaced by one observed site
:class:`CollapsedBetaBinomial` whose tempered normaliser is :math:`\log c_n`
(:func:`collapse_locals`); the local is then no latent at all, so the SMC runs over the
globals alone and no quadrature over :math:`p_n` is needed. Adaptive Gauss-Hermite
quadrature in :math:`\operatorname{logit} p` could not serve these locals: a U-shaped Beta
(:math:`a, b \ll 1`) puts its mass in tails that decay like :math:`e^{a v}`, where the rule
was 120-160 nats low, and a concentrated one (:math:`a + b > e^{12}`) is narrower than
float32 resolves (docs/reproductions.md, "A Beta local under a log-normal concentration").

Each term is evaluated as :math:`h \log \mathrm{Binomial}(y \mid n, m) + R(a, hy) + R(b,
h(n - y)) - R(a + b, hn)` with :math:`m = a/(a + b)` and :math:`R(x, d) = \log\Gamma(x + d)
- \log\Gamma(x) - d \log x` (:func:`~numpyro_tempering.special.log_gamma_excess`): the
terms of size :math:`h n \log(a + b)` cancel analytically, so a concentrated Beta keeps
float32 accuracy.

**Which pairs.** The local is an unobserved ``Beta`` site (plate expansions and ``to_event``
allowed; tempered or not: with ``latent=`` naming it, its density :math:`\mathrm{Beta}(p; a,
b)^{1/T}` enters unnormalised), without a ``scale`` (no subsampling); exactly one site reads
it, a tempered, observed ``Bernoulli(probs=p)`` or ``Binomial(n, probs=p)`` of the same
shape, unscaled and unmasked, whose ``probs`` *is* the local (checked on two runs with
different values of it, which must change no other site's density) and whose counts are
below ``partition._BINOMIAL_ONE_CHUNK``; or a tempered ``Bernoulli`` whose ``probs`` is the
local broadcast along leading dimensions (a nested plate of trials that share it; the local
has at least one dimension): then :math:`c_n = \sum_k \binom{m}{k} B(a + hk, b + h(m - k)) /
B(a, b)` for its :math:`m` trials, the coefficient not raised to :math:`h`
(:class:`CollapsedBetaBinomial` with ``trials``). Anything else -- ``probs=f(p)``, a second
reader, a ``factor`` that reads ``p``, ``logits``, Binomial trials that share a local, a
scalar Beta read by every element (a global: the SMC over it serves it) -- keeps the route
it had.

Example:
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro_tempering.partition import tempered_log_normalizer
    >>> d = CollapsedBetaBinomial(jnp.array(2.0), jnp.array(3.0), jnp.array(1.0), terms=2)
    >>> # Bernoulli: E[p^h + (1 - p)^h] with h = 1/2 under Beta(2, 3)
    >>> from scipy.special import beta as B
    >>> exact = (B(2.5, 3) + B(2, 3.5)) / B(2, 3)
    >>> bool(abs(float(tempered_log_normalizer(d, 2.0)) - float(jnp.log(exact))) < 1e-5)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as npd
from jax import Array
from jax.scipy.special import gammaln, logsumexp, xlogy
from numpyro.handlers import seed, substitute, trace
from numpyro.primitives import Messenger

from numpyro_tempering.handlers import TEMPERED, Selection
from numpyro_tempering.partition import (
    _BINOMIAL_ONE_CHUNK,
    TemperedDistribution,
    TemperedResult,
    register_tempered,
)
from numpyro_tempering.special import log_gamma_excess, tempered_log_gamma
from numpyro_tempering.structure import structure_trace

__all__ = ["CollapsedBetaBinomial", "collapse_locals", "collapsible_locals"]


def _log_terms(a: Array, b: Array, n: Array, t: Array, terms: int,
               per_trial: bool = False, tempered_local: bool = False) -> Array:
    """Per count ``y = 0..terms-1`` (last axis), ``log [binom(n, y)^h B(a + hy, b + h(n - y))
    / B(a, b)]`` (``per_trial``: ``binom(n, y)`` not raised to ``h``, the count of ``n``
    tempered Bernoulli trials; ``tempered_local``: the local's density raised to ``h`` too,
    ``B(a' + hy, b' + h(n - y)) / B(a, b)^h`` with ``a' = h (a - 1) + 1``, ``+inf`` where
    ``a'`` or ``b'`` is not positive), ``-inf`` for ``y > n``."""
    dtype = jnp.result_type(a, b, t)
    h = (1.0 / t)[..., None]
    a, b, n = a[..., None], b[..., None], jnp.asarray(n, dtype)[..., None]
    s = a + b
    y = jnp.arange(terms, dtype=dtype)
    yc = jnp.minimum(y, n)
    log_binom = gammaln(n + 1.0) - gammaln(yc + 1.0) - gammaln(n - yc + 1.0)
    pmf = log_binom + xlogy(yc, a / s) + xlogy(n - yc, b / s)
    excess = (log_gamma_excess(a, h * yc) + log_gamma_excess(b, h * (n - yc))
              - log_gamma_excess(s, h * n))
    if per_trial:
        excess = excess + (1.0 - h) * log_binom
    out = h * pmf + excess
    if tempered_local:  # tempered_log_gamma's sum over the three factors: no large terms
        d = 1.0 - h
        out = ((1.0 if per_trial else h) * log_binom
               + tempered_log_gamma(a, d + h * yc, h) + tempered_log_gamma(b, d + h * (n - yc), h)
               - tempered_log_gamma(s, 2.0 * d + h * n, h))
        proper = (h * a + d > 0) & (h * b + d > 0)
        out = jnp.where(proper, out, jnp.inf)
    return jnp.where(y <= n, out, -jnp.inf)


class CollapsedBetaBinomial(npd.BetaBinomial):
    r"""An observed ``Binomial(n, p)`` site with its ``Beta(a, b)`` local ``p`` integrated
    out, *for log C*: its tempered normaliser is :math:`\log \int dp\, \mathrm{Beta}(p; a,
    b) \sum_y \mathrm{Binomial}(y \mid n, p)^{1/T}` (module docstring), not that of a
    Beta-binomial site raised to :math:`1/T`. Untempered it is the Beta-binomial.
    ``terms``: one more than the largest count it may be given (a count at or above it
    gives NaN, never a truncated sum).

    ``trials > 1``: each entry is one of ``trials`` Bernoulli trials that share one local
    (a nested plate of trials, all read from the same :math:`p`); each holds
    :math:`\log c / \text{trials}` with :math:`c = \sum_k \binom{m}{k} B(a + hk, b + h(m -
    k)) / B(a, b)`, :math:`m` = ``trials`` (the trials' own :math:`\sum_{x \in \{0, 1\}^m}
    \prod_j p^{h x_j} (1 - p)^{h (1 - x_j)} = (p^h + (1 - p)^h)^m`), so that the entries of a
    group add up to its :math:`\log c`.

    ``tempered_local``: the local was tempered too (``latent=`` names it), its density
    :math:`\mathrm{Beta}(p; a, b)^{1/T}` unnormalised in :math:`c`."""

    pytree_aux_fields = ("terms", "trials", "tempered_local")

    def __init__(self, concentration1: Array, concentration0: Array, total_count: Array = 1,
                 *, terms: int = 2, trials: int = 1, tempered_local: bool = False,
                 validate_args: bool | None = None) -> None:
        self.terms, self.trials = int(terms), int(trials)
        self.tempered_local = bool(tempered_local)
        super().__init__(concentration1, concentration0, total_count,
                         validate_args=validate_args)


class _TemperedCollapsed(TemperedDistribution):
    """The normalised tempered law of a :class:`CollapsedBetaBinomial` over its counts."""

    def log_terms(self) -> Array:
        d = self.base_dist
        return _log_terms(d.concentration1, d.concentration0, d.total_count, self.temperature,
                          d.terms, tempered_local=d.tempered_local)

    def log_prob(self, value: Array) -> Array:
        d = self.base_dist
        if d.trials > 1:
            raise NotImplementedError("the tempered law of trials that share a local is joint "
                                      "over the group: no per-trial log_prob")
        log_t = self.log_terms()
        y = jnp.asarray(value).astype(jnp.int32)[..., None]
        shape = jnp.broadcast_shapes(y.shape[:-1], log_t.shape[:-1])
        log_t = jnp.broadcast_to(log_t, shape + (d.terms,))
        y = jnp.broadcast_to(jnp.clip(y, 0, d.terms - 1), shape + (1,))
        at = jnp.take_along_axis(log_t, y, axis=-1)[..., 0]
        return jnp.where((value >= 0) & (value < d.terms), at, -jnp.inf) - self.log_normalizer


def _sample_collapsed(key: Array, td: _TemperedCollapsed, shape: tuple[int, ...]) -> Array:
    d = td.base_dist
    if d.trials > 1:
        raise NotImplementedError("trials that share a local are drawn jointly: no sampler")
    log_t = jnp.broadcast_to(td.log_terms(), td.batch_shape + (d.terms,))
    log_t = jnp.broadcast_to(log_t, td.batch_shape + (d.terms,))
    return jax.random.categorical(key, log_t, shape=shape + td.batch_shape).astype(
        jnp.result_type(float))


@register_tempered(CollapsedBetaBinomial)
def _collapsed(d: CollapsedBetaBinomial, t: Array) -> TemperedResult:
    a, b = d.concentration1, d.concentration0
    if d.trials > 1:
        log_c = logsumexp(_log_terms(a, b, d.trials, t, d.trials + 1, per_trial=True,
                                     tempered_local=d.tempered_local), -1)
        log_z = log_c / d.trials
    else:
        log_z = logsumexp(_log_terms(a, b, d.total_count, t, d.terms,
                                     tempered_local=d.tempered_local), axis=-1)
        log_z = jnp.where(jnp.asarray(d.total_count) < d.terms, log_z, jnp.nan)
    law = _TemperedCollapsed(d, t, log_z, _sample_collapsed, validate_args=False)
    return TemperedResult(log_z, law)


# -----------------------------------------------------------------------------------------
# Finding the pairs and collapsing them
# -----------------------------------------------------------------------------------------


class Collapse(NamedTuple):
    """A Beta local's reader and how to collapse it."""

    child: str  # the tempered Bernoulli / Binomial site reading the local as its probs
    terms: int  # one more than its largest count
    event_ndims: int  # the child's event dimensions (``to_event``)
    trials: int = 1  # Bernoulli trials per local (its leading dimensions beyond the local's)
    tempered_local: bool = False  # the local's density is raised to 1/T too


def _layers(fn: Any) -> Any:
    """The distribution under plate expansions and ``to_event`` (a masked one is returned
    as is, and refused by the callers)."""
    while isinstance(fn, (npd.ExpandedDistribution, npd.Independent)):
        fn = fn.base_dist
    return fn


def _full(x: Any, fn: Any) -> Array:
    return jnp.broadcast_to(jnp.asarray(x), tuple(fn.batch_shape) + tuple(fn.event_shape))


def _beta_params(fn: Any) -> tuple[Array, Array] | None:
    base = _layers(fn)
    if type(base) is not npd.Beta:
        return None
    return _full(base.concentration1, fn), _full(base.concentration0, fn)


def _probs_and_count(fn: Any) -> tuple[Array, Array] | None:
    base = _layers(fn)
    if type(base) is npd.BernoulliProbs:
        return _full(base.probs, fn), _full(1.0, fn)
    if type(base) is npd.BinomialProbs:
        return _full(base.probs, fn), _full(base.total_count, fn)
    return None


def _unscaled(site: dict) -> bool:
    return site.get("scale") is None and not isinstance(site["fn"], npd.MaskedDistribution)


def _reads(site: dict, value: Array) -> int:
    """How many entries of ``site`` read each entry of ``value`` as their probs: 1 for the
    same shape, the product of the leading dimensions for Bernoulli trials that share a
    local of at least one dimension (0: it does not read it so)."""
    found = _probs_and_count(site["fn"])
    if found is None:
        return 0
    probs, shape = np.asarray(found[0]), np.shape(value)
    if probs.shape == shape:
        return int(np.array_equal(probs, np.asarray(value)))
    lead = probs.shape[: probs.ndim - len(shape)]
    if (not shape or probs.shape[len(lead):] != shape
            or type(_layers(site["fn"])) is not npd.BernoulliProbs):
        return 0
    same = np.array_equal(probs, np.broadcast_to(np.asarray(value), probs.shape))
    return math.prod(lead) if same else 0


def _candidates(tr: dict) -> dict[str, str]:
    """Untempered Beta locals -> their one tempered, observed Bernoulli/Binomial reader
    (``_reads``)."""
    out = {}
    for name, site in tr.items():
        if (site["type"] != "sample" or site["is_observed"] or not _unscaled(site)
                or _beta_params(site["fn"]) is None):
            continue
        value = jnp.asarray(site["value"])
        readers = [c for c, s in tr.items() if s["type"] == "sample" and c != name
                   and _reads(s, value)]
        if len(readers) != 1:
            continue
        child = tr[readers[0]]
        if (child["is_observed"] and child["infer"].get(TEMPERED, False)
                and _unscaled(child)):
            out[name] = readers[0]
    return out


def _site_log_probs(tr: dict, skip: set) -> dict[str, np.ndarray]:
    return {n: np.asarray(s["fn"].log_prob(s["value"])) for n, s in tr.items()
            if s["type"] == "sample" and n not in skip}


def _read_only_by(marked: Callable, args: tuple, kwargs: dict, tr: dict, local: str,
                  child: str) -> bool:
    """Whether another value of ``local`` changes no site's density but ``child``'s, whose
    probs follow it."""
    value = np.asarray(tr[local]["value"], np.float64)
    other = jnp.asarray(np.where(value < 0.5, value + 0.25, value - 0.25),
                        jnp.asarray(tr[local]["value"]).dtype)
    latents = {n: s["value"] for n, s in tr.items()
               if s["type"] == "sample" and not s["is_observed"] and n != local}
    latents[local] = other
    tr2 = trace(substitute(seed(marked, 0), data=latents)).get_trace(*args, **kwargs)
    if child not in tr2 or _reads(tr2[child], other) != _reads(tr[child], tr[local]["value"]):
        return False
    before = _site_log_probs(tr, {local, child})
    after = _site_log_probs(tr2, {local, child})
    return before.keys() == after.keys() and all(
        np.array_equal(before[n], after[n], equal_nan=True) for n in before)


def collapsible_locals(marked: Callable, args: tuple, kwargs: dict,
                       selection: Selection) -> dict[str, Collapse]:
    """The Beta locals of the marked model (``temper(model, ..., sites=selection)``) that
    :func:`collapse_locals` integrates exactly (module docstring: which pairs), found by
    running it eagerly on its data; ``{}`` when the selection is a predicate or joint (a
    predicate could read the replaced distribution) or the model does not run eagerly."""
    if selection.joint or callable(selection.sites):
        return {}
    shapes = structure_trace(marked, args, kwargs)  # abstract: nothing is computed
    if not any(s["type"] == "sample" and not s["is_observed"]
               and type(_layers(s["fn"])) is npd.Beta for s in shapes.values()):
        return {}  # no Beta latent: no eager run
    try:
        tr = trace(seed(marked, 0)).get_trace(*args, **kwargs)
    except Exception:  # a model that runs only under jit: no collapse
        return {}
    out = {}
    for local, child in _candidates(tr).items():
        counts = np.asarray(_probs_and_count(tr[child]["fn"])[1], np.float64)
        most = float(np.max(counts, initial=0.0))
        if not (np.isfinite(most) and most < _BINOMIAL_ONE_CHUNK):
            continue
        if not _read_only_by(marked, args, kwargs, tr, local, child):
            continue
        event_ndims = len(tr[child]["fn"].event_shape)
        trials = _reads(tr[child], jnp.asarray(tr[local]["value"]))
        if trials >= _BINOMIAL_ONE_CHUNK:  # (the sum has trials + 1 terms per element)
            continue
        tempered_local = bool(tr[local]["infer"].get(TEMPERED, False))
        out[local] = Collapse(child, int(most) + 1, event_ndims, trials, tempered_local)
    return out


class _collapse(Messenger):
    """Hide each collapsible local (its value: the Beta mean, read by no one else) and
    replace its reader's distribution by the :class:`CollapsedBetaBinomial`."""

    def __init__(self, fn: Callable, pairs: dict[str, Collapse]) -> None:
        self.pairs = pairs
        self.by_child = {c.child: name for name, c in pairs.items()}
        self.params: dict[str, tuple[Array, Array]] = {}
        super().__init__(fn)

    def _key(self) -> tuple:
        return self.fn, tuple(sorted(self.pairs.items()))

    def __eq__(self, other: object) -> bool:  # equal collapses share compiled runners
        return isinstance(other, _collapse) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample":
            return
        name = msg["name"]
        if name in self.pairs and not msg["is_observed"]:
            a, b = _beta_params(msg["fn"])
            self.params[name] = (a, b)
            msg["value"] = a / (a + b)
            msg["stop"] = True  # no handler outside sees it: it is integrated out
        elif name in self.by_child:
            local = self.by_child[name]
            a, b = self.params.pop(local)
            pair = self.pairs[local]
            count = _probs_and_count(msg["fn"])[1]
            a, b = jnp.broadcast_to(a, count.shape), jnp.broadcast_to(b, count.shape)
            fn = CollapsedBetaBinomial(a, b, count, terms=pair.terms, trials=pair.trials,
                                       tempered_local=pair.tempered_local,
                                       validate_args=False)
            msg["fn"] = fn.to_event(pair.event_ndims) if pair.event_ndims else fn


def collapse_locals(model: Callable, pairs: dict[str, Collapse]) -> Callable:
    """``model`` with each pair of :func:`collapsible_locals` integrated out: the Beta local
    hidden from every handler outside, its reader a :class:`CollapsedBetaBinomial`. For log C
    only (temper it after collapsing: ``temper(collapse_locals(model, pairs), ...)``)."""
    if not pairs:
        return model
    return _collapse(model, pairs)

