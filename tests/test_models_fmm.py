"""Tests of the factorial mixture model: data, exact collapsing, joint tempering, C(T)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.scipy.special import logsumexp
from numpyro.handlers import seed
from numpyro.infer.util import log_density
from scipy import integrate

from numpyro_tempering import temper
from numpyro_tempering.models import fmm


def _all_z(num_data: int, num_components: int) -> np.ndarray:
    """Every binary (N, K) matrix, shape (2^(N K), N, K)."""
    flat = np.array(list(itertools.product((0.0, 1.0), repeat=num_data * num_components)))
    return flat.reshape(-1, num_data, num_components)


def _tiny_problem(seed: int = 0, num_data: int = 2, num_components: int = 3, dim: int = 2):
    rng = np.random.default_rng(seed)
    mu = rng.normal(0.0, 0.6, (num_components, dim))
    x = rng.normal(0.5, 0.8, (num_data, dim))
    pi = rng.uniform(0.1, 0.9, num_components)
    return x, mu, pi


def _brute_force_log_marginal(model, x, mu, pi, sigma_n, z_configs):
    """log sum_Z exp(log_density(model, mu, Z)) with Z over all binary matrices."""

    def one(z):
        lp, _ = log_density(
            model,
            (x,),
            dict(num_components=mu.shape[0], pi=pi, sigma_n=sigma_n),
            {"mu": mu, "z": z},
        )
        return lp

    return logsumexp(jax.vmap(one)(jnp.asarray(z_configs)))


# -- data -----------------------------------------------------------------------------------
def test_toy_components_are_distinct_binary_images():
    b = fmm.toy_components()
    assert b.shape == (8, 16) and set(np.unique(b)) == {0.0, 1.0}
    assert np.linalg.matrix_rank(b) == 8
    assert len(fmm.COMPONENT_NAMES) == 8
    # any two different on/off configurations differ in at least 4 pixels
    configs = np.array(list(itertools.product((0, 1), repeat=8)))
    sums = configs @ b
    dist = ((sums[:, None] - sums[None]) ** 2).sum(-1)
    np.fill_diagonal(dist, np.inf)
    assert dist.min() >= 4


def test_make_toy_data_shapes_and_statistics():
    n = 4000
    data = fmm.make_toy_data(jax.random.PRNGKey(3), n, pi=0.3, sigma_n=0.1)
    assert data.x.shape == (n, 16) and data.z.shape == (n, 8) and data.mu.shape == (8, 16)
    w = np.asarray(data.weights)
    assert np.all((w >= 0.5) & (w <= 1.0))
    np.testing.assert_allclose(data.mu, w[:, None] * fmm.toy_components(), rtol=1e-6)
    # z ~ Bern(0.3): the mean of 32,000 switches is within 5 standard errors
    assert abs(float(data.z.mean()) - 0.3) < 5 * np.sqrt(0.21 / data.z.size)
    resid = np.asarray(data.x - data.z @ data.mu)
    assert abs(resid.mean()) < 5 * 0.1 / np.sqrt(resid.size)
    # sample variance of 64,000 N(0, 0.01) values: relative sd sqrt(2 / 64000) ~ 0.0056
    assert abs(resid.var() / 0.01 - 1) < 0.03


def test_make_toy_data_rejects_bad_input():
    with pytest.raises(ValueError, match="num_data"):
        fmm.make_toy_data(jax.random.PRNGKey(0), 0)
    with pytest.raises(ValueError, match="pi"):
        fmm.make_toy_data(jax.random.PRNGKey(0), 10, pi=1.5)
    with pytest.raises(ValueError, match="sigma_n"):
        fmm.make_toy_data(jax.random.PRNGKey(0), 10, sigma_n=0.0)


# -- the collapsed likelihood ---------------------------------------------------------------
def test_collapsed_model_equals_enumerated_explicit_model():
    with jax.enable_x64(True):
        x, mu, pi = _tiny_problem()
        sigma_n = 0.4
        brute = _brute_force_log_marginal(fmm.model, x, mu, pi, sigma_n, _all_z(2, 3))
        collapsed, _ = log_density(
            fmm.collapsed_model,
            (x,),
            dict(num_components=3, pi=pi, sigma_n=sigma_n),
            {"mu": mu},
        )
        np.testing.assert_allclose(collapsed, brute, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(x=st.floats(-3, 3), mu=st.floats(-2, 2), pi=st.floats(0.01, 0.99), sigma=st.floats(0.1, 3))
def test_single_component_is_a_two_gaussian_mixture(x, mu, pi, sigma):
    with jax.enable_x64(True):
        lp = fmm.FactorialMixture(jnp.array([[mu]]), pi, sigma).log_prob(jnp.array([x]))
        gauss = lambda m: -0.5 * ((x - m) / sigma) ** 2 - np.log(sigma * np.sqrt(2 * np.pi))
        expected = np.logaddexp(np.log1p(-pi) + gauss(0.0), np.log(pi) + gauss(mu))
        np.testing.assert_allclose(lp, expected, rtol=1e-10, atol=1e-10)


def test_factorial_mixture_float32_matches_float64():
    x, mu, pi = _tiny_problem(seed=1, num_data=50, num_components=4, dim=5)
    with jax.enable_x64(True):
        ref = np.asarray(fmm.FactorialMixture(jnp.asarray(mu), pi, 0.3).log_prob(jnp.asarray(x)))
    lp32 = fmm.FactorialMixture(jnp.asarray(mu, jnp.float32), pi, 0.3).log_prob(
        jnp.asarray(x, jnp.float32)
    )
    assert lp32.dtype == jnp.float32
    np.testing.assert_allclose(lp32, ref, rtol=1e-5, atol=1e-4)


def test_factorial_mixture_sample_moments_and_batching():
    _, mu, pi = _tiny_problem(seed=2, num_components=3, dim=2)
    d = fmm.FactorialMixture(jnp.asarray(mu, jnp.float32), pi, 0.2)
    draws = np.asarray(d.sample(jax.random.PRNGKey(0), (20000,)))
    assert draws.shape == (20000, 2)
    # covariance of sum_k z_k mu_k + eps is sum_k pi_k (1 - pi_k) mu_k mu_k^T + sigma^2 I
    cov = (mu.T * (pi * (1 - pi))) @ mu + 0.04 * np.eye(2)
    np.testing.assert_allclose(
        draws.mean(0), d.mean, atol=5 * np.sqrt(cov.diagonal().max() / 20000)
    )
    np.testing.assert_allclose(np.cov(draws.T), cov, atol=0.03 * np.abs(cov).max())
    # a batch of feature matrices broadcasts against the data
    batched = fmm.FactorialMixture(jnp.stack([mu, 2 * mu]).astype(jnp.float32), pi, 0.2)
    assert batched.batch_shape == (2,)
    lp = batched.log_prob(jnp.zeros((5, 1, 2)))
    assert lp.shape == (5, 2)
    np.testing.assert_allclose(
        lp[:, 1], fmm.FactorialMixture(2 * mu, pi, 0.2).log_prob(jnp.zeros(2)), rtol=1e-6
    )


def test_factorial_mixture_rejects_bad_input():
    with pytest.raises(ValueError, match="mu"):
        fmm.FactorialMixture(jnp.ones(3))
    with pytest.raises(ValueError, match="pi"):
        fmm.FactorialMixture(jnp.ones((3, 2)), jnp.array([0.2, 0.3]))
    with pytest.raises(ValueError, match="2\\^K"):
        fmm.FactorialMixture(jnp.ones((17, 2)))
    with pytest.raises(ValueError, match="x"):
        log_density(fmm.collapsed_model, (jnp.ones(5),), {}, {"mu": jnp.ones((8, 5))})


def test_collapsed_model_subsampling_scales_the_likelihood():
    data = fmm.make_toy_data(jax.random.PRNGKey(0), 40)
    prior = fmm.dist.Normal(0.0, 0.35).log_prob(data.mu).sum()
    full, _ = log_density(fmm.collapsed_model, (data.x,), {}, {"mu": data.mu})
    sub, trace = log_density(
        seed(fmm.collapsed_model, 0), (data.x,), {"subsample_size": 10}, {"mu": data.mu}
    )
    idx = trace["data"]["value"]
    lik = fmm.FactorialMixture(data.mu).log_prob(data.x[idx]).sum()
    np.testing.assert_allclose(sub, prior + 4.0 * lik, rtol=1e-5)
    np.testing.assert_allclose(
        full, prior + fmm.FactorialMixture(data.mu).log_prob(data.x).sum(), rtol=1e-5
    )


# -- joint tempering ------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 2.7, 10.0])
def test_jointly_tempered_log_lik_is_the_enumerated_tempered_explicit_model(temperature):
    with jax.enable_x64(True):
        x, mu, pi = _tiny_problem(seed=4)
        sigma_n = 0.5
        tempered = temper(fmm.model, temperature, latent="z")
        brute = _brute_force_log_marginal(tempered, x, mu, pi, sigma_n, _all_z(2, 3))
        log_prior = fmm.dist.Normal(0.0, 0.35).log_prob(mu).sum()
        per_datum = fmm.jointly_tempered_log_lik(x, mu, temperature, pi, sigma_n)
        assert per_datum.shape == (2,)
        np.testing.assert_allclose(per_datum.sum(), brute - log_prior, rtol=1e-12)
        # the collapsed model with temperature=T has the same density
        lp, _ = log_density(
            fmm.collapsed_model,
            (x,),
            dict(num_components=3, pi=pi, sigma_n=sigma_n, temperature=temperature),
            {"mu": mu},
        )
        np.testing.assert_allclose(lp, brute, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(temperature=st.floats(0.3, 30.0), seed=st.integers(0, 1000))
def test_joint_tempering_identity(temperature, seed):
    """sum_z p(x, z | mu)^(1/T) = C_1(T) * FMM(x; mu, pi_T, sigma_n sqrt(T))."""
    with jax.enable_x64(True):
        x, mu, pi = _tiny_problem(seed=seed, num_data=5, num_components=3, dim=2)
        sigma_n = 0.3
        lhs = fmm.jointly_tempered_log_lik(x, mu, temperature, pi, sigma_n)
        pi_t, sigma_t = fmm.jointly_tempered_params(temperature, pi, sigma_n)
        rhs = fmm.log_partition(temperature, 1, 2, pi, sigma_n) + fmm.FactorialMixture(
            mu, pi_t, sigma_t
        ).log_prob(x)
        np.testing.assert_allclose(lhs, rhs, rtol=1e-10, atol=1e-10)


def test_jointly_tempered_log_lik_accepts_per_datum_and_traced_temperatures():
    x, mu, pi = _tiny_problem(seed=5, num_data=3)
    temps = jnp.array([1.0, 2.0, 5.0])
    per_datum = fmm.jointly_tempered_log_lik(x, mu, temps, pi, 0.3)
    one_by_one = [fmm.jointly_tempered_log_lik(x[i], mu, t, pi, 0.3) for i, t in enumerate(temps)]
    np.testing.assert_allclose(per_datum, one_by_one, rtol=1e-6)
    jitted = jax.jit(lambda t: fmm.jointly_tempered_log_lik(x, mu, t, pi, 0.3))
    np.testing.assert_allclose(
        jitted(2.0), fmm.jointly_tempered_log_lik(x, mu, 2.0, pi, 0.3), rtol=1e-6
    )


# -- the tempered partition function --------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 1.7, 4.0, 10.0])
def test_log_partition_matches_integration_in_one_dimension(temperature):
    """C(T) = sum_z int dx p(x, z | mu)^(1/T), D = 1, K = 2, by quadrature, for two mu."""
    with jax.enable_x64(True):
        pi, sigma_n = np.array([0.3, 0.8]), 0.25
        integrand = jax.jit(
            lambda x, mu: jnp.exp(
                fmm.jointly_tempered_log_lik(jnp.reshape(x, (1,)), mu, temperature, pi, sigma_n)
            )
        )
        expected = float(fmm.log_partition(temperature, 1, 1, pi, sigma_n))
        for mu in (np.array([[0.7], [-1.2]]), np.array([[3.0], [0.1]])):
            value, _ = integrate.quad(
                lambda x, m=mu: float(integrand(x, m)),
                -np.inf,
                np.inf,
                epsabs=1e-13,
                epsrel=1e-11,
                limit=200,
            )
            np.testing.assert_allclose(np.log(value), expected, rtol=1e-8, atol=1e-9)
        # N data points: C(T)^N
        np.testing.assert_allclose(
            fmm.log_partition(temperature, 7, 1, pi, sigma_n), 7 * expected, rtol=1e-12
        )


def test_log_partition_matches_grid_integration_in_two_dimensions():
    with jax.enable_x64(True):
        temperature, pi, sigma_n = 3.0, 0.3, 0.2
        mu = np.array([[0.5, -0.3], [0.1, 0.9]])
        grid = np.linspace(-4.0, 4.0, 801)
        xx = np.stack(np.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)
        dens = np.exp(np.asarray(fmm.jointly_tempered_log_lik(xx, mu, temperature, pi, sigma_n)))
        value = integrate.trapezoid(integrate.trapezoid(dens.reshape(801, 801), grid), grid)
        expected = fmm.log_partition(temperature, 1, 2, pi, sigma_n, num_components=2)
        np.testing.assert_allclose(np.log(value), expected, rtol=1e-6)


def test_paper_partition_function_tempers_only_the_exponent():
    """normalised=False is the paper's eq.: int sum_z w_z^(1/T) (2 pi s^2)^(-1/2) e^(-r^2/2s^2T)."""
    with jax.enable_x64(True):
        temperature, pi, sigma_n = 4.0, np.array([0.3, 0.6]), 0.1
        mu = np.array([[0.4], [-0.2]])
        log_joint = jax.jit(
            lambda x: fmm.FactorialMixture(mu, pi, sigma_n).config_log_joint(jnp.reshape(x, (1,)))
        )
        log_norm = -0.5 * np.log(2 * np.pi * sigma_n**2)

        def integrand(x):
            # exponent tempered, Gaussian normaliser kept at power one
            return float(jnp.exp(logsumexp((log_joint(x) - log_norm) / temperature + log_norm)))

        # the integrand is below 1e-40 outside [-8, 8]
        value, _ = integrate.quad(
            integrand,
            -8.0,
            8.0,
            epsabs=1e-13,
            epsrel=1e-11,
            points=[-0.2, 0.0, 0.2, 0.4],
            limit=200,
        )
        paper = fmm.log_partition(temperature, 1, 1, pi, sigma_n, normalised=False)
        np.testing.assert_allclose(np.log(value), paper, rtol=1e-8)
        # the paper's closed form, literally: (N D / 2) log T + N sum_k log(pi^(1/T)+(1-pi)^(1/T))
        closed = 0.5 * np.log(temperature) + np.sum(
            np.log(pi ** (1 / temperature) + (1 - pi) ** (1 / temperature))
        )
        np.testing.assert_allclose(paper, closed, rtol=1e-12)
        normalised = fmm.log_partition(temperature, 1, 1, pi, sigma_n)
        np.testing.assert_allclose(
            normalised - paper,
            0.5 * (1 - 1 / temperature) * np.log(2 * np.pi * sigma_n**2),
            rtol=1e-12,
        )


def test_log_partition_is_zero_at_t1_and_vectorises_over_temperatures():
    temps = jnp.array([1.0, 2.0, 8.0])
    out = fmm.log_partition(temps, 100, 16)
    assert out.shape == (3,)
    assert float(out[0]) == pytest.approx(0.0, abs=1e-4)
    np.testing.assert_allclose(
        out[1:], [fmm.log_partition(t, 100, 16) for t in (2.0, 8.0)], rtol=1e-6
    )
    with pytest.raises(ValueError, match="num_components"):
        fmm.log_partition(2.0, 1, 1, jnp.array([0.3, 0.4]), num_components=3)


# -- component matching ---------------------------------------------------------------------
def test_match_components_recovers_a_permutation():
    truth = fmm.make_toy_data(jax.random.PRNGKey(0), 1).mu
    perm = np.array([3, 7, 0, 5, 1, 6, 2, 4])
    noisy = np.asarray(truth)[perm] + 0.01 * np.random.default_rng(0).normal(size=(8, 16))
    found = fmm.match_components(noisy, truth)
    np.testing.assert_allclose(noisy[found], np.asarray(truth), atol=0.05)
    assert sorted(found.tolist()) == list(range(8))
    assert fmm.component_error(np.asarray(truth)[perm], truth) == 0.0
    assert fmm.component_error(noisy, truth) == pytest.approx(0.01, rel=0.2)
    with pytest.raises(ValueError, match="same shape"):
        fmm.match_components(noisy[:7], truth)


@pytest.mark.parametrize("T", [1.0, 2.5, 10.0])
def test_temper_joint_equals_the_jointly_tempered_collapsed_model(T):
    data = fmm.make_toy_data(jax.random.PRNGKey(3), 20)
    params = {"mu": data.mu}
    via_handler = log_density(temper(fmm.collapsed_model, T, joint=True), (data.x,), {}, params)
    by_hand = log_density(fmm.collapsed_model, (data.x,), {"temperature": T}, params)
    np.testing.assert_allclose(via_handler[0], by_hand[0], rtol=2e-5)


def test_multicanonical_model_at_beta_one_is_the_collapsed_likelihood():
    # E_q[log p(x, z)] + H[q] = log sum_z p(x, z) when q(z) is proportional to p(x, z)
    data = fmm.make_toy_data(jax.random.PRNGKey(4), 15)
    params = {"mu": data.mu}
    mvi = log_density(fmm.multicanonical_model, (data.x, 1.0), {}, params)[0]
    collapsed = log_density(fmm.collapsed_model, (data.x,), {}, params)[0]
    np.testing.assert_allclose(mvi, collapsed, rtol=1e-5)
    # any other q(z) gives a lower bound (Jensen); a near-uniform q(z) a much lower one
    hotter = log_density(fmm.multicanonical_model, (data.x, 0.3), {}, params)[0]
    assert float(hotter) <= float(collapsed) + 1e-4
    flat = log_density(fmm.multicanonical_model, (data.x, 0.01), {}, params)[0]
    assert float(flat) < float(collapsed) - 1.0
