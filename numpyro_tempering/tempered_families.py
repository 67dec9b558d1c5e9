r"""Closed-form tempered normalisers of location-scale and heavy-tailed families.

With :math:`a = 1/T`, the rule of every family below is :math:`\log Z(T) = \log\int
p(x)^{a}\,dx` for NumPyro's whole density (normaliser included), registered with
:func:`~numpyro_tempering.partition.register_tempered` like those of
:mod:`numpyro_tempering.partition`. A location-scale density :math:`p(x) = f((x - \mu)/s)/s`
has :math:`\log Z = (1 - a)\log s + \log\int f(z)^a dz`, so the scale enters exactly and
only the standard integral needs a closed form:

* StudentT(nu, mu, s): with :math:`m = a(\nu + 1)/2`, :math:`\log Z = a\log c_\nu + (1 - a)
  \log s + \tfrac12\log(\nu\pi) + \log\Gamma(m - \tfrac12) - \log\Gamma(m)`,
  :math:`c_\nu = \Gamma(\tfrac{\nu + 1}2)/(\sqrt{\nu\pi}\,\Gamma(\tfrac\nu2))`; finite for
  :math:`\nu' = a(\nu + 1) - 1 > 0`; law StudentT(nu', mu, s sqrt(nu / nu')).
  Cauchy(mu, s) is the case :math:`\nu = 1` (finite for :math:`T < 2`).
* Laplace(mu, s): :math:`(1 - a)\log 2s + \log T`; law Laplace(mu, s T).
* Logistic(mu, s): :math:`(1 - a)\log s + \log B(a, a)`; law mu + s logit(Beta(a, a)).
* Gumbel(mu, s): :math:`(1 - a)\log s + \log\Gamma(a) - a\log a`; law mu - s log(G / a),
  G ~ Gamma(a).
* HalfNormal(s): :math:`(a - 1)\log 2 + \tfrac{1 - a}2\log(2\pi s^2) + \tfrac12\log T`;
  law HalfNormal(s sqrt(T)).
* HalfCauchy(s): :math:`a\log\tfrac2\pi + (1 - a)\log s - \log 2 + \tfrac12\log\pi +
  \log\Gamma(a - \tfrac12) - \log\Gamma(a)` (the Cauchy's less :math:`(1 - a)\log 2`),
  finite for :math:`T < 2`; law the absolute
  value of StudentT(2a - 1, 0, s / sqrt(2a - 1)).
* LogNormal(mu, s): :math:`\tfrac{1 - a}2\log(2\pi s^2) + \tfrac12\log T + (1 - a)\mu +
  (1 - a)^2 s^2 T/2`; law LogNormal(mu + (1 - a) s^2 T, s sqrt(T)).
* InverseGamma(alpha, beta): with :math:`\alpha' = a(\alpha + 1) - 1`,
  :math:`a(\alpha\log\beta - \log\Gamma(\alpha)) + \log\Gamma(\alpha') - \alpha'\log(a\beta)`,
  finite for :math:`\alpha' > 0`; law InverseGamma(alpha', a beta).

* GammaPoisson(a, b), and the negative binomials built on it (``NegativeBinomialProbs``,
  ``NegativeBinomialLogits``, ``NegativeBinomial2``): with :math:`P = b/(1 + b)`, the pmf is
  :math:`p(k) = \frac{\Gamma(a + k)}{\Gamma(a)\,k!} P^a (1 - P)^k` and :math:`\log Z =
  \log\sum_{k \ge 0} p(k)^{1/T}` has no closed form. It is summed as the Poisson's series
  is (:mod:`numpyro_tempering.partition`: chunks of 128 terms in log space, gradients by a
  ``custom_jvp`` accumulated in the same loop) with the rigorous tail bound
  :math:`t_K\,q/(1 - q)`, :math:`q = ((1 - P)\max(1, \tfrac{a + K}{K + 1}))^{1/T}`, which
  bounds every later ratio of consecutive terms :math:`((1 - P)\tfrac{a + k}{k + 1})^{1/T}`
  (decreasing in k for :math:`a \ge 1`, increasing to :math:`(1 - P)^{1/T}` for
  :math:`a < 1`). The log terms use :func:`~numpyro_tempering.special.log_beta` (accurate
  for large k and a: no difference of two large log-gammas; JAX's ``betaln`` errs by 1e-6
  in float64), so float32 keeps about 1e-6 relative accuracy in each term. The cost is
  the number of terms before the tail bound falls below float precision, about the tempered
  law's mean plus tens of its standard deviations (the law is spread over :math:`O(\bar k)`
  values when a is small): an element that needs more than :math:`2^{22}` terms (means
  beyond about a million) gives NaN, at once where lower bounds on the terms needed show
  it (``_nb_beyond_cap``), not after the whole cap. There is no large-mean expansion yet
  (the Poisson has one): :func:`~numpyro_tempering.partition_function.log_partition` runs
  the series for every particle and is slow where the tilted target reaches large means
  (a probe: 120 s for one temperature at N = 50, 323 s at N = 200, within 0.02 nats).
  Law: the normalised :math:`p^{1/T}/Z`, sampled by the same walk.

Each is 0 at T = 1 exactly, and tested against numerical integration and against its law's
``log_prob`` (``tests/test_tempered_families.py``). Where the tempered integral diverges
(heavy tails at a high temperature) the rule gives :math:`+\infty` under tracing and raises
``ValueError`` for concrete inputs, as for the Gamma and Beta rules.

Before these rules, a Student-t likelihood needed ``fallback='quadrature'``, whose nodes
scale with :math:`s`: at the scales a tilted target reaches (:math:`\log s \approx 22` at
T = 2, N = 500) they overflowed float32, the gradient was NaN and :func:`log_partition
<numpyro_tempering.partition_function.log_partition>` returned values hundreds of nats low.

Example:
    >>> import numpyro.distributions as dist
    >>> from numpyro_tempering.partition import tempered_log_normalizer
    >>> round(float(tempered_log_normalizer(dist.Laplace(0.0, 0.5), 2.0)), 6)  # log 2
    0.693147
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpyro.distributions as npd
from jax import Array, random
from jax.scipy.special import digamma, gammaln

from numpyro_tempering.partition import (
    _SERIES_CHUNK,
    _SERIES_MAX_TERMS,
    TemperedResult,
    _broadcast_params,
    _bucketed,
    _check_proper,
    _float,
    _law,
    _make_series_log_sum,
    _normal_core,
    _one_minus_inv,
    _series_sample,
    _wrap,
    register_tempered,
)
from numpyro_tempering.special import log_beta

__all__: list[str] = []

_LOG_PI = math.log(math.pi)

# As in numpyro_tempering.partition, the array math of each rule is a jitted core: one
# compilation per shape and dtype instead of one dispatch per primitive in eager mode.


def _tempered_shape(shape: Array, t: Array) -> tuple[Array, Array, Array]:
    """``(a, ok, safe)``: a = 1/T and the tempered shape a (shape + 1) - 1 (Student-t's
    degrees of freedom, the inverse gamma's shape), where it is > 0 (``ok``: the
    integral converges), else 1 (a stand-in that keeps the arithmetic finite)."""
    a = 1.0 / t
    shape_t = a * (shape + 1.0) - 1.0
    ok = shape_t > 0
    return a, ok, jnp.where(ok, shape_t, 1.0)


@jax.jit
def _student_core(df: Array, scale: Array, t: Array) -> tuple[Array, ...]:
    """log Z, nu', the tempered law's scale, and whether log Z is finite."""
    a, ok, safe = _tempered_shape(df, t)
    m = 0.5 * (safe + 1.0)
    log_c = gammaln(0.5 * (df + 1.0)) - gammaln(0.5 * df) - 0.5 * (jnp.log(df) + _LOG_PI)
    log_z = (a * log_c + _one_minus_inv(t) * jnp.log(scale) + 0.5 * (jnp.log(df) + _LOG_PI)
             + gammaln(m - 0.5) - gammaln(m))
    return jnp.where(ok, log_z, jnp.inf), safe, scale * jnp.sqrt(df / safe), ok


@register_tempered(npd.StudentT)
def _student_t(d: npd.StudentT, t: Array) -> TemperedResult:
    log_z, df_t, scale_t, ok = _student_core(d.df, d.scale, t)
    _check_proper(ok, d, "df' = (df + 1) / temperature - 1 > 0")
    return TemperedResult(log_z, _law(d, npd.StudentT, df_t, d.loc, scale_t))


@register_tempered(npd.Cauchy)
def _cauchy(d: npd.Cauchy, t: Array) -> TemperedResult:
    log_z, df_t, scale_t, ok = _student_core(jnp.ones_like(d.scale), d.scale, t)
    _check_proper(ok, d, "temperature < 2")
    return TemperedResult(log_z, _law(d, npd.StudentT, df_t, d.loc, scale_t))


@jax.jit
def _laplace_core(scale: Array, t: Array) -> tuple[Array, Array]:
    return _one_minus_inv(t) * jnp.log(2.0 * scale) + jnp.log(t), scale * t


@register_tempered(npd.Laplace)
def _laplace(d: npd.Laplace, t: Array) -> TemperedResult:
    log_z, scale = _laplace_core(d.scale, t)
    return TemperedResult(log_z, _law(d, npd.Laplace, d.loc, scale))


def _logistic_sampler(key: Array, td, sample_shape: tuple[int, ...]) -> Array:
    d, a = td.base_dist, 1.0 / td.temperature
    shape = sample_shape + td.batch_shape
    b = random.beta(key, a, a, shape, dtype=jnp.result_type(float))
    return d.loc + d.scale * (jnp.log(b) - jnp.log1p(-b))


@jax.jit
def _logistic_core(scale: Array, t: Array) -> Array:
    a = 1.0 / t
    return _one_minus_inv(t) * jnp.log(scale) + 2.0 * gammaln(a) - gammaln(2.0 * a)


@register_tempered(npd.Logistic)
def _logistic(d: npd.Logistic, t: Array) -> TemperedResult:
    log_z = _logistic_core(d.scale, t)
    return TemperedResult(log_z, _wrap(d, t, log_z, _logistic_sampler))


def _gumbel_sampler(key: Array, td, sample_shape: tuple[int, ...]) -> Array:
    d, a = td.base_dist, 1.0 / td.temperature
    shape = sample_shape + td.batch_shape
    g = random.gamma(key, jnp.broadcast_to(a, shape), dtype=jnp.result_type(float))
    return d.loc - d.scale * (jnp.log(g) - jnp.log(a))


@jax.jit
def _gumbel_core(scale: Array, t: Array) -> Array:
    a = 1.0 / t
    return _one_minus_inv(t) * jnp.log(scale) + gammaln(a) - a * jnp.log(a)


@register_tempered(npd.Gumbel)
def _gumbel(d: npd.Gumbel, t: Array) -> TemperedResult:
    log_z = _gumbel_core(d.scale, t)
    return TemperedResult(log_z, _wrap(d, t, log_z, _gumbel_sampler))


@register_tempered(npd.HalfNormal)
def _half_normal(d: npd.HalfNormal, t: Array) -> TemperedResult:
    # 2 p(x) on x > 0: int (2p)^a = 2^(a - 1) int_R p^a, the Normal's less (1 - a) log 2
    log_z, scale_t = _normal_core(d.scale, t)
    log_z = log_z - _one_minus_inv(t) * math.log(2.0)
    return TemperedResult(log_z, _law(d, npd.HalfNormal, scale_t))


def _half_cauchy_sampler(key: Array, td, sample_shape: tuple[int, ...]) -> Array:
    d = td.base_dist
    df = 2.0 / td.temperature - 1.0
    shape = sample_shape + td.batch_shape
    z = random.t(key, jnp.broadcast_to(df, shape), shape, dtype=jnp.result_type(float))
    return jnp.abs(z) * d.scale / jnp.sqrt(df)


@register_tempered(npd.HalfCauchy)
def _half_cauchy(d: npd.HalfCauchy, t: Array) -> TemperedResult:
    # as the half-normal: the Cauchy's log Z less (1 - a) log 2
    log_z, _, _, ok = _student_core(jnp.ones_like(d.scale), d.scale, t)
    log_z = log_z - _one_minus_inv(t) * math.log(2.0)
    _check_proper(ok, d, "temperature < 2")
    return TemperedResult(log_z, _wrap(d, t, log_z, _half_cauchy_sampler))


@register_tempered(npd.LogNormal)
def _log_normal(d: npd.LogNormal, t: Array) -> TemperedResult:
    # y = log x ~ N(mu, s): p(x)^a dx = N(y)^a e^{(1 - a) y} dy, the Normal's log Z plus the
    # Gaussian integral of e^{(1 - a) y} under the tempered N(mu, s sqrt(T))
    log_z, scale_t = _normal_core(d.scale, t)
    c = _one_minus_inv(t)
    log_z = log_z + c * d.loc + 0.5 * (c * scale_t) ** 2
    return TemperedResult(log_z, _law(d, npd.LogNormal, d.loc + c * scale_t**2, scale_t))


@jax.jit
def _inverse_gamma_core(alpha: Array, beta: Array, t: Array) -> tuple[Array, ...]:
    a, ok, safe = _tempered_shape(alpha, t)
    log_z = (a * (alpha * jnp.log(beta) - gammaln(alpha)) + gammaln(safe)
             - safe * jnp.log(a * beta))
    return jnp.where(ok, log_z, jnp.inf), safe, a * beta, ok


@register_tempered(npd.InverseGamma)
def _inverse_gamma(d: npd.InverseGamma, t: Array) -> TemperedResult:
    log_z, alpha_t, beta_t, ok = _inverse_gamma_core(d.concentration, d.rate, t)
    _check_proper(ok, d, "(concentration + 1) / temperature - 1 > 0")
    return TemperedResult(log_z, _law(d, npd.InverseGamma, alpha_t, beta_t))


# ---- GammaPoisson and the negative binomials: the Poisson's series with its own tail bound ----


def _nb_term(k: Array, params: tuple[Array, ...]) -> Array:
    """log p(k) / T, p(k) = Gamma(a + k) / (Gamma(a) k!) P^a (1 - P)^k, from
    (a, log P, log(1 - P), T); :func:`log_beta` keeps large k and a accurate."""
    a, log_p, log_q, t = params
    return (-log_beta(a, k + 1.0) - jnp.log(a + k) + a * log_p + k * log_q) / t


def _nb_term_grad(k: Array, params: tuple[Array, ...], term: Array) -> tuple[Array, ...]:
    a, _, _, t = params  # d/da log Gamma(a + k) - log Gamma(a) = psi(a + k) - psi(a)
    return ((digamma(a + k) - digamma(a) + params[1]) / t, a / t * jnp.ones_like(term),
            k / t * jnp.ones_like(term), -term / t)


def _nb_tail(k_last: Array, params: tuple[Array, ...]) -> Array:
    """log of a bound on the terms after ``k_last`` = K: every later ratio of consecutive
    terms is at most q = ((1 - P) max(1, (a + K) / (K + 1)))^(1/T), so they sum to at most
    t_K q / (1 - q) (+inf while q >= 1)."""
    a, _, log_q, t = params
    log_ratio = (log_q + jnp.maximum(jnp.log1p((a - 1.0) / (k_last + 1.0)), 0.0)) / t
    below = log_ratio < 0
    safe = jnp.where(below, log_ratio, -1.0)
    bound = _nb_term(k_last, params) + safe - jnp.log1p(-jnp.exp(safe))
    return jnp.where(below, bound, jnp.inf)


_nb_log_sum = _make_series_log_sum(_nb_term, _nb_tail, _nb_term_grad)


def _nb_params(d: npd.GammaPoisson, t: Array) -> tuple[Array, ...]:
    """(a, log P, log(1 - P), T) broadcast together, P = b / (1 + b) from the rate b;
    ``NegativeBinomialLogits`` from its logits (b = e^-logits, P = sigmoid(-logits))."""
    if isinstance(d, npd.NegativeBinomialLogits):
        logits = _float(d.logits)
        log_p, log_q = -jax.nn.softplus(logits), -jax.nn.softplus(-logits)  # b = e^-logits
    else:
        rate = _float(d.rate)
        log_q = -jnp.log1p(rate)
        log_p = jnp.log(rate) + log_q
    return _broadcast_params(_float(d.concentration), log_p, log_q, t)


def _nb_beyond_cap(params: tuple[Array, ...]) -> Array:
    r"""Where the series provably cannot meet its stopping rule within its cap
    (``_SERIES_MAX_TERMS``, checked up to :math:`K` = the cap + one chunk): it would give
    NaN only after the whole cap (a ray of the tail check or a particle at a mean of 1e8
    kept a batch's loop running to the cap, 45 s per call of 200 elements, and
    ``log_partition`` on a negative-binomial model did not return in 17 minutes). The rule
    stops once :math:`t_K q_K/(1 - q_K) < \epsilon s_K` (:math:`s_K` the partial sum). With
    :math:`r = -\log(1 - P)/T` and :math:`q = e^{-r} \le q_K`, each a necessary condition:

    * :math:`q_K < 1`, i.e. :math:`K + 1 > (a - 1)(1 - P)/P` (before, the tail bound is
      infinite);
    * :math:`a \ge 1`: every ratio is at least :math:`e^{-r}`, the largest term
      :math:`t_m` lies at :math:`m \le k^* + 1` (:math:`k^* = (a - 1)(1 - P)/P - 1`), and
      :math:`s_K \le (K + 1) t_m`: :math:`(K - k^* - 1) r > |\log\epsilon| +
      \log\frac{q}{1 - q} - \log(K + 1)`;
    * :math:`a < 1`: the terms decrease, :math:`s_K \le t_0/(1 - q)`, and
      :math:`t_K/t_0 \ge ((K + 1)^{a - 1}/\Gamma(a))^{1/T} e^{-K r}` (Gautschi's
      inequality): :math:`(K + 1) r + \tfrac{1 - a}{T}\log(K + 1) +
      \tfrac{\log\Gamma(a)}{T} > |\log\epsilon|`.
    """
    a, log_p, log_q, t = params
    k_max = float(_SERIES_MAX_TERMS + _SERIES_CHUNK)
    log_eps = -math.log(float(jnp.finfo(a.dtype).eps))
    rate = -log_q / t  # r > 0
    k_star = (a - 1.0) * jnp.exp(log_q - log_p) - 1.0  # (1 - P) / P = e^(log_q - log_p)
    log_q_over = -rate - jnp.log(-jnp.expm1(-rate))  # log q / (1 - q)
    need_above = (jnp.maximum(k_star, 0.0) + 1.0
                  + (log_eps + log_q_over - math.log(k_max + 1.0)) / rate)
    reach_below = ((k_max + 1.0) * rate + (1.0 - a) / t * math.log(k_max + 1.0)
                   + gammaln(jnp.minimum(a, 1.0)) / t)
    return (k_star >= k_max) | jnp.where(a >= 1.0, need_above > k_max, reach_below < log_eps)


@jax.jit
def _nb_log_sum_checked(params: tuple[Array, ...]) -> Array:
    """The series where the parameters are valid (a > 0, 0 < P < 1) and it can converge
    within its cap (:func:`_nb_beyond_cap`), NaN elsewhere at once."""
    a, log_p, log_q, t = params
    ok = (a > 0) & jnp.isfinite(a) & (log_p < 0) & (log_q < 0)
    ok = ok & ~_nb_beyond_cap(params)
    stand_in = (jnp.where(ok, a, 1.0), jnp.where(ok, log_p, -math.log(2.0)),
                jnp.where(ok, log_q, -math.log(2.0)), t)
    return jnp.where(ok, _nb_log_sum(stand_in), jnp.nan)


@partial(jax.jit, static_argnums=2)
def _nb_sample_core(key: Array, params: tuple[Array, ...], shape: tuple[int, ...],
                    log_z: Array) -> Array:
    params = tuple(jnp.broadcast_to(p, shape[len(shape) - log_z.ndim:]) for p in params)
    u = random.uniform(key, shape, params[0].dtype)
    return _series_sample(_nb_term, _nb_tail, params, log_z.astype(u.dtype), u)


def _sample_tempered_nb(key: Array, td, sample_shape: tuple[int, ...]) -> Array:
    shape = sample_shape + tuple(td.batch_shape)
    params = _nb_params(td.base_dist, td.temperature)
    return _nb_sample_core(key, params, shape, jnp.asarray(td.log_normalizer))


@register_tempered(npd.GammaPoisson)
@register_tempered(npd.NegativeBinomialLogits)
def _gamma_poisson(d: npd.GammaPoisson, t: Array) -> TemperedResult:
    log_z = _bucketed(_nb_log_sum_checked, _nb_params(d, t))
    return TemperedResult(log_z, _wrap(d, t, log_z, _sample_tempered_nb))
