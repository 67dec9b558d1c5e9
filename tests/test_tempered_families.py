"""The closed-form tempered normalisers of numpyro_tempering.tempered_families against
numerical integration, their laws against p^(1/T) / Z, their samplers against their laws,
and divergent cases refused."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as npd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose
from scipy import integrate, special, stats

from numpyro_tempering.partition import tempered, tempered_log_normalizer
from numpyro_tempering.special import log_beta

x64 = jax.enable_x64

TEMPS = [0.4, 1.0, 1.7, 3.0, 10.0]

#: name: (distribution, its scipy log density, support, finite for T <)
CASES = {
    "student_t": (lambda: npd.StudentT(4.5, 0.3, 1.7),
                  lambda x: stats.t.logpdf(x, 4.5, 0.3, 1.7), (-np.inf, np.inf), 5.5),
    "cauchy": (lambda: npd.Cauchy(-0.4, 0.6),
               lambda x: stats.cauchy.logpdf(x, -0.4, 0.6), (-np.inf, np.inf), 2.0),
    "laplace": (lambda: npd.Laplace(0.5, 0.8),
                lambda x: stats.laplace.logpdf(x, 0.5, 0.8), (-np.inf, np.inf), np.inf),
    "logistic": (lambda: npd.Logistic(1.0, 2.5),
                 lambda x: stats.logistic.logpdf(x, 1.0, 2.5), (-np.inf, np.inf), np.inf),
    "gumbel": (lambda: npd.Gumbel(-1.0, 0.7),
               lambda x: stats.gumbel_r.logpdf(x, -1.0, 0.7), (-np.inf, np.inf), np.inf),
    "half_normal": (lambda: npd.HalfNormal(1.9),
                    lambda x: stats.halfnorm.logpdf(x, 0, 1.9), (0.0, np.inf), np.inf),
    "half_cauchy": (lambda: npd.HalfCauchy(0.8),
                    lambda x: stats.halfcauchy.logpdf(x, 0, 0.8), (0.0, np.inf), 2.0),
    "log_normal": (lambda: npd.LogNormal(0.4, 0.6),
                   lambda x: stats.lognorm.logpdf(x, 0.6, 0, math.exp(0.4)), (0.0, np.inf),
                   np.inf),
    "inverse_gamma": (lambda: npd.InverseGamma(2.5, 1.5),
                      lambda x: stats.invgamma.logpdf(x, 2.5, 0, 1.5), (0.0, np.inf), 3.5),
}


def log_quad(log_f, lo, hi):
    """log int_lo^hi exp(log_f) by scipy's adaptive quadrature, split at a few points."""
    cuts = [lo, *([0.0] if lo < 0 else [0.5, 1.0, 4.0]), hi]
    with np.errstate(over="ignore"):  # scipy's Gumbel density far in its left tail
            val = sum(integrate.quad(lambda x: math.exp(log_f(x)), a, b, epsabs=0.0, epsrel=1e-11,
                                 limit=500)[0] for a, b in zip(cuts[:-1], cuts[1:], strict=True))
    return math.log(val)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("T", TEMPS)
def test_closed_form_equals_numerical_integration(name, T):
    make, log_pdf, (lo, hi), limit = CASES[name]
    if T >= limit:
        with x64(True), pytest.raises(ValueError, match="improper"):
            tempered_log_normalizer(make(), T)
        return
    with x64(True):
        got = float(tempered_log_normalizer(make(), T))
    ref = log_quad(lambda x: float(log_pdf(x)) / T, lo, hi)
    assert_allclose(got, ref, rtol=1e-8, atol=1e-8)
    if T == 1.0:
        assert got == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_law_is_p_to_the_one_over_t_normalised(name):
    make, _, (lo, hi), limit = CASES[name]
    T = min(2.5, 0.5 * (1.0 + limit))
    with x64(True):
        d = make()
        res = tempered(d, T)
        x = jnp.asarray(np.linspace(max(lo, -5.0) + 0.05, min(hi, 5.0), 11))
        assert_allclose(res.distribution.log_prob(x), d.log_prob(x) / T - res.log_normalizer,
                        rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", sorted(CASES))
def test_samples_of_the_law_follow_it(name):
    """A Kolmogorov-Smirnov test of 4,000 draws against the law's CDF by quadrature."""
    make, _, (lo, hi), limit = CASES[name]
    T = min(2.5, 0.5 * (1.0 + limit))
    with x64(True):
        law = tempered(make(), T).distribution
        draws = np.sort(np.asarray(law.sample(jax.random.PRNGKey(3), (4000,))))
        density = jax.jit(lambda v: jnp.exp(law.log_prob(v)))
        pdf = lambda v: float(density(v))  # noqa: E731
        probes = np.quantile(draws, [0.1, 0.3, 0.5, 0.7, 0.9])
        start = lo if np.isfinite(lo) else probes[0] - 200.0
        cdf = np.cumsum([integrate.quad(pdf, a, b, limit=400)[0] for a, b in
                         zip([start, *probes[:-1]], probes, strict=True)])
        if not np.isfinite(lo):  # the mass left of the first piece
            cdf = cdf + integrate.quad(pdf, -np.inf, start)[0]
    empirical = np.searchsorted(draws, probes, side="right") / draws.size
    assert np.max(np.abs(cdf - empirical)) < 0.03, (cdf, empirical)


def test_traced_divergent_temperature_gives_inf_and_gradients_in_the_scale_are_exact():
    f = jax.jit(lambda s, t: tempered_log_normalizer(npd.StudentT(4.0, 0.0, s), t))
    assert np.isinf(float(f(1.0, 6.0)))
    # the scale enters as (1 - 1/T) log s: finite gradients at any scale (the quadrature
    # fallback's were NaN beyond s ~ 1e8 in float32)
    g = jax.grad(lambda log_s: f(jnp.exp(log_s), 2.0))
    for log_s in (0.0, 22.5, 60.0):
        assert float(g(jnp.float32(log_s))) == pytest.approx(0.5, rel=1e-6)


SIGMA_SD, NUM = 0.3, 500


def student_t_model(x):
    """A Student-t likelihood of unknown scale (the case that once came out hundreds of
    nats low through the quadrature fallback, with a standard error of 0.3-0.7)."""
    import numpyro

    s = numpyro.sample("sigma", npd.LogNormal(0.0, SIGMA_SD))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", npd.StudentT(4.0, 0.0, s), obs=x)


def test_log_partition_of_a_student_t_likelihood_is_exact_and_infinite_where_it_diverges():
    from numpyro_tempering import log_partition
    from numpyro_tempering.ladder import Ladder

    temps = jnp.array([1.0, 2.0, 8.0])  # (df + 1) / T = 2.5 at T = 2; 0.625: divergent
    with pytest.warns(UserWarning, match=r"log C\(T\) = \+inf at T = \[8.0\].*'x'"):
        est = log_partition(jax.random.PRNGKey(0), student_t_model, temps, jnp.zeros(NUM),
                            plate="data", progress_bar=False)
    # c_n(sigma, T) = sigma^(1 - 1/T) z(T), so C(T) = z^N E[sigma^(N(1 - 1/T))] in closed form
    a = 0.5
    log_z1 = float(tempered_log_normalizer(npd.StudentT(4.0, 0.0, 1.0), 2.0))
    exact = NUM * log_z1 + 0.5 * (NUM * (1 - a) * SIGMA_SD) ** 2
    assert float(est.log_c[0]) == 0.0
    assert abs(float(est.log_c[1]) - exact) < 0.1
    assert abs(float(est.log_c[1]) - exact) < 3 * float(est.stderr[1]) + 0.02
    assert np.isinf(float(est.log_c[2])) and float(est.stderr[2]) == 0.0
    assert est.divergent.tolist() == [False, False, True] and not np.any(est.flagged)
    with pytest.raises(ValueError, match="improper there.*leave those temperatures out"):
        Ladder(temps).with_estimate(est)


def test_log_partition_is_infinite_where_the_normaliser_diverges_on_part_of_the_prior():
    """df = 1 + g, g ~ Gamma(5, 1), x_n ~ StudentT(df): at T = 3 the normaliser is
    infinite where df <= 2 (prior mass 0.004), so log C(3) = +inf exactly. The 16 probe
    draws that look for divergence miss so small a region; the SMC returned NaN, flagged,
    with a warning that blamed the stage cap (a probe, at N = 200). Now the missed-mass
    check's 1024 prior draws see it too: +inf, exact, and a warning that says why."""
    import numpyro

    from numpyro_tempering import log_partition

    def model(x):
        g = numpyro.sample("g", npd.Gamma(5.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", npd.StudentT(1.0 + g, 0.0, 1.0), obs=x)

    with pytest.warns(UserWarning, match=r"log C\(T\) = \+inf at T = \[3.0\]"):
        est = log_partition(jax.random.PRNGKey(0), model, jnp.array([3.0]), jnp.zeros(20),
                            plate="data", num_particles=32, num_replicates=2,
                            num_mcmc_steps=1, progress_bar=False)
    assert np.isinf(float(est.log_c[0])) and float(est.stderr[0]) == 0.0
    assert est.divergent.tolist() == [True] and not np.any(est.flagged)


# -- GammaPoisson and the negative binomials (a series, like the Poisson's) ----------------------

def nb_brute(a, mean, T):
    """log sum_k p(k)^(1/T) over enough k that the rest is below float64's resolution."""
    b = a / mean
    prob = b / (1.0 + b)  # scipy's nbinom(n = a, p = P)
    size = int(mean + 50.0 * max(T, 1.0) * (mean / a + math.sqrt(mean * (1.0 + mean / a))) + 500)
    return special.logsumexp(stats.nbinom.logpmf(np.arange(size), a, prob) / T)


#: (concentration, mean): the series walks ~ T mean / a terms past the mode, so the spread
#: ones are few (a = 0.3 at mean 150 walks 10^5 at T = 10)
NB_CASES = [(a, mean) for a in (0.3, 1.0, 2.5, 40.0) for mean in (0.5, 6.0, 150.0)] + [
    (2.5, 1000.0), (40.0, 3000.0)]


def test_log_beta_is_accurate_where_jax_betaln_is_not():
    """Against 40-digit mpmath: within 1e-13 of the result (float64) where
    ``jax.scipy.special.betaln`` errs by up to 1.3e-6 (its large-argument branch), and
    within 5e-6 in float32; the plain difference of log-gammas would lose digits at 1e7."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 40
    grid = np.geomspace(1e-3, 1e7, 24)
    a, b = (x.ravel() for x in np.meshgrid(grid, grid))
    ref = np.array([float(mp.log(mp.beta(mp.mpf(x), mp.mpf(y))))
                    for x, y in zip(a, b, strict=True)])
    scale = np.maximum(1.0, np.abs(ref))
    with x64(True):
        got = np.asarray(log_beta(jnp.asarray(a), jnp.asarray(b)))
        jax_err = abs(float(jax.scipy.special.betaln(2.5, 8.0)) - float(mp.log(mp.beta(2.5, 8))))
    assert np.max(np.abs(got - ref) / scale) < 1e-13
    assert jax_err > 1e-7  # why log_beta exists (if JAX fixes betaln, use it instead)
    got32 = np.asarray(log_beta(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)))
    assert np.max(np.abs(got32 - ref) / scale) < 5e-6


@pytest.mark.parametrize("T", [0.7, 1.0, 1.5, 3.0, 10.0])
def test_negative_binomial_series_equals_brute_force(T):
    """log sum_k NB(k)^(1/T) against scipy's pmf summed far into the tail: float64 to 1e-10,
    float32 to 1e-4 (relative; concentrations 0.3-40, means 0.5-3000)."""
    a, mean = (np.array(x) for x in zip(*NB_CASES, strict=True))
    ref = np.array([nb_brute(x, m, T) for x, m in NB_CASES])
    with x64(True):
        got = np.asarray(tempered_log_normalizer(npd.NegativeBinomial2(mean, a), T))
    assert_allclose(got, ref, rtol=1e-10, atol=1e-10)
    got32 = tempered_log_normalizer(npd.NegativeBinomial2(jnp.asarray(mean, jnp.float32),
                                                          jnp.asarray(a, jnp.float32)),
                                    jnp.float32(T))
    assert got32.dtype == jnp.float32
    assert_allclose(np.asarray(got32), ref, rtol=1e-4, atol=1e-4)


def test_the_four_negative_binomials_agree_and_are_normalised_at_one():
    """GammaPoisson(a, b), NegativeBinomial2(a / b, a), NegativeBinomialProbs(a, 1 / (1 + b))
    and NegativeBinomialLogits(a, -log b) are one pmf: one log Z; log Z(1) = 0."""
    a, b = jnp.array([0.4, 2.0, 30.0]), jnp.array([0.05, 1.0, 3.0])
    with x64(True):
        a, b = a.astype(jnp.float64), b.astype(jnp.float64)
        laws = [npd.GammaPoisson(a, b), npd.NegativeBinomial2(a / b, a),
                npd.NegativeBinomialProbs(a, 1.0 / (1.0 + b)),
                npd.NegativeBinomialLogits(a, -jnp.log(b))]
        for T in (1.0, 2.5):
            vals = [np.asarray(tempered_log_normalizer(d, T)) for d in laws]
            for v in vals[1:]:
                assert_allclose(v, vals[0], rtol=1e-12, atol=1e-12)
            if T == 1.0:
                assert np.max(np.abs(vals[0])) < 1e-12


def test_negative_binomial_gradients_equal_finite_differences():
    """d log Z / d(concentration, rate, T) through the custom jvp against central
    differences of the brute-force sum."""
    a, b, T, h = 2.5, 0.0625, 3.0, 1e-5

    def ref(a, b, T):
        return nb_brute(a, a / b, T)

    with x64(True):
        grads = jax.grad(lambda a, b, t: tempered_log_normalizer(npd.GammaPoisson(a, b), t),
                         argnums=(0, 1, 2))(a, b, T)
    fd = [(ref(a + h, b, T) - ref(a - h, b, T)) / (2 * h),
          (ref(a, b + h * b, T) - ref(a, b - h * b, T)) / (2 * h * b),
          (ref(a, b, T + h) - ref(a, b, T - h)) / (2 * h)]
    assert_allclose([float(g) for g in grads], fd, rtol=1e-6)


def test_negative_binomial_law_is_normalised_and_its_sampler_follows_it():
    """The tempered law's log_prob sums to 1 (to numpyro's own pmf accuracy) and 20,000
    draws have its mean within 4 standard errors."""
    a, mean, T = 2.5, 40.0, 3.0
    with x64(True):
        law = tempered(npd.NegativeBinomial2(mean, a), T).distribution
        k = np.arange(20000.0)
        log_p = np.asarray(law.log_prob(jnp.asarray(k)))
        draws = np.asarray(law.sample(jax.random.PRNGKey(0), (20000,)))
    assert abs(special.logsumexp(log_p)) < 1e-6
    p = np.exp(log_p - special.logsumexp(log_p))
    m = np.sum(p * k)
    se = math.sqrt(np.sum(p * (k - m) ** 2) / draws.size)
    assert abs(draws.mean() - m) < 4 * se


def test_negative_binomial_invalid_or_too_spread_is_nan_or_summed_by_the_tail():
    """Invalid parameters under tracing (nan, a <= 0, an infinite rate) give NaN beside a
    valid element. Laws a series of terms summed slowly or not at all (mean 1000 with
    a = 0.5 at T = 2 e-folds every 4,000 counts; mean 1e5 went beyond the series' cap of
    2^22 terms, NaN) are finite and right: against brute force and the geometric closed
    form (a = 1)."""
    f = jax.jit(lambda a, b: tempered_log_normalizer(npd.GammaPoisson(a, b), 2.0))
    got = np.asarray(f(jnp.array([1.0, jnp.nan, 2.0, -1.0]), jnp.array([1.0, 1.0, jnp.inf, 1.0])))
    assert np.isfinite(got[0]) and np.all(np.isnan(got[1:]))
    with x64(True):
        spread = np.asarray(tempered_log_normalizer(
            npd.NegativeBinomial2(jnp.array([1000.0, 1e5]), jnp.array([0.5, 1.0])), 2.0))
    assert_allclose(spread, [nb_brute(0.5, 1000.0, 2.0), _geometric_log_z(1e5, 2.0)],
                    rtol=1e-10)


def _nb_size(a, mean, T):
    """The terms nb_brute sums."""
    return mean + 50.0 * max(T, 1.0) * (mean / a + math.sqrt(mean * (1.0 + mean / a)))


#: long series (large means, high temperatures) that scipy can still sum term by term
NB_LONG = [(a, mean, T) for a in (0.05, 0.5, 2.5, 40.0, 2000.0) for mean in (3e3, 5e4)
           for T in (0.5, 1.5, 10.0) if _nb_size(a, mean, T) < 4e6]


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_negative_binomial_large_mean_expansion_equals_brute_force(dtype):
    """Where the terms after the first 128 matter (every case here), the tail sum
    (Euler-Maclaurin, a double-exponential rule) against scipy's pmf summed term by term:
    float64 to 1e-10, float32 to 5e-4 (relative; concentrations 0.05-2000, means 3e3-5e4,
    T = 0.5-10; the float32 terms' own rounding at a = 2000 is 1.5e-4)."""
    from numpyro_tempering import tempered_families as tf

    a, mean, T = (np.array(x) for x in zip(*NB_LONG, strict=True))
    ref = np.array([nb_brute(*case) for case in NB_LONG])
    with x64(dtype == jnp.float64):
        d = npd.NegativeBinomial2(jnp.asarray(mean, dtype), jnp.asarray(a, dtype))
        t = jnp.asarray(T, dtype)
        long = np.asarray(tf._nb_head(tf._nb_params(d, t))[1])
        got = np.asarray(tempered_log_normalizer(d, t))
    assert long.all() and len(NB_LONG) >= 15
    tol = 1e-10 if dtype == jnp.float64 else 5e-4
    assert_allclose(got, ref, rtol=tol, atol=tol)


def test_negative_binomial_on_random_parameters_equals_brute_force():
    """60 random (a, mean, T), log-uniform in [1e-3, 1e6] x [1e-3, 1e4] x [0.2, 50] (those
    scipy can sum term by term in 2e5 terms), against scipy: float64 to 1e-9, float32 to
    5e-4 (relative; the terms' own float32 rounding at large a, as in numpyro's log_prob)."""
    rng = np.random.default_rng(7)
    cases = []
    while len(cases) < 60:
        a, mean, T = np.exp(rng.uniform(np.log([1e-3, 1e-3, 0.2]), np.log([1e6, 1e4, 50.0])))
        if _nb_size(a, mean, T) < 2e5:
            cases.append((a, mean, T))
    a, mean, T = (np.array(x) for x in zip(*cases, strict=True))
    ref = np.array([nb_brute(*case) for case in cases])
    for dtype, tol in ((jnp.float64, 1e-9), (jnp.float32, 5e-4)):
        with x64(dtype == jnp.float64):
            got = tempered_log_normalizer(
                npd.NegativeBinomial2(jnp.asarray(mean, dtype), jnp.asarray(a, dtype)),
                jnp.asarray(T, dtype))
        assert_allclose(np.asarray(got), ref, rtol=tol, atol=tol, err_msg=str(dtype))


def _geometric_log_z(mean, T):
    """a = 1: p(k) = P (1 - P)^k sums in closed form, P^(1/T) / (1 - (1 - P)^(1/T))."""
    log_q = -np.log1p(1.0 / mean)  # log(1 - P), P = 1 / (1 + mean)
    return (log_q - np.log(mean)) / T - np.log(-np.expm1(log_q / T))


def _polylog_log_z(mean, T):
    """a = 2: p(k) = (k + 1) P^2 (1 - P)^k, so sum p^(1/T) = P^(2/T) Li_(-1/T)(z) / z with
    z = (1 - P)^(1/T) (mpmath's polylogarithm, 30 digits)."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 30
    p = 2 / (2 + mp.mpf(mean))
    z = (1 - p) ** (1 / mp.mpf(T))
    return float(mp.log(p ** (2 / mp.mpf(T)) * mp.polylog(-1 / mp.mpf(T), z) / z))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_negative_binomial_at_huge_means_equals_closed_forms(dtype):
    """Means of 1e3 to 1e12 (the series would need up to 1e13 terms: NaN beyond its cap
    before the expansion) against the geometric law's closed form (a = 1) and the
    polylogarithm (a = 2): float64 to 1e-10, float32 to 1e-4 (relative)."""
    means = np.array([1e3, 1e5, 1e7, 1e9, 1e12])
    temps = np.array([0.5, 2.0, 10.0])
    mean, T = (x.ravel() for x in np.meshgrid(means, temps, indexing="ij"))
    geo = _geometric_log_z(mean, T)
    poly = np.array([_polylog_log_z(m, t) for m, t in zip(mean, T, strict=True)])
    tol = 1e-10 if dtype == jnp.float64 else 1e-4
    with x64(dtype == jnp.float64):
        t = jnp.asarray(T, dtype)
        for a, ref in ((1.0, geo), (2.0, poly)):
            d = npd.NegativeBinomial2(jnp.asarray(mean, dtype), jnp.full(mean.shape, a, dtype))
            got = jax.jit(tempered_log_normalizer)(d, t)
            assert got.dtype == dtype
            assert_allclose(np.asarray(got), ref, rtol=tol, atol=tol, err_msg=f"a = {a}")


def test_negative_binomial_large_mean_gradients_equal_finite_differences():
    """d log Z / d(concentration, rate, T) through the expansion (plain autodiff) against
    central differences of the brute-force sum, where a series would take 2e5 terms."""
    from numpyro_tempering import tempered_families as tf

    a, b, T, h = 2.5, 5e-4, 3.0, 1e-5
    with x64(True):
        params = tf._nb_params(npd.GammaPoisson(jnp.float64(a), jnp.float64(b)),
                               jnp.float64(T))
        assert bool(tf._nb_head(params)[1])
        grads = jax.grad(lambda a, b, t: tempered_log_normalizer(npd.GammaPoisson(a, b), t),
                         argnums=(0, 1, 2))(a, b, T)

    def ref(a, b, T):
        return nb_brute(a, a / b, T)

    fd = [(ref(a + h, b, T) - ref(a - h, b, T)) / (2 * h),
          (ref(a, b + h * b, T) - ref(a, b - h * b, T)) / (2 * h * b),
          (ref(a, b, T + h) - ref(a, b, T - h)) / (2 * h)]
    assert_allclose([float(g) for g in grads], fd, rtol=1e-6)


@pytest.mark.parametrize("point", [(2.5, 5e-4, 3.0), (2.0, 0.5, 1.7), (0.7, 1e-3, 1.3)])
def test_negative_binomial_hessians_equal_finite_differences_of_gradients(point):
    """Second derivatives in (concentration, rate, T) -- log_partition's Newton steps to
    its Laplace reference use them -- against central differences of the gradient
    (float64). A stop_gradient on the summands inside the closed-form derivative of the
    log-sums made them wrong by orders of magnitude while every gradient stayed right
    (log_partition on an NB regression: flagged, a replicate spread of 1.7 nats)."""

    def log_z(v):
        return tempered_log_normalizer(npd.GammaPoisson(v[0], v[1]), v[2])

    with x64(True):
        v = jnp.asarray(point)
        hess = np.asarray(jax.hessian(log_z)(v))
        grad = jax.grad(log_z)
        h = 1e-6 * np.abs(np.asarray(v))
        fd = np.stack([(np.asarray(grad(v.at[i].add(h[i])))
                        - np.asarray(grad(v.at[i].add(-h[i])))) / (2 * h[i]) for i in range(3)])
    assert_allclose(hess, fd, rtol=1e-3, atol=1e-6 * np.abs(fd).max())


def test_polygamma_differences_keep_their_digits_at_huge_counts():
    """psi(a + x) - psi(x + 1) and psi_1(a + x) - psi_1(x + 1) against 40-digit mpmath,
    to 1e-13 (float64) and 1e-4 (float32) relative, up to x = 1e12, where the plain
    differences are all rounding in float32."""
    from numpyro_tempering.tempered_families import _polygamma_differences

    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 40
    xs = np.array([64.0, 500.0, 1e5, 1e9, 1e12])
    for a in (0.5, 2.5, 100.0, 1e4):
        ref = np.array([[float(mp.digamma(a + x) - mp.digamma(x + 1)),
                         float(mp.polygamma(1, a + x) - mp.polygamma(1, x + 1))] for x in xs]).T
        for dtype, tol in ((jnp.float64, 1e-13), (jnp.float32, 1e-4)):
            with x64(dtype == jnp.float64):
                got = _polygamma_differences(jnp.asarray(a, dtype), jnp.asarray(xs, dtype))
            assert_allclose(np.asarray(got), ref, rtol=tol, err_msg=f"a = {a}, {dtype}")
        plain = float(jax.scipy.special.digamma(jnp.float32(a + 1e12))
                      - jax.scipy.special.digamma(jnp.float32(1e12 + 1)))
        assert abs(plain - ref[0, -1]) > 0.5 * abs(ref[0, -1])  # why the series is there


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 50.0), st.floats(0.1, 500.0), st.floats(0.15, 1.0), st.floats(0.15, 1.0))
def test_negative_binomial_log_z_is_convex_in_the_inverse_temperature(a, mean, h1, h2):
    """log sum_k e^(h log p(k)) is convex in h = 1/T and 0 at h = 1 (float64)."""
    lo, hi = sorted((h1, h2))
    mid = 0.5 * (lo + hi)
    with x64(True):
        d = npd.NegativeBinomial2(jnp.float64(mean), jnp.float64(a))
        vals = np.asarray(tempered_log_normalizer(d, 1.0 / jnp.array([lo, mid, hi, 1.0])))
    assert vals[1] <= 0.5 * (vals[0] + vals[2]) + 1e-9 * (1.0 + np.abs(vals).max())
    assert abs(vals[3]) < 1e-12


def _large_shape_references():
    """(name, distribution, float64 log Z(T) by scipy) at shapes 100 to 30,000."""
    def gamma(a, b, t):
        at = 1 + (a - 1) / t
        return (a * np.log(b) - special.gammaln(a)) / t + special.gammaln(at) - at * np.log(b / t)

    def dirichlet(alpha, t):
        def log_b(x):
            return special.gammaln(x).sum() - special.gammaln(x.sum())
        return log_b(1 + (alpha - 1) / t) - log_b(alpha) / t

    def inverse_gamma(a, b, t):
        h = 1 / t
        s = h * (a + 1) - 1
        return h * (a * np.log(b) - special.gammaln(a)) + special.gammaln(s) - s * np.log(h * b)

    def student(df, scale, t):
        h = 1 / t
        m = h * (df + 1) / 2
        log_c = special.gammaln((df + 1) / 2) - special.gammaln(df / 2) - 0.5 * np.log(df * np.pi)
        return (h * log_c + (1 - h) * np.log(scale) + 0.5 * np.log(df * np.pi)
                + special.gammaln(m - 0.5) - special.gammaln(m))

    for x in (100.0, 1_000.0, 30_000.0):
        alpha = np.array([x, 3 * x, 0.5 * x + 1])
        yield "gamma", npd.Gamma(x, 2.5), lambda t, x=x: gamma(x, 2.5, t)
        yield "beta", npd.Beta(x, 2 * x), lambda t, x=x: dirichlet(np.array([x, 2 * x]), t)
        yield "dirichlet", npd.Dirichlet(jnp.asarray(alpha)), lambda t, a=alpha: dirichlet(a, t)
        yield "inverse_gamma", npd.InverseGamma(x, 3.0), lambda t, x=x: inverse_gamma(x, 3.0, t)
        yield "student_t", npd.StudentT(x, 0.0, 2.0), lambda t, x=x: student(x, 2.0, t)


def test_large_shapes_keep_their_normaliser_in_float32():
    """log Gamma(a') - log Gamma(a) / T cancels terms of size a log a down to a few nats: in
    float32 the plain difference lost ~1e-4 nats per element at a = 1000 (1.3e-2 relative
    for a Dirichlet at 30,000), which N elements sharing the shape turned into a log C 0.25-2.4
    nats off, unflagged (a probe: x_n ~ Gamma(alpha, 1), alpha ~ 1000, N = 2000-20,000).
    special.tempered_log_gamma cancels them analytically: float32 within 2e-6 of the float64
    value relative to its size, and exactly 0 at T = 1."""
    for name, d, reference in _large_shape_references():
        for t in (1.5, 3.0, 10.0):
            want = reference(t)
            got = float(tempered_log_normalizer(d, jnp.float32(t)))
            assert abs(got - want) <= 2e-6 * max(1.0, abs(want)), (name, d.batch_shape, t)
        assert float(tempered_log_normalizer(d, jnp.float32(1.0))) == 0.0, name
