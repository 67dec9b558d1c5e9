"""The closed-form tempered normalisers of numpyro_tempering.tempered_families against
numerical integration, their laws against p^(1/T) / Z, their samplers against their laws,
and divergent cases refused."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as npd
import pytest
from numpy.testing import assert_allclose
from scipy import integrate, stats

from numpyro_tempering.partition import tempered, tempered_log_normalizer

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
