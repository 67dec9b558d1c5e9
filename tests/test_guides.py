"""Tests for numpyro_tempering.guides and numpyro_tempering.warmstart.

Exact identities (change of variables, Jacobians, normalisation) are checked against
``jax.jacfwd`` / numerical quadrature; SVI fits are checked against the exact conjugate
Dirichlet-Categorical posterior Dir(alpha + counts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from jax.scipy.special import gammaln, logsumexp
from numpyro import handlers
from numpyro.distributions.kl import kl_divergence
from numpyro.infer import SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoGuideList, AutoNormal
from numpyro.infer.initialization import init_to_value
from numpyro.infer.util import log_density

from numpyro_tempering.guides import (
    AdditiveLogisticTransform,
    AutoDirichlet,
    AutoLogisticNormal,
    AutoOvercompleteLogisticNormal,
    LogisticNormal,
    overcomplete_forward,
    overcomplete_inverse,
    overcomplete_log_prob,
    simplex_guide,
)
from numpyro_tempering.objectives.cubo import CUBO
from numpyro_tempering.warmstart import elbo_init, map_init

GUIDES = [AutoDirichlet, AutoLogisticNormal, AutoOvercompleteLogisticNormal]

# --------------------------------------------------------------------------------------
# Conjugate Dirichlet-Categorical models
# --------------------------------------------------------------------------------------
ALPHA = jnp.array([1.0, 1.0, 1.0])
COUNTS = jnp.array([20, 10, 5])
DATA = jnp.repeat(jnp.arange(3), COUNTS)
POST = ALPHA + COUNTS  # exact posterior concentration (21, 11, 6)

GROUP_COUNTS = jnp.array([[12, 4, 4], [3, 14, 3], [2, 2, 16]])  # 3 groups x K=3, N=20
GROUP_DATA = jnp.stack(
    [jnp.repeat(jnp.arange(3), c, total_repeat_length=20) for c in GROUP_COUNTS], axis=-1
)  # (N, groups)
GROUP_POST = ALPHA + GROUP_COUNTS


def dircat_model(y):
    theta = numpyro.sample("theta", dist.Dirichlet(ALPHA))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Categorical(theta), obs=y)


def conjugate_model(y, y_groups):
    """A single simplex ``theta`` plus a plate of 3 simplexes ``phi`` (batch (3,), event
    (3,)); the posteriors are independent: Dir(POST) and Dir(GROUP_POST[g])."""
    dircat_model(y)
    with numpyro.plate("groups", y_groups.shape[1], dim=-1):
        phi = numpyro.sample("phi", dist.Dirichlet(ALPHA))
        with numpyro.plate("m", y_groups.shape[0], dim=-2):
            numpyro.sample("y_groups", dist.Categorical(phi), obs=y_groups)


def log_beta(a):
    return jnp.sum(gammaln(a), -1) - gammaln(jnp.sum(a, -1))


LOG_EVIDENCE = log_beta(POST) - log_beta(ALPHA)  # log p(D) of dircat_model
LOG_EVIDENCE_JOINT = LOG_EVIDENCE + jnp.sum(log_beta(GROUP_POST) - log_beta(ALPHA))


def fit(model, guide, *data, steps=1000, particles=32, lr=0.1, seed=0, with_losses=False):
    """Trace_ELBO fit; lr decays 50x so the final iterate has little SGD noise.
    Particles are looped (lax.map), which compiles much faster than vmap for the
    Gamma/Dirichlet sampler and its implicit gradient."""
    opt = optax.adam(optax.exponential_decay(lr, steps, 0.02))
    svi = SVI(model, guide, opt, Trace_ELBO(num_particles=particles, vectorize_particles=False))
    res = svi.run(random.PRNGKey(seed), steps, *data, progress_bar=False)
    return (res.params, res.losses) if with_losses else res.params


@pytest.fixture(scope="module")
def conjugate_fits():
    """One fit per guide family of conjugate_model (cost is dominated by compilation),
    shared by several tests. ``sites=None``: the guide finds both simplex sites."""
    out = {}
    for guide_cls in GUIDES:
        guide = guide_cls(conjugate_model)
        out[guide_cls] = guide, *fit(conjugate_model, guide, DATA, GROUP_DATA, with_losses=True)
    return out


# --------------------------------------------------------------------------------------
# Minimal logistic normal (appendix C.2)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [3, 4])
def test_additive_logistic_logdet_matches_jacfwd(K):
    t = AdditiveLogisticTransform()

    @jax.jit
    def check(u):
        x = t(u)
        jac = jax.jacfwd(lambda u: t(u)[:-1])(u)  # (K-1, K-1): map onto first K-1 coords
        return x, t.log_abs_det_jacobian(u, x), jnp.linalg.slogdet(jac)[1], t.inv(x)

    u = 1.5 * random.normal(random.PRNGKey(K), (5, K - 1))
    x, ldj, logdet, u_back = jax.vmap(check)(u)
    assert x.shape == (5, K)
    np.testing.assert_allclose(jnp.sum(x, -1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(ldj, logdet, atol=1e-4)
    np.testing.assert_allclose(logdet, jnp.sum(jnp.log(x), -1), atol=1e-4)  # sum_k log x_k
    np.testing.assert_allclose(u_back, u, atol=1e-4)


@pytest.mark.parametrize("K", [3, 4])
def test_logistic_normal_log_prob_is_exact(K):
    k1, k2, k3 = random.split(random.PRNGKey(K), 3)
    loc = random.normal(k1, (K - 1,))
    scale = jnp.exp(0.3 * random.normal(k2, (K - 1,)))

    @jax.jit
    def check(key):
        d = LogisticNormal(loc, scale)
        x = d.sample(key, (7,))
        # change of variables with jacfwd
        u = jnp.log(x[:, :-1] / x[:, -1:])
        jac = jax.vmap(jax.jacfwd(lambda u: AdditiveLogisticTransform()(u)[:-1]))(u)
        cov = dist.Normal(loc, scale).log_prob(u).sum(-1) - jnp.linalg.slogdet(jac)[1]
        # paper eq. 9
        eq9 = (
            -jnp.sum(jnp.log(x), -1)
            - (K - 1) / 2 * jnp.log(2 * jnp.pi)
            - jnp.sum(jnp.log(scale))
            - 0.5 * jnp.sum(((u - loc) / scale) ** 2, -1)
        )
        return x, d.log_prob(x), cov, eq9

    x, lp, cov, eq9 = check(k3)
    assert x.shape == (7, K) and LogisticNormal.support is dist.constraints.simplex
    np.testing.assert_allclose(lp, cov, atol=1e-4)
    np.testing.assert_allclose(lp, eq9, atol=1e-4)


def _simplex_grid(n):
    """Midpoints of an n x n grid on (x1, x2) restricted to the open 2-simplex."""
    g = (jnp.arange(n) + 0.5) / n
    x1, x2 = jnp.meshgrid(g, g, indexing="ij")
    x1, x2 = x1.ravel(), x2.ravel()
    keep = np.asarray(x1 + x2 < 1.0)
    x1, x2 = x1[keep], x2[keep]
    return jnp.stack([x1, x2, 1.0 - x1 - x2], -1), 1.0 / n**2


def test_logistic_normal_integrates_to_one_on_simplex():
    d = LogisticNormal(jnp.array([0.3, -0.2]), jnp.array([0.6, 0.9]))
    x, cell = _simplex_grid(800)
    total = jax.jit(lambda x: jnp.sum(jnp.exp(d.log_prob(x))))(x) * cell
    np.testing.assert_allclose(total, 1.0, atol=3e-3)


# --------------------------------------------------------------------------------------
# Overcomplete logistic normal (appendix C.3)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [3, 4])
def test_overcomplete_change_of_variables(K):
    k1, k2, k3 = random.split(random.PRNGKey(10 + K), 3)
    loc = random.normal(k1, (K,))
    scale = jnp.exp(0.3 * random.normal(k2, (K,)))
    v = loc + scale * random.normal(k3, (5, K))

    def to_xw(v):  # v -> (x_1..x_{K-1}, w)
        x, w = overcomplete_forward(v)
        return jnp.concatenate([x[:-1], w[None]])

    def to_u(z):  # eq. 14 inverse: (pi_{1:K-1}, w) -> u
        pi = jnp.concatenate([z[:-1], 1.0 - jnp.sum(z[:-1], keepdims=True)])
        return overcomplete_inverse(pi, z[-1])

    @jax.jit
    def check(v):
        x, w = overcomplete_forward(v)
        logdet = jnp.linalg.slogdet(jax.jacfwd(to_xw)(v))[1]
        z = jnp.concatenate([x[:-1], w[None]])
        logdet_inv = jnp.linalg.slogdet(jax.jacfwd(to_u)(z))[1]
        log_qv = dist.Normal(loc, scale).log_prob(v).sum(-1)
        return (
            x,
            overcomplete_inverse(x, w),
            overcomplete_log_prob(x, w, loc, scale),
            logdet,
            logdet_inv,
            log_qv,
        )

    x, v_back, log_qxw, logdet, logdet_inv, log_qv = jax.vmap(check)(v)
    np.testing.assert_allclose(v_back, v, atol=1e-4)
    # density of v equals q(x, w) |det d(x, w)/dv|
    np.testing.assert_allclose(log_qxw + logdet, log_qv, atol=2e-4)
    # eq. 17: det du/d(pi, w) = prod_k 1/pi_k
    np.testing.assert_allclose(logdet_inv, -jnp.sum(jnp.log(x), -1), atol=2e-4)


def test_overcomplete_integrates_to_one_on_simplex_times_reals():
    loc, scale = jnp.array([0.2, -0.3, 0.1]), jnp.array([0.5, 0.7, 0.6])
    x, cell = _simplex_grid(400)
    ws = jnp.linspace(-4.0, 7.0, 441)
    dw = ws[1] - ws[0]
    per_w = jax.lax.map(lambda w: jnp.sum(jnp.exp(overcomplete_log_prob(x, w, loc, scale))), ws)
    np.testing.assert_allclose(jnp.sum(per_w) * cell * dw, 1.0, atol=5e-3)


def test_overcomplete_guide_trace_density():
    """Guide trace = log q(x, w) (eq. 18) at the v and x sites, minus log N(w; 0, 1)."""
    guide = AutoOvercompleteLogisticNormal(dircat_model, init_scale=0.7)
    with handlers.seed(rng_seed=0):
        guide(DATA)  # set up the prototype
    tr = handlers.trace(handlers.seed(guide, 3)).get_trace(DATA)
    assert set(tr) >= {"theta", "theta_auto_v", "theta_auto_w_prior"}
    assert tr["theta_auto_v"]["infer"]["is_auxiliary"]

    def lp(name):
        site = tr[name]
        return site["fn"].log_prob(site["value"])

    x = tr["theta"]["value"]
    w = logsumexp(tr["theta_auto_v"]["value"])
    loc, scale = tr["theta_auto_loc"]["value"], tr["theta_auto_scale"]["value"]
    np.testing.assert_allclose(
        lp("theta_auto_v") + lp("theta"), overcomplete_log_prob(x, w, loc, scale), atol=1e-4
    )
    np.testing.assert_allclose(lp("theta_auto_w_prior"), -dist.Normal(0, 1).log_prob(w), atol=1e-5)


# --------------------------------------------------------------------------------------
# Dirichlet reparameterisation (implicit gradients)
# --------------------------------------------------------------------------------------
def test_dirichlet_guide_sample_is_reparameterised():
    """Pathwise d x / d concentration through the guide's sample (JAX implicit gradients
    of the Gamma sampler) is finite, nonzero and unbiased for d E[x] / d a."""
    assert dist.Dirichlet(jnp.ones(3)).has_rsample
    guide = AutoDirichlet(dircat_model, sites="theta")
    with handlers.seed(rng_seed=0):
        guide(DATA)

    def sample(conc, key):
        sub = handlers.substitute(
            handlers.seed(guide, key), data={"theta_auto_concentration": conc}
        )
        return sub(DATA)["theta"]

    a = jnp.array([2.0, 3.0, 5.0])
    keys = random.split(random.PRNGKey(1), 4000)
    jac = jax.jit(lambda a, ks: jax.lax.map(lambda k: jax.jacrev(sample)(a, k), ks))(
        a, keys
    )  # (S, k, j)
    assert jnp.all(jnp.isfinite(jac)) and jnp.all(jnp.abs(jac.mean(0)) > 1e-3)
    A = a.sum()
    analytic = (jnp.eye(3) * A - a[:, None]) / A**2  # d(a_k / A) / d a_j
    se = jac.std(0) / jnp.sqrt(len(keys))
    assert jnp.all(jnp.abs(jac.mean(0) - analytic) < 5 * se + 1e-4)


# --------------------------------------------------------------------------------------
# SVI fits on the conjugate model
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("guide_cls", GUIDES)
def test_fit_conjugate_dirichlet_categorical(guide_cls, conjugate_fits):
    guide, params, _ = conjugate_fits[guide_cls]
    assert set(guide.prototype_trace) == {"theta", "phi"}
    exact = dist.Dirichlet(POST)
    if guide_cls is AutoDirichlet:
        conc = params["theta_auto_concentration"]
        # The family contains the posterior, so KL(q || post) = log p(D) - ELBO(q) -> 0.
        # 5e-3 nats rejects the off-by-one answers alpha + counts +- 1 (KL >= 0.035).
        assert kl_divergence(dist.Dirichlet(conc), exact) < 5e-3
        np.testing.assert_allclose(conc, POST, rtol=0.03)
        mean = guide.median(params)["theta"]  # for AutoDirichlet: the exact q mean
    else:
        predictive = Predictive(
            conjugate_model,
            guide=guide,
            params=params,
            num_samples=20000,
            return_sites=["theta", "y"],
        )
        samples = jax.jit(predictive)(random.PRNGKey(1), DATA, GROUP_DATA)
        assert samples["y"].shape == (20000, DATA.shape[0])
        mean = samples["theta"].mean(0)
    # posterior mean (0.553, 0.289, 0.158); the MAP (0.571, 0.286, 0.143) is > 0.01 away
    np.testing.assert_allclose(mean, exact.mean, atol=0.01)


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_fit_plate_of_simplexes(guide_cls, conjugate_fits):
    guide, params, _ = conjugate_fits[guide_cls]
    exact = dist.Dirichlet(GROUP_POST)
    if guide_cls is AutoDirichlet:
        conc = params["phi_auto_concentration"]
        assert conc.shape == (3, 3)
        assert jnp.all(kl_divergence(dist.Dirichlet(conc), exact) < 5e-3)
        np.testing.assert_allclose(guide.median(params)["phi"], exact.mean, atol=0.01)
    else:
        sample = jax.jit(guide.sample_posterior, static_argnames="sample_shape")
        samples = sample(random.PRNGKey(2), params, DATA, GROUP_DATA, sample_shape=(20000,))
        assert samples["phi"].shape == (20000, 3, 3)
        np.testing.assert_allclose(samples["phi"].mean(0), exact.mean, atol=0.015)


# Hand-set guides that are over-dispersed w.r.t. the (augmented) posterior, so the
# importance weights are (essentially) bounded and the estimator is well-conditioned.
# For the overcomplete guide the augmented target in v-space has covariance
# Cov(log x) + 1 1^T (w ~ N(0, 1)), whose largest eigenvalue is ~3.2 < 2^2.
POST_MEAN = POST / POST.sum()
WIDE_PARAMS = {
    AutoDirichlet: {"theta_auto_concentration": POST / 4},
    AutoLogisticNormal: {
        "theta_auto_loc": jnp.log(POST_MEAN[:-1] / POST_MEAN[-1]),
        "theta_auto_scale": jnp.ones(2),
    },
    AutoOvercompleteLogisticNormal: {
        "theta_auto_loc": jnp.log(POST_MEAN),
        "theta_auto_scale": 2.0 * jnp.ones(3),
    },
}


@pytest.mark.parametrize("guide_cls", [AutoLogisticNormal, AutoOvercompleteLogisticNormal])
def test_importance_weights_estimate_evidence(guide_cls):
    """E_q[p~(x, D) / q] = p(D) exactly: checks that each guide trace carries its exact,
    normalised density -- for the overcomplete guide that log q(x, w) of eq. 18 and the
    -log N(w; 0, 1) factor together make p~ / q an unbiased weight for p(D)."""
    guide = guide_cls(dircat_model)
    with handlers.seed(rng_seed=0):
        guide(DATA)  # prototype
    params = WIDE_PARAMS[guide_cls]

    def log_weight(key):
        g_lp, g_tr = log_density(handlers.seed(guide, key), (DATA,), {}, params)
        m_lp, _ = log_density(handlers.replay(dircat_model, g_tr), (DATA,), {}, params)
        return m_lp - g_lp

    lw = jax.jit(jax.vmap(log_weight))(random.split(random.PRNGKey(5), 50000))
    w = jnp.exp(lw - lw.max())
    log_z = jnp.log(w.mean()) + lw.max()
    tol = 5 * w.std() / w.mean() / jnp.sqrt(len(w))  # 5 standard errors (delta method)
    assert tol < 0.15
    assert jnp.abs(log_z - LOG_EVIDENCE) < tol
    assert lw.mean() < LOG_EVIDENCE  # ELBO is a lower bound


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_fitted_guide_elbo_below_evidence(guide_cls, conjugate_fits):
    # the last 250 steps (lr <= 0.0027) x 32 particles estimate -ELBO at the optimum
    _, _, losses = conjugate_fits[guide_cls]
    tail = -losses[-250:]
    elbo, se = tail.mean(), tail.std() / jnp.sqrt(len(tail))
    gap = LOG_EVIDENCE_JOINT - elbo
    assert gap > -3 * se  # ELBO <= log p(D)
    if guide_cls is AutoDirichlet:
        # the family contains the posterior: gap = sum of 4 KL(q || post) ~ 0
        assert gap < 0.02 + 3 * se
    elif guide_cls is AutoLogisticNormal:
        # mean field in alr coordinates: e.g. Dir(21, 11, 6) has corr(u1, u2) ~ 0.72 there,
        # which a diagonal Gaussian misses at a cost of about -log(1 - 0.72^2)/2 = 0.37
        assert 0.2 < gap < 1.5
    else:
        # extra E_q KL(q(w | x) || N(0, 1)) per simplex: a diagonal Gaussian in v cannot
        # give w its prior spread, so the augmented ELBO is looser (~1 nat per simplex)
        assert 1.5 < gap < 8.0


def test_subsampled_plate_shapes():
    """Parameters get the full plate size and are sliced by subsampled plates."""

    def model(y):
        with numpyro.plate("groups", 3, subsample_size=2, dim=-1) as idx:
            theta = numpyro.sample("theta", dist.Dirichlet(ALPHA))
            with numpyro.plate("n", y.shape[0], dim=-2):
                numpyro.sample("y", dist.Categorical(theta), obs=y[:, idx])

    for guide_cls in GUIDES:
        guide = guide_cls(model)  # fresh guide: its prototype is only built abstractly

        def shapes(guide=guide):
            tr = handlers.trace(handlers.seed(guide, 0)).get_trace(GROUP_DATA)
            return {k: v["value"] for k, v in tr.items() if v["type"] in ("param", "sample")}

        out = jax.eval_shape(shapes)
        params = [
            v
            for k, v in out.items()
            if k.startswith("theta_auto_") and k[-1] != "v" and not k.endswith("w_prior")
        ]
        assert params and all(v.shape[0] == 3 for v in params)  # full plate size
        assert out["theta"].shape == (2, 3)  # subsample


# --------------------------------------------------------------------------------------
# Composition: AutoGuideList, jit, Predictive
# --------------------------------------------------------------------------------------
def mixed_model(y, z=None):
    theta = numpyro.sample("theta", dist.Dirichlet(ALPHA))
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    numpyro.deterministic("theta0", theta[0])
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Categorical(theta), obs=y)
        numpyro.sample("z", dist.Normal(mu, 1.0), obs=z)


def test_simplex_guide_list_jit_predictive():
    z = 3.0 + random.normal(random.PRNGKey(0), DATA.shape)
    guide = simplex_guide(mixed_model, {"theta": "overcomplete_logistic_normal"})
    svi = SVI(mixed_model, guide, optax.adam(0.05), Trace_ELBO())
    state = svi.init(random.PRNGKey(1), DATA, z=z)
    body = jax.jit(
        lambda state: jax.lax.fori_loop(0, 300, lambda i, st: svi.update(st, DATA, z=z)[0], state)
    )
    state = body(state)
    params = svi.get_params(state)
    assert all(jnp.all(jnp.isfinite(v)) for v in params.values())
    assert "mu_auto_loc" in params
    np.testing.assert_allclose(params["mu_auto_loc"], z.mean(), atol=0.3)
    post = jax.jit(guide.sample_posterior, static_argnames="sample_shape")(
        random.PRNGKey(2), params, DATA, z=z, sample_shape=(10,)
    )
    assert post["theta"].shape == (10, 3) and post["mu"].shape == (10,)
    pred = jax.jit(Predictive(mixed_model, guide=guide, params=params, num_samples=10))(
        random.PRNGKey(3), DATA
    )
    assert pred["y"].shape == (10, DATA.shape[0]) and pred["theta0"].shape == (10,)
    assert guide.median(params)["theta"].shape == (3,)


def test_manual_autoguidelist():
    guide = AutoGuideList(mixed_model)
    guide.append(AutoLogisticNormal(mixed_model, sites=["theta"]))
    guide.append(AutoNormal(handlers.block(mixed_model, hide=["theta", "theta0"])))
    svi = SVI(mixed_model, guide, optax.adam(0.05), Trace_ELBO())
    params = svi.get_params(svi.init(random.PRNGKey(4), DATA, z=jnp.zeros(DATA.shape)))
    assert set(params) == {"theta_auto_loc", "theta_auto_scale", "mu_auto_loc", "mu_auto_scale"}


def test_site_validation():
    with pytest.raises(ValueError, match="simplex"):
        with handlers.seed(rng_seed=0):
            AutoDirichlet(mixed_model, sites="mu")(DATA)
    with pytest.raises(ValueError, match="not found"):
        with handlers.seed(rng_seed=0):
            AutoLogisticNormal(mixed_model, sites=["nope"])(DATA)
    with pytest.raises(ValueError, match="Unknown"):
        simplex_guide(mixed_model, {"theta": "gaussian"})


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "1", None])
def test_guide_settings_must_be_finite_positive_numbers(bad):
    """Before: a non-positive concentration or scale became a NaN parameter (log of a
    negative number in the positive constraint's inverse) without a word."""
    with pytest.raises(ValueError, match="AutoDirichlet: `init_concentration` must be"):
        AutoDirichlet(dircat_model, init_concentration=bad)
    for cls in (AutoLogisticNormal, AutoOvercompleteLogisticNormal):
        with pytest.raises(ValueError, match=f"{cls.__name__}: `init_scale` must be"):
            cls(dircat_model, init_scale=bad)
    with pytest.raises(ValueError, match="`w_prior_scale` must be a finite number > 0"):
        AutoOvercompleteLogisticNormal(dircat_model, w_prior_scale=bad)
    if bad not in (0.0, -1.0):
        with pytest.raises(ValueError, match="`w_prior_loc` must be a finite number"):
            AutoOvercompleteLogisticNormal(dircat_model, w_prior_loc=bad)


@pytest.mark.parametrize("value", [[1.0, 2.0, 3.0], [0.5, 0.6, -0.1], [0.5, float("nan"), 0.5]])
def test_initial_value_off_the_simplex_is_an_error(value):
    """Before: [1, 2, 3] was silently renormalised to [1/6, 2/6, 3/6]."""

    def prior():
        numpyro.sample("theta", dist.Dirichlet(ALPHA))

    init = init_to_value(values={"theta": jnp.array(value)})
    for cls in GUIDES:
        with pytest.raises(ValueError, match=f"{cls.__name__}: the initial value of site 'theta'"):
            with handlers.seed(rng_seed=0):
                cls(prior, init_loc_fn=init)()


# --------------------------------------------------------------------------------------
# Warm starts
# --------------------------------------------------------------------------------------
def test_map_init_recovers_unconstrained_mode_and_initialises_guides():
    values = map_init(dircat_model, DATA, key=random.PRNGKey(0), num_steps=1500)
    # the mode of the stick-breaking-transformed Dir(POST) density is its mean, not the
    # constrained mode (POST - 1) / (POST.sum() - 3)
    np.testing.assert_allclose(values["theta"], POST / POST.sum(), atol=2e-3)

    init = init_to_value(values=values)
    for guide_cls in GUIDES:
        guide = guide_cls(dircat_model, init_loc_fn=init)
        tr = handlers.trace(handlers.seed(guide, 1)).get_trace(DATA)
        params = {k: v["value"] for k, v in tr.items() if v["type"] == "param"}
        np.testing.assert_allclose(guide.median(params)["theta"], values["theta"], atol=1e-4)


SPARSE_ALPHA = jnp.array([0.5, 0.5, 0.5])
SPARSE_DATA = jnp.array([0, 0, 0, 1])  # counts (3, 1, 0): posterior Dir(3.5, 1.5, 0.5)
SPARSE_POST = SPARSE_ALPHA + jnp.array([3.0, 1.0, 0.0])


def sparse_model(y):
    theta = numpyro.sample("theta", dist.Dirichlet(SPARSE_ALPHA))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Categorical(theta), obs=y)


def test_map_init_at_a_dirichlet_below_one_stays_inside_and_cubo_is_sane():
    """Dir(alpha < 1) with an unseen category: the constrained density has no maximum (it
    grows without bound towards theta_3 = 0), and the old constrained "MAP" drifted to the
    boundary, where a guide initialised from it made CUBO collapse (-40 vs log Z = -4.14)."""
    values = map_init(sparse_model, SPARSE_DATA, key=random.PRNGKey(0), num_steps=1000)
    theta = values["theta"]
    assert float(jnp.min(theta)) > 0.05  # strictly inside the simplex
    np.testing.assert_allclose(theta, SPARSE_POST / SPARSE_POST.sum(), atol=2e-3)

    log_z = float(log_beta(SPARSE_POST) - log_beta(SPARSE_ALPHA))
    guide = AutoDirichlet(sparse_model, init_loc_fn=init_to_value(values=values))
    params = {
        k: v["value"]
        for k, v in handlers.trace(handlers.seed(guide, 1)).get_trace(SPARSE_DATA).items()
        if v["type"] == "param"
    }
    d = CUBO(num_particles=512).diagnose(
        random.PRNGKey(2), params, sparse_model, guide, SPARSE_DATA
    )
    assert bool(jnp.isfinite(d.cubo)) and int(d.num_nonfinite) == 0
    # a loose guide, many particles: the estimates straddle log Z, the CUBO within a nat
    assert float(d.elbo) < log_z < float(d.cubo) < log_z + 1.0


def test_elbo_init_params_are_accepted_by_svi():
    guide = AutoLogisticNormal(dircat_model)
    params = elbo_init(
        dircat_model, guide, DATA, key=random.PRNGKey(0), num_steps=300, num_particles=2
    )
    assert set(params) == {"theta_auto_loc", "theta_auto_scale"}
    # a different objective (here a 2-particle ELBO standing in for an upper bound)
    svi = SVI(dircat_model, guide, optax.adam(1e-3), Trace_ELBO(num_particles=2))
    state = svi.init(random.PRNGKey(1), DATA, init_params=params)
    for k, v in svi.get_params(state).items():
        np.testing.assert_allclose(v, params[k], rtol=1e-5, atol=1e-6)
    # warm start is already near the posterior: median within 0.03 of the exact mean
    np.testing.assert_allclose(guide.median(params)["theta"], dist.Dirichlet(POST).mean, atol=0.03)
