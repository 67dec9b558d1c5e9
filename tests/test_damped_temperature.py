"""The damped q(y) of MulticanonicalELBO (``step_size``): a running average of eq. 18's
log-weights (Mandt et al. 2016), checked by hand; ``step_size=1`` is eq. 18."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numpyro.infer import SVI
from scipy.special import logsumexp as sp_logsumexp
from scipy.stats import norm
from test_multicanonical import (
    KEY,
    LADDER,
    PARAMS,
    SIGMA,
    TEMPS,
    WEIGHTS,
    X,
    guide,
    guide_draw,
    log_prior_minus_log_q,
    model,
    normal_log_c,
)

from numpyro_tempering import TemperedELBO
from numpyro_tempering.objectives.multicanonical import (
    MulticanonicalELBO,
    record_temperatures,
    temperature_history,
)
from numpyro_tempering.temperatures import (
    TemperatureRecord,
    damped_log_weights,
    robbins_monro,
)

RECORDED = record_temperatures(model, LADDER, 8)
LOG_PI = np.log(WEIGHTS)


def record(log_weights, step=0):
    rec = TemperatureRecord.empty(8, TEMPS.size, jnp.float32, LOG_PI)
    return TemperatureRecord(
        jnp.asarray(step, jnp.int32), rec.probs, rec.mean_temperature,
        rec.mean_inverse_temperature, jnp.asarray(log_weights, jnp.float32),
    )


def step(elbo, rec, params=PARAMS, key=KEY):
    """One loss evaluation from ``rec``: (loss, new record)."""
    out = jax.jit(
        lambda k, p, r: elbo.loss_with_mutable_state(
            k, {**p, "_temperature_record": r}, RECORDED, guide, X
        )
    )(key, params, rec)
    return out["loss"], out["mutable_state"]["_temperature_record"]


def eq18_log_weights(mu):
    """log pi + l / T - log C at the guide draw mu (float64, by hand)."""
    lik = norm.logpdf(np.asarray(X, np.float64), mu, SIGMA).sum()
    return LOG_PI + lik / TEMPS - normal_log_c(TEMPS), lik


def test_step_size_one_is_eq18():
    exact, one = MulticanonicalELBO(LADDER), MulticanonicalELBO(LADDER, step_size=1.0)
    runs = []
    for elbo in (exact, one):
        svi = SVI(RECORDED, guide, optax.adam(0.1), elbo)
        runs.append(svi.run(jax.random.PRNGKey(3), 6, X, progress_bar=False))
    h0, h1 = temperature_history(runs[0]), temperature_history(runs[1])
    np.testing.assert_array_equal(h1.probs[0], h0.probs[0])  # same logits, same softmax
    np.testing.assert_allclose(h1.probs, h0.probs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(runs[1].losses, runs[0].losses, rtol=1e-6)


def test_step_size_one_gives_eq18_log_weights_by_hand():
    _, rec = step(MulticanonicalELBO(LADDER, step_size=1.0), record(LOG_PI + 5.0))
    target, _ = eq18_log_weights(guide_draw(KEY))
    np.testing.assert_allclose(rec.log_weights, target, rtol=1e-6)  # the past is forgotten


def test_a_damped_update_is_the_stated_average_by_hand():
    rho = 0.3
    previous = LOG_PI + np.array([0.3, -1.2, 2.0])
    loss, rec = step(MulticanonicalELBO(LADDER, step_size=rho), record(previous, step=4))
    mu = guide_draw(KEY)
    target, lik = eq18_log_weights(mu)
    a = (1.0 - rho) * previous + rho * target
    np.testing.assert_allclose(rec.log_weights, a, rtol=1e-6)
    r = np.exp(a - sp_logsumexp(a))
    np.testing.assert_allclose(rec.probs[4], r, rtol=1e-5)
    assert int(rec.step) == 5
    # the M-ELBO (eq. 13) at this q(y): y-terms with its own log r
    m_elbo = log_prior_minus_log_q(mu) + np.sum(
        r * (lik / TEMPS - normal_log_c(TEMPS) + LOG_PI - np.log(r))
    )
    np.testing.assert_allclose(-loss, m_elbo, rtol=1e-6)


def test_robbins_monro_recursion_at_a_fixed_fit():
    # same key and parameters every step: l is fixed, so a_k = log pi + (1 - prod(1 - rho_s))
    # (l / T - log C), with rho_s = (tau + s)^-kappa and s = 1, 2, 3 counted by the record
    tau, kappa = 2.0, 0.8
    elbo = MulticanonicalELBO(LADDER, step_size=robbins_monro(tau, kappa))
    rec = record(LOG_PI)
    for _ in range(3):
        _, rec = step(elbo, rec)
    target, _ = eq18_log_weights(guide_draw(KEY))
    kept = np.prod([1.0 - (tau + s) ** -kappa for s in (1, 2, 3)])
    np.testing.assert_allclose(rec.log_weights, LOG_PI + (1.0 - kept) * (target - LOG_PI),
                               rtol=1e-5)


def test_damped_bound_is_below_eq18_and_its_gradient_is_tempered():
    elbo = MulticanonicalELBO(LADDER, step_size=0.05)
    rec = record(LOG_PI)
    damped, new = step(elbo, rec)
    exact = jax.jit(lambda k, p: MulticanonicalELBO(LADDER).loss(k, p, model, guide, X))(
        KEY, PARAMS
    )
    assert float(damped) > float(exact) + 1e-3  # -M-ELBO: eq. 18 is the maximiser over q(y)
    beta = float(new.mean_inverse_temperature[0])
    grad = jax.jit(jax.grad(lambda p: step(elbo, rec, params=p)[0]))(PARAMS)
    tempered = TemperedELBO(temperature=1.0 / beta)
    ref = jax.jit(jax.grad(lambda p: tempered.loss(KEY, p, model, guide, X)))(PARAMS)
    for k in PARAMS:
        np.testing.assert_allclose(grad[k], ref[k], rtol=1e-5)


def test_zero_prior_rungs_stay_minus_infinity():
    lad = LADDER.__class__(TEMPS, [0.5, 0.0, 0.5]).with_log_partition_values(
        normal_log_c(TEMPS)
    )
    prior = np.array([np.log(0.5), -np.inf, np.log(0.5)])
    a = np.asarray(damped_log_weights(prior, jnp.array([-3.0, -1.5, -1.0]), lad, 0.5))
    assert np.isneginf(a[1]) and np.all(np.isfinite(a[[0, 2]]))


def test_a_zero_step_holds_the_log_weights_whatever_the_likelihood():
    """rho_t = 0 (a schedule updating q(y) only every n steps, between updates) keeps the
    previous log-weights exactly, even where this step's l_m is not finite (0 * nan would
    make them NaN); rho_t = 1 is eq. 18."""
    lad = LADDER.__class__(TEMPS, [0.5, 0.0, 0.5]).with_log_partition_values(
        normal_log_c(TEMPS)
    )
    prev = jnp.array([-0.3, -jnp.inf, -1.2])
    for ell in (jnp.array([jnp.nan, 1.0, -jnp.inf]), jnp.array([-3.0, -1.5, -1.0])):
        np.testing.assert_array_equal(damped_log_weights(prev, ell, lad, 0.0), prev)
    ell = jnp.array([-3.0, -1.5, -1.0])
    eq18 = np.log([0.5, 0.0, 0.5]) + np.asarray(ell) - normal_log_c(TEMPS)
    np.testing.assert_allclose(damped_log_weights(prev, ell, lad, 1.0), eq18, rtol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="global temperature"):
        MulticanonicalELBO(LADDER, plate="data", step_size=0.1)
    with pytest.raises(ValueError, match="step_size"):
        MulticanonicalELBO(LADDER, step_size=0.0)
    with pytest.raises(ValueError, match="Robbins-Monro"):
        robbins_monro(1.0, 0.4)
    with pytest.raises(ValueError, match="record_temperatures"):
        MulticanonicalELBO(LADDER, step_size=0.1).loss(KEY, PARAMS, model, guide, X)


def test_a_record_shorter_than_the_run_says_so():
    """SVI ran 12 steps into a record of 8 rows: the history warns that its last row is step
    8's, and mean_inverse_temperature (the *current* value) refuses instead of returning
    step 8's as if it were the last (it did, silently)."""
    from numpyro_tempering import mean_inverse_temperature

    rec = record(np.log(WEIGHTS))
    rows = jnp.arange(8.0)
    full = TemperatureRecord(jnp.asarray(12, jnp.int32), rec.probs, rows, 1.0 / (1.0 + rows),
                             rec.log_weights)
    with pytest.warns(UserWarning, match="first 8 of the 12 SVI steps"):
        hist = temperature_history({"_temperature_record": full})
    assert hist.probs.shape[0] == 8
    with pytest.raises(ValueError, match="first 8 of the 12 SVI steps"):
        mean_inverse_temperature({"_temperature_record": full})
    assert "the record is full" in repr(full)
    exact = TemperatureRecord(jnp.asarray(8, jnp.int32), rec.probs, rows, 1.0 / (1.0 + rows),
                              rec.log_weights)
    assert mean_inverse_temperature({"_temperature_record": exact}) == pytest.approx(1 / 8)
