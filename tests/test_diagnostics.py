"""The evidence sandwich (numpyro_tempering.diagnostics), checked against exact answers.

Conjugate models (Normal-Normal, Beta-Bernoulli) and single-document LDA (K = V = 3) have
closed-form log evidence, posterior draws and, for Gaussians, closed-form CUBO_2 and KLpq.
Guides are functions of ``numpyro.param`` sites, so each (model, guide) pair compiles once
per configuration and is reused across tests with different parameter values.
"""

from __future__ import annotations

import math
import warnings

import arviz as az
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax.scipy.special import betaln
from numpyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoNormal

from numpyro_tempering import bounds
from numpyro_tempering import diagnostics as diag
from numpyro_tempering.diagnostics import (
    BoundWarning,
    evidence_bounds,
    training_flags,
    warn_training_flags,
)
from numpyro_tempering.guides import AutoDirichlet, AutoOvercompleteLogisticNormal

matplotlib.use("Agg")

KEY = jax.random.PRNGKey(0)
SIZES = (100, 10_000)
R = 20
ALL = ("elbo", "iwae", "cubo", "klpq")

# -- Normal-Normal: mu ~ N(0, 1), x_i ~ N(mu, 1) -------------------------------------------------
X = jnp.array([0.5, 1.5, 1.0, 2.0])
POST_LOC = float(X.sum() / (1 + X.shape[0]))
POST_SD = float((1 + X.shape[0]) ** -0.5)
LOG_Z = float(dist.MultivariateNormal(jnp.zeros(4), jnp.eye(4) + jnp.ones((4, 4))).log_prob(X))
NN_DRAWS = {"mu": POST_LOC + POST_SD * jax.random.normal(jax.random.PRNGKey(11), (R * SIZES[-1],))}


def nn_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def nn_guide(x):
    numpyro.sample("mu", dist.Normal(numpyro.param("loc", 0.0), numpyro.param("scale", 1.0)))


def nn_params(shift: float = 0.0, scale: float = 1.0) -> dict:
    """q = N(posterior mean + shift * sd, (scale * sd)^2)."""
    return {"loc": jnp.array(POST_LOC + shift * POST_SD), "scale": jnp.array(scale * POST_SD)}


def gaussian_cubo2(loc: float, sd: float) -> float:
    """Exact CUBO_2 = log Z + 1/2 log int p(z | x)^2 / q(z) dz for Gaussian p(z | x) and q."""
    a = 1 / POST_SD**2 - 1 / (2 * sd**2)
    b = 2 * POST_LOC / POST_SD**2 - loc / sd**2
    c = POST_LOC**2 / POST_SD**2 - loc**2 / (2 * sd**2)
    log_int = (
        math.log(sd / (math.sqrt(2 * math.pi) * POST_SD**2))
        + 0.5 * math.log(math.pi / a)
        + b**2 / (4 * a)
        - c
    )
    return LOG_Z + 0.5 * log_int


def gaussian_klpq(loc: float, sd: float) -> float:
    """Exact KLpq (Pradier et al., eq. 3) = log Z + KL(N(post) || N(loc, sd^2))."""
    kl = math.log(sd / POST_SD) + (POST_SD**2 + (POST_LOC - loc) ** 2) / (2 * sd**2) - 0.5
    return LOG_Z + kl


def nn_report(params: dict, **kwargs):
    options = {"num_samples": SIZES, "num_replicates": R, "bounds": ALL}
    options.update(kwargs)
    options.setdefault("posterior_samples", NN_DRAWS)
    return evidence_bounds(KEY, nn_model, nn_guide, params, X, **options)


def medians(report) -> dict:
    return report.summary()["median"].to_dict()


def codes(report) -> set[tuple[str, str | None]]:
    return {(f.code, f.bound) for f in report.flags}


@pytest.fixture(scope="module")
def good_fit():
    """q slightly off the posterior and wider than it: bounded weights (k-hat < 0)."""
    return nn_report(nn_params(0.1, 1.1), log_evidence=LOG_Z)


@pytest.fixture(scope="module")
def heavy_tailed():
    """q four times narrower than the posterior: weight tail index k = 1 - 1/16 = 0.94."""
    return nn_report(nn_params(0.0, 0.25), log_evidence=LOG_Z)


# -- the sandwich on conjugate models -----------------------------------------------------------
def test_normal_normal_sandwich_brackets_log_z(good_fit):
    s = good_fit.summary()
    for size in SIZES:
        assert s.loc[("elbo", size), "median"] < LOG_Z
        assert s.loc[("iwae", size), "q5"] < LOG_Z
        assert s.loc[("klpq", size), "median"] > LOG_Z
        assert s.loc[("cubo", size), "median"] > LOG_Z
    # the estimates converge to the closed forms (eq. 1, eq. 3) at S = 10^4
    big = SIZES[-1]
    loc, sd = POST_LOC + 0.1 * POST_SD, 1.1 * POST_SD
    assert abs(s.loc[("cubo", big), "median"] - gaussian_cubo2(loc, sd)) < 4 * max(
        s.loc[("cubo", big), "sd"], 1e-4
    )
    assert abs(s.loc[("klpq", big), "median"] - gaussian_klpq(loc, sd)) < 4 * max(
        s.loc[("klpq", big), "sd"], 1e-4
    )
    assert abs(s.loc[("iwae", big), "median"] - LOG_Z) < 1e-3
    assert s.loc[("elbo", big), "k_hat"] < 0.25  # q wider than p: light-tailed weights


def test_flags_quiet_on_a_good_fit(good_fit):
    assert good_fit.flags == [], [str(f) for f in good_fit.flags]


def test_exact_posterior_guide_collapses_every_bound_onto_log_z():
    report = nn_report(nn_params(), log_evidence=LOG_Z)
    for b in ALL:
        values = report.estimates[b]
        np.testing.assert_allclose(values, LOG_Z, atol=2e-5, err_msg=b)
    assert np.isnan(report.k_hat["cubo"]).all()  # constant weights: no tail to fit
    assert report.flags == []


def test_exact_posterior_guide_collapses_in_float64():
    with jax.enable_x64(True):
        x64 = {k: jnp.asarray(v, jnp.float64) for k, v in nn_params().items()}
        report = evidence_bounds(
            KEY,
            nn_model,
            nn_guide,
            x64,
            jnp.asarray(X, jnp.float64),
            num_samples=(100,),
            num_replicates=4,
            bounds=("elbo", "iwae", "cubo"),
        )
        exact = float(
            dist.MultivariateNormal(jnp.zeros(4), jnp.eye(4) + jnp.ones((4, 4))).log_prob(
                jnp.asarray(X, jnp.float64)
            )
        )
    for b in ("elbo", "iwae", "cubo"):
        np.testing.assert_allclose(report.estimates[b], exact, atol=1e-10, err_msg=b)
    assert report.idata.log_weights["q"].dtype == np.float64


def test_heavy_tailed_guide_fires_the_flags(heavy_tailed):
    found = codes(heavy_tailed)
    assert ("khat_lower", "elbo") in found and ("khat_lower", "iwae") in found
    assert ("khat_cubo_mean", "cubo") in found  # k = 0.94 >= 1/2
    assert {("drift_widens", "cubo"), ("drift_slow", "cubo"), ("drift_moves", "cubo")} & found
    k = heavy_tailed.summary().loc[("cubo", SIZES[-1]), "k_hat"]
    assert 0.8 < k < 1.1  # theory: 1 - (1/4)^2 = 0.94
    s = heavy_tailed.summary()
    assert s.loc[("iwae", SIZES[-1]), "median"] < LOG_Z < s.loc[("klpq", SIZES[-1]), "median"]
    text = str(heavy_tailed)
    assert "CUBO_2 not estimable" in text and "Findings" in text


def test_wrong_posterior_draws_flag_klpq_below_iwae(good_fit):
    # draws three posterior sds away from the posterior: E[log w] < log Z (q wider than p)
    wrong = {"mu": NN_DRAWS["mu"] + 3 * POST_SD}
    report = nn_report(nn_params(0.1, 1.1), posterior_samples=wrong, log_evidence=LOG_Z)
    order = [f for f in report.flags if f.code == "order" and f.bound == "klpq"]
    assert order and "Suspect the KLpq" in order[0].message
    assert ("exact", "klpq") in codes(report)
    # the q-sampled bounds did not change (same keys, same compiled program)
    for b in ("elbo", "iwae", "cubo"):
        np.testing.assert_array_equal(report.estimates[b], good_fit.estimates[b])


def test_beta_bernoulli_sandwich_and_collapse():
    a, b = 2.0, 3.0
    y = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    k, n = float(y.sum()), y.shape[0]
    log_z = float(betaln(a + k, b + n - k) - betaln(a, b))

    def model(y):
        p = numpyro.sample("p", dist.Beta(a, b))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(p), obs=y)

    def guide(y):
        numpyro.sample("p", dist.Beta(numpyro.param("qa", 1.0), numpyro.param("qb", 1.0)))

    draws = {"p": dist.Beta(a + k, b + n - k).sample(jax.random.PRNGKey(3), (R * 1000,))}
    run = {"num_samples": (100, 1000), "num_replicates": R, "posterior_samples": draws}
    exact = evidence_bounds(
        KEY, model, guide, {"qa": a + k, "qb": b + n - k}, y, log_evidence=log_z, **run
    )
    for name in ALL:
        np.testing.assert_allclose(exact.estimates[name], log_z, atol=2e-5, err_msg=name)
    # a wider Beta (concentration x 0.7): bounded weights
    wider = evidence_bounds(
        KEY,
        model,
        guide,
        {"qa": 0.7 * (a + k), "qb": 0.7 * (b + n - k)},
        y,
        log_evidence=log_z,
        **run,
    )
    s = wider.summary()
    for size in (100, 1000):
        assert s.loc[("elbo", size), "median"] < log_z
        assert s.loc[("iwae", size), "median"] < log_z
        assert s.loc[("klpq", size), "median"] > log_z
        assert s.loc[("cubo", size), "median"] > log_z
    assert s.loc[("cubo", 1000), "k_hat"] < 0.25
    assert wider.flags == []


def test_autonormal_and_autodiagonalnormal_give_the_same_klpq():
    """log q at posterior draws through AutoNormal's transformed site and through the
    auxiliary latent of an AutoContinuous guide (same q, so the same numbers)."""

    def model():
        numpyro.sample("s", dist.LogNormal(0.0, 1.0))
        numpyro.sample("m", dist.Normal(0.0, 1.0))

    draws = {
        "s": jnp.exp(jax.random.normal(jax.random.PRNGKey(1), (4000,))),
        "m": jax.random.normal(jax.random.PRNGKey(2), (4000,)),
    }
    loc, scale = jnp.array([0.2, -0.1]), jnp.array([0.9, 1.2])
    normal = {"s_auto_loc": loc[0], "s_auto_scale": scale[0]}
    normal.update({"m_auto_loc": loc[1], "m_auto_scale": scale[1]})
    run = {"num_samples": (100,), "num_replicates": 4, "posterior_samples": draws}
    a = evidence_bounds(KEY, model, AutoNormal(model), normal, bounds=("klpq",), **run)
    diag_guide = AutoDiagonalNormal(model)
    b = evidence_bounds(
        KEY, model, diag_guide, {"auto_loc": loc, "auto_scale": scale}, bounds=("klpq",), **run
    )
    np.testing.assert_allclose(a.estimates["klpq"], b.estimates["klpq"], rtol=1e-5)
    # the prior is the posterior here (no data): KLpq = 0 + KL(p || q) > 0 = log Z
    assert (a.estimates["klpq"] > 0).all()


# -- single-document LDA (Pradier et al., section 4; Table 2: 1 word, log p(x) = -1.0986) --------
PHI = jnp.array([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]])  # doubly stochastic
ALPHA = jnp.ones(3)
ONE_WORD = jnp.array([1.0, 0.0, 0.0])


def lda_doc(counts):
    pi = numpyro.sample("pi", dist.Dirichlet(ALPHA))
    numpyro.sample("x", dist.Multinomial(total_count=1, probs=pi @ PHI), obs=counts)


def test_single_document_lda_one_word():
    # exact: p(x) = sum_k E[pi_k] phi_k,w; posterior = sum_k r_k Dir(alpha + e_k), r ~ alpha phi
    mix = ALPHA / ALPHA.sum() * PHI[:, 0]
    log_z = float(jnp.log(mix.sum()))
    assert round(log_z, 4) == -1.0986  # the paper's Table 2 value
    comp = jax.random.categorical(jax.random.PRNGKey(4), jnp.log(mix), shape=(R * 1000,))
    gammas = jax.random.gamma(jax.random.PRNGKey(5), ALPHA + jax.nn.one_hot(comp, 3))
    draws = {"pi": gammas / gammas.sum(-1, keepdims=True)}
    run = {"num_samples": (100, 1000), "num_replicates": R, "posterior_samples": draws}

    # q = Dir(1.2, 1, 1): p / q ~ pi_1^(-0.2) near pi_1 = 0, a light tail (k = 1/6)
    guide = AutoDirichlet(lda_doc, sites="pi")
    conc = {"pi_auto_concentration": jnp.array([1.2, 1.0, 1.0])}
    report = evidence_bounds(KEY, lda_doc, guide, conc, ONE_WORD, log_evidence=log_z, **run)
    s = report.summary()
    for size in (100, 1000):
        assert s.loc[("elbo", size), "median"] < log_z < s.loc[("klpq", size), "median"]
        assert log_z < s.loc[("cubo", size), "median"]
    assert s.loc[("cubo", 1000), "k_hat"] < 0.25  # so the CUBO estimate is trustworthy
    assert abs(s.loc[("iwae", 1000), "median"] - log_z) < 0.01
    assert report.flags == []

    over = AutoOvercompleteLogisticNormal(lda_doc, sites="pi")
    with pytest.raises(ValueError, match="not a latent site of the model"):
        evidence_bounds(KEY, lda_doc, over, {}, ONE_WORD, bounds=("klpq",), **run)


# -- streaming: chunking, memory, agreement with bounds.py and arviz.psislw -----------------------
@pytest.fixture(scope="module")
def chunked():
    """Same key, chunk size 256 (rounded up to 512: ten chunks) and 10^5 (one batch)."""
    out = {}
    for chunk in (256, 100_000):
        out[chunk] = nn_report(
            nn_params(0.3, 0.6),
            num_samples=(300, 5000),
            num_replicates=3,
            bounds=("elbo", "iwae", "cubo", "cubo_prior"),
            chunk_size=chunk,
            cubo_order=3.0,
        )
    return out


def test_chunked_equals_unchunked(chunked):
    one_batch = chunked[100_000]
    for chunk in (256,):
        for b in one_batch.estimates:
            np.testing.assert_array_equal(chunked[chunk].estimates[b], one_batch.estimates[b])
            np.testing.assert_array_equal(chunked[chunk].k_hat[b], one_batch.k_hat[b])
        for group in ("q", "prior"):
            np.testing.assert_array_equal(
                chunked[chunk].idata.log_weights[group].values,
                one_batch.idata.log_weights[group].values,
            )


def test_streamed_estimates_equal_bounds_module_and_psislw(chunked):
    report = chunked[256]
    lw = jnp.asarray(report.idata.log_weights["q"].values, jnp.float32)  # all 5000 particles
    assert lw.shape == (3, 5000)
    np.testing.assert_allclose(report.estimates["elbo"][1], bounds.elbo(lw), rtol=1e-6)
    np.testing.assert_allclose(report.estimates["iwae"][1], bounds.iwae(lw), rtol=1e-6)
    np.testing.assert_allclose(report.estimates["cubo"][1], bounds.cubo(lw, 3.0), rtol=1e-6)
    np.testing.assert_allclose(report.ess["iwae"][1], bounds.effective_sample_size(lw), rtol=1e-4)
    np.testing.assert_allclose(
        report.ess["cubo"][1], bounds.effective_sample_size(3.0 * lw), rtol=1e-4
    )
    # k-hat from the streamed top values == arviz.psislw on all S weights
    np.testing.assert_allclose(report.k_hat["cubo"][1], az.psislw(np.asarray(lw, float))[1])
    # eq. 2 with n = 3: (1/3) log mean(prior integrand)
    pl = jnp.asarray(report.idata.log_weights["prior"].values, jnp.float32)
    np.testing.assert_allclose(report.estimates["cubo_prior"][1], bounds.iwae(pl) / 3.0, rtol=1e-6)


def _max_intermediate(jaxpr) -> int:
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    biggest = max(biggest, _max_intermediate(inner))
    return biggest


def test_one_million_samples_in_bounded_memory():
    size, chunk = 10**6, 10**4
    value = diag._q_value(nn_model, nn_guide, nn_params(0.1, 1.1), (X,), {})
    num_top = diag._pow2(diag._tail_sizes(size)[1])
    step = diag._chunk_size(chunk, size)  # 10240

    def stream(key, num_samples):
        return diag._stream(
            value,
            key,
            num_samples,
            chunk=step,
            num_top=num_top,
            keep_pad=step,
            order=2.0,
            dtype=jnp.float32,
        )

    jaxpr = jax.make_jaxpr(stream)(KEY, size).jaxpr
    biggest = _max_intermediate(jaxpr)
    # nothing of size S: the largest arrays are the top-value buffer merged with one chunk
    assert biggest <= num_top + step < size // 10

    report = evidence_bounds(
        KEY,
        nn_model,
        nn_guide,
        nn_params(0.1, 1.1),
        X,
        num_samples=(size,),
        num_replicates=2,
        bounds=("elbo", "iwae", "cubo"),
        chunk_size=chunk,
    )
    assert report.idata.log_weights["q"].shape == (2, 10_000)  # the storage cap
    np.testing.assert_allclose(report.estimates["iwae"], LOG_Z, atol=2e-3)
    cubo = gaussian_cubo2(POST_LOC + 0.1 * POST_SD, 1.1 * POST_SD)
    np.testing.assert_allclose(report.estimates["cubo"], cubo, atol=5e-3)
    assert (report.ess["elbo"] == size).all()


# -- non-finite weights ------------------------------------------------------------------------
def test_nonfinite_weights_are_counted_never_averaged_away():
    def model(bad):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        numpyro.factor("f", jnp.where(z > 1.5, bad, 0.0))

    def guide(bad):
        numpyro.sample("z", dist.Normal(0.0, 1.0))

    run = {"num_samples": (1000,), "num_replicates": 4, "bounds": ("elbo", "iwae", "cubo")}
    nan = evidence_bounds(KEY, model, guide, {}, jnp.nan, **run)
    for b in ("elbo", "iwae", "cubo"):
        assert np.isnan(nan.estimates[b]).all()
        assert (nan.num_nonfinite[b] > 0).all()
    flag = [f for f in nan.flags if f.code == "nonfinite" and f.bound == "iwae"][0]
    assert "NaN" in flag.message and "never averaged away" in flag.message
    # -inf is a zero weight: counted, used; the ELBO is -inf, IWAE finite and below log Z = 0
    zero = evidence_bounds(KEY, model, guide, {}, -jnp.inf, **run)
    assert (zero.estimates["elbo"] == -np.inf).all()
    assert np.isfinite(zero.estimates["iwae"]).all() and (zero.estimates["iwae"] < 0).all()
    assert (zero.num_nonfinite["iwae"] > 0).all()
    assert ("nonfinite", "iwae") in codes(zero)
    # the same counts as bounds.count_nonfinite on the stored weights
    lw = zero.idata.log_weights["q"].values
    np.testing.assert_array_equal(zero.num_nonfinite["iwae"][0], bounds.count_nonfinite(lw))


# -- ArviZ, pandas, matplotlib -------------------------------------------------------------------
def test_inference_data_summary_and_plot(good_fit):
    idata = good_fit.idata
    assert idata.bounds["log_evidence"].dims == ("chain", "draw", "bound", "num_samples")
    assert list(idata.bounds["bound"].values) == list(ALL)
    summary = az.summary(idata, group="bounds", kind="stats")
    assert len(summary) == len(ALL) * len(SIZES)
    # the calls docs/diagnostics.md names (a probe found `group=` refused by az.ess and
    # az.plot_forest in ArviZ 0.23: the docs now pass the group itself)
    assert az.ess(idata.bounds)["log_evidence"].shape == (len(ALL), len(SIZES))
    assert az.plot_forest(idata.bounds) is not None
    ess = az.ess(idata.log_weights)  # replicates as chains, particles as draws
    assert set(ess.data_vars) == {"q", "klpq"}
    assert idata.log_weights["q"].shape == (R, SIZES[-1])
    np.testing.assert_allclose(
        idata.bounds["log_evidence"].sel(bound="iwae", num_samples=100).values[0],
        good_fit.estimates["iwae"][0],
    )
    s = good_fit.summary()
    assert list(s.columns[:6]) == ["median", "q5", "q95", "mean", "sd", "mcse"]
    assert {"k_hat", "ess", "nonfinite", "error"} <= set(s.columns)
    assert (s["q5"] <= s["median"]).all() and (s["median"] <= s["q95"]).all()

    ax = good_fit.plot()
    assert ax.get_xscale() == "log"
    assert any(np.allclose(line.get_ydata(), LOG_Z) for line in ax.get_lines())
    assert len(ax.get_legend().get_texts()) == len(ALL) + 1
    ax = good_fit.plot(bounds=("iwae", "klpq"), log_evidence=0.0)
    assert len(ax.get_legend().get_texts()) == 3
    # one bound as a string, as evidence_bounds takes it (it was split into characters)
    assert len(good_fit.plot(bounds="iwae").get_legend().get_texts()) == 2
    with pytest.raises(ValueError, match="cubo_prior"):
        good_fit.plot(bounds=("cubo_prior",))


def test_posterior_as_chains_dict_and_inference_data_agree(good_fit):
    chains = {"mu": NN_DRAWS["mu"].reshape(4, -1)}
    from_dict = nn_report(nn_params(0.1, 1.1), posterior_samples=chains, bounds=("klpq",))
    idata = az.from_dict(posterior={"mu": np.asarray(chains["mu"])})
    from_idata = nn_report(nn_params(0.1, 1.1), posterior_samples=idata, bounds=("klpq",))
    np.testing.assert_array_equal(from_dict.estimates["klpq"], good_fit.estimates["klpq"])
    np.testing.assert_array_equal(from_idata.estimates["klpq"], good_fit.estimates["klpq"])


def test_default_posterior_draws_by_nuts():
    """One tiny NUTS run: draws for KLpq, the run kept in idata, resampling flagged."""
    a, b, k, n = 1.0, 1.0, 3.0, 4.0

    def model():
        p = numpyro.sample("p", dist.Beta(a, b))
        numpyro.sample("k", dist.Binomial(n, p), obs=k)

    def guide():
        numpyro.sample("p", dist.Beta(numpyro.param("qa", 2.0), numpyro.param("qb", 2.0)))

    log_z = -math.log(n + 1)  # uniform prior: p(k) = 1 / (n + 1)
    report = evidence_bounds(
        KEY,
        model,
        guide,
        {},
        num_samples=(100, 400),
        num_replicates=5,
        bounds=("klpq",),
        mcmc_kwargs={"num_warmup": 200, "num_samples": 150, "num_chains": 2},
        progress_bar=False,
    )
    assert {"posterior", "sample_stats"} <= set(report.idata.groups())
    assert report.idata.posterior["p"].shape == (2, 150)
    # posterior Beta(4, 2), q = Beta(2, 2): KLpq = log Z + KL(p || q) = log Z + 0.18
    assert (np.median(report.estimates["klpq"], axis=1) > log_z + 0.05).all()
    assert ("klpq_bootstrap", "klpq") in codes(report)  # 300 draws < 5 x 400


# -- argument checks -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bounds": ("elbo", "eubo")}, "bounds"),
        ({"num_samples": (100, 0)}, "num_samples"),
        ({"num_samples": (100, 100)}, "repeated"),
        ({"num_replicates": 1}, "num_replicates"),
        ({"cubo_order": 1.0}, "cubo_order"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"log_evidence": float("nan")}, "log_evidence"),
        ({"log_evidence": "a"}, "`log_evidence` must be a finite number"),
        ({"posterior_samples": {"nu": jnp.zeros(10)}}, r"latent sites \['mu'\]"),
        ({"posterior_samples": {"mu": jnp.zeros((2, 3, 4))}}, "expected"),
        # found by a probe: empty draws failed inside numpy ("high <= 0")
        ({"posterior_samples": {"mu": jnp.zeros((1, 0))}}, r"holds no draws"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    options = {"num_samples": (100,), "num_replicates": 2, "posterior_samples": NN_DRAWS}
    options.update(kwargs)
    with pytest.raises(ValueError, match=match):
        evidence_bounds(KEY, nn_model, nn_guide, nn_params(), X, **options)


def test_params_that_miss_the_guides_parameters_are_refused():
    """Found by a probe: params under other names (a typo, another guide's) left the guide at
    its initial parameters, silently (an ELBO of -3.65 for -2.26, no flag)."""
    wrong = {f"{k}_typo": v for k, v in nn_params().items()}
    with pytest.raises(ValueError, match="`params` has no value for the parameter site"):
        evidence_bounds(KEY, nn_model, nn_guide, wrong, X, num_samples=(100,),
                        num_replicates=2, posterior_samples=NN_DRAWS)


def test_posterior_samples_of_the_wrong_type():
    with pytest.raises(TypeError, match="posterior_samples"):
        evidence_bounds(KEY, nn_model, nn_guide, nn_params(), X, posterior_samples=[1.0])


def test_point_mass_guides_are_refused():
    with pytest.raises(ValueError, match="point mass"):
        evidence_bounds(
            KEY,
            nn_model,
            AutoDelta(nn_model),
            {"mu_auto_loc": jnp.array(0.5)},
            X,
            bounds=("elbo",),
        )


# -- training-time checks --------------------------------------------------------------------------
def test_training_flags_are_jit_safe_and_exact():
    flags = jax.jit(training_flags, static_argnames="n")(
        jnp.array([0.0, 0.0, 0.0, jnp.log(3.0)]), n=2.0, lower_bound=1.0
    )
    # w = (1, 1, 1, 3): w^2 = (1, 1, 1, 9), Kish ESS = 12^2 / 84, CUBO_2 = 0.5 log 3
    np.testing.assert_allclose(flags.ess_fraction, 144 / 84 / 4, rtol=1e-6)
    np.testing.assert_allclose(flags.cubo, 0.5 * math.log(3.0), rtol=1e-6)
    assert bool(flags.below_lower_bound) and not bool(flags.degenerate)
    assert int(flags.num_nonfinite) == 0
    degenerate = training_flags(jnp.array([0.0] * 199 + [50.0]))
    assert bool(degenerate.degenerate) and not bool(degenerate.below_lower_bound)


def test_warn_training_flags_inside_a_jitted_loss():
    @jax.jit
    def loss(log_w):
        flags = training_flags(log_w, lower_bound=5.0)
        jax.debug.callback(warn_training_flags, flags)
        return flags.cubo

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = float(loss(jnp.zeros(8)))
        jax.effects_barrier()
    assert any(
        issubclass(w.category, BoundWarning) and "below the given lower bound" in str(w.message)
        for w in caught
    )
    np.testing.assert_allclose(value, 0.0)
    # a vmapped loss passes batched flags: the worst entry is reported
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.vmap(loss)(jnp.stack([jnp.zeros(8), jnp.full(8, 9.0)])).block_until_ready()
        jax.effects_barrier()
    messages = [str(w.message) for w in caught if issubclass(w.category, BoundWarning)]
    assert any("CUBO estimate 0.0000 is below" in m for m in messages)


def test_a_laplace_approximation_is_its_gaussian():
    """AutoLaplaceApproximation samples its MAP point (a point mass): the bounds use its
    Laplace posterior (guide.get_posterior, a multivariate normal over the same latent), as
    docs/diagnostics.md says; on the normal-normal model it is the exact posterior, so every
    bound, the prior-sampled CUBO included, is log Z (it was refused: "a point mass")."""
    import optax
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoLaplaceApproximation

    guide = AutoLaplaceApproximation(nn_model)
    svi = SVI(nn_model, guide, optax.adam(0.05), Trace_ELBO())
    params = svi.run(KEY, 600, X, progress_bar=False).params
    report = evidence_bounds(KEY, nn_model, guide, params, X, num_samples=(100,),
                             num_replicates=4, bounds=("elbo", "iwae", "cubo", "cubo_prior"),
                             progress_bar=False)
    for b in ("elbo", "iwae", "cubo"):
        np.testing.assert_allclose(report.estimates[b], LOG_Z, atol=1e-3, err_msg=b)
    assert abs(float(np.median(report.estimates["cubo_prior"])) - LOG_Z) < 0.2
