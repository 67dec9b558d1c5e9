"""Enumerated discrete sites: the engine refuses them, TraceEnum_ELBO on temper(model) sums them.

The model is a two-component Gaussian mixture with an enumerated local z_n:

    mu ~ N(0, 2^2),  z_n ~ Categorical(PI),  x_n | z_n = k, mu ~ N(SIGN_k mu, 1).

With a point-mass guide for mu at m the ELBO is exact (no Monte Carlo), so TraceEnum_ELBO on
the tempered model can be checked against a brute-force sum over k:

* ``temper(model, T)`` tempers the observed x only:
  log p(m) + sum_n log sum_k p(z_n = k) p(x_n | k, m)^(1/T_n);
* ``temper(model, T, latent="z")`` tempers the joint:
  log p(m) + sum_n log sum_k (p(z_n = k) p(x_n | k, m))^(1/T_n).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO

pytest.importorskip("funsor")
from numpyro.contrib.funsor import config_enumerate  # noqa: E402

from numpyro_tempering import CUBO, KLpq, TemperedELBO, temper  # noqa: E402
from numpyro_tempering.engine import log_weights  # noqa: E402

PI = jnp.array([0.3, 0.7])
SIGN = jnp.array([1.0, -1.0])
XE = jnp.array([1.2, -0.8, 2.0, -1.5])
M = 0.9
PARAMS = {"m": jnp.array(M)}
KEY = jax.random.PRNGKey(0)


def mixture(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0]):
        z = numpyro.sample("z", dist.Categorical(probs=PI))
        numpyro.sample("x", dist.Normal(mu * SIGN[z], 1.0), obs=x)


enumerated = config_enumerate(mixture)


def delta_guide(x):
    numpyro.sample("mu", dist.Delta(numpyro.param("m", 0.5)))


def normal_guide(x):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.5), 0.3))


def brute_force_elbo(T, joint: bool, m=M):
    """The exact ELBO at the point mass mu = m (log q = 0), enumerating k by hand."""
    x = np.asarray(XE, np.float64)[:, None]
    t = np.broadcast_to(np.asarray(T, np.float64), x.shape[:1])[:, None]
    log_prior_z = np.log(np.asarray(PI, np.float64))[None, :]
    log_lik = -0.5 * (x - m * np.asarray(SIGN, np.float64)[None, :]) ** 2 - 0.5 * np.log(
        2 * np.pi
    )
    terms = (log_prior_z + log_lik) / t if joint else log_prior_z + log_lik / t
    log_mu = -0.5 * (m / 2.0) ** 2 - np.log(2.0) - 0.5 * np.log(2 * np.pi)
    return log_mu + np.sum(np.logaddexp.reduce(terms, axis=1))


TEMPERATURES = {"scalar": 2.0, "per_datapoint": jnp.array([1.0, 2.0, 3.0, 4.0])}
SELECTIONS = {"observed": {}, "joint": {"latent": "z"}}


# ---------------------------------------------------------------------------------------
# (a) TraceEnum_ELBO on temper(model, T) against brute force
@pytest.mark.parametrize("temperature", list(TEMPERATURES))
@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_trace_enum_on_tempered_mixture_equals_brute_force(selection, temperature):
    T = TEMPERATURES[temperature]
    model = temper(enumerated, T, **SELECTIONS[selection])
    loss = TraceEnum_ELBO().loss(KEY, PARAMS, model, delta_guide, XE)
    expected = brute_force_elbo(T, joint=selection == "joint")
    np.testing.assert_allclose(-loss, expected, rtol=1e-5)
    # the two selections really differ (the test can tell them apart)
    other = brute_force_elbo(T, joint=selection != "joint")
    assert abs(float(-loss) - other) > 1e-2


# (b) at T = 1 tempering changes nothing under enumeration
@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_trace_enum_on_temper_at_1_equals_the_model(selection):
    ref = TraceEnum_ELBO().loss(KEY, PARAMS, enumerated, delta_guide, XE)
    out = TraceEnum_ELBO().loss(
        KEY, PARAMS, temper(enumerated, 1.0, **SELECTIONS[selection]), delta_guide, XE
    )
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    np.testing.assert_allclose(-out, brute_force_elbo(1.0, joint=False), rtol=1e-5)


# (c) a traced T under jax.jit inside TraceEnum_ELBO
@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_trace_enum_with_a_traced_temperature_under_jit(selection):
    @jax.jit
    def loss(T):
        model = temper(enumerated, T, **SELECTIONS[selection])
        return TraceEnum_ELBO().loss(KEY, PARAMS, model, delta_guide, XE)

    joint = selection == "joint"
    for T in (2.0, 3.5):
        np.testing.assert_allclose(-loss(jnp.asarray(T)), brute_force_elbo(T, joint), rtol=1e-5)
    T = TEMPERATURES["per_datapoint"]
    np.testing.assert_allclose(-loss(T), brute_force_elbo(T, joint), rtol=1e-5)


# ---------------------------------------------------------------------------------------
# The engine does not enumerate: it refuses an enumerated site the guide does not sample.
ENGINE_OBJECTIVES = {
    "TemperedELBO(T=2)": lambda: TemperedELBO(temperature=2.0),
    "TemperedELBO()": lambda: TemperedELBO(),
    "TemperedELBO(3, lax.map)": lambda: TemperedELBO(3, False, temperature=2.0),
    "CUBO": lambda: CUBO(num_particles=2),
    "KLpq": lambda: KLpq(num_particles=2),
}


@pytest.mark.parametrize("objective", list(ENGINE_OBJECTIVES))
def test_objectives_on_the_engine_refuse_enumerated_sites(objective):
    elbo = ENGINE_OBJECTIVES[objective]()
    with pytest.raises(ValueError, match=r"'z'.*enumeration.*TraceEnum_ELBO"):
        elbo.loss(KEY, PARAMS, temper(enumerated, 1.0), normal_guide, XE)


def test_engine_refuses_enumerated_sites_with_a_multi_sample_guide_too():
    def multi_guide(x):
        with numpyro.plate("samples", 3):
            numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.5), 0.3))

    with pytest.raises(ValueError, match="'z'"):
        log_weights(KEY, PARAMS, enumerated, multi_guide, (XE,), multi_sample_guide=True)


def test_explicit_infer_enumerate_is_refused_as_config_enumerate():
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        with numpyro.plate("data", x.shape[0]):
            z = numpyro.sample("z", dist.Categorical(probs=PI), infer={"enumerate": "parallel"})
            numpyro.sample("x", dist.Normal(mu * SIGN[z], 1.0), obs=x)

    with pytest.raises(ValueError, match="'z'"):
        log_weights(KEY, PARAMS, model, normal_guide, (XE,))


def test_an_enumerated_site_the_guide_samples_is_fine():
    # then nothing is enumerated (the guide's sample is replayed), exactly as Trace_ELBO
    def guide(x):
        normal_guide(x)
        probs = numpyro.param("q", jnp.full((x.shape[0], 2), 0.5),
                              constraint=dist.constraints.simplex)
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("z", dist.Categorical(probs=probs))

    params = {**PARAMS, "q": jnp.tile(jnp.array([0.2, 0.8]), (4, 1))}
    ref = Trace_ELBO(3).loss(KEY, params, enumerated, guide, XE)
    out = TemperedELBO(3, temperature=1.0).loss(KEY, params, enumerated, guide, XE)
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_a_plain_discrete_latent_missing_from_the_guide_behaves_as_in_trace_elbo():
    # not marked for enumeration: drawn from the prior, with NumPyro's mismatch warning
    message = re.escape("Found vars in model but not guide: {'z'}")
    with pytest.warns(UserWarning, match=message):
        ref = Trace_ELBO(3).loss(KEY, PARAMS, mixture, normal_guide, XE)
    with pytest.warns(UserWarning, match=message):
        out = TemperedELBO(3, temperature=1.0).loss(KEY, PARAMS, mixture, normal_guide, XE)
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_svi_warns_about_discrete_latents_as_with_trace_elbo():
    assert TemperedELBO.can_infer_discrete is Trace_ELBO.can_infer_discrete is False

    def init_warning(elbo):
        with pytest.warns(UserWarning, match="discrete latent variables") as record:
            SVI(mixture, normal_guide, optax.adam(0.1), elbo).init(KEY, XE)
        return [str(w.message) for w in record if "discrete" in str(w.message)]

    ref = init_warning(Trace_ELBO())
    out = init_warning(TemperedELBO())
    assert [m.replace("TemperedELBO", "Trace_ELBO") for m in out] == ref
