"""The per-document tempered normaliser of LDA, log C_d(T | beta)
(numpyro_tempering.models.lda_partition), against exact references: the multinomial expansion
summed term by term, quadrature over theta, the normalisation of the tempered model summed over
every document of a small vocabulary, and Dirichlet moments; the supplement's prior Monte Carlo
against it at a realistic length; MVI on a corpus drawn from the model at T = 1 cools to 1."""

from __future__ import annotations

import itertools
import math
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy import integrate, stats
from scipy.special import gammaln, logsumexp

from numpyro_tempering.models import corpora, lda_svi
from numpyro_tempering.models import lda_partition as lp

TEMPS = np.array([1.0, 1.3, 2.0, 5.0, 10.0])


def _expansion(log_b, alpha, inv_t, length):
    """log C by the multinomial expansion, every composition of `length` summed by hand."""
    k = len(alpha)
    total = alpha.sum()
    terms = []
    for n in itertools.product(range(length + 1), repeat=k):
        if sum(n) != length:
            continue
        n = np.array(n)
        terms.append(gammaln(length + 1) - gammaln(n + 1).sum() + n @ log_b
                     + gammaln(total) - gammaln(total + length * inv_t)
                     + (gammaln(alpha + n * inv_t) - gammaln(alpha)).sum())
    return logsumexp(terms)


def _quadrature(b, alpha, inv_t, length):
    """log C for K = 2 by quadrature over theta_1 ~ Beta(alpha_1, alpha_2): on each half of
    (0, 1) the substitution x = t^(1/alpha) absorbs the density's endpoint singularity."""
    grid = np.linspace(0.0, 1.0, 20001)
    top = length * np.max(np.log(b[0] * grid ** inv_t + b[1] * (1 - grid) ** inv_t))

    def s_pow(x, y):  # s(x)^L / max, with y = 1 - x computed without cancellation
        return math.exp(length * math.log(b[0] * x ** inv_t + b[1] * y ** inv_t) - top)

    a1, a2 = alpha
    left = integrate.quad(lambda t: s_pow(t ** (1 / a1), 1 - t ** (1 / a1))
                          * (1 - t ** (1 / a1)) ** (a2 - 1) / a1, 0, 0.5 ** a1,
                          epsabs=0, epsrel=1e-12, limit=400)[0]
    right = integrate.quad(lambda t: s_pow(1 - t ** (1 / a2), t ** (1 / a2))
                           * (1 - t ** (1 / a2)) ** (a1 - 1) / a2, 0, 0.5 ** a2,
                           epsabs=0, epsrel=1e-12, limit=400)[0]
    log_beta_fn = gammaln(a1) + gammaln(a2) - gammaln(a1 + a2)
    return math.log(left + right) + top - log_beta_fn


def test_exact_table_equals_the_multinomial_expansion():
    rng = np.random.default_rng(0)
    beta = rng.dirichlet(np.full(6, 0.4), 3)
    alpha = np.array([0.2, 0.5, 1.3])
    log_b = lp.topic_log_sums(beta, TEMPS, expected=False)
    table = lp.length_log_partition(log_b, TEMPS, alpha, 9)
    for length in range(10):
        for m, t in enumerate(TEMPS):
            assert table[length, m] == pytest.approx(
                _expansion(log_b[m], alpha, 1 / t, length), abs=1e-10)
    np.testing.assert_allclose(table[:, 0], 0.0, atol=1e-12)  # T = 1: C = 1
    np.testing.assert_allclose(table[0], 0.0, atol=1e-12)  # the empty document


@pytest.mark.parametrize("alpha", [(0.1, 0.1), (0.5, 2.0)])
def test_exact_table_equals_quadrature_up_to_40_words(alpha):
    """K = 2: C(T) = E_theta[(b_1 theta^(1/T) + b_2 (1 - theta)^(1/T))^L] by quadrature,
    for every length up to 40 and sparse / uneven priors."""
    alpha = np.array(alpha)
    rng = np.random.default_rng(1)
    beta = rng.dirichlet(np.full(5, 0.3), 2)
    log_b = lp.topic_log_sums(beta, TEMPS, expected=False)
    table = lp.length_log_partition(log_b, TEMPS, alpha, 40)
    for length in (1, 7, 20, 40):
        for m in (1, 2, 4):
            ref = _quadrature(np.exp(log_b[m]), alpha, 1 / TEMPS[m], length)
            assert table[length, m] == pytest.approx(ref, abs=1e-6), (length, m)


@pytest.mark.parametrize("k, alpha", [(4, 0.25), (20, 0.05)])
def test_long_documents_two_routes_agree(k, alpha, monkeypatch):
    """Beyond EXACT_LENGTH the table continues by tilted linear-space passes; the log-space
    convolution run to the full length is the independent route: they agree to 1e-9 up to
    600 words, on a ladder with a rung just above T = 1 and one at T = 10."""
    rng = np.random.default_rng(6)
    temps = np.array([1.0, 1.001, 1.5, 3.0, 10.0])
    log_b = lp.topic_log_sums(rng.dirichlet(np.full(300, 0.05), k), temps, expected=False)
    fast = lp.length_log_partition(log_b, temps, alpha, 600)
    monkeypatch.setattr(lp, "EXACT_LENGTH", 600)  # the log-space route all the way
    exact = lp.length_log_partition(log_b, temps, alpha, 600)
    assert not np.any(np.isnan(fast))
    np.testing.assert_allclose(fast, exact, rtol=1e-12, atol=1e-9)
    # a rung whose passes stall falls back to the log-space route, in float64 too
    monkeypatch.setattr(lp, "EXACT_LENGTH", 128)
    monkeypatch.setattr(lp, "PASS_FLOOR", -1.0)  # no pass yields anything: every rung stalls
    fallback = lp.length_log_partition(log_b, temps, alpha, 600)
    np.testing.assert_allclose(fallback, exact, rtol=1e-12, atol=1e-9)


def test_normaliser_sums_the_tempered_model_over_every_document():
    """The definition: sum over all V^L documents and assignments of the tempered joint,
    integrated over theta, is C_d(T | beta) (K = 2, V = 3, L = 3, quadrature over theta)."""
    rng = np.random.default_rng(2)
    beta = rng.dirichlet(np.ones(3), 2)
    alpha, t, length = np.array([0.3, 0.7]), 2.5, 3
    prior = stats.beta(alpha[0], alpha[1])
    per_word = [lambda x, v=v: ((x * beta[0, v]) ** (1 / t) + ((1 - x) * beta[1, v]) ** (1 / t))
                for v in range(3)]
    total = 0.0
    for doc in itertools.product(range(3), repeat=length):
        total += integrate.quad(lambda x, doc=doc: prior.pdf(x) * np.prod(
            [per_word[v](x) for v in doc]), 0, 1, limit=200)[0]
    log_b = lp.topic_log_sums(beta, [t], expected=False)
    assert lp.length_log_partition(log_b, [t], alpha, length)[length, 0] == pytest.approx(
        math.log(total), abs=1e-7)


def test_expected_topic_sums_are_dirichlet_moments():
    """log E_q[sum_v beta_kv^(1/T)] in closed form against a large Monte Carlo average."""
    rng = np.random.default_rng(3)
    lam = rng.gamma(2.0, 1.0, (2, 30)) + 0.05
    exact = lp.topic_log_sums(lam, [1.0, 3.0], expected=True)
    np.testing.assert_allclose(exact[0], 0.0, atol=1e-12)
    draws = np.stack([rng.dirichlet(row, 200_000) for row in lam])  # (K, S, V)
    mc = np.log(np.mean(np.sum(draws ** (1 / 3.0), axis=-1), axis=1))
    np.testing.assert_allclose(exact[1], mc, atol=2e-3)


def test_jensen_gap_of_the_concentrated_topic_sums_is_small():
    """E_q[log C_d(T | beta)] against log C_d(T | E_q[b]) (the module's choice) with draws of
    beta from q: a 100-word document at T = 2 and 10 with uncertain topics (lambda ~ two
    counts per word, V = 400): the gap is within 0.1 nats (log C itself varies by ~0.5 nats
    from draw to draw), and it shrinks as the topics gain counts."""
    rng = np.random.default_rng(4)
    temps = [2.0, 10.0]
    for scale, bound in ((1.0, 0.1), (50.0, 0.02)):
        lam = scale * rng.gamma(0.5, 4.0, (4, 400)) + 0.05
        at_mean = lp.length_log_partition(lp.topic_log_sums(lam, temps), temps, 0.25, 100)[100]
        draws = np.array([lp.length_log_partition(
            lp.topic_log_sums(np.stack([np.maximum(rng.dirichlet(r), 1e-300) for r in lam]),
                              temps, expected=False), temps, 0.25, 100)[100] for _ in range(100)])
        gap = at_mean - draws.mean(0)
        stderr = draws.std(0) / 10.0
        assert np.all(np.abs(gap) < bound + 3 * stderr), (scale, gap, stderr)


def test_prior_monte_carlo_is_biased_low_for_long_documents():
    """The supplement's route (prior draws of theta, eq. 7) at K = 10, alpha = 0.1, fixed
    topics: low by many nats at L = 1,300 (hundreds of nats, as issue 19 measured), while
    importance sampling from a Dirichlet proposal near the tilted target agrees with the
    exact table to within its standard error."""
    rng = np.random.default_rng(5)
    k, length, t = 10, 1300, 2.0
    beta = rng.dirichlet(np.full(500, 0.1), k)
    alpha = np.full(k, 0.1)
    log_b = lp.topic_log_sums(beta, [t], expected=False)[0]
    exact = lp.length_log_partition(log_b[None], [t], alpha, length)[length, 0]

    def log_s(theta):
        return logsumexp(np.log(np.maximum(theta, 1e-300)) / t + log_b, axis=-1)

    prior = rng.dirichlet(alpha, 2000)
    naive = logsumexp(length * log_s(prior)) - math.log(len(prior))
    assert exact - naive > 50.0
    # importance sampling: proposal Dir(c * theta*), theta* the maximiser of s
    star = np.exp(log_b * t / (t - 1))
    star /= star.sum()
    proposal = stats.dirichlet(200.0 * star)
    draws = proposal.rvs(100_000, random_state=rng)
    log_w = (length * log_s(draws) + stats.dirichlet(alpha).logpdf(draws.T)
             - proposal.logpdf(draws.T))
    estimate = logsumexp(log_w) - math.log(len(draws))
    w = np.exp(log_w - log_w.max())
    stderr = np.std(w) / (np.mean(w) * math.sqrt(len(w)))
    assert abs(estimate - exact) <= 3 * stderr + 0.02, (estimate, exact, stderr)


def test_conditional_log_partition_per_document():
    lam = np.array([[5.0, 1.0, 1.0, 0.5], [1.0, 0.5, 1.0, 5.0]])
    lengths = np.array([0, 3, 12, 3])
    c = lp.conditional_log_partition(lam, TEMPS, 0.5, lengths)
    table = lp.length_log_partition(lp.topic_log_sums(lam, TEMPS), TEMPS, 0.5, 12)
    np.testing.assert_allclose(c, table[lengths])
    mean = lp.conditional_log_partition(lam, TEMPS, 0.5, lengths, topics="mean")
    beta = lam / lam.sum(1, keepdims=True)
    np.testing.assert_allclose(mean, lp.length_log_partition(
        lp.topic_log_sums(beta, TEMPS, expected=False), TEMPS, 0.5, 12)[lengths])
    assert np.all(np.diff(c[2]) > 0)  # grows with T


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="temperatures"):
        lp.topic_log_sums(np.ones((2, 3)), [1.0, -2.0])
    with pytest.raises(ValueError, match="topics"):
        lp.topic_log_sums(np.ones((2, 3)), [1.0], expected=False)
    with pytest.raises(ValueError, match="lengths"):
        lp.conditional_log_partition(np.ones((2, 3)), [1.0], 0.5, [2.5])
    with pytest.raises(ValueError, match="log_b"):
        lp.length_log_partition(np.zeros((3, 2)), [1.0, 2.0], 0.5, 4)
    with pytest.raises(ValueError, match="alpha"):
        lp.length_log_partition(np.zeros((1, 2)), [1.0], -0.5, 4)
    with pytest.raises(ValueError, match="topics"):
        lp.conditional_log_partition(np.ones((2, 3)), [1.0], 0.5, [2], topics="map")
    assert np.all(np.isnan(lp.length_log_partition(np.full((1, 2), np.nan), [2.0], 0.5, 3)))


def test_mvi_cools_to_one_on_data_from_the_model():
    """Issue 19: on a corpus drawn from LDA at T = 1, the learnt E[T] falls to within 0.1 of
    1 by the end (the paper's ladder and defaults, exact conditional normaliser)."""
    corpus, _ = corpora.synthetic(0, 400, 60, 3, 40, alpha=0.3, eta=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fit that ends cool says nothing
        fit = lda_svi.fit(corpus, 3, passes=3, batch_size=50,
                          temperature=lda_svi.Multicanonical.paper(), tau=10.0, seed=0)
    assert fit.temperatures[0] > 1.5  # it starts hot (random topics explain nothing) ...
    assert abs(fit.temperatures[-1] - 1.0) < 0.1  # ... and cools to 1
    assert np.all(np.isfinite(fit.lam)) and fit.log_c_seconds > 0


def test_an_mvi_fit_on_short_documents_ends_hot_and_says_so():
    """docs/lda.md, "Short documents stay hot, exactly": the same corpus cut to 4 words a
    document stays hot (the exact posterior's E[T] is 2.9 at the true topics), and fit
    warns that its topics were learnt tempered, naming the documents' length."""
    corpus, _ = corpora.synthetic(0, 400, 4, 3, 40, alpha=0.3, eta=0.3)
    with pytest.warns(UserWarning, match=r"ended hot.*median length is 4 words"):
        fit = lda_svi.fit(corpus, 3, passes=3, batch_size=50,
                          temperature=lda_svi.Multicanonical.paper(), tau=10.0, seed=0)
    assert fit.temperatures[-1] > lda_svi.HOT_END


BRACKET_TEMPS = np.array([1.0, 1.7, 3.0, 10.0])
BRACKET_BASE = np.log(np.array([[1.0, 1.0, 1.0, 1.0], [1.5, 2.0, 1.2, 3.0],
                                [4.0, 9.0, 2.0, 6.0], [50.0, 300.0, 20.0, 90.0]]))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-0.05, 0.05), min_size=12, max_size=12), st.floats(0.05, 1.0))
def test_stale_table_error_is_within_its_exact_bracket(shift, alpha):
    """Moving the topics' log b_k(T) by delta_k moves log C_L by between L min delta and
    L max delta (a positive combination of prod_k b_k^(n_k), sum n_k = L): the midpoint
    table is within its half-width of the exact table at every length and rung."""
    new = BRACKET_BASE.copy()
    new[1:] += np.reshape(shift, (3, 4))
    old = lp.exact_table(BRACKET_BASE, BRACKET_TEMPS, alpha, 300)
    table, bound = lp.stale_table(old, new)
    exact = lp.length_log_partition(new, BRACKET_TEMPS, alpha, 300)
    assert np.all(np.abs(table - exact) <= bound + 1e-8 * (1 + np.abs(exact)))
    assert np.all(bound[:, 0] == 0)  # T = 1: b_k = 1 never moves


def test_refresh_recomputes_only_the_rungs_that_can_matter():
    """lda_svi's normaliser recomputes a rung when the statistics it can move exceed the
    tolerance (given as logs): none, no recomputation (the bracketed table is returned,
    within the bracket plus L times the fast sums' rounding allowance); full mass on every
    rung, every rung whose bracket is not 0 (T = 1's always is), exactly. T = 1 is 0 exactly
    and never computed."""
    rng = np.random.default_rng(0)
    lam = rng.gamma(1.0, 1.0, (3, 12)) + 0.1
    lengths = np.array([5, 40, 200, 0])
    mc = lda_svi.Multicanonical.paper(6)
    norm = lda_svi._Normaliser(mc, 0.3, lengths)
    first = norm.table(lam)
    assert norm.rungs == 5
    np.testing.assert_allclose(first, lp.conditional_log_partition(
        lam, mc.temperatures, 0.3, lengths, topics="mean"), atol=1e-10)
    moved = lam * rng.uniform(0.9, 1.1, lam.shape)
    none = np.full((lda_svi.LENGTH_BINS, 6), -np.inf)
    stale = norm.table(moved, none)
    assert norm.rungs == 5  # nothing recomputed ...
    exact = lp.conditional_log_partition(moved, mc.temperatures, 0.3, lengths, topics="mean")
    log_b = lp.topic_log_sums(moved / moved.sum(1, keepdims=True), mc.temperatures,
                              expected=False)
    _, bound = lp.stale_table(norm.exact, log_b)
    allowance = lp.fast_topic_log_sums(moved, mc.temperatures)[1].max(axis=1)
    assert np.all(np.abs(stale - exact) <= bound[lengths] + lengths[:, None] * allowance + 1e-9)
    assert np.max(bound[lengths]) > 1e-3
    fresh = norm.table(moved, np.zeros((lda_svi.LENGTH_BINS, 6)), 1.0)  # log 1 of 1 word
    assert norm.rungs == 5 + 5
    np.testing.assert_allclose(fresh, exact, atol=1e-10)


def test_coarse_first_table_brackets_the_rungs_between_and_refines_where_asked():
    """The first table of a fit computes every COARSE_STRIDE-th rung and brackets the others
    by convexity: every entry within its bound of the exact table. Asked again with the
    words of a first minibatch all on one bracketed rung, it computes that rung (and no
    rung whose bracket moves less than the tolerance), which is then exact."""
    rng = np.random.default_rng(1)
    lam = rng.gamma(0.5, 1.0, (4, 30)) + 0.05
    lengths = np.array([3, 60, 250, 0])
    mc = lda_svi.Multicanonical.paper(20)
    norm = lda_svi._Normaliser(mc, 0.25, lengths)
    coarse = norm.table(lam, coarse=True)
    grid = norm.grid[mc.temperatures[norm.grid] != 1.0]
    assert norm.rungs == grid.size == 5
    exact = lp.conditional_log_partition(lam, mc.temperatures, 0.25, lengths, topics="mean")
    log_b = lp.topic_log_sums(lam / lam.sum(1, keepdims=True), mc.temperatures, expected=False)
    _, bound = lp.stale_table(norm.exact, log_b)
    allowance = lengths[:, None] * lp.fast_topic_log_sums(lam, mc.temperatures)[1].max(axis=1)
    assert np.all(np.abs(coarse - exact) <= bound[lengths] + allowance + 1e-9)
    np.testing.assert_allclose(coarse[:, grid], exact[:, grid], atol=1e-5)
    assert np.max(bound[250, 13:]) < 1.0 < np.max(bound[250, :4])  # narrow where hot
    words = np.full((lda_svi.LENGTH_BINS, 20), -np.inf)
    words[lda_svi._length_bin(250), 9] = 0.0  # every word on rung 9 (between the grid's 8, 12)
    refined = norm.table(lam, words, 250.0)
    assert norm.rungs == 6
    np.testing.assert_allclose(refined[:, 9], exact[:, 9], atol=1e-5)


def test_refresh_rule_in_log_space_keeps_a_rung_below_the_float_range_stale():
    """A rung whose words are e^-5000 of the minibatch's (q(y_d = m) below any float) with
    a bracket of 500 nats moves e^-4500 of the statistics: stale, not recomputed for an
    overflow (in linear space 0 * inf); the same rung with e^-1 of the words is recomputed,
    a bracket of 0 (T = 1) is not, unless the tolerance is 0 (every rung)."""
    bins = lda_svi.LENGTH_BINS
    log_words = np.full((bins, 3), -np.inf)
    log_words[5] = [0.0, -5000.0, -5000.0]
    bound = np.zeros((101, 3))
    bound[:, 1:] = 5.0 * np.arange(101)[:, None]  # 500 nats at 100 words
    assert lda_svi._rungs_to_refresh(log_words, bound, 100, 0.01, 1.0).tolist() == []
    log_words[5, 2] = -1.0
    assert lda_svi._rungs_to_refresh(log_words, bound, 100, 0.01, 1.0).tolist() == [2]
    assert lda_svi._rungs_to_refresh(log_words, bound, 100, 0.0, 1.0).tolist() == [0, 1, 2]


def test_lazy_refresh_follows_the_full_refresh():
    """A fit with the default tolerance computes fewer rung tables than one recomputing
    every rung at every refresh, fits the T = 1 anchor alone between probes once the hot
    anchors serve less than the tolerance (fewer sweeps; never at the first update), and
    learns the same temperatures and topics."""
    corpus, _ = corpora.synthetic(1, 300, 80, 3, 40, alpha=0.3, eta=0.3)
    runs = [lda_svi.fit(corpus, 3, passes=2, batch_size=50, tau=10.0, seed=0,
                        temperature=lda_svi.Multicanonical.paper(20)._replace(tolerance=tol))
            for tol in (0.0, 0.01)]
    assert runs[1].log_c_rungs < runs[0].log_c_rungs
    np.testing.assert_allclose(runs[1].temperatures, runs[0].temperatures, atol=0.02)
    topics = [r.lam / r.lam.sum(axis=1, keepdims=True) for r in runs]
    np.testing.assert_allclose(topics[1], topics[0], atol=2e-3)
    cold_only = runs[1].sweeps < 0.7 * runs[0].sweeps  # the T = 1 anchor alone
    assert not cold_only[0] and np.sum(cold_only) >= 2  # the first update is a probe


@pytest.mark.parametrize("topics", ["mean", "expected"])
def test_table_ends_are_the_slopes_of_the_exact_table(topics):
    """f_L(h) = log C_L(T = 1/h): f(1) = 0 with slope L * slope1, and f(h) -> L log(KV) with
    slope L * slope0 as h -> 0, against central finite differences of the exact table."""
    rng = np.random.default_rng(3)
    lam = rng.gamma(0.7, 1.0, (3, 7)) + 0.05
    alpha, length, eps = np.array([0.2, 0.5, 1.3]), 25, 1e-6
    ends = lp.table_ends(lam, alpha, topics)

    def f(h):
        t = np.array([1.0 / h])
        return lp.length_log_partition(lp.fitted_topic_log_sums(lam, t, topics), t, alpha,
                                       length)[length, 0]

    assert abs(f(1.0)) < 1e-9
    assert abs((f(1.0) - f(1.0 - eps)) / eps - length * ends.slope1) < 1e-3 * length
    assert abs((f(eps) - length * ends.value0) / eps - length * ends.slope0) < 1e-3 * length


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10**6), st.floats(0.02, 2.0), st.sampled_from(["mean", "expected"]),
       st.lists(st.floats(1.01, 12.0), min_size=3, max_size=7, unique=True))
@example(0, 1.0, "mean", [2.0, 1.0100000000000002, 1.01])  # two knots 2e-16 apart: the
# extended secant through them is rounding noise (598 nats off before it was discounted)
def test_convex_bracket_contains_the_exact_table(seed, alpha, topics, temps):
    """log C_L is convex in h = 1/T, so chords bound it above and the extended secants and
    the closed-form tangents at h = 0 and 1 below: every rung left out is within its
    bracket, at every length (both routes of the exact table: up to 300 words)."""
    rng = np.random.default_rng(seed)
    lam = rng.gamma(rng.uniform(0.05, 3.0), 1.0, (4, 9)) + 1e-3
    temps = np.sort(np.array(temps))
    log_b = lp.fitted_topic_log_sums(lam, temps, topics)
    table = lp.length_log_partition(log_b, temps, alpha, 300)
    ends = lp.table_ends(lam, alpha, topics)
    for m in range(temps.size):
        others = np.delete(np.arange(temps.size), m)
        mid, half = lp.convex_bracket(1 / temps[others], table[:, others], 1 / temps[m], ends)
        excess = np.abs(mid - table[:, m]) - half
        assert np.all(excess <= 0), (m, np.max(excess))
    mid, half = lp.convex_bracket(1 / temps[::2], table[:, ::2], 1 / temps[1::2], ends)
    assert mid.shape == half.shape == (301, temps[1::2].size)  # several rungs at once
    assert np.all(np.abs(mid - table[:, 1::2]) <= half)


def test_the_exact_temperature_posterior_of_one_word_is_the_closed_form():
    # L = 1: p_T(w | beta) = sum_k E[theta_k^h] beta_kw^h, E[theta_k^h] = G(A) G(a_k + h) /
    # (G(a_k) G(A + h)), and C(T) = sum_v p_T(v | beta)
    beta = np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.05, 0.9, 0.05]])
    alpha, temps = np.array([0.3, 0.5, 1.2]), np.array([1.0, 1.8, 5.0])
    log_w = np.log([0.5, 0.3, 0.2])
    h = 1.0 / temps[:, None]
    moment = np.exp(gammaln(alpha.sum()) + gammaln(alpha + h) - gammaln(alpha)
                    - gammaln(alpha.sum() + h))  # (M, K)
    p_w = np.einsum("mk,mkv->mv", moment, beta[None] ** h[:, :, None])  # (M, V)
    for word in range(3):
        expected = np.exp(log_w) * p_w[:, word] / p_w.sum(1)
        post = lp.exact_temperature_posterior(beta, [word], temps, log_w, alpha)
        np.testing.assert_allclose(post, expected / expected.sum(), rtol=1e-10)


def test_short_documents_stay_hot_exactly_and_mvi_is_hotter():
    """docs/lda.md, "Short documents stay hot, exactly": documents of a few words drawn from
    LDA at T = 1 keep an exact temperature posterior near the ladder's prior (E[T] 3.92),
    cooler as they grow, and MVI's q(y_d) (eq. 18 over the anchor fits) is hotter still,
    at the true topics."""
    mc = lda_svi.Multicanonical.paper()
    temps, alpha, lengths, num = mc.temperatures, 0.3, (2, 8), 40
    corpus, truth = corpora.synthetic(0, num, lengths[-1], 3, 40, alpha=alpha, eta=alpha)
    # the short documents: 2 of each document's 8 tokens (a subset of an LDA document's
    # exchangeable tokens is an LDA document), in one local step with the long ones
    rng = np.random.default_rng(1)
    short_ids, short_counts = np.zeros_like(corpus.ids), np.zeros_like(corpus.counts)
    for d in range(num):
        tokens = rng.permutation(np.repeat(corpus.ids[d], corpus.counts[d]))[: lengths[0]]
        uniq, cnt = np.unique(tokens, return_counts=True)
        short_ids[d, : uniq.size], short_counts[d, : uniq.size] = uniq, cnt
    ids = np.concatenate([short_ids, corpus.ids])
    counts = np.concatenate([short_counts, corpus.counts])
    log_c = lp.length_log_partition(lp.topic_log_sums(truth, temps, expected=False), temps,
                                    alpha, lengths[-1])[np.repeat(lengths, num)]
    cfg = lda_svi.config(3, 40, 2 * num, alpha=alpha, eta=alpha)
    local = lda_svi.local_step(
        cfg, jnp.asarray(truth * 1e4, jnp.float32), ids, counts,
        lda_svi.initial_gamma(0, 2 * num, 3),
        (1.0 / temps, mc.log_weights, 1.0 / mc.anchor_temperatures(), log_c))
    mvi = (np.asarray(local.q_y, np.float64) @ temps).reshape(2, num)
    exact = np.array([[lp.exact_temperature_posterior(
        truth, np.repeat(ids[d], counts[d]), temps, mc.log_weights, alpha) @ temps
        for d in range(k * num, (k + 1) * num)] for k in range(2)])
    means = {length: (exact[k].mean(), mvi[k].mean()) for k, length in enumerate(lengths)}
    for length in lengths:
        assert means[length][1] > means[length][0] + 0.1  # hotter than the exact posterior
    assert means[2][0] > 3.0 and means[8][0] < means[2][0] - 0.5  # hot, cooling with L
