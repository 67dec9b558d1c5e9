"""`temper` where it meets the rest of NumPyro: MCMC, Predictive, conditioning, reparam, schedules.

Every test compares with an exact answer (conjugate posteriors, hand-written densities).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.infer import MCMC, NUTS, Predictive
from numpyro.infer.reparam import LocScaleReparam
from numpyro.infer.util import log_density, log_likelihood, potential_energy

from numpyro_tempering import schedules, temper
from numpyro_tempering.handlers import TEMPERED

# Normal data with unknown precision tau ~ Gamma(A, B): the tempered posterior is conjugate,
# p(tau | y, T) = Gamma(A + n / (2T), B + sum(y^2) / (2T)).
A, B = 2.0, 1.5
Y = jnp.array([0.8, -1.9, 2.4, 0.3, -0.7, 1.6, -2.2, 0.9])


def precision_model(y=Y):
    tau = numpyro.sample("tau", dist.Gamma(A, B))
    with numpyro.plate("data", 8):
        numpyro.sample("y", dist.Normal(0.0, 1.0 / jnp.sqrt(tau)), obs=y)


def exact_posterior(T, tempered_prior=False):
    a, b = A, B
    if tempered_prior:  # Gamma(a, b)^(1/T) is Gamma((a - 1)/T + 1, b/T)
        a, b = (a - 1.0) / T + 1.0, b / T
    return a + Y.shape[0] / (2 * T), b + jnp.sum(Y**2) / (2 * T)


@pytest.mark.parametrize("tempered_prior", [False, True])
def test_mcmc_potential_tempers_the_likelihood_but_never_the_jacobian(tempered_prior):
    # exact: potential(u) = -[log Gamma(tau) (/T) + lik / T + log |d tau / d u|], tau = e^u
    T, u = 4.0, 0.3
    latent = ("tau",) if tempered_prior else ()
    pe = potential_energy(temper(precision_model, T, latent=latent), (), {}, {"tau": u})
    tau = jnp.exp(u)
    prior = dist.Gamma(A, B).log_prob(tau) / (T if tempered_prior else 1.0)
    lik = dist.Normal(0.0, 1.0 / jnp.sqrt(tau)).log_prob(Y).sum() / T
    np.testing.assert_allclose(pe, -(prior + lik + u), rtol=1e-6)


def test_jacobian_factor_is_not_marked_tempered():
    tr = handlers.trace(
        handlers.substitute(
            temper(precision_model, 4.0),
            substitute_fn=lambda site: numpyro.infer.util._unconstrain_reparam(
                {"tau": jnp.array(0.3)}, site
            ),
        )
    ).get_trace()
    assert "_tau_log_det" in tr
    assert not tr["_tau_log_det"]["infer"].get(TEMPERED)
    assert tr["y"]["infer"].get(TEMPERED)


def test_nuts_samples_the_exact_tempered_posterior_of_a_constrained_latent():
    T = 4.0
    mcmc = MCMC(
        NUTS(temper(precision_model, T)), num_warmup=300, num_samples=1500, progress_bar=False
    )
    mcmc.run(jax.random.PRNGKey(0))
    tau = mcmc.get_samples()["tau"]
    a, b = exact_posterior(T)
    mean, sd = a / b, jnp.sqrt(a) / b
    # 5 Monte Carlo standard errors, with a generous effective sample size of 300
    assert abs(float(tau.mean() - mean)) < 5 * float(sd) / np.sqrt(300)


def test_schedule_under_mcmc_is_refused():
    model = temper(precision_model, schedules.linear(4.0, 1.0, num_steps=10))
    with pytest.raises(ValueError, match="schedule under MCMC"):
        MCMC(NUTS(model), num_warmup=2, num_samples=2, progress_bar=False).run(
            jax.random.PRNGKey(0)
        )


def test_predictive_with_nothing_observed_runs_and_draws_the_untempered_prior():
    draws = {"tau": jnp.array([1.0, 2.0, 3.0])}
    pred = Predictive(temper(precision_model, 3.0), draws)(jax.random.PRNGKey(1), y=None)
    plain = Predictive(precision_model, draws)(jax.random.PRNGKey(1), y=None)
    np.testing.assert_array_equal(pred["y"], plain["y"])


def test_log_likelihood_sees_the_tempered_density():
    draws = {"tau": jnp.array([0.5, 2.0])}
    T = jnp.array(3.0)
    out = log_likelihood(temper(precision_model, T), draws)["y"]
    exact = dist.Normal(0.0, 1.0 / jnp.sqrt(draws["tau"][:, None])).log_prob(Y) / T
    np.testing.assert_allclose(out, exact, rtol=1e-6)


def latent_y_model():
    tau = numpyro.sample("tau", dist.Gamma(A, B))
    with numpyro.plate("data", 8):
        numpyro.sample("y", dist.Normal(0.0, 1.0 / jnp.sqrt(tau)))


@pytest.mark.parametrize("order", ["condition_inside", "condition_outside"])
def test_conditioned_sites_are_data_in_either_handler_order(order):
    T = 2.5
    if order == "condition_inside":
        fn = temper(handlers.condition(latent_y_model, {"y": Y}), T)
    else:
        fn = handlers.condition(temper(latent_y_model, T), {"y": Y})
    lp = log_density(fn, (), {}, {"tau": 1.3})[0]
    lik = dist.Normal(0.0, 1.0 / jnp.sqrt(1.3)).log_prob(Y).sum()
    np.testing.assert_allclose(lp, dist.Gamma(A, B).log_prob(1.3) + lik / T, rtol=1e-6)


def test_condition_fn_outside_counts_too():
    fn = handlers.condition(
        temper(latent_y_model, 2.0),
        condition_fn=lambda site: Y if site["name"] == "y" else None,
    )
    lp = log_density(fn, (), {}, {"tau": 1.3})[0]
    lik = dist.Normal(0.0, 1.0 / jnp.sqrt(1.3)).log_prob(Y).sum()
    np.testing.assert_allclose(lp, dist.Gamma(A, B).log_prob(1.3) + lik / 2.0, rtol=1e-6)


@pytest.mark.parametrize("order", ["condition_inside", "condition_outside"])
def test_a_none_value_in_condition_leaves_the_site_latent_and_untempered(order):
    """NumPyro's condition ignores a None value: the site stays latent, so temper leaves it
    alone in both orders (outside, it used to count as observed and was tempered)."""
    fn = temper(handlers.condition(latent_y_model, {"y": None}), 2.0) if (
        order == "condition_inside") else handlers.condition(temper(latent_y_model, 2.0),
                                                             {"y": None})
    lp = log_density(fn, (), {}, {"tau": 1.3, "y": Y})[0]
    exact = dist.Gamma(A, B).log_prob(1.3) + dist.Normal(0.0, 1.0 / jnp.sqrt(1.3)).log_prob(Y).sum()
    np.testing.assert_allclose(lp, exact, rtol=1e-6)


def loc_model():
    mu = numpyro.sample("mu", dist.Normal(1.0, 2.0))
    numpyro.sample("x", dist.Normal(mu, 1.0), obs=0.5)


def test_reparam_outside_temper_of_a_tempered_latent_is_refused():
    fn = handlers.reparam(temper(loc_model, 2.0, latent="mu"), {"mu": LocScaleReparam(0.0)})
    with pytest.raises(ValueError, match="'mu'.*reparam"):
        log_density(handlers.seed(fn, 0), (), {}, {})


def test_reparam_auxiliary_sites_are_never_tempered():
    # reparam outside: its auxiliary site mu_decentered is emitted while `mu` is being handled
    fn = handlers.reparam(temper(loc_model, 2.0), {"mu": LocScaleReparam(0.0)})
    lp, tr = log_density(fn, (), {}, {"mu_decentered": 0.25})
    mu = 1.0 + 2.0 * 0.25
    prior, lik = dist.Normal(0.0, 1.0).log_prob(0.25), dist.Normal(mu, 1.0).log_prob(0.5)
    np.testing.assert_allclose(lp, prior + lik / 2, rtol=1e-6)
    assert not tr["mu_decentered"]["infer"].get(TEMPERED)
    # reparam inside: the decentered site can be tempered by name
    fn = temper(
        handlers.reparam(loc_model, {"mu": LocScaleReparam(0.0)}), 2.0, latent="mu_decentered"
    )
    lp = log_density(fn, (), {}, {"mu_decentered": 0.25})[0]
    np.testing.assert_allclose(lp, (prior + lik) / 2, rtol=1e-6)


def test_naming_a_reparameterised_latent_lists_the_sites_that_latent_may_name():
    """temper(reparam(model), latent="mu"): `mu` is no sample site of the reparameterised
    model; the error listed only ['x'], not the auxiliary `mu_decentered` it may name (a
    probe)."""
    fn = temper(handlers.reparam(loc_model, {"mu": LocScaleReparam(0.0)}), 2.0, latent="mu")
    with pytest.raises(ValueError, match=r"\['mu'\].*\['x'\].*may name: \['mu_decentered'\]"):
        log_density(fn, (), {}, {"mu_decentered": 0.25})


def test_traced_bad_temperature_gives_nan_not_a_number():
    f = jax.jit(lambda T: log_density(temper(loc_model, T), (), {}, {"mu": 0.1})[0])
    assert np.isfinite(f(2.0))
    for bad in (0.0, -1.0, jnp.inf, jnp.nan):
        assert np.isnan(f(bad)), bad


def test_schedule_validation():
    with pytest.raises(ValueError, match="at step 3"):
        temper(loc_model, lambda step: 3.0 - step)
    with pytest.warns(UserWarning, match="not at T = 1"):
        temper(loc_model, schedules.linear(10.0, 2.0, num_steps=10))


def test_substitute_param_and_deterministic_pass_through():
    def model():
        s = numpyro.param("s", 1.0, constraint=dist.constraints.positive)
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.deterministic("twice", 2 * mu)
        numpyro.sample("x", dist.Normal(mu, s), obs=0.5)

    lp, tr = log_density(temper(model, 2.0), (), {}, {"mu": 0.2, "s": 3.0})
    expected = dist.Normal(0.0, 1.0).log_prob(0.2) + dist.Normal(0.2, 3.0).log_prob(0.5) / 2
    np.testing.assert_allclose(lp, expected, rtol=1e-6)
    assert float(tr["twice"]["value"]) == pytest.approx(0.4)


def test_annealed_wrapper_carries_the_clock_through_trace_enum_elbo():
    from numpyro.contrib.funsor import config_enumerate
    from numpyro.infer import TraceEnum_ELBO

    from numpyro_tempering.objectives import Annealed

    x = jnp.array([2.0, -2.1, 1.9])

    @config_enumerate
    def model():
        loc = numpyro.sample("loc", dist.Normal(0.0, 5.0))
        with numpyro.plate("data", 3):
            z = numpyro.sample("z", dist.Bernoulli(0.3))
            numpyro.sample("x", dist.Normal(jnp.where(z, loc, -loc), 1.0), obs=x)

    def guide():
        numpyro.sample("loc", dist.Normal(numpyro.param("m", 0.5), 0.1))

    sched = schedules.linear(5.0, 1.0, num_steps=4)
    annealed = temper(model, sched, latent="z")
    params = {"m": jnp.array(0.7)}
    key = jax.random.PRNGKey(3)
    for step in range(6):
        clock = {"_temper_clock": {"step": jnp.array(step), "temperature": jnp.array(0.0)}}
        out = Annealed(TraceEnum_ELBO()).loss_with_mutable_state(
            key, {**params, **clock}, annealed, guide
        )
        fixed = TraceEnum_ELBO().loss(
            key, params, temper(model, float(sched(step)), latent="z"), guide
        )
        np.testing.assert_allclose(out["loss"], fixed, rtol=1e-6)
        new = out["mutable_state"]["_temper_clock"]
        assert int(new["step"]) == step + 1
        np.testing.assert_allclose(new["temperature"], sched(step), rtol=1e-6)


def test_annealed_wrapper_keeps_the_clock_of_trace_elbo_with_several_particles():
    from numpyro.infer import SVI, Trace_ELBO

    from numpyro_tempering.objectives import Annealed

    def guide():
        numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), 1.0))

    model = temper(loc_model, schedules.linear(3.0, 1.0, num_steps=5))
    svi = SVI(model, guide, numpyro.optim.Adam(0.01), Annealed(Trace_ELBO(num_particles=3)))
    result = svi.run(jax.random.PRNGKey(0), 7, progress_bar=False)
    assert int(result.state.mutable_state["_temper_clock"]["step"]) == 7


def test_condition_outside_a_scope_tempers_the_site_it_conditions():
    """``condition(scope(temper(model)), {"a/y": y})``: temper asked the outer condition for
    "y" while it holds "a/y", took y for a latent and left the likelihood untempered
    (-19.40 where the tempered density is -8.29; found by a probe). The outer handlers are
    now asked with the name the scopes in between give the site; likewise a ``reparam``
    behind a scope is refused as documented (it crashed inside NumPyro)."""
    T, tau = 2.5, 1.3
    lik = dist.Normal(0.0, 1 / jnp.sqrt(tau)).log_prob(Y).sum()
    exact = dist.Gamma(A, B).log_prob(tau) + lik / T
    scoped = handlers.scope(temper(latent_y_model, T), prefix="a")
    got = log_density(handlers.condition(scoped, {"a/y": Y}), (), {}, {"a/tau": tau})[0]
    assert got == pytest.approx(float(exact), rel=1e-6)
    by_fn = handlers.condition(scoped, condition_fn=lambda m: Y if m["name"] == "a/y" else None)
    assert log_density(by_fn, (), {}, {"a/tau": tau})[0] == pytest.approx(float(exact), rel=1e-6)

    def loc_model():
        mu = numpyro.sample("mu", dist.Normal(1.0, 2.0))
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=0.5)

    behind = handlers.reparam(handlers.scope(temper(loc_model, T, latent="mu"), prefix="a"),
                              {"a/mu": LocScaleReparam(0.0)})
    with pytest.raises(ValueError, match="latent site 'mu' is tempered inside a `reparam`"):
        log_density(behind, (), {}, {"a/mu_decentered": 0.25})


def test_gibbs_kernels_hold_latents_fixed_without_tempering_their_prior():
    """DiscreteHMCGibbs, MixedHMC and HMCGibbs evaluate the model under NumPyro's
    ``gibbs.conditioned`` (``condition`` and ``substitute`` with one dict of the Gibbs
    sites' values). temper took the conditioned discrete latent z for data and tempered
    p(z | theta) too: DiscreteHMCGibbs(NUTS(temper(model, 3))) sampled E[theta] = 0.287
    where the tempered posterior has 0.525 (found by a probe). The density the kernels
    evaluate is now the exact one; ``latent="z"`` still tempers z on request."""
    from numpyro.infer.gibbs import GIBBS_SITES_KWARG, conditioned

    T, theta, z, x = 3.0, 0.3, 1, 1.5

    def model():
        th = numpyro.sample("th", dist.Normal(0.0, 1.0))
        zz = numpyro.sample("z", dist.Bernoulli(logits=3.0 * th))
        numpyro.sample("x", dist.Normal(4.0 * zz - 2.0, 1.0), obs=x)

    prior = dist.Normal(0.0, 1.0).log_prob(theta)
    p_z = dist.Bernoulli(logits=3.0 * theta).log_prob(z)
    lik = dist.Normal(4.0 * z - 2.0, 1.0).log_prob(x)
    gibbs = {GIBBS_SITES_KWARG: {"z": z}}
    got = log_density(conditioned(temper(model, T)), (), gibbs, {"th": theta})[0]
    assert got == pytest.approx(float(prior + p_z + lik / T), rel=1e-6)
    both = log_density(conditioned(temper(model, T, latent="z")), (), gibbs, {"th": theta})[0]
    assert both == pytest.approx(float(prior + p_z / T + lik / T), rel=1e-6)
    # a user's condition supplies data: tempered, as before
    data = log_density(handlers.condition(temper(model, T), {"z": z}), (), {}, {"th": theta})[0]
    assert data == pytest.approx(float(prior + p_z / T + lik / T), rel=1e-6)


def test_laplace_on_an_annealed_model_needs_the_clock_with_the_parameters():
    """AutoLaplaceApproximation takes its Hessian at the parameters it is given; without
    the schedule's clock the annealed model ran at schedule(0): after annealing 10 -> 1 the
    posterior variance came out 0.96 (that of T = 10) where T = 1 gives 0.0996 (found by a
    probe). Refused now, and right with the clock."""
    import optax
    from numpyro.infer import SVI
    from numpyro.infer.autoguide import AutoLaplaceApproximation

    from numpyro_tempering import TemperedELBO

    def model():
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with numpyro.plate("data", 8):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=Y)

    annealed = temper(model, schedules.linear(10.0, 1.0, num_steps=100))
    guide = AutoLaplaceApproximation(annealed)
    res = SVI(annealed, guide, optax.adam(0.1), TemperedELBO()).run(
        jax.random.PRNGKey(0), 400, progress_bar=False)
    with pytest.raises(ValueError, match="no schedule clock"):
        guide.get_posterior(res.params)
    posterior = guide.get_posterior({**res.params, **res.state.mutable_state})
    exact = 1.0 / (1.0 / 25.0 + 8.0)  # T = 1 at the end of the schedule
    assert float(posterior.covariance_matrix[0, 0]) == pytest.approx(exact, rel=1e-3)


def test_resuming_through_init_params_continues_the_schedule_where_it_stopped():
    """``SVI.init(init_params={**params, **mutable_state})`` runs the model once with the
    saved clock; temper advanced it there, so the resumed fit skipped a step (T =
    schedule(13) at its first update instead of schedule(12); found by a probe). SVI.init
    takes no step now."""
    import optax
    from numpyro.infer import SVI

    from numpyro_tempering import TemperedELBO

    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)

    def guide(x):
        numpyro.sample("mu", dist.Delta(numpyro.param("m", 0.7)))

    sched = schedules.linear(10.0, 1.0, 20)
    svi = SVI(temper(model, sched), guide, optax.sgd(0.0), TemperedELBO())
    done = svi.run(jax.random.PRNGKey(0), 12, 0.3, progress_bar=False)
    resumed = svi.init(jax.random.PRNGKey(1), 0.3,
                       init_params={**done.params, **done.state.mutable_state})
    assert int(resumed.mutable_state["_temper_clock"]["step"]) == 12
    _, loss = svi.update(resumed, 0.3)
    prior = dist.Normal(0.0, 1.0).log_prob(0.7)
    lik = dist.Normal(0.7, 1.0).log_prob(0.3)
    assert float(lik / (-loss - prior)) == pytest.approx(float(sched(12)), rel=1e-5)
