"""The tempered-SMC estimator of log C(T) (the default of log_partition) against exact answers.

Three models with N = 2000 whose tilted target p(beta) prod_n c_n(beta, T) is far from the
prior (where plain Monte Carlo over the prior fails): Beta-Bernoulli (exact by quadrature),
a Normal likelihood whose scale has a log-normal prior (closed form), and a two-component
mixture whose discrete local is tempered jointly with the observation (quadrature over the
mixing weight). One compiled estimator per model (module fixtures, cached by log_partition).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy.special import betaln, gammaln
from scipy.special import logsumexp as sp_logsumexp

from numpyro_tempering import partition_function as pf
from numpyro_tempering.ladder import Ladder
from numpyro_tempering.partition_function import log_partition
from numpyro_tempering.tempered_smc import MIN_PARTICLES, flag_smc

KEY = jax.random.PRNGKey(11)
TEMPS = np.array([1.0, 1.5, 2.5, 5.0, 10.0])
N = 2000
K_SE = 4.0  # the error must be within K_SE reported standard errors (+ float32 slack)


def log_trapezoid(log_f: np.ndarray, grid: np.ndarray) -> float:
    """log int f over ``grid`` by the trapezoid rule, from log f (no overflow)."""
    w = np.full(grid.size, grid[1] - grid[0])
    w[[0, -1]] /= 2
    return float(sp_logsumexp(log_f + np.log(w)))


# (a) Beta-Bernoulli: C(T) = int Beta(p; A, B) (p^a + (1 - p)^a)^N dp, a = 1/T.
A_BB, B_BB = 2.0, 3.0


def bb_model(x):
    p = numpyro.sample("p", dist.Beta(A_BB, B_BB))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Bernoulli(probs=p), obs=x)


def bb_exact(T, n=N):
    a = 1.0 / T
    p = np.linspace(1e-9, 1 - 1e-9, 400_001)
    log_prior = (A_BB - 1) * np.log(p) + (B_BB - 1) * np.log1p(-p) - betaln(A_BB, B_BB)
    return log_trapezoid(log_prior + n * np.logaddexp(a * np.log(p), a * np.log1p(-p)), p)


def test_beta_bernoulli_quadrature_agrees_with_the_binomial_sum():
    for T in (1.0, 2.5):
        a, k = 1.0 / T, np.arange(N + 1)
        log_binom = gammaln(N + 1) - gammaln(k + 1) - gammaln(N - k + 1)
        closed = sp_logsumexp(
            log_binom + betaln(A_BB + a * k, B_BB + a * (N - k)) - betaln(A_BB, B_BB)
        )
        assert bb_exact(T) == pytest.approx(closed, abs=1e-6)


# (b) Regression with a log-normal noise scale: y_n ~ N(w u_n, s m_n), s ~ LogNormal(0, v),
# w ~ N(0, 1). c_n(s, T) = (2 pi s^2 m_n^2)^((1-a)/2) T^(1/2) is free of w (a global the
# tempered factor does not touch: it must still mix), so C(T) = prod_n [(2 pi m_n^2)^((1-a)/2)
# T^(1/2)] E[s^k], k = N (1 - a), E[s^k] = exp(k^2 v^2 / 2). The tilted target exp(k log s)
# p(s) shifts log s by k v^2 = 4.5 (90 prior sds) at T = 10.
V_LN = 0.05


def multipliers(n):
    return jnp.linspace(0.5, 2.0, n)


def scale_model(x):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    s = numpyro.sample("s", dist.LogNormal(0.0, V_LN))
    n = x.shape[0]
    with numpyro.plate("data", n):
        numpyro.sample("x", dist.Normal(w * jnp.linspace(-1.0, 1.0, n), s * multipliers(n)),
                       obs=x)


def scale_exact_elements(temps, n=N):  # (M, N): the split the estimator defines, exactly
    t = np.asarray(temps, np.float64)[:, None]
    a = 1.0 / t
    k = n * (1 - a)
    m = np.asarray(multipliers(n), np.float64)
    base = 0.5 * (1 - a) * np.log(2 * np.pi * m**2) + 0.5 * np.log(t)
    # E[log s] under the tilted target is k v^2; the even share is log C - sum of the rest
    return base + (1 - a) * k * V_LN**2 - (k * V_LN) ** 2 / (2 * n)


def scale_exact(T, n=N):
    return float(scale_exact_elements([T], n).sum())


# (c) Two-component mixture, its discrete local tempered jointly (joint=True: the registry's
# closed form sum_k w_k^a Z_k(T)); the global is the mixing weight w ~ Uniform(0, 1):
# C(T) = int_0^1 (w^a Z_1 + (1 - w)^a Z_2)^N dw, Z_k = (2 pi s_k^2)^((1-a)/2) T^(1/2).
LOC_MIX, S_MIX = np.array([-1.0, 2.0]), np.array([0.5, 2.0])


def mixture_model(x):
    w = numpyro.sample("w", dist.Uniform(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        mix = dist.MixtureSameFamily(
            dist.Categorical(probs=jnp.stack([w, 1.0 - w])),
            dist.Normal(jnp.asarray(LOC_MIX), jnp.asarray(S_MIX)),
        )
        numpyro.sample("x", mix, obs=x)


def mixture_exact(T, n=N):
    a = 1.0 / T
    log_z = 0.5 * (1 - a) * np.log(2 * np.pi * S_MIX**2) + 0.5 * np.log(T)
    w = np.linspace(1e-12, 1 - 1e-12, 400_001)
    log_c = np.logaddexp(a * np.log(w) + log_z[0], a * np.log1p(-w) + log_z[1])
    return log_trapezoid(n * log_c, w)


CASES = {
    "beta_bernoulli": (bb_model, bb_exact, {}),
    "lognormal_regression": (scale_model, scale_exact, {}),
    "joint_mixture": (mixture_model, mixture_exact, {"joint": True}),
}


@pytest.fixture(scope="module")
def estimates():
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a trustworthy estimate is silent
        for name, (model, exact, kw) in CASES.items():
            est = log_partition(KEY, model, TEMPS, jnp.zeros(N), plate="data", **kw)
            out[name] = (est, np.array([exact(T) for T in TEMPS]))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_smc_is_within_a_tenth_of_a_nat_and_its_error_bar_covers_the_truth(estimates, case):
    est, exact = estimates[case]
    assert est.method == "smc"
    log_c, se = np.asarray(est.log_c, np.float64), np.asarray(est.stderr, np.float64)
    err = np.abs(log_c - exact)
    assert np.all(err < 0.1), err
    assert np.all(err <= K_SE * se + 1e-6 * np.abs(exact) + 1e-4), (err, se)
    assert log_c[0] == 0.0 and se[0] == 0.0 and exact[0] == pytest.approx(0.0, abs=1e-6)
    assert np.all(se[1:] > 0) and not est.flagged.any()
    # per-replicate values, ESS and stages are reported
    assert est.replicate_log_c.shape == (4, TEMPS.size)
    assert np.all(np.isfinite(est.replicate_log_c)) and np.all(est.num_stages >= 1)
    assert np.all(np.asarray(est.ess) > 10) and np.all(np.asarray(est.num_nonfinite) == 0)
    # per-element pieces add up to log C
    assert est.element_log_c.shape == (TEMPS.size, N)
    np.testing.assert_allclose(np.asarray(est.element_log_c).sum(1), log_c, rtol=1e-4, atol=1e-2)


def test_smc_in_float64_is_float64_and_as_accurate():
    # the SMC path end to end with x64 on (blackjax's kernels, the Laplace reference, the
    # replicate average): float64 out, within the reported error of the quadrature
    temps = np.array([1.0, 2.5, 10.0])
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("error")  # a trustworthy estimate is silent
        est = log_partition(KEY, bb_model, temps, jnp.zeros(N), num_particles=128)
    assert est.method == "smc" and est.log_c.dtype == jnp.float64
    exact = np.array([bb_exact(T) for T in temps])
    err = np.abs(np.asarray(est.log_c) - exact)
    assert np.all(err <= K_SE * np.asarray(est.stderr) + 1e-9) and np.all(err < 0.1), err
    assert not est.flagged.any()


def test_the_old_estimator_is_flagged_where_smc_is_not(estimates):
    est, exact = estimates["lognormal_regression"]
    with pytest.warns(UserWarning, match="cannot be trusted"):
        old = log_partition(KEY, scale_model, TEMPS, jnp.zeros(N), method="prior", num_samples=200)
    assert old.method == "prior" and old.flagged[1:].all()
    assert np.max(np.abs(np.asarray(old.log_c) - exact)) > 1.0  # the old failure, reproduced
    assert not est.flagged.any()


def test_a_starved_budget_is_flagged_never_confidently_wrong():
    temps = TEMPS[[0, -1]]  # the starved runs below share one compiled estimator
    with pytest.warns(UserWarning, match="tempered SMC estimate of log C.T. cannot be trusted"):
        est = log_partition(
            KEY, scale_model, temps, jnp.zeros(N), num_particles=4, num_replicates=2
        )
    exact = np.array([scale_exact(T) for T in temps])
    wrong = np.abs(np.asarray(est.log_c) - exact) > 0.1
    assert not np.any(wrong & ~est.flagged)
    assert est.flagged.tolist() == [False, True]  # T = 1 is exact (log C(1) = 0)
    assert est.num_particles == 4 < MIN_PARTICLES


def test_compiled_once_per_model_and_shape():
    def count():
        return len(pf._SMC_CACHE)

    temps = TEMPS[[0, -1]]
    with pytest.warns(UserWarning):  # starved budget: flagged
        log_partition(KEY, scale_model, temps, jnp.zeros(N), num_particles=4, num_replicates=2)
    before = count()
    with pytest.warns(UserWarning):
        log_partition(KEY, scale_model, temps, jnp.ones(N), num_particles=4, num_replicates=2)
    assert count() == before  # other data values, same shapes: the cached function


def test_flag_smc_rules():
    ok = dict(ess=[100.0], num_particles=256, replicate_log_c=[[1.0], [1.1]],
              acceptance=[0.8], num_nonfinite=[0])
    assert flag_smc(**ok).tolist() == [False]
    assert flag_smc(**{**ok, "num_nonfinite": [1]}).tolist() == [True]
    assert flag_smc(**{**ok, "ess": [3.0]}).tolist() == [True]
    assert flag_smc(**{**ok, "acceptance": [0.0]}).tolist() == [True]
    assert flag_smc(**{**ok, "replicate_log_c": [[1.0], [4.0]]}).tolist() == [True]
    assert flag_smc(**{**ok, "num_particles": 8}).tolist() == [True]


def test_discrete_globals_fall_back_with_a_warning():
    def model(x):
        b = numpyro.sample("b", dist.Bernoulli(0.3))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(0.0, 1.0 + b), obs=x)

    with pytest.warns(UserWarning, match=r"discrete global site\(s\) \['b'\]\); falling back"):
        est = log_partition(KEY, model, [1.0, 2.0], jnp.zeros(3), num_samples=500)
    assert est.method == "prior"
    a = 0.5
    log_z = 0.5 * (1 - a) * np.log(2 * np.pi * np.array([1.0, 4.0])) + 0.5 * np.log(2.0)
    exact = sp_logsumexp(np.log([0.7, 0.3]) + 3 * log_z)
    assert float(est.log_c[1]) == pytest.approx(exact, abs=5 * float(est.stderr[1]) + 1e-4)


def test_method_is_checked():
    with pytest.raises(ValueError, match="`method` must be one of"):
        log_partition(KEY, scale_model, TEMPS, jnp.zeros(3), method="ais")
    with pytest.raises(ValueError, match="`num_replicates` must be an integer >= 2"):
        log_partition(KEY, scale_model, TEMPS, jnp.zeros(3), num_replicates=1)


def test_ladder_keeps_and_shows_the_smc_diagnostics(estimates):
    est, _ = estimates["lognormal_regression"]
    with pytest.warns(UserWarning, match="cannot be trusted"):
        starved = Ladder(TEMPS[[0, -1]]).with_log_partition(
            scale_model, KEY, jnp.zeros(N), num_particles=4, num_replicates=2
        )
    assert starved.method == "smc" and starved.flagged.tolist() == [False, True]
    assert "UNTRUSTED" in repr(starved) and "method='smc'" in repr(starved)
    rows = starved.summary().splitlines()
    assert rows[0].split()[5] == "stages" and rows[2].split()[-1] == "YES"
    assert est.num_particles == 256


# ---------------------------------------------------------------------------------------
# LDA (supplement eq. 5-8): the per-document theta are untempered locals, so log_partition
# falls back (with a warning) to the nested Monte Carlo of eq. 7, bracketed by the exact
# upper bound of eq. 4 (analytic_log_partition) and the Jensen lower bounds of eq. 8. Tiny
# LDA: K = 2 topics, V = 3 words, D = 2 documents of L = 2 words, alpha = eta = 1, against
# brute-force quadrature of C(T) = E_beta[(E_theta[s(theta, beta)^L])^D],
# s = sum_v (theta . beta_v)^(1/T) (Gauss-Legendre; each simplex by the Duffy map).
K_LDA, V_LDA, D_LDA, L_LDA = 2, 3, 2, 2


def lda_exact(T, nodes=20):
    a = 1.0 / T
    x, w = np.polynomial.legendre.leggauss(nodes)
    x, w = (x + 1) / 2, w / 2
    u, v = np.meshgrid(x, x, indexing="ij")
    simplex = np.stack([u, (1 - u) * v, (1 - u) * (1 - v)], -1).reshape(-1, 3)
    weight = (np.outer(w, w) * 2 * (1 - u)).reshape(-1)  # Dir(1, 1, 1) density 2, Jacobian
    b1, b2 = simplex[:, None, None, :], simplex[None, :, None, :]  # (S, 1, 1, V), (1, S, 1, V)
    t = x[None, None, :, None]
    s = np.sum((t * b1 + (1 - t) * b2) ** a, -1)  # (S, S, nodes)
    g = np.sum(w * s**L_LDA, -1)  # E_theta[s^L], theta = (t, 1 - t) ~ Dir(1, 1)
    return float(np.log(np.sum(weight[:, None] * weight[None, :] * g**D_LDA)))


def test_lda_log_c_is_bracketed_and_the_nested_estimate_covers_brute_force():
    from numpyro_tempering.models import lda
    from numpyro_tempering.partition_function import analytic_log_partition, jensen_bounds

    temps = np.array([1.0, 2.0, 5.0])
    exact = np.array([lda_exact(T) for T in temps])
    assert exact[0] == pytest.approx(0.0, abs=1e-6)
    assert np.allclose(exact, [lda_exact(T, nodes=14) for T in temps], atol=1e-3)  # converged
    words = jnp.zeros((D_LDA, L_LDA), jnp.int32)
    args = (words, K_LDA, V_LDA, 1.0, 1.0)
    upper = np.asarray(analytic_log_partition(KEY, lda.model, temps, *args, plate="docs"))
    np.testing.assert_allclose(upper, D_LDA * L_LDA * (1 - 1 / temps) * np.log(V_LDA),
                               rtol=1e-5, atol=1e-6)  # float32: 0 at T = 1 to rounding
    bounds = jensen_bounds(KEY, lda.model, temps, *args, plate="docs", num_samples=1000)
    # the default falls back to this (warning about the local theta); asked for directly
    # here to save the compilation of the probes
    est = log_partition(KEY, lda.model, temps, *args, plate="docs", num_samples=1000,
                        num_inner=32, method="prior")
    hot = slice(1, None)
    assert np.all(np.asarray(bounds.mean_log)[hot] < exact[hot])
    # log_mean is a Monte Carlo estimate of a lower bound that is tight here: up to its error
    assert np.all(np.asarray(bounds.log_mean)[hot] < exact[hot] + 0.01)
    assert np.all(exact[hot] < upper[hot])
    err = np.abs(np.asarray(est.log_c) - exact)
    assert np.all(err <= 4 * np.asarray(est.stderr) + 0.01) and np.all(err < 0.05)


def test_local_latents_that_matter_fall_back_with_a_warning():
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            # an untempered local of two coordinates (the default's quadrature takes one)
            z = numpyro.sample("z", dist.Normal(mu, 1.0).expand([2]).to_event(1))
            numpyro.sample("x", dist.Normal(0.0, jnp.exp(z.sum(-1))), obs=x)

    with pytest.warns(UserWarning, match=r"local latent site\(s\) \['z'\] change the"):
        est = log_partition(KEY, model, [1.0, 2.0], jnp.zeros(3), plate="data", num_inner=4)
    assert est.method == "prior"


# ---------------------------------------------------------------------------------------
# MVI end to end on the regression of case (b) (its compiled estimator is shared): the
# multicanonical objective, with a shared and with per-element temperatures, is the same
# with the SMC ladder as with the exact one, up to the reported error.
def regression_guide(x):
    numpyro.sample("w", dist.Normal(numpyro.param("w_loc", 0.3), 0.1))
    numpyro.sample("s", dist.LogNormal(numpyro.param("s_loc", 0.1), 0.05))


def test_multicanonical_elbo_is_the_same_with_the_smc_log_c_as_with_the_exact_one(estimates):
    from numpyro_tempering.objectives.multicanonical import MulticanonicalELBO
    from numpyro_tempering.partition_function import model_sizes

    x = jnp.zeros(N)
    # the fixture's estimate is log_partition(KEY, scale_model, TEMPS, x, plate="data"),
    # what Ladder(TEMPS).with_log_partition(scale_model, KEY, x, plate="data") would run
    smc = Ladder(TEMPS).with_estimate(estimates["lognormal_regression"][0])
    elements = scale_exact_elements(TEMPS)
    exact = Ladder(TEMPS).with_log_partition_values(
        element_log_c=elements, plate="data", sizes=model_sizes(scale_model, x)
    )
    assert smc.method == "smc" and not smc.flagged.any()
    assert np.all(np.abs(smc.log_c - exact.log_c) <= 4 * smc.stderr + 1e-3)
    # each element is off by (error of log C) / N only: the particle error of E[log s]
    # is the same for every element and cancels against the even share
    np.testing.assert_allclose(smc.element_log_c, elements, atol=1e-3)
    params = {"w_loc": jnp.array(0.3), "s_loc": jnp.array(0.1)}
    tol = 4 * np.max(smc.stderr) + 0.01
    for plate in (None, "data"):
        elbo = [MulticanonicalELBO(lad, plate=plate, num_particles=4) for lad in (smc, exact)]
        smc_loss, exact_loss = (
            float(e.loss(KEY, params, scale_model, regression_guide, x)) for e in elbo
        )
        assert abs(smc_loss - exact_loss) <= tol, (plate, smc_loss, exact_loss)


def test_subsampled_plates_fall_back_with_a_warning():
    def model(x, subsample_size=None):
        s = numpyro.sample("s", dist.LogNormal(0.0, 0.1))
        with numpyro.plate("data", x.shape[0], subsample_size=subsample_size) as idx:
            numpyro.sample("x", dist.Normal(0.0, s), obs=x[idx])

    with pytest.warns(UserWarning, match=r"subsampled plate\(s\) \['data'\]"):
        est = log_partition(KEY, model, [1.0, 2.0], jnp.zeros(6), subsample_size=3,
                            num_samples=500)
    assert est.method == "prior"
    k = 6 * 0.5
    exact = 3 * np.log(2.0) + 0.5 * k * np.log(2 * np.pi) + 0.5 * (k * 0.1) ** 2
    assert float(est.log_c[1]) == pytest.approx(exact, abs=4 * float(est.stderr[1]) + 1e-3)


def test_particles_of_weight_zero_do_not_make_the_final_means_nan():
    """A particle whose target is NaN (a global scale drawn where the model's density is NaN:
    a logit-normal Binomial's sigma at e^-209, 0 in float32) has weight 0; its NaN check
    value and per-element values made the quadrature error NaN and flagged the temperature
    (docs/reproductions.md, "A logit-normal Binomial"). Only weighted particles count."""
    from numpyro_tempering.tempered_smc import SMCSettings, _smc, _Target

    def pieces(u, t):
        el = jnp.where(u[0] > 1.5, jnp.nan, -0.5 * u[0] ** 2 / t) * jnp.ones(2)
        return jnp.sum(el), el, jnp.zeros(())

    target = _Target(lambda k: jax.random.normal(k, (1,)),
                     lambda u: -0.5 * jnp.sum(u**2) - 0.5 * np.log(2 * np.pi), pieces)
    settings = SMCSettings(num_particles=64, max_stages=20)
    out = jax.jit(lambda k: _smc(target, settings, k, jnp.asarray(2.0), None, True,
                                 final=lambda u: (jnp.abs(pieces(u, 2.0)[0]),
                                                  *pieces(u, 2.0)[1:])))(KEY)
    log_z, element, check = out[0], out[4], out[6]
    assert np.isfinite(log_z) and np.all(np.isfinite(element)) and np.isfinite(check)


def test_a_nan_acceptance_counts_as_a_rejection_not_as_a_run_that_accepts_nothing():
    """tempered_smc.mean_acceptance: one divergent proposal's NaN rate made the stage's mean
    NaN, read as 0 (the step size shrank and the run was flagged for acceptance 0)."""
    from numpyro_tempering.tempered_smc import mean_acceptance

    rate = jnp.array([[1.0, jnp.nan], [0.5, 0.5]])
    assert float(mean_acceptance(rate)) == 0.5
    assert float(mean_acceptance(jnp.full((2, 2), jnp.nan))) == 0.0
