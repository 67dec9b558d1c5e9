"""Tests for numpyro_tempering.partition (tempered log-normalisers and tempered laws).

References are computed independently of the implementation: scipy quadrature / brute-force
sums over scipy.stats log-densities, the Beta-function identity with scipy.special, and a
brute-force 2-D grid for a correlated Gaussian.
"""

from __future__ import annotations

import doctest
import itertools
import math
import warnings
from functools import partial

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as npd
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose
from numpyro.distributions.distribution import validation_enabled
from scipy import integrate, special, stats

from numpyro_tempering import partition
from numpyro_tempering.partition import (
    TemperedDistribution,
    TemperedResult,
    register_tempered,
    registered_types,
    tempered,
    tempered_distribution,
    tempered_log_normalizer,
    tempered_multinomial_exact,
)

x64 = partial(jax.enable_x64, True)


@pytest.fixture(autouse=True, scope="module")
def _float64_by_default():
    """Exact comparisons run in float64 (``test_float32_and_float64`` switches back).

    NumPyro's argument validation is switched off here to save eager compilations;
    ``test_with_numpyro_validation`` runs the public API with it on.
    """
    with x64(), validation_enabled(False):
        yield


TEMPS = [0.3, 0.7, 1.0, 2.5, 10.0]
HYP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# property tests parametrised by family (every family is exercised): fewer examples each
HYP_PER_FAMILY = settings(HYP, max_examples=10)


def log_quad(log_f, lo, hi, points=None):
    """log of int_lo^hi exp(log_f(x)) dx with scipy.integrate.quad (rescaled by the max)."""
    grid = np.linspace(max(lo, -50.0), min(hi, 50.0), 2001)[1:-1]
    shift = np.max(log_f(grid))
    # split at a few points so quad sees endpoint singularities on finite pieces
    cuts = sorted({lo, hi, *(points or [])} | ({0.5, 1.0, 4.0} if lo == 0 else set()))
    cuts = [c for c in cuts if lo <= c <= hi]
    val = 0.0
    for a, b in itertools.pairwise(cuts):
        piece, _ = integrate.quad(
            lambda x: np.exp(log_f(x) - shift), a, b, epsabs=0.0, epsrel=1e-11, limit=400
        )
        val += piece
    return math.log(val) + shift


def brute_log_sum(log_p, T):
    return special.logsumexp(np.asarray(log_p, dtype=np.float64) / T)


def compositions(n, k):
    """All count vectors of length k summing to n."""
    for bars in itertools.combinations(range(n + k - 1), k - 1):
        edges = (-1, *bars, n + k - 1)
        yield np.array([edges[i + 1] - edges[i] - 1 for i in range(k)])


# ------------------------------------------------------------------------------------------
# Continuous closed forms vs numerical integration
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", TEMPS)
def test_normal_vs_quad(T):
    with x64():
        loc, scale = 0.7, 1.3
        got = float(tempered_log_normalizer(npd.Normal(loc, scale), T))
    ref = log_quad(lambda x: stats.norm.logpdf(x, loc, scale) / T, -np.inf, np.inf)
    assert_allclose(got, ref, rtol=1e-8, atol=1e-9)
    # the paper's eq. 12 value (untempered normaliser) differs by (1 - 1/T)/2 log(2 pi s^2)
    paper = 0.5 * math.log(T)
    assert_allclose(got - paper, 0.5 * (1 - 1 / T) * math.log(2 * math.pi * scale**2))


@pytest.mark.parametrize("T", TEMPS)
@pytest.mark.parametrize("a", [0.8, 2.5])
def test_gamma_vs_quad(T, a):
    b = 1.7
    if 1 + (a - 1) / T <= 0:
        pytest.skip("improper (tested separately)")
    with x64():
        got = float(tempered_log_normalizer(npd.Gamma(a, b), T))
    ref = log_quad(lambda x: stats.gamma.logpdf(x, a, scale=1 / b) / T, 0, np.inf)
    assert_allclose(got, ref, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("T", TEMPS)
def test_exponential_and_chi2_vs_quad(T):
    with x64():
        got = float(tempered_log_normalizer(npd.Exponential(2.2), T))
        chi2 = float(tempered_log_normalizer(npd.Chi2(3.0), T))  # subclass of Gamma
    ref = log_quad(lambda x: stats.expon.logpdf(x, scale=1 / 2.2) / T, 0, np.inf)
    assert_allclose(got, ref, rtol=1e-8, atol=1e-9)
    ref = log_quad(lambda x: stats.chi2.logpdf(x, 3.0) / T, 0, np.inf)
    assert_allclose(chi2, ref, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("T", TEMPS)
def test_uniform(T):
    with x64():
        got = np.asarray(tempered_log_normalizer(npd.Uniform(-1.0, jnp.array([0.5, 3.0])), T))
    widths = np.array([1.5, 4.0])
    assert_allclose(got, np.log(widths * widths ** (-1 / T)), rtol=1e-12)


@pytest.mark.parametrize("T", TEMPS)
@pytest.mark.parametrize("ab", [(0.9, 2.0), (3.0, 1.5), (5.0, 5.0)])
def test_beta_vs_quad_and_beta_function(T, ab):
    a, b = ab
    at, bt = 1 + (a - 1) / T, 1 + (b - 1) / T
    if min(at, bt) <= 0:
        pytest.skip("improper")
    with x64():
        got = float(tempered_log_normalizer(npd.Beta(a, b), T))
    ref = log_quad(lambda x: stats.beta.logpdf(x, a, b) / T, 0, 1, points=[0.5])
    assert_allclose(got, ref, rtol=1e-7, atol=1e-8)
    identity = special.betaln(at, bt) - special.betaln(a, b) / T
    assert_allclose(got, identity, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", TEMPS)
def test_dirichlet_beta_identity(T):
    alpha = np.array([1.5, 2.0, 3.5])
    with x64():
        got = float(tempered_log_normalizer(npd.Dirichlet(jnp.asarray(alpha)), T))
        two = float(tempered_log_normalizer(npd.Dirichlet(jnp.array([1.5, 2.0])), T))
        beta = float(tempered_log_normalizer(npd.Beta(1.5, 2.0), T))

    def log_mv_beta(x):
        return special.gammaln(x).sum() - special.gammaln(x.sum())

    at = 1 + (alpha - 1) / T
    assert_allclose(got, log_mv_beta(at) - log_mv_beta(alpha) / T, rtol=1e-12, atol=1e-12)
    assert_allclose(two, beta, rtol=1e-12, atol=1e-12)  # K = 2 Dirichlet is a Beta


def test_dirichlet_vs_simplex_quadrature():
    alpha, T = np.array([1.5, 2.0, 3.5]), 2.0
    with x64():
        got = float(tempered_log_normalizer(npd.Dirichlet(jnp.asarray(alpha)), T))

    log_norm = special.gammaln(alpha.sum()) - special.gammaln(alpha).sum()

    def f(y, x):
        z = 1.0 - x - y
        if z <= 0:
            return 0.0
        log_p = log_norm + np.dot(alpha - 1, np.log([x, y, z]))
        return math.exp(log_p / T)

    val, _ = integrate.dblquad(f, 0, 1, 0, lambda x: 1 - x, epsabs=1e-12, epsrel=1e-10)
    assert_allclose(got, math.log(val), rtol=1e-7)


@pytest.mark.parametrize("T", TEMPS)
def test_mvn_diagonal_is_product_of_normals(T):
    loc = jnp.array([[0.1, -0.3, 2.0], [1.0, 0.0, -1.0]])
    scale = jnp.array([0.5, 1.2, 3.0])
    with x64():
        mvn = npd.MultivariateNormal(loc, jnp.diag(scale**2))
        got = tempered_log_normalizer(mvn, T)
        ref = tempered_log_normalizer(npd.Normal(loc, scale).to_event(1), T)
        ref2 = tempered_log_normalizer(npd.Normal(0.0, scale), T).sum()
    assert got.shape == (2,)
    assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    assert_allclose(got, ref2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", TEMPS)
def test_mvn_correlated_vs_grid(T):
    mu = np.array([0.3, -0.2])
    cov = np.array([[1.5, 0.6], [0.6, 0.8]])
    with x64():
        got = float(tempered_log_normalizer(npd.MultivariateNormal(mu, cov), T))
        lowrank = npd.LowRankMultivariateNormal(
            jnp.asarray(mu), jnp.array([[1.0], [0.6]]), jnp.array([0.5, 0.44])
        )  # W W^T + diag(d) == cov
        got_lr = float(tempered_log_normalizer(lowrank, T))
    half = 9.0 * math.sqrt(T * 1.8)
    g = np.linspace(-half, half, 401)
    xx, yy = np.meshgrid(g + mu[0], g + mu[1], indexing="ij")
    pts = np.stack([xx, yy], -1)
    log_f = stats.multivariate_normal(mu, cov).logpdf(pts) / T
    h = g[1] - g[0]
    ref = special.logsumexp(log_f) + 2 * math.log(h)
    assert_allclose(got, ref, rtol=1e-8, atol=1e-9)
    assert_allclose(got_lr, got, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------
# Discrete closed forms vs brute-force sums
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", TEMPS)
def test_bernoulli_and_categorical_vs_brute(T):
    p = np.array([0.0, 0.2, 0.5, 0.97, 1.0])
    probs = np.array([[0.2, 0.3, 0.5], [0.0, 0.25, 0.75]])
    logits = np.array([[0.3, -1.0, 2.0], [5.0, 0.0, 0.0]])
    with x64():
        bp = np.asarray(tempered_log_normalizer(npd.Bernoulli(probs=jnp.asarray(p)), T))
        bl = np.asarray(tempered_log_normalizer(npd.Bernoulli(logits=jnp.asarray(logits)), T))
        cp = np.asarray(tempered_log_normalizer(npd.Categorical(probs=jnp.asarray(probs)), T))
        cl = np.asarray(tempered_log_normalizer(npd.Categorical(logits=jnp.asarray(logits)), T))
    with np.errstate(divide="ignore"):
        ref_bp = [brute_log_sum(np.log([q, 1 - q]), T) for q in p]
        ref_cp = [brute_log_sum(np.log(row), T) for row in probs]
    sig = special.expit(logits)
    ref_bl = np.vectorize(lambda s: brute_log_sum(np.log([s, 1 - s]), T))(sig)
    ref_cl = [brute_log_sum(row - special.logsumexp(row), T) for row in logits]
    assert_allclose(bp, ref_bp, rtol=1e-12, atol=1e-12)
    assert_allclose(bl, ref_bl, rtol=1e-10, atol=1e-12)
    assert_allclose(cp, ref_cp, rtol=1e-12, atol=1e-12)
    assert_allclose(cl, ref_cl, rtol=1e-12, atol=1e-12)
    # supplement eq. 14, one factor: log(pi^{1/T} + (1 - pi)^{1/T})
    assert_allclose(bp[1], math.log(0.2 ** (1 / T) + 0.8 ** (1 / T)), rtol=1e-12)


@pytest.mark.parametrize("T", TEMPS)
def test_binomial_vs_brute(T):
    n = np.array([0, 1, 3, 7, 20])
    p = np.array([0.2, 0.5, 0.5, 0.9, 0.35])
    with x64():
        got_p = np.asarray(tempered_log_normalizer(npd.Binomial(jnp.asarray(n), probs=p), T))
        got_l = np.asarray(
            tempered_log_normalizer(npd.Binomial(jnp.asarray(n), logits=special.logit(p)), T)
        )
    ref = [
        brute_log_sum(stats.binom.logpmf(np.arange(m + 1), m, q), T)
        for m, q in zip(n, p, strict=True)
    ]
    assert_allclose(got_p, ref, rtol=1e-12, atol=1e-12)
    assert_allclose(got_l, ref, rtol=1e-10, atol=1e-12)


def test_binomial_counts_known_at_trace_time_are_summed_in_one_chunk_without_a_loop():
    """partition._BINOMIAL_ONE_CHUNK: counts known when traced (a number in the model) are
    summed over their n + 1 terms at once -- no while loop in the program -- and give the
    value and gradient of the series' loop, which traced counts (data) still take."""
    n = np.array([0, 1, 3, 7, 20])
    logits = jnp.asarray(special.logit(np.array([0.2, 0.5, 0.5, 0.9, 0.35])))

    def log_z(lg, counts):
        return jnp.sum(tempered_log_normalizer(npd.Binomial(counts, logits=lg), 3.0))

    known = jax.jit(jax.value_and_grad(lambda lg: log_z(lg, n)))
    traced = jax.jit(jax.value_and_grad(log_z))
    assert "while" not in str(jax.make_jaxpr(known)(logits))
    assert "while" in str(jax.make_jaxpr(traced)(logits, jnp.asarray(n)))
    (v1, g1), (v2, g2) = known(logits), traced(logits, jnp.asarray(n))
    ref = sum(brute_log_sum(stats.binom.logpmf(np.arange(m + 1), m, q), 3.0)
              for m, q in zip(n, special.expit(np.asarray(logits)), strict=True))
    assert_allclose([v1, v2], [ref, ref], rtol=2e-6)
    assert_allclose(g1, g2, rtol=1e-5, atol=1e-6)
    assert "while" in str(jax.make_jaxpr(lambda lg: log_z(lg, 5000))(logits[:1]))  # too many


def test_binomial_terms_sum_traced_counts_in_one_chunk_and_refuse_larger_ones():
    """partition.binomial_terms: traced counts (data) summed over the given number of terms
    in one chunk (no loop), equal to the series' loop; a count at or above it gives NaN,
    never a truncated sum. log_partition sets it from the model's data
    (partition_function._largest_binomial_count)."""
    from numpyro_tempering.partition_function import _largest_binomial_count

    n = jnp.array([0, 1, 3, 7, 20])
    logits = jnp.asarray(special.logit(np.array([0.2, 0.5, 0.5, 0.9, 0.35])))

    def log_z(counts):  # traced anew each time (JAX's caches do not see the context)
        return tempered_log_normalizer(npd.Binomial(counts, logits=logits), 3.0)

    with partition.binomial_terms(21):
        program = str(jax.make_jaxpr(lambda c: log_z(c))(n))
        hinted = jax.jit(lambda c: log_z(c))(n)
    with partition.binomial_terms(20):
        short = jax.jit(lambda c: log_z(c))(n)
    assert "while" not in program and "while" in str(jax.make_jaxpr(lambda c: log_z(c))(n))
    assert_allclose(hinted, jax.jit(lambda c: log_z(c))(n), rtol=2e-6)
    assert np.all(np.isfinite(short[:4])) and np.isnan(short[4])
    with partition.binomial_terms(20):  # known counts are not held to the hint
        assert np.isfinite(log_z(jnp.array([2000]))[0])

    def model(counts, y):
        with numpyro.plate("data", counts.shape[0]):
            numpyro.sample("y", npd.Binomial(counts, logits=0.3), obs=y)

    def literal(y):
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", npd.Binomial(20, logits=0.3), obs=y)

    def subsampled(counts, y):
        with numpyro.plate("data", counts.shape[0], subsample_size=2) as idx:
            numpyro.sample("y", npd.Binomial(counts[idx], logits=0.3), obs=y[idx])

    from numpyro_tempering.handlers import Selection
    from numpyro_tempering.partition_function import _marked, _probe

    def sites(m, *args):
        return _probe(_marked(m, Selection.of()), args, {}, None).binomial_sites

    assert sites(model, n, n) == ("y",) and sites(subsampled, n, n) == ()  # one subsample's
    assert _largest_binomial_count(model, (n, n), {}, ("y",)) == 21
    assert _largest_binomial_count(literal, (n,), {}, ("y",)) == 21  # (known when traced)
    assert _largest_binomial_count(model, (n * 100, n), {}, ("y",)) is None  # >= ONE_CHUNK


def test_log_partition_sums_a_binomial_with_counts_as_data_in_one_chunk(monkeypatch):
    """log_partition runs the model once on its data and compiles its normalisers under
    partition.binomial_terms(max count + 1), so counts passed as data (traced) skip the
    series' loop as literal counts do (a logit-normal Binomial(20) at N = 50: 368 s -> 69 s,
    docs/reproductions.md)."""
    from numpyro_tempering.partition_function import log_partition

    seen = []
    finite = partition._finite_binomial_log_sum

    def spy(terms):
        seen.append(terms)
        return finite(terms)

    monkeypatch.setattr(partition, "_finite_binomial_log_sum", spy)
    counts = jnp.array([3, 0, 12, 7])

    def model(n):
        b = numpyro.sample("b", npd.Normal(0.0, 1.0))
        with numpyro.plate("data", n.shape[0]):
            numpyro.sample("y", npd.Binomial(n, logits=b), obs=jnp.zeros_like(n))

    est = log_partition(jax.random.PRNGKey(0), model, jnp.array([2.0]), counts,
                        method="prior", num_samples=8, progress_bar=False)
    assert seen and set(seen) == {13}
    assert np.isfinite(est.log_c[0])


def test_binomial_degenerate_probs():
    with x64():
        got = tempered_log_normalizer(npd.Binomial(5, probs=jnp.array([0.0, 1.0])), 3.0)
    assert_allclose(got, [0.0, 0.0], atol=1e-12)


@pytest.mark.parametrize("T", TEMPS)
def test_poisson_vs_brute(T):
    rate = np.array([0.0, 0.3, 4.0, 50.0, 300.0])
    with x64():
        got = np.asarray(tempered_log_normalizer(npd.Poisson(jnp.asarray(rate)), T))
    k = np.arange(20000)
    ref = [0.0] + [brute_log_sum(stats.poisson.logpmf(k, r), T) for r in rate[1:]]
    assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_poisson_large_rates_use_the_asymptotic_expansion(dtype):
    """Beyond rate/T = 30 (float32) or 1000 (float64) the three-term expansion of Gaunt et
    al. (2019) replaces the series: against the brute-force sum across the switch, and a
    huge rate returns at once (finite) while a non-finite one gives nan."""
    temps = np.array([0.5, 1.5, 10.0])[:, None]
    rate = np.array([25.0, 35.0, 90.0, 110.0, 900.0, 1100.0, 2.0e4])
    with x64():
        got = np.asarray(tempered_log_normalizer(
            npd.Poisson(jnp.asarray(rate, dtype)), jnp.asarray(temps, dtype)))
        huge = np.asarray(tempered_log_normalizer(
            npd.Poisson(jnp.asarray([1e30, np.inf, 1e38, np.finfo(dtype).max], dtype)),
            jnp.asarray(3.0, dtype)))
    k = np.arange(60000)
    ref = [[brute_log_sum(stats.poisson.logpmf(k, r), t) for r in rate] for t in temps[:, 0]]
    assert_allclose(got, ref, rtol=0, atol=1e-10 if dtype == np.float64 else 5e-5)
    assert np.isfinite(huge[0]) and np.isnan(huge[1])
    nu = 1 / 3.0  # leading order: (1 - nu)/2 log(2 pi r) + log(T)/2
    # finite up to the largest finite rate: 2 pi r overflowed float32 beyond r = 5.4e37
    # (log Z = +inf at a log link's eta in (86.9, 88.7): the quadrature route's NaN)
    lead = [(1 - nu) / 2 * (np.log(2 * np.pi) + np.log(np.float64(r))) + np.log(3.0) / 2
            for r in (1e30, 1e38, np.finfo(dtype).max)]
    assert_allclose(huge[[0, 2, 3]], lead, rtol=1e-6)
    # draws at a large rate start their walk near the bulk: mean and variance of the law
    with x64():
        td = tempered_distribution(npd.Poisson(jnp.asarray([2.0e4], dtype)), 3.0)
        draws = np.asarray(td.sample(jax.random.PRNGKey(0), (4000,)), np.float64)[:, 0]
    log_p = stats.poisson.logpmf(k, 2.0e4) / 3.0
    p = np.exp(log_p - special.logsumexp(log_p))
    mean = np.sum(k * p)
    var = np.sum((k - mean) ** 2 * p)
    assert abs(draws.mean() - mean) < 5 * np.sqrt(var / 4000)
    assert abs(draws.var() / var - 1) < 0.15


def test_poisson_curvature_in_a_log_link_is_finite():
    """The second derivative of log Z(T) of Poisson(e^eta) in eta (forward over reverse
    through the series' custom_jvp: the curvature that places the quadrature nodes of
    numpyro_tempering.local_quadrature): it was nan at eta = 3.5 and 3.75 in this batch
    (the forward derivative of the series' running max divides by the count of terms equal
    to it, and XLA's recomputation of the terms with other rounding made that count 0; it
    depends on the batch and on how the pieces are compiled)."""
    eta = np.linspace(3.0, 8.0, 21)

    def curvature(dtype):
        def log_z(e):
            law = npd.Poisson(jnp.exp(e))
            return jnp.sum(tempered_log_normalizer(law, jnp.asarray(10.0, dtype)))

        e = jnp.asarray(eta, dtype)
        return np.asarray(jax.jvp(jax.grad(log_z), (e,), (jnp.ones_like(e),))[1], np.float64)

    got = curvature(jnp.float32)
    assert np.all(np.isfinite(got)), eta[~np.isfinite(got)]
    with x64():
        ref = curvature(jnp.float64)
    assert_allclose(got, ref, rtol=0, atol=2e-4)


def test_series_stop_at_once_on_nan_parameters():
    """A nan rate or probability (a divergent HMC step's) gives nan at once; it used to run
    the series to its 2**22-term cap in lock step with the whole batch (minutes under SMC):
    the loop over chunks of terms now stops after the chunks the finite element needs (a
    rate of 1 at T = 2: 17 terms, a first chunk of 16 and one of 128)."""
    with validation_enabled(False):
        pois = tempered_log_normalizer(
            npd.Poisson(jnp.array([1.0, np.nan, -1.0, np.inf]), validate_args=False), 2.0)
        binom = tempered_log_normalizer(
            npd.Binomial(5, probs=jnp.array([0.3, np.nan]), validate_args=False), 2.0)
    assert np.isfinite(pois[0]) and np.isnan(pois[1:]).all()
    assert np.isfinite(binom[0]) and np.isnan(binom[1])
    chunks = []

    def counted_term(k, params):
        jax.debug.callback(lambda: chunks.append(1))
        return partition._poisson_term(k, params)

    params = (jnp.array([1.0, np.nan, -1.0, np.inf]), jnp.full(4, 2.0))
    log_z, _ = partition._series_loop(counted_term, partition._poisson_tail, params, False)
    jax.effects_barrier()
    assert np.isfinite(log_z[0]) and np.isnan(log_z[1:]).all()
    assert len(chunks) == 2, len(chunks)


def test_a_vmapped_series_runs_each_call_only_as_far_as_it_needs():
    """Under ``vmap`` (particles, quadrature nodes) the series' calls are queued
    (partition._series_members): 200 calls, one of them at a rate that needs ~650 terms
    and the rest a few dozen. Values and gradients equal the calls made one at a time
    and the brute-force sum, and the terms computed are those the calls need (JAX's
    batched while_loop ran every call for the slowest one's chunks: 200 x 6 chunks)."""
    rates = np.concatenate([np.full(199, 2.0), [290.0]]).astype(np.float32)
    value_and_grad = jax.value_and_grad(
        lambda r: tempered_log_normalizer(npd.Poisson(r), 10.0))
    values, grads = jax.jit(jax.vmap(value_and_grad))(jnp.asarray(rates))
    one = jax.jit(value_and_grad)
    for i in (0, -1):  # a call alone: the same value and gradient
        value, grad = one(jnp.asarray(rates[i]))
        assert_allclose(values[i], value, rtol=2e-6)
        assert_allclose(grads[i], grad, rtol=2e-5)
    k = np.arange(4000)
    ref = [brute_log_sum(stats.poisson.logpmf(k, r), 10.0) for r in rates[[0, -1]]]
    assert_allclose(np.asarray(values)[[0, -1]], ref, rtol=2e-6)
    terms = []

    def counted_term(k, params):  # the terms one evaluation computes, across the batch
        lt = partition._poisson_term(k, params)
        jax.debug.callback(lambda t: terms.append(np.size(t)), lt)
        return lt

    params = (jnp.asarray(rates), jnp.full(200, 10.0, jnp.float32))
    jax.vmap(lambda *p: partition._series_loop(counted_term, partition._poisson_tail, p,
                                               False)[0])(*params)
    jax.effects_barrier()
    # a first chunk of 16 terms and one of 128 for all 200 calls, then a few passes of
    # 128 terms for 200 / 8 calls (one of them real): 41,600 terms, against 131,200 in
    # lock step
    assert sum(terms) <= 200 * (16 + 128) + 5 * 25 * 128, sum(terms)


@pytest.mark.parametrize("T", [0.5, 1.0, 3.0])
def test_multinomial_per_trial_and_exact_vs_enumeration(T):
    probs = np.array([0.2, 0.3, 0.5])
    n = 4
    xs = list(compositions(n, 3))
    log_pmf = np.array([stats.multinomial.logpmf(x, n, probs) for x in xs])
    log_coef = np.array(
        [stats.multinomial.logpmf(x, n, np.ones(3) / 3) + n * np.log(3) for x in xs]
    )
    with x64():
        d = npd.Multinomial(n, probs=jnp.asarray(probs))
        per_trial = float(tempered_log_normalizer(d, T))
        per_trial_logits = float(
            tempered_log_normalizer(npd.Multinomial(n, logits=jnp.log(probs) + 1.0), T)
        )
        exact = float(tempered_multinomial_exact(d, jnp.asarray(T)).log_normalizer)
    # per trial: coefficient untempered, sum_x binom(n, x) prod p^{x/T} = (sum p^{1/T})^n
    ref_per_trial = special.logsumexp(log_coef + (log_pmf - log_coef) / T)
    assert_allclose(per_trial, ref_per_trial, rtol=1e-12, atol=1e-12)
    assert_allclose(per_trial, n * math.log(np.sum(probs ** (1 / T))), rtol=1e-12, atol=1e-12)
    assert_allclose(per_trial_logits, per_trial, rtol=1e-12, atol=1e-12)
    assert_allclose(exact, brute_log_sum(log_pmf, T), rtol=1e-12, atol=1e-12)
    if T != 1.0:
        assert abs(exact - per_trial) > 1e-3  # the two conventions genuinely differ


def test_multinomial_exact_two_categories_is_binomial():
    n = np.array([0, 3, 7])
    p = np.array([0.3, 0.7, 0.1])
    with x64():
        multi = npd.Multinomial(jnp.asarray(n), probs=jnp.stack([jnp.asarray(p), 1 - p], -1))
        T = jnp.array([[0.5], [2.0]])
        exact = tempered_multinomial_exact(multi, T).log_normalizer
        binom = tempered_log_normalizer(npd.Binomial(jnp.asarray(n), probs=jnp.asarray(p)), T)
    assert exact.shape == (2, 3)
    assert_allclose(exact, binom, rtol=1e-11, atol=1e-12)


def test_multinomial_exact_keeps_its_digits_in_float32_at_hundreds_of_trials():
    """The exact rule subtracted log n! / T from a convolution of (j log p_k - log j!) / T:
    terms of size n log n, 7.6e-5 nats lost per element in float32 at n = 1,000 (found
    with the probe of large shapes). As a product of Poisson(x_k | n p_k) over
    Poisson(n | n) every term is of size log n: within 3e-6 of the float64 sum over all
    count vectors (K = 3) at n = 400 (8.5e-5 off before)."""
    p = np.array([0.2, 0.3, 0.5])
    n = 400
    k1, k2 = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    k3 = n - k1 - k2
    ok = k3 >= 0
    k3 = np.where(ok, k3, 0)
    log_pmf = (special.gammaln(n + 1.0) - special.gammaln(k1 + 1.0) - special.gammaln(k2 + 1.0)
               - special.gammaln(k3 + 1.0) + k1 * np.log(p[0]) + k2 * np.log(p[1])
               + k3 * np.log(p[2]))
    rule = jax.jit(lambda q, t: tempered_multinomial_exact(npd.Multinomial(n, q), t)
                   .log_normalizer)  # one program: eager, its ops took seconds to compile
    for t in (1.5, 10.0):
        want = special.logsumexp(np.where(ok, log_pmf / t, -np.inf))
        got = float(rule(jnp.asarray(p, jnp.float32), jnp.float32(t)))
        assert abs(got - want) < 3e-6, (t, got, want)


def test_multinomial_tempered_law_and_coefficient():
    probs = jnp.array([0.2, 0.3, 0.5])
    T = 2.0
    with x64():
        d = npd.Multinomial(4, probs=probs)
        res = tempered(d, T)
        xs = jnp.asarray(np.stack(list(compositions(4, 3))))
        lp_t = res.distribution.log_prob(xs)
        log_coef = d.log_prob(xs) - jnp.sum(xs * jnp.log(probs), -1)
        expected = d.log_prob(xs) / T - res.log_normalizer + (1 - 1 / T) * log_coef
    assert_allclose(lp_t, expected, rtol=1e-12, atol=1e-12)
    assert_allclose(jnp.sum(jnp.exp(lp_t)), 1.0, rtol=1e-12)


def test_delta_and_unit():
    with x64():
        delta = npd.Delta(jnp.zeros((3, 2)), jnp.array([0.0, 1.0, -2.0]), event_dim=1)
        unit = npd.Unit(jnp.array([0.5, -3.0]))
        T = jnp.array([[0.5], [4.0]])
        ld = tempered_log_normalizer(delta, T)
        lu = tempered_log_normalizer(unit, T)
        tu = tempered_distribution(unit, T)
        td = tempered_distribution(delta, T)
        assert_allclose(ld, jnp.array([0.0, 1.0, -2.0]) / T)
        assert_allclose(lu, jnp.array([0.5, -3.0]) / T)
        assert tu.batch_shape == (2, 2)
        assert_allclose(tu.log_prob(jnp.zeros((2, 2, 0))), jnp.zeros((2, 2)))
        assert_allclose(td.log_prob(jnp.zeros((3, 2))), jnp.zeros((2, 3)))
        assert_allclose(tempered_log_normalizer(npd.Delta(1.0), 3.0), 0.0)


# ------------------------------------------------------------------------------------------
# Wrappers
# ------------------------------------------------------------------------------------------


def test_independent_expanded_masked():
    T = jnp.array([[0.5], [1.0], [3.0]])
    loc, scale = jnp.zeros((4, 5)), jnp.linspace(0.5, 2.0, 5)
    with x64():
        base = tempered_log_normalizer(npd.Normal(loc, scale), T[..., None])  # (3, 4, 5)
        ind = tempered(npd.Normal(loc, scale).to_event(1), T)
        assert ind.log_normalizer.shape == (3, 4)
        assert_allclose(ind.log_normalizer, base.sum(-1), rtol=1e-12)
        assert ind.distribution.event_shape == (5,)
        x = jnp.ones((4, 5))
        assert_allclose(
            ind.distribution.log_prob(x),
            npd.Normal(loc, scale).to_event(1).log_prob(x) / T - ind.log_normalizer,
            rtol=1e-12,
        )

        exp = tempered(npd.Gamma(2.0, 1.0).expand([4]), T)
        assert exp.log_normalizer.shape == (3, 4)
        ref = tempered_log_normalizer(npd.Gamma(2.0, 1.0), T)
        assert_allclose(exp.log_normalizer, jnp.broadcast_to(ref, (3, 4)), rtol=1e-12)
        assert exp.distribution.batch_shape == (3, 4)

        mask = jnp.array([True, False, True, True])
        msk = tempered(npd.Normal(loc[:, 0], 2.0).mask(mask), T)
        full = tempered_log_normalizer(npd.Normal(loc[:, 0], 2.0), T)
        assert_allclose(msk.log_normalizer, jnp.where(mask, full, 0.0), rtol=1e-12)
        assert_allclose(msk.distribution.log_prob(jnp.ones(4))[:, 1], 0.0)
        off = tempered_log_normalizer(npd.Normal(0.0, 2.0).mask(False), T)
        assert_allclose(off, jnp.zeros((3, 1)))
        on = tempered_log_normalizer(npd.Normal(0.0, 2.0).mask(True), T)
        assert_allclose(on, tempered_log_normalizer(npd.Normal(0.0, 2.0), T))


# ------------------------------------------------------------------------------------------
# Property tests (hypothesis): T = 1, log_prob identity, normalisation
# ------------------------------------------------------------------------------------------

FAMILIES = [
    "normal",
    "mvn",
    "gamma",
    "exponential",
    "beta",
    "dirichlet",
    "bernoulli",
    "bernoulli_logits",
    "categorical",
    "categorical_logits",
    "binomial",
    "poisson",
    "uniform",
]
pos = st.floats(0.3, 6.0)


@st.composite
def family_params(draw, names=tuple(FAMILIES)):
    name = draw(st.sampled_from(names))
    shape = (2,)  # fixed shapes: jit caches are reused across examples
    arr = lambda s, lo, hi: np.asarray(  # noqa: E731
        draw(st.lists(st.floats(lo, hi), min_size=int(np.prod(s)), max_size=int(np.prod(s))))
    ).reshape(s)
    if name in ("normal",):
        params = (arr(shape, -3, 3), arr(shape, 0.2, 4))
    elif name == "mvn":
        a = arr((2, 2), -1, 1)
        params = (arr((2,), -2, 2), a @ a.T + np.eye(2) * draw(st.floats(0.2, 2.0)))
    elif name in ("gamma", "beta"):
        params = (arr(shape, 0.3, 6), arr(shape, 0.3, 6))
    elif name == "exponential":
        params = (arr(shape, 0.1, 5),)
    elif name == "dirichlet":
        params = (arr(shape + (3,), 0.3, 6),)
    elif name in ("bernoulli", "binomial"):
        params = (arr(shape, 0.01, 0.99), np.asarray(draw(st.integers(0, 12))))
    elif name in ("bernoulli_logits", "categorical_logits"):
        params = (arr(shape + ((3,) if name.startswith("cat") else ()), -4, 4),)
    elif name == "categorical":
        w = arr(shape + (4,), 0.01, 1.0)
        params = (w / w.sum(-1, keepdims=True),)
    elif name == "poisson":
        params = (arr(shape, 0.05, 40.0),)  # rate 0 is covered by test_poisson_vs_brute
    else:  # uniform
        lo = arr(shape, -2, 1)
        params = (lo, lo + arr(shape, 0.1, 4))
    return name, params, arr((3, 2, 3), 0.001, 0.999)


def support_points(name, params, u):
    """Three batch-shaped points in the support of family ``name`` from uniforms ``u``."""
    u2 = u[..., 0]  # (3, 2)
    if name == "normal":
        return params[0] + params[1] * (8 * u2 - 4)
    if name == "mvn":
        return params[0] + (6 * u2 - 3)  # (3, 2) = 3 points of the 2-d event
    if name in ("gamma", "exponential"):
        return 10 * u2
    if name == "beta":
        return u2
    if name == "dirichlet":
        return u / u.sum(-1, keepdims=True)
    if name.startswith("bernoulli"):
        return (u2 > 0.5).astype(float)
    if name.startswith("categorical"):
        return np.floor(u2 * params[0].shape[-1]).astype(np.int64)
    if name == "binomial":
        return np.floor(u2 * (params[1] + 1))
    if name == "poisson":
        return np.floor(u2 * 80)
    return params[0] + (params[1] - params[0]) * u2  # uniform


def build(name, params):
    p = [jnp.asarray(x) for x in params]
    return {
        "normal": lambda: npd.Normal(*p),
        "mvn": lambda: npd.MultivariateNormal(p[0], p[1]),
        "gamma": lambda: npd.Gamma(*p),
        "exponential": lambda: npd.Exponential(*p),
        "beta": lambda: npd.Beta(*p),
        "dirichlet": lambda: npd.Dirichlet(*p),
        "bernoulli": lambda: npd.Bernoulli(probs=p[0]),
        "bernoulli_logits": lambda: npd.Bernoulli(logits=p[0]),
        "categorical": lambda: npd.Categorical(probs=p[0]),
        "categorical_logits": lambda: npd.Categorical(logits=p[0]),
        "binomial": lambda: npd.Binomial(p[1], probs=p[0]),
        "poisson": lambda: npd.Poisson(*p),
        "uniform": lambda: npd.Uniform(*p),
    }[name]()


def min_concentration(name, params):
    if name in ("gamma",):
        return float(np.min(params[0]))
    if name in ("beta", "dirichlet"):
        return float(min(np.min(q) for q in params))
    return 1.0


temperatures = st.floats(0.2, 20.0)


@partial(jax.jit, static_argnums=0)
def _identity_terms(name, params, T, x):
    """log Z, log p_T(x) and log p(x)/T - log Z, in one compiled function per family."""
    d = build(name, params)
    res = tempered(d, T)
    lhs = res.distribution.log_prob(x)
    return res.log_normalizer, lhs, d.log_prob(x) / T - res.log_normalizer


def _check_identity(lhs, rhs):
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    ok = np.isfinite(rhs)
    assert ok.any()
    assert_allclose(lhs[ok], rhs[ok], rtol=1e-9, atol=1e-9)
    assert np.array_equal(np.isfinite(lhs), ok)


@pytest.mark.parametrize("family", FAMILIES)
@HYP_PER_FAMILY
@given(data=st.data())
def test_temperature_one_is_identity(family, data):
    name, params, u = data.draw(family_params(names=(family,)))
    x = support_points(name, params, u)
    log_z, lhs, rhs = _identity_terms(name, params, 1.0, x)
    assert log_z.shape == build(name, params).batch_shape
    assert_allclose(log_z, 0.0, atol=1e-10)
    _check_identity(lhs, rhs)  # at T = 1: log p_T(x) == log p(x) - 0


@pytest.mark.parametrize("family", FAMILIES)
@HYP_PER_FAMILY
@given(data=st.data(), T=temperatures)
def test_tempered_log_prob_identity(family, data, T):
    name, params, u = data.draw(family_params(names=(family,)))
    assume(1 + (min_concentration(name, params) - 1) / T > 1e-3)
    x = support_points(name, params, u)
    log_z, lhs, rhs = _identity_terms(name, params, T, x)
    _check_identity(lhs, rhs)
    eager = tempered_log_normalizer(build(name, params), T)  # concrete path agrees with jit
    assert_allclose(eager, log_z, rtol=1e-12, atol=1e-12)


DISCRETE = ["bernoulli", "bernoulli_logits", "categorical", "categorical_logits", "binomial"]


@HYP
@given(family_params(names=(*DISCRETE, "poisson")), temperatures)
def test_tempered_law_sums_to_one(fp, T):
    name, params, _ = fp
    d = build(name, params)
    td = tempered_distribution(d, T)
    if name == "poisson":
        support = jnp.arange(6000.0)
    elif name == "binomial":  # fixed shape (n <= 12); k > n has probability 0
        support = jnp.arange(13.0)
    else:
        support = d.enumerate_support(expand=False)[:, 0]
    total = _total_mass(td, support)
    assert_allclose(total, 1.0, rtol=1e-9)


@jax.jit
def _total_mass(td, support):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # out-of-support k for the Binomial
        return jnp.sum(jnp.exp(td.log_prob(support[:, None])), axis=0)


@pytest.mark.parametrize(
    "d",
    [
        npd.Normal(0.4, 1.5),
        npd.Gamma(1.7, 0.6),
        npd.Exponential(1.3),
        npd.Beta(2.0, 0.9),
        npd.Uniform(-1.0, 2.0),
    ],
    ids=lambda d: type(d).__name__,
)
@pytest.mark.parametrize("T", [0.5, 4.0])
def test_continuous_tempered_law_integrates_to_one(d, T):
    with x64():
        td = tempered_distribution(d, T)
        log_prob = jax.jit(td.log_prob)
        lo, hi = (float(b) for b in _bounds(d))
        val, _ = integrate.quad(
            lambda x: float(jnp.exp(log_prob(x))), lo, hi, epsrel=1e-10, limit=400
        )
    assert_allclose(val, 1.0, rtol=1e-7)


def _bounds(d):
    support = d.support
    lo = getattr(support, "lower_bound", -np.inf)
    hi = getattr(support, "upper_bound", np.inf)
    return lo, hi


# ------------------------------------------------------------------------------------------
# Broadcasting, dtypes, jit
# ------------------------------------------------------------------------------------------

LADDER_DISTS = {  # name: (distribution with batch (3,), a point of its support)
    "normal": (
        lambda: npd.Normal(jnp.array([0.0, 1.0, -1.0]), jnp.array([0.5, 1.0, 2.0])),
        [0.3, 2.0, -4.0],
    ),
    "gamma": (lambda: npd.Gamma(jnp.array([1.5, 2.0, 7.0]), 2.0), [0.3, 2.0, 4.0]),
    "poisson": (lambda: npd.Poisson(jnp.array([0.5, 3.0, 12.0])), [0, 4, 30]),
    "binomial": (
        lambda: npd.Binomial(jnp.array([2, 5, 9]), probs=jnp.array([0.1, 0.5, 0.8])),
        [2, 0, 7],
    ),
    "mvn": (
        lambda: npd.MultivariateNormal(jnp.zeros((3, 2)), jnp.array([[2.0, 0.5], [0.5, 1]])),
        [[0.1, -1.0], [2.0, 0.0], [0.0, 0.0]],
    ),
    "dirichlet": (
        lambda: npd.Dirichlet(jnp.array([[1.0, 2.0], [3.0, 3.0], [1.5, 8.0]])),
        [[0.2, 0.8], [0.5, 0.5], [0.9, 0.1]],
    ),
    "multinomial": (
        lambda: npd.Multinomial(3, probs=jnp.array([[0.2, 0.8], [0.5, 0.5], [0.1, 0.9]])),
        [[3, 0], [1, 2], [0, 3]],
    ),
}


@partial(jax.jit, static_argnums=0)
def _ladder_terms(name, Ts, x):
    d = LADDER_DISTS[name][0]()
    ladder = tempered(d, Ts[:, None])
    base_lp = d.log_prob(x)
    if name == "multinomial":  # per-trial: the coefficient is not tempered
        log_coef = base_lp - jnp.sum(x * jnp.log(d.probs), -1)
    else:
        log_coef = jnp.zeros_like(base_lp)
    expected = (base_lp - log_coef) / Ts[:, None] + log_coef - ladder.log_normalizer
    return ladder, ladder.distribution.log_prob(x), expected


@pytest.mark.parametrize("name", ["binomial", "dirichlet", "multinomial", "mvn", "poisson"])
def test_temperature_ladder_broadcasting(name):
    Ts = np.geomspace(0.5, 10.0, 100)
    ladder, lp, expected = _ladder_terms(name, Ts, jnp.asarray(LADDER_DISTS[name][1]))
    assert ladder.log_normalizer.shape == (100, 3)
    assert ladder.distribution.batch_shape == (100, 3)
    assert_allclose(lp, expected, rtol=1e-10, atol=1e-10)
    # looping over scalar temperatures on the concrete (eager) path gives the same rows
    d = LADDER_DISTS[name][0]()
    looped = np.stack([np.asarray(tempered_log_normalizer(d, T)) for T in Ts[::33]])
    assert_allclose(ladder.log_normalizer[::33], looped, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["normal", "poisson", "mvn"])
def test_vmap_over_temperatures_matches_ladder(name):
    Ts = jnp.geomspace(0.5, 10.0, 100)
    d = LADDER_DISTS[name][0]()
    vmapped = jax.jit(jax.vmap(lambda t: tempered_log_normalizer(d, t)))(Ts)
    assert_allclose(vmapped, tempered_log_normalizer(d, Ts[:, None]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["gamma", "poisson", "mvn"])
def test_float32_and_float64(name):
    T = np.array([0.5, 2.0, 10.0])[:, None]
    with jax.enable_x64(False):
        lz32 = tempered_log_normalizer(LADDER_DISTS[name][0](), T.astype(np.float32))
        assert lz32.dtype == jnp.float32
    with x64():
        lz64 = tempered_log_normalizer(LADDER_DISTS[name][0](), T)
        assert lz64.dtype == jnp.float64
        weak = tempered_log_normalizer(
            npd.Normal(jnp.zeros(2, jnp.float32), jnp.ones(2, jnp.float32)), 2.0
        )
        assert weak.dtype == jnp.float32  # Python scalars do not promote
    assert_allclose(lz32, lz64, rtol=2e-5, atol=2e-5)


def test_jit_with_traced_parameters_and_temperature():
    f = jax.jit(
        lambda r, p, t: (
            tempered_log_normalizer(npd.Poisson(r), t),
            tempered_log_normalizer(npd.Binomial(jnp.array([3, 6]), probs=p), t),
            tempered_log_normalizer(npd.Gamma(r, 1.0), t),
        )
    )
    with x64():
        r, p, t = jnp.array([1.5, 4.0]), jnp.array([0.3, 0.6]), jnp.array([[0.5], [3.0]])
        got = f(r, p, t)
        eager = (
            tempered_log_normalizer(npd.Poisson(r), t),
            tempered_log_normalizer(npd.Binomial(jnp.array([3, 6]), probs=p), t),
            tempered_log_normalizer(npd.Gamma(r, 1.0), t),
        )
        for a, b in zip(got, eager, strict=True):
            assert a.shape == (2, 2)
            assert_allclose(a, b, rtol=1e-12)
        # invalid temperatures cannot raise under jit: nan; improper Gamma: +inf
        bad = f(r, p, jnp.array([[-1.0], [jnp.inf]]))
        assert all(np.isnan(np.asarray(b)).all() for b in bad)
        improper = f(jnp.array([0.2, 4.0]), p, jnp.array([[0.5], [0.5]]))[2]
        assert np.isposinf(improper[:, 0]).all() and np.isfinite(improper[:, 1]).all()


def test_tempered_distribution_is_a_pytree_through_jit():
    with x64():
        make = jax.jit(lambda r, t: tempered_distribution(npd.Poisson(r), t))
        td = make(jnp.array([2.0, 5.0]), 3.0)
        assert isinstance(td, TemperedDistribution)
        ref = tempered_distribution(npd.Poisson(jnp.array([2.0, 5.0])), 3.0)
        assert_allclose(td.log_prob(jnp.array([1, 7])), ref.log_prob(jnp.array([1, 7])))
        # the sampler survives flatten/unflatten (same shapes as the frequency test: one compile)
        assert td.sample(jax.random.PRNGKey(0), (40000,)).shape == (40000, 2)


# ------------------------------------------------------------------------------------------
# Gradients of the series rules (custom_jvp) vs finite differences
# ------------------------------------------------------------------------------------------


def test_series_gradients_match_finite_differences():
    pois = lambda r, t: tempered_log_normalizer(npd.Poisson(r), t)  # noqa: E731
    binom = lambda p, t: tempered_log_normalizer(npd.Binomial(7, probs=p), t)  # noqa: E731
    for fn, x0 in ((pois, 4.0), (binom, 0.3)):
        value = fn  # eager: the series cores are jitted inside
        grad = jax.jit(jax.grad(fn, argnums=(0, 1)))
        for t0 in (0.5, 3.0):
            gx, gt = grad(x0, t0)
            fd_x = (value(x0 + 1e-5, t0) - value(x0 - 1e-5, t0)) / 2e-5
            fd_t = (value(x0, t0 + 1e-5) - value(x0, t0 - 1e-5)) / 2e-5
            assert_allclose((gx, gt), (fd_x, fd_t), rtol=1e-7)
    # vector-valued with batch and ladder, through jit
    ladder = jnp.array([[0.5], [4.0]])
    total = lambda r: pois(r, ladder).sum()  # noqa: E731
    rates = jnp.array([0.5, 3.0, 20.0])
    g = jax.jit(jax.grad(total))(rates)
    eye = jnp.eye(3) * 1e-5
    fd = [(total(rates + e) - total(rates - e)) / 2e-5 for e in eye]
    assert_allclose(g, fd, rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Sampling the non-named tempered laws
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: npd.Poisson(jnp.array([4.0, 0.7])),
        lambda: npd.Binomial(jnp.array([6, 2]), probs=jnp.array([0.8, 0.3])),
        lambda: npd.BetaBinomial(jnp.array([1.0, 2.0]), jnp.array([3.0, 0.5]), 6),
    ],
    ids=["poisson", "binomial", "enumerate"],
)
def test_sampling_frequencies_match_tempered_pmf(make):
    T, n = 2.5, 40000
    d = make()
    fallback = "enumerate" if isinstance(d, npd.BetaBinomial) else None
    td = tempered_distribution(d, T, fallback=fallback)
    samples = np.asarray(td.sample(jax.random.PRNGKey(1), (n,)))
    assert samples.shape == (n, 2)
    n_k = 40 if isinstance(d, npd.Poisson) else 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # k > n is out of the Binomial support
        pmf = np.exp(np.asarray(jax.jit(td.log_prob)(jnp.arange(n_k, dtype=float)[:, None])))
    for j in range(2):
        freq = np.bincount(samples[:, j], minlength=n_k) / n
        assert freq.shape == (n_k,)  # no sample beyond the support / truncation
        assert np.abs(freq - pmf[:, j]).max() < 0.012
        assert_allclose(pmf[:, j].sum(), 1.0, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Numerical fallbacks
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [0.5, 1.0, 3.0, 10.0])
def test_quadrature_fallback(T):
    with x64():
        logistic = float(tempered_log_normalizer(npd.Logistic(0.5, 2.0), T, fallback="quadrature"))
        half = float(tempered_log_normalizer(npd.HalfNormal(1.5), T, fallback="quadrature"))
        kum = float(tempered_log_normalizer(npd.Kumaraswamy(2.0, 3.0), T, fallback="quadrature"))
        laplace = float(tempered_log_normalizer(npd.Laplace(1.0, 0.5), T, fallback="quadrature"))
        # the rule itself on registered families vs their closed forms
        for d in (npd.Normal(3.0, 0.2), npd.Gamma(0.9, 4.0), npd.Beta(0.8, 3.0)):
            q = partition._quadrature_rule(d, jnp.asarray(T)).log_normalizer
            assert_allclose(q, tempered_log_normalizer(d, T), rtol=1e-8, atol=1e-8)
    ref = (1 - 1 / T) * math.log(2.0) + special.betaln(1 / T, 1 / T)
    assert_allclose(logistic, ref, rtol=1e-10, atol=1e-12)
    c = math.log(math.sqrt(2 / math.pi) / 1.5)
    assert_allclose(half, (1 / T - 1) * c + 0.5 * math.log(T), rtol=1e-10, atol=1e-12)
    ref = log_quad(lambda x: np.log(6.0 * x * (1 - x**2) ** 2) / T, 0, 1)
    assert_allclose(kum, ref, rtol=1e-8, atol=1e-9)
    assert_allclose(laplace, (1 - 1 / T) * math.log(1.0) + math.log(T), atol=1e-3)  # kink


def test_quadrature_fallback_tempered_law_and_limits():
    d = npd.SoftLaplace(jnp.zeros(3), 1.0)  # no closed form registered
    with x64():
        res = tempered(d, jnp.array([[0.5], [2.0]]), fallback="quadrature")
        assert res.log_normalizer.shape == (2, 3)
        x = jnp.array([0.1, -2.0, 4.0])
        assert_allclose(
            res.distribution.log_prob(x),
            d.log_prob(x) / jnp.array([[0.5], [2.0]]) - res.log_normalizer,
            rtol=1e-12,
        )
        with pytest.raises(NotImplementedError, match="sampling"):
            res.distribution.sample(jax.random.PRNGKey(0))
        with pytest.raises(NotImplementedError, match="univariate"):
            tempered_log_normalizer(
                npd.MultivariateStudentT(3.0, jnp.zeros(2), jnp.eye(2)), 2.0, fallback="quadrature"
            )
        with pytest.raises(NotImplementedError, match="has_enumerate_support"):
            tempered_log_normalizer(npd.SoftLaplace(0.0, 1.0), 2.0, fallback="enumerate")
        # Independent of an unregistered base passes the fallback through
        ind = tempered_log_normalizer(
            npd.SoftLaplace(jnp.zeros(2), 1.0).to_event(1), 2.0, fallback="quadrature"
        )
    # SoftLaplace: 1 / (pi cosh x), so int p^(1/2) = pi^(-1/2) B(1/4, 1/2)
    ref = -0.5 * math.log(math.pi) + special.betaln(0.25, 0.5)
    assert_allclose(ind, 2 * ref, rtol=1e-8)


def test_enumerate_fallback():
    Ts = jnp.array([[0.5], [2.0]])
    got = tempered_log_normalizer(npd.DiscreteUniform(0, 4).expand([3]), Ts, fallback="enumerate")
    assert got.shape == (2, 3)
    assert_allclose(got, jnp.broadcast_to((1 - 1 / Ts) * np.log(5.0), (2, 3)), rtol=1e-12)
    a, b, n = np.array([1.0, 2.0]), np.array([3.0, 0.5]), 6
    d = npd.BetaBinomial(jnp.asarray(a), jnp.asarray(b), n)
    res = tempered(d, Ts, fallback="enumerate")
    k = np.arange(n + 1)
    # numpyro's BetaBinomial log-pmf differs from scipy's by ~1e-6: temper numpyro's own
    log_pmf = np.asarray(jax.jit(d.log_prob)(jnp.asarray(k, float)[:, None]))  # (n + 1, 2)
    assert_allclose(log_pmf, stats.betabinom.logpmf(k[:, None], n, a, b), atol=1e-5)
    for i, T in enumerate(np.asarray(Ts)[:, 0]):
        ref = [brute_log_sum(log_pmf[:, j], T) for j in range(2)]
        assert_allclose(res.log_normalizer[i], ref, rtol=1e-12)
    lp = jax.jit(res.distribution.log_prob)(jnp.asarray(k, float)[:, None, None])  # (7, 2, 2)
    assert_allclose(jnp.exp(lp).sum(0), 1.0, rtol=1e-12)
    assert_allclose(lp[:, 0], log_pmf / 0.5 - res.log_normalizer[0], rtol=1e-12)


@pytest.mark.parametrize(
    "d, T",
    [(npd.Pareto(1.0, 1.0), 3.0), (npd.Pareto(1.0, 3.0), 10.0), (npd.Pareto(1.0, 1.0), 2.0)],
    ids=["pareto1-T3", "pareto3-T10", "pareto1-T2"],
)
def test_quadrature_fallback_refuses_divergent_integrals(d, T):
    # int p^(1/T) diverges (tails x^(-2/T) and x^(-4/T), as Cauchy's and a Student-t's, which
    # have closed forms now): the old rule returned finite numbers (25.1 for Cauchy at
    # T = 3); now an error (concrete) or NaN (traced)
    with x64():
        with pytest.raises(ValueError, match="failed its self-checks"):
            tempered_log_normalizer(d, T, fallback="quadrature")
        traced = jax.jit(lambda t: tempered_log_normalizer(d, t, fallback="quadrature"))(T)
        assert np.isnan(float(traced))
        ok = jax.jit(lambda t: tempered_log_normalizer(d, t, fallback="quadrature"))(1.5)
        if float(d.alpha) == 1.0:  # T = 1.5 converges: int_1^inf x^(-4/3) dx = 3
            assert_allclose(float(ok), math.log(3.0), rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Mixtures and the tempered sites of numpyro_tempering.handlers
# ------------------------------------------------------------------------------------------


def _mixture_quad(w, loc, scale, T):
    """log int (sum_k w_k N(x; loc_k, scale_k))^(1/T) dx by scipy, split at the modes."""
    w, loc, scale = (np.asarray(v, np.float64) for v in (w, loc, scale))

    def log_f(x):
        x = np.asarray(x)[..., None]
        return special.logsumexp(np.log(w) + stats.norm.logpdf(x, loc, scale), axis=-1) / T

    return log_quad(log_f, -np.inf, np.inf, points=sorted(set(loc.tolist())))


MIXTURES = [  # well separated, narrow and separated (the old fallback missed them), overlapping
    ([0.3, 0.7], [-5.0, 5.0], [1.0, 1.0]),
    ([0.2, 0.3, 0.5], [-40.0, 0.0, 40.0], [0.003, 0.003, 0.003]),
    ([0.2, 0.5, 0.3], [0.0, 0.1, 3.0], [1.0, 0.2, 2.0]),
]


@pytest.mark.parametrize("T", [0.7, 1.0, 10.0])
@pytest.mark.parametrize("mix", MIXTURES, ids=["separated", "narrow", "overlapping"])
def test_mixture_same_family_vs_scipy(mix, T):
    w, loc, scale = mix
    with x64():
        d = npd.MixtureSameFamily(npd.Categorical(jnp.array(w)), npd.Normal(jnp.array(loc),
                                                                              jnp.array(scale)))
        got = float(tempered_log_normalizer(d, T))
    assert_allclose(got, _mixture_quad(w, loc, scale, T), atol=1e-6)
    if T == 1.0:
        assert abs(got) < 1e-10  # C(1) = 1


def test_mixture_rule_batches_ladders_and_float32():
    w = jnp.array([0.3, 0.7])
    loc = jnp.array([[-1.0, 1.0], [0.0, 8.0], [3.0, 4.0]])
    d = npd.MixtureSameFamily(npd.Categorical(w), npd.Normal(loc, 0.5))
    T = jnp.array([[1.0], [2.5]])
    with x64():
        got = tempered(d, T)
    assert got.log_normalizer.shape == (2, 3)
    for i, t in enumerate([1.0, 2.5]):
        for j in range(3):
            ref = _mixture_quad(np.asarray(w), np.asarray(loc[j]), [0.5, 0.5], t)
            assert_allclose(got.log_normalizer[i, j], ref, atol=1e-6)
    x = jnp.array([0.2, 7.0, 3.5])
    assert_allclose(got.distribution.log_prob(x), d.log_prob(x) / T - got.log_normalizer,
                    rtol=1e-12)
    with jax.enable_x64(False):
        d32 = npd.MixtureSameFamily(npd.Categorical(w.astype(jnp.float32)),
                                    npd.Normal(loc.astype(jnp.float32), 0.5))
        got32 = tempered_log_normalizer(d32, jnp.float32(2.5))
        assert got32.dtype == jnp.float32
        assert_allclose(got32, got.log_normalizer[1], atol=1e-4)


def test_mixture_general_and_unresolvable_mixtures():
    with x64():
        g = npd.MixtureGeneral(npd.Categorical(jnp.array([0.3, 0.7])),
                               [npd.Normal(0.0, 1.0), npd.Logistic(4.0, 0.5)])

        def log_f(x):
            return np.logaddexp(np.log(0.3) + stats.norm.logpdf(x),
                                np.log(0.7) + stats.logistic.logpdf(x, 4.0, 0.5)) / 2.0

        ref = log_quad(log_f, -np.inf, np.inf, points=[0.0, 4.0])
        assert_allclose(tempered_log_normalizer(g, 2.0), ref, rtol=1e-8)
        # a spike 100x narrower on top of a broad component: the rule cannot resolve it and
        # says so (error when concrete, NaN when traced), never a wrong number
        spike = npd.MixtureSameFamily(npd.Categorical(jnp.array([0.5, 0.5])),
                                      npd.Normal(jnp.array([0.0, 0.1]), jnp.array([1.0, 0.01])))
        with pytest.raises(ValueError, match="mixture quadrature .* failed its self-checks"):
            tempered_log_normalizer(spike, 2.0)
        assert np.isnan(float(jax.jit(tempered_log_normalizer)(spike, 2.0)))
        with pytest.raises(NotImplementedError, match="discrete components"):
            tempered_log_normalizer(npd.MixtureSameFamily(
                npd.Categorical(jnp.array([0.5, 0.5])), npd.Poisson(jnp.array([1.0, 5.0]))), 2.0)


@pytest.mark.parametrize("loc", [0.0, 2.0])
def test_a_float32_two_normal_mixture_compiled_is_right(loc):
    """MixtureSameFamily(Categorical([.5, .5]), Normal([m, -m], 1.0)) at T = 1.5 in float32:
    the compiled rule gave NaN (the floored components' log-sum-exp came out -inf, and
    -inf + inf at the far nodes), so tempered_log_normalizer raised 'failed its
    self-checks' for every m, while eager code gave the right value (found by a probe)."""
    d = npd.MixtureSameFamily(npd.Categorical(jnp.array([0.5, 0.5])),
                              npd.Normal(jnp.array([loc, -loc]), 1.0))

    def log_f(x):
        return np.logaddexp(stats.norm.logpdf(x, loc), stats.norm.logpdf(x, -loc)) / 1.5 \
            + math.log(0.5) / 1.5

    ref = log_quad(log_f, -np.inf, np.inf, points=[-loc, loc] if loc else None)
    assert_allclose(float(tempered_log_normalizer(d, jnp.asarray(1.5))), ref, atol=2e-5)
    assert_allclose(float(jax.jit(tempered_log_normalizer)(d, jnp.asarray(1.5))), ref,
                    atol=2e-5)


@pytest.mark.parametrize("T", [1.5, 10.0])
def test_the_mixture_normaliser_has_the_gradient_of_finite_differences(T):
    """d log Z / d(locations, scales, weights) of the mixture rule, float64 and float32 (the
    gradient a Newton step or HMC in log_partition takes): it was NaN in every parameter at
    every temperature (the double-exponential rule's far nodes overflow the densities, and
    0 * NaN = NaN), so HMC on a model with a mixture likelihood accepted nothing (a
    two-component mixture's log C at N = 500, T = 10 came out 4-7 nats low, flagged only
    by the zero acceptance)."""

    def log_z(params, t):
        loc, log_scale, logits = params
        mix = npd.MixtureSameFamily(npd.Categorical(logits=logits),
                                    npd.Normal(loc, jnp.exp(log_scale)))
        general = npd.MixtureGeneral(npd.Categorical(logits=logits),
                                     [npd.Normal(loc[0], jnp.exp(log_scale[0])),
                                      npd.Logistic(loc[1], jnp.exp(log_scale[1]))])
        return tempered_log_normalizer(mix, t) + 0.5 * tempered_log_normalizer(general, t)

    # NumPyro's default, argument validation on (this module switches it off, and without
    # it the old rule's far nodes happened to give finite gradients)
    with x64(), validation_enabled(True):
        params = (jnp.array([0.0, 8.0]), jnp.array([0.0, -0.5]), jnp.array([0.3, -0.2]))
        flat, unravel = jax.flatten_util.ravel_pytree(params)
        eps = 1e-5
        fd = np.array([(log_z(unravel(flat + eps * e), T) - log_z(unravel(flat - eps * e), T))
                       / (2 * eps) for e in np.eye(flat.size)])
        grad = jax.flatten_util.ravel_pytree(jax.jit(jax.grad(log_z))(params, T))[0]
        assert_allclose(grad, fd, rtol=1e-5, atol=1e-7)
        assert np.all(np.abs(fd) > 1e-4)  # every parameter moves log Z: the test can fail
    with jax.enable_x64(False), validation_enabled(True):
        params32 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float32), params)
        grad32 = jax.flatten_util.ravel_pytree(jax.jit(jax.grad(log_z))(params32, T))[0]
    assert grad32.dtype == jnp.float32
    assert_allclose(grad32, fd, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("T", [0.7, 1.0, 3.0])
def test_jointly_tempered_mixture_is_sum_of_tempered_components(T):
    # int sum_k (w_k p_k(x))^(1/T) dx = sum_k w_k^(1/T) Z_k(T): closed form vs brute force
    from numpyro_tempering.handlers import JointlyTempered

    w, loc, scale = np.array([0.2, 0.8]), np.array([0.0, 0.5]), np.array([1.0, 0.3])
    with x64():
        mix = npd.MixtureSameFamily(npd.Categorical(jnp.asarray(w)),
                                    npd.Normal(jnp.asarray(loc), jnp.asarray(scale)))
        res = tempered(JointlyTempered(mix, 1.0), T)

        def log_f(x):
            return special.logsumexp((np.log(w) + stats.norm.logpdf(x, loc, scale)) / T)

        ref = log_quad(np.vectorize(log_f), -np.inf, np.inf, points=[0.0, 0.5])
        assert_allclose(res.log_normalizer, ref, rtol=1e-9, atol=1e-10)
        # the tempered law is normalised, matches log p / T - log Z, and samples
        x = jnp.linspace(-12.0, 12.0, 6001)
        lp = res.distribution.log_prob(x)
        assert_allclose(jnp.trapezoid(jnp.exp(lp), x), 1.0, rtol=1e-6)
        assert_allclose(lp, JointlyTempered(mix, 1.0 / T).log_prob(x) - res.log_normalizer,
                        rtol=1e-9, atol=1e-9)
        draws = res.distribution.sample(jax.random.PRNGKey(0), (4000,))
        mean = float(jnp.trapezoid(x * jnp.exp(lp), x))
        assert abs(float(draws.mean()) - mean) < 4 * float(draws.std()) / math.sqrt(4000)
        # a JointlyTempered already at 1/T0 = 2 tempered at T: the joint at T / 2
        res2 = tempered_log_normalizer(JointlyTempered(mix, 2.0), T)
        assert_allclose(res2, tempered_log_normalizer(JointlyTempered(mix, 1.0), T / 2.0),
                        rtol=1e-12)
        # MixtureGeneral components: the same closed form
        gen = npd.MixtureGeneral(npd.Categorical(jnp.asarray(w)),
                                 [npd.Normal(0.0, 1.0), npd.Normal(0.5, 0.3)])
        assert_allclose(tempered_log_normalizer(JointlyTempered(gen, 1.0), T),
                        res.log_normalizer, rtol=1e-12)


def test_tempered_site_wrapper_rescales_the_temperature():
    from numpyro_tempering.handlers import Tempered

    with x64():
        d = npd.Gamma(3.0, 2.0)
        assert_allclose(tempered_log_normalizer(Tempered(d, 0.5), 3.0),
                        tempered_log_normalizer(d, 6.0), rtol=1e-12)
        law = tempered_distribution(Tempered(d, 0.5), 3.0)
        assert float(law.concentration) == pytest.approx(1 + 2 / 6)


# ------------------------------------------------------------------------------------------
# Errors and the registry
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf, -np.inf, np.array([1.0, 0.0])])
def test_invalid_temperature_raises(bad):
    with pytest.raises(ValueError, match="temperature"):
        tempered_log_normalizer(npd.Normal(0.0, 1.0), bad)
    with pytest.raises(ValueError, match="temperature"):
        tempered_distribution(npd.Poisson(1.0), bad)


def test_invalid_temperature_type():
    with pytest.raises(ValueError, match="temperature"):
        tempered_log_normalizer(npd.Normal(0.0, 1.0), 1j)
    with pytest.raises(TypeError, match="temperature"):
        tempered_log_normalizer(npd.Normal(0.0, 1.0), npd.Normal(0.0, 1.0))
    assert_allclose(tempered_log_normalizer(npd.Normal(0.0, 1.0), 1), 0.0)  # ints are fine
    with pytest.raises(ValueError, match="temperature of shape"):
        tempered_log_normalizer(npd.Normal(jnp.zeros(3), 1.0), jnp.ones(4))


def test_unregistered_type_raises_with_names():
    with pytest.raises(NotImplementedError, match="SoftLaplace") as info:
        tempered_log_normalizer(npd.SoftLaplace(0.0, 1.0), 2.0)
    assert "Normal" in str(info.value) and "fallback" in str(info.value)
    with pytest.raises(NotImplementedError, match="Pareto"):
        tempered_distribution(npd.Pareto(1.0, 3.0).to_event(0).expand([2]), 2.0)
    with pytest.raises(ValueError, match="fallback"):
        tempered_log_normalizer(npd.SoftLaplace(0.0, 1.0), 2.0, fallback="magic")


@pytest.mark.parametrize(
    "d, T",
    [
        (npd.Gamma(0.5, 1.0), 0.4),
        (npd.Beta(2.0, 0.3), 0.5),
        (npd.Dirichlet(jnp.array([2.0, 0.2, 1.0])), 0.7),
    ],
    ids=["gamma", "beta", "dirichlet"],
)
def test_improper_tempered_law_raises(d, T):
    with pytest.raises(ValueError, match="improper"):
        tempered_log_normalizer(d, T)
    tempered_log_normalizer(d, 1.0)  # proper at T = 1


def test_register_custom_rule_and_subclass_dispatch():
    class Shifted(npd.Laplace):
        pass

    class ShiftedChild(Shifted):
        pass

    @register_tempered(Shifted)
    def _laplace_rule(d, t):
        log_z = jnp.log(t) + (1 - 1 / t) * jnp.log(2 * d.scale)
        return TemperedResult(log_z, npd.Laplace(d.loc, d.scale * t))

    assert Shifted in registered_types()
    with x64():
        got = tempered_log_normalizer(ShiftedChild(0.0, jnp.array([0.5, 2.0])), 3.0)
    assert_allclose(got, np.log(3.0) + (2 / 3) * np.log([1.0, 4.0]), rtol=1e-12)
    with pytest.raises(TypeError, match="Distribution subclass"):
        register_tempered(npd.Bernoulli)  # a factory function, not a class
    # Chi2 (a Gamma subclass) and OrderedLogistic (a CategoricalProbs subclass) dispatch
    with x64():
        assert_allclose(
            tempered_log_normalizer(npd.Chi2(4.0), 2.0),
            tempered_log_normalizer(npd.Gamma(2.0, 0.5), 2.0),
            rtol=1e-12,
        )
        ol = npd.OrderedLogistic(0.3, jnp.array([-1.0, 1.0]))
        assert_allclose(
            tempered_log_normalizer(ol, 2.0),
            tempered_log_normalizer(npd.Categorical(probs=ol.probs), 2.0),
            rtol=1e-12,
        )


def test_with_numpyro_validation():
    with validation_enabled(True):
        d = npd.Gamma(jnp.array([2.0, 3.0]), 1.5)
        assert d._validate_args
        res = tempered(d, jnp.array([[0.5], [4.0]]))
        assert res.distribution._validate_args  # sample validation follows the base
        assert_allclose(res.log_normalizer, tempered_log_normalizer(d, [[0.5], [4.0]]))
        with pytest.warns(UserWarning, match="Out-of-support"):
            res.distribution.log_prob(-1.0)
        td = tempered_distribution(npd.Poisson(2.0), 3.0)
        with pytest.warns(UserWarning, match="Out-of-support"):
            td.log_prob(-1.0)
        with pytest.raises(ValueError, match="improper"):
            tempered(npd.Gamma(0.5, 1.0), 0.25)


def test_module_doctests():
    result = doctest.testmod(partition, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_quadrature_fallback_gradients_stay_finite_at_large_scales():
    """Nodes far out overflowed float32 at large scales (x = inf) and their discarded
    log densities' derivatives made the gradient NaN (0 * nan); a location-scale family's
    log Z moves by exactly (1 - 1/T) per unit of log scale, with zero curvature."""
    f = lambda ls: tempered_log_normalizer(  # noqa: E731
        npd.SoftLaplace(0.3, jnp.exp(ls)), 2.0, fallback="quadrature")
    grad, curv = jax.jit(jax.grad(f)), jax.jit(jax.grad(jax.grad(f)))
    for log_scale in (0.0, 10.0, 22.5):
        assert float(grad(jnp.float32(log_scale))) == pytest.approx(0.5, abs=1e-5)
        assert abs(float(curv(jnp.float32(log_scale)))) < 1e-4


def test_float32_binomial_with_many_trials_keeps_its_accuracy():
    """The terms are Loader's saddle-point form of the pmf (special.binomial_log_pmf), not
    log binom(n, k) + k log p + (n - k) log q, whose terms of size n cancel: in float32 log Z
    of Binomial(1e5, 0.4) at T = 1 was 0.021 (exact: 0), and 1e-4 to 3.5e-3 per element at
    n = 2000-3000 (times N in a model); now within 1e-5 everywhere here."""
    for n, p in ((1e5, 0.4), (1e5, 1e-4), (3000.0, 0.3), (2000.0, 0.7)):
        k = np.arange(int(n) + 1)
        p32 = float(np.float32(p))  # the probability float32 can hold
        for T in (1.0, 1.5, 0.2):
            ref = special.logsumexp(stats.binom.logpmf(k, int(n), p32) / T)
            with jax.enable_x64(False):
                got = tempered_log_normalizer(npd.BinomialProbs(jnp.float32(p), jnp.float32(n)),
                                              jnp.float32(T))
            assert got.dtype == jnp.float32
            assert abs(float(got) - ref) < 1e-5 * max(1.0, abs(ref)), (n, p, T, float(got), ref)


def test_binomial_log_pmf_is_accurate_at_large_n():
    """special.binomial_log_pmf against 50-digit mpmath (float64: 1e-11 where scipy's own
    errs by 2e-9 at n = 1e6) and the edges (k = 0, n, outside 0..n, p = 0 and 1)."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 50
    from numpyro_tempering.special import binomial_log_pmf

    def exact(k, n, p):
        return float(mp.log(mp.binomial(n, k)) + k * mp.log(p) + (n - k) * mp.log(1 - p))

    for n, p in ((10**6, mp.mpf(2) / 5), (10**5, mp.mpf(1) / 10**4), (40, mp.mpf(1) / 3)):
        mode = int(n * p)
        for k in (mode - 3 * int(mp.sqrt(n * p)) - 1, mode, mode + 7, 1, n - 1):
            with x64():
                got = float(binomial_log_pmf(jnp.float64(k), jnp.float64(n),
                                             jnp.log(jnp.float64(p)), jnp.log1p(-jnp.float64(p))))
            ref = exact(k, n, p)
            assert abs(got - ref) < 1e-11 * max(1.0, abs(ref)), (n, k, got, ref)
    with x64():
        f = jax.jit(binomial_log_pmf)
        n = jnp.float64(5.0)
        out = np.asarray(f(jnp.array([0.0, 5.0, -1.0, 6.0, 2.0]), n, jnp.log(0.3), jnp.log(0.7)))
        np.testing.assert_allclose(out[:2], [5 * np.log(0.7), 5 * np.log(0.3)], rtol=1e-14)
        assert np.all(np.isneginf(out[2:4]))
        edge = np.asarray(f(jnp.array([0.0, 2.0, 5.0]), n, jnp.float64(-jnp.inf), 0.0))
        assert edge[0] == 0.0 and np.isneginf(edge[1]) and np.isneginf(edge[2])


def test_a_narrow_component_on_a_wide_one_errs_below_the_self_checks_tolerance():
    """The module docstring's measured limit of the mixture quadrature: a Normal of sd 0.03
    on one of sd 10 (equal weights, same place) at T = 2 passes the self-checks with an
    error between 1e-5 and 1e-3 nats (per element; it adds up over a plate). If this starts
    failing below 1e-5, the quadrature improved: update the docstring."""
    w, scales, T = np.array([0.5, 0.5]), np.array([0.03, 10.0]), 2.0

    def f(x):
        return math.exp(special.logsumexp(np.log(w) + stats.norm.logpdf(x, 0.0, scales)) / T)

    cuts = [-np.inf, -100.0, -1.0, -0.1, 0.0, 0.1, 1.0, 100.0, np.inf]
    ref = math.log(sum(integrate.quad(f, a, b, epsabs=0.0, epsrel=1e-12, limit=200)[0]
                       for a, b in zip(cuts[:-1], cuts[1:], strict=True)))
    d = npd.MixtureSameFamily(npd.Categorical(probs=jnp.asarray(w)),
                              npd.Normal(jnp.zeros(2), jnp.asarray(scales)))
    err = abs(float(tempered_log_normalizer(d, T)) - ref)
    assert 1e-5 < err < 1e-3, err
