"""MulticanonicalELBO (eq. 13, 18) and the multicanonical handler: exactness and hand checks."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from conjugate import S_MIX, W_MIX, joint_mixture_log_c, mixture_model, normal_log_z
from numpyro.diagnostics import effective_sample_size
from numpyro.handlers import condition, seed, substitute, trace
from numpyro.infer import MCMC, NUTS, SVI, Predictive, Trace_ELBO
from numpyro.infer.util import log_density
from scipy.special import gammaln
from scipy.special import logsumexp as sp_logsumexp
from scipy.stats import norm

from numpyro_tempering import TemperedELBO, temper
from numpyro_tempering.engine import log_weights
from numpyro_tempering.handlers import Selection
from numpyro_tempering.ladder import UNCHECKED, Ladder
from numpyro_tempering.multicanonical_model import multicanonical
from numpyro_tempering.objectives.multicanonical import (
    MulticanonicalELBO,
    multicanonical_elbo,
    record_temperatures,
    temperature_history,
)
from numpyro_tempering.partition_function import model_sizes
from numpyro_tempering.temperatures import mean_inverse_temperature, temperature_posterior

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
    return n * normal_log_z(temps, SIGMA)


def per_element(log_c_one, n=N):  # identical elements: each has the per-datum log c
    return np.repeat(np.asarray(log_c_one)[:, None], n, axis=1)


SIZES = model_sizes(model, X)
LADDER = Ladder(TEMPS, WEIGHTS).with_log_partition_values(
    sizes=SIZES, element_log_c=per_element(normal_log_c(TEMPS, 1)), plate="data"
)
T1_LADDER = Ladder([1.0]).with_log_partition_values(
    sizes=SIZES, element_log_c=per_element([0.0]), plate="data"
)


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
    tempered = TemperedELBO(temperature=1.0 / beta, num_particles=4)
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


def _point_mass_guide(x, subsample_size=None):
    numpyro.sample("mu", dist.Delta(jnp.array(0.7)))


def _minibatch_losses(plate, num_particles, num_keys=1000):
    """-loss of the point-mass guide at mu = 0.7 over ``num_keys`` keys (one minibatch of 2
    of the N = 6 elements per key), and the exact full-data M-ELBO (no Monte Carlo noise in
    the guide: the only randomness is the minibatch)."""
    elbo = MulticanonicalELBO(LADDER, plate=plate, num_particles=num_particles)
    keys = jax.random.split(KEY, num_keys)
    out = jax.jit(jax.vmap(lambda k: -elbo.loss(k, {}, model, _point_mass_guide, X, 2)))(keys)
    lik = norm.logpdf(np.asarray(X, np.float64), 0.7, SIGMA)
    log_c = per_element(normal_log_c(TEMPS, 1))  # (M, N)
    a = np.log(WEIGHTS)[:, None] + lik[None] / TEMPS[:, None] - log_c
    local = sp_logsumexp(a, axis=0).sum()
    glob = sp_logsumexp(np.log(WEIGHTS) + lik.sum() / TEMPS - log_c.sum(1))
    exact = norm.logpdf(0.7, 0.0, 2.0) + (glob if plate is None else local)
    return np.asarray(out, np.float64), exact


def test_local_temperatures_with_several_particles_share_one_minibatch():
    """Each particle drew its own minibatch (as under Trace_ELBO) while the objective
    averaged the per-element terms over particles column by column and picked log c_n by
    the first particle's indices: with 4 particles the minibatch M-ELBO was biased (a probe:
    1.1 nats low, 30 standard errors, at N = 8, B = 2, S = 16). Now every particle sees the
    same minibatch, and the local M-ELBO on minibatches is unbiased for the full-data one
    (it is a sum over elements)."""
    out, exact = _minibatch_losses("data", 4)
    se = out.std() / np.sqrt(out.size)
    assert abs(out.mean() - exact) < 4 * se, (out.mean(), exact, se)


def test_a_global_temperature_on_minibatches_is_biased_upward():
    """The claim in objectives/multicanonical.py: with a global temperature, q(y) (eq. 18)
    and the M-ELBO are a log-sum-exp of the minibatch's noisy l, so their expectation lies
    above the full-data M-ELBO (Jensen), by less with more particles."""
    one, exact = _minibatch_losses(None, 1)
    many, _ = _minibatch_losses(None, 16)
    bias_one, bias_many = one.mean() - exact, many.mean() - exact
    se_one, se_many = one.std() / np.sqrt(one.size), many.std() / np.sqrt(many.size)
    assert bias_one > 4 * se_one, (bias_one, se_one)  # 0.89 +- 0.09 nats
    assert bias_many < bias_one / 4, (bias_many, se_many)  # 0.06 +- 0.02


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


def test_record_with_several_particles_is_written_without_a_warning():
    # the record is per step, not per particle: no "mutable state is currently ignored"
    elbo = MulticanonicalELBO(LADDER, num_particles=3)
    svi = SVI(record_temperatures(model, LADDER, 2), guide, optax.adam(0.1), elbo)
    state = svi.init(jax.random.PRNGKey(4), X)
    key, params = jax.random.split(state.rng_key)[1], svi.get_params(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, _ = jax.jit(svi.update)(state, X)
    hist = temperature_history(state)
    assert hist.probs.shape == (1, 3)
    np.testing.assert_allclose(hist.probs[0], posterior_fn(elbo)(key, params).probs, rtol=1e-5)


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


def test_record_under_any_name_and_two_records():
    """record_temperatures(name=...) is honoured (the objective finds records by type, not
    by a fixed key); two records are both written; E[1/T] is one call; the repr is short."""
    elbo = MulticanonicalELBO(LADDER)
    wrapped = record_temperatures(record_temperatures(model, LADDER, 4, name="a"), LADDER, 2,
                                  name="b")
    svi = SVI(wrapped, guide, optax.adam(0.1), elbo)
    state = svi.init(jax.random.PRNGKey(3), X)
    key, params = jax.random.split(state.rng_key)[1], svi.get_params(state)
    state, _ = jax.jit(svi.update)(state, X)
    post = posterior_fn(elbo)(key, params)
    for name in ("a", "b"):
        hist = temperature_history(state, name=name)
        assert hist.probs.shape == (1, 3)
        np.testing.assert_allclose(hist.probs[0], post.probs, rtol=1e-5)
        np.testing.assert_allclose(
            mean_inverse_temperature(state, name=name), post.mean_inverse_temperature, rtol=1e-5
        )
    with pytest.raises(ValueError, match=r"expected one TemperatureRecord.*\['a', 'b'\]"):
        temperature_history(state)
    with pytest.raises(ValueError, match="no TemperatureRecord 'c'"):
        temperature_history(state, name="c")
    text = repr(state.mutable_state["a"])
    assert text.startswith("TemperatureRecord(step=1, rows=4, temperatures=3, E[T] = ")
    assert "\n" not in text and len(text) < 120


def test_temperature_posterior_is_eq18():
    """The one eq. 18 core: softmax(log pi + l_m - log C_m), its moments and log marginal,
    against numpy; per-element log c broadcasts; a NaN likelihood gives NaN, not a rung."""
    ell = np.array([[-4.0, -2.5, -1.0], [0.0, 0.3, -0.2]])
    logits = np.log(WEIGHTS) + ell - normal_log_c(TEMPS)
    probs = np.exp(logits - sp_logsumexp(logits, axis=-1, keepdims=True))
    post = temperature_posterior(jnp.asarray(ell), LADDER)
    np.testing.assert_allclose(post.probs, probs, rtol=1e-5)
    np.testing.assert_allclose(post.mean_temperature, probs @ TEMPS, rtol=1e-5)
    np.testing.assert_allclose(post.mean_inverse_temperature, probs @ (1 / TEMPS), rtol=1e-5)
    np.testing.assert_allclose(post.log_marginal, sp_logsumexp(logits, axis=-1), rtol=1e-5)
    own = np.array([[0.0, 1.0, 2.0], [0.0, -1.0, 0.5]])
    mine = temperature_posterior(jnp.asarray(ell), LADDER, log_c=jnp.asarray(own))
    logits = np.log(WEIGHTS) + ell - own
    np.testing.assert_allclose(mine.log_marginal, sp_logsumexp(logits, axis=-1), rtol=1e-5)
    bad = temperature_posterior(jnp.array([jnp.nan, 0.0, 0.0]), LADDER)
    assert np.all(np.isnan(np.asarray(bad.probs)))
    with pytest.raises(ValueError, match="must end in the ladder's 3 temperatures"):
        temperature_posterior(jnp.zeros(2), LADDER)


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
    with pytest.raises(ValueError, match=r"per-element log c_n are for plate 'data', not 'docs'"):
        MulticanonicalELBO(LADDER, plate="docs")
    docs = Ladder(TEMPS, WEIGHTS).with_log_partition_values(
        sizes=UNCHECKED, element_log_c=per_element(normal_log_c(TEMPS, 1)), plate="docs"
    )
    with pytest.raises(ValueError, match=r"plate 'docs' is not in the model; its plates are"):
        MulticanonicalELBO(docs, plate="docs").loss(KEY, PARAMS, model, guide, X)
    with pytest.raises(ValueError, match=r"plate 'docs' is not in the model; its plates are"):
        log_density(multicanonical(model, docs, plate="docs"), (X,), {}, {"mu": 0.0})
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
    ladder = Ladder(TEMPS, WEIGHTS).with_log_partition_values(
        log_c, sizes=model_sizes(latent_model, X, latent="z")
    )
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


# ---------------------------------------------------------------------------------------
# What the objective and the handler refuse or warn about.
def test_a_ladder_without_sizes_is_refused_unless_unchecked():
    bare = Ladder(TEMPS, WEIGHTS).with_log_partition_values(normal_log_c(TEMPS))
    with pytest.raises(ValueError, match="does not record the model sizes"):
        MulticanonicalELBO(bare).loss(KEY, PARAMS, model, guide, X)
    with pytest.raises(ValueError, match="does not record the model sizes"):
        log_density(multicanonical(model, bare), (X,), {}, {"mu": 0.0})
    unchecked = Ladder(TEMPS, WEIGHTS).with_log_partition_values(
        normal_log_c(TEMPS), sizes=UNCHECKED
    )
    np.testing.assert_allclose(
        loss(MulticanonicalELBO(unchecked)), loss(MulticanonicalELBO(LADDER)), rtol=1e-6
    )


def test_a_flagged_ladder_is_warned_about():
    def scale_model(x):
        s = numpyro.sample("s", dist.LogNormal(0.2, 0.3))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(0.0, s), obs=x)

    with pytest.warns(UserWarning, match="cannot be trusted"):
        flagged = Ladder([1.0, 10.0]).with_log_partition(
            scale_model, KEY, jnp.zeros(200), method="prior"
        )
    with pytest.warns(UserWarning, match=r"MulticanonicalELBO: .* untrusted at T = \[10.0\]"):
        MulticanonicalELBO(flagged)
    with pytest.warns(UserWarning, match=r"multicanonical: .* untrusted at T = \[10.0\]"):
        multicanonical(scale_model, flagged)


def test_model_params_are_refused():
    def param_model(x):
        s = numpyro.param("s", 0.5, constraint=dist.constraints.positive)
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(mu, s), obs=x)

    with pytest.raises(ValueError, match=r"numpyro.param site\(s\) \['s'\]"):
        MulticanonicalELBO(LADDER).loss(KEY, PARAMS, param_model, guide, X)
    with pytest.raises(ValueError, match=r"numpyro.param site\(s\) \['s'\]"):
        log_density(multicanonical(param_model, LADDER), (X,), {}, {"mu": 0.0})


def test_a_model_with_nothing_tempered_is_refused_by_the_objective():
    """With `obs=` forgotten the objective fitted q(y) = the ladder's prior, silently."""
    def forgot_obs(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(mu, SIGMA))

    with pytest.raises(ValueError, match="MulticanonicalELBO: no site of the model is tempered"):
        MulticanonicalELBO(LADDER).loss(KEY, PARAMS, forgot_obs, guide, X)


def test_predictive_without_data_adds_nothing():
    samples = {"mu": jnp.array([0.1, 0.5, -0.3])}
    draws = Predictive(multicanonical(model, LADDER), samples)(KEY, X * jnp.nan)
    assert "_multicanonical_probs" in draws  # with data: the temperature posterior

    def optional(x=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        with numpyro.plate("data", N):
            numpyro.sample("x", dist.Normal(mu, SIGMA), obs=x)

    draws = Predictive(multicanonical(optional, LADDER), samples)(KEY, None)
    assert draws["x"].shape == (3, N) and "_multicanonical_probs" not in draws
    ladder = Ladder(TEMPS, WEIGHTS).with_log_partition_values(
        [0.0, 0.4, 1.3], sizes=model_sizes(latent_model, X, latent="z")
    )

    def optional_latent(x=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
        with numpyro.plate("data", N):
            numpyro.sample("x", dist.Normal(z, SIGMA), obs=x)

    with pytest.warns(UserWarning, match=r"no tempered site is observed .* \['z'\]"):
        draws = Predictive(multicanonical(optional_latent, ladder, latent="z"), samples)(
            KEY, None
        )
    assert draws["x"].shape == (3, N)


# ---------------------------------------------------------------------------------------
# NUTS on the multicanonical model with a constrained latent (a Gamma precision: MCMC adds a
# Jacobian factor for it, which must keep its density). Conjugate: per temperature T the
# tempered joint is Gamma(tau; a + N/(2T), b + S/(2T)) times a closed-form evidence E_T, and
# log C(T) = N/2 log T + k log(2 pi b) + lgamma(a - k) - lgamma(a), k = N (1 - 1/T) / 2. The
# exact posterior is the mixture of the two Gamma posteriors with weights
# w_m ~ pi_m E_{T_m} / C(T_m), which is also E[p(y = m | tau, x)] under the posterior.
A_TAU, B_TAU = 4.0, 2.0
Y_TAU = 0.5 * np.array([1.9, -2.4, 0.8, 3.1, -1.5, 2.6])


def precision_model(y):
    tau = numpyro.sample("tau", dist.Gamma(A_TAU, B_TAU))
    with numpyro.plate("data", Y_TAU.size):
        numpyro.sample("y", dist.Normal(0.0, 1.0 / jnp.sqrt(tau)), obs=y)


def test_nuts_samples_the_exact_multicanonical_posterior():
    temps, n, s = np.array([1.0, 4.0]), Y_TAU.size, float(np.sum(Y_TAU**2))
    k = n * (1 - 1 / temps) / 2
    log_c = 0.5 * n * np.log(temps) + k * np.log(2 * np.pi * B_TAU) + gammaln(A_TAU - k)
    log_c -= gammaln(A_TAU)
    a_t, b_t = A_TAU + n / (2 * temps), B_TAU + s / (2 * temps)
    log_ev = A_TAU * np.log(B_TAU) - gammaln(A_TAU) - n / (2 * temps) * np.log(2 * np.pi)
    log_ev += gammaln(a_t) - a_t * np.log(b_t)
    w = softmax(np.log(0.5) + log_ev - log_c)
    mean = float(w @ (a_t / b_t))
    sd = float(np.sqrt(w @ (a_t / b_t**2 + (a_t / b_t) ** 2) - mean**2))
    assert 0.3 < w[0] < 0.8  # both temperatures matter
    ladder = Ladder(temps).with_log_partition_values(
        log_c, sizes=model_sizes(precision_model, jnp.asarray(Y_TAU))
    )
    mcmc = MCMC(NUTS(multicanonical(precision_model, ladder)), num_warmup=200,
                num_samples=400, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), jnp.asarray(Y_TAU))
    tau = np.asarray(mcmc.get_samples()["tau"])
    probs = np.asarray(mcmc.get_samples()["_multicanonical_probs"])[:, 0]
    # within 4 Monte Carlo standard errors (sd / sqrt(ESS)), which are small enough to
    # tell this posterior from its components (e.g. T = 1 alone: E[p(y = 1 | tau, x)] = 1)
    se_tau = sd / np.sqrt(effective_sample_size(tau[None]))
    se_w = probs.std() / np.sqrt(effective_sample_size(probs[None]))
    assert abs(tau.mean() - mean) < 4 * se_tau < 0.3
    assert abs(probs.mean() - w[0]) < 4 * se_w < 0.08
    assert abs(a_t[0] / b_t[0] - mean) > 0.1


# ---------------------------------------------------------------------------------------
# Joint tempering of a summed-out local (joint=True): l_m = sum_n log sum_k
# (w_k N(x_n; loc_k, s_k))^(1/T_m), no longer l / T_m. Objective and handler by hand.
def mixture_guide(x):
    numpyro.sample("loc", dist.Normal(jnp.array([-1.0, 1.5]), 0.3).to_event(1))


def joint_lik(loc):  # (N, M): log sum_k (w_k N(x_n; loc_k, s_k))^(1/T_m)
    comp = np.log(W_MIX) + norm.logpdf(np.asarray(X, np.float64)[:, None], loc, S_MIX)
    return sp_logsumexp(comp[:, None, :] / TEMPS[None, :, None], axis=-1)


def joint_log_c(n=1):
    return joint_mixture_log_c(TEMPS, n)


@pytest.fixture(scope="module")
def joint_ladder():
    return Ladder(TEMPS, WEIGHTS).with_log_partition(
        mixture_model, KEY, X, joint=True, plate="data", num_samples=4
    )


@pytest.mark.parametrize("plate", [None, "data"])
def test_joint_tempering_objective_by_hand(joint_ladder, plate):
    np.testing.assert_allclose(joint_ladder.log_c, joint_log_c(N), rtol=1e-5, atol=1e-5)
    elbo = MulticanonicalELBO(joint_ladder, plate=plate, joint=True)
    out = -jax.jit(lambda k: elbo.loss(k, {}, mixture_model, mixture_guide, X))(KEY)

    @jax.jit
    def draw(key):
        _, guide_seed = jax.random.split(key)
        return trace(seed(mixture_guide, guide_seed)).get_trace(X)["loc"]["value"]

    loc = np.asarray(draw(KEY), np.float64)
    lik = joint_lik(loc)
    prior_q = norm.logpdf(loc, 0.0, 3.0).sum() - norm.logpdf(loc, [-1.0, 1.5], 0.3).sum()
    if plate is None:
        a = np.log(WEIGHTS) + lik.sum(0) - joint_log_c(N)
    else:
        a = np.log(WEIGHTS) + lik - joint_log_c(1)[None, :]
    expected = prior_q + np.sum(sp_logsumexp(a, axis=-1))  # L_M(r*) = logsumexp per draw
    np.testing.assert_allclose(out, expected, rtol=1e-5)
    # tempering the marginal instead (joint=False) is a different objective
    assert np.max(np.abs(lik.sum(0) - lik[:, 0].sum() / TEMPS)) > 0.5
    # the ladder carries its selection: without `joint=True` here the objective is the same
    inherited = MulticanonicalELBO(joint_ladder, plate=plate)
    assert inherited.selection == Selection(joint=True)
    again = -jax.jit(lambda k: inherited.loss(k, {}, mixture_model, mixture_guide, X))(KEY)
    np.testing.assert_allclose(again, out, rtol=1e-6)


def test_selection_other_than_the_ladders_is_refused(joint_ladder):
    # log C was computed for the joint tempering of 'x': another selection would pair the
    # weights exp(l/T - log C) with the wrong log C (it was accepted without a word before)
    assert joint_ladder.selection == Selection(joint=True)
    for make in (MulticanonicalELBO, lambda lad, **kw: multicanonical(mixture_model, lad, **kw)):
        with pytest.raises(ValueError, match="ladder's log C was computed for"):
            make(joint_ladder, sites="x")
        with pytest.raises(ValueError, match="joint=True"):
            make(joint_ladder, latent="loc", joint=True)
    assert multicanonical(mixture_model, joint_ladder).selection == Selection(joint=True)
    # a ladder given its log C by value, without a selection, takes the objective's
    bare = Ladder(TEMPS, WEIGHTS).with_log_partition_values(
        joint_ladder.log_c, sizes=joint_ladder.sizes
    )
    assert bare.selection is None
    assert MulticanonicalELBO(bare, sites="x").selection == Selection(frozenset({"x"}))


@pytest.mark.parametrize("plate", [None, "data"])
def test_joint_tempering_handler_by_hand(joint_ladder, plate):
    mc = multicanonical(mixture_model, joint_ladder, plate=plate, joint=True)
    loc = np.array([-0.8, 1.2])
    lp = jax.jit(lambda v: log_density(mc, (X,), {}, {"loc": v})[0])(jnp.asarray(loc))
    lik = joint_lik(loc)
    if plate is None:
        a = np.log(WEIGHTS) + lik.sum(0) - joint_log_c(N)
    else:
        a = np.log(WEIGHTS) + lik - joint_log_c(1)[None, :]
    expected = norm.logpdf(loc, 0.0, 3.0).sum() + np.sum(sp_logsumexp(a, axis=-1))
    np.testing.assert_allclose(lp, expected, rtol=1e-5)


def test_condition_inside_or_outside_the_handler_gives_the_same_density():
    def unobserved(x=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        with numpyro.plate("data", N):
            numpyro.sample("x", dist.Normal(mu, SIGMA), obs=x)

    inside = multicanonical(condition(unobserved, {"x": X}), LADDER)
    outside = condition(multicanonical(unobserved, LADDER), {"x": X})
    lp_in = log_density(inside, (), {}, {"mu": 0.4})[0]
    lp_out = log_density(outside, (), {}, {"mu": 0.4})[0]
    reference = log_density(multicanonical(model, LADDER), (X,), {}, {"mu": 0.4})[0]
    np.testing.assert_allclose(lp_in, reference, rtol=1e-6)
    np.testing.assert_allclose(lp_out, reference, rtol=1e-6)


def test_an_already_tempered_model_is_refused():
    """A model that a `temper` handler already tempers (p^(1/T0)) would meet the ladder's
    log C(T_m) of the untempered model at temperatures T0 T_m: refused, naming the site
    (it gave a finite, wrong M-ELBO)."""
    from numpyro.infer.autoguide import AutoNormal

    def model():
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=3.0)

    ladder = Ladder([1.0, 4.0]).with_log_partition_values([0.0, 0.5], sizes=UNCHECKED)
    guide = AutoNormal(model)
    svi = SVI(model, guide, optax.adam(0.1), Trace_ELBO())
    params = svi.get_params(svi.init(jax.random.PRNGKey(0)))
    loss = MulticanonicalELBO(ladder)
    assert np.isfinite(float(loss.loss(jax.random.PRNGKey(1), params, model, guide)))
    with pytest.raises(ValueError, match="site 'x' is already tempered"):
        loss.loss(jax.random.PRNGKey(1), params, temper(model, 2.0), guide)


def test_temper_outside_a_multicanonical_model_is_refused():
    """temper(multicanonical(model, ladder), T) would temper the multicanonical factor (an
    observed site): it returned the M-ELBO density scaled by 1/T, silently. Refused, naming
    the site; T = 1 changes nothing and passes."""
    def model():
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=3.0)

    from numpyro_tempering import multicanonical

    mc = multicanonical(model, Ladder([1.0, 4.0]).with_log_partition_values(
        [0.0, 0.5], sizes=UNCHECKED))
    plain = log_density(mc, (), {}, {"mu": 0.5})[0]
    np.testing.assert_allclose(log_density(temper(mc, 1.0), (), {}, {"mu": 0.5})[0], plain)
    with pytest.raises(ValueError, match="belongs to a multicanonical model"):
        log_density(temper(mc, 2.0), (), {}, {"mu": 0.5})
