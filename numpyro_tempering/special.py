"""Special functions accurate in float32 and float64 where JAX's are not.

Example:
    >>> import jax.numpy as jnp
    >>> from numpyro_tempering.special import log_beta
    >>> round(float(log_beta(jnp.float32(2.0), jnp.float32(3.0))), 6)  # log(1/12)
    -2.484907
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import Array
from jax.scipy.special import gammaln

__all__ = ["binomial_log_pmf", "log_beta", "log_gamma_excess", "poisson_log_pmf",
           "tempered_log_gamma"]

#: Stirling's series of log Gamma(x) - [(x - 1/2) log x - x + log(2 pi) / 2]: c_j / x^(2j - 1),
#: error below 2e-14 for x >= 8 with these seven terms
_STIRLING = (1.0 / 12.0, -1.0 / 360.0, 1.0 / 1260.0, -1.0 / 1680.0, 1.0 / 1188.0,
             -691.0 / 360360.0, 1.0 / 156.0)
_LOG_BETA_LARGE = 8.0


def _stirling_correction(x: Array) -> Array:
    """log Gamma(x) - (x - 1/2) log x + x - log(2 pi) / 2 for x >= 8 (else a stand-in)."""
    r = 1.0 / jnp.maximum(x, _LOG_BETA_LARGE)
    r2 = r * r
    acc = jnp.zeros_like(r)
    for c in reversed(_STIRLING):
        acc = acc * r2 + c
    return acc * r


def log_beta(a: Array, b: Array) -> Array:
    r""":math:`\log B(a, b)` for a, b > 0, accurate to a few ulps of the result in float32
    and float64 whatever the size of the arguments (``jax.scipy.special.betaln`` errs by
    up to 1e-6 in float64 once the larger argument reaches 8, e.g. 1.3e-6 at (2.5, 8); the
    plain difference of log-gammas loses digits when they are large). With p <= q: both
    below 8, the log-gammas directly; q >= 8, the difference :math:`\log\Gamma(q) -
    \log\Gamma(p + q)` by Stirling's series, :math:`-(q - \tfrac12)\log(1 + p/q) -
    p\log(p + q) + p + \delta(q) - \delta(p + q)`; both >= 8, :math:`\tfrac12\log 2\pi
    - \tfrac12\log(p + q) + (p - \tfrac12)\log\tfrac{p}{p + q} + (q - \tfrac12)
    \log(1 - \tfrac{p}{p + q}) + \delta(p) + \delta(q) - \delta(p + q)` (:math:`\delta`
    Stirling's correction, seven terms).

    Example:
        >>> import jax
        >>> from scipy.special import betaln
        >>> with jax.enable_x64(True):
        ...     got = float(log_beta(jnp.float64(2.5), jnp.float64(8.0)))
        >>> bool(abs(got - betaln(2.5, 8.0)) < 1e-14)
        True
    """
    p, q = jnp.minimum(a, b), jnp.maximum(a, b)
    s = p + q
    big_q = q >= _LOG_BETA_LARGE
    big_p = p >= _LOG_BETA_LARGE
    small = gammaln(p) + gammaln(q) - gammaln(s)
    safe_q = jnp.where(big_q, q, _LOG_BETA_LARGE)
    safe_s = safe_q + p
    one_large = (gammaln(p) - (safe_q - 0.5) * jnp.log1p(p / safe_q) - p * jnp.log(safe_s) + p
                 + _stirling_correction(safe_q) - _stirling_correction(safe_s))
    safe_p = jnp.where(big_p, p, _LOG_BETA_LARGE)
    both_s = safe_p + safe_q
    ratio = safe_p / both_s
    both_large = (0.5 * (math.log(2.0 * math.pi) - jnp.log(both_s))
                  + (safe_p - 0.5) * jnp.log(ratio) + (safe_q - 0.5) * jnp.log1p(-ratio)
                  + _stirling_correction(safe_p) + _stirling_correction(safe_q)
                  - _stirling_correction(both_s))
    return jnp.where(big_p, both_large, jnp.where(big_q, one_large, small))


def _log_gamma_remainder(z: Array) -> Array:
    """log Gamma(z) - [(z - 1/2) log z - z + log(2 pi) / 2] for z > 0: Stirling's series
    from 8 on, the difference itself below (both terms under 9 in size there, so no
    cancellation to speak of)."""
    big = z >= _LOG_BETA_LARGE
    zs = jnp.where(big | (z <= 0), 1.0, z)
    direct = gammaln(zs) - ((zs - 0.5) * jnp.log(zs) - zs + 0.5 * math.log(2.0 * math.pi))
    return jnp.where(big, _stirling_correction(z), direct)


def tempered_log_gamma(x: Array, d: Array, a: Array) -> Array:
    r""":math:`\log\Gamma(y) - a\log\Gamma(x) - y\log a` with :math:`y = a x + d > 0`, the
    log-gamma part of a tempered normaliser, accurate to a few ulps of its own size (a few
    nats) in float32 and float64 whatever the size of ``x``.

    Raising a Gamma, Beta, Dirichlet, inverse gamma or Student-t density to the power
    :math:`a = 1/T` gives a law of the same family whose shape is :math:`y = a x + d`
    (:math:`d = 1 - a` for a Gamma's shape, :math:`a - 1` for an inverse gamma's, ...),
    and its normaliser holds :math:`\log\Gamma(y) - a\log\Gamma(x)`: two terms of size
    :math:`x\log x` whose difference is of size :math:`\log x`. In float32 the plain
    difference loses about :math:`2^{-24}\,x\log x` nats (1e-4 at x = 1000), which a model
    with N observations sharing that shape multiplies by N -- jitter in the globals of
    several nats at N = 10,000 (found by a probe of log C). With Stirling's series
    :math:`\log\Gamma(z) = (z - \tfrac12)\log z - z + \tfrac12\log 2\pi + \delta(z)` the
    large terms cancel analytically: for :math:`x \ge 8`,

    .. math::

        (d + \tfrac{a - 1}{2})\log x - \tfrac12\log a + (y - \tfrac12)\log\big(1 +
        \tfrac{d}{a x}\big) - d + \tfrac{1 - a}{2}\log 2\pi + \delta(y) - a\,\delta(x),

    every term of the size of the result (the :math:`-y\log a` of the definition cancels
    the :math:`y\log a` of :math:`\log\Gamma(y)`, so that a sum of these over the factors
    of a Beta or Dirichlet function has no large terms left either). Below 8 the
    log-gammas directly. ``d`` is given, not ``y``: :math:`y - a x` would cancel again.

    Example:
        >>> from scipy.special import gammaln as gl
        >>> x, a = 3_000.0, 1.0 / 3.0
        >>> y = a * x + (1 - a)  # a Gamma(3000) density raised to 1/3
        >>> exact = gl(y) - a * gl(x) - y * math.log(a)  # float64
        >>> got = tempered_log_gamma(jnp.float32(x), jnp.float32(1 - a), jnp.float32(a))
        >>> bool(abs(float(got) - exact) < 1e-5), bool(abs(exact) < 10)
        (True, True)
    """
    big = x >= _LOG_BETA_LARGE
    xs = jnp.where(big, x, _LOG_BETA_LARGE)
    y = a * xs + d
    ok = y > 0
    ys = jnp.where(ok, y, 1.0)
    large = (jnp.log(xs) * (d + 0.5 * (a - 1.0)) - 0.5 * jnp.log(a)
             + (ys - 0.5) * jnp.log1p(jnp.where(ok, d / (a * xs), 0.0)) - d
             + 0.5 * math.log(2.0 * math.pi) * (1.0 - a)
             + _log_gamma_remainder(ys) - a * _stirling_correction(xs))
    xm = jnp.where(big | (x <= 0), 1.0, x)
    ym = a * xm + d
    ym = jnp.where(ym > 0, ym, 1.0)
    small = gammaln(ym) - a * gammaln(xm) - ym * jnp.log(a)
    return jnp.where(big, large, small)


def log_gamma_excess(x: Array, d: Array) -> Array:
    r""":math:`R(x, d) = \log\Gamma(x + d) - \log\Gamma(x) - d\log x` for :math:`x > 0,
    d \ge 0` (NaN for :math:`x \le 0`), from Stirling's form with its remainder
    :math:`\rho`: :math:`(x + d - \tfrac12)\log(1 + d/x) - d + \rho(x + d) - \rho(x)`, no
    terms of size :math:`d\log x` to cancel (the Beta moments of
    :mod:`numpyro_tempering.conjugate`).

    Example:
        >>> import mpmath
        >>> x, d = 1e6, 7.5
        >>> exact = float(mpmath.loggamma(mpmath.mpf(x) + d) - mpmath.loggamma(x)
        ...               - d * mpmath.log(x))  # 2.4e-5
        >>> got = float(log_gamma_excess(jnp.float32(x), jnp.float32(d)))
        >>> x32, d32 = jnp.float32(x), jnp.float32(d)
        >>> plain = float(gammaln(x32 + d32) - gammaln(x32) - d32 * jnp.log(x32))
        >>> bool(abs(got - exact) < 1e-7), bool(abs(plain - exact) > 0.5)  # float32
        (True, True)
    """
    ok = x > 0
    xs = jnp.where(ok, x, 1.0)
    out = ((xs + d - 0.5) * jnp.log1p(d / xs) - d
           + _log_gamma_remainder(xs + d) - _log_gamma_remainder(xs))
    return jnp.where(ok, out, jnp.nan)


def _stirlerr(n: Array) -> Array:
    """log(n!) - log(sqrt(2 pi n) (n / e)^n) (Loader 2000), for n >= 1: Stirling's series
    from 8 on, the log-gammas below (small there, so without cancellation)."""
    small = gammaln(n + 1.0) - (n + 0.5) * jnp.log(n) + n - 0.5 * math.log(2.0 * math.pi)
    return jnp.where(n >= _LOG_BETA_LARGE, _stirling_correction(n), small)


#: terms of the series of bd0 where |x - m| < 0.1 (x + m): |v| < 0.1, so the term after
#: these is below 1e-20 of the first
_BD0_TERMS = 10


def _bd0(x: Array, m: Array) -> Array:
    """x log(x / m) + m - x, the deviance term, accurate where x ~ m (Loader 2000: the series
    in v = (x - m) / (x + m) there, direct elsewhere); +inf where m = 0 < x."""
    d = x - m
    close = jnp.abs(d) < 0.1 * (x + m)
    safe_s = jnp.where(close, x + m, 1.0)
    v = jnp.where(close, d / safe_s, 0.0)
    acc, term = d * v, 2.0 * x * v
    for j in range(1, _BD0_TERMS + 1):
        term = term * v * v
        acc = acc + term / (2 * j + 1)
    safe_m = jnp.where(m > 0, m, 1.0)
    direct = jnp.where(m > 0, x * (jnp.log(x) - jnp.log(safe_m)) + m - x, jnp.inf)
    return jnp.where(close, acc, direct)


def binomial_log_pmf(k: Array, n: Array, log_p: Array, log_q: Array) -> Array:
    r"""log Binomial(k | n, p) from log p and log q = log(1 - p), accurate to a few ulps of
    the result in float32 too (Loader 2000, "Fast and accurate computation of binomial
    probabilities": :math:`\log p(k) = \delta(n) - \delta(k) - \delta(n - k) - b(k, np) -
    b(n - k, nq) + \tfrac12\log\frac{n}{2\pi k(n - k)}`, with Stirling's remainder
    :math:`\delta` and the deviance term :math:`b(x, m) = x\log\frac xm + m - x` summed as a
    series where :math:`x \approx m`). The textbook sum of :math:`\log\binom nk` and
    :math:`k\log p + (n - k)\log q` cancels terms of size :math:`n` down to one of size
    :math:`\log n`: 0.002 nats lost at n = 1e5 in float32. k outside 0..n gives -inf.

    Example:
        >>> from scipy import stats
        >>> got = binomial_log_pmf(jnp.float32(40_000.0), jnp.float32(1e5),
        ...                        jnp.log(jnp.float32(0.4)), jnp.log1p(-jnp.float32(0.4)))
        >>> bool(abs(float(got) - stats.binom.logpmf(40_000, 100_000, 0.4)) < 1e-5)
        True
    """
    inside = (k > 0) & (k < n)
    kk = jnp.where(inside, k, 1.0)
    nn = jnp.where(inside, n, 2.0)
    mid = (_stirlerr(nn) - _stirlerr(kk) - _stirlerr(nn - kk)
           - _bd0(kk, nn * jnp.exp(log_p)) - _bd0(nn - kk, nn * jnp.exp(log_q))
           + 0.5 * (jnp.log(nn) - jnp.log(kk) - jnp.log(nn - kk) - math.log(2.0 * math.pi)))
    at_zero = jnp.where(n == 0, 0.0, n * log_q)  # k = 0: q^n (0 * -inf is 0 here)
    at_n = jnp.where(n == 0, 0.0, n * log_p)
    out = jnp.where(inside, mid, jnp.where(k == 0, at_zero, at_n))
    return jnp.where((k < 0) | (k > n), -jnp.inf, out)


def poisson_log_pmf(k: Array, rate: Array) -> Array:
    r"""log Poisson(k | rate), accurate to a few ulps of the result in float32 too (Loader
    2000: :math:`-\delta(k) - b(k, \lambda) - \tfrac12\log 2\pi k`, with Stirling's
    remainder :math:`\delta` and the deviance term :math:`b`; the textbook :math:`k\log
    \lambda - \lambda - \log k!` cancels terms of size :math:`k\log k` down to one of size
    :math:`\log k`). ``k = 0`` gives :math:`-\lambda`; ``rate = 0`` gives -inf for k > 0.

    Example:
        >>> from scipy import stats
        >>> got = poisson_log_pmf(jnp.float32(1_000.0), jnp.float32(990.0))
        >>> bool(abs(float(got) - stats.poisson.logpmf(1_000, 990.0)) < 1e-6)
        True
    """
    positive = k > 0
    kk = jnp.where(positive, k, 1.0)
    mid = -_stirlerr(kk) - _bd0(kk, rate) - 0.5 * (math.log(2.0 * math.pi) + jnp.log(kk))
    return jnp.where(positive, mid, -rate)
