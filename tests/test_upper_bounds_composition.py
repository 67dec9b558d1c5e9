"""CUBO and KLpq where they meet the rest of NumPyro (issue 8).

* enumeration: a site marked for enumeration is refused, naming the site (they sample, never
  enumerate); ``can_infer_discrete`` says what SVI needs to know;
* model parameters: held fixed by default (exactly zero gradient), fitted by the IWAE gradient
  with ``learn_model_params=True``;
* ``nan`` in the data: the loss and the gradient are ``nan`` (never ``-inf``, the best value);
* ``temper(model, T)``: the bounds of the tempered evidence, exact at the tempered posterior.

Reference model (conjugate): mu ~ N(M0, S0^2), x_i ~ N(mu, SIGMA^2), i = 1..N. Tempering the
likelihood by 1/T gives N(x_i; mu, SIGMA^2)^beta = (2 pi SIGMA^2)^((1 - beta)/2) beta^(-1/2)
N(x_i; mu, SIGMA^2/beta), so the tempered evidence and posterior are Gaussian in closed form.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
import scipy.optimize
import scipy.stats
from conjugate import M0, S0, SIGMA, X, guide, model, tempered_log_evidence, tempered_posterior
from numpyro.infer import SVI

from numpyro_tempering import bounds, temper
from numpyro_tempering.engine import log_weights
from numpyro_tempering.handlers import stop_param_gradients, stop_sample_gradients
from numpyro_tempering.objectives.cubo import CUBO
from numpyro_tempering.objectives.klpq import KLpq

KEY = jax.random.PRNGKey(5)
S = 16


OBJECTIVES = {
    "cubo": CUBO(num_particles=S),
    "cubo_exp": CUBO(num_particles=S, gradient="exponentiated"),
    "klpq": KLpq(num_particles=S),
}


@functools.cache
def _jit(objective, model, guide, what):
    def loss(params, *args):
        return objective.loss(KEY, params, model, guide, *args)

    fn = {
        "loss": loss,
        "grad": jax.value_and_grad(loss),
        "diagnose": lambda params, *args: objective.diagnose(KEY, params, model, guide, *args),
    }[what]
    return jax.jit(fn)


def run(objective, what, params, *args, model=model, guide=guide):
    """``objective.loss`` / its value and gradient / ``diagnose``, jitted once per setting."""
    return _jit(objective, model, guide, what)(params, *(args or (X,)))


# -- enumeration ----------------------------------------------------------------------------


def mixture(x, mark=True):
    """Two components at +-loc with P(z = 1) = 0.3; ``z`` marked for enumeration."""
    loc = numpyro.sample("loc", dist.Normal(0.0, 2.0))
    infer = {"enumerate": "parallel"} if mark else {}
    with numpyro.plate("data", x.shape[0]):
        z = numpyro.sample("z", dist.Bernoulli(0.3), infer=infer)
        numpyro.sample("x", dist.Normal(jnp.where(z == 1, loc, -loc), 1.0), obs=x)


def mixture_guide(x):
    numpyro.sample("loc", dist.Normal(numpyro.param("m", 0.5), 0.5))


MIX_X = jnp.array([1.2, -0.8, 1.5])
marked_mixture = functools.partial(mixture, mark=True)
plain_mixture = functools.partial(mixture, mark=False)


@pytest.mark.parametrize("objective", [CUBO(num_particles=4), KLpq(num_particles=4)])
def test_enumerated_model_site_is_refused_naming_it(objective):
    # Before: z was drawn from its prior and weighted as if it were summed out; CUBO then
    # reported an "upper bound" below the ELBO.
    name = type(objective).__name__
    with pytest.raises(ValueError, match=f"{name}: model latent site 'z' is marked for enum"):
        objective.loss(KEY, {"m": 0.5}, marked_mixture, mixture_guide, MIX_X)
    with pytest.raises(ValueError, match="model latent site 'z' is marked.*Sample 'z' in the"):
        objective.diagnose(KEY, {"m": 0.5}, marked_mixture, mixture_guide, MIX_X)
    # unmarked, it is the ordinary "not sampled by the guide" error
    with pytest.raises(ValueError, match="model latent site 'z' is not sampled by the guide"):
        objective.loss(KEY, {"m": 0.5}, plain_mixture, mixture_guide, MIX_X)


@pytest.mark.parametrize("objective", [CUBO(num_particles=4), KLpq(num_particles=4)])
def test_config_enumerate_mixture_is_refused(objective):
    funsor_api = pytest.importorskip("numpyro.contrib.funsor")
    enumerated = funsor_api.config_enumerate(plain_mixture)
    with pytest.raises(ValueError, match="model latent site 'z' is marked for enumeration"):
        objective.loss(KEY, {"m": 0.5}, enumerated, mixture_guide, MIX_X)


def discrete_guide(x, mark=False):
    """Samples both sites; ``mark``: the guide's z marked for enumeration."""
    mixture_guide(x)
    p = numpyro.param("p", 0.5, constraint=dist.constraints.unit_interval)
    infer = {"enumerate": "parallel"} if mark else {}
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("z", dist.Bernoulli(p), infer=infer)


def test_klpq_guide_sampled_discrete_site_is_fine_and_a_marked_guide_site_is_refused():
    params = {"m": jnp.array(0.5), "p": jnp.array(0.4)}
    # a model site marked for enumeration but sampled by the guide is not enumerated by
    # TraceEnum_ELBO either: the same weights as without the mark
    klpq = KLpq(num_particles=S)
    marked = run(klpq, "loss", params, MIX_X, model=marked_mixture, guide=discrete_guide)
    plain = run(klpq, "loss", params, MIX_X, model=plain_mixture, guide=discrete_guide)
    assert bool(jnp.isfinite(marked)) and marked == plain
    marked_guide = functools.partial(discrete_guide, mark=True)
    with pytest.raises(ValueError, match="KLpq: guide site 'z' is marked for enumeration"):
        KLpq(num_particles=4).loss(KEY, params, plain_mixture, marked_guide, MIX_X)


def test_can_infer_discrete_matches_what_svi_does_with_it():
    """SVI reads it only to warn at init about discrete latents: KLpq samples them, CUBO not."""
    assert KLpq.can_infer_discrete is True and CUBO.can_infer_discrete is False
    for objective, warns in ((KLpq(num_particles=4), False), (CUBO(num_particles=4), True)):
        svi = SVI(plain_mixture, discrete_guide, optax.sgd(0.1), objective)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            svi.init(KEY, MIX_X)
        assert any("discrete latent" in str(w.message) for w in record) is warns


# -- model parameters ------------------------------------------------------------------------


def model_sigma(x):
    """The likelihood scale is a model parameter (CUBO used to drive it to 1e-8)."""
    sigma = numpyro.param("sigma", 1.0, constraint=dist.constraints.positive)
    mu = numpyro.sample("mu", dist.Normal(M0, S0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, sigma), obs=x)


PARAMS = {"loc": jnp.array(1.0), "scale": jnp.array(0.5), "sigma": jnp.array(0.8)}
LEARN = {
    "cubo": CUBO(num_particles=S, learn_model_params=True),
    "cubo_exp": CUBO(num_particles=S, gradient="exponentiated", learn_model_params=True),
    "klpq": KLpq(num_particles=S, learn_model_params=True),
}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_model_params_are_held_fixed_by_default(name):
    objective = OBJECTIVES[name]
    _, grad = run(objective, "grad", PARAMS, model=model_sigma)
    assert grad["sigma"] == 0.0  # exactly
    assert grad["loc"] != 0 and grad["scale"] != 0

    svi = SVI(model_sigma, guide, optax.adam(0.05), objective)
    state = svi.init(jax.random.PRNGKey(0), X)
    before = svi.get_params(state)["sigma"]
    result = svi.run(jax.random.PRNGKey(0), 20, X, progress_bar=False)
    assert result.params["sigma"] == before
    assert result.params["loc"] != svi.get_params(state)["loc"]
    assert bool(jnp.all(jnp.isfinite(result.losses)))


def test_weight_decay_still_moves_a_held_model_param():
    """The docstrings' caveat: the gradient is zero, but an optimiser that changes parameters
    without one (decoupled weight decay) still shrinks them."""
    svi = SVI(model_sigma, guide, optax.adamw(0.05, weight_decay=0.5), OBJECTIVES["klpq"])
    result = svi.run(jax.random.PRNGKey(0), 20, X, init_params=PARAMS, progress_bar=False)
    assert float(result.params["sigma"]) != float(PARAMS["sigma"])


def neg_iwae_at_fixed_samples(params):
    """-IWAE as a function of the model's parameters, the particles held fixed."""
    lw = log_weights(KEY, params, model_sigma, stop_sample_gradients(guide), (X,), num_particles=S)
    return -bounds.iwae(lw.log_w)


@pytest.mark.parametrize("name", sorted(LEARN))
def test_learn_model_params_gives_the_iwae_gradient_and_keeps_the_guide_gradient(name):
    value, grad = run(LEARN[name], "grad", PARAMS, model=model_sigma)
    ref = jax.jit(jax.grad(neg_iwae_at_fixed_samples))(PARAMS)
    np.testing.assert_allclose(grad["sigma"], ref["sigma"], rtol=1e-5)
    assert grad["sigma"] != 0
    # the value and the guide-side gradient are those of the default
    default_value, default_grad = run(OBJECTIVES[name], "grad", PARAMS, model=model_sigma)
    np.testing.assert_allclose(value, default_value, rtol=1e-6)
    for k in ("loc", "scale"):
        np.testing.assert_allclose(grad[k], default_grad[k], rtol=1e-5)


def max_evidence_sigma(x=X):
    """argmax_sigma log N(x; M0 1, sigma^2 I + S0^2 1 1^T), by SciPy in float64."""
    x = np.asarray(x, np.float64)
    n = x.shape[0]

    def neg_log_evidence(sigma):
        cov = sigma**2 * np.eye(n) + S0**2 * np.ones((n, n))
        return -scipy.stats.multivariate_normal(np.full(n, M0), cov).logpdf(x)

    bounded = scipy.optimize.minimize_scalar(neg_log_evidence, bounds=(0.05, 5.0), method="bounded")
    return bounded.x


def test_learn_model_params_fits_sigma_by_maximum_evidence():
    """With the opt-in, sigma climbs the evidence to its maximiser (0.641 here) instead of
    collapsing as the CUBO gradient would drive it; by default it stays put."""
    init = {"loc": jnp.array(1.0), "scale": jnp.array(0.4), "sigma": jnp.array(0.3)}
    sigma_hat = max_evidence_sigma()
    for objective in (LEARN["cubo"], LEARN["klpq"]):
        svi = SVI(model_sigma, guide, optax.adam(0.02), objective)
        result = svi.run(jax.random.PRNGKey(1), 150, X, init_params=init, progress_bar=False)
        sigma = float(result.params["sigma"])
        assert abs(sigma - sigma_hat) < 0.02, (type(objective).__name__, sigma, sigma_hat)


def model_shared(x):
    """The prior mean is the guide's own parameter ``loc``."""
    mu = numpyro.sample("mu", dist.Normal(numpyro.param("loc", 0.0), S0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, SIGMA), obs=x)


def model_shared_fixed(x):
    """``model_shared`` with the parameter replaced by its value PARAMS["loc"]."""
    mu = numpyro.sample("mu", dist.Normal(PARAMS["loc"], S0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, SIGMA), obs=x)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_a_param_shared_by_model_and_guide_keeps_its_guide_gradient(name):
    params = {"loc": PARAMS["loc"], "scale": PARAMS["scale"]}
    _, grad = run(OBJECTIVES[name], "grad", params, model=model_shared)
    _, ref = run(OBJECTIVES[name], "grad", params, model=model_shared_fixed)
    assert ref["loc"] != 0
    for k in params:
        np.testing.assert_allclose(grad[k], ref[k], rtol=1e-6)


def test_stop_param_gradients_keeps_values():
    lw = log_weights(KEY, PARAMS, model_sigma, guide, (X,), num_particles=S).log_w
    held = log_weights(
        KEY, PARAMS, stop_param_gradients(model_sigma), guide, (X,), num_particles=S
    ).log_w
    np.testing.assert_array_equal(lw, held)


def test_stop_param_gradients_on_a_pytree_param_inside_substitute():
    """Leaf by leaf, and after an outer substitute has set the value (as SVI does)."""

    def fn():
        w = numpyro.param("w", {"a": 1.0, "b": 2.0})
        return 3.0 * w["a"] + w["b"] ** 2

    def value(fn, w):
        return numpyro.handlers.substitute(fn, {"w": w})()

    w = {"a": jnp.array(0.5), "b": jnp.array(1.5)}
    grad = jax.grad(lambda w: value(fn, w))(w)
    assert float(grad["a"]) == 3.0 and float(grad["b"]) == 3.0
    held = jax.grad(lambda w: value(stop_param_gradients(fn), w))(w)
    assert float(held["a"]) == 0.0 and float(held["b"]) == 0.0
    assert value(stop_param_gradients(fn), w) == value(fn, w)


# -- non-finite data ---------------------------------------------------------------------------


@pytest.mark.parametrize("validate", [True, False], ids=["validated", "unvalidated"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_nan_in_the_data_gives_a_nan_loss_and_gradient(dtype, validate):
    """Before: NumPyro's validation makes log N(nan) = -inf for every particle, and CUBO
    reported -inf, the best possible value. Now the loss and the gradient are nan and
    ``diagnose`` counts every particle; without validation the weights themselves are nan."""
    with jax.enable_x64(dtype == jnp.float64), numpyro.validation_enabled(validate):
        x = X.astype(dtype).at[3].set(jnp.nan)
        params = {"loc": jnp.asarray(1.0, dtype), "scale": jnp.asarray(0.5, dtype)}

        @jax.jit
        def values(params, x):
            out = {}
            for name, objective in OBJECTIVES.items():
                out[name] = jax.value_and_grad(
                    lambda p, objective=objective: objective.loss(KEY, p, model, guide, x)
                )(params)
                out[name + "_diag"] = objective.diagnose(KEY, params, model, guide, x)
            return out

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NumPyro: out-of-support values (eager only)
            out = values(params, x)
    for name in OBJECTIVES:
        loss, grad = out[name]
        assert loss.dtype == dtype and bool(jnp.isnan(loss)), (name, loss)
        assert all(bool(jnp.isnan(g)) for g in grad.values()), (name, grad)
        diag = out[name + "_diag"]
        assert int(diag.num_nonfinite) == S
        assert bool(jnp.isnan(diag.cubo)) and bool(jnp.isnan(diag.klpq))


# -- tempering --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_bounds_of_the_tempered_evidence_are_exact_at_the_tempered_posterior(temperature):
    beta = 1 / temperature
    mean, sd = tempered_posterior(beta)
    params = {"loc": jnp.array(mean), "scale": jnp.array(sd)}
    tempered = temper(model, temperature)
    log_z = tempered_log_evidence(beta)
    for name, objective in OBJECTIVES.items():
        value = run(objective, "loss", params, model=tempered)
        np.testing.assert_allclose(value, log_z, rtol=2e-6, err_msg=name)
    # and away from it, the estimates lie above the tempered evidence (loose q, many particles)
    off = {"loc": jnp.array(mean + 0.5 * sd), "scale": jnp.array(1.5 * sd)}
    d = run(CUBO(num_particles=4096), "diagnose", off, model=tempered)
    assert float(d.elbo) < log_z < float(d.cubo)
    assert log_z < float(d.klpq)
