"""Every NumPyro entry point on the zoo of tests/test_site_roles.py (issue 21, scope 2).

Each test names the entry point (the rows of the table in docs/composition.md, "Which entry
points see the tempered density") and checks its answer on ``temper(model, T)`` exactly:
against the untempered model's number through an identity that holds for every draw (the
SVI loss moves by (1 - 1/T) times the log likelihood of the guide's draw), a closed form
(HMCECS's subsampled potential) or brute force over paths (the HMM), or checks that it is
refused naming the site. The entry points that get ``scan`` wrong even untempered
(TraceEnum_ELBO, infer_discrete) are tested in tests/test_site_roles.py.
"""

import warnings

import arviz as az
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro import handlers
from numpyro.infer import (
    HMCECS,
    MCMC,
    NUTS,
    SVI,
    Predictive,
    Trace_ELBO,
    TraceEnum_ELBO,
    TraceMeanField_ELBO,
    autoguide,
)
from numpyro.infer.initialization import init_to_value
from numpyro.infer.util import initialize_model, log_likelihood
from test_site_roles import (
    AUTOGUIDES,
    S8,
    Y8,
    YH,
    Z_MARKOV,
    T,
    hmm,
    hmm_brute_force,
    hmm_forward,
    hmm_markov,
    mixture,
    schools,
    state_space,
    von_mises,
    with_cond,
)

from numpyro_tempering import temper

pytest.importorskip("funsor")  # enumeration

KEY = jax.random.PRNGKey(0)
SCHOOLS_NC = schools(False)

# --------------------------------------------------------------------------------------
# SVI with each AutoGuide
# --------------------------------------------------------------------------------------


def _svi_loss(model, guide_class, elbo=None):
    """The ELBO's loss at KEY (Trace_ELBO by default), the guide built on the model SVI
    runs (the usual idiom)."""
    elbo = Trace_ELBO() if elbo is None else elbo
    guide = guide_class(model)
    svi = SVI(model, guide, optax.sgd(0.0), elbo)
    params = svi.get_params(svi.init(KEY))
    return elbo.loss(KEY, params, model, guide), guide, params


def schools_tempered_by_hand(y=Y8):
    """The non-centred eight schools with its likelihood written tempered: p(y | theta)^(1/T)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("J", len(Y8)):
        eta = numpyro.sample("eta", dist.Normal(0.0, 1.0))
        numpyro.factor("y", dist.Normal(mu + tau * eta, S8).log_prob(y) / T)


@pytest.mark.parametrize("guide_class", AUTOGUIDES, ids=lambda g: g.__name__)
def test_svi_trace_elbo_with_each_autoguide_on_schools_is_the_hand_tempered_elbo(guide_class):
    # the guide is built on the tempered model (AutoDAIS runs its potential inside the
    # guide, so its draws depend on T): compare with the model tempered by hand
    loss_T, _, params_T = _svi_loss(temper(SCHOOLS_NC, T), guide_class)
    expected, _, params = _svi_loss(schools_tempered_by_hand, guide_class)
    assert jax.tree.structure(params_T) == jax.tree.structure(params)
    np.testing.assert_allclose(loss_T, expected, rtol=1e-5)


SVI_ZOO = [
    ("state_space", state_space, Trace_ELBO()),
    ("schools_centred", schools(True), Trace_ELBO()),
    ("schools_noncentred", SCHOOLS_NC, Trace_ELBO()),
    ("von_mises", von_mises, Trace_ELBO()),
    ("mixture", mixture, Trace_ELBO()),
    ("schools_centred", schools(True), TraceMeanField_ELBO()),  # analytic KL for the prior
]


@pytest.mark.parametrize(
    "name, model, elbo", SVI_ZOO, ids=[f"{c[0]}-{type(c[2]).__name__}" for c in SVI_ZOO]
)
def test_svi_elbo_with_autonormal_on_the_zoo_moves_by_the_tempered_likelihood(name, model, elbo):
    # loss(T) = loss(1) + (1 - 1/T) log p(y | draw), for the guide's draw at KEY
    loss_1, guide, params = _svi_loss(model, autoguide.AutoNormal, elbo)
    loss_T, _, _ = _svi_loss(temper(model, T), autoguide.AutoNormal, elbo)
    guide_key = jax.random.split(KEY)[1]  # both ELBOs seed the guide with the 2nd half
    tr = handlers.trace(handlers.substitute(handlers.seed(guide, guide_key), params)).get_trace()
    draw = {n: s["value"] for n, s in tr.items() if s["type"] == "sample"}
    lik = sum(jnp.sum(v) for v in log_likelihood(model, draw, batch_ndims=0).values())
    np.testing.assert_allclose(loss_T, loss_1 + lik - lik / T, rtol=1e-5)


def test_svi_on_a_cond_model_with_a_latent_in_a_branch_is_refused_naming_the_site():
    # NumPyro's cond does not pass `replay` into its branches (tests/test_site_roles.py)
    with pytest.raises(ValueError, match=r"latent site 'w' is in a branch of .*cond"):
        _svi_loss(temper(with_cond, T), autoguide.AutoNormal)


@pytest.mark.parametrize("latent", [(), Z_MARKOV], ids=["likelihood", "latent=z"])
def test_svi_traceenum_elbo_with_autodelta_on_the_markov_hmm_is_the_forward_algorithm(latent):
    mu = 0.4
    model = temper(hmm_markov, T, latent=latent)
    # an AutoGuide on the continuous sites only: NumPyro's AutoGuides refuse the enumerated
    # states ("cannot handle discrete sample site"), tempered or not
    guide = autoguide.AutoDelta(
        handlers.block(model, expose=["mu"]), init_loc_fn=init_to_value(values={"mu": mu})
    )
    svi = SVI(model, guide, optax.sgd(0.0), TraceEnum_ELBO())
    loss = svi.evaluate(svi.init(KEY))
    T_lat = T if latent else 1.0
    np.testing.assert_allclose(-loss, hmm_forward(mu, T, T_lat), rtol=1e-5)


def test_svi_traceenum_elbo_with_an_autoguide_on_the_scan_hmm_is_refused_naming_the_site():
    model = temper(hmm, T)
    guide = autoguide.AutoNormal(handlers.block(model, expose=["mu"]))
    svi = SVI(model, guide, optax.sgd(0.0), TraceEnum_ELBO())
    state = svi.init(KEY)
    with pytest.raises(ValueError, match=r"site 'z' is inside .*scan.*TraceEnum_ELBO"):
        svi.evaluate(state)


# --------------------------------------------------------------------------------------
# NUTS: the enumerated potential of the markov HMM (the scan HMM: tests/test_site_roles.py)
# --------------------------------------------------------------------------------------


def test_nuts_potential_of_the_tempered_markov_hmm_equals_brute_force():
    for latent, T_lat in (((), 1.0), (Z_MARKOV, T)):
        _, potential_fn, _, _ = initialize_model(
            KEY, temper(hmm_markov, T, latent=latent), dynamic_args=False
        )
        for mu in (0.4, -1.3):
            np.testing.assert_allclose(
                -potential_fn({"mu": jnp.asarray(mu)}), hmm_brute_force(mu, T, T_lat), rtol=1e-5
            )


# --------------------------------------------------------------------------------------
# HMCECS: the subsampled potential, without and with a Taylor proxy
# --------------------------------------------------------------------------------------

Y6 = jnp.array([0.3, -0.4, 1.1, 0.7, -0.2, 0.5])
N, M = 6, 3
SUBSAMPLE = jnp.array([1, 3, 4])


def subsampled(y=Y6, sigma=1.0):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("n", N, subsample_size=M) as idx:
        numpyro.sample("y", dist.Normal(mu, sigma), obs=y[idx])


def _hmcecs_potential(model, proxy, mu=0.4):
    # compiled (the proxy's Taylor expansion op by op is slower than its compilation)
    def potential(mu):
        kernel = HMCECS(NUTS(model), proxy=proxy)
        state = kernel.init(KEY, 0, {"mu": mu, "n": SUBSAMPLE}, (), {})
        return state.hmc_state.potential_energy

    return jax.jit(potential)(jnp.asarray(mu))


def test_hmcecs_potential_without_proxy_is_the_tempered_subsampled_estimate():
    mu = 0.4
    lik = jnp.sum(dist.Normal(mu, 1.0).log_prob(Y6[SUBSAMPLE]))
    exact = -(dist.Normal(0.0, 1.0).log_prob(mu) + N / M * lik / T)
    np.testing.assert_allclose(_hmcecs_potential(temper(subsampled, T), None), exact, rtol=1e-6)


def test_hmcecs_potential_with_a_taylor_proxy_is_that_of_the_tempered_likelihood():
    # Normal(y | mu, 1)^(1/T) = Normal(y | mu, sqrt(T)) * exp(c) per observation, so the
    # tempered model's estimate (proxy, difference estimator and its variance correction)
    # is the wide model's, shifted by N c
    proxy = HMCECS.taylor_proxy({"mu": jnp.array(0.2)})
    c = 0.5 * jnp.log(T) + 0.5 * jnp.log(2 * jnp.pi) * (1.0 - 1.0 / T)
    wide = _hmcecs_potential(lambda y=Y6: subsampled(y, np.sqrt(T)), proxy)
    tempered = _hmcecs_potential(temper(subsampled, T), proxy)
    np.testing.assert_allclose(tempered, wide - N * c, rtol=1e-6)


# --------------------------------------------------------------------------------------
# Predictive: draws the untempered likelihood (temper changes densities, not samplers)
# --------------------------------------------------------------------------------------

PREDICTIVE = [
    ("schools_centred", schools(True), "y"),
    ("schools_noncentred", SCHOOLS_NC, "y"),
    ("von_mises", von_mises, "y"),
    ("mixture", mixture, "x"),
    ("cond", with_cond, "y"),
]


@pytest.mark.parametrize("name, model, obs", PREDICTIVE, ids=[p[0] for p in PREDICTIVE])
def test_predictive_draws_of_the_tempered_model_are_the_untempered_ones(name, model, obs):
    prior = Predictive(model, num_samples=3)(KEY, **{obs: None})
    latents = {k: v for k, v in prior.items() if k != obs}
    key = jax.random.PRNGKey(5)
    plain = Predictive(model, latents)(key, **{obs: None})
    tempered = Predictive(temper(model, T), latents)(key, **{obs: None})
    assert sorted(tempered) == sorted(plain)
    for site in plain:
        np.testing.assert_array_equal(tempered[site], plain[site])


def test_predictive_latent_draws_of_the_tempered_scan_models_are_the_untempered_ones():
    # scan needs the data for its length: the observations stay observed, the latents of
    # every step (the state-space model's x and tau, the HMM's z) are drawn untempered,
    # also when tempered by name (temper changes a latent's density, not its sampler)
    key = jax.random.PRNGKey(5)
    for model, given, latent in ((state_space, {"rho": jnp.array([0.3, -0.2])}, "x"),
                                 (hmm, {"mu": jnp.array([0.4, -0.3])}, "z")):
        plain = Predictive(model, given)(key)
        tempered = Predictive(temper(model, T, latent=latent), given)(key)
        assert sorted(tempered) == sorted(plain)
        for site in plain:
            np.testing.assert_array_equal(tempered[site], plain[site])


# --------------------------------------------------------------------------------------
# log_likelihood on the HMMs (the other zoo models: tests/test_site_roles.py)
# --------------------------------------------------------------------------------------


def test_log_likelihood_of_the_tempered_hmms_given_the_states_is_the_untempered_over_t():
    mu = jnp.array([0.4, -0.3])
    paths = jnp.array([[0, 1, 1], [1, 0, 0]])
    for model, draws in (
        (hmm, {"mu": mu, "z": paths}),
        (hmm_markov, {"mu": mu, **{n: paths[:, t] for t, n in enumerate(Z_MARKOV)}}),
    ):
        plain = log_likelihood(model, draws)
        tempered = log_likelihood(temper(model, T), draws)
        assert sorted(tempered) == sorted(plain)
        for site in plain:
            np.testing.assert_allclose(tempered[site], plain[site] / T, rtol=1e-6)
    # by hand for the scan HMM: log N(y_t | +-mu, 1) along the path
    locs = jnp.where(paths == 0, mu[:, None], -mu[:, None])
    np.testing.assert_allclose(
        log_likelihood(temper(hmm, T), {"mu": mu, "z": paths})["y"],
        dist.Normal(locs, 1.0).log_prob(YH) / T,
        rtol=1e-6,
    )


# --------------------------------------------------------------------------------------
# az.from_numpyro + az.loo after NUTS on the tempered model
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tempered_mcmc():
    mcmc = MCMC(NUTS(temper(SCHOOLS_NC, T)), num_warmup=30, num_samples=40, progress_bar=False)
    mcmc.run(KEY)
    return mcmc


def test_nuts_az_from_numpyro_and_loo_see_the_tempered_log_likelihood(tempered_mcmc):
    samples = tempered_mcmc.get_samples()
    plain = log_likelihood(SCHOOLS_NC, samples)["y"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PSIS k-hat warnings on 40 draws
        idata = az.from_numpyro(tempered_mcmc)
        np.testing.assert_allclose(idata.log_likelihood["y"].values[0], plain / T, rtol=1e-6)
        by_hand = az.from_dict(
            posterior={k: np.asarray(v)[None] for k, v in samples.items()},
            log_likelihood={"y": np.asarray(plain / T)[None]},
        )
        loo, expected = az.loo(idata), az.loo(by_hand)
    np.testing.assert_allclose(loo.elpd_loo, expected.elpd_loo, rtol=1e-6)
    np.testing.assert_allclose(loo.p_loo, expected.p_loo, rtol=1e-6)
    assert np.all(np.isfinite(samples["mu"]))


def test_az_from_numpyro_on_a_multicanonical_model_is_refused_naming_the_site():
    from numpyro_tempering.ladder import Ladder
    from numpyro_tempering.multicanonical_model import multicanonical
    from numpyro_tempering.structure import model_sizes

    ladder = Ladder([1.0, 2.0]).with_log_partition_values(
        [0.0, 0.4], sizes=model_sizes(SCHOOLS_NC)
    )
    mcmc = MCMC(NUTS(multicanonical(SCHOOLS_NC, ladder)), num_warmup=3, num_samples=3,
                progress_bar=False)
    mcmc.run(KEY)
    with pytest.raises(ValueError, match="'y'"):
        az.from_numpyro(mcmc)


# --------------------------------------------------------------------------------------
# The table in docs/composition.md names a test for every row; each must exist
# --------------------------------------------------------------------------------------


def test_every_test_the_entry_point_table_names_exists():
    import re
    from pathlib import Path

    root = Path(__file__).parent
    doc = (root.parent / "docs" / "composition.md").read_text()
    table = doc[doc.index("## Which entry points see the tempered density"):]
    table = table[: table.index("\n## ")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    defined = set(re.findall(r"^def (test_\w+)", "".join(
        p.read_text() for p in root.glob("test_*.py")), re.M))
    for row in rows[1:]:  # every row but the header names at least one test, all defined
        named = re.findall(r"`(test_\w+)`", row)
        assert named, row
        assert set(named) <= defined, set(named) - defined
