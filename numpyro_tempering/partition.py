r"""Tempered log-partition functions of NumPyro distributions.

Tempering raises a density to the power :math:`1/T`. For a NumPyro distribution with
log-density :math:`\log p(x)` -- *exactly* as ``dist.log_prob`` computes it, normaliser
included -- this module provides

.. math::

    \log Z(T) = \log \int p(x)^{1/T}\, dx
    \qquad \text{(a sum over the support for discrete } x\text{)},

and the normalised tempered distribution :math:`p_T(x) = p(x)^{1/T} / Z(T)`, so that

.. math::

    \log p_T(x) = \frac{\log p(x)}{T} - \log Z(T).

These are the building blocks of the tempered partition function :math:`C(T)` of
variational tempering (Mandt et al. 2016, supplement eq. 1-3; "supplement eq. N" below) and
of the multicanonical joint (Mandt et al. 2016, eq. 4-5 and 10-13): the per-datum integral
:math:`\int dx_i\, dz_i\, p(x_i, z_i \mid \beta)^{1/T}` of supplement eq. 1-2 is a sum of
``tempered_log_normalizer`` terms over the local sites once :math:`\beta` is fixed, and
supplement eq. 3 turns it into a Monte-Carlo average over :math:`\beta \sim p(\beta)`.
For an exponential family with a base measure that is constant on the support
(:math:`h \equiv 1`), :math:`\log Z(T) = a(\eta / T) - a(\eta) / T` -- the identity below
supplement eq. 2.

Note that supplement eq. 12 drops the Gaussian normaliser from the tempered power
(it reports :math:`\sqrt{T}^{ND}`); here the normaliser *is* tempered, so a Normal gives
:math:`\tfrac12 (1 - 1/T)\log(2\pi\sigma^2) + \tfrac12 \log T` (the paper's value plus
:math:`\tfrac12(1 - 1/T)\log(2\pi\sigma^2)` per dimension).

Public API
----------

* :func:`tempered_log_normalizer` -- ``log Z(T)``; shape ``broadcast(shape(T), batch_shape)``
  (NumPy rules, so a ladder ``T[:, None]`` against batch ``(K,)`` gives ``(M, K)``); event
  dims are integrated out.
* :func:`tempered_distribution` -- the normalised tempered distribution, batch shape as above.
* :func:`tempered` -- both at once as a :class:`TemperedResult`.
* :func:`register_tempered` -- decorator registering a rule ``(dist, temperature) ->
  TemperedResult`` for a distribution type (dispatch follows the MRO, like
  ``numpyro.distributions.kl.kl_divergence``); :func:`registered_types` lists them.
* :class:`TemperedDistribution` -- generic ``p^{1/T}/Z`` wrapper used where the tempered
  law is not a named family (Binomial, Poisson, numerical fallbacks).
* :func:`tempered_multinomial_exact` -- optional rule tempering the Multinomial coefficient
  too (see "Multinomial" below).

Closed forms (``a' = 1 + (a - 1)/T``, elementwise)
--------------------------------------------------

* Normal(mu, s): ``(1 - 1/T)/2 log(2 pi s^2) + 1/2 log T``; law Normal(mu, s sqrt(T)).
* MultivariateNormal(mu, S), dim D: ``(1 - 1/T)(D/2 log 2pi + 1/2 log|S|) + D/2 log T``;
  law MVN(mu, T S). LowRankMultivariateNormal likewise with ``S = W W^T + diag(d)``; law
  LowRankMVN(mu, sqrt(T) W, T d).
* Bernoulli(p): ``log(p^{1/T} + (1 - p)^{1/T})`` (supplement eq. 14); law with logits / T.
* Categorical(p): ``logsumexp(log p / T)`` (supplement eq. 6); law with logits log p / T.
* Gamma(a, b): ``(a log b - lgamma a) / T + lgamma a' - a' log(b / T)``; law Gamma(a', b/T).
  Exponential(b): ``log T - (1 - 1/T) log b``; law Exponential(b / T).
* Beta(a, b): ``log B(a', b') - log B(a, b) / T``; law Beta(a', b').
* Dirichlet(alpha): ``log B(alpha') - log B(alpha) / T`` with the multivariate Beta function
  ``log B(alpha) = sum lgamma(alpha) - lgamma(sum alpha)``; law Dirichlet(alpha').
* Uniform(l, h): ``(1 - 1/T) log(h - l)``; law Uniform(l, h).
* Delta(v, ld): ``ld / T``; law Delta(v, 0). Unit(f): ``f / T``; law Unit(0) (see below).
* Binomial(n, p): exact finite sum ``logsumexp_{k=0..n} log p(k) / T`` (coefficient
  included); law :class:`TemperedDistribution` (samplable).
* Poisson(r): convergent series (see below); law :class:`TemperedDistribution` (samplable).
* Multinomial(n, p): per trial, ``n logsumexp(log p / T)``; law Multinomial(n, logits / T).
* Independent: the base's ``log Z`` summed over the reinterpreted dims; law
  Independent(tempered base). ExpandedDistribution: the base's, broadcast; law the tempered
  base, expanded. MaskedDistribution: ``where(mask, log Z_base, 0)`` (masked-out sites are
  not part of the joint); law Masked(tempered base, mask).
* StudentT, Cauchy, Laplace, Logistic, Gumbel, HalfNormal, HalfCauchy, LogNormal,
  InverseGamma: closed forms in :mod:`numpyro_tempering.tempered_families` (registered when
  the package is imported).
* MixtureSameFamily / MixtureGeneral of univariate continuous components (the *marginal*
  tempered, ``(sum_k w_k p_k(x))^{1/T}``): no closed form; a double-exponential rule per
  component (see "Mixtures" below); law :class:`TemperedDistribution` (``log_prob`` only).
* :class:`~numpyro_tempering.handlers.JointlyTempered` (``temper(..., joint=True)``: the
  summed-out local tempered jointly, ``sum_k (w_k p_k(x))^{1/T}``): closed form
  ``log sum_k w_k^{1/T} Z_k(T)`` for registered components (any event shape); law the
  mixture of the tempered components with weights ``w_k^{1/T} Z_k(T)`` (samplable when the
  components are). :class:`~numpyro_tempering.handlers.Tempered` (``p^b``, a site tempered
  at ``T0 = 1/b``): the base at ``T / b``.

Gamma, Beta and Dirichlet are *proper* only if every tempered concentration ``a'`` is
positive, i.e. ``T > 1 - a`` for ``a < 1`` (only relevant for ``T < 1``). Otherwise the
integral diverges: with concrete inputs a ``ValueError`` is raised; under tracing
``log Z = +inf`` is returned (and the tempered law has invalid parameters).

Tempered laws are built with ``validate_args=False`` (their parameters are derived from
already-valid ones) and inherit the base distribution's ``_validate_args`` flag, so
``log_prob`` validates samples exactly when the base does. The log-gammas of the Gamma,
Beta, Dirichlet, inverse gamma and Student-t normalisers are combined by
:func:`~numpyro_tempering.special.tempered_log_gamma`, which cancels the terms of size
:math:`a\log a` analytically: the plain difference :math:`\log\Gamma(a') -
\log\Gamma(a)/T` loses ~1e-4 nats per element in float32 at a shape of 1,000, and N
elements sharing that shape multiply it into a log C several nats off
(``tests/test_tempered_families.py::test_large_shapes_keep_their_normaliser_in_float32``).

Temperature
-----------
``temperature`` must be finite and ``> 0``; ``T < 1`` (sharpening) is allowed. Concrete
inputs are checked and raise ``ValueError`` mentioning ``temperature``; under ``jit`` no
exception can be raised and ``log Z`` is ``nan`` wherever the temperature is invalid.
The result dtype follows the inputs (Python scalars are weakly typed).

Delta and Unit
--------------
A ``Delta`` (``Unit``, used by ``numpyro.factor``) site has a single admissible value; its
"integral" is the value of the tempered density at that atom, ``exp(log_density / T)``
(``exp(log_factor / T)``). Hence ``log Z = log_factor / T``: a factor site tempered with the
rest of the joint contributes ``f / T`` to ``log C(T)``, and the normalised tempered site is
the trivial ``Unit(0)``.

Multinomial
-----------
NumPyro's Multinomial log-pmf is ``log n! - sum_k log x_k! + sum_k x_k log p_k``. The
registered rule tempers *per trial*, as the paper does for LDA words (supplement eq. 6-7):
the ``n`` draws are tempered categorical draws, ``prod_i p_{w_i}^{1/T}``, and the
multinomial coefficient only counts the orderings of a count vector (it is the base measure
of the count representation and is *not* raised to ``1/T``). By the multinomial theorem

.. math::

    \sum_x \binom{n}{x} \prod_k p_k^{x_k / T} = \Big(\sum_k p_k^{1/T}\Big)^n,
    \qquad \log Z = n \log \sum_k p_k^{1/T},

and the tempered law is ``Multinomial(n, logits=log p / T)``. Be aware that therefore
``log p_T(x) = log p(x)/T - log Z + (1 - 1/T) log binom(n, x)`` -- i.e. the identity above
holds up to the (untempered) coefficient. This is the right normaliser when the model is
written with per-word Categorical sites (or when ``log_prob/T`` excludes the coefficient);
if instead the *whole* Multinomial log_prob is scaled by ``1/T`` (e.g. with
``numpyro.handlers.scale``), use :func:`tempered_multinomial_exact`, e.g.
``register_tempered(npd.MultinomialProbs)(tempered_multinomial_exact)``. Binomial, by
contrast, is always tempered exactly, coefficient included (for the per-trial value use
``n * log(p^{1/T} + (1 - p)^{1/T})``, a two-category Multinomial).

Poisson
-------
``log Z = log sum_{k>=0} exp((k log r - r - lgamma(k + 1)) / T)`` (a
Conway-Maxwell-Poisson normaliser; no closed form). The terms are log-concave in ``k``
and, for ``k + 1 > r``, the ratio of consecutive terms is
``q = (r / (k + 1))^{1/T} < 1`` and decreasing, so the tail after index ``K`` is bounded
by ``t_K q / (1 - q)``. The series is summed in log space in a first chunk of 16 terms
and then chunks of 128 (``jax.lax.while_loop``) until this rigorous tail bound is below
``finfo(dtype).eps`` times the running sum, i.e. the absolute error in ``log Z`` is at
most ~1 ulp. The cost is ``O(r + T log(1/eps))`` terms, so beyond ``r / T = 30``
(float32) or ``1000`` (float64) the large-rate expansion of the Conway-Maxwell-Poisson
normaliser (Gaunt et al. 2019, three terms; error below 2e-7 and 1e-12 there) replaces
the series, and no rate makes the loop run long. A nan parameter stops its element at
once with ``nan`` (it used to run the whole batch to the cap: minutes under an SMC whose
divergent HMC step gave a nan rate), and a non-finite rate gives ``nan``. Gradients
(w.r.t. rate and temperature) use a ``custom_jvp``,
``d log Z = E_{p_T}[d(log p(k) / T)]``, with the tempered expectation (closed-form
derivatives of the terms) accumulated in the same loop. Binomial uses the same loop,
which stops after ``k = max(n)`` (exact finite sum, ``total_count`` may be an array and
may be traced); counts known at trace time, or traced counts under
:func:`binomial_terms` (which ``log_partition`` sets from the model's data), are summed in
one chunk of ``max(n) + 1`` terms without the loop (Binomial(20): 21 terms instead of the
loop's 16 + 128).

Mixtures
--------
The marginal of a mixture, ``int (sum_k w_k p_k(x))^{1/T} dx``, is integrated as
``sum_k int (sum_j w_j p_j)^{1/T} rho_k dx`` with the partition of unity
``rho_k ∝ (w_k p_k)^{1/T}``, each piece by the double-exponential rule of the quadrature
fallback centred and scaled on component ``k`` (at ``T``). Separated or narrow components are
resolved however far apart they are (a single rule centred on the mixture's mean misses
them: the old fallback gave ``log C(1) = 218`` on 100 points of a three-component mixture
of width 0.003). Components much narrower than a component they sit on are not resolved:
the self-checks below then raise (concrete inputs) or give NaN (traced). Between the two,
the error can pass the self-checks' tolerance (1e-3) unflagged: measured against scipy's
adaptive quadrature (float64, equal weights, a Normal of sd 0.01-0.03 on one of sd 10 at
the same place, T = 1.2-3), errors of 7e-5 to 6.8e-4 nats per element. In a model that
error is per observation and adds up over the plate (0.7 nats at N = 1000), beyond what
``log_partition``'s standard error covers.

Fallbacks (opt-in)
------------------
A distribution type without a rule raises ``NotImplementedError`` unless ``fallback`` is

* ``"quadrature"`` -- univariate continuous distributions on the real line, a half line or
  an interval: fixed double-exponential (sinh-sinh / exp-sinh / tanh-sinh) trapezoidal rule
  with step ``1/64`` on ``[-4.5, 4.5]`` (577 nodes), centred on ``dist.mean`` and scaled by
  ``sqrt(T * dist.variance)`` on the real line when those are finite (else 0 and 1). It is
  accurate (typically ~1e-10 in float64) for smooth, unimodal densities whose scale is
  within a few orders of magnitude of that guess, less so for kinks or very peaked
  densities on a half line / interval. The tempered law supports ``log_prob`` but not
  ``sample``.
* ``"enumerate"`` -- discrete distributions with ``has_enumerate_support`` (finite support):
  exact ``logsumexp`` over ``enumerate_support()``; the tempered law can be sampled.

**Self-checks of the quadrature rules** (fallback and mixtures), on the same nodes, each to
``1e-3`` in ``log Z``: the rule with every other node agrees with the full rule (the usual
error estimate of a double-exponential rule: unresolved modes); the integrand vanishes at
the ends of the node range (a truncated or *divergent* integral, e.g. Cauchy at ``T >= 2``,
where the old rule returned finite numbers); and at ``T = 1``, ``log Z(1) = 0`` (a
normalised density). A failed check raises ``ValueError`` for concrete inputs and gives
``nan`` under tracing -- never a finite wrong number.

Example
-------
>>> import jax.numpy as jnp
>>> import numpyro.distributions as npd
>>> from numpyro_tempering.partition import tempered_distribution, tempered_log_normalizer
>>> d = npd.Normal(0.0, 1.0)
>>> round(float(tempered_log_normalizer(d, 4.0)), 5)  # 3/8 log(2 pi) + 1/2 log 4
1.38235
>>> float(tempered_distribution(d, 4.0).scale)
2.0
>>> tempered_log_normalizer(npd.Normal(jnp.zeros(3), 1.0), jnp.ones((5, 1))).shape
(5, 3)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as npd
from jax import lax, random
from jax.custom_batching import custom_vmap
from jax.scipy.special import gammaln, logsumexp, xlogy
from multipledispatch import Dispatcher
from numpyro.distributions import constraints
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.util import sum_rightmost
from numpyro.util import not_jax_tracer

from numpyro_tempering.handlers import JointlyTempered, JointMixture, Tempered
from numpyro_tempering.special import binomial_log_pmf, poisson_log_pmf, tempered_log_gamma

__all__ = [
    "Fallback",
    "TemperedDistribution",
    "TemperedResult",
    "binomial_terms",
    "register_tempered",
    "registered_types",
    "tempered",
    "tempered_distribution",
    "tempered_log_normalizer",
    "tempered_multinomial_exact",
]

Array = jax.Array
ArrayLike = Any
Fallback = Literal["quadrature", "enumerate"] | None
_FALLBACKS = ("quadrature", "enumerate")

_LOG_2PI = math.log(2.0 * math.pi)


class TemperedResult(NamedTuple):
    """What a tempering rule returns.

    :param log_normalizer: ``log Z(T) = log int p(x)^{1/T} dx``, shape
        ``broadcast(shape(T), dist.batch_shape)`` (rules may return something broadcastable
        to it).
    :param distribution: the normalised tempered law ``p^{1/T} / Z``.
    """

    log_normalizer: Array
    distribution: Distribution


Rule = Callable[[Distribution, Array], TemperedResult]

_REGISTRY = Dispatcher("tempered")
_FALLBACK: contextvars.ContextVar[Fallback] = contextvars.ContextVar(
    "numpyro_tempering_fallback", default=None
)


# ------------------------------------------------------------------------------------------
# Registry and public entry points
# ------------------------------------------------------------------------------------------


def register_tempered(dist_type: type[Distribution]) -> Callable[[Rule], Rule]:
    """Register a tempering rule for ``dist_type`` (and, via the MRO, its subclasses).

    The rule is called as ``rule(dist, temperature)`` with a validated, floating
    ``temperature`` array whose shape broadcasts against ``dist.batch_shape`` by NumPy
    rules, and must return a :class:`TemperedResult`. Registering a type again replaces
    its rule. Subclasses that override ``log_prob`` need their own rule.

    >>> import jax.numpy as jnp
    >>> import numpyro.distributions as npd
    >>> class Flat(npd.Uniform):
    ...     pass
    >>> @register_tempered(Flat)
    ... def _flat(d, t):
    ...     w = jnp.log(d.high - d.low)
    ...     return TemperedResult((1 - 1 / t) * w, npd.Uniform(d.low, d.high))
    >>> float(tempered_log_normalizer(Flat(0.0, jnp.e), 2.0))
    0.5
    """
    if not (isinstance(dist_type, type) and issubclass(dist_type, Distribution)):
        raise TypeError(
            f"register_tempered expects a Distribution subclass, got {dist_type!r} "
            "(numpyro's Bernoulli/Categorical/Binomial/Multinomial are factory functions: "
            "register e.g. BernoulliProbs and BernoulliLogits)"
        )

    def decorator(rule: Rule) -> Rule:
        _REGISTRY.add((dist_type,), rule)
        return rule

    return decorator


def registered_types() -> tuple[type[Distribution], ...]:
    """The distribution types that have a registered tempering rule (sorted by name)."""
    return tuple(sorted((sig[0] for sig in _REGISTRY.funcs), key=lambda c: c.__name__))


def tempered(
    dist: Distribution, temperature: ArrayLike, *, fallback: Fallback = None
) -> TemperedResult:
    """``log Z(T)`` and the normalised tempered distribution of ``dist`` at ``temperature``.

    :param dist: a NumPyro distribution (its full ``log_prob`` is tempered).
    :param temperature: ``T > 0``, finite; any shape broadcasting against
        ``dist.batch_shape``.
    :param fallback: ``None`` (default: unregistered types raise ``NotImplementedError``),
        ``"quadrature"`` or ``"enumerate"`` (see the module docstring).
    :return: :class:`TemperedResult` with ``log_normalizer`` of shape
        ``broadcast(shape(T), dist.batch_shape)`` and a distribution of that batch shape.
    """
    if fallback not in (None, *_FALLBACKS):
        raise ValueError(f"fallback must be None or one of {_FALLBACKS}, got {fallback!r}")
    t = _as_temperature(temperature)
    try:
        jnp.broadcast_shapes(jnp.shape(t), tuple(dist.batch_shape))
    except ValueError:
        raise ValueError(
            f"temperature of shape {jnp.shape(t)} does not broadcast against the batch shape "
            f"{tuple(dist.batch_shape)} of {type(dist).__name__} (NumPy rules; for a ladder "
            "use e.g. T[:, None] against batch (K,))"
        ) from None
    token = _FALLBACK.set(fallback)
    try:
        log_z, tempered_dist = _dispatch(dist, t)
    finally:
        _FALLBACK.reset(token)
    if not not_jax_tracer(t):  # traced: cannot raise, mark invalid temperatures with nan
        log_z = jnp.where(jnp.isfinite(t) & (t > 0), log_z, jnp.nan)
    return TemperedResult(log_z, tempered_dist)


def tempered_log_normalizer(
    dist: Distribution, temperature: ArrayLike, *, fallback: Fallback = None
) -> Array:
    r"""``log Z(T) = log \int p(x)^{1/T} dx`` (sum over the support if discrete).

    Shape ``broadcast(shape(T), dist.batch_shape)``; event dims are integrated out.
    See the module docstring for the closed forms and :func:`tempered` for the arguments.

    >>> import numpyro.distributions as npd
    >>> round(float(tempered_log_normalizer(npd.Bernoulli(probs=0.5), 2.0)), 6)  # log 2 / 2
    0.346574
    """
    return tempered(dist, temperature, fallback=fallback).log_normalizer


def tempered_distribution(
    dist: Distribution, temperature: ArrayLike, *, fallback: Fallback = None
) -> Distribution:
    r"""The normalised tempered law :math:`p^{1/T} / Z(T)` as a NumPyro distribution.

    Its batch shape is ``broadcast(shape(T), dist.batch_shape)`` and
    ``log_prob(x) == dist.log_prob(x) / T - tempered_log_normalizer(dist, T)``
    (Multinomial: up to the coefficient, see the module docstring).

    >>> import numpyro.distributions as npd
    >>> td = tempered_distribution(npd.Gamma(3.0, 2.0), 2.0)
    >>> float(td.concentration), float(td.rate)
    (2.0, 1.0)
    """
    return tempered(dist, temperature, fallback=fallback).distribution


def _as_temperature(temperature: ArrayLike) -> Array:
    if isinstance(temperature, Distribution):
        raise TypeError("temperature must be an array or scalar, not a Distribution")
    t = jnp.asarray(temperature)
    if t.dtype == jnp.bool_ or jnp.issubdtype(t.dtype, jnp.complexfloating):
        raise ValueError(f"temperature must be real and > 0, got dtype {t.dtype}")
    if not jnp.issubdtype(t.dtype, jnp.floating):
        t = t * 1.0  # integers -> (weakly typed) default float
    if not_jax_tracer(t):
        tn = np.asarray(t)
        bad = ~(np.isfinite(tn) & (tn > 0))
        if bad.any():
            raise ValueError(
                "temperature must be finite and > 0; got invalid value(s) "
                f"{tn[bad][:5].tolist()} (shape {tn.shape})"
            )
    return t


def _dispatch(d: Distribution, t: Array) -> TemperedResult:
    """Resolve the rule for ``type(d)`` (or the active fallback) and normalise shapes."""
    rule = _REGISTRY.dispatch(type(d))
    if rule is None:
        fallback = _FALLBACK.get()
        if fallback == "quadrature":
            rule = _quadrature_rule
        elif fallback == "enumerate":
            rule = _enumerate_rule
        else:
            names = ", ".join(c.__name__ for c in registered_types())
            raise NotImplementedError(
                f"No tempering rule registered for {type(d).__name__} "
                f"({type(d).__module__}.{type(d).__qualname__}). Registered types: {names}. "
                f"Register one with @register_tempered({type(d).__name__}) or opt into "
                "fallback='quadrature' (univariate continuous) or fallback='enumerate' "
                "(finite discrete support)."
            )
    log_z, td = rule(d, t)
    shape = jnp.broadcast_shapes(jnp.shape(t), tuple(d.batch_shape))
    log_z = jnp.broadcast_to(log_z, shape)
    if tuple(td.batch_shape) != shape:
        td = td.expand(shape)
    return TemperedResult(log_z, td)


def _check_proper(ok: Array, d: Distribution, condition: str) -> None:
    """Raise for concrete improper tempered laws (under tracing the rule returns +inf)."""
    if not_jax_tracer(ok) and not bool(np.all(np.asarray(ok))):
        raise ValueError(
            f"the tempered {type(d).__name__} is improper (its integral diverges) for the "
            f"given temperature: requires {condition}; lower temperatures need larger "
            "concentrations"
        )


def _law(
    base: Distribution, cls: Callable[..., Distribution], *args: Any, **kwargs: Any
) -> Distribution:
    """Build a tempered law without re-validating its derived parameters (valid by
    construction, or flagged improper by the rule); sample validation follows ``base``."""
    law = cls(*args, validate_args=False, **kwargs)
    law._validate_args = base._validate_args
    return law


def _wrap(
    base: Distribution,
    t: Array,
    log_z: Array,
    sampler: Callable[[Array, TemperedDistribution, tuple[int, ...]], Array] | None = None,
) -> TemperedDistribution:
    return _law(base, TemperedDistribution, base, t, log_z, sampler)


def _one_minus_inv(t: Array) -> Array:
    return (t - 1.0) / t  # 1 - 1/T, exact zero at T = 1


def _expand_t(t: Array, ndims: int) -> Array:
    """Append ``ndims`` singleton dims so ``t`` broadcasts against batch + event dims."""
    return jnp.reshape(t, jnp.shape(t) + (1,) * ndims)


def _float(x: ArrayLike) -> Array:
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.result_type(float))


# ------------------------------------------------------------------------------------------
# The generic tempered wrapper
# ------------------------------------------------------------------------------------------


class TemperedDistribution(Distribution):
    r"""Generic normalised tempered law :math:`p(x)^{1/T} / Z(T)` of ``base_dist``.

    ``log_prob(x) = base_dist.log_prob(x) / temperature - log_normalizer``. The support
    and event shape are the base's; the batch shape is
    ``broadcast(shape(temperature), base_dist.batch_shape)``. ``sample`` needs a
    ``sampler(key, tempered_dist, sample_shape)`` (a module-level, hashable function);
    without one it raises ``NotImplementedError``.
    """

    arg_constraints: dict[str, Any] = {}
    pytree_data_fields = ("base_dist", "temperature", "log_normalizer")
    pytree_aux_fields = ("sampler", "has_enumerate_support")

    def __init__(
        self,
        base_dist: Distribution,
        temperature: ArrayLike,
        log_normalizer: ArrayLike,
        sampler: Callable[[Array, TemperedDistribution, tuple[int, ...]], Array] | None = None,
        *,
        validate_args: bool | None = None,
    ) -> None:
        batch_shape = jnp.broadcast_shapes(jnp.shape(temperature), tuple(base_dist.batch_shape))
        self.base_dist = base_dist
        self.temperature = jnp.asarray(temperature)
        self.log_normalizer = jnp.broadcast_to(log_normalizer, batch_shape)
        self.sampler = sampler
        self.has_enumerate_support = bool(base_dist.has_enumerate_support)
        super().__init__(batch_shape, tuple(base_dist.event_shape), validate_args=validate_args)

    @property
    def support(self) -> constraints.Constraint:
        return self.base_dist.support

    def log_prob(self, value: ArrayLike) -> Array:
        return self.base_dist.log_prob(value) / self.temperature - self.log_normalizer

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        if self.sampler is None:
            raise NotImplementedError(
                f"sampling is not available for the tempered {type(self.base_dist).__name__}"
                " (no sampler; e.g. the quadrature fallback only provides log_prob)"
            )
        return self.sampler(key, self, tuple(sample_shape))

    def enumerate_support(self, expand: bool = True) -> Array:
        values = self.base_dist.enumerate_support(expand=False)
        s = values.shape[0]
        values = jnp.reshape(values, (s,) + (1,) * len(self.batch_shape) + self.event_shape)
        if expand:
            values = jnp.broadcast_to(values, (s,) + self.batch_shape + self.event_shape)
        return values


# ------------------------------------------------------------------------------------------
# Continuous closed forms
# ------------------------------------------------------------------------------------------


# The array math of each rule lives in a jitted core: one compilation per shape/dtype instead
# of one per primitive in eager mode (under an outer jit the cores are simply inlined).


@jax.jit
def _normal_core(scale: Array, t: Array) -> tuple[Array, Array]:
    log_var = _LOG_2PI + 2.0 * jnp.log(scale)
    log_z = 0.5 * _one_minus_inv(t) * log_var + 0.5 * jnp.log(t)
    return log_z, scale * jnp.sqrt(t)


@register_tempered(npd.Normal)
def _normal(d: npd.Normal, t: Array) -> TemperedResult:
    log_z, scale = _normal_core(d.scale, t)
    return TemperedResult(log_z, _law(d, npd.Normal, d.loc, scale))


def _mvn_log_z(scale_tril: Array, t: Array) -> Array:
    dim = scale_tril.shape[-1]
    half_log_det = jnp.sum(jnp.log(jnp.diagonal(scale_tril, axis1=-2, axis2=-1)), axis=-1)
    return _one_minus_inv(t) * (0.5 * dim * _LOG_2PI + half_log_det) + 0.5 * dim * jnp.log(t)


@jax.jit
def _mvn_core(loc: Array, scale_tril: Array, t: Array) -> tuple[Array, Array, Array]:
    # full-batch parameters: numpyro's MVN.log_prob mis-broadcasts partial batch dims
    dim = scale_tril.shape[-1]
    batch = jnp.broadcast_shapes(t.shape, loc.shape[:-1], scale_tril.shape[:-2])
    new_tril = jnp.broadcast_to(scale_tril * _expand_t(jnp.sqrt(t), 2), batch + (dim, dim))
    return _mvn_log_z(scale_tril, t), jnp.broadcast_to(loc, batch + (dim,)), new_tril


@register_tempered(npd.MultivariateNormal)
def _mvn(d: npd.MultivariateNormal, t: Array) -> TemperedResult:
    log_z, loc, scale_tril = _mvn_core(d.loc, d.scale_tril, t)
    return TemperedResult(log_z, _law(d, npd.MultivariateNormal, loc, scale_tril=scale_tril))


@jax.jit
def _lowrank_core(
    loc: Array, cov_factor: Array, cov_diag: Array, scale_tril: Array, t: Array
) -> tuple[Array, ...]:
    cov_factor = cov_factor * _expand_t(jnp.sqrt(t), 2)
    cov_diag = cov_diag * _expand_t(t, 1)
    shape = jnp.broadcast_shapes(loc.shape, cov_factor.shape[:-1], cov_diag.shape)
    return _mvn_log_z(scale_tril, t), jnp.broadcast_to(loc, shape), cov_factor, cov_diag


@register_tempered(npd.LowRankMultivariateNormal)
def _lowrank_mvn(d: npd.LowRankMultivariateNormal, t: Array) -> TemperedResult:
    log_z, loc, cov_factor, cov_diag = _lowrank_core(
        d.loc, d.cov_factor, d.cov_diag, d.scale_tril, t
    )
    return TemperedResult(log_z, _law(d, npd.LowRankMultivariateNormal, loc, cov_factor, cov_diag))


@jax.jit
def _gamma_core(a: Array, b: Array, t: Array) -> tuple[Array, ...]:
    a_t = 1.0 + (a - 1.0) / t
    b_t = b / t
    ok = a_t > 0
    # (a log b - lgamma(a)) / T + lgamma(a_t) - a_t log(b / T), with a_t = a / T + d: the
    # terms of size a log a cancelled analytically (special.tempered_log_gamma)
    d = _one_minus_inv(t)
    log_z = tempered_log_gamma(a, d, 1.0 / t) - d * jnp.log(b)
    return jnp.where(ok, log_z, jnp.inf), a_t, b_t, ok


@register_tempered(npd.Gamma)
def _gamma(d: npd.Gamma, t: Array) -> TemperedResult:
    log_z, a_t, b_t, ok = _gamma_core(d.concentration, d.rate, t)
    _check_proper(ok, d, "1 + (concentration - 1) / temperature > 0")
    return TemperedResult(log_z, _law(d, npd.Gamma, a_t, b_t))


@jax.jit
def _exponential_core(rate: Array, t: Array) -> tuple[Array, Array]:
    return jnp.log(t) - _one_minus_inv(t) * jnp.log(rate), rate / t


@register_tempered(npd.Exponential)
def _exponential(d: npd.Exponential, t: Array) -> TemperedResult:
    log_z, rate = _exponential_core(d.rate, t)
    return TemperedResult(log_z, _law(d, npd.Exponential, rate))


def _tempered_log_beta(alpha: Array, t: Array) -> Array:
    """log B(alpha_t) - log B(alpha) / T over the last axis (the multivariate Beta function,
    alpha_t = 1 + (alpha - 1) / T; ``t`` broadcasts against alpha's batch shape), from
    :func:`~numpyro_tempering.special.tempered_log_gamma` per factor: no terms of size
    alpha log alpha to cancel in float32."""
    a = 1.0 / t
    d = _one_minus_inv(t)
    k = alpha.shape[-1]
    parts = tempered_log_gamma(alpha, d[..., None], a[..., None])
    total = tempered_log_gamma(jnp.sum(alpha, axis=-1), k * d, a)
    return jnp.sum(parts, axis=-1) - total


@jax.jit
def _beta_core(a: Array, b: Array, t: Array) -> tuple[Array, ...]:
    a_t = 1.0 + (a - 1.0) / t
    b_t = 1.0 + (b - 1.0) / t
    ok = (a_t > 0) & (b_t > 0)
    log_z = _tempered_log_beta(jnp.stack(jnp.broadcast_arrays(a, b), axis=-1), t)
    return jnp.where(ok, log_z, jnp.inf), a_t, b_t, ok


@register_tempered(npd.Beta)
def _beta(d: npd.Beta, t: Array) -> TemperedResult:
    log_z, a_t, b_t, ok = _beta_core(d.concentration1, d.concentration0, t)
    _check_proper(ok, d, "1 + (concentration{0,1} - 1) / temperature > 0")
    return TemperedResult(log_z, _law(d, npd.Beta, a_t, b_t))


@jax.jit
def _dirichlet_core(alpha: Array, t: Array) -> tuple[Array, ...]:
    alpha_t = 1.0 + (alpha - 1.0) / _expand_t(t, 1)
    ok = jnp.all(alpha_t > 0, axis=-1)
    log_z = _tempered_log_beta(alpha, t)
    return jnp.where(ok, log_z, jnp.inf), alpha_t, ok


@register_tempered(npd.Dirichlet)
def _dirichlet(d: npd.Dirichlet, t: Array) -> TemperedResult:
    log_z, alpha_t, ok = _dirichlet_core(d.concentration, t)
    _check_proper(ok, d, "1 + (concentration - 1) / temperature > 0 for every component")
    return TemperedResult(log_z, _law(d, npd.Dirichlet, alpha_t))


@register_tempered(npd.Uniform)
def _uniform(d: npd.Uniform, t: Array) -> TemperedResult:
    log_z = _one_minus_inv(t) * jnp.log(d.high - d.low)
    return TemperedResult(log_z, _law(d, npd.Uniform, d.low, d.high))


@register_tempered(npd.Delta)
def _delta(d: npd.Delta, t: Array) -> TemperedResult:
    log_z = d.log_density / t
    td = _law(d, npd.Delta, d.v, jnp.zeros_like(d.log_density), event_dim=len(d.event_shape))
    return TemperedResult(log_z, td)


@register_tempered(npd.Unit)
def _unit(d: npd.Unit, t: Array) -> TemperedResult:
    log_z = d.log_factor / t
    return TemperedResult(log_z, _law(d, npd.Unit, jnp.zeros_like(log_z)))


# ------------------------------------------------------------------------------------------
# Discrete closed forms
# ------------------------------------------------------------------------------------------


@jax.jit
def _bernoulli_probs_core(p: Array, t: Array) -> tuple[Array, Array]:
    log_p1, log_p0 = jnp.log(p) / t, jnp.log1p(-p) / t
    log_z = jnp.logaddexp(log_p1, log_p0)
    return log_z, jnp.exp(log_p1 - log_z)


@register_tempered(npd.BernoulliProbs)
def _bernoulli_probs(d: npd.BernoulliProbs, t: Array) -> TemperedResult:
    log_z, probs = _bernoulli_probs_core(d.probs, t)
    return TemperedResult(log_z, _law(d, npd.BernoulliProbs, probs))


@jax.jit
def _bernoulli_logits_core(logits: Array, t: Array) -> tuple[Array, Array]:
    log_z = jnp.logaddexp(-jax.nn.softplus(-logits) / t, -jax.nn.softplus(logits) / t)
    return log_z, logits / t


@register_tempered(npd.BernoulliLogits)
def _bernoulli_logits(d: npd.BernoulliLogits, t: Array) -> TemperedResult:
    log_z, logits = _bernoulli_logits_core(d.logits, t)
    return TemperedResult(log_z, _law(d, npd.BernoulliLogits, logits))


@partial(jax.jit, static_argnums=0)
def _categorical_core(from_probs: bool, param: Array, t: Array) -> tuple[Array, ...]:
    log_p = jnp.log(param) if from_probs else jax.nn.log_softmax(param, axis=-1)
    scaled = log_p / _expand_t(t, 1)
    log_z = logsumexp(scaled, axis=-1)
    return log_z, scaled, jnp.exp(scaled - log_z[..., None])


@register_tempered(npd.CategoricalProbs)
def _categorical_probs(d: npd.CategoricalProbs, t: Array) -> TemperedResult:
    log_z, _, probs = _categorical_core(True, d.probs, t)
    return TemperedResult(log_z, _law(d, npd.CategoricalProbs, probs))


@register_tempered(npd.CategoricalLogits)
def _categorical_logits(d: npd.CategoricalLogits, t: Array) -> TemperedResult:
    log_z, logits, _ = _categorical_core(False, d.logits, t)
    return TemperedResult(log_z, _law(d, npd.CategoricalLogits, logits))


def _multinomial_log_probs(d: Distribution) -> Array:
    if isinstance(d, npd.MultinomialProbs):
        return jnp.log(d.probs)
    return jax.nn.log_softmax(d.logits, axis=-1)


@register_tempered(npd.MultinomialProbs)
@register_tempered(npd.MultinomialLogits)
def _multinomial_per_trial(d: Distribution, t: Array) -> TemperedResult:
    """Per-trial tempering (coefficient untempered), see the module docstring."""
    from_probs = isinstance(d, npd.MultinomialProbs)
    log_norm, scaled, probs = _categorical_core(from_probs, d.probs if from_probs else d.logits, t)
    n = d.total_count
    log_z = n * log_norm
    if from_probs:
        td = _law(d, npd.MultinomialProbs, probs, n, total_count_max=d.total_count_max)
    else:
        td = _law(d, npd.MultinomialLogits, scaled, n, total_count_max=d.total_count_max)
    return TemperedResult(log_z, td)


def tempered_multinomial_exact(dist: Distribution, temperature: Array) -> TemperedResult:
    r"""Rule tempering the *whole* Multinomial log-pmf, multinomial coefficient included.

    .. math::

        \log Z = \frac{\log n!}{T} + \log \sum_{x:\,\sum_k x_k = n}
            \prod_k \exp\Big(\frac{x_k \log p_k - \log x_k!}{T}\Big),

    computed exactly by ``K - 1`` log-space convolutions of length ``n + 1``
    (``O(K n^2)`` per batch element; ``total_count`` must be concrete -- it is static
    pytree data of NumPyro's Multinomial). Not registered by default; to use it::

        register_tempered(npd.MultinomialProbs)(tempered_multinomial_exact)
        register_tempered(npd.MultinomialLogits)(tempered_multinomial_exact)

    The tempered law is a :class:`TemperedDistribution` (``log_prob`` only).

    >>> import numpyro.distributions as npd
    >>> d = npd.Multinomial(2, probs=jnp.array([0.5, 0.5]))
    >>> per_trial = tempered_log_normalizer(d, 2.0)  # 2 log(2 sqrt(1/2)) = log 2
    >>> exact = tempered_multinomial_exact(d, 2.0).log_normalizer  # log(1 + sqrt(1/2))
    >>> round(float(per_trial), 5), round(float(exact), 5)
    (0.69315, 0.5348)
    """
    t = _as_temperature(temperature)
    n = dist.total_count
    if not not_jax_tracer(n):
        raise ValueError("tempered_multinomial_exact needs a concrete total_count")
    n_np = np.asarray(n).astype(np.int64)
    n_max = int(n_np.max()) if n_np.size else 0
    log_p = _multinomial_log_probs(dist)  # (*B, K)
    j = jnp.arange(n_max + 1, dtype=log_p.dtype)
    # Multinomial(x | n, p) = prod_k Poisson(x_k | n p_k) / Poisson(n | n) on sum x = n, each
    # factor a log-pmf of size log n (special.poisson_log_pmf), where n! / prod x_k! with
    # p_k^x_k cancels terms of size n log n (7.6e-5 nats lost in float32 at n = 1,000):
    # a[..., k, j] = log Poisson(j | n p_k) / T
    n_b = jnp.asarray(n, log_p.dtype)
    rates = n_b[..., None] * jnp.exp(log_p)  # (*B, K)
    a = poisson_log_pmf(j, rates[..., None]) / _expand_t(t, 2)
    idx = np.arange(n_max + 1)
    diff = idx[:, None] - idx[None, :]
    valid = jnp.asarray(diff >= 0)
    gather = jnp.asarray(np.clip(diff, 0, n_max))

    def convolve(c: Array, a_k: Array) -> tuple[Array, None]:
        terms = c[..., None, :] + jnp.take(a_k, gather, axis=-1)
        return logsumexp(jnp.where(valid, terms, -jnp.inf), axis=-1), None

    a = jnp.moveaxis(a, -2, 0)  # (K, *B, n + 1)
    c, _ = lax.scan(convolve, a[0], a[1:])
    n_idx = jnp.broadcast_to(jnp.asarray(n_np), c.shape[:-1])[..., None]
    c_n = jnp.take_along_axis(c, n_idx, axis=-1)[..., 0]
    log_z = c_n - poisson_log_pmf(n_b, n_b) / t
    return TemperedResult(log_z, _wrap(dist, t, log_z))


# ---- Binomial and Poisson: chunked log-space series with a rigorous stopping rule --------

_SERIES_CHUNK = 128
_SERIES_FIRST_CHUNK = 16
#: laws whose tempered normaliser is a sum over terms (the series of :func:`_series_loop`;
#: the negative binomials' head and tail rule, :mod:`numpyro_tempering.tempered_families`):
#: evaluated at every particle and step of an SMC, its run, not its compile, dominates
#: there (``log_partition`` compiles such a model at XLA's default optimisation level)
SERIES_LAWS = (npd.Poisson, npd.BinomialProbs, npd.BinomialLogits, npd.GammaPoisson)
_SERIES_MAX_TERMS = 1 << 22


#: a series evaluated for at least this many independent calls at once (``vmap``: particles,
#: quadrature nodes, ...) runs its chunks after the first through a queue
#: (:func:`_series_members`) ...
_SERIES_QUEUE_MIN = 64
#: ... each pass taking up to this share of the calls (1/8)
_SERIES_QUEUE_SHARE = 8


def _series_loop(
    term_fn: Callable[[Array, tuple[Array, ...]], Array],
    tail_fn: Callable[[Array, tuple[Array, ...]], Array],
    params: tuple[Array, ...],
    with_grad: bool,
    term_grad_fn: Callable[[Array, tuple[Array, ...], Array], tuple[Array, ...]] | None = None,
    terms: int | None = None,
) -> tuple[Array, tuple[Array, ...]]:
    """``log sum_{k>=0} exp(term_fn(k))`` and (if ``with_grad``) ``E_q[d term / d param]``.

    ``params`` are float arrays of a common shape on which ``term_fn`` acts elementwise;
    ``tail_fn(K)`` upper-bounds (in log space) the sum of the terms with index ``> K``;
    ``term_grad_fn(k, params, term)`` gives the terms' partial derivatives in closed form
    (one per param; a jvp per param inside the loop cost three times the terms).
    Stops once that bound is below ``eps * partial sum`` for every element; elements still
    unconverged after ``_SERIES_MAX_TERMS`` terms give ``nan``. The expectations are under
    ``q(k) = exp(term_fn(k)) / sum``, i.e. the gradient of the log-sum w.r.t. each param.
    ``terms``: a static bound on the number of nonzero terms (a Binomial's ``n + 1`` when
    ``n`` is known at trace time): then one chunk of that many terms, and no loop.

    Under ``vmap`` each call keeps this rule (a call stops once its own elements converged,
    as under JAX's batched ``while_loop``: the same chunks in the same order, the same
    numbers to float32 rounding), but only the calls still running pay for a chunk
    (:func:`_series_members`): under JAX's batching rule every call paid for the slowest
    one's chunks (a Poisson log link under the quadrature's nodes: 96% of the series end
    within 144 terms, a few near rate / T = 30 at T = 10 take 656; 3.0x the needed terms,
    and lgamma(k + 1) computed once per call and chunk, 95% of the log C run).
    """
    fn = _series_members(term_fn, tail_fn, term_grad_fn if with_grad else None, terms)
    log_z, grads = fn(tuple(p[None] for p in params))  # one call: one member
    return log_z[0], tuple(g[0] for g in grads)


@functools.cache
def _series_members(term_fn: Callable, tail_fn: Callable,
                    term_grad_fn: Callable | None, terms: int | None = None) -> Callable:
    """:func:`_series_loop` over ``params`` of shape ``(M, *E)``: M independent calls
    ("members"), and under ``vmap`` (``custom_vmap``) the vmapped axes flattened into
    more members, so that a batch of any depth is one queue of members. With
    ``term_grad_fn`` (``None``: values only) also the expectations of the terms' partial
    derivatives."""

    @custom_vmap
    def members(params: tuple[Array, ...]) -> tuple[Array, tuple[Array, ...]]:
        return _series_members_loop(term_fn, tail_fn, term_grad_fn, params, terms)

    @members.def_vmap
    def rule(axis_size: int, in_batched: list, params: tuple[Array, ...]) -> tuple:
        if not any(in_batched[0]):  # only tangents batched (forward mode): no new members
            out = _series_members_loop(term_fn, tail_fn, term_grad_fn, params, terms)
            return out, jax.tree.map(lambda _: False, out)
        params = tuple(p if b else jnp.broadcast_to(p, (axis_size, *p.shape))
                       for p, b in zip(params, in_batched[0], strict=True))
        inner = params[0].shape[1:]  # (M, *E)
        out = members(tuple(p.reshape((-1, *inner[1:])) for p in params))
        out = jax.tree.map(lambda a: a.reshape((axis_size, *inner[:1], *a.shape[1:])), out)
        return out, jax.tree.map(lambda _: True, out)

    return members


def _series_members_loop(
    term_fn: Callable[[Array, tuple[Array, ...]], Array],
    tail_fn: Callable[[Array, tuple[Array, ...]], Array],
    term_grad_fn: Callable[[Array, tuple[Array, ...], Array], tuple[Array, ...]] | None,
    params: tuple[Array, ...],
    terms: int | None = None,
) -> tuple[Array, tuple[Array, ...]]:
    """:func:`_series_members`: a first chunk for every member (all ``terms`` of them when
    given, and then no loop), then chunks of
    ``_SERIES_CHUNK`` for the members still running: all of them in lock step (fewer than
    ``_SERIES_QUEUE_MIN`` members), or a queue whose every pass runs one chunk for up to
    ``M / _SERIES_QUEUE_SHARE`` of the running members whose next chunk starts lowest (all
    at one start: ``k`` and ``lgamma(k + 1)`` once per pass, not once per member)."""
    shape = params[0].shape  # (M, *E)
    num = shape[0]
    dtype = params[0].dtype
    n_grad = 0 if term_grad_fn is None else len(params)
    log_eps = math.log(float(jnp.finfo(dtype).eps))
    per_member = tuple(range(1, len(shape)))
    zeros = jnp.zeros(shape, dtype)

    def body(start: Array, state: tuple, prm: tuple[Array, ...], chunk: int) -> tuple:
        m, s, s_grad, done = state
        k = start + jnp.arange(chunk, dtype=dtype).reshape((chunk,) + (1,) * len(shape))
        lt = term_fn(k, prm)
        # the running max is only a shift (it cancels): no derivative through it. Its
        # forward-mode derivative (curvatures: jvp of the custom_jvp's rule) divides by the
        # count of terms equal to the max, which XLA's fused recomputation of the terms
        # (different rounding) can make 0: 0/0 = nan (a batch of 32 rates, issue 20)
        new_m = lax.stop_gradient(jnp.maximum(m, jnp.max(lt, axis=0)))
        ref = jnp.where(jnp.isfinite(new_m), new_m, 0.0)
        w = jnp.exp(lt - ref)
        rescale = jnp.exp(m - ref)
        s = s * rescale + jnp.sum(w, axis=0)
        new_grad = []
        dlts = () if term_grad_fn is None else term_grad_fn(k, prm, lt)
        for i in range(n_grad):
            acc = jnp.sum(jnp.where(w > 0, w * dlts[i], 0.0), axis=0)
            new_grad.append(s_grad[i] * rescale + acc)
        log_tail = tail_fn(start + (chunk - 1), prm)
        log_s = jnp.log(s) + ref
        # nan parameters (e.g. a divergent HMC step's) stop at once and give nan
        converged = (log_tail == -jnp.inf) | (log_tail < log_s + log_eps) | jnp.isnan(log_s)
        return new_m, s, tuple(new_grad), done | converged

    def running(state: tuple, start: Array) -> Array:  # per member
        return ~jnp.all(state[3], axis=per_member) & (start < _SERIES_MAX_TERMS)

    init = (jnp.full(shape, -jnp.inf, dtype), zeros, (zeros,) * n_grad, jnp.zeros(shape, bool))
    # a short first chunk: many series a model meets (a Binomial's few trials, a small
    # Poisson rate at a mild temperature) end within it, at an eighth of a full chunk's
    # work (Binomial(10) under SMC: 12x faster, the series being most of its time; a
    # second loop of short chunks before the long ones ran 2-3x slower than this one)
    first = _SERIES_FIRST_CHUNK if terms is None else terms
    state = body(jnp.zeros((), dtype), init, params, first)
    if terms is not None:  # every nonzero term is in: done (nan parameters give nan)
        return _series_result(*state)
    starts = jnp.full((num,), _SERIES_FIRST_CHUNK, dtype)  # each member's next chunk
    if num < _SERIES_QUEUE_MIN:
        def lock_step(carry: tuple) -> tuple:
            state, starts = carry
            keep = running(state, starts)  # all running members are at the latest start
            new = body(jnp.max(starts), state, params, _SERIES_CHUNK)
            state = jax.tree.map(
                lambda a, b: jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                new, state)
            return state, jnp.where(keep, starts + _SERIES_CHUNK, starts)

        step = lock_step
    else:
        block = -(-num // _SERIES_QUEUE_SHARE)

        def queue(carry: tuple) -> tuple:
            state, starts = carry
            left = running(state, starts)
            level = jnp.min(jnp.where(left, starts, jnp.inf))
            idx = jnp.nonzero(left & (starts == level), size=block, fill_value=num)[0]
            take = jnp.minimum(idx, num - 1)
            new = body(level, jax.tree.map(lambda a: a[take], state),
                       tuple(p[take] for p in params), _SERIES_CHUNK)
            state = jax.tree.map(lambda a, b: a.at[idx].set(b, mode="drop"), state, new)
            return state, starts.at[idx].set(level + _SERIES_CHUNK, mode="drop")

        step = queue
    state, _ = lax.while_loop(lambda c: jnp.any(running(*c)), step, (state, starts))
    return _series_result(*state)


def _series_result(m: Array, s: Array, s_grad: tuple[Array, ...],
                   done: Array) -> tuple[Array, tuple[Array, ...]]:
    """The log-sum and the expectations from the loop's running max, scaled sums and flags."""
    ref = jnp.where(jnp.isfinite(m), m, 0.0)
    log_z = jnp.where(done, jnp.log(s) + ref, jnp.nan)
    safe_s = jnp.where(s > 0, s, 1.0)
    grads = tuple(jnp.where(s > 0, g / safe_s, jnp.where(jnp.isnan(s), jnp.nan, 0.0))
                  for g in s_grad)
    return log_z, grads


def _make_series_log_sum(
    term_fn: Callable[[Array, tuple[Array, ...]], Array],
    tail_fn: Callable[[Array, tuple[Array, ...]], Array],
    term_grad_fn: Callable[[Array, tuple[Array, ...], Array], tuple[Array, ...]],
    terms: int | None = None,
) -> Callable[[tuple[Array, ...]], Array]:
    @jax.custom_jvp
    def log_sum(params: tuple[Array, ...]) -> Array:
        return _series_loop(term_fn, tail_fn, params, False, terms=terms)[0]

    @log_sum.defjvp
    def _log_sum_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
        (params,), (dparams,) = primals, tangents
        log_z, grads = _series_loop(term_fn, tail_fn, params, True, term_grad_fn, terms)
        # linear in the tangents (outside the loop), so reverse mode can transpose it
        dlog_z = sum(g * dp for g, dp in zip(grads, dparams, strict=True))
        return log_z, dlog_z

    return jax.jit(log_sum)


def _series_sample(
    term_fn: Callable[[Array, tuple[Array, ...]], Array],
    tail_fn: Callable[[Array, tuple[Array, ...]], Array],
    params: tuple[Array, ...],
    log_z: Array,
    u: Array,
    offset: Array | None = None,
) -> Array:
    """Inverse-CDF sampling of ``exp(term_fn(k) - log_z)``; ``u`` has shape sample + batch.
    ``offset`` (batch-shaped, integer-valued floats) starts each element's walk there, for
    laws whose mass below it is negligible (below the dtype's resolution)."""
    shape = params[0].shape
    dtype = params[0].dtype
    n_sample = u.ndim - len(shape)
    log_eps = math.log(float(jnp.finfo(dtype).eps))
    ks = jnp.arange(_SERIES_CHUNK, dtype=dtype).reshape((_SERIES_CHUNK,) + (1,) * len(shape))
    to_u = (_SERIES_CHUNK,) + (1,) * n_sample + shape
    int_dtype = jnp.result_type(int)

    def cond(state: tuple[Array, ...]) -> Array:
        start, _, _, done = state
        return ~jnp.all(done) & (start < _SERIES_MAX_TERMS)

    base = jnp.zeros(shape, dtype) if offset is None else offset

    def body(state: tuple[Array, ...]) -> tuple[Array, ...]:
        start, cum, result, done = state
        k = base + start + ks
        probs = jnp.exp(term_fn(k, params) - log_z).reshape(to_u)
        cs = cum + jnp.cumsum(probs, axis=0)
        hit = cs >= u
        first = jnp.argmax(hit, axis=0).astype(int_dtype)
        has = jnp.any(hit, axis=0)
        k_last = base + start + (_SERIES_CHUNK - 1)
        exhausted = tail_fn(k_last, params) - log_z < log_eps  # rounding left u unreached
        start_i = (base + start).astype(int_dtype)
        result = jnp.where(~done & has, start_i + first, result)
        result = jnp.where(~done & ~has & exhausted, k_last.astype(int_dtype), result)
        return start + _SERIES_CHUNK, cs[-1], result, done | has | exhausted

    init = (
        jnp.zeros((), dtype),
        jnp.zeros(u.shape, dtype),
        jnp.zeros(u.shape, int_dtype),
        jnp.zeros(u.shape, bool),
    )
    return lax.while_loop(cond, body, init)[2]


def _poisson_term(k: Array, params: tuple[Array, ...]) -> Array:
    rate, t = params
    return (xlogy(k, rate) - rate - gammaln(k + 1.0)) / t


def _poisson_term_grad(k: Array, params: tuple[Array, ...], term: Array) -> tuple[Array, ...]:
    rate, t = params
    return (jnp.where(k > 0, k / rate, 0.0) - 1.0) / t, -term / t


def _poisson_tail(k_last: Array, params: tuple[Array, ...]) -> Array:
    rate, t = params
    log_q = (jnp.log(rate) - jnp.log(k_last + 1.0)) / t  # ratio bound for all later terms
    below = log_q < 0
    safe_q = jnp.where(below, log_q, -1.0)
    bound = _poisson_term(k_last, params) + safe_q - jnp.log1p(-jnp.exp(safe_q))
    return jnp.where(below, bound, jnp.inf)


def _binomial_term(k: Array, params: tuple[Array, ...]) -> Array:
    n, log_p1, log_p0, t = params
    kc = jnp.minimum(k, n)
    # Loader's saddle-point form keeps large n accurate in float32 (log binom(n, k) + k log p
    # + (n - k) log q cancels terms of size n: 0.02 nats lost at n = 1e5 with three
    # log-gammas). Its value off p + q = 1 differs, but the parameters are always on it, and
    # the derivatives are _binomial_term_grad's (the same there)
    lp = binomial_log_pmf(kc, n, log_p1, log_p0)
    return jnp.where(k <= n, lp / t, -jnp.inf)


def _binomial_term_grad(k: Array, params: tuple[Array, ...], term: Array) -> tuple[Array, ...]:
    n, _, _, t = params  # n carries no gradient (stop_gradient in _binomial_params)
    kc = jnp.minimum(k, n)
    return jnp.zeros_like(term), kc / t, (n - kc) / t, -term / t


def _binomial_tail(k_last: Array, params: tuple[Array, ...]) -> Array:
    n = params[0]
    return jnp.where(k_last >= n, -jnp.inf, jnp.inf)


_poisson_log_sum = _make_series_log_sum(_poisson_term, _poisson_tail, _poisson_term_grad)
_binomial_log_sum = _make_series_log_sum(_binomial_term, _binomial_tail, _binomial_term_grad)


def _broadcast_params(*xs: Array) -> tuple[Array, ...]:
    dtype = jnp.result_type(*xs)
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in xs))
    return tuple(jnp.broadcast_to(jnp.asarray(x, dtype), shape) for x in xs)


def _poisson_params(rate: Array, t: Array) -> tuple[Array, ...]:
    return _broadcast_params(_float(rate), t)


def _binomial_params(from_probs: bool, n: Array, param: Array, t: Array) -> tuple[Array, ...]:
    if from_probs:
        log_p1, log_p0 = jnp.log(param), jnp.log1p(-param)
    else:
        log_p1, log_p0 = -jax.nn.softplus(-param), -jax.nn.softplus(param)
    n = lax.stop_gradient(jnp.asarray(n).astype(jnp.result_type(log_p1)))
    return _broadcast_params(n, log_p1, log_p0, t)


def _binomial_args(d: Distribution) -> tuple[bool, Array, Array]:
    from_probs = isinstance(d, npd.BinomialProbs)
    return from_probs, d.total_count, d.probs if from_probs else d.logits


def _bucketed(log_sum: Callable[[tuple[Array, ...]], Array], params: tuple[Array, ...]) -> Array:
    """Run a series on flattened params padded to a power-of-two length (>= 8), so that its
    while loop compiles once per size bucket rather than once per batch shape. Under an
    outer trace (``jit``, ``vmap``, ...) the loop is part of that program and compiled with
    it whatever its length: the padding would only add work, so the series runs as it is."""
    shape = params[0].shape
    size = math.prod(shape)
    if size == 0:
        return jnp.zeros(shape, params[0].dtype)
    if any(isinstance(p, jax.core.Tracer) for p in params):
        return log_sum(tuple(p.reshape(-1) for p in params)).reshape(shape)
    bucket = max(8, 1 << (size - 1).bit_length())
    return _unflatten(log_sum(_flatten_pad(bucket, params)), shape)


@partial(jax.jit, static_argnums=0)
def _flatten_pad(bucket: int, params: tuple[Array, ...]) -> tuple[Array, ...]:
    size = math.prod(params[0].shape)
    return tuple(jnp.pad(p.reshape(-1), (0, bucket - size), mode="edge") for p in params)


@partial(jax.jit, static_argnums=1)
def _unflatten(flat: Array, shape: tuple[int, ...]) -> Array:
    return flat[: math.prod(shape)].reshape(shape)


_poisson_params_jit = jax.jit(lambda rate, t: _poisson_params(rate, t))
_binomial_params_jit = jax.jit(
    lambda from_probs, n, param, t: _binomial_params(from_probs, n, param, t), static_argnums=0
)


# rate / T beyond which the asymptotic expansion is used: its error is below 2e-7 at 30 (float32's
# resolution) and about 1e-12 at 1000 (float64)
_POISSON_ASYMPTOTIC = {4: 30.0, 8: 1000.0}


def _poisson_large(rate: Array, t: Array) -> Array:
    """Where ``rate / T`` is past the dtype's switch to the asymptotic expansion."""
    return rate > _POISSON_ASYMPTOTIC[jnp.dtype(rate.dtype).itemsize] * t


def _poisson_asymptotic(rate: Array, t: Array) -> Array:
    r"""The large-rate expansion of the tempered Poisson normaliser: with ``nu = 1/T`` it is
    ``e^{-r/T}`` times the Conway-Maxwell-Poisson normaliser ``Z(r^nu, nu)``, whose expansion
    in ``x = r/T`` (Gaunt, Iyengar, Olde Daalhuis and Simsek 2019, Theorem 1) gives

    ``log Z = (1 - nu)/2 log(2 pi r) + 1/2 log T + log(1 + c1/x + c2/x^2 + c3/x^3)``,
    ``c1 = (nu^2-1)/24``, ``c2 = (nu^2-1)(nu^2+23)/1152``,
    ``c3 = (nu^2-1)(5nu^4-298nu^2+11237)/414720``;

    its error is below 2e-7 at ``x >= 30``, 1e-9 at ``x >= 100`` and about 1e-12 at
    ``x >= 1000`` (against the series, tests/test_partition.py)."""
    nu = 1.0 / t
    x = rate / t
    nu2 = nu * nu
    c1 = (nu2 - 1.0) / 24.0
    c2 = (nu2 - 1.0) * (nu2 + 23.0) / 1152.0
    c3 = (nu2 - 1.0) * (5.0 * nu2 * nu2 - 298.0 * nu2 + 11237.0) / 414720.0
    series = 1.0 + (c1 + (c2 + c3 / x) / x) / x
    # log(2 pi) + log(r), not log(2 pi r): the product overflows float32 for finite rates
    # r > 5.4e37 (a log link's eta > 86.88, reached by quadrature nodes on a funnel)
    log_2pi_r = math.log(2.0 * math.pi) + jnp.log(rate)
    return 0.5 * (1.0 - nu) * log_2pi_r + 0.5 * jnp.log(t) + jnp.log(series)


@jax.jit
def _poisson_log_sum_any(params: tuple[Array, ...]) -> Array:
    """The series for ``rate / T`` below 30 (float32) or 1000 (float64), i.e.
    ``O(rate + T log(1/eps))`` terms, and the asymptotic expansion beyond (``O(1)``), so that
    no rate makes the loop run long; a non-finite rate gives ``nan``."""
    rate, t = params
    big = _poisson_large(rate, t)
    finite = jnp.isfinite(rate)
    small = _poisson_log_sum((jnp.where(big | ~finite, t, rate), t))  # cheap stand-ins
    large = _poisson_asymptotic(jnp.where(big, rate, 2e3 * t), t)  # a safe stand-in
    return jnp.where(finite, jnp.where(big, large, small), jnp.nan)


def _poisson_core(rate: Array, t: Array) -> Array:
    return _bucketed(_poisson_log_sum_any, _poisson_params_jit(rate, t))


#: a Binomial whose largest count is known at trace time and below this is summed in one
#: chunk of ``n + 1`` terms, without the series' loop: Binomial(20) under the quadrature of
#: a logit-normal local paid for 144 terms a call (the loop's first chunk of 16, then one
#: of 128), 7x the 21 it needs
_BINOMIAL_ONE_CHUNK = 1024


@functools.cache
def _finite_binomial_log_sum(terms: int) -> Callable[[tuple[Array, ...]], Array]:
    return _make_series_log_sum(_binomial_term, _binomial_tail, _binomial_term_grad, terms)


def _known_terms(n: Array) -> int | None:
    """``max(n) + 1`` if the counts ``n`` are known at trace time (not traced) and at most
    ``_BINOMIAL_ONE_CHUNK``; else ``None`` (the series' loop, which finds where to stop)."""
    if isinstance(n, jax.core.Tracer):
        return None
    most = np.max(np.asarray(n, np.float64), initial=0.0)
    return int(most) + 1 if np.isfinite(most) and most < _BINOMIAL_ONE_CHUNK else None


_BINOMIAL_TERMS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "binomial_terms", default=None)


@contextlib.contextmanager
def binomial_terms(terms: int | None) -> Iterator[None]:
    """Within it, Binomial normalisers whose counts are traced (data passed to a compiled
    function) sum ``terms`` terms in one chunk, as counts known at trace time do, and give
    NaN (never a truncated sum) wherever a count is ``>= terms``. ``None``: the series' loop.
    :func:`~numpyro_tempering.partition_function.log_partition` sets it from the model's
    largest count, found by running the model once on its data, and keys its compiled
    runners on it. JAX's trace caches, keyed on the Python function, do not see it: a
    function traced under one value and traced again under another keeps its first trace
    (give each value a function object of its own, e.g. a fresh ``lambda``).

    Example:
        >>> import numpyro.distributions as dist
        >>> def log_z(n):
        ...     return tempered_log_normalizer(dist.Binomial(n, probs=0.5), 2.0)
        >>> with binomial_terms(4):  # counts 0..3 summed in one chunk, 4 refused
        ...     out = jax.jit(log_z)(jnp.array([1, 3, 4]))
        >>> round(float(out[0]), 4), bool(jnp.isnan(out[2]))  # log(2 sqrt(1/2))
        (0.3466, True)
    """
    token = _BINOMIAL_TERMS.set(terms)
    try:
        yield
    finally:
        _BINOMIAL_TERMS.reset(token)


def _binomial_core(from_probs: bool, n: Array, param: Array, t: Array) -> Array:
    terms = _known_terms(n)
    hinted = isinstance(n, jax.core.Tracer) and _BINOMIAL_TERMS.get() is not None
    if hinted:  # (known counts beyond _BINOMIAL_ONE_CHUNK keep the loop)
        terms = _BINOMIAL_TERMS.get()
    log_sum = _binomial_log_sum if terms is None else _finite_binomial_log_sum(terms)
    log_z = _bucketed(log_sum, _binomial_params_jit(from_probs, n, param, t))
    return jnp.where(jnp.asarray(n) < terms, log_z, jnp.nan) if hinted else log_z


@partial(jax.jit, static_argnums=3)
def _poisson_sample_core(
    key: Array, rate: Array, t: Array, shape: tuple[int, ...], log_z: Array
) -> Array:
    params = _poisson_params(rate, t)
    params = tuple(jnp.broadcast_to(p, shape[len(shape) - log_z.ndim :]) for p in params)
    u = random.uniform(key, shape, params[0].dtype)
    # the law is close to N(r, r T) for large r: below r - 10 sqrt(r T) lies less than e^-50
    # of its mass, so large rates start their walk there (O(sqrt(r T)) terms, not O(r))
    rate_b, t_b = params
    big = _poisson_large(rate_b, t_b)
    offset = jnp.where(big, jnp.floor(jnp.maximum(rate_b - 10.0 * jnp.sqrt(rate_b * t_b), 0.0)),
                       0.0)
    return _series_sample(_poisson_term, _poisson_tail, params, log_z.astype(u.dtype), u,
                          offset)


@partial(jax.jit, static_argnums=(0, 5))
def _binomial_sample_core(
    from_probs: bool,
    key: Array,
    n: Array,
    param: Array,
    t: Array,
    shape: tuple[int, ...],
    log_z: Array,
) -> Array:
    params = _binomial_params(from_probs, n, param, t)
    params = tuple(jnp.broadcast_to(p, shape[len(shape) - log_z.ndim :]) for p in params)
    u = random.uniform(key, shape, params[0].dtype)
    return _series_sample(_binomial_term, _binomial_tail, params, log_z.astype(u.dtype), u)


def _sample_tempered_poisson(
    key: Array, td: TemperedDistribution, sample_shape: tuple[int, ...]
) -> Array:
    shape = sample_shape + tuple(td.batch_shape)
    return _poisson_sample_core(key, td.base_dist.rate, td.temperature, shape, td.log_normalizer)


def _sample_tempered_binomial(
    key: Array, td: TemperedDistribution, sample_shape: tuple[int, ...]
) -> Array:
    from_probs, n, param = _binomial_args(td.base_dist)
    shape = sample_shape + tuple(td.batch_shape)
    return _binomial_sample_core(
        from_probs, key, n, param, td.temperature, shape, td.log_normalizer
    )


@register_tempered(npd.Poisson)
def _poisson(d: npd.Poisson, t: Array) -> TemperedResult:
    log_z = _poisson_core(d.rate, t)
    return TemperedResult(log_z, _wrap(d, t, log_z, _sample_tempered_poisson))


@register_tempered(npd.BinomialProbs)
@register_tempered(npd.BinomialLogits)
def _binomial(d: Distribution, t: Array) -> TemperedResult:
    log_z = _binomial_core(*_binomial_args(d), t)
    return TemperedResult(log_z, _wrap(d, t, log_z, _sample_tempered_binomial))


# ------------------------------------------------------------------------------------------
# Wrappers
# ------------------------------------------------------------------------------------------


@register_tempered(npd.Independent)
def _independent(d: npd.Independent, t: Array) -> TemperedResult:
    r = d.reinterpreted_batch_ndims
    log_z, base_td = _dispatch(d.base_dist, _expand_t(t, r))
    return TemperedResult(sum_rightmost(log_z, r), npd.Independent(base_td, r))


@register_tempered(npd.ExpandedDistribution)
def _expanded(d: npd.ExpandedDistribution, t: Array) -> TemperedResult:
    return _dispatch(d.base_dist, t)  # _dispatch broadcasts to the expanded batch shape


@register_tempered(npd.MaskedDistribution)
def _masked(d: npd.MaskedDistribution, t: Array) -> TemperedResult:
    log_z, base_td = _dispatch(d.base_dist, t)
    mask = d._mask
    if mask is True:
        return TemperedResult(log_z, base_td)
    if mask is False:
        return TemperedResult(jnp.zeros_like(log_z), npd.MaskedDistribution(base_td, False))
    return TemperedResult(jnp.where(mask, log_z, 0.0), npd.MaskedDistribution(base_td, mask))


# ------------------------------------------------------------------------------------------
# Opt-in numerical fallbacks
# ------------------------------------------------------------------------------------------

_QUAD_STEP = 1.0 / 64.0
_QUAD_TMAX = 4.5
_QUAD_NODES = np.arange(-round(_QUAD_TMAX / _QUAD_STEP), round(_QUAD_TMAX / _QUAD_STEP) + 1)
_HALF_PI = 0.5 * math.pi
#: tolerance of the quadrature self-checks (see :func:`_checked_integral`)
_QUAD_TOL = 1e-3
#: nodes more than this many nats below the largest term are left out (< 1e-34 of it)
_QUAD_NEGLIGIBLE = 80.0


def _log_cosh(x: Array) -> Array:
    ax = jnp.abs(x)
    return ax + jnp.log1p(jnp.exp(-2.0 * ax)) - math.log(2.0)


def _safe_moments(d: Distribution) -> tuple[Array, Array]:
    try:
        mean = jnp.asarray(d.mean)
        std = jnp.sqrt(jnp.asarray(d.variance))
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return jnp.zeros(()), jnp.ones(())
    mean = jnp.where(jnp.isfinite(mean), mean, 0.0)
    std = jnp.where(jnp.isfinite(std) & (std > 0), std, 1.0)
    return mean, std


def _quadrature_support(d: Distribution) -> str:
    support = d.support
    if len(d.event_shape) != 0 or support is None or support.is_discrete:
        raise NotImplementedError(
            f"fallback='quadrature' needs a univariate continuous distribution; "
            f"{type(d).__name__} has event_shape {d.event_shape} and support {support}"
        )
    if isinstance(support, constraints._Real):
        return "real"
    if isinstance(support, constraints._Interval):
        return "interval"
    if isinstance(support, constraints._GreaterThan):
        return "lower"
    if isinstance(support, constraints._LessThan):
        return "upper"
    raise NotImplementedError(
        f"fallback='quadrature' does not handle the support {support} of {type(d).__name__}"
    )


def _quadrature_nodes(d: Distribution, t: Array, kind: str) -> tuple[Array, Array]:
    """Double-exponential nodes ``x`` and log weights, both ``(Q, *broadcast(T, batch))``."""
    support = d.support
    shape = jnp.broadcast_shapes(jnp.shape(t), tuple(d.batch_shape))
    dtype = jnp.result_type(t, jnp.result_type(float))
    tau = jnp.asarray(_QUAD_NODES * _QUAD_STEP, dtype).reshape((-1,) + (1,) * len(shape))
    u = _HALF_PI * jnp.sinh(tau)
    log_dtau = math.log(_HALF_PI) + jnp.log(jnp.cosh(tau)) + math.log(_QUAD_STEP)
    if kind == "real":  # sinh-sinh around the mean, scaled by sqrt(T * variance)
        mean, std = _safe_moments(d)
        scale = std * jnp.sqrt(t)
        x = mean + scale * jnp.sinh(u)
        log_jac = jnp.log(scale) + _log_cosh(u)
    elif kind == "interval":  # tanh-sinh
        lo, hi = support.lower_bound, support.upper_bound
        width = jnp.asarray(hi) - jnp.asarray(lo)
        # lo + width * sigmoid(2u), measured from the nearer endpoint (no cancellation)
        x = jnp.where(
            u < 0, lo + width * jax.nn.sigmoid(2.0 * u), hi - width * jax.nn.sigmoid(-2.0 * u)
        )
        log_jac = jnp.log(0.5 * width) - 2.0 * _log_cosh(u)
    else:  # exp-sinh from the finite edge, scaled by the distance of the mean
        lower = kind == "lower"
        edge = jnp.asarray(support.lower_bound if lower else support.upper_bound)
        mean, _ = _safe_moments(d)
        gap = (mean - edge) if lower else (edge - mean)
        scale = jnp.where(jnp.isfinite(gap) & (gap > 0), gap, 1.0)
        x = edge + (1.0 if lower else -1.0) * scale * jnp.exp(u)
        log_jac = jnp.log(scale) + u
    full = (_QUAD_NODES.size,) + shape
    x = jnp.broadcast_to(x.astype(dtype), full)
    return x, jnp.broadcast_to((log_jac + log_dtau).astype(dtype), full)


def _finite_log_prob(log_p: Array) -> Array:
    return jnp.where(jnp.isnan(log_p) | (log_p == jnp.inf), -jnp.inf, log_p)


def _checked_integral(log_f: Array, t: Array, axes: tuple[int, ...]) -> Array:
    r"""``log sum exp(log_f)`` over ``axes`` (the last one the node axis), NaN where unreliable.

    ``log_f`` is the tempered integrand plus the log weights. Three self-checks, all on the
    same nodes (no extra density evaluations), each to ``_QUAD_TOL`` in log space:

    * the rule with every other node (step ``2h``) agrees with the full rule (step ``h``),
      the usual error estimate of a double-exponential rule (modes the nodes do not
      resolve);
    * the integrand vanishes at the ends of the node range (a truncated or divergent
      integral, e.g. Cauchy at ``T >= 2``);
    * at ``T = 1`` the density integrates to one (``log Z(1) = 0``).
    """
    node_axis = axes[-1]
    shape = [1] * log_f.ndim
    shape[node_axis] = -1
    index = np.abs(_QUAD_NODES).reshape(shape)
    log_z = logsumexp(log_f, axis=axes)
    half = logsumexp(jnp.where(jnp.asarray(index % 2 == 0), log_f, -jnp.inf), axis=axes)
    ends = jnp.asarray(index >= index.max() - round(0.5 / _QUAD_STEP))
    log_ends = logsumexp(jnp.where(ends, log_f, -jnp.inf), axis=axes)
    ok = (
        (jnp.abs(half + math.log(2.0) - log_z) <= _QUAD_TOL)
        & (log_ends - log_z <= math.log(_QUAD_TOL))
        & ((t != 1) | (jnp.abs(log_z) <= _QUAD_TOL))
    )
    return jnp.where(ok, log_z, jnp.nan)


def _kept_log_f(log_f: Callable[[Array], Array], x: Array, node_axis: int) -> Array:
    """``log_f`` (the log integrand plus the log weights) at the nodes ``x``, the rule's
    nodes along ``node_axis`` and any rules (a mixture's components) before it, with the
    nodes where it is not finite (or ``x`` itself overflowed, far out at a large scale), or
    whose share of the integral is below ``e^-_QUAD_NEGLIGIBLE``, set to ``-inf``: those are
    evaluated at their rule's centre node instead, so that no derivative of a discarded
    node reaches the gradient (0 * nan = nan, 0 * inf = nan: the gradient in the scale was
    NaN beyond ~1e8 in float32, the curvature beyond ~1e4; a mixture's was NaN at every
    temperature with NumPyro's default validation)."""
    first = lax.stop_gradient(log_f(lax.stop_gradient(x)))
    finite = lax.stop_gradient(jnp.isfinite(x)) & jnp.isfinite(first)
    top = jnp.max(jnp.where(finite, first, -jnp.inf), axis=tuple(range(node_axis + 1)))
    keep = finite & (first > top - _QUAD_NEGLIGIBLE)
    centre = jnp.take(x, _QUAD_NODES.size // 2, axis=node_axis)
    centre = jnp.broadcast_to(jnp.expand_dims(centre, node_axis), x.shape)
    return jnp.where(keep, log_f(jnp.where(keep, x, lax.stop_gradient(centre))), -jnp.inf)


def _quadrature_log_z(d: Distribution, t: Array, kind: str) -> Array:
    x, log_w = _quadrature_nodes(d, t, kind)
    log_f = _kept_log_f(lambda y: d.log_prob(y) / t + log_w, x, 0)
    return _checked_integral(log_f, t, (0,))


_quadrature_log_z_jit = jax.jit(_quadrature_log_z, static_argnums=2)


def _raise_if_unreliable(log_z: Array, d: Distribution, what: str) -> None:
    """Concrete results: a failed quadrature self-check is an error (traced: NaN stays)."""
    if not_jax_tracer(log_z) and bool(np.any(np.isnan(np.asarray(log_z)))):
        raise ValueError(
            f"{what} for {type(d).__name__} failed its self-checks (to {_QUAD_TOL} in log "
            "space: half the nodes agree with all of them; the integrand vanishes at the ends "
            "of the node range; Z(1) = 1): the density has modes the nodes do not resolve, or "
            "the integral diverges (a heavy-tailed density at a high temperature)"
        )


def _quadrature_rule(d: Distribution, t: Array) -> TemperedResult:
    """Double-exponential trapezoidal rule for univariate continuous ``d`` (opt-in)."""
    kind = _quadrature_support(d)
    try:  # distributions are pytrees: compile once per type/shape
        log_z = _quadrature_log_z_jit(d, t, kind)
    except (TypeError, ValueError):  # e.g. unhashable static pytree data: run eagerly
        log_z = _quadrature_log_z(d, t, kind)
    _raise_if_unreliable(log_z, d, "fallback='quadrature'")
    return TemperedResult(log_z, _wrap(d, t, log_z))


def _scaled_log_probs(d: Distribution, values: Array, t: Array) -> Array:
    log_p = d.log_prob(values)  # (S, *batch)
    n_batch = len(jnp.broadcast_shapes(jnp.shape(t), tuple(d.batch_shape)))
    pad = n_batch - (log_p.ndim - 1)
    log_p = jnp.reshape(log_p, log_p.shape[:1] + (1,) * pad + log_p.shape[1:])
    return log_p / t


_scaled_log_probs_jit = jax.jit(_scaled_log_probs)


def _enumerated_log_weights(d: Distribution, t: Array) -> Array:
    """``log p(v) / T`` over the enumerated support, shape ``(S, *broadcast(T, batch))``."""
    values = d.enumerate_support(expand=False)  # needs concrete parameters: not jitted
    try:
        return _scaled_log_probs_jit(d, values, t)
    except (TypeError, ValueError):  # e.g. unhashable static pytree data: run eagerly
        return _scaled_log_probs(d, values, t)


def _sample_enumerated(
    key: Array, td: TemperedDistribution, sample_shape: tuple[int, ...]
) -> Array:
    d = td.base_dist
    batch, event = tuple(td.batch_shape), tuple(td.event_shape)
    log_w = _enumerated_log_weights(d, td.temperature)
    n_support = log_w.shape[0]
    log_w = jnp.broadcast_to(log_w, (n_support,) + batch)
    idx = random.categorical(key, jnp.moveaxis(log_w, 0, -1), shape=sample_shape + batch)
    values = td.enumerate_support(expand=True)  # (S, *batch, *event)
    n_b, n_e = int(np.prod(batch, dtype=np.int64)), int(np.prod(event, dtype=np.int64))
    flat_values = values.reshape(n_support, n_b, n_e)
    flat_idx = idx.reshape(-1, n_b)
    out = flat_values[flat_idx, jnp.arange(n_b)[None, :], :]
    return out.reshape(sample_shape + batch + event)


def _enumerate_rule(d: Distribution, t: Array) -> TemperedResult:
    """Exact finite sum over ``enumerate_support()`` (opt-in)."""
    if not d.has_enumerate_support:
        raise NotImplementedError(
            f"fallback='enumerate' needs a discrete distribution with finite enumerable "
            f"support; {type(d).__name__} has has_enumerate_support=False"
        )
    log_z = logsumexp(_enumerated_log_weights(d, t), axis=0)
    return TemperedResult(log_z, _wrap(d, t, log_z, _sample_enumerated))


# ------------------------------------------------------------------------------------------
# Mixtures, and the tempered sites of numpyro_tempering.handlers
# ------------------------------------------------------------------------------------------


def _mixture_log_weights(d: Distribution) -> Array:
    return jax.nn.log_softmax(d.mixing_distribution.logits, axis=-1)


def _mixture_nodes(d: Distribution, t: Array) -> tuple[Array, Array]:
    """Nodes and log weights ``(K, Q, *broadcast(T, batch))``: one rule per component,
    centred and scaled on that component (at ``T``) as the univariate fallback does."""
    shape = (_QUAD_NODES.size,) + jnp.broadcast_shapes(jnp.shape(t), tuple(d.batch_shape))
    if isinstance(d, npd.MixtureSameFamily):
        comp = d.component_distribution
        x, log_w = _quadrature_nodes(comp, _expand_t(t, 1), _quadrature_support(comp))
        x, log_w = jnp.moveaxis(x, -1, 0), jnp.moveaxis(log_w, -1, 0)  # (K, Q, ...)
        full = (x.shape[0],) + shape
        return jnp.broadcast_to(x, full), jnp.broadcast_to(log_w, full)
    nodes = [_quadrature_nodes(c, t, _quadrature_support(c)) for c in d.component_distributions]
    return (
        jnp.stack([jnp.broadcast_to(x, shape) for x, _ in nodes]),
        jnp.stack([jnp.broadcast_to(w, shape) for _, w in nodes]),
    )


def _mixture_log_f(d: Distribution, x: Array, t: Array, log_w: Array) -> Array:
    """The tempered integrand times the partition of unity, plus the log weights, at the
    nodes ``x`` ``(K, Q, *TB)`` (:func:`_mixture_log_z`)."""
    k = x.shape[0]
    log_p = _finite_log_prob(d.log_prob(x))
    # floored: far out every component underflows (the integrand is 0 there anyway)
    clp = jnp.maximum(_finite_log_prob(d.component_log_probs(x)), -1e30)  # (K, Q, *TB, K)
    clp = clp / _expand_t(t, 1)
    own = jnp.eye(k, dtype=bool).reshape((k,) + (1,) * (clp.ndim - 2) + (k,))
    log_rho = jnp.sum(jnp.where(own, clp, 0.0), axis=-1) - logsumexp(clp, axis=-1)
    # where the density underflows, the integrand is 0 whatever log_rho is: compiled, the
    # log-sum-exp of the floored values came out -inf (eager: finite), and log_rho +inf made
    # -inf + inf = NaN at the far nodes of every two-Normal mixture (found by a probe)
    return jnp.where(log_p == -jnp.inf, -jnp.inf, log_p / t + log_rho + log_w)


def _mixture_log_z(d: Distribution, t: Array) -> Array:
    r"""``log int (sum_k w_k p_k(x))^{1/T} dx`` by quadrature, split over the components.

    The integrand is multiplied by the partition of unity
    :math:`\rho_k(x) \propto (w_k p_k(x))^{1/T}` (:math:`\sum_k \rho_k = 1`) and each piece
    integrated with a rule centred on component :math:`k`: separated or narrow components
    are resolved however far apart they are. Far and negligible nodes are left out as in
    the univariate rule (:func:`_kept_log_f`): the double-exponential rule's far nodes
    overflow the densities, and the gradient in the components' parameters was NaN, so that
    HMC and Newton on a model with a mixture likelihood never moved.
    """
    x, log_w = _mixture_nodes(d, t)  # (K, Q, *TB)
    log_f = _kept_log_f(lambda y: _mixture_log_f(d, y, t, log_w), x, 1)
    return _checked_integral(log_f, t, (0, 1))


_mixture_log_z_jit = jax.jit(_mixture_log_z)


@register_tempered(npd.MixtureSameFamily)
@register_tempered(npd.MixtureGeneral)
def _mixture(d: Distribution, t: Array) -> TemperedResult:
    """Mixtures of univariate continuous components: quadrature (see the module docstring)."""
    if d.is_discrete:
        raise NotImplementedError(
            f"no tempering rule for a {type(d).__name__} of discrete components; use "
            "fallback='enumerate' (finite support), or temper the joint of the summed-out "
            "local (temper(..., joint=True))"
        )
    try:
        log_z = _mixture_log_z_jit(d, t)
    except (TypeError, ValueError):  # e.g. unhashable static pytree data: run eagerly
        log_z = _mixture_log_z(d, t)
    _raise_if_unreliable(log_z, d, "the mixture quadrature")
    return TemperedResult(log_z, _wrap(d, t, log_z))


@register_tempered(Tempered)
def _tempered_site(d: Tempered, t: Array) -> TemperedResult:
    """``p^b`` (a site ``temper`` tempered at ``T0 = 1/b``) tempered at ``T``: ``p`` at ``T/b``."""
    return _dispatch(d.base_dist, t / jnp.asarray(d.inv_temperature))


@register_tempered(JointlyTempered)
def _jointly_tempered(d: JointlyTempered, t: Array) -> TemperedResult:
    """A jointly tempered site: its wrappers' rules (plate expansion, mask, ``to_event``)
    around :class:`~numpyro_tempering.handlers.JointMixture`'s."""
    return _dispatch(d.inner, t)


@register_tempered(JointMixture)
def _joint_mixture(d: JointMixture, t: Array) -> TemperedResult:
    r"""Joint tempering of a summed-out local: :math:`\int \sum_k (w_k p_k(x))^{1/T} dx =
    \sum_k w_k^{1/T} Z_k(T)`, in closed form for registered components."""
    mix = d.mixture
    t_eff = t / jnp.asarray(d.inv_temperature)
    log_w = _mixture_log_weights(mix)
    t_k = _expand_t(t_eff, 1)
    if isinstance(mix, npd.MixtureSameFamily):
        log_zk, law_k = _dispatch(mix.component_distribution, t_k)
    elif isinstance(mix, npd.MixtureGeneral):
        parts = [_dispatch(c, t_eff) for c in mix.component_distributions]
        log_zk = jnp.stack(jnp.broadcast_arrays(*(z for z, _ in parts)), axis=-1)
        law_k = [law for _, law in parts]
    else:
        raise NotImplementedError(
            f"joint tempering needs a MixtureSameFamily or MixtureGeneral, got "
            f"{type(mix).__name__}"
        )
    logits = log_w / t_k + log_zk
    log_z = logsumexp(logits, axis=-1)
    batch = jnp.shape(log_z)
    mixing = _law(mix.mixing_distribution, npd.CategoricalLogits, jnp.broadcast_to(
        logits, batch + (logits.shape[-1],)))
    if isinstance(law_k, list):
        law = _law(mix, npd.MixtureGeneral, mixing, [c.expand(batch) for c in law_k])
    else:
        law = _law(mix, npd.MixtureSameFamily, mixing, law_k.expand(batch + law_k.batch_shape[-1:]))
    return TemperedResult(log_z, law)
