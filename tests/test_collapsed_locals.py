"""Beta locals read only by a tempered Bernoulli / Binomial: log C integrates them in closed
form (numpyro_tempering.conjugate), checked against the definition integrated numerically."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate
from scipy.special import betaln, gammaln, logsumexp
from scipy.stats import norm

from numpyro_tempering import log_partition
from numpyro_tempering.conjugate import (
    CollapsedBetaBinomial,
    collapse_locals,
    collapsible_locals,
)
from numpyro_tempering.handlers import Selection, temper
from numpyro_tempering.partition import tempered, tempered_log_normalizer
from numpyro_tempering.special import log_gamma_excess

KEY = jax.random.PRNGKey(0)


def definition(a: float, b: float, n: int, T: float, tempered_local: bool = False) -> float:
    """log int Beta(p; a, b) sum_y Binomial(y | n, p)^(1/T) dp by adaptive quadrature over p
    (the definition, not the closed form); ``tempered_local``: Beta(p; a, b)^(1/T)."""
    h, y = 1.0 / T, np.arange(n + 1)
    power = h if tempered_local else 1.0
    log_binom = gammaln(n + 1) - gammaln(y + 1) - gammaln(n - y + 1)

    def f(p: float) -> float:
        if not 0.0 < p < 1.0:
            return 0.0
        log_t = h * (log_binom + y * np.log(p) + (n - y) * np.log1p(-p))
        log_beta = (a - 1) * np.log(p) + (b - 1) * np.log1p(-p) - betaln(a, b)
        return np.exp(power * log_beta + logsumexp(log_t))

    m = a / (a + b)
    width = np.sqrt(m * (1 - m) / (a + b + 1))
    points = sorted(x for x in {m - 10 * width, m, m + 10 * width} if 0.0 < x < 1.0)
    pieces = [integrate.quad(f, lo, hi, limit=400, epsabs=0, epsrel=1e-11)[0]
              for lo, hi in zip([0.0] + points, points + [1.0], strict=True)]
    return float(np.log(sum(pieces)))


CASES = [  # (a, b, n, T): moderate, U-shaped, concentrated (a + b = 1e5), many trials
    (2.0, 3.0, 1, 2.0),
    (0.3, 0.2, 1, 1.5),
    (0.3, 0.2, 20, 3.0),
    (3e4, 7e4, 20, 3.0),
    (0.5, 0.5, 200, 10.0),
    (4.0, 1.5, 50, 0.7),
]


@pytest.mark.parametrize("a, b, n, T", CASES)
def test_the_closed_form_is_the_definition_integrated_over_the_local(a, b, n, T):
    exact = definition(a, b, n, T)
    with jax.enable_x64(True):
        d = CollapsedBetaBinomial(jnp.float64(a), jnp.float64(b), jnp.float64(n), terms=n + 1)
        got64 = float(tempered_log_normalizer(d, jnp.float64(T)))
    d32 = CollapsedBetaBinomial(jnp.float32(a), jnp.float32(b), jnp.float32(n), terms=n + 1)
    got32 = float(tempered_log_normalizer(d32, jnp.float32(T)))
    assert got64 == pytest.approx(exact, abs=1e-8 + 1e-9 * abs(exact))
    assert got32 == pytest.approx(exact, abs=2e-5)


def test_a_concentration_float32_cannot_hold_in_a_beta_density_keeps_its_digits():
    # kappa = e^16: NumPyro's Beta log density loses its digits in float32; the closed form
    # cancels the terms of size h n log kappa analytically. As kappa -> inf, c_n -> the
    # Binomial normaliser at p = m.
    m, kappa, n, T = 0.4, np.exp(16.0), 50, 1.5
    got = float(tempered_log_normalizer(
        CollapsedBetaBinomial(jnp.float32(m * kappa), jnp.float32((1 - m) * kappa),
                              jnp.float32(n), terms=n + 1), jnp.float32(T)))
    with jax.enable_x64(True):
        ref = float(tempered_log_normalizer(
            CollapsedBetaBinomial(jnp.float64(m * kappa), jnp.float64((1 - m) * kappa),
                                  jnp.float64(n), terms=n + 1), jnp.float64(T)))
        limit = float(tempered_log_normalizer(dist.Binomial(n, probs=jnp.float64(m)), T))
    assert got == pytest.approx(ref, abs=2e-5)
    assert ref == pytest.approx(limit, abs=1e-4)


@settings(max_examples=40, deadline=None)
@given(st.floats(1e-3, 1e6), st.floats(1e-3, 1e6), st.integers(0, 300))
def test_at_t_one_every_element_sums_to_one(a, b, n):
    with jax.enable_x64(True):
        d = CollapsedBetaBinomial(jnp.float64(a), jnp.float64(b), jnp.float64(n), terms=301)
        assert abs(float(tempered_log_normalizer(d, 1.0))) < 1e-10


def test_counts_at_or_beyond_the_terms_give_nan_and_the_law_is_normalised():
    d = CollapsedBetaBinomial(jnp.array([2.0, 2.0]), jnp.array([3.0, 3.0]),
                              jnp.array([3.0, 4.0]), terms=4)
    log_z, law = tempered(d, 2.0)
    assert np.isfinite(float(log_z[0])) and np.isnan(float(log_z[1]))
    y = jnp.arange(4.0)[:, None]
    total = jax.scipy.special.logsumexp(law.log_prob(y)[:, 0])
    assert float(total) == pytest.approx(0.0, abs=1e-6)
    draws = law.sample(KEY, (4000,))[:, 0]
    probs = np.exp(np.asarray(law.log_prob(y)[:, 0]))
    np.testing.assert_allclose(np.bincount(np.asarray(draws, int), minlength=4) / 4000,
                               probs, atol=0.03)


def test_log_gamma_excess_matches_the_log_gammas_in_float64():
    x = [1e-3, 0.5, 7.9, 8.0, 30.0, 1e7]
    d = [0.0, 2.5, 100.0, 0.3, 1000.0, 20.0]
    mpmath.mp.dps = 40
    exact = [float(mpmath.loggamma(mpmath.mpf(a) + b) - mpmath.loggamma(a)
                   - b * mpmath.log(a)) for a, b in zip(x, d, strict=True)]
    with jax.enable_x64(True):
        got = np.asarray(log_gamma_excess(jnp.asarray(x), jnp.asarray(d)))
    np.testing.assert_allclose(got, exact, rtol=1e-12, atol=1e-12)


# -----------------------------------------------------------------------------------------
# Which locals are collapsed
# -----------------------------------------------------------------------------------------

COUNTS = jnp.array([1.0, 5.0, 20.0, 20.0, 3.0])


def beta_binomial(n, probs_of=lambda p: p, extra=None, child=dist.Binomial):
    with numpyro.plate("data", n.shape[0]):
        p = numpyro.sample("p", dist.Beta(0.7, 1.9))
        numpyro.sample("y", child(n, probs=probs_of(p)), obs=jnp.zeros_like(n))
        if extra is not None:
            extra(p)


def found(model, *args, **select) -> dict:
    selection = Selection.of(**select)
    return collapsible_locals(temper(model, 1.0, sites=selection), args, {}, selection)


def test_a_beta_local_read_as_probs_by_one_tempered_binomial_is_collapsed():
    pairs = found(beta_binomial, COUNTS)
    assert list(pairs) == ["p"] and pairs["p"].child == "y" and pairs["p"].terms == 21


@pytest.mark.parametrize("case", ["function of p", "second reader", "factor", "logits",
                                  "conditioned", "child untempered", "masked", "scaled",
                                  "predicate selection"])
def test_anything_else_keeps_its_route(case):
    model, select = beta_binomial, {}
    if case == "function of p":
        model = lambda n: beta_binomial(n, probs_of=lambda p: p**2)  # noqa: E731
    elif case == "second reader":
        model = lambda n: beta_binomial(  # noqa: E731
            n, extra=lambda p: numpyro.sample("w", dist.Bernoulli(p), obs=jnp.ones(5)))
    elif case == "factor":
        model = lambda n: beta_binomial(  # noqa: E731
            n, extra=lambda p: numpyro.factor("f", jnp.sum(jnp.log(p))))
    elif case == "logits":
        model = lambda n: beta_binomial(  # noqa: E731
            n, child=lambda n, probs: dist.Binomial(n, logits=jnp.log(probs / (1 - probs))))
    elif case == "conditioned":  # p observed: no latent to integrate
        model = numpyro.handlers.condition(beta_binomial, {"p": jnp.full(5, 0.3)})
    elif case == "child untempered":
        select = {"sites": ["z"]}

        def model(n):
            beta_binomial(n)
            numpyro.sample("z", dist.Normal(0.0, 1.0), obs=0.0)
    elif case == "masked":
        model = lambda n: beta_binomial(  # noqa: E731
            n, child=lambda n, probs: dist.Binomial(n, probs=probs).mask(n > 2))
    elif case == "scaled":
        model = numpyro.handlers.scale(beta_binomial, 2.0)
    elif case == "predicate selection":
        select = {"sites": lambda msg: msg["is_observed"]}
    assert found(model, COUNTS, **select) == {}


def test_equal_collapses_are_equal_so_compiled_runs_are_shared():
    pairs = found(beta_binomial, COUNTS)
    assert collapse_locals(beta_binomial, pairs) == collapse_locals(beta_binomial, dict(pairs))
    assert hash(collapse_locals(beta_binomial, pairs)) == hash(
        collapse_locals(beta_binomial, dict(pairs)))


# -----------------------------------------------------------------------------------------
# log_partition
# -----------------------------------------------------------------------------------------


def test_without_globals_log_partition_is_exact():
    temps = np.array([1.0, 2.0, 7.0])
    exact = [sum(definition(0.7, 1.9, int(n), T) for n in COUNTS) for T in temps]
    est = log_partition(KEY, beta_binomial, temps, COUNTS, plate="data", progress_bar=False)
    np.testing.assert_allclose(est.log_c, exact, atol=5e-5)
    assert np.all(np.asarray(est.stderr) < 1e-6) and not est.flagged.any()
    assert est.collapsed == ("p",)


RAT_COUNTS = np.array([20, 20, 19, 18, 17, 25, 24, 10, 49, 46, 27, 13, 48, 50, 22, 52, 14, 20])


def rats(n):
    """The rat-tumour model's shape (Gelman et al. 2013, section 5.3) with proper priors."""
    m = numpyro.sample("m", dist.Beta(1.0, 1.0))
    kappa = numpyro.sample("kappa", dist.LogNormal(2.0, 1.5))
    with numpyro.plate("exp", n.shape[0]):
        theta = numpyro.sample("theta", dist.Beta(m * kappa, (1 - m) * kappa))
        numpyro.sample("y", dist.Binomial(n, probs=theta), obs=jnp.zeros_like(n))


def rats_exact(T: float) -> float:
    """Float64 grid over (m, log kappa) of the elements' closed forms (scipy's betaln; at
    T = 3 a 200 x 300 grid agrees with a 1000 x 1000 one to 1e-11)."""
    m = np.linspace(5e-4, 1 - 5e-4, 200)[:, None]
    lk = np.linspace(-7.0, 12.0, 300)[None, :]
    a, b, h = m * np.exp(lk), (1 - m) * np.exp(lk), 1.0 / T
    total = 0.0
    for n, times in zip(*np.unique(RAT_COUNTS, return_counts=True), strict=True):
        y = np.arange(n + 1)
        log_binom = gammaln(n + 1) - gammaln(y + 1) - gammaln(n - y + 1)
        t = (h * log_binom + betaln(a[..., None] + h * y, b[..., None] + h * (n - y))
             - betaln(a, b)[..., None])
        total = total + times * logsumexp(t, axis=-1)
    log_f = total + norm.logpdf(lk, 2.0, 1.5)
    return float(logsumexp(log_f) + np.log((m[1, 0] - m[0, 0]) * (lk[0, 1] - lk[0, 0])))


def test_a_hierarchical_beta_binomial_runs_over_its_two_globals_within_its_error_bars():
    exact = rats_exact(3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact per element: no fallback, nothing to flag
        est = log_partition(KEY, rats, np.array([3.0]), jnp.asarray(RAT_COUNTS, jnp.float32),
                            plate="exp", progress_bar=False)
    assert est.method == "smc" and est.quadrature_error is None  # over the globals alone
    err = abs(float(est.log_c[0]) - exact)
    assert err < 0.1 and err <= 3 * float(est.stderr[0]), (est.log_c, exact, est.stderr)


def test_under_scan_and_with_to_event_the_locals_are_collapsed_exactly():
    from numpyro.contrib.control_flow import scan

    def scanned(ys):
        def step(carry, y):
            p = numpyro.sample("p", dist.Beta(2.0, 3.0))
            numpyro.sample("y", dist.Bernoulli(p), obs=y)
            return carry, None

        scan(step, 0.0, ys)

    def as_event(ys):
        p = numpyro.sample("p", dist.Beta(2.0, 3.0).expand([4]).to_event(1))
        numpyro.sample("y", dist.Bernoulli(p).to_event(1), obs=ys)

    exact = 4 * definition(2.0, 3.0, 1, 2.0)
    for model in (scanned, as_event):
        assert list(found(model, jnp.zeros(4))) == ["p"]
        est = log_partition(KEY, model, np.array([2.0]), jnp.zeros(4), progress_bar=False)
        assert float(est.log_c[0]) == pytest.approx(exact, abs=2e-5)
        assert float(est.stderr[0]) < 1e-6


def trials_definition(a: float, b: float, m: int, T: float) -> float:
    """log E_Beta(a, b)[(p^h + (1 - p)^h)^m] by adaptive quadrature over p."""
    h = 1.0 / T

    def f(p: float) -> float:
        if not 0.0 < p < 1.0:
            return 0.0
        log_z = m * np.logaddexp(h * np.log(p), h * np.log1p(-p))
        return np.exp((a - 1) * np.log(p) + (b - 1) * np.log1p(-p) - betaln(a, b) + log_z)

    return float(np.log(integrate.quad(f, 0.0, 1.0, limit=400, epsabs=0, epsrel=1e-11)[0]))


def test_bernoulli_trials_in_a_nested_plate_share_their_local_exactly():
    a, b, groups, m = 0.8, 1.7, 3, 6

    def model(y):
        with numpyro.plate("groups", groups):
            p = numpyro.sample("p", dist.Beta(a, b))
            with numpyro.plate("trials", m, dim=-2):
                numpyro.sample("y", dist.Bernoulli(p), obs=y)

    pairs = found(model, jnp.zeros((m, groups)))
    assert pairs["p"].trials == m
    temps = np.array([1.0, 2.5])
    est = log_partition(KEY, model, temps, jnp.zeros((m, groups)), plate="groups",
                        progress_bar=False)
    exact = [groups * trials_definition(a, b, m, T) for T in temps]
    np.testing.assert_allclose(est.log_c, exact, atol=2e-5)
    np.testing.assert_allclose(np.asarray(est.element_log_c)[1], exact[1] / groups, atol=1e-5)


def test_shared_binomials_and_a_scalar_beta_are_left_to_the_smc():
    def binomial_trials(y):
        with numpyro.plate("groups", 3):
            p = numpyro.sample("p", dist.Beta(2.0, 2.0))
            with numpyro.plate("trials", 4, dim=-2):
                numpyro.sample("y", dist.Binomial(5, probs=p), obs=y)

    def scalar(y):  # one global p read by every element: the SMC over p serves it
        p = numpyro.sample("p", dist.Beta(2.0, 3.0))
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(p), obs=y)

    assert found(binomial_trials, jnp.zeros((4, 3))) == {}
    assert found(scalar, jnp.zeros(5)) == {}


def test_a_tempered_local_enters_as_its_unnormalised_power():
    pairs = found(beta_binomial, COUNTS, latent="p")
    assert pairs["p"].tempered_local
    temps = np.array([1.0, 2.5])
    est = log_partition(KEY, beta_binomial, temps, COUNTS, plate="data", latent="p",
                        progress_bar=False)
    assert est.collapsed == ("p",) and est.selection == Selection.of(latent="p")
    exact = [sum(definition(0.7, 1.9, int(n), T, tempered_local=True) for n in COUNTS)
             for T in temps]
    assert abs(exact[1] - sum(definition(0.7, 1.9, int(n), 2.5) for n in COUNTS)) > 0.1
    np.testing.assert_allclose(est.log_c, exact, atol=5e-5)
    # T < 1 sharpens: Beta(0.7, 1.9)^2 is p^-0.6 (1 - p)^1.8, integrable; Beta(0.3, 1.9)^2
    # is p^-1.4 near 0, whose integral diverges: +inf, never a finite number
    d = CollapsedBetaBinomial(jnp.array([0.7, 0.3]), jnp.array([1.9, 1.9]),
                              jnp.array([3.0, 3.0]), terms=4, tempered_local=True)
    log_z = np.asarray(tempered_log_normalizer(d, 0.5))
    assert log_z[0] == pytest.approx(definition(0.7, 1.9, 3, 0.5, tempered_local=True), abs=2e-5)
    assert log_z[1] == np.inf

