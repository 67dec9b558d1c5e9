"""TemperedELBO and the log-weight engine: exactness at T = 1, conjugate posteriors, one trace."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro import handlers
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

from numpyro_tempering import TemperedELBO, log_weights, schedules, temper

# ---------------------------------------------------------------------------------------
# Normal-Normal: mu ~ N(0, 1/tau0), x_i ~ N(mu, 1/tau). Tempering the likelihood at T gives
# the posterior precision tau0 + n tau / T and mean (tau / T) sum(x) / precision.
TAU0, TAU = 0.5, 4.0
X = jnp.array([1.3, 0.4, 2.1, 1.7, 0.9, 1.1, 1.5, 0.2, 1.9, 1.0])


def normal_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, TAU0**-0.5))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, TAU**-0.5), obs=x)


def normal_guide(x):
    loc = numpyro.param("loc", 0.0)
    scale = numpyro.param("scale", 1.0, constraint=dist.constraints.positive)
    numpyro.sample("mu", dist.Normal(loc, scale))


def tempered_normal_posterior(T, x=X):
    precision = TAU0 + x.shape[0] * TAU / T
    return (TAU / T) * x.sum() / precision, precision**-0.5


PARAMS = {"loc": jnp.array(0.7), "scale": jnp.array(0.4)}
KEY = jax.random.PRNGKey(11)


@pytest.mark.parametrize("num_particles", [1, 5])
def test_T1_value_and_gradient_equal_trace_elbo(num_particles):
    def value_and_grad(elbo):
        return jax.value_and_grad(lambda p: elbo.loss(KEY, p, normal_model, normal_guide, X))(
            PARAMS
        )

    ref, ref_grad = value_and_grad(Trace_ELBO(num_particles=num_particles))
    out, grad = value_and_grad(TemperedELBO(num_particles, temperature=1.0))
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    for k in PARAMS:
        np.testing.assert_allclose(grad[k], ref_grad[k], rtol=1e-6)


def test_T1_equals_trace_elbo_with_an_autoguide():
    guide = AutoNormal(normal_model)
    svi = SVI(normal_model, guide, optax.adam(0.1), Trace_ELBO())
    params = svi.get_params(svi.init(KEY, X))
    ref = Trace_ELBO(num_particles=3).loss(KEY, params, normal_model, guide, X)
    out = TemperedELBO(3, temperature=1.0).loss(KEY, params, normal_model, guide, X)
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_tempered_elbo_matches_eq7_by_hand():
    # eq. 7 with one particle: log p(mu) + log p(x | mu) / T - log q(mu), same draw as Trace_ELBO
    T = 3.0
    lw = log_weights(KEY, PARAMS, temper(normal_model, 1.0), normal_guide, (X,))
    model_seed, guide_seed = jax.random.split(KEY)
    tr = numpyro.handlers.trace(
        numpyro.handlers.seed(numpyro.handlers.substitute(normal_guide, PARAMS), guide_seed)
    ).get_trace(X)
    mu = tr["mu"]["value"]
    expected = (
        dist.Normal(0.0, TAU0**-0.5).log_prob(mu)
        + dist.Normal(mu, TAU**-0.5).log_prob(X).sum() / T
        - dist.Normal(PARAMS["loc"], PARAMS["scale"]).log_prob(mu)
    )
    out = -TemperedELBO(temperature=T).loss(KEY, PARAMS, normal_model, normal_guide, X)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(lw.tempered_log_w(1 / T)[0], expected, rtol=1e-6)


def test_engine_plate_elements_sum_to_the_likelihood():
    lw = log_weights(
        KEY, PARAMS, temper(normal_model, 1.0), normal_guide, (X,), num_particles=3, plate="data"
    )
    assert lw.log_lik_elements.shape == (3, X.shape[0])
    np.testing.assert_allclose(lw.log_lik_elements.sum(-1), lw.log_lik, rtol=1e-6)
    assert float(lw.plate_scale) == 1.0
    with pytest.raises(ValueError, match="plate 'docs' is not in the model"):
        log_weights(KEY, PARAMS, temper(normal_model, 1.0), normal_guide, (X,), plate="docs")


def fit(model, guide, elbo, steps, lr, key=KEY, args=(X,)):
    schedule = optax.exponential_decay(lr, steps, 0.01)
    svi = SVI(model, guide, optax.adam(schedule), elbo)
    return svi.run(key, steps, *args, progress_bar=False)


@pytest.mark.parametrize("T", [1.0, 4.0])
def test_svi_recovers_tempered_normal_posterior(T):
    result = fit(normal_model, normal_guide, TemperedELBO(16, temperature=T), 3000, 0.05)
    mean, sd = tempered_normal_posterior(T)
    # The Normal guide contains the exact tempered posterior; with 16 particles and a learning
    # rate decayed 100x the remaining optimisation noise is ~1% of sd (checked over seeds), so
    # 5% of sd on the mean and 5% relative on the sd fail for any wrong precision formula
    # (T = 4 halves... the sd differs by > 40% from the untempered one).
    np.testing.assert_allclose(result.params["loc"], mean, atol=0.05 * sd)
    np.testing.assert_allclose(result.params["scale"], sd, rtol=0.05)


# Beta-Bernoulli: p ~ Beta(a, b), x_i ~ Bernoulli(p). Tempered posterior Beta(a + s/T, b + (n-s)/T).
A, B = 2.0, 3.0
COINS = jnp.array([1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1], dtype=jnp.float32)


def beta_model(x):
    p = numpyro.sample("p", dist.Beta(A, B))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Bernoulli(p), obs=x)


def beta_guide(x):
    c1 = numpyro.param("c1", 1.0, constraint=dist.constraints.positive)
    c0 = numpyro.param("c0", 1.0, constraint=dist.constraints.positive)
    numpyro.sample("p", dist.Beta(c1, c0))


def test_svi_recovers_tempered_beta_bernoulli_posterior():
    T = 3.0
    s, n = float(COINS.sum()), COINS.shape[0]
    result = fit(beta_model, beta_guide, TemperedELBO(16, temperature=T), 4000, 0.05,
                 args=(COINS,))
    # Beta samples are reparameterised by implicit differentiation, so the guide family is
    # exact; concentrations are recovered to a few percent (noise ~1-2% over seeds, checked).
    np.testing.assert_allclose(result.params["c1"], A + s / T, rtol=0.08)
    np.testing.assert_allclose(result.params["c0"], B + (n - s) / T, rtol=0.08)
    # and the untempered answer is clearly excluded
    assert abs(float(result.params["c1"]) - (A + s)) > 3.0


def test_annealing_in_svi_run_compiles_once_and_follows_the_schedule():
    traces = []

    def counted_model(x):
        traces.append(1)  # runs only while JAX traces (or SVI.init runs the model eagerly)
        normal_model(x)

    sched = schedules.linear(10.0, 1.0, num_steps=30)
    svi = SVI(temper(counted_model, sched), normal_guide, optax.adam(0.01),
              TemperedELBO(num_particles=2))
    state = svi.init(KEY, X)
    n_init = len(traces)
    update = jax.jit(svi.update)
    temps = []
    for _ in range(40):
        state, _ = update(state, X)
        temps.append(float(state.mutable_state["_temper_clock"]["temperature"]))
    assert len(traces) - n_init == 1  # one trace for 40 steps while T changed
    np.testing.assert_allclose(temps, schedules.trajectory(sched, 40), rtol=1e-6)
    assert temps[0] == 10.0 and temps[-1] == 1.0
    assert int(state.mutable_state["_temper_clock"]["step"]) == 40


def test_svi_run_with_progress_bar_and_scan_agree():
    sched = schedules.geometric(5.0, 1.0, num_steps=20)
    svi = SVI(temper(normal_model, sched), normal_guide, optax.adam(0.01), TemperedELBO())
    a = svi.run(KEY, 25, X, progress_bar=False)
    b = svi.run(KEY, 25, X, progress_bar=True)
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-5)
    assert int(b.state.mutable_state["_temper_clock"]["step"]) == 25


def test_annealed_loss_uses_the_scheduled_temperature():
    sched = schedules.linear(8.0, 1.0, num_steps=10)
    svi = SVI(temper(normal_model, sched), normal_guide, optax.sgd(0.0), TemperedELBO())
    state = svi.init(KEY, X)
    for step in range(12):
        params = svi.get_params(state)
        key = jax.random.split(state.rng_key)[1]
        expected = TemperedELBO(temperature=float(sched(step))).loss(key, params, normal_model,
                                                         normal_guide, X)
        state, loss = svi.update(state, X)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)


def _count_primitive(jaxpr, name: str, inside: str | None = None) -> int:
    """Equations of primitive ``name`` in ``jaxpr`` and its sub-jaxprs (only those inside
    an equation of primitive ``inside``, if given)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name and inside is None:
            total += 1
        for sub in jax.core.jaxprs_in_params(eqn.params):
            within = None if inside is None or eqn.primitive.name == inside else inside
            total += _count_primitive(sub, name, within)
    return total


@pytest.mark.parametrize("vectorize", [False, True])
def test_schedule_clock_is_read_once_per_step_outside_the_particle_map(vectorize):
    # a schedule with a marker primitive (cosh): T(step) must be evaluated once per step,
    # outside the particles' map, not inside lax.map's body (where it would run S times)
    def sched(step):
        return 1.0 + jnp.cosh(0.0 * jnp.asarray(step, jnp.float32))

    elbo = TemperedELBO(4, vectorize_particles=vectorize)
    params = {"loc": 0.1, "scale": 1.0,
              "_temper_clock": {"step": jnp.array(3), "temperature": jnp.array(2.0)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the schedule ends at T = 2
        model = temper(normal_model, sched)

    def loss(params):
        out = elbo.loss_with_mutable_state(KEY, params, model, normal_guide, X)
        return out["loss"], out["mutable_state"]

    jaxpr = jax.make_jaxpr(loss)(params).jaxpr
    assert _count_primitive(jaxpr, "cosh") == 1
    if not vectorize:
        assert _count_primitive(jaxpr, "scan") == 1
        assert _count_primitive(jaxpr, "cosh", inside="scan") == 0
    value, state = loss(params)
    expected = TemperedELBO(4, vectorize_particles=vectorize, temperature=2.0).loss(
        KEY, params, normal_model, normal_guide, X)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    assert int(state["_temper_clock"]["step"]) == 4
    assert float(state["_temper_clock"]["temperature"]) == 2.0


def scale_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, s), obs=x)


@pytest.mark.parametrize("num_particles", [1, 4])
def test_runtime_temperature_derivatives_equal_a_literal_ones(num_particles):
    # A traced T (a schedule's) goes through engine._tempered_total, whose derivative applies
    # 1/T to the inputs' tangents (so that XLA folds the likelihood's per-element backward
    # pass as for Trace_ELBO): value, gradient, forward mode and second order all equal the
    # literal T's (which takes the ordinary path).
    guide = AutoNormal(scale_model)
    svi = SVI(scale_model, guide, optax.adam(0.1), Trace_ELBO())
    params = svi.get_params(svi.init(KEY, X))

    def loss(params, T):
        return TemperedELBO(num_particles, temperature=T).loss(KEY, params, scale_model, guide, X)

    # the loss is A + B / T at a fixed key: B from two literal temperatures
    b = 2.0 * (loss(params, 1.0) - loss(params, 2.0))
    for T in (0.7, 3.0):
        literal = jax.value_and_grad(loss)(params, T)
        traced = jax.jit(jax.value_and_grad(loss))(params, jnp.asarray(T))
        for x, y in zip(jax.tree.leaves(literal), jax.tree.leaves(traced), strict=True):
            np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)
        second = jax.jit(jax.hessian(lambda t: loss(params, t)))(jnp.asarray(T))
        np.testing.assert_allclose(second, 2.0 * b / T**3, rtol=1e-4)
        direction = jax.tree.map(jnp.ones_like, params)
        _, tangent = jax.jvp(lambda p, t=T: loss(p, jnp.asarray(t)), (params,), (direction,))
        grad = jax.grad(loss)(params, T)
        expected = sum(jnp.sum(g) for g in jax.tree.leaves(grad))
        np.testing.assert_allclose(tangent, expected, rtol=1e-5)


def _seams_subsample_param_factor(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    w = numpyro.param("w", 0.7)
    with numpyro.plate("data", x.shape[0], subsample_size=6) as idx:
        numpyro.sample("x", dist.Normal(mu, s), obs=x[idx])
    numpyro.factor("f", -w * (mu - 1.0) ** 2)


def _seams_masked(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("data", x.shape[0]), handlers.mask(mask=x > 0.5):
        numpyro.sample("x", dist.Normal(mu, s), obs=x)


def _seams_unobserved(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, s))


@pytest.mark.parametrize("case", ["subsample_param_factor", "mask", "condition"])
def test_runtime_temperature_equals_a_literal_one_through_numpyros_seams(case):
    # engine._tempered_total under a subsampled plate (a site scale), numpyro.param and
    # numpyro.factor (a tempered Unit site), handlers.mask and handlers.condition
    model = {"subsample_param_factor": _seams_subsample_param_factor,
             "mask": _seams_masked,
             "condition": handlers.condition(_seams_unobserved, {"x": X})}[case]
    guide = AutoNormal(handlers.block(model, hide=["w"]))
    with handlers.seed(rng_seed=0):
        params = {k: v["value"] for k, v in handlers.trace(guide).get_trace(X).items()
                  if v["type"] == "param"}
    params["w"] = jnp.asarray(0.7)

    def loss(p, T):
        return TemperedELBO(3, temperature=T).loss(KEY, p, model, guide, X)

    literal = jax.value_and_grad(loss)(params, 2.5)
    traced = jax.jit(jax.value_and_grad(loss))(params, jnp.asarray(2.5))
    assert "custom_jvp_call" in str(jax.make_jaxpr(loss)(params, jnp.asarray(2.5)))
    for x, y in zip(jax.tree.leaves(literal), jax.tree.leaves(traced), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-5)


def test_runtime_temperature_on_a_distribution_that_does_not_rebuild():
    # a distribution keeping an attribute that is no pytree field cannot go through
    # _tempered_total (flatten/unflatten would drop it): it takes the ordinary path
    class Shifted(dist.Distribution):
        arg_constraints = {"loc": dist.constraints.real}
        support = dist.constraints.real

        def __init__(self, loc, n):
            self.loc = loc
            self.half = 0.5 * jnp.ones(n)  # not declared
            super().__init__((n,), ())

        def log_prob(self, value):
            return -self.half * (value - self.loc) ** 2

    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        numpyro.sample("x", Shifted(mu, x.shape[0]), obs=x)

    def guide(x):
        numpyro.sample("mu", dist.Normal(numpyro.param("loc", 0.3), 1.0))

    params = {"loc": 0.3}

    def loss(params, T):
        return TemperedELBO(2, temperature=T).loss(KEY, params, model, guide, X)

    literal = jax.value_and_grad(loss)(params, 2.0)
    traced = jax.jit(jax.value_and_grad(loss))(params, jnp.asarray(2.0))
    for x, y in zip(jax.tree.leaves(literal), jax.tree.leaves(traced), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5)


def test_schedule_given_to_the_elbo_points_to_temper():
    with pytest.raises(TypeError, match="temper\\(model, schedule\\)"):
        TemperedELBO(temperature=schedules.linear(10.0, 1.0, 100))


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf")])
def test_bad_temperature_in_the_elbo(bad):
    with pytest.raises(ValueError, match="temperature"):
        TemperedELBO(temperature=bad)


def local_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0]):
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
        numpyro.sample("x", dist.Normal(z, 0.5), obs=x)


def test_tempered_latent_sites_sampled_by_the_guide_are_in_the_likelihood_group():
    # the guide samples z: NumPyro's replay copies the guide's `infer` over the model's
    guide = AutoNormal(local_model)
    svi = SVI(local_model, guide, optax.adam(0.1), Trace_ELBO())
    params = svi.get_params(svi.init(KEY, X))
    lw = log_weights(KEY, params, temper(local_model, 1.0, latent="z"), guide, (X,),
                     plate="data")
    model_seed, guide_seed = jax.random.split(KEY)
    tr = numpyro.handlers.trace(
        numpyro.handlers.seed(numpyro.handlers.substitute(guide, params), guide_seed)
    ).get_trace(X)
    mu, z = tr["mu"]["value"], tr["z"]["value"]
    np.testing.assert_allclose(lw.log_prior[0], dist.Normal(0.0, 2.0).log_prob(mu), rtol=1e-6)
    lik = dist.Normal(mu, 1.0).log_prob(z) + dist.Normal(z, 0.5).log_prob(X)
    np.testing.assert_allclose(lw.log_lik_elements[0], lik, rtol=1e-5)
    # and the tempered ELBO at T divides exactly that group
    T = 2.5
    expected = lw.log_prior + lw.log_lik / T - lw.log_q
    out = -TemperedELBO(temperature=T, latent="z").loss(KEY, params, local_model, guide, X)
    np.testing.assert_allclose(out, expected[0], rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Drop-in for Trace_ELBO (issue 8, item 6): same value, gradient and warnings at T = 1 on
# models using what Trace_ELBO supports.
def sink_model(x):
    """A model param, handlers.scale, a subsampled plate, mask, factor and deterministic."""
    w = numpyro.param("w", 0.8, constraint=dist.constraints.positive)
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    numpyro.deterministic("mu2", mu**2)
    with numpyro.handlers.scale(scale=0.7):
        s = numpyro.sample("s", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0], subsample_size=4) as idx:
        xb = x[idx]
        with numpyro.handlers.mask(mask=xb > 0.5):
            numpyro.sample("x", dist.Normal(mu, s * w), obs=xb)
    numpyro.factor("penalty", -0.5 * mu**2)


def sink_guide(x):
    """With an auxiliary site and a deterministic site of its own."""
    m = numpyro.param("m", 0.3)
    sm = numpyro.param("sm", 0.5, constraint=dist.constraints.positive)
    u = numpyro.sample("u", dist.Normal(0.0, 1.0), infer={"is_auxiliary": True})
    numpyro.deterministic("u2", u**2)
    numpyro.sample("mu", dist.Normal(m + 0.1 * u, sm))
    numpyro.sample("s", dist.LogNormal(numpyro.param("ls", 0.1), 0.3))


def prior_only_model(x):
    """Nothing observed (nothing to temper); the guide below leaves 'b' to the prior."""
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    numpyro.sample("b", dist.Normal(a, 1.0))


def prior_only_guide(x):
    numpyro.sample("a", dist.Normal(numpyro.param("m", 0.3), 0.7))


def subsampled_local_model(x):
    """Local latents in a subsampled plate; the guide draws the subsample, the model replays it."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0], subsample_size=6) as idx:
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
        numpyro.sample("x", dist.Normal(z, 0.5), obs=x[idx])


def subsampled_local_guide(x):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.3), 0.5))
    z_loc = numpyro.param("z_loc", jnp.zeros(x.shape[0]))
    with numpyro.plate("data", x.shape[0], subsample_size=6) as idx:
        numpyro.sample("z", dist.Normal(z_loc[idx], 0.7))


PARITY_CASES = {
    "sink": lambda: (
        sink_model,
        sink_guide,
        {"w": jnp.array(0.8), "m": jnp.array(0.3), "sm": jnp.array(0.5), "ls": jnp.array(0.1)},
    ),
    "local_subsampled": lambda: (
        subsampled_local_model,
        subsampled_local_guide,
        {"m": jnp.array(0.3), "z_loc": 0.1 * jnp.arange(X.shape[0], dtype=jnp.float32)},
    ),
    "prior_only": lambda: (prior_only_model, prior_only_guide, {"m": jnp.array(0.3)}),
}


def _vmap_particles(fn, keys):
    return jax.vmap(fn)(keys)


# (num_particles, vectorize_particles, sum_sites)
PARITY_OPTIONS = {
    "1-vmap-sum": (1, True, True),
    "3-map-sites": (3, False, False),
    "3-callable-sum": (3, _vmap_particles, True),
    "3-callable-sites": (3, _vmap_particles, False),
}
PARITY_GRID = [
    ("sink", "1-vmap-sum"),
    ("sink", "3-map-sites"),
    ("sink", "3-callable-sum"),
    ("local_subsampled", "1-vmap-sum"),
    ("local_subsampled", "3-callable-sites"),
    ("prior_only", "1-vmap-sum"),
    ("prior_only", "3-map-sites"),
]

_PARITY_CACHE: dict = {}


def evaluate(case, make_elbo, options):
    """Loss, gradient and warnings of an objective, computed once per module."""
    key = (case, make_elbo.__name__, options)
    if key not in _PARITY_CACHE:
        model, guide, params = PARITY_CASES[case]()
        elbo = make_elbo(*PARITY_OPTIONS[options])

        def f(p):
            loss = elbo.loss(KEY, p, model, guide, X)
            return jax.tree.reduce(jnp.add, loss), loss

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (_, loss), grad = jax.value_and_grad(f, has_aux=True)(params)
        messages = {str(w.message) for w in caught}
        _PARITY_CACHE[key] = loss, grad, messages
    return _PARITY_CACHE[key]


def trace_elbo(n, vectorize, sum_sites):
    return Trace_ELBO(n, vectorize, False, sum_sites)


def tempered_elbo_at_1(n, vectorize, sum_sites):
    return TemperedELBO(n, vectorize, False, sum_sites, temperature=1.0)


def tempered_elbo_untempered(n, vectorize, sum_sites):
    return TemperedELBO(n, vectorize, False, sum_sites)


def assert_trees_close(a, b, rtol=2e-6):
    """Equal to float tolerance (a few ulps: Trace_ELBO sums the sites in another order)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)  # per-site dicts: same keys
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("case, options", PARITY_GRID)
def test_drop_in_parity_with_trace_elbo(case, options):
    ref_loss, ref_grad, ref_warnings = evaluate(case, trace_elbo, options)
    loss, grad, caught = evaluate(case, tempered_elbo_at_1, options)
    assert_trees_close(loss, ref_loss)
    assert_trees_close(grad, ref_grad)
    assert caught == ref_warnings
    if case == "prior_only":  # model/guide mismatch warned as Trace_ELBO warns
        assert any("Found vars in model but not guide" in m for m in caught)


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_without_a_temperature_an_untempered_model_is_trace_elbo(case):
    ref_loss, ref_grad, ref_warnings = evaluate(case, trace_elbo, "1-vmap-sum")
    loss, grad, caught = evaluate(case, tempered_elbo_untempered, "1-vmap-sum")
    assert_trees_close(loss, ref_loss)
    assert_trees_close(grad, ref_grad)
    assert caught == ref_warnings


def test_tempering_divides_exactly_the_observed_site_terms():
    # default selection: the observed 'x' (masked, subsampled) and the factor 'penalty'
    T = 2.5
    ref, _, _ = evaluate("sink", trace_elbo, "3-map-sites")
    model, guide, params = PARITY_CASES["sink"]()
    out = TemperedELBO(3, False, sum_sites=False, temperature=T).loss(
        KEY, params, model, guide, X
    )
    tempered = {"x", "penalty"}
    for name in ref:
        np.testing.assert_allclose(out[name], ref[name] / (T if name in tempered else 1.0),
                                   rtol=1e-5, atol=1e-6)


def test_num_particles_is_the_first_positional_argument_as_in_trace_elbo():
    elbo = TemperedELBO(3, False, True, False)
    assert (elbo.num_particles, elbo.vectorize_particles, elbo.multi_sample_guide,
            elbo.sum_sites, elbo.temperature) == (3, False, True, False, None)
    ref = Trace_ELBO(3)
    out = TemperedELBO(3)
    assert out.num_particles == ref.num_particles == 3
    # the old meaning (a temperature first) cannot pass silently
    with pytest.raises(TypeError, match=r"temperature=T"):
        TemperedELBO(4.0)
    with pytest.raises(TypeError, match="num_particles"):
        TemperedELBO(True)
    with pytest.raises(ValueError, match="num_particles"):
        TemperedELBO(0)


def test_bad_options_are_refused():
    with pytest.raises(TypeError, match="sum_sites"):
        TemperedELBO(1, True, False, "no")
    with pytest.raises(TypeError, match="multi_sample_guide"):
        TemperedELBO(1, True, None)
    with pytest.raises(ValueError, match="vectorize_particles"):
        TemperedELBO(2, "vmap")
