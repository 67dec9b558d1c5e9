r"""Why multicanonical VI for LDA heated up, by exact computation (issue 19; docs/lda.md).

Four measurements, each against an exact reference:

1. **The prior Monte Carlo log C_d (supplement eq. 7) against the exact table**
   (:mod:`numpyro_tempering.models.lda_partition`) for fixed topics, K = 10, alpha = 0.1:
   its error per document length and temperature.
2. **The paper's mean-field eq. 18 has a hot fixed point.** Topics fitted by plain SVI on
   Reuters; for each of 16 documents, q(y_d) by the paper's coupling (phi and gamma at
   E[1/T_y], then r by eq. 18 with ell_d / T_m, iterated) from a uniform q(y_d) and from
   q(y_d) at T = 1, against the anchored family of ``lda_svi.local_step`` and against each
   rung's own best bound (a local fit at every rung: the reference).
3. **q(beta)'s uncertainty favours hot rungs** (``topics="expected"``): at the random
   initial topics every word's E_q[log beta] is below log E_q[beta] by a Jensen gap that
   eq. 18 divides by T_m; measured per word.
4. **The exact temperature posterior of a document** on an enumerable problem (K = 2,
   V = 4, topics fixed at the truth or at a blurred copy; ten documents drawn from the
   model at T = 1 per length): p(y_d = m | w_d, beta) by quadrature over theta, summing
   the assignments exactly. For data the model fits, it concentrates at T = 1 as the
   document grows: the posterior of the temperature is not an annealing schedule, it
   reports the fit.
5. **Short documents stay hot, exactly, and MVI's q(y_d) is hotter still.** A corpus drawn
   from LDA at T = 1 (K = 3, V = 40, alpha = eta = 0.3, 400 documents of L = 2, 4, 8
   words): the exact posterior p(y_d = m | w_d, beta) of the multicanonical model at the
   true topics (every assignment enumerated, Dirichlet moments in closed form, the exact
   log C_d) against ``lda_svi.local_step``'s q(y_d) (eq. 18 over the anchor fits) at the
   same topics, and the E[T] a fit (``Multicanonical.paper()``, 3 passes) ends at. A few
   words hardly move the temperature off its prior (found by a probe, 2026-11-28).

Run: ``python benchmarks/lda_mvi_diagnosis.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import integrate
from scipy.special import digamma, logsumexp, softmax

from numpyro_tempering.models import corpora, lda_svi
from numpyro_tempering.models import lda_partition as lp


def prior_monte_carlo_bias() -> None:
    print("1. prior Monte Carlo log C_d (200 draws of theta) minus exact, K = 10, alpha = 0.1")
    rng = np.random.default_rng(0)
    temps = np.array([1.5, 2.0, 10.0])
    beta = rng.dirichlet(np.full(2000, 0.1), 10)
    log_b = lp.topic_log_sums(beta, temps, expected=False)
    lengths = [10, 100, 400, 1300]
    exact = lp.length_log_partition(log_b, temps, 0.1, max(lengths))
    theta = np.maximum(rng.dirichlet(np.full(10, 0.1), 200), 1e-300)
    print(f"   {'L':>6} " + " ".join(f"T={t:<6g}" for t in temps))
    for length in lengths:
        row = []
        for m, t in enumerate(temps):
            log_s = logsumexp(np.log(theta) / t + log_b[m], axis=1)
            mc = logsumexp(length * log_s) - math.log(len(theta))
            row.append(mc - exact[length, m])
        print(f"   {length:>6} " + " ".join(f"{x:8.1f}" for x in row))


def _mean_field_fixed_point(cfg, lam, ids, cnt, temps, log_c, r0, sweeps=300):
    """The paper's local coupling, literally: phi, gamma at E[1/T_y]; r by eq. 18 from
    ell_d / T_m; repeated."""
    elog_beta = np.asarray(lda_svi.expected_log_dirichlet(jnp.asarray(lam)))
    out = []
    for d in range(ids.shape[0]):
        w, c = ids[d][cnt[d] > 0], cnt[d][cnt[d] > 0]
        r, gamma = r0.copy(), np.ones(lam.shape[0])
        for _ in range(sweeps):
            h = r @ (1 / temps)
            elog_theta = digamma(gamma) - digamma(gamma.sum())
            logits = elog_theta[:, None] + elog_beta[:, w]
            phi = softmax(h * logits, axis=0)
            gamma = cfg.alpha + h * (phi * c).sum(1)
            ell = np.sum(c * phi * logits)
            r = softmax(ell / temps - log_c[d] - math.log(len(temps)))
        out.append(r @ temps)
    return np.array(out)


def hot_fixed_point() -> None:
    print("\n2. E[T] of 16 Reuters documents under topics fitted by SVI (K = 20, 5 passes)")
    corpus = corpora.reuters()
    train, _ = corpora.train_test_split(corpus, num_test=95, seed=0)
    k = 20
    fit = lda_svi.fit(train, k, passes=5, temperature=1.0, seed=0, tau=10.0)
    lam = np.asarray(fit.lam, np.float64)
    mc = lda_svi.Multicanonical.paper()._replace(topics="expected")
    temps = mc.temperatures
    cfg = lda_svi.config(k, train.vocab_size, train.num_docs)._replace(mvi_topics="expected")
    docs = np.arange(16)
    ids, cnt = train.ids[docs], train.counts[docs].astype(np.float64)
    log_c = lp.conditional_log_partition(lam, temps, cfg.alpha, train.lengths[docs])
    uniform = np.full(len(temps), 1 / len(temps))
    cold = np.eye(len(temps))[0]
    print("   mean-field eq. 18, uniform start:",
          np.round(_mean_field_fixed_point(cfg, lam, ids, cnt, temps, log_c, uniform), 2))
    print("   mean-field eq. 18, start at T = 1:",
          np.round(_mean_field_fixed_point(cfg, lam, ids, cnt, temps, log_c, cold), 2))
    with jax.enable_x64(True):
        out = lda_svi.local_step(cfg, jnp.asarray(lam), jnp.asarray(ids), jnp.asarray(cnt),
                                 jnp.ones((16, k)), (1 / temps, mc.log_weights,
                                                     1 / mc.anchor_temperatures(), log_c))
        every = lda_svi.local_step(cfg, jnp.asarray(lam), jnp.asarray(ids), jnp.asarray(cnt),
                                   jnp.ones((16, k)), (1 / temps, mc.log_weights,
                                                       1 / temps[::9], log_c[:, :]))
    print("   anchored (4 anchors):          ", np.round(np.asarray(out.q_y) @ temps, 2))
    print("   anchored (12 anchors):         ", np.round(np.asarray(every.q_y) @ temps, 2))


def jensen_gap() -> None:
    print("\n3. per-word Jensen gap log E_q[beta] - E_q[log beta] of q(beta) = Dir(lambda)")
    for label, lam in (("initial topics (Gamma(100, 0.01), V = 4258)",
                        np.random.default_rng(0).gamma(100.0, 0.01, (20, 4258))),
                       ("topics with ~50 counts per used word",
                        np.random.default_rng(0).gamma(0.2, 250.0, (20, 4258)) + 0.05)):
        mean = np.log(lam / lam.sum(1, keepdims=True))
        expected = digamma(lam) - digamma(lam.sum(1, keepdims=True))
        weight = lam / lam.sum(1, keepdims=True)  # the words the topics emit
        print(f"   {label}: {np.sum(weight * (mean - expected)) / lam.shape[0]:.3f} nats/word "
              "(eq. 18 pays it / T_m: a hot rung pays a tenth of it at T = 10)")


def _log_evidence(beta, alpha, doc, t):
    """log sum_z int p(theta) prod_n p(w_n, z_n | theta, beta)^(1/T) dtheta, K = 2."""
    a1, a2 = alpha
    log_norm = math.lgamma(a1 + a2) - math.lgamma(a1) - math.lgamma(a2)

    def integrand(x):
        per_word = [(x * beta[0, v]) ** (1 / t) + ((1 - x) * beta[1, v]) ** (1 / t) for v in doc]
        return math.exp(sum(math.log(p) for p in per_word) + shift)

    grid = np.linspace(1e-6, 1 - 1e-6, 2001)
    shift = -max(sum(math.log((x * beta[0, v]) ** (1 / t) + ((1 - x) * beta[1, v]) ** (1 / t))
                     for v in doc) for x in grid)
    val = integrate.quad(integrand, 0, 1, weight="alg", wvar=(a1 - 1, a2 - 1), limit=200)[0]
    return math.log(val) - shift + log_norm


def exact_temperature_posterior() -> None:
    print("\n4. exact p(y_d | w_d, beta) of one document, K = 2, V = 4, alpha = 0.5, "
          "ladder 1..10 (8 rungs)")
    rng = np.random.default_rng(3)
    truth = np.array([[0.6, 0.3, 0.05, 0.05], [0.05, 0.05, 0.3, 0.6]])
    blurred = 0.5 * truth + 0.5 * truth[::-1]
    alpha = np.array([0.5, 0.5])
    temps = np.geomspace(1.0, 10.0, 8)
    for label, beta in (("true topics", truth), ("blurred topics", blurred)):
        log_b = lp.topic_log_sums(beta, temps, expected=False)
        for length in (5, 20, 60):
            log_c = lp.length_log_partition(log_b, temps, alpha, length)[length]
            posts = []
            for _ in range(10):  # ten documents drawn from the model at T = 1
                doc = rng.choice(4, size=length, p=rng.dirichlet(alpha) @ truth)
                posts.append(softmax([_log_evidence(beta, alpha, doc, t) for t in temps]
                                     - log_c))
            posts = np.array(posts)
            print(f"   {label:>14}, L = {length:>3}: mean over 10 documents of E[T] = "
                  f"{np.mean(posts @ temps):5.2f}, of p(T = 1) = {np.mean(posts[:, 0]):.3f}")


def short_documents() -> None:
    print("\n5. short documents drawn at T = 1 (K = 3, V = 40, alpha = eta = 0.3): E[T] of "
          "the exact posterior and of MVI's q(y_d) at the true topics, and a fit's last E[T]")
    mc = lda_svi.Multicanonical.paper()
    temps, inv, alpha, num_topics, vocab = mc.temperatures, 1.0 / mc.temperatures, 0.3, 3, 40
    for length in (2, 4, 8):
        corpus, truth = corpora.synthetic(0, 400, length, num_topics, vocab, alpha=alpha,
                                          eta=alpha)
        fit = lda_svi.fit(corpus, num_topics, passes=3, batch_size=50, temperature=mc,
                          tau=10.0, seed=0, alpha=alpha, eta=alpha)
        docs = np.arange(60)
        log_c = lp.length_log_partition(lp.topic_log_sums(truth, temps, expected=False),
                                        temps, alpha, length)[length]
        exact = [lp.exact_temperature_posterior(
            truth, np.repeat(corpus.ids[d], corpus.counts[d]), temps, mc.log_weights, alpha)
            @ temps for d in docs]
        cfg = lda_svi.config(num_topics, vocab, corpus.num_docs, alpha=alpha, eta=alpha)
        local = lda_svi.local_step(
            cfg, jnp.asarray(truth * 1e4, jnp.float32), corpus.ids[docs], corpus.counts[docs],
            lda_svi.initial_gamma(0, docs.size, num_topics),
            (inv, mc.log_weights, 1.0 / mc.anchor_temperatures(),
             np.tile(log_c, (docs.size, 1))))
        q_t = np.asarray(local.q_y, np.float64) @ temps
        print(f"   L = {length}: exact E[T] {np.mean(exact):.2f} (range {np.min(exact):.2f}-"
              f"{np.max(exact):.2f}), MVI q(y_d) {q_t.mean():.2f} ({q_t.min():.2f}-"
              f"{q_t.max():.2f}); a fit's last E[T] {fit.temperatures[-1]:.2f}; prior "
              f"{temps.mean():.2f}")


if __name__ == "__main__":
    prior_monte_carlo_bias()
    hot_fixed_point()
    jensen_gap()
    exact_temperature_posterior()
    short_documents()
