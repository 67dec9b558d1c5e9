"""The `temper` handler: exact log densities, selection, composition and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpyro import handlers
from numpyro.infer.util import log_density

from numpyro_tempering import schedules, temper
from numpyro_tempering.handlers import TEMPERED, Selection

X = jnp.array([0.3, -1.2, 2.0, 0.7])
PARAMS = {"mu": 0.4, "z": jnp.array([0.1, -0.5, 0.2, 1.0])}


def model(x=X):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0]):
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
        numpyro.sample("x", dist.Normal(z, 0.5), obs=x)


def by_hand(T=1.0, T_z=1.0, mu=PARAMS["mu"], z=PARAMS["z"], x=X):
    prior = dist.Normal(0.0, 2.0).log_prob(mu)
    local = dist.Normal(mu, 1.0).log_prob(z).sum()
    lik = dist.Normal(z, 0.5).log_prob(x).sum()
    return prior + local / T_z + lik / T


def logp(fn, params=PARAMS, args=()):
    return log_density(fn, args, {}, params)[0]


def test_log_density_is_prior_plus_likelihood_over_T():
    np.testing.assert_allclose(logp(temper(model, 3.0)), by_hand(T=3.0), rtol=1e-6)


def test_latent_sites_are_tempered_jointly_with_the_likelihood():
    out = logp(temper(model, 2.5, latent=("z",)))
    np.testing.assert_allclose(out, by_hand(T=2.5, T_z=2.5), rtol=1e-6)


def test_sites_by_name_and_by_predicate():
    only_z = logp(temper(model, 2.0, sites="z"))
    np.testing.assert_allclose(only_z, by_hand(T_z=2.0), rtol=1e-6)
    pred = logp(temper(model, 2.0, sites=lambda msg: msg["name"] in ("z", "x")))
    np.testing.assert_allclose(pred, by_hand(T=2.0, T_z=2.0), rtol=1e-6)


def test_a_selection_value_tempers_as_its_keywords_do():
    sel = Selection.of(latent="z", exclude=())
    assert temper(model, 2.0, sites=sel).selection is sel
    np.testing.assert_allclose(
        logp(temper(model, 2.0, sites=sel)), logp(temper(model, 2.0, latent="z")), rtol=1e-7
    )
    assert Selection.of(["x", "z"], latent=("z",)) == Selection.of(("z", "x"), latent="z")
    assert hash(Selection.of(latent=["z"])) == hash(Selection.of(latent="z"))
    assert Selection(sites=["x"], latent="z") == Selection.of("x", latent=("z",))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sites=Selection(), latent="z"), "either a Selection"),
        (dict(joint="yes"), "`joint` must be True or False"),
        (dict(latent=3), "`latent` must be a site name"),
        (dict(exclude=["x", 1]), "`exclude` must be site names"),
    ],
)
def test_bad_selection_names_the_argument(kwargs, match):
    with pytest.raises(TypeError, match=match):
        temper(model, 2.0, **kwargs)


def test_marks_exactly_the_tempered_sites():
    tr = handlers.trace(handlers.substitute(temper(model, 2.0), PARAMS)).get_trace()
    marked = {n for n, s in tr.items() if s["type"] == "sample" and s["infer"].get(TEMPERED)}
    assert marked == {"x"}


def factor_model():
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    numpyro.factor("penalty", -(mu**2))
    numpyro.factor("loglik", -3.0 * (mu - 1.0) ** 2)


def test_factor_sites_are_likelihood_by_default_and_can_be_excluded():
    prior = dist.Normal(0.0, 1.0).log_prob(0.5)
    pen, lik = -(0.5**2), -3.0 * 0.25
    out = logp(temper(factor_model, 4.0), {"mu": 0.5})
    np.testing.assert_allclose(out, prior + (pen + lik) / 4.0, rtol=1e-6)
    out = logp(temper(factor_model, 4.0, exclude="penalty"), {"mu": 0.5})
    np.testing.assert_allclose(out, prior + pen + lik / 4.0, rtol=1e-6)


def test_context_manager_and_decorator_forms():
    def inner():
        with temper(temperature=2.0):
            model()

    np.testing.assert_allclose(logp(inner), by_hand(T=2.0), rtol=1e-6)

    @temper(temperature=2.0)
    def decorated():
        model()

    np.testing.assert_allclose(logp(decorated), by_hand(T=2.0), rtol=1e-6)


def test_per_datapoint_temperature_array():
    T = jnp.array([1.0, 2.0, 4.0, 8.0])
    out = logp(temper(model, T))
    lik = (dist.Normal(PARAMS["z"], 0.5).log_prob(X) / T).sum()
    expected = by_hand(T=jnp.inf) + lik
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_per_datapoint_temperature_of_wrong_shape_names_the_site():
    with pytest.raises(ValueError, match="site 'x'"):
        logp(temper(model, jnp.ones(3) * 2.0))


def test_vmap_over_a_vector_of_temperatures():
    temps = jnp.array([1.0, 2.0, 5.0, 10.0])
    out = jax.vmap(lambda T: logp(temper(model, T)))(temps)
    expected = jnp.stack([by_hand(T=float(t)) for t in temps])
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_traced_temperature_under_jit():
    f = jax.jit(lambda T: logp(temper(model, T)))
    np.testing.assert_allclose(f(3.0), by_hand(T=3.0), rtol=1e-6)
    np.testing.assert_allclose(f(7.0), by_hand(T=7.0), rtol=1e-6)


def test_composes_with_subsampled_plate():
    def sub_model():
        with numpyro.plate("data", 100, subsample_size=4) as idx:
            numpyro.sample("x", dist.Normal(0.0, 1.0), obs=jnp.arange(4.0)[jnp.argsort(idx)])

    tr = handlers.trace(handlers.seed(temper(sub_model, 5.0), 0)).get_trace()
    assert tr["x"]["scale"] == 25.0  # the subsample scale is untouched; the density is tempered
    lp = log_density(handlers.seed(temper(sub_model, 5.0), 0), (), {}, {})[0]
    x = tr["x"]["value"]
    np.testing.assert_allclose(lp, 25.0 * dist.Normal(0.0, 1.0).log_prob(x).sum() / 5.0, rtol=1e-6)


def test_composes_with_condition_and_seed():
    # `condition` turns z into data: it is then tempered with the likelihood
    conditioned = handlers.condition(model, {"z": PARAMS["z"]})
    out = logp(temper(conditioned, 2.0), {"mu": PARAMS["mu"]})
    np.testing.assert_allclose(out, by_hand(T=2.0, T_z=2.0), rtol=1e-6)
    tr = handlers.trace(handlers.seed(temper(model, 2.0), 3)).get_trace()
    tr2 = handlers.trace(handlers.seed(model, 3)).get_trace()
    np.testing.assert_array_equal(tr["z"]["value"], tr2["z"]["value"])


positive_T = st.floats(0.05, 50.0, allow_nan=False)


@settings(max_examples=25, deadline=None)
@given(T1=positive_T, T2=positive_T, s=st.floats(0.1, 10.0))
def test_properties_identity_stacking_and_scale(T1, T2, s):
    base = logp(model)
    np.testing.assert_allclose(logp(temper(model, 1.0)), base, rtol=1e-6)
    twice = logp(temper(temper(model, T1), T2))
    np.testing.assert_allclose(twice, by_hand(T=T1 * T2), rtol=2e-5, atol=1e-5)
    scaled = logp(handlers.scale(temper(model, T1), s))
    np.testing.assert_allclose(scaled, s * by_hand(T=T1), rtol=2e-5, atol=1e-5)
    inner_scaled = logp(temper(handlers.scale(model, s), T1))
    np.testing.assert_allclose(inner_scaled, s * by_hand(T=T1), rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_float32_and_float64(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        x = jnp.asarray(X, dtype)
        params = {k: jnp.asarray(v, dtype) for k, v in PARAMS.items()}
        out = log_density(temper(model, jnp.asarray(3.0, dtype)), (x,), {}, params)[0]
        assert out.dtype == dtype
        expected = by_hand(T=3.0, mu=params["mu"], z=params["z"], x=x)
        tol = 1e-12 if dtype == jnp.float64 else 1e-6
        np.testing.assert_allclose(out, expected, rtol=tol)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), jnp.array([1.0, -2.0])])
def test_bad_temperature_names_the_argument(bad):
    with pytest.raises(ValueError, match="temperature"):
        temper(model, bad)


def test_schedule_returning_non_finite_is_rejected():
    with pytest.raises(ValueError, match="schedule"):
        temper(model, lambda step: jnp.nan * step)


def test_unknown_site_lists_the_sites_that_exist():
    with pytest.raises(ValueError, match=r"'zz'.*\['mu', 'x', 'z'\]"):
        logp(temper(model, 2.0, latent=("zz",)))


def test_model_with_nothing_to_temper_is_not_tempered():
    def prior_only():
        numpyro.sample("mu", dist.Normal(0.0, 1.0))

    out = logp(temper(prior_only, 2.0), {"mu": 0.3})
    np.testing.assert_allclose(out, dist.Normal(0.0, 1.0).log_prob(0.3), rtol=1e-6)


def test_schedule_clock_reads_the_step_from_mutable_state():
    sched = schedules.linear(10.0, 1.0, num_steps=9)
    clock = {"_temper_clock": {"step": jnp.array(3), "temperature": jnp.array(0.0)}}
    tr = handlers.trace(handlers.substitute(temper(model, sched), {**PARAMS, **clock})).get_trace()
    np.testing.assert_allclose(tr["x"]["fn"].inv_temperature, 1.0 / 7.0, rtol=1e-6)
    state = tr["_temper_clock"]["value"]
    assert int(state["step"]) == 4 and float(state["temperature"]) == pytest.approx(7.0)
    # without SVI's state (e.g. a bare log_density) the schedule starts at step 0
    np.testing.assert_allclose(logp(temper(model, sched)), by_hand(T=10.0), rtol=1e-6)


W = jnp.array([0.3, 0.7])
LOCS = jnp.array([-2.0, 1.5])


def mixture_model(x=X):
    shift = numpyro.sample("shift", dist.Normal(0.0, 1.0))
    mix = dist.MixtureSameFamily(dist.Categorical(W), dist.Normal(LOCS + shift, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", mix, obs=x)


def explicit_mixture_model(x=X):
    shift = numpyro.sample("shift", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        z = numpyro.sample("z", dist.Categorical(W))
        numpyro.sample("x", dist.Normal(LOCS[z] + shift, 1.0), obs=x)


@pytest.mark.parametrize("T", [1.0, 3.0, 10.0])
def test_joint_tempering_equals_tempering_the_explicit_local_then_summing(T):
    # paper eq. 4 with p(x_n, z_n | beta)^(1/T): brute force over z of the explicit model
    shift = 0.3
    configs = jnp.stack(jnp.meshgrid(*[jnp.arange(2)] * X.shape[0], indexing="ij"), -1)
    configs = configs.reshape(-1, X.shape[0])
    explicit = temper(explicit_mixture_model, T, latent="z")
    per_config = jax.vmap(lambda z: logp(explicit, {"shift": shift, "z": z}))(configs)
    brute = jax.scipy.special.logsumexp(per_config)
    joint = logp(temper(mixture_model, T, joint=True), {"shift": shift})
    np.testing.assert_allclose(joint, brute, rtol=1e-5)
    marginal = logp(temper(mixture_model, T), {"shift": shift})
    if T > 1:  # tempering the marginal instead is a different density
        assert abs(float(marginal - joint)) > 1e-2
    else:
        np.testing.assert_allclose(marginal, joint, rtol=1e-6)


def wrapped_mixture_model(wrap, x=X):
    shift = numpyro.sample("shift", dist.Normal(0.0, 1.0))
    mix = dist.MixtureSameFamily(dist.Categorical(W), dist.Normal(LOCS + shift, 1.0))
    if wrap == "to_event":
        numpyro.sample("x", mix.expand([x.shape[0]]).to_event(1), obs=x)
        return
    with numpyro.plate("data", x.shape[0]):
        if wrap == "mask":
            numpyro.sample("x", mix.mask(MASK), obs=x)
        else:  # a scalar observation broadcast over the plate: one copy per element
            numpyro.sample("x", mix, obs=x[0])


MASK = jnp.arange(X.shape[0]) % 2 == 0


@pytest.mark.parametrize("wrap", ["mask", "to_event", "broadcast"])
@pytest.mark.parametrize("T", [1.0, 2.5])
def test_joint_tempering_sees_through_numpyros_wrappers(wrap, T):
    """A mixture inside .mask(...), .to_event(...) or a plate that broadcasts a scalar
    observation is tempered jointly, element by element, the wrappers acting as on the
    untempered density (they used to be skipped: a mask or to_event fell back to the
    marginal, and a broadcast observation counted once, wrong even at T = 1)."""
    shift = 0.3
    comp = dist.Normal(LOCS + shift, 1.0).log_prob(X[:, None]) + jnp.log(W)  # (N, K)
    if wrap == "broadcast":
        comp = jnp.broadcast_to(comp[:1], comp.shape)
    per = jax.scipy.special.logsumexp(comp / T, -1)
    if wrap == "mask":
        per = jnp.where(MASK, per, 0.0)
    prior = dist.Normal(0.0, 1.0).log_prob(shift)
    got = logp(temper(wrapped_mixture_model, T, joint=True), {"shift": shift}, (wrap,))
    np.testing.assert_allclose(got, prior + per.sum(), rtol=1e-5)
    plain = logp(wrapped_mixture_model, {"shift": shift}, (wrap,))
    np.testing.assert_allclose(logp(temper(wrapped_mixture_model, 1.0, joint=True),
                                    {"shift": shift}, (wrap,)), plain, rtol=1e-6)


def test_stacked_joint_handlers_multiply_and_a_marginal_inside_is_refused():
    """temper(temper(m, 2, joint=True), 1.5, joint=True) is joint tempering at T = 3 (as
    stacked handlers multiply); a joint handler around a marginal one cannot recover the
    joint and refuses (it used to temper the inner tempered marginal)."""
    shift = 0.3
    stacked = temper(temper(mixture_model, 2.0, joint=True), 1.5, joint=True)
    np.testing.assert_allclose(logp(stacked, {"shift": shift}),
                               logp(temper(mixture_model, 3.0, joint=True), {"shift": shift}),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="already tempers marginally"):
        logp(temper(temper(mixture_model, 2.0), 1.5, joint=True), {"shift": shift})


def test_joint_tempering_normaliser_follows_the_wrappers():
    """log Z of a jointly tempered site: per element log sum_k w_k^(1/T) Z_k(T) (Normal
    components: Z_k = (1 - 1/T)/2 log(2 pi) + log(T)/2), 0 where masked, summed by
    to_event."""
    from numpyro_tempering.handlers import JointlyTempered
    from numpyro_tempering.partition import tempered_log_normalizer

    T = 2.5
    mix = dist.MixtureSameFamily(dist.Categorical(W), dist.Normal(LOCS, 1.0))
    per = jax.scipy.special.logsumexp(
        jnp.log(W) / T + (1 - 1 / T) / 2 * jnp.log(2 * jnp.pi) + jnp.log(T) / 2)
    masked = tempered_log_normalizer(JointlyTempered(mix.expand([4]).mask(MASK[:4]), 1.0), T)
    np.testing.assert_allclose(masked, jnp.where(MASK[:4], per, 0.0), rtol=1e-5)
    event = tempered_log_normalizer(JointlyTempered(mix.expand([4]).to_event(1), 1.0), T)
    np.testing.assert_allclose(event, 4 * per, rtol=1e-5)


def test_joint_tempering_leaves_sites_without_components_to_scale():
    np.testing.assert_allclose(logp(temper(model, 3.0, joint=True)), by_hand(T=3.0), rtol=1e-6)


def test_schedule_arguments_are_checked_with_the_argument_named():
    """An array temperature for a schedule, a ladder averaging below 1 (from_ladder named
    `start` and `allow_below_one`, which it does not take) and num_steps=True (a one-step
    schedule) were accepted or unclear."""
    with pytest.raises(ValueError, match="`temperature` must be a scalar"):
        schedules.constant(jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="mean temperature is 0.75 < 1"):
        schedules.from_ladder([0.5, 1.0], 10)
    with pytest.raises(ValueError, match="`num_steps` must be a positive integer"):
        schedules.linear(10.0, 1.0, num_steps=True)


@pytest.mark.parametrize("make", [schedules.linear, schedules.geometric])
def test_a_staircase_schedule_ends_at_num_steps_even_when_every_does_not_divide_it(make):
    """``linear(10, 1, 100, every=30)`` held T(90) = 1.9 until step 120: the staircase
    floored step 100 to 90 after the snap to T = 1 (found by a probe). T reaches ``end``
    at ``num_steps``, as documented, and holds every 30 steps before it."""
    sched = make(10.0, 1.0, 100, every=30)
    plain = make(10.0, 1.0, 100)
    assert float(sched(100)) == 1.0 and float(sched(119)) == 1.0
    assert float(sched(99)) == pytest.approx(float(plain(90)))
    assert float(sched(59)) == pytest.approx(float(plain(30)))


def test_a_ladder_schedule_refuses_temperatures_that_are_not_positive():
    """from_ladder([-5, 10], ...) was accepted (its mean is 2.5): found by a probe."""
    with pytest.raises(ValueError, match="`temperatures` must be finite and > 0"):
        schedules.from_ladder([-5.0, 10.0], 100)
