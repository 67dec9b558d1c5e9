"""Tests of the collapsed LDA model: corpus, log densities by hand, eq. 6 normaliser, log C."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.handlers import substitute
from numpyro.infer.util import log_density
from scipy.special import gammaln
from scipy.stats import dirichlet

from numpyro_tempering.models import lda
from numpyro_tempering.partition_function import log_partition, model_sizes

K, V, D, L = 3, 6, 4, 5


@pytest.fixture(scope="module")
def corpus():
    return lda.make_corpus(jax.random.PRNGKey(0), D, L, K, V, alpha=0.7, eta=0.4)


def _values(seed=1):
    rng = np.random.default_rng(seed)
    beta = rng.dirichlet(np.full(V, 0.8), K)
    theta = rng.dirichlet(np.full(K, 1.3), D)
    return beta, theta


def test_corpus_is_consistent(corpus):
    assert corpus.words.shape == (D, L) and corpus.counts.shape == (D, V)
    assert jnp.issubdtype(corpus.words.dtype, jnp.integer)
    assert np.all((np.asarray(corpus.words) >= 0) & (np.asarray(corpus.words) < V))
    np.testing.assert_array_equal(np.asarray(corpus.counts).sum(1), L)
    for d in range(D):
        expected = np.bincount(np.asarray(corpus.words[d]), minlength=V)
        np.testing.assert_array_equal(np.asarray(corpus.counts[d]), expected)
    np.testing.assert_allclose(np.asarray(corpus.beta).sum(1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(corpus.theta).sum(1), 1.0, rtol=1e-5)


def test_word_model_log_density_by_hand(corpus):
    beta, theta = _values()
    alpha, eta = 0.7, 0.4
    lp, _ = log_density(lda.model, (corpus.words, K, V, alpha, eta), {},
                        {"beta": beta, "theta": theta[:, None, :]})
    probs = theta @ beta
    words = np.asarray(corpus.words)
    expected = (
        sum(dirichlet.logpdf(b, np.full(V, eta)) for b in beta)
        + sum(dirichlet.logpdf(t, np.full(K, alpha)) for t in theta)
        + sum(np.log(probs[d, words[d, n]]) for d in range(D) for n in range(L))
    )
    np.testing.assert_allclose(float(lp), expected, rtol=2e-5)


def test_multinomial_model_is_word_model_plus_coefficient(corpus):
    beta, theta = _values(2)
    lp_words, _ = log_density(lda.model, (corpus.words, K, V), {},
                              {"beta": beta, "theta": theta[:, None, :]})
    lp_counts, _ = log_density(lda.multinomial_model, (corpus.counts, K), {},
                               {"beta": beta, "theta": theta})
    counts = np.asarray(corpus.counts)
    coefficient = np.sum(gammaln(L + 1) - gammaln(counts + 1).sum(1))
    np.testing.assert_allclose(float(lp_counts), float(lp_words) + coefficient, rtol=2e-5)


def test_default_concentrations_are_one_over_k(corpus):
    beta, theta = _values(3)
    lp_default, _ = log_density(lda.model, (corpus.words, K, V), {},
                                {"beta": beta, "theta": theta[:, None, :]})
    lp_explicit, _ = log_density(lda.model, (corpus.words, K, V, 1 / K, 1 / K), {},
                                 {"beta": beta, "theta": theta[:, None, :]})
    assert float(lp_default) == pytest.approx(float(lp_explicit), rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.5, 10.0])
def test_document_log_normalizer_is_eq6_to_the_length(temperature):
    beta, theta = _values(4)
    expected = L * np.log(np.sum((theta @ beta) ** (1.0 / temperature), axis=-1))
    got = lda.document_log_normalizer(jnp.full((D,), temperature), theta, beta, L)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)


def test_log_partition_given_all_latents_is_sum_of_document_normalizers(corpus):
    """With beta and theta fixed, the generic estimator is deterministic and must equal
    sum_d L log sum_v (theta_d beta)_v^(1/T) (supplement eq. 6-7): this checks the plate
    layout (words broadcast, not copied) against the formula."""
    beta, theta = _values(5)
    fixed = substitute(lda.model, data={"beta": beta, "theta": theta[:, None, :]})
    temps = jnp.array([1.0, 2.0, 7.0])
    est = log_partition(jax.random.PRNGKey(0), fixed, temps, corpus.words, K, V,
                        num_samples=2, plate="docs", method="prior")
    expected = [
        float(lda.document_log_normalizer(t, theta, beta, L).sum()) for t in np.asarray(temps)
    ]
    np.testing.assert_allclose(np.asarray(est.log_c), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(est.stderr), 0.0, atol=1e-6)


def test_log_partition_per_word_and_per_count_agree(corpus):
    """The registry tempers Multinomial per trial, so both forms have the same log C."""
    temps = jnp.array([1.0, 3.0])
    kw = dict(num_samples=50, plate="docs", method="prior")  # local theta: the nested MC
    words = log_partition(jax.random.PRNGKey(1), lda.model, temps, corpus.words, K, V, **kw)
    counts = log_partition(jax.random.PRNGKey(1), lda.multinomial_model, temps, corpus.counts,
                           K, doc_length=L, **kw)  # counts are traced inside log_partition
    np.testing.assert_allclose(np.asarray(words.log_c), np.asarray(counts.log_c), rtol=1e-4,
                               atol=1e-4)
    assert abs(float(words.log_c[0])) < 1e-4  # C(1) = 1


def test_subsampled_model_has_full_sizes(corpus):
    full = model_sizes(lda.model, corpus.words, K, V)
    sub = model_sizes(lda.model, corpus.words, K, V, subsample_size=2)
    assert full == sub
    assert dict(full.sites)["w"] == (D, L)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="words"):
        log_density(lda.model, (jnp.zeros((2, 3)), K, V), {}, {})
    with pytest.raises(ValueError, match="num_docs"):
        lda.make_corpus(jax.random.PRNGKey(0), 0)
    with pytest.raises(ValueError, match="eta"):
        lda.make_corpus(jax.random.PRNGKey(0), 2, 3, 2, 4, eta=-1.0)
    with pytest.raises(ValueError, match="different lengths"):
        log_density(lda.multinomial_model, (jnp.array([[1, 0], [1, 1]]), 2), {}, {})
