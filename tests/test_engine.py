"""The log-weight engine: Trace_ELBO's particle options, per-site terms and mutable state."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.primitives import mutable

from numpyro_tempering import TemperedELBO, schedules, temper
from numpyro_tempering.engine import (
    MUTABLE_STATE_WARNING,
    log_weights,
    particle_map,
    particle_options,
)
from numpyro_tempering.handlers import DEFAULT_CLOCK

X = jnp.array([1.3, 0.4, 2.1, 1.7, 0.9, 1.1, 1.5, 0.2, 1.9, 1.0])
KEY = jax.random.PRNGKey(5)
PARAMS = {"loc": jnp.array(0.7), "scale": jnp.array(0.4)}


def model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 0.5), obs=x)


def guide(x):
    loc = numpyro.param("loc", 0.0)
    scale = numpyro.param("scale", 1.0, constraint=dist.constraints.positive)
    numpyro.sample("mu", dist.Normal(loc, scale))


def assert_trees_close(a, b, rtol=2e-6):
    """Equal to float tolerance (a few ulps: Trace_ELBO sums the sites in another order)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol)


# ---------------------------------------------------------------------------------------
# Particle maps
def counting_vmap():
    calls = []

    def vectorize(fn, keys):
        calls.append(keys.shape)
        return jax.vmap(fn)(keys)

    return vectorize, calls


@pytest.mark.parametrize("vectorize", ["vmap", "map", "callable"])
def test_every_particle_map_gives_the_same_weights(vectorize):
    ref = log_weights(KEY, PARAMS, temper(model, 2.0), guide, (X,), num_particles=4)
    if vectorize == "callable":
        vectorize_particles, calls = counting_vmap()
    else:
        vectorize_particles, calls = vectorize == "vmap", None
    out = log_weights(
        KEY, PARAMS, temper(model, 2.0), guide, (X,), num_particles=4,
        vectorize_particles=vectorize_particles,
    )
    assert_trees_close(out[:3], ref[:3])
    if calls is not None:
        assert calls == [(4, 2)]  # the callable was given the per-particle function and keys


def test_a_single_particle_is_not_mapped():
    vectorize, calls = counting_vmap()
    lw = log_weights(KEY, PARAMS, model, guide, (X,), vectorize_particles=vectorize)
    assert calls == [] and lw.log_w.shape == (1,)


@pytest.mark.parametrize("bad", [None, "vmap", 1])
def test_bad_vectorize_particles_is_refused(bad):
    with pytest.raises(ValueError, match="vectorize_particles"):
        particle_map(bad)
    with pytest.raises(ValueError, match="vectorize_particles"):
        log_weights(KEY, PARAMS, model, guide, (X,), num_particles=2, vectorize_particles=bad)


def test_particle_options_read_a_numpyro_elbo():
    vectorize, _ = counting_vmap()
    opts = particle_options(Trace_ELBO(3, vectorize, True))
    assert opts == {"num_particles": 3, "vectorize_particles": vectorize,
                    "multi_sample_guide": True}
    assert particle_options(TemperedELBO(2, False))["vectorize_particles"] is False


# ---------------------------------------------------------------------------------------
# Per-site terms
@pytest.mark.parametrize("num_particles", [1, 3])
def test_per_site_terms_sum_to_the_log_weight(num_particles):
    T = 2.0
    lw = log_weights(KEY, PARAMS, temper(model, T), guide, (X,), num_particles=num_particles,
                     per_site=True)
    assert set(lw.site_log_w) == {"mu", "x"}
    np.testing.assert_allclose(lw.site_log_w["mu"] + lw.site_log_w["x"], lw.log_w, rtol=1e-6)
    np.testing.assert_allclose(lw.site_log_w["x"], lw.log_lik, rtol=1e-6)  # tempered already
    np.testing.assert_allclose(lw.site_log_w["mu"], lw.log_prior - lw.log_q, rtol=1e-6)
    assert log_weights(KEY, PARAMS, model, guide, (X,)).site_log_w is None


def test_sum_sites_false_loss_at_T_is_per_site_and_sums_to_the_loss():
    T = 3.0
    total = TemperedELBO(3, temperature=T).loss(KEY, PARAMS, model, guide, X)
    sites = TemperedELBO(3, sum_sites=False, temperature=T).loss(KEY, PARAMS, model, guide, X)
    np.testing.assert_allclose(sites["mu"] + sites["x"], total, rtol=1e-6)
    ref = Trace_ELBO(3, sum_sites=False).loss(KEY, PARAMS, model, guide, X)
    np.testing.assert_allclose(sites["mu"], ref["mu"], rtol=1e-6)  # the prior is untempered
    np.testing.assert_allclose(sites["x"], ref["x"] / T, rtol=1e-6)  # the likelihood is


# ---------------------------------------------------------------------------------------
# Subsampled plate: scale and indices of the named plate
def subsampled_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0], subsample_size=4) as idx:
        numpyro.sample("x", dist.Normal(mu, 0.5), obs=x[idx])


def test_named_plate_scale_and_indices_with_subsampling():
    lw = log_weights(KEY, PARAMS, temper(subsampled_model, 1.0), guide, (X,),
                     num_particles=2, plate="data")
    assert float(lw.plate_scale) == pytest.approx(X.shape[0] / 4)
    assert lw.plate_indices.shape == (4,)
    np.testing.assert_allclose(lw.log_lik_elements.sum(-1), lw.log_lik, rtol=1e-6)
    # both particles saw the same subsample (one model seed per particle, but the indices are
    # those of particle 0 and the scale applies to every element)
    assert len(set(np.asarray(lw.plate_indices).tolist())) == 4


# ---------------------------------------------------------------------------------------
# Multi-sample guides, as Trace_ELBO(multi_sample_guide=True)
K = 5


def multi_guide(x):
    loc = numpyro.param("loc", 0.0)
    scale = numpyro.param("scale", 1.0, constraint=dist.constraints.positive)
    with numpyro.plate("samples", K):
        numpyro.sample("mu", dist.Normal(loc, scale))


@pytest.mark.parametrize("num_particles, sum_sites", [(1, True), (2, False)])
def test_multi_sample_guide_equals_trace_elbo(num_particles, sum_sites):
    def value_and_grad(elbo):
        def f(p):
            return elbo.loss(KEY, p, model, multi_guide, X)

        return f(PARAMS), jax.grad(lambda p: jax.tree.reduce(jnp.add, f(p)))(PARAMS)

    ref = value_and_grad(Trace_ELBO(num_particles, True, True, sum_sites))
    out = value_and_grad(TemperedELBO(num_particles, True, True, sum_sites, temperature=1.0))
    assert_trees_close(out, ref)
    # and at T the likelihood of every guide sample is tempered: by hand for one particle
    if num_particles == 1 and sum_sites:
        T = 2.0
        _, guide_key = jax.random.split(KEY)
        tr = numpyro.handlers.trace(
            numpyro.handlers.seed(numpyro.handlers.substitute(multi_guide, PARAMS), guide_key)
        ).get_trace(X)
        mu = tr["mu"]["value"]
        expected = (
            dist.Normal(0.0, 2.0).log_prob(mu).sum()
            + dist.Normal(mu[:, None], 0.5).log_prob(X).sum() / T
            - dist.Normal(PARAMS["loc"], PARAMS["scale"]).log_prob(mu).sum()
        )
        out = TemperedELBO(1, True, True, temperature=T).loss(KEY, PARAMS, model, multi_guide, X)
        np.testing.assert_allclose(-out, expected, rtol=1e-5)


def test_multi_sample_guide_without_sample_sites_is_refused():
    def empty_guide(x):
        numpyro.param("loc", 0.0)

    with pytest.raises(ValueError, match="multi_sample_guide"):
        log_weights(KEY, PARAMS, model, empty_guide, (X,), multi_sample_guide=True)


# ---------------------------------------------------------------------------------------
# Mutable state
def stateful_model(x):
    """A model with particle-dependent mutable state (like a batch-norm running mean)."""
    state = mutable("running", {"mean": jnp.zeros(())})
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    state["mean"] = 0.9 * state["mean"] + 0.1 * mu
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 0.5), obs=x)


STATE = {"running": {"mean": jnp.array(0.25)}}


def test_one_particle_returns_the_mutable_state_as_trace_elbo():
    params = {**PARAMS, **STATE}
    ref = Trace_ELBO().loss_with_mutable_state(KEY, params, stateful_model, guide, X)
    out = TemperedELBO(temperature=1.0).loss_with_mutable_state(
        KEY, params, stateful_model, guide, X
    )
    np.testing.assert_allclose(out["loss"], ref["loss"], rtol=1e-6)
    np.testing.assert_allclose(
        out["mutable_state"]["running"]["mean"], ref["mutable_state"]["running"]["mean"]
    )
    assert float(out["mutable_state"]["running"]["mean"]) != 0.25  # it was updated


@pytest.mark.parametrize("vectorize", [True, False])
def test_several_particles_warn_like_trace_elbo_and_ignore_particle_state(vectorize):
    params = {**PARAMS, **STATE}
    with pytest.warns(UserWarning, match=re.escape(MUTABLE_STATE_WARNING)):
        ref = Trace_ELBO(3, vectorize).loss_with_mutable_state(
            KEY, params, stateful_model, guide, X
        )
    with pytest.warns(UserWarning, match=re.escape(MUTABLE_STATE_WARNING)):
        out = TemperedELBO(3, vectorize, temperature=1.0).loss_with_mutable_state(
            KEY, params, stateful_model, guide, X
        )
    assert ref["mutable_state"] is None
    np.testing.assert_allclose(out["loss"], ref["loss"], rtol=1e-6)
    # the update is ignored: the state is the one that came in (not particle 0's)
    assert float(out["mutable_state"]["running"]["mean"]) == 0.25


def test_clock_is_kept_and_other_state_ignored_with_several_particles_in_svi_run():
    sched = schedules.linear(6.0, 1.0, num_steps=5)
    svi = SVI(temper(stateful_model, sched), guide, optax.adam(0.01), TemperedELBO(3))
    with pytest.warns(UserWarning, match=re.escape(MUTABLE_STATE_WARNING)):
        result = svi.run(KEY, 8, X, progress_bar=False)  # a scan: the state keeps its structure
    clock = result.state.mutable_state[DEFAULT_CLOCK]
    assert int(clock["step"]) == 8
    assert float(clock["temperature"]) == 1.0
    # never updated after SVI.init (which records the state after one run of the model)
    initial = svi.init(KEY, X).mutable_state["running"]["mean"]
    assert float(result.state.mutable_state["running"]["mean"]) == float(initial)


@pytest.mark.parametrize("vectorize", [True, False])
def test_schedule_with_several_particles_anneals_without_a_warning(vectorize):
    # issue 8 item 13: num_particles > 1 with a schedule runs (the clock is shared)
    sched = schedules.linear(6.0, 1.0, num_steps=5)
    svi = SVI(temper(model, sched, clock="my_clock"), guide, optax.adam(0.01),
              TemperedELBO(4, vectorize))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = svi.run(KEY, 7, X, progress_bar=False)
    clock = result.state.mutable_state["my_clock"]
    assert int(clock["step"]) == 7 and float(clock["temperature"]) == 1.0
    if not vectorize:
        return
    # the loss at each step used that step's temperature
    state = svi.init(KEY, X)
    for step in range(2):
        params, key = svi.get_params(state), jax.random.split(state.rng_key)[1]
        expected = TemperedELBO(4, temperature=float(sched(step))).loss(key, params, model,
                                                                        guide, X)
        state, loss = svi.update(state, X)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_shared_state_names_are_kept_without_a_warning():
    params = {**PARAMS, **STATE}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lw = log_weights(KEY, params, stateful_model, guide, (X,), num_particles=3,
                         shared_state=("running",))
    assert float(lw.mutable_state["running"]["mean"]) != 0.25  # particle 0's update, kept


def test_float64_weights_and_trace_elbo_parity():
    with jax.enable_x64(True):
        params = {k: jnp.asarray(v, jnp.float64) for k, v in PARAMS.items()}
        x = jnp.asarray(X, jnp.float64)
        lw = log_weights(KEY, params, temper(model, 2.0), guide, (x,), per_site=True)
        assert lw.log_w.dtype == lw.site_log_w["x"].dtype == jnp.float64
        ref = Trace_ELBO().loss(KEY, params, model, guide, x)
        out = TemperedELBO(temperature=1.0).loss(KEY, params, model, guide, x)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, ref, rtol=1e-12)


def test_multi_sample_guide_ignores_per_sample_model_state_with_a_warning():
    params = {**PARAMS, **STATE}
    with pytest.warns(UserWarning, match="multi_sample_guide"):
        lw = log_weights(KEY, params, stateful_model, multi_guide, (X,), multi_sample_guide=True)
    assert float(lw.mutable_state["running"]["mean"]) == 0.25
