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
  \log\sum_{k \ge 0} p(k)^{1/T}` has no closed form. The first 128 terms are summed exactly
  (in log space; the log terms use :func:`~numpyro_tempering.special.log_beta`, accurate for
  large k and a, where the difference of two large log-gammas loses digits and JAX's
  ``betaln`` errs by 1e-6 in float64). The rest is either below float precision of that by
  the rigorous tail bound :math:`t_K\,q/(1 - q)`, :math:`q = ((1 - P)\max(1, \tfrac{a + K}{K
  + 1}))^{1/T}`, which bounds every later ratio of consecutive terms :math:`((1 - P)\tfrac{a
  + k}{k + 1})^{1/T}` (decreasing in k for :math:`a \ge 1`, increasing to :math:`(1 -
  P)^{1/T}` for :math:`a < 1`), or summed by the midpoint Euler-Maclaurin formula, whose
  integral is a double-exponential rule placed on the law's mode by Newton steps
  (``_nb_tail_sum``, self-checks that give NaN rather than a wrong value). The cost is
  fixed: 128 terms, 145 nodes and a few polygammas an element, whatever the mean (a series
  of terms until the bound is met, as the Poisson's, needs :math:`O(T\bar k/a)` of them:
  minutes a temperature in ``log_partition`` where the tilted target reached large means,
  and NaN beyond means of about a million). The derivatives of the terms are closed-form (a
  ``custom_jvp``). Against scipy's pmf summed term by term on random (a, mean, T) in [1e-3,
  1e6] x [1e-3, 1e4] x [0.2, 50]: within 1e-9 in float64 (5e-4 in float32, which the terms'
  own rounding sets at large a; numpyro's ``log_prob`` has it too); within 1e-10 of the
  closed forms at a = 1 (geometric) and a = 2 (a polylogarithm) at means up to 1e12
  (``tests/test_tempered_families.py``; times in ``benchmarks/negative_binomial.py``).
  Law: the normalised :math:`p^{1/T}/Z`, sampled by an inverse-CDF walk from 0 (its
  cost grows with the mean).

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
import numpy as np
import numpyro.distributions as npd
from jax import Array, lax, random
from jax.custom_derivatives import SymbolicZero
from jax.scipy.special import digamma, gammaln, logsumexp, polygamma

from numpyro_tempering.partition import (
    _SERIES_CHUNK,
    TemperedResult,
    _broadcast_params,
    _bucketed,
    _check_proper,
    _float,
    _law,
    _normal_core,
    _one_minus_inv,
    _series_sample,
    _wrap,
    register_tempered,
)
from numpyro_tempering.special import log_beta, tempered_log_gamma

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
    # a log c(df) + lgamma(m - 1/2) - lgamma(m), m = a (df + 1) / 2, c the Student-t's
    # constant: the log-gammas paired (x = df / 2 with m - 1/2 = a x + (a - 1) / 2, and
    # x = (df + 1) / 2 with m = a x) so that no terms of size df log df are left
    x = 0.5 * df
    log_z = (tempered_log_gamma(x, 0.5 * (a - 1.0), a) - tempered_log_gamma(x + 0.5, 0.0, a)
             - 0.5 * jnp.log(a)
             + _one_minus_inv(t) * (0.5 * (jnp.log(df) + _LOG_PI) + jnp.log(scale)))
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
    # a (alpha log beta - lgamma(alpha)) + lgamma(alpha') - alpha' log(a beta), with
    # alpha' = a alpha + (a - 1): special.tempered_log_gamma cancels the large terms
    log_z = tempered_log_gamma(alpha, a - 1.0, a) + _one_minus_inv(t) * jnp.log(beta)
    return jnp.where(ok, log_z, jnp.inf), safe, a * beta, ok


@register_tempered(npd.InverseGamma)
def _inverse_gamma(d: npd.InverseGamma, t: Array) -> TemperedResult:
    log_z, alpha_t, beta_t, ok = _inverse_gamma_core(d.concentration, d.rate, t)
    _check_proper(ok, d, "(concentration + 1) / temperature - 1 > 0")
    return TemperedResult(log_z, _law(d, npd.InverseGamma, alpha_t, beta_t))


# ---- GammaPoisson and the negative binomials: 128 exact terms, then a tail bound or tail sum ----


@jax.custom_jvp
def _nb_term(k: Array, params: tuple[Array, ...]) -> Array:
    """log p(k) / T, p(k) = Gamma(a + k) / (Gamma(a) k!) P^a (1 - P)^k, from
    (a, log P, log(1 - P), T); :func:`log_beta` keeps large k and a accurate. Its
    derivatives are closed-form (:func:`_nb_term_grad`, one digamma a term): reverse mode
    through log_beta's branches cost 150 ns a term in float32, six times its value."""
    a, log_p, log_q, t = params
    return (-log_beta(a, k + 1.0) - jnp.log(a + k) + a * log_p + k * log_q) / t


def _nb_term_grad(k: Array, params: tuple[Array, ...], term: Array) -> tuple[Array, ...]:
    a, _, _, t = params  # d/da log Gamma(a + k) - log Gamma(a) = psi(a + k) - psi(a)
    return ((digamma(a + k) - digamma(a) + params[1]) / t, a / t * jnp.ones_like(term),
            k / t * jnp.ones_like(term), -term / t)


@partial(_nb_term.defjvp, symbolic_zeros=True)
def _nb_term_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    (k, params), (dk, dparams) = primals, tangents
    term = _nb_term(k, params)
    dterm = jnp.zeros_like(term)
    for grad, dp in zip(_nb_term_grad(k, params, term), dparams, strict=True):
        if not isinstance(dp, SymbolicZero):
            dterm = dterm + grad * dp
    if not isinstance(dk, SymbolicZero):  # the count is a node of a rule: d/dk as well
        dterm = dterm + _nb_score(k, params[0], params[2], params[3])[0] * dk
    return term, dterm


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


def _nb_params(d: npd.GammaPoisson, t: Array) -> tuple[Array, ...]:
    """(a, log P, log(1 - P), T) broadcast together, P = b / (1 + b) from the rate b;
    ``NegativeBinomialLogits`` from its logits (b = e^-logits, P = sigmoid(-logits))."""
    if isinstance(d, npd.NegativeBinomialLogits):
        logits = _float(d.logits)
        log_p, log_q = -jax.nn.softplus(logits), -jax.nn.softplus(-logits)  # b = e^-logits
    else:
        rate = _float(d.rate)
        # log P = -log(1 + 1/b), not log b - log(1 + b): a large concentration (rate) makes
        # the difference lose digits that a P^a multiplies (7e-3 nats per element in float32
        # at a = 2e4, mean 300)
        log_q = -jnp.log1p(rate)
        log_p = -jnp.log1p(1.0 / rate)
    return _broadcast_params(_float(d.concentration), log_p, log_q, t)


def _nb_valid(params: tuple[Array, ...]) -> Array:
    a, log_p, log_q, t = params
    return (a > 0) & jnp.isfinite(a) & (log_p < 0) & (log_q < 0) & (t > 0) & jnp.isfinite(t)


def _nb_stand_in(use: Array, params: tuple[Array, ...]) -> tuple[Array, ...]:
    """``params`` where ``use``, else a = 1, 1 - P = e^-0.001 (a geometric law of mean 1000,
    harmless to every step below, so that no NaN reaches a gradient through ``where``)."""
    a, log_p, log_q, t = params
    return (jnp.where(use, a, 1.0), jnp.where(use, log_p, math.log(-math.expm1(-1e-3))),
            jnp.where(use, log_q, -1e-3), jnp.where(use, t, 1.0))


# ---- the tail past the head: Euler-Maclaurin and a double-exponential rule -------------------

#: terms summed exactly; the tail starts at c = _NB_HEAD - 1/2
_NB_HEAD = _SERIES_CHUNK
#: the tail's rule: a trapezoid in s on [-5, 4] in steps of 1/16 (145 nodes), on
#: x = c + y0 exp(w sinh s) (see :func:`_nb_tail_sum`)
_NB_STEP = 1.0 / 16.0
_NB_NODES = np.arange(-80, 65) * _NB_STEP
#: the rule's self-checks' tolerance in log space (the half rule; the integrand at its ends)
_NB_TOL = 1e-3
#: counts beyond which the polygamma differences use their asymptotic series
_NB_ASYMPTOTIC = 64.0


def _polygamma_differences(a: Array, x: Array) -> tuple[Array, Array]:
    r""":math:`\psi(a + x) - \psi(x + 1)` and :math:`\psi_1(a + x) - \psi_1(x + 1)`.

    For :math:`x \ge 64` from the asymptotic series of :math:`\psi` and :math:`\psi_1`
    (Abramowitz and Stegun 1964, 6.3.18 and 6.4.12; truncation error below
    :math:`z^{-8}/240`), the leading terms as :math:`\log(1 + (a - 1)/(x + 1))` and
    :math:`(1 - a)/((a + x)(x + 1))`: the plain differences cancel to nothing in float32 at
    the counts a law of mean :math:`10^{12}` reaches (:math:`\psi \approx 27.6`, its ulp
    2e-6, the difference 1e-12), and the Newton steps of :func:`_nb_tail_placement` went
    astray (NaN at such means)."""
    big = x >= _NB_ASYMPTOTIC
    xs = jnp.where(big, x, _NB_ASYMPTOTIC)
    u, v = 1.0 / (a + xs), 1.0 / (xs + 1.0)
    d0 = (jnp.log1p((a - 1.0) / (xs + 1.0)) - 0.5 * (u - v) - (u**2 - v**2) / 12.0
          + (u**4 - v**4) / 120.0 - (u**6 - v**6) / 252.0)
    d1 = ((1.0 - a) * u * v + 0.5 * (u**2 - v**2) + (u**3 - v**3) / 6.0
          - (u**5 - v**5) / 30.0 + (u**7 - v**7) / 42.0)
    xe = jnp.where(big, 0.0, x)
    e0 = digamma(a + xe) - digamma(xe + 1.0)
    e1 = polygamma(1, a + xe) - polygamma(1, xe + 1.0)
    return jnp.where(big, d0, e0), jnp.where(big, d1, e1)


def _nb_score(x: Array, a: Array, log_q: Array, t: Array) -> tuple[Array, Array]:
    """The first two derivatives in the count x of the log term :func:`_nb_term`."""
    d0, d1 = _polygamma_differences(a, x)
    return (d0 + log_q) / t, d1 / t


def _nb_tail_placement(params: tuple[Array, ...], c: float) -> tuple[Array, Array]:
    r"""``(y0, w)``: where and how wide :math:`h(u) = f(c + e^u) e^u` is, in :math:`u`.

    The log term :math:`\log f(x)` is close to :math:`\kappa'\log x - \rho x` (a Gamma
    density, :math:`\kappa' = (a - 1)/T`, :math:`\rho = -\log(1 - P)/T`), whose
    :math:`\log h` peaks at the positive root :math:`y` of :math:`\rho y^2 + (\rho c -
    \kappa' - 2) y - c = 0`; of that, the pmf's mode and the root of a quadratic
    :math:`\log f` from :math:`c`, the start with the largest :math:`\log h`; six Newton
    steps on the exact derivatives move it to the mode
    :math:`u_0 = \log y_0`, and :math:`w = (-\partial_u^2 \log h)^{-1/2}` (capped at 2,
    and widened to reach 40 to the left). Placement only: no gradient flows through it, and
    the rule integrates the same integral wherever it is put."""
    params = tuple(lax.stop_gradient(p) for p in params)
    a, log_p, log_q, t = params
    rho = -log_q / t
    kappa = (a - 1.0) / t + 1.0
    lin = rho * c - kappa - 1.0
    gamma_root = (-lin + jnp.sqrt(lin * lin + 4.0 * rho * c)) / (2.0 * rho)
    # two more starts, for where the Gamma shape is far off (a concentration of 5e5 put it
    # at 7e4 for a law whose mode is 191): the pmf's mode (a - 1)(1 - P)/P past c, and the
    # root of 1 + g'(c) y + g''(c) y^2 (log f quadratic from c); the best log h of the three
    pmf_mode = (a - 1.0) * jnp.exp(log_q - log_p) - c
    g1, g2 = _nb_score(jnp.asarray(c, a.dtype), a, log_q, t)
    disc = g1 * g1 - 4.0 * g2
    quad = jnp.where(jnp.abs(g2) > 0, (-g1 - jnp.sqrt(jnp.abs(disc))) / (2.0 * g2), -1.0 / g1)
    starts = jnp.stack([gamma_root,
                        jnp.where(pmf_mode > 0, pmf_mode, gamma_root),
                        jnp.where((disc >= 0) & (quad > 0), quad, gamma_root)])
    log_h = _nb_term(c + starts, params) + jnp.log(starts)
    log_h = jnp.where(jnp.isnan(log_h), -jnp.inf, log_h)
    u = jnp.log(jnp.take_along_axis(starts, jnp.argmax(log_h, axis=0)[None], axis=0)[0])

    def derivatives(u: Array) -> tuple[Array, Array]:
        y = jnp.exp(u)
        g1, g2 = _nb_score(c + y, a, log_q, t)
        return g1 * y + 1.0, g2 * y * y + g1 * y  # d/du and d2/du2 of log h

    for _ in range(6):
        d1, d2 = derivatives(u)
        u = u + jnp.clip(jnp.where(d2 < 0, -d1 / d2, jnp.sign(d1)), -2.0, 2.0)
    _, d2 = derivatives(u)
    width = jnp.minimum(lax.rsqrt(jnp.maximum(-d2, jnp.finfo(d2.dtype).tiny)), 2.0)
    # h decays only as e^u towards x = c where f(c) is not negligible: reach 40 to the left
    # (0.55 sinh 5); a narrower peak keeps at least 11 nodes per width (a trapezoid error
    # below e^-40), and one narrower than 0.05 lies e^-200 above f(c)
    return jnp.exp(u), jnp.maximum(width, jnp.minimum(0.55, 11.0 * width))


def _nb_log_sum_over(x: Array, log_w: Array, params: tuple[Array, ...],
                     large: bool = False) -> tuple[Array, Array]:
    r""":math:`\log\sum_i \exp(\log f(x_i) + \log w_i)` over the leading axis of ``x`` and
    ``log_w`` (:func:`_nb_term`; NaN terms count as 0, for the self-checks to see), and
    the summands (no gradient: for the self-checks). Each term is evaluated once, in one array
    that every consumer reads (XLA otherwise computed them once per consumer: twice the
    time); the derivative is closed-form, :math:`\sum_i \pi_i\,\partial\log f(x_i)`
    (:math:`\pi` the normalised weights): a third of the time of reverse mode. ``large``:
    every :math:`x_i \ge 64`, where :math:`\psi(a + x)` is its asymptotic series."""
    log_f = _nb_term(x, params) + log_w
    log_f = jnp.where(jnp.isnan(log_f), -jnp.inf, log_f)
    # log_f keeps its dependence on params (the rule below ignores its tangent, which
    # repeats theirs): the rule's weights pi must see it for second derivatives (the
    # Newton steps of log_partition's Laplace reference); a stop_gradient here made the
    # Hessian wrong by orders of magnitude
    return _nb_weighted_log_sum(large, x, log_w, params, log_f), lax.stop_gradient(log_f)


def _digamma_large(z: Array) -> Array:
    """psi(z) for z >= 64: its asymptotic series (Abramowitz and Stegun 1964, 6.3.18),
    truncation error below z^-8 / 240."""
    r2 = 1.0 / (z * z)
    return jnp.log(z) - 0.5 / z - r2 * (1.0 / 12.0 - r2 * (1.0 / 120.0 - r2 / 252.0))


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def _nb_weighted_log_sum(large: bool, x: Array, log_w: Array, params: tuple[Array, ...],
                         log_f: Array) -> Array:
    return logsumexp(log_f, axis=0)


@partial(_nb_weighted_log_sum.defjvp, symbolic_zeros=True)
def _nb_weighted_log_sum_jvp(large: bool, primals: tuple,
                             tangents: tuple) -> tuple[Array, Array]:
    (x, log_w, params, log_f), (dx, dlog_w, dparams, _) = primals, tangents
    a, log_p, log_q, t = params
    out = logsumexp(log_f, axis=0)
    pi = jnp.exp(log_f - out)
    some = pi > 0

    def mean(v: Array) -> Array:
        return jnp.sum(jnp.where(some, pi * v, 0.0), axis=0)

    da, dlog_p, dlog_q, dt = dparams
    dout = jnp.zeros_like(out)
    if not isinstance(da, SymbolicZero):  # d/da log Gamma(a + x) - log Gamma(a) + a log P
        psi = _digamma_large(a + x) if large else digamma(a + x)
        dout = dout + (mean(psi) - digamma(a) + log_p) / t * da
    if not isinstance(dlog_p, SymbolicZero):
        dout = dout + a / t * dlog_p
    if not isinstance(dlog_q, SymbolicZero):
        dout = dout + mean(x) / t * dlog_q
    if not isinstance(dt, SymbolicZero):
        dout = dout - mean(log_f - log_w) / t * dt  # the terms
    if not isinstance(dx, SymbolicZero):
        dout = dout + mean(_nb_score(x, a, log_q, t)[0] * dx)
    if not isinstance(dlog_w, SymbolicZero):
        dout = dout + mean(dlog_w)
    return out, dout


def _trigamma_slope_difference(a: Array, c: float) -> Array:
    r""":math:`\psi_2(a + c) - \psi_2(c + 1)` for :math:`c \ge 64`, from the asymptotic
    series :math:`\psi_2(z) = -z^{-2} - z^{-3} - z^{-4}/2 + z^{-6}/6 - z^{-8}/6`
    (Abramowitz and Stegun 1964, 6.4.13; error below :math:`3z^{-10}/10`)."""
    def psi2(z: Array) -> Array:
        r = 1.0 / z
        r2 = r * r
        return -r2 * (1.0 + r + r2 * (0.5 - r2 * (1.0 / 6.0 - r2 / 6.0)))

    return psi2(a + c) - psi2(jnp.full_like(a, c + 1.0))


def _nb_tail_sum(params: tuple[Array, ...]) -> Array:
    r""":math:`\log\sum_{k \ge H} f(k)`, :math:`\log f` = :func:`_nb_term`, in a fixed
    number of evaluations, by the midpoint Euler-Maclaurin formula

    .. math::
        \sum_{k \ge H} f(k) = \int_c^\infty f(x)\,dx + \frac{f'(c)}{24}
        - \frac{7 f'''(c)}{5760} + R, \qquad c = H - \tfrac12

    (its signs checked on :math:`f = e^{-\lambda x}`, whose sum is the integral times
    :math:`\lambda/(2\sinh(\lambda/2))`), :math:`f' = f g'` and :math:`f''' = f(g''' + 3 g'
    g'' + g'^3)` from the polygammas of :math:`g = \log f`. The remainder :math:`R` is of
    the order of :math:`31 f^{(5)}(c)/967\,680` and of the aliasing :math:`\sum_{m \ne 0}
    \hat f(m)`; both are far below float precision where the tail matters (the law is
    wide there, :math:`|g'| \ll 1`). The integral is a trapezoid rule in :math:`s` on
    :math:`x = c + y_0 e^{w\sinh s}` (:func:`_nb_tail_placement`), exponentially convergent
    for this analytic integrand. NaN where the rule fails its self-checks: the rule on
    every other node agrees to ``_NB_TOL``, and the integrand has fallen below ``_NB_TOL``
    of the integral at both ends of the nodes."""
    a, _, log_q, t = params
    dtype = a.dtype
    c = _NB_HEAD - 0.5
    g1, g2 = _nb_score(jnp.asarray(c, dtype), a, log_q, t)
    g3 = _trigamma_slope_difference(a, c) / t
    em = g1 / 24.0 - 7.0 * (g3 + 3.0 * g1 * g2 + g1**3) / 5760.0  # times f(c)
    y0, width = _nb_tail_placement(params, c)
    s = jnp.asarray(_NB_NODES, dtype)[:, None]
    v = width * jnp.sinh(s)
    x = c + y0 * jnp.exp(v)
    log_w = jnp.log(y0) + v + jnp.log(width) + jnp.log(jnp.cosh(s)) + math.log(_NB_STEP)
    finite = jnp.isfinite(x)  # nodes far out may overflow: weight 0
    x, log_w = jnp.where(finite, x, c), jnp.where(finite, log_w, -jnp.inf)
    log_int, log_f = _nb_log_sum_over(x, log_w, params, large=True)
    log_half = logsumexp(log_f[::2], axis=0) + math.log(2.0)
    log_ends = jnp.maximum(log_f[0], log_f[-1]) - log_int
    ok = (jnp.abs(log_half - log_int) < _NB_TOL) & (log_ends < math.log(_NB_TOL))
    log_fc = _nb_term(jnp.asarray(c, dtype), params)
    return jnp.where(ok, log_int + jnp.log1p(jnp.exp(log_fc - log_int) * em), jnp.nan)


def _nb_head(params: tuple[Array, ...]) -> tuple[Array, Array]:
    """``(log sum_{k < H} f(k), long)``: the first :math:`H` = 128 terms, and where the
    rigorous tail bound :func:`_nb_tail` after them is not below float precision of it
    (the rest needs :func:`_nb_tail_sum`)."""
    dtype = params[0].dtype
    k = jnp.arange(_NB_HEAD, dtype=dtype)[:, None]
    head, _ = _nb_log_sum_over(k, jnp.zeros_like(k), params)
    bound = _nb_tail(jnp.asarray(_NB_HEAD - 1.0, dtype), params)
    log_eps = math.log(float(jnp.finfo(dtype).eps))
    return head, lax.stop_gradient(bound >= head + log_eps)


@jax.jit
def _nb_log_sum(params: tuple[Array, ...]) -> Array:
    r""":math:`\log\sum_{k \ge 0} p(k)^{1/T}`: the first :math:`H` = 128 terms exactly, and
    the rest either bounded below float precision by the rigorous tail bound (short laws:
    the series' own guarantee) or summed by :func:`_nb_tail_sum` (:func:`_nb_head`). NaN
    for invalid parameters (a <= 0, P outside (0, 1), T <= 0, anything non-finite)."""
    valid = _nb_valid(params)
    params = _nb_stand_in(valid, params)
    head, long = _nb_head(params)
    tail = lax.cond(jnp.any(long), _nb_tail_sum, lambda p: jnp.zeros_like(p[0]),
                    _nb_stand_in(long, params))
    log_z = jnp.where(long, jnp.logaddexp(head, tail), head)
    return jnp.where(valid, log_z, jnp.nan)


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
    log_z = _bucketed(_nb_log_sum, _nb_params(d, t))
    return TemperedResult(log_z, _wrap(d, t, log_z, _sample_tempered_nb))
