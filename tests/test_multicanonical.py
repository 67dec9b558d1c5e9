"""MulticanonicalELBO (eq. 13, 18) and the multicanonical handler: exactness and hand checks."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro.handlers import seed, substitute, trace
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.util import log_density
from scipy.special import logsumexp as sp_logsumexp
from scipy.stats import norm

from numpyro_tempering import TemperedELBO, temper
from numpyro_tempering.engine import log_weights
from numpyro_tempering.ladder import Ladder
from numpyro_tempering.log_partition import model_sizes
from numpyro_tempering.multicanonical import multicanonical
from numpyro_tempering.objectives.multicanonical import (
    MulticanonicalELBO,
    multicanonical_elbo,
    record_temperatures,
    temperature_history,
)

SIGMA = 0.5
X = jnp.array([1.3, 0.4, 2.1, 1.7, 0.9, 1.1])
N = X.shape[0]
KEY = jax.random.PRNGKey(7)
PARAMS = {"loc": jnp.array(0.7), "scale": jnp.array(0.4)}
TEMPS = np.array([1.0, 2.0, 5.0])
WEIGHTS = np.array([0.5, 0.3, 0.2])


def model(x, subsample_size=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0], subsample_size=subsample_size) as idx:
        numpyro.sample("x", dist.Normal(mu, SIGMA), obs=x[idx])


def guide(x, subsample_size=None):
    loc = numpyro.param("loc", 0.0)
    scale = numpyro.param("scale", 1.0, constraint=dist.constraints.positive)
    numpyro.sample("mu", dist.Normal(loc, scale))


def normal_log_c(temps, n=N):  # exact: the Normal likelihood's tempered integral is free of mu
    a = 1.0 / np.asarray(temps)
    return n * (0.5 * (1 - a) * np.log(2 * np.pi * SIGMA**2) + 0.5 * np.log(temps))


SIZES = model_sizes(model, X)
LADDER = Ladder(TEMPS, WEIGHTS).with_log_partition_values(normal_log_c(TEMPS), sizes=SIZES)
T1_LADDER = Ladder([1.0]).with_log_partition_values([0.0], sizes=SIZES)


def loss(elbo, model_=model, key=KEY, **kwargs):
    """``elbo.loss`` at PARAMS, compiled (eager JAX compiles every primitive separately)."""
    return jax.jit(lambda k, p: elbo.loss(k, p, model_, guide, X, **kwargs))(key, PARAMS)


def posterior_fn(elbo):
    return jax.jit(lambda k, p: elbo.temperature_posterior(k, p, model, guide, X))


@jax.jit
def _guide_draw(key):
    _, guide_seed = jax.random.split(key)
    return trace(seed(substitute(guide, PARAMS), guide_seed)).get_trace(X)["mu"]["value"]


def guide_draw(key):
    """The mu the engine / Trace_ELBO draw for one particle with ``key`` (float64)."""
    return float(_guide_draw(key))


# Hand computations in NumPy / SciPy (float64), independent of the package.
def log_prior_minus_log_q(mu):
    return norm.logpdf(mu, 0.0, 2.0) - norm.logpdf(mu, float(PARAMS["loc"]), float(PARAMS["scale"]))


def softmax(a):
    return np.exp(a - sp_logsumexp(a, axis=-1, keepdims=True))


def by_hand(mu, log_c, plate, idx=None):
    """log p(mu) - log q(mu) + sum_m r_m (l/T_m - log C_m + log pi_m - log r_m), r at eq. 18."""
    lik = norm.logpdf(np.asarray(X, np.float64), mu, SIGMA)
    log_pi = np.log(WEIGHTS)
    idx = np.arange(N) if idx is None else np.asarray(idx)
    scale = N / idx.size
    if plate is None:
        a = log_pi + scale * lik[idx].sum() / TEMPS - log_c
    else:
        a = log_pi + lik[idx][:, None] / TEMPS - log_c / N
    r = softmax(a)
    per_element = 1.0 if plate is None else scale  # a global l is already scaled by N/B
    return log_prior_minus_log_q(mu) + per_element * np.sum(r * (a - np.log(r))), r


# ---------------------------------------------------------------------------------------
# T = 1 only: exactly Trace_ELBO.
@pytest.mark.parametrize("plate", [None, "data"])
@pytest.mark.parametrize("num_particles", [1, 3])
def test_T1_ladder_equals_trace_elbo(plate, num_particles):
    def value_and_grad(elbo):
        return jax.jit(jax.value_and_grad(lambda p: elbo.loss(KEY, p, model, guide, X)))(PARAMS)

    ref, ref_grad = value_and_grad(Trace_ELBO(num_particles=num_particles))
    out, grad = value_and_grad(
        MulticanonicalELBO(T1_LADDER, plate=plate, num_particles=num_particles)
    )
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    for k in PARAMS:
        np.testing.assert_allclose(grad[k], ref_grad[k], rtol=1e-6)


# ---------------------------------------------------------------------------------------
# The M-ELBO and q(y) by hand.
@pytest.mark.parametrize("plate", [None, "data"])
def test_m_elbo_and_q_y_by_hand(plate):
    elbo = MulticanonicalELBO(LADDER, plate=plate)
    expected, r = by_hand(guide_draw(KEY), normal_log_c(TEMPS), plate)
    np.testing.assert_allclose(-loss(elbo), expected, rtol=1e-6)
    post = posterior_fn(elbo)(KEY, PARAMS)
    np.testing.assert_allclose(post.probs, r, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(post.mean_temperature, (r * TEMPS).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(post.mean_inverse_temperature, (r / TEMPS).sum(-1), rtol=1e-5)


def test_gradient_is_the_tempered_elbo_at_the_effective_temperature():
    # eq. 15-17: 1/T_eff = E_q[1/T_y], q(y) held fixed
    elbo = MulticanonicalELBO(LADDER, num_particles=4)
    beta = posterior_fn(elbo)(KEY, PARAMS).mean_inverse_temperature
    grad = jax.jit(jax.grad(lambda p: elbo.loss(KEY, p, model, guide, X)))(PARAMS)
    tempered = TemperedELBO(1.0 / beta, num_particles=4)
    ref = jax.jit(jax.grad(lambda p: tempered.loss(KEY, p, model, guide, X)))(PARAMS)
    assert 0.2 < float(beta) < 0.99  # a genuine mixture of temperatures
    for k in PARAMS:
        np.testing.assert_allclose(grad[k], ref[k], rtol=1e-5)


def test_closed_form_q_y_is_the_argmax_of_the_m_elbo():
    weights = jax.jit(
        lambda k: log_weights(k, PARAMS, temper(model, 1.0), guide, (X,), num_particles=4)
    )(KEY)
    ell = float(weights.log_lik.mean())
    # log C values chosen to put the optimum well inside the simplex
    log_c = ell * (1.0 / TEMPS - 1.0) + np.array([0.0, 0.3, -0.2])
    ladder = Ladder(TEMPS, WEIGHTS).with_log_partition_values(log_c)
    value = jax.jit(lambda r: multicanonical_elbo(weights, ladder, probs=r)[0])
    best, post = multicanonical_elbo(weights, ladder)
    r_star = np.asarray(post.probs)
    assert r_star.min() > 0.1

    # brute force 1: a grid over the simplex (step 0.005)
    g = np.arange(1, 200) / 200.0
    r1, r2 = np.meshgrid(g, g, indexing="ij")
    ok = r1 + r2 < 1
    grid = np.stack([r1[ok], r2[ok], 1 - r1[ok] - r2[ok]], -1)
    values = np.asarray(jax.vmap(value)(jnp.asarray(grid)))
    assert values.max() <= float(best) + 1e-5
    np.testing.assert_allclose(grid[values.argmax()], r_star, atol=0.0051)

    # brute force 2: gradient ascent on softmax logits
    opt = optax.adam(0.05)

    def step(carry, _):
        logits, state = carry
        g = jax.grad(lambda z: -value(jax.nn.softmax(z)))(logits)
        updates, state = opt.update(g, state)
        return (optax.apply_updates(logits, updates), state), None

    logits0 = jnp.zeros(3)
    (logits, _), _ = jax.lax.scan(step, (logits0, opt.init(logits0)), None, length=3000)
    np.testing.assert_allclose(jax.nn.softmax(logits), r_star, atol=2e-3)


# ---------------------------------------------------------------------------------------
# Subsampling.
def test_subsampling_with_full_batch_is_exact():
    elbo = MulticanonicalELBO(LADDER, plate="data", num_particles=2)
    full = loss(elbo)
    sub = loss(elbo, subsample_size=N)
    np.testing.assert_allclose(sub, full, rtol=1e-6)


@pytest.mark.parametrize("plate", [None, "data"])
def test_subsampled_minibatch_scale_accounting(plate):
    b = 2
    elbo = MulticanonicalELBO(LADDER, plate=plate)
    out = -loss(elbo, subsample_size=b)
    mu = guide_draw(KEY)

    @jax.jit
    def indices(key):  # the subsample the engine draws: replayed mu, then the plate's key
        model_seed, _ = jax.random.split(key)
        tr = trace(substitute(seed(model, model_seed), {"mu": mu})).get_trace(X, b)
        return tr["data"]["value"]

    idx = indices(KEY)
    assert idx.shape == (b,)
    expected, _ = by_hand(mu, normal_log_c(TEMPS), plate, idx=idx)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# The handler: exact marginalisation over the ladder.
@pytest.mark.parametrize("plate", [None, "data"])
def test_handler_log_density_by_hand(plate):
    mc = multicanonical(model, LADDER, plate=plate)
    mu = 0.4
    lp, probs_out = jax.jit(
        lambda m: (
            log_density(mc, (X,), {}, {"mu": m})[0],
            mc.temperature_posterior({"mu": m}, X),
        )
    )(mu)
    lik = norm.logpdf(np.asarray(X, np.float64), mu, SIGMA)
    log_c = normal_log_c(TEMPS)
    if plate is None:
        a = np.log(WEIGHTS) + lik.sum() / TEMPS - log_c
    else:
        a = np.log(WEIGHTS) + lik[:, None] / TEMPS - log_c / N
    expected = norm.logpdf(mu, 0.0, 2.0) + sp_logsumexp(a, axis=-1).sum()
    np.testing.assert_allclose(lp, expected, rtol=1e-6)
    np.testing.assert_allclose(probs_out, softmax(a), rtol=1e-5)


def test_trace_elbo_on_handler_by_hand():
    mc = multicanonical(model, LADDER)
    out = -loss(Trace_ELBO(), mc)
    mu = guide_draw(KEY)
    lik = norm.logpdf(np.asarray(X, np.float64), mu, SIGMA).sum()
    marg = sp_logsumexp(np.log(WEIGHTS) + lik / TEMPS - normal_log_c(TEMPS))
    np.testing.assert_allclose(out, log_prior_minus_log_q(mu) + marg, rtol=1e-6)


@pytest.mark.parametrize("plate", [None, "data"])
def test_m_elbo_is_below_the_marginalised_elbo(plate):
    # L_M(r*) <= Trace_ELBO(multicanonical model), particle by particle (Jensen), same draws
    kw = dict(num_particles=8)
    m_elbo = -loss(MulticanonicalELBO(LADDER, plate=plate, **kw))
    marg = -loss(Trace_ELBO(**kw), multicanonical(model, LADDER, plate=plate))
    assert float(m_elbo) < float(marg) - 1e-4
    if plate is None:  # equality for a single temperature
        one = -loss(MulticanonicalELBO(T1_LADDER, **kw))
        one_marg = -loss(Trace_ELBO(**kw), multicanonical(model, T1_LADDER))
        np.testing.assert_allclose(one, one_marg, rtol=1e-6)


def test_handler_hides_absorbed_sites_from_the_engine():
    mc = multicanonical(model, LADDER)
    flags = {}

    def site_flags():
        flags.update(trace(seed(mc, 0)).get_trace(X)["x"]["infer"])

    jax.eval_shape(site_flags)
    assert flags["multicanonical"]
    lw = jax.jit(lambda k: log_weights(k, PARAMS, mc, guide, (X,)))(KEY)
    np.testing.assert_allclose(lw.log_lik, 0.0)  # the absorbed sites' own densities are 0
    mu = guide_draw(KEY)
    lik = norm.logpdf(np.asarray(X, np.float64), mu, SIGMA).sum()
    marg = sp_logsumexp(np.log(WEIGHTS) + lik / TEMPS - normal_log_c(TEMPS))
    np.testing.assert_allclose(lw.log_w, log_prior_minus_log_q(mu) + marg, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# The learnt temperature trajectory.
def test_recorded_trajectory_matches_re_evaluation():
    steps = 6
    elbo = MulticanonicalELBO(LADDER)
    svi = SVI(record_temperatures(model, LADDER, steps), guide, optax.adam(0.1), elbo)
    state = svi.init(jax.random.PRNGKey(1), X)
    update = jax.jit(svi.update)
    posterior = posterior_fn(elbo)
    saved, keys = [], []
    for _ in range(steps):
        saved.append(svi.get_params(state))
        keys.append(jax.random.split(state.rng_key)[1])  # the key SVI.update uses
        state, _ = update(state, X)
    hist = temperature_history(state)
    assert hist.probs.shape == (steps, 3)
    for t in range(steps):
        post = posterior(keys[t], saved[t])
        np.testing.assert_allclose(hist.probs[t], post.probs, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(hist.mean_temperature[t], post.mean_temperature, rtol=1e-5)
    traj = jax.jit(lambda k, ps: elbo.temperature_trajectory(k, ps, model, guide, X))(
        keys[0], saved
    )
    np.testing.assert_allclose(traj.probs[0], hist.probs[0], rtol=1e-5)
    assert traj.probs.shape == (steps, 3)
    # svi.run records the same way
    result = svi.run(jax.random.PRNGKey(1), steps, X, progress_bar=False)
    np.testing.assert_allclose(temperature_history(result).probs, hist.probs, rtol=1e-4)


def test_record_of_local_temperatures_is_the_minibatch_average():
    elbo = MulticanonicalELBO(LADDER, plate="data")
    svi = SVI(record_temperatures(model, LADDER, 3), guide, optax.adam(0.1), elbo)
    state = svi.init(jax.random.PRNGKey(2), X)
    key, params = jax.random.split(state.rng_key)[1], svi.get_params(state)
    state, _ = jax.jit(svi.update)(state, X)
    post = posterior_fn(elbo)(key, params)
    hist = temperature_history(state)
    assert hist.probs.shape == (1, 3)
    np.testing.assert_allclose(hist.probs[0], post.probs.mean(0), rtol=1e-5)
    with pytest.raises(ValueError, match="record_temperatures"):
        temperature_history({})


# ---------------------------------------------------------------------------------------
# Bad input.
def test_errors():
    with pytest.raises(ValueError, match="has no log C"):
        MulticanonicalELBO(Ladder([1.0, 2.0]))
    with pytest.raises(ValueError, match="has no log C"):
        multicanonical(model, Ladder([1.0, 2.0]))
    with pytest.raises(TypeError, match="must be a Ladder"):
        MulticanonicalELBO([1.0, 2.0])
    other = jnp.zeros(N + 1)
    with pytest.raises(ValueError, match=r"different model size: plate 'data': model has 7"):
        MulticanonicalELBO(LADDER).loss(KEY, PARAMS, model, guide, other)
    with pytest.raises(ValueError, match=r"different model size: plate 'data': model has 7"):
        log_density(multicanonical(model, LADDER), (other,), {}, {"mu": 0.0})
    with pytest.raises(ValueError, match=r"tempered site 'mu'"):
        MulticanonicalELBO(LADDER, latent="mu").loss(KEY, PARAMS, model, guide, X)
    with pytest.raises(ValueError, match=r"plate 'docs' is not in the model; its plates are"):
        MulticanonicalELBO(LADDER, plate="docs").loss(KEY, PARAMS, model, guide, X)
    with pytest.raises(ValueError, match=r"plate 'docs' is not in the model; its plates are"):
        log_density(multicanonical(model, LADDER, plate="docs"), (X,), {}, {"mu": 0.0})
    with pytest.raises(ValueError, match="no sample site named"):
        MulticanonicalELBO(LADDER, sites="typo").loss(KEY, PARAMS, model, guide, X)
    with pytest.raises(ValueError, match="positive integer"):
        record_temperatures(model, LADDER, 0)


# ---------------------------------------------------------------------------------------
# A tempered latent (latent="z") under the handler: Trace_ELBO replays the guide's z into the
# model (replacing the site's infer dict); the factor must still include log p(z | mu).
def latent_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    z = numpyro.sample("z", dist.Normal(mu, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(z, SIGMA), obs=x)


def latent_guide(x):
    numpyro.sample("mu", dist.Normal(0.3, 0.5))
    numpyro.sample("z", dist.Normal(1.1, 0.2))


def test_handler_with_a_tempered_latent_under_trace_elbo():
    log_c = np.array([0.0, 0.4, 1.3])
    ladder = Ladder(TEMPS, WEIGHTS).with_log_partition_values(log_c)
    mc = multicanonical(latent_model, ladder, latent="z")
    out = -jax.jit(lambda k: Trace_ELBO().loss(k, {}, mc, latent_guide, X))(KEY)

    @jax.jit
    def draws(key):
        _, guide_seed = jax.random.split(key)
        tr = trace(seed(latent_guide, guide_seed)).get_trace(X)
        return tr["mu"]["value"], tr["z"]["value"]

    mu, z = (float(v) for v in draws(KEY))
    ell = norm.logpdf(z, mu, 1.0) + norm.logpdf(np.asarray(X, np.float64), z, SIGMA).sum()
    expected = (
        norm.logpdf(mu, 0.0, 2.0)
        + sp_logsumexp(np.log(WEIGHTS) + ell / TEMPS - log_c)
        - norm.logpdf(mu, 0.3, 0.5)
        - norm.logpdf(z, 1.1, 0.2)
    )
    np.testing.assert_allclose(out, expected, rtol=1e-6)
