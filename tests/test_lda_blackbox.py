"""Black-box LDA (``lda_blackbox``): stock NumPyro SVI on collapsed LDA with Dirichlet,
logistic-normal and amortised guides.

Exact references: the sparse corpus model's density equals the word-by-word model's
(``lda.model``) computed independently; at T = 1 the loss is Trace_ELBO's on the same key,
and at T = 2 the likelihood term is exactly half. A fit compiles for 10-30 s (the
reparameterised Dirichlet sampler), so the module runs only two fits.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpyro.infer import Trace_ELBO
from numpyro.infer.util import log_density

from numpyro_tempering import Ladder, TemperedELBO, schedules
from numpyro_tempering.models import corpora, lda, lda_blackbox, lda_svi

K, V = 3, 20


@pytest.fixture(scope="module")
def data():
    corpus, _ = corpora.synthetic(0, 48, 25, K, V, alpha=0.3, eta=0.3)
    train, test = corpora.train_test_split(corpus, 8, seed=0)
    return train, corpora.completion_split(test, seed=0)


def test_corpus_model_density_is_the_word_model():
    """log p of ``corpus_model`` on (index, count) pairs = ``lda.model`` on the same words in
    order (documents of equal length; the padded sparse form drops no term)."""
    words = np.random.default_rng(3).integers(0, V, (4, 9))
    corpus = corpora.from_bow([sorted(zip(*np.unique(np.asarray(w), return_counts=True),
                                          strict=True)) for w in words], V)
    rng = np.random.default_rng(0)
    beta, theta = rng.dirichlet(np.full(V, 0.7), K), rng.dirichlet(np.full(K, 0.9), 4)
    values = {"beta": jnp.asarray(beta), "theta": jnp.asarray(theta)}
    lp_sparse, _ = log_density(lda_blackbox.make_model(K, V), (corpus.ids, corpus.counts), {},
                               values)
    lp_words, _ = log_density(lda.model, (words, K, V), {},
                              {**values, "theta": values["theta"][:, None, :]})
    np.testing.assert_allclose(float(lp_sparse), float(lp_words), rtol=1e-5)
    by_hand = np.sum(np.log((theta @ beta)[np.arange(4)[:, None], np.asarray(words)]))
    _, tr = log_density(lda_blackbox.make_model(K, V), (corpus.ids, corpus.counts), {}, values)
    assert tr["words"]["value"].shape == corpus.ids.shape  # sparse: (D, W), never (D, V)
    np.testing.assert_allclose(float(tr["words"]["fn"].log_prob(tr["words"]["value"]).sum()),
                               by_hand, rtol=1e-5)


def test_loss_at_t1_is_trace_elbo_and_t2_halves_the_likelihood(data):
    train, _ = data
    model = lda_blackbox.make_model(K, V)
    guide = lda_blackbox.make_guide("dirichlet", K, V)
    rng = np.random.default_rng(1)
    params = {"lam": jnp.asarray(rng.gamma(5.0, 0.2, (K, V))),
              "gamma": jnp.asarray(rng.gamma(5.0, 0.4, (train.num_docs, K)))}
    args = (jnp.asarray(train.ids), jnp.asarray(train.counts))

    @jax.jit  # eager Dirichlet sampling is 10x slower
    def losses(key, params):
        per_site = jax.vmap(lambda t: TemperedELBO(temperature=t, sum_sites=False).loss(
            key, params, model, guide, *args))(jnp.array([1.0, 2.0]))  # same draws for both
        return Trace_ELBO().loss(key, params, model, guide, *args), per_site

    ref, per_site = losses(jax.random.PRNGKey(2), params)
    sites1 = {k: v[0] for k, v in per_site.items()}
    sites2 = {k: v[1] for k, v in per_site.items()}
    assert np.isfinite(float(ref))
    np.testing.assert_allclose(sum(float(v) for v in sites1.values()), float(ref), rtol=1e-6)
    np.testing.assert_allclose(float(sites2["words"]), 0.5 * float(sites1["words"]), rtol=1e-6)
    np.testing.assert_allclose(float(sites2["theta"]), float(sites1["theta"]), rtol=1e-6)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, V - 1), st.integers(1, 9)), min_size=1, max_size=6,
                unique_by=lambda x: x[0]), st.integers(0, 3), st.randoms(use_true_random=False))
def test_encoder_shape_positivity_and_invariances(pairs, pad, rnd):
    """(B, K) concentrations >= 1e-3, unchanged by the order of the (index, count) pairs and
    by padding (0, 0) pairs: a function of the bag of words."""
    params = lda_blackbox.encoder_init(jax.random.PRNGKey(0), V, K, hidden=7)
    ids, counts = map(np.asarray, zip(*pairs, strict=True))
    shuffled = list(pairs)
    rnd.shuffle(shuffled)
    s_ids, s_counts = map(np.asarray, zip(*shuffled, strict=True))
    s_ids, s_counts = np.pad(s_ids, (0, pad)), np.pad(s_counts, (0, pad))
    out = lda_blackbox.encoder_apply(params, ids[None], counts[None])
    out2 = lda_blackbox.encoder_apply(params, s_ids[None], s_counts[None])
    assert out.shape == (1, K) and bool(jnp.all(out >= 1e-3))
    np.testing.assert_allclose(np.asarray(out), np.asarray(out2), rtol=1e-5)


@pytest.fixture(scope="module")
def annealed_fit(data):
    """40 full-batch updates of the amortised guide, annealed from T = 3 to 1 over the first
    10 (full batch: the loss varies only by its Monte Carlo draws)."""
    train, _ = data
    schedule = schedules.linear(3.0, 1.0, num_steps=10)
    res = lda_blackbox.fit(train, K, guide="amortised", passes=40, batch_size=train.num_docs,
                           temperature=schedule, learning_rate=0.05, hidden=16,
                           num_particles=4, seed=0)
    return res, schedule


def test_annealed_amortised_fit_improves_and_records_temperatures(annealed_fit, data):
    """The loss at T = 1 falls by more than its noise between updates 10-14 and 35-39, the
    temperature per update is the schedule's, and the topics score finitely and better than
    uniform topics."""
    res, schedule = annealed_fit
    _, (observed, heldout) = data
    assert res.num_steps == 40 and res.num_nonfinite == 0
    np.testing.assert_allclose(res.temperatures,
                               np.asarray(schedules.trajectory(schedule, 40)), rtol=1e-6)
    assert np.all(res.temperatures[10:] == 1.0)
    early, late = res.losses[10:15], res.losses[35:40]
    noise = np.hypot(early.std(ddof=1), late.std(ddof=1)) / np.sqrt(5)
    assert early.mean() - late.mean() > 3 * noise
    score = lda_svi.heldout_log_likelihood(res.lam, observed, heldout)
    assert np.isfinite(score)
    assert score > np.log(1.0 / V)  # better than uniform topics


def test_multicanonical_fit_cools_with_the_exact_joint_normaliser(data):
    """MVI (the default joint form: JointWordCounts with the exact log C_d(T | mean topics)
    as data, recomputed every 5 updates): E_q[T] stays on the ladder, starts hot (random
    topics explain nothing) and cools by the end; the loss is finite."""
    train, (observed, heldout) = data
    ladder = Ladder.geometric(1.0, 10.0, 6)
    res = lda_blackbox.fit(train, K, guide="logistic_normal", passes=10, batch_size=20,
                           temperature=ladder, seed=1, log_c_every=5, progress_bar=True)
    assert res.num_nonfinite == 0 and res.temperatures.shape == (res.num_steps,)
    assert np.all((res.temperatures >= 1.0 - 1e-9) & (res.temperatures <= 10.0 + 1e-9))
    assert res.temperatures[-3:].mean() < res.temperatures[:3].mean() - 0.5
    assert np.isfinite(lda_svi.heldout_log_likelihood(res.lam, observed, heldout))


def test_joint_word_counts_is_the_tempered_joint_summed_over_topics():
    """Through ``temper(model, T, joint=True)``: the words' log density is
    sum_tokens log sum_k (theta_k beta_kw)^(1/T) - log C_d(T | beta), by brute force over
    every topic assignment of a document's tokens; at T = 1 it is the collapsed WordCounts';
    at a T off the table's ladder it is NaN. With the normaliser of lda_partition (tested
    there to normalise the tempered model), the site is a proper tempered likelihood."""
    from numpyro_tempering import temper
    from numpyro_tempering.models import lda_partition

    rng = np.random.default_rng(4)
    beta, theta = rng.dirichlet(np.ones(V), K), rng.dirichlet(np.ones(K), 2)
    tokens = [[0, 3, 3, 7], [5, 5, 1, 0]]
    corpus = corpora.from_bow([sorted(zip(*np.unique(t, return_counts=True), strict=True))
                               for t in tokens], V)
    temps = np.array([1.0, 2.0, 5.0])
    table = lda_partition.length_log_partition(
        lda_partition.topic_log_sums(beta, temps, expected=False), temps, 1.0 / K, 4)[
        corpus.lengths]  # (D, M)
    model = lda_blackbox.make_model(K, V, joint=True, inv_temperatures=1.0 / temps)
    values = {"beta": jnp.asarray(beta), "theta": jnp.asarray(theta)}
    for t in (*temps, 3.0):
        _, tr = log_density(temper(model, float(t), joint=True),
                            (corpus.ids, corpus.counts, jnp.asarray(table)), {}, values)
        got = np.asarray(tr["words"]["fn"].log_prob(tr["words"]["value"]))
        if t == 3.0:
            assert np.all(np.isnan(got))
            continue
        m = int(np.flatnonzero(temps == t)[0])
        for d, doc in enumerate(tokens):
            brute = sum(np.prod([(theta[d, z] * beta[z, w]) ** (1 / t)
                                 for z, w in zip(zs, doc, strict=True)])
                        for zs in itertools.product(range(K), repeat=len(doc)))
            np.testing.assert_allclose(got[d], np.log(brute) - table[d, m], rtol=1e-5)
    _, plain = log_density(lda_blackbox.make_model(K, V), (corpus.ids, corpus.counts), {},
                           values)
    _, joint = log_density(temper(model, 1.0, joint=True),
                           (corpus.ids, corpus.counts, jnp.asarray(table)), {}, values)
    np.testing.assert_allclose(
        np.asarray(joint["words"]["fn"].log_prob(joint["words"]["value"])),
        np.asarray(plain["words"]["fn"].log_prob(plain["words"]["value"])), rtol=1e-6)


def test_fit_validates(data):
    train, _ = data
    for kwargs, match in (({"guide": "normal"}, "guide"), ({"passes": 0}, "passes"),
                          ({"batch_size": 0}, "batch_size"), ({"temperature": -1.0}, "T > 0"),
                          ({"learning_rate": float("nan")}, "learning_rate")):
        with pytest.raises(ValueError, match=match):
            lda_blackbox.fit(train, K, **kwargs)


def test_gamma_log_grad_is_the_implicit_gradient(dtype=jnp.float64):
    """d log x / d alpha of a Gamma(alpha, 1) draw: the series (x < 1) and the chunked
    calls of JAX's rule (x >= 1; more elements than one chunk) equal
    ``jax.lax.random_gamma_grad(alpha, x) / x`` on every element, to 1e-8 in float64 (float32:
    the docstring's example, and every fit)."""
    from scipy.stats import gamma as gamma_dist

    with jax.enable_x64(dtype == jnp.float64):
        alpha = jnp.asarray(np.repeat([1e-3, 0.05, 0.5, 1.0, 3.0, 20.0, 300.0], 9), dtype)
        q = np.tile(np.linspace(0.05, 0.95, 9), 7)
        x = jnp.asarray(np.maximum(gamma_dist.ppf(q, np.asarray(alpha, np.float64)), 1e-30),
                        dtype)
        assert int(jnp.sum(x >= 1)) > x.size // 8  # the x >= 1 branch spans several chunks
        got = lda_blackbox.gamma_log_grad(alpha, jnp.log(x))
        want = jax.lax.random_gamma_grad(alpha, x) / x
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                                   rtol=1e-8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_log_gamma_draws_have_the_gamma_log_moments(dtype):
    """The vectorised Marsaglia-Tsang draws (boosted in log space below 1): the mean of
    log x is digamma(alpha) and its variance trigamma(alpha), within 5 standard errors, for
    concentrations from 0.01 (log x near -100) to 200."""
    from jax.scipy.special import digamma, polygamma

    n = 20000
    with jax.enable_x64(dtype == jnp.float64):
        alpha = jnp.asarray([0.01, 0.3, 1.0, 5.0, 200.0], dtype)
        log_x = lda_blackbox._log_gamma_draw(jax.random.PRNGKey(0),
                                             jnp.broadcast_to(alpha, (n, 5)))
        assert log_x.dtype == dtype and bool(jnp.all(jnp.isfinite(log_x)))
        var = np.asarray(polygamma(1, alpha), np.float64)
        np.testing.assert_array_less(
            np.abs(np.asarray(log_x.mean(0), np.float64) - np.asarray(digamma(alpha))),
            5 * np.sqrt(var / n))
        np.testing.assert_allclose(np.asarray(log_x.var(0), np.float64), var, rtol=0.06)
        bad = jax.jit(lda_blackbox._log_gamma_draw)(  # never accepted: NaN, not a hang
            jax.random.PRNGKey(1), jnp.asarray([jnp.nan, jnp.inf, 0.0, 2.0], dtype))
        assert np.all(np.isnan(bad[:3])) and np.isfinite(bad[3])


def test_default_fit_matches_the_conjugate_route_at_four_times_its_passes():
    """The defaults (guide "local", Adam 0.2) after 8 passes score within 0.02 nats/word of
    the conjugate route (online VB) after 2, on a synthetic corpus (measured, 3 seeds: the
    black box 0.06-0.23 above it; the previous default, the per-document Dirichlet guide at
    Adam 0.05, 0.40 below)."""
    corpus, _ = corpora.synthetic(1, 240, 40, 4, 60, alpha=0.2, eta=0.1)
    train, test = corpora.train_test_split(corpus, 40, seed=0)
    observed, heldout = corpora.completion_split(test, seed=0)
    conj = lda_svi.fit(train, 4, passes=2, batch_size=50, seed=0, tau=10.0, kappa=0.7)
    res = lda_blackbox.fit(train, 4, passes=8, batch_size=50, seed=0)
    assert res.num_nonfinite == 0
    ref = lda_svi.heldout_log_likelihood(conj.lam, observed, heldout)
    assert lda_svi.heldout_log_likelihood(res.lam, observed, heldout) > ref - 0.02
