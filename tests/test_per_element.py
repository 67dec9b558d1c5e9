"""Per-element multicanonical temperatures with elements that differ: each its own log c_n(T).

y_n ~ Normal(mu, sigma_n) with different sigma_n. The tempered normaliser of element n is
free of mu, log c_n(T) = (1 - 1/T)/2 log(2 pi sigma_n^2) + 1/2 log T, so log C = sum_n log c_n
exactly, while the old even split log C / N gave every element the average. Checked for
log_partition, the Ladder, MulticanonicalELBO and the multicanonical handler, with and
without subsampling, against hand computations in NumPy/SciPy.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.util import log_density
from scipy.special import logsumexp
from scipy.stats import norm

from numpyro_tempering.ladder import Ladder
from numpyro_tempering.multicanonical_model import multicanonical
from numpyro_tempering.objectives.multicanonical import MulticanonicalELBO
from numpyro_tempering.partition_function import log_partition, model_sizes

SIGMA = np.array([0.05, 0.3, 1.0, 2.5, 6.0, 0.5])
X = jnp.array([0.3, -0.2, 1.4, 2.2, -3.0, 0.9])
N = X.shape[0]
TEMPS = np.array([1.0, 2.0, 6.0])
WEIGHTS = np.array([0.4, 0.35, 0.25])
KEY = jax.random.PRNGKey(11)
PARAMS = {"loc": jnp.array(0.4), "scale": jnp.array(0.3)}


def model(x, subsample_size=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0], subsample_size=subsample_size) as idx:
        numpyro.sample("x", dist.Normal(mu, jnp.asarray(SIGMA)[idx]), obs=x[idx])


def guide(x, subsample_size=None):
    loc = numpyro.param("loc", 0.0)
    scale = numpyro.param("scale", 1.0, constraint=dist.constraints.positive)
    numpyro.sample("mu", dist.Normal(loc, scale))


def exact_element_log_c(temps=TEMPS):  # (M, N)
    t = np.asarray(temps)[:, None]
    return 0.5 * (1 - 1 / t) * np.log(2 * np.pi * SIGMA**2) + 0.5 * np.log(t)


SIZES = model_sizes(model, X)
LADDER = Ladder(TEMPS, WEIGHTS).with_log_partition_values(
    element_log_c=exact_element_log_c(), plate="data", sizes=SIZES
)


def by_hand(mu, idx, element_log_c):
    """log p(mu) - log q(mu) + (N/B) sum_{n in idx} sum_m r_nm (a_nm - log r_nm), eq. 13/18."""
    lik = norm.logpdf(np.asarray(X, np.float64)[idx], mu, SIGMA[idx])
    a = np.log(WEIGHTS) + lik[:, None] / TEMPS - element_log_c.T[idx]
    r = np.exp(a - logsumexp(a, axis=-1, keepdims=True))
    prior_q = norm.logpdf(mu, 0.0, 2.0) - norm.logpdf(mu, float(PARAMS["loc"]),
                                                      float(PARAMS["scale"]))
    return prior_q + N / len(idx) * np.sum(r * (a - np.log(r))), r


@partial(jax.jit, static_argnums=1)
def _draws(key, b):
    """The mu and subsample indices the engine draws with ``key`` (one particle)."""
    model_seed, guide_seed = jax.random.split(key)
    mu = trace(seed(substitute(guide, PARAMS), guide_seed)).get_trace(X)["mu"]["value"]
    tr = trace(substitute(seed(model, model_seed), {"mu": mu})).get_trace(X, b)
    return mu, tr["data"]["value"]


def test_log_partition_gives_each_element_its_own_normaliser():
    est = log_partition(KEY, model, TEMPS, X, num_samples=4, plate="data")
    np.testing.assert_allclose(est.element_log_c, exact_element_log_c(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(est.log_c, exact_element_log_c().sum(1), rtol=1e-5, atol=1e-5)
    ladder = Ladder(TEMPS, WEIGHTS).with_log_partition(model, KEY, X, num_samples=4,
                                                        plate="data")
    np.testing.assert_allclose(ladder.element_log_c, LADDER.element_log_c, atol=1e-5)
    # the even split is far from it: the elements really differ
    even = np.repeat(exact_element_log_c().sum(1, keepdims=True) / N, N, axis=1)
    assert np.max(np.abs(even - exact_element_log_c())) > 1.0
    # a subsampled run only sees B elements: no per-element values
    with pytest.warns(UserWarning, match="cannot be trusted"):  # random subsamples
        sub = log_partition(KEY, model, TEMPS, X, num_samples=4, plate="data",
                            subsample_size=3)
    assert sub.element_log_c is None and sub.plate is None


@pytest.mark.parametrize("subsample_size", [None, 3])
def test_objective_uses_each_elements_log_c(subsample_size):
    elbo = MulticanonicalELBO(LADDER, plate="data")
    kwargs = {} if subsample_size is None else {"subsample_size": subsample_size}
    value, probs = jax.jit(
        lambda k: (
            -elbo.loss(k, PARAMS, model, guide, X, **kwargs),
            elbo.temperature_posterior(k, PARAMS, model, guide, X, **kwargs).probs,
        )
    )(KEY)
    mu, idx = _draws(KEY, subsample_size)
    idx = np.arange(N) if subsample_size is None else np.asarray(idx)
    expected, r = by_hand(float(mu), idx, exact_element_log_c())
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    np.testing.assert_allclose(probs, r, rtol=1e-5, atol=1e-7)
    # the old even split gives a different value: the test can fail
    even = np.repeat(exact_element_log_c().sum(1, keepdims=True) / N, N, axis=1)
    wrong, r_wrong = by_hand(float(mu), idx, even)
    assert abs(wrong - expected) > 1e-3 and np.max(np.abs(r_wrong - r)) > 0.05


@pytest.mark.parametrize("subsample_size", [None, 3])
def test_handler_uses_each_elements_log_c(subsample_size):
    mc = multicanonical(model, LADDER, plate="data")
    mu = 0.7

    @jax.jit
    def run(key):
        lp, tr = log_density(seed(mc, key), (X,), {"subsample_size": subsample_size},
                             {"mu": mu})
        return lp, tr["data"]["value"], tr["_multicanonical_probs"]["value"]

    lp, idx, probs = run(KEY)
    idx = np.asarray(idx)
    assert idx.shape == (N if subsample_size is None else subsample_size,)
    lik = norm.logpdf(np.asarray(X, np.float64)[idx], mu, SIGMA[idx])
    a = np.log(WEIGHTS) + lik[:, None] / TEMPS - exact_element_log_c().T[idx]
    expected = norm.logpdf(mu, 0.0, 2.0) + N / idx.size * logsumexp(a, axis=-1).sum()
    np.testing.assert_allclose(lp, expected, rtol=1e-6)
    np.testing.assert_allclose(probs, np.exp(a - logsumexp(a, axis=-1, keepdims=True)),
                               rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------
# When c_n depends on the globals there is no exact split: the documented one is
# log E_s[c_n(s)] + delta / N with delta = log C - sum_n log E_s[c_n(s)]. Scale s ~
# LogNormal(m, v) times a known m_n: c_n(s) = A_n s^k, k = 1 - 1/T, so (exactly)
# log E[c_n] = A_n + k m + k^2 v^2 / 2 and delta = k^2 v^2 (N^2 - N) / 2.
M_LOG, V_LOG, MULT = 0.1, 0.2, np.array([0.5, 1.0, 3.0, 1.5])


def scale_model(x):
    s = numpyro.sample("s", dist.LogNormal(M_LOG, V_LOG))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(0.0, s * jnp.asarray(MULT)), obs=x)


def test_split_when_the_normaliser_depends_on_the_globals():
    n = MULT.size
    est = log_partition(KEY, scale_model, TEMPS, jnp.zeros(n), num_samples=4000, plate="data",
                       method="prior")
    t = TEMPS[:, None]
    k = 1 - 1 / t
    a_n = 0.5 * k * np.log(2 * np.pi * MULT**2) + 0.5 * np.log(t)
    split = a_n + k * M_LOG + 0.5 * (k * V_LOG) ** 2 + 0.5 * (k * V_LOG) ** 2 * (n**2 - n) / n
    np.testing.assert_allclose(np.asarray(est.element_log_c).sum(1), est.log_c, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(est.element_log_c, split, atol=0.02)
    # differences between elements are exact (same draws): A_n - A_0
    diff = np.asarray(est.element_log_c) - np.asarray(est.element_log_c)[:, :1]
    np.testing.assert_allclose(diff, a_n - a_n[:, :1], atol=1e-5)


# ---------------------------------------------------------------------------------------
# The fused eq. 18 (one pass of exponentials) and the M-ELBO's y-terms at the optimum
# (log Z - E_r[l_m], no second (B, M) pass) are the explicit formulas up to rounding.
def _weights(key, s, b):
    from numpyro_tempering.engine import LogWeights

    k1, k2, k3 = jax.random.split(key, 3)
    elements = -jnp.abs(jax.random.normal(k1, (s, b))) * jnp.linspace(1.0, 400.0, b)
    return LogWeights(
        log_prior=jax.random.normal(k2, (s,)),
        log_lik=elements.sum(-1),
        log_q=jax.random.normal(k3, (s,)),
        log_lik_elements=elements,
        plate_scale=jnp.asarray(1.0),
        plate_indices=jnp.arange(b),
    )


def test_fused_posterior_matches_logsumexp_and_keeps_non_finite_as_nan():
    from numpyro_tempering.temperatures import posterior_from_arrays

    rng = np.random.default_rng(0)
    temps = np.geomspace(1.0, 10.0, 7)
    with np.errstate(divide="ignore"):  # a zero-weight rung gets r = 0 exactly
        log_pi = np.log(np.r_[0.0, np.full(6, 1 / 6)])
    ell = rng.normal(size=(5, 1)) * np.array([[1.0], [30.0], [1e3], [1e4], [0.1]]) / temps
    log_c = rng.normal(size=(5, 7))
    post = posterior_from_arrays(jnp.asarray(ell), jnp.asarray(log_pi), jnp.asarray(1 / temps),
                                 jnp.asarray(log_c))
    a = log_pi + ell - log_c
    r = np.exp(a - logsumexp(a, axis=-1, keepdims=True))
    np.testing.assert_allclose(post.probs, r, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(post.log_marginal, logsumexp(a, axis=-1), rtol=1e-6)
    np.testing.assert_allclose(post.mean_temperature, r @ temps, rtol=1e-5)
    np.testing.assert_allclose(post.mean_inverse_temperature, r @ (1 / temps), rtol=1e-5)
    assert np.all(np.asarray(post.probs)[:, 0] == 0.0)
    # non-finite: NaN probabilities, never a chosen rung; all rungs impossible: log Z = -inf
    bad = jnp.array([[jnp.nan] + [0.0] * 6, [-jnp.inf] * 7, [jnp.inf] + [0.0] * 6])
    post = posterior_from_arrays(bad, jnp.zeros(7), jnp.asarray(1 / temps), jnp.zeros(7))
    assert np.all(np.isnan(np.asarray(post.probs)[:2])) and np.isnan(post.probs[2, 0])
    assert np.isnan(post.log_marginal[0]) and post.log_marginal[1] == -np.inf
    assert np.all(np.isnan(np.asarray(post.mean_inverse_temperature)))
    with pytest.raises(ValueError, match="`inverse_temperatures` must be the ladder's"):
        posterior_from_arrays(bad, jnp.zeros(7), jnp.ones((3, 7)), jnp.zeros(7))


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("joint", [False, True])
def test_bound_at_the_optimum_equals_the_explicit_eq_13(local, joint):
    from numpyro_tempering.objectives.multicanonical import multicanonical_elbo

    s, b = 3, N
    weights = _weights(KEY, s, b)
    ladder = LADDER
    by_temperature = None
    if joint:  # some l_m that is not l / T_m
        lik = weights.log_lik_elements if local else weights.log_lik
        by_temperature = lik[..., None] / jnp.asarray(TEMPS) ** 1.3
    plate_size = b if local else None
    value, post = multicanonical_elbo(weights, ladder, plate_size,
                                      log_lik_by_temperature=by_temperature)
    explicit, _ = multicanonical_elbo(weights, ladder, plate_size, post.probs,
                                      log_lik_by_temperature=by_temperature)
    np.testing.assert_allclose(value, explicit, rtol=2e-6)
    # and both are the hand-written eq. 13 at eq. 18's r
    lik = np.asarray(weights.log_lik_elements if local else weights.log_lik, np.float64)
    ell_m = (np.asarray(by_temperature, np.float64) if joint
             else lik[..., None] / TEMPS)  # (S, [B,] M)
    log_c = exact_element_log_c().T if local else exact_element_log_c().sum(1)
    a = np.log(WEIGHTS) + ell_m.mean(0) - log_c
    r = np.exp(a - logsumexp(a, axis=-1, keepdims=True))
    np.testing.assert_allclose(post.probs, r, rtol=1e-5, atol=1e-7)
    with np.errstate(divide="ignore", invalid="ignore"):  # r = 0 (underflow): 0 log 0 = 0
        y_terms = np.sum(np.where(r > 0, r * (np.log(WEIGHTS) - log_c - np.log(r)), 0.0))
    hand = np.mean(np.asarray(weights.log_prior - weights.log_q, np.float64)
                   + np.sum(r * ell_m, axis=-1).reshape(s, -1).sum(-1)) + y_terms
    np.testing.assert_allclose(value, hand, rtol=2e-6)
    # the gradient flows through l only: d value / d l_n = E_r[1/T] (linear case)
    if not joint:
        grad = jax.grad(lambda e: multicanonical_elbo(
            weights._replace(log_lik_elements=e, log_lik=e.sum(-1)), ladder, plate_size)[0])(
                weights.log_lik_elements)
        inv = (r @ (1 / TEMPS)) if local else np.full(b, r @ (1 / TEMPS))
        np.testing.assert_allclose(grad, np.broadcast_to(inv / s, (s, b)), rtol=1e-5)
