r"""Collapsed latent Dirichlet allocation (LDA), the second model of Mandt et al. 2016.

With the word-topic assignments summed out (variational-tempering supplement, eq. 5), for D
documents of :math:`L_d` words over a vocabulary of V words and K topics:

.. math::

    \beta_k \sim \mathrm{Dir}(\eta\,\mathbf 1_V), \qquad
    \theta_d \sim \mathrm{Dir}(\alpha\,\mathbf 1_K), \qquad
    w_{dn} \mid \theta_d, \beta \sim \mathrm{Cat}\big(\textstyle\sum_k \theta_{dk}\beta_k\big).

The paper uses :math:`\alpha = \eta = 1/K` (section 4), the defaults here.

What this module provides
-------------------------
* :func:`make_corpus`: a synthetic corpus drawn from the model (no third-party data).
* :func:`model`: per-word Categorical likelihood, sites ``beta`` (K, V), and inside
  ``plate("docs", D)`` (dim -2) ``theta`` and, inside ``plate("words", L)`` (dim -1), the
  observed ``w``. Tempering ``w`` tempers each word, :math:`p(w_{dn}\mid\theta_d,\beta)^{1/T}`,
  whose normaliser is supplement eq. 6, :math:`\sum_v (\sum_k\theta_{dk}\beta_{kv})^{1/T}`:
  :func:`~numpyro_tempering.partition_function.log_partition` on this model is supplement eq. 7
  (with ``plate="docs"``).
* :func:`multinomial_model`: the same likelihood on word *counts*,
  ``Multinomial(L_d, theta_d @ beta)``. Its log density is :func:`model`'s plus the
  multinomial coefficient :math:`\log L_d! - \sum_v \log n_{dv}!` (a data constant).
  Caveat for tempering: ``temper`` scales the *whole* log-pmf, coefficient included, while
  the package's Multinomial rule (``numpyro_tempering.partition``) tempers per trial (the
  paper's eq. 6-7), i.e. the normaliser of the coefficient-*untempered* density. The two
  objectives differ by :math:`(1/T - 1)` times the coefficient, which varies with T, so for
  multicanonical VI use :func:`model` (whose tempering and log C agree).
* :func:`document_log_normalizer`: supplement eq. 6 raised to the document length, for given
  :math:`\theta, \beta`.
* :func:`corpus_model`: :func:`model`'s density on a sparse corpus (documents of any length
  as padded ``(index, count)`` arrays, :class:`~numpyro_tempering.models.corpora.Corpus`),
  with the observed site ``words`` a :class:`WordCounts` distribution: what the black-box
  route (:mod:`numpyro_tempering.models.lda_blackbox`) fits with stock NumPyro SVI.

Cost: the per-word model evaluates :math:`\theta_d^\top\beta` once per document (``D K V``)
and gathers the L observed words; its log C per temperature costs ``D V`` (the Categorical
is broadcast over the words plate, not copied).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from jax.scipy.special import logsumexp
from numpyro.util import not_jax_tracer

__all__ = [
    "JointWordCounts",
    "LDAData",
    "WordCounts",
    "corpus_model",
    "document_log_normalizer",
    "make_corpus",
    "model",
    "multinomial_model",
    "word_counts",
]


class LDAData(NamedTuple):
    """A synthetic corpus: ``words`` (D, L) int, ``counts`` (D, V), and the true ``theta``
    (D, K) and ``beta`` (K, V)."""

    words: jax.Array
    counts: jax.Array
    theta: jax.Array
    beta: jax.Array


def _check_positive_int(value, name: str) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


def _check_concentration(value, name: str) -> float:
    if not (float(value) > 0 and jnp.isfinite(value)):
        raise ValueError(f"`{name}` must be a finite concentration > 0, got {value!r}.")
    return float(value)


def word_counts(words: jax.typing.ArrayLike, vocab_size: int) -> jax.Array:
    """Bag-of-words counts ``(D, V)`` of a ``(D, L)`` array of word indices.

    Example:
        >>> import jax.numpy as jnp
        >>> word_counts(jnp.array([[0, 2, 2]]), 4).tolist()
        [[1, 0, 2, 0]]
    """
    words = jnp.asarray(words)
    return jnp.sum(jax.nn.one_hot(words, vocab_size, dtype=jnp.int32), axis=-2)


def make_corpus(
    rng_key: jax.Array,
    num_docs: int = 50,
    doc_length: int = 100,
    num_topics: int = 50,
    vocab_size: int = 4000,
    *,
    alpha: float | None = None,
    eta: float | None = None,
) -> LDAData:
    """Draw a corpus from the LDA generative process (defaults: the paper's alpha = eta = 1/K).

    Every document has ``doc_length`` words.

    Example:
        >>> import jax
        >>> from numpyro_tempering.models.lda import make_corpus
        >>> data = make_corpus(jax.random.PRNGKey(0), 3, 7, 4, 20)
        >>> data.words.shape, data.counts.shape, int(data.counts.sum())
        ((3, 7), (3, 20), 21)
    """
    num_docs = _check_positive_int(num_docs, "num_docs")
    doc_length = _check_positive_int(doc_length, "doc_length")
    num_topics = _check_positive_int(num_topics, "num_topics")
    vocab_size = _check_positive_int(vocab_size, "vocab_size")
    alpha = _check_concentration(1.0 / num_topics if alpha is None else alpha, "alpha")
    eta = _check_concentration(1.0 / num_topics if eta is None else eta, "eta")
    k_beta, k_theta, k_words = random.split(rng_key, 3)
    dtype = jnp.result_type(float)
    beta = random.dirichlet(k_beta, jnp.full((vocab_size,), eta, dtype), (num_topics,))
    theta = random.dirichlet(k_theta, jnp.full((num_topics,), alpha, dtype), (num_docs,))
    log_probs = jnp.log(theta @ beta)
    words = random.categorical(k_words, log_probs[:, None, :], shape=(num_docs, doc_length))
    return LDAData(words, word_counts(words, vocab_size), theta, beta)


def _priors(num_topics, vocab_size, alpha, eta):
    num_topics = _check_positive_int(num_topics, "num_topics")
    vocab_size = _check_positive_int(vocab_size, "vocab_size")
    alpha = 1.0 / num_topics if alpha is None else alpha
    eta = 1.0 / num_topics if eta is None else eta
    beta = numpyro.sample(
        "beta", dist.Dirichlet(jnp.full((vocab_size,), eta)).expand([num_topics]).to_event(1)
    )
    return beta, dist.Dirichlet(jnp.full((num_topics,), alpha))


def _shape(data, num_docs, second, what: str) -> tuple[int, int]:
    if data is None:
        if num_docs is None or second is None:
            raise ValueError(f"without `{what}`, give `num_docs` and the document size.")
        return int(num_docs), int(second)
    if jnp.ndim(data) != 2:
        raise ValueError(f"`{what}` must have shape (num_docs, ...), got {jnp.shape(data)}.")
    d, s = jnp.shape(data)
    if num_docs is not None and num_docs != d:
        raise ValueError(f"`{what}` has {d} documents but num_docs={num_docs}.")
    return d, s


def model(
    words: jax.typing.ArrayLike | None = None,
    num_topics: int = 50,
    vocab_size: int = 4000,
    alpha: float | None = None,
    eta: float | None = None,
    *,
    num_docs: int | None = None,
    doc_length: int | None = None,
    subsample_size: int | None = None,
) -> None:
    r"""Collapsed LDA with one Categorical site per word (supplement eq. 5).

    Args:
        words: ``(D, L)`` word indices in ``[0, V)`` (``None`` to generate: give ``num_docs``
            and ``doc_length``).
        num_topics, vocab_size: K and V.
        alpha, eta: Dirichlet concentrations of theta and beta (default 1/K each).
        subsample_size: documents per minibatch (``plate("docs", D, subsample_size)``).

    Sites: ``beta`` (K, V); ``theta`` (D, 1, K) in ``plate("docs", dim=-2)``; ``w`` (D, L)
    observed, in ``plate("words", dim=-1)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from numpyro.infer.util import log_density
        >>> from numpyro_tempering.models import lda
        >>> beta, theta = jnp.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]]), jnp.array([[[1.0, 0.0]]])
        >>> lp, tr = log_density(lda.model, (jnp.array([[0, 1]]), 2, 3, 1.0, 1.0), {},
        ...                      {"beta": beta, "theta": theta})
        >>> round(float(tr["w"]["fn"].log_prob(tr["w"]["value"]).sum()), 4)  # 2 log(1/2)
        -1.3863
    """
    num_docs, doc_length = _shape(words, num_docs, doc_length, "words")
    if words is not None:
        words = jnp.asarray(words)
        if not jnp.issubdtype(words.dtype, jnp.integer):
            raise ValueError(f"`words` must be integer word indices, got dtype {words.dtype}.")
    beta, theta_prior = _priors(num_topics, vocab_size, alpha, eta)
    with numpyro.plate("docs", num_docs, subsample_size=subsample_size, dim=-2) as idx:
        theta = numpyro.sample("theta", theta_prior)  # (B, 1, K)
        probs = jnp.matmul(theta, beta)  # (B, 1, V)
        obs = None if words is None else words[idx]
        with numpyro.plate("words", doc_length, dim=-1):
            numpyro.sample("w", dist.Categorical(probs=probs), obs=obs)


def multinomial_model(
    counts: jax.typing.ArrayLike | None = None,
    num_topics: int = 50,
    vocab_size: int | None = None,
    alpha: float | None = None,
    eta: float | None = None,
    *,
    num_docs: int | None = None,
    doc_length: int | None = None,
    subsample_size: int | None = None,
) -> None:
    r"""Collapsed LDA on bag-of-words counts: ``counts_d ~ Multinomial(L_d, theta_d @ beta)``.

    ``counts`` is ``(D, V)``; every document must have the same length ``L`` (the counts'
    row sums) unless ``doc_length`` is given. See the module docstring for the caveat on
    tempering the multinomial coefficient.

    Sites: ``beta`` (K, V); in ``plate("docs", dim=-1)``: ``theta`` (D, K) and the observed
    ``counts`` (D, V).

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro.infer.util import log_density
        >>> from numpyro_tempering.models import lda
        >>> beta, theta = jnp.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]]), jnp.array([[1.0, 0.0]])
        >>> _, tr = log_density(lda.multinomial_model, (jnp.array([[1, 1, 0]]), 2), {},
        ...                     {"beta": beta, "theta": theta})
        >>> round(float(tr["counts"]["fn"].log_prob(tr["counts"]["value"]).sum()), 4)  # log 1/2
        -0.6931
    """
    if counts is not None:
        counts = jnp.asarray(counts)
        if counts.ndim != 2:
            raise ValueError(f"`counts` must have shape (num_docs, V), got {counts.shape}.")
        if vocab_size is not None and counts.shape[1] != vocab_size:
            raise ValueError(f"`counts` has {counts.shape[1]} words but vocab_size={vocab_size}.")
        vocab_size = counts.shape[1]
        if doc_length is None:
            if not not_jax_tracer(counts):
                raise ValueError("`doc_length` is needed when `counts` is traced (under jit).")
            lengths = np.asarray(counts).sum(-1)
            doc_length = int(lengths[0])
            if not np.all(lengths == doc_length):
                raise ValueError("documents of different lengths: give `doc_length` per "
                                 "document as an array, or equal-length documents.")
    elif vocab_size is None or doc_length is None or num_docs is None:
        raise ValueError("without `counts`, give `num_docs`, `vocab_size` and `doc_length`.")
    num_docs = counts.shape[0] if counts is not None else int(num_docs)
    beta, theta_prior = _priors(num_topics, vocab_size, alpha, eta)
    with numpyro.plate("docs", num_docs, subsample_size=subsample_size) as idx:
        theta = numpyro.sample("theta", theta_prior)  # (B, K)
        obs = None if counts is None else counts[idx]
        numpyro.sample("counts", dist.Multinomial(doc_length, probs=theta @ beta), obs=obs)


def document_log_normalizer(
    temperature: jax.typing.ArrayLike,
    theta: jax.typing.ArrayLike,
    beta: jax.typing.ArrayLike,
    doc_length: int,
) -> jax.Array:
    r"""Supplement eq. 6 for a whole document: :math:`L \log\sum_v (\sum_k \theta_k
    \beta_{kv})^{1/T}`.

    ``theta``: ``(..., K)``; ``beta``: ``(K, V)``; ``temperature`` broadcast against the batch
    of ``theta``. The log C of :func:`model` given the globals and the thetas is the sum of
    this over the documents.

    Example:
        >>> import jax.numpy as jnp
        >>> beta = jnp.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
        >>> round(float(document_log_normalizer(2.0, jnp.array([1.0, 0.0]), beta, 3)), 4)
        1.0397
    """
    log_p = jnp.log(jnp.matmul(jnp.asarray(theta), jnp.asarray(beta)))
    t = jnp.asarray(temperature, log_p.dtype)
    return doc_length * logsumexp(log_p / t[..., None], axis=-1)


class WordCounts(dist.Distribution):
    r"""The collapsed word likelihood of a document given as ``(index, count)`` pairs.

    ``probs`` (..., W): :math:`p_{dw} = \sum_k\theta_{dk}\beta_{k v_w}`, the probability of
    each listed word :math:`v_w`; the value is the counts :math:`n_{dw}` (..., W) (padding:
    count 0). The log density is that of the document's words in a fixed order,

    .. math::

        \log p(w_d \mid \theta_d, \beta) = \textstyle\sum_w n_{dw} \log p_{dw},

    i.e. :func:`model`'s per-word Categorical likelihood (supplement eq. 5) summed over the
    document's tokens, without the multinomial coefficient. Tempering it (``temper``) divides
    it by T, as tempering every word of :func:`model` does. Sampling is not supported (the
    distribution only knows the listed words).

    Example:
        >>> import jax.numpy as jnp
        >>> d = WordCounts(jnp.array([0.5, 0.25, 0.1]))
        >>> round(float(d.log_prob(jnp.array([2.0, 1.0, 0.0]))), 4)  # 2 log 1/2 + log 1/4
        -2.7726
    """

    arg_constraints = {"probs": dist.constraints.unit_interval}
    support = dist.constraints.independent(dist.constraints.nonnegative, 1)

    def __init__(self, probs: jax.Array, *, validate_args: bool | None = None) -> None:
        self.probs = jnp.asarray(probs)
        super().__init__(batch_shape=self.probs.shape[:-1], event_shape=self.probs.shape[-1:],
                         validate_args=validate_args)

    def sample(self, key, sample_shape=()):
        raise NotImplementedError(
            "WordCounts cannot be sampled: it only knows the listed words' probabilities; "
            "simulate documents with make_corpus or corpora.synthetic.")

    def log_prob(self, value: jax.Array) -> jax.Array:
        value = jnp.asarray(value, self.probs.dtype)
        safe = jnp.where(value > 0, self.probs, 1.0)
        return jnp.sum(jnp.where(value > 0, value * jnp.log(safe), 0.0), axis=-1)


class JointWordCounts(WordCounts):
    r""":class:`WordCounts` that keeps its topics for **joint** tempering (``temper(...,
    joint=True)``, ``MulticanonicalELBO(..., joint=True)``): each token's topic assignment
    :math:`z` is summed out *after* tempering, as in the paper's updates (supplement eq. 9)
    and the conjugate route (:mod:`~numpyro_tempering.models.lda_svi`),

    .. math::

        \log p_T(w_d \mid \theta_d, \beta) = \sum_w n_{dw}\log\sum_k
            (\theta_{dk}\beta_{k v_w})^{1/T} - \log C_d(T \mid \bar\beta),

    normalised by the document's own :math:`C_d(T\mid\beta)` of
    :mod:`~numpyro_tempering.models.lda_partition` when a table ``log_c`` (..., M) at the
    ``inv_temperatures`` (M,) of a ladder is given (the table is data: it is computed
    outside the model, at the topics' current mean :math:`\bar\beta`, and held fixed for
    the gradient, as eq. 16 omits :math:`\partial\log C/\partial\lambda`). With the
    normaliser inside the likelihood, the ladder's own log C is 0 (``element_log_c`` of
    zeros): eq. 18 is unchanged. At T = 1 the log density is :class:`WordCounts`'s and
    :math:`\log C_d(1) = 0`; with a table, at a T that is neither 1 nor on the table's
    ladder it is NaN (no normaliser is known there); without one it is unnormalised, like
    every tempered site.

    ``theta`` (..., K); ``beta_words`` (..., K, W): the topics at the listed words.

    Example:
        >>> import jax.numpy as jnp
        >>> theta, bw = jnp.array([0.5, 0.5]), jnp.array([[0.5, 0.25], [0.1, 0.5]])
        >>> d = JointWordCounts(theta, bw)
        >>> n = jnp.array([2.0, 1.0])
        >>> bool(jnp.isclose(d.jointly_tempered_log_prob(n, 1.0), d.log_prob(n)))
        True
        >>> # T = 2, word 0: log(sqrt(.25) + sqrt(.05)), twice; word 1: log(sqrt(.125) + .5)
        >>> round(float(d.jointly_tempered_log_prob(n, 0.5)), 4)
        -0.8054
        >>> d = JointWordCounts(theta, bw, log_c=jnp.array([0.0, 0.3]),
        ...                     inv_temperatures=jnp.array([1.0, 0.5]))  # log C(2) = 0.3
        >>> round(float(d.jointly_tempered_log_prob(n, 0.5)), 4)
        -1.1054
    """

    pytree_data_fields = ("probs", "log_components", "log_c", "inv_temperatures")

    def __init__(self, theta: jax.Array, beta_words: jax.Array, log_c: jax.Array | None = None,
                 inv_temperatures: jax.Array | None = None, *,
                 validate_args: bool | None = None) -> None:
        theta, beta_words = jnp.asarray(theta), jnp.asarray(beta_words)
        if (log_c is None) != (inv_temperatures is None):
            raise ValueError("give both `log_c` and `inv_temperatures` (the ladder's), or "
                             "neither.")
        #: log theta_k + log beta_{k v_w}, (..., W, K)
        self.log_components = (jnp.log(theta)[..., None, :]
                               + jnp.log(jnp.swapaxes(beta_words, -1, -2)))
        self.log_c = None if log_c is None else jnp.asarray(log_c)
        self.inv_temperatures = (None if inv_temperatures is None
                                 else jnp.asarray(inv_temperatures))
        super().__init__(jnp.einsum("...k,...kw->...w", theta, beta_words),
                         validate_args=validate_args)

    def jointly_tempered_log_prob(self, value: jax.Array, inv_temperature) -> jax.Array:
        value = jnp.asarray(value, self.probs.dtype)
        h = jnp.asarray(inv_temperature, self.probs.dtype)
        per_word = logsumexp(h[..., None, None] * self.log_components, axis=-1)
        tempered = jnp.sum(jnp.where(value > 0, value * per_word, 0.0), axis=-1)
        return tempered - self._log_normaliser(h)

    def _log_normaliser(self, h: jax.Array) -> jax.Array:
        """log C_d at inverse temperature h: the table's rung with that h, 0 at h = 1, NaN
        elsewhere; 0 without a table (unnormalised, like every tempered site)."""
        if self.log_c is None:
            return jnp.zeros_like(h)
        gap = jnp.abs(h[..., None] - self.inv_temperatures.astype(h.dtype))  # (..., M)
        rung = jnp.argmin(gap, axis=-1)
        on_ladder = jnp.min(gap, axis=-1) <= 1e-5 * h
        batch = jnp.broadcast_shapes(rung.shape, self.log_c.shape[:-1])
        value = jnp.take_along_axis(jnp.broadcast_to(self.log_c, batch + self.log_c.shape[-1:]),
                                    jnp.broadcast_to(rung, batch)[..., None], axis=-1)[..., 0]
        return jnp.where(on_ladder, value, jnp.where(h == 1.0, 0.0, jnp.nan))


def corpus_model(
    ids: jax.typing.ArrayLike,
    counts: jax.typing.ArrayLike,
    log_c: jax.typing.ArrayLike | None = None,
    *,
    num_topics: int,
    vocab_size: int,
    alpha: float | None = None,
    eta: float | None = None,
    subsample_size: int | None = None,
    joint: bool = False,
    inv_temperatures: jax.typing.ArrayLike | None = None,
) -> None:
    r"""Collapsed LDA (supplement eq. 5) on a sparse corpus: :func:`model`'s density.

    Args:
        ids, counts: ``(D, W)`` distinct word indices of each document and their counts,
            padded with count 0 (``Corpus.ids``, ``Corpus.counts``): documents of any length,
            never a dense ``D x V`` matrix.
        num_topics, vocab_size: K and V (keyword-only: bind them with ``functools.partial``,
            they fix shapes).
        alpha, eta: Dirichlet concentrations (default 1/K).
        subsample_size: documents per minibatch (``plate("docs", D, subsample_size)``).
        joint: the words as :class:`JointWordCounts` (each token's topic summed out after
            tempering, under ``temper(..., joint=True)``), not :class:`WordCounts`.
        log_c, inv_temperatures: with ``joint``, the documents' normalisers
            :math:`\log C_d(T_m\mid\bar\beta)` (D, M) at a ladder's inverse temperatures
            (M,) (:class:`JointWordCounts`); ``log_c`` is data (positional: it changes as the
            topics are learnt), ``inv_temperatures`` fixed.

    Sites: ``beta`` (K, V); in ``plate("docs", dim=-1)``: ``theta`` (B, K) and the observed
    ``words`` (B, W) (:class:`WordCounts`, probabilities gathered at the listed words only:
    cost ``B W K``).

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro.infer.util import log_density
        >>> from numpyro_tempering.models import lda
        >>> beta, theta = jnp.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]]), jnp.array([[1.0, 0.0]])
        >>> _, tr = log_density(lda.corpus_model, (jnp.array([[0, 1]]), jnp.array([[1, 1]])),
        ...                     {"num_topics": 2, "vocab_size": 3},
        ...                     {"beta": beta, "theta": theta})
        >>> round(float(tr["words"]["fn"].log_prob(tr["words"]["value"]).sum()), 4)  # 2 log 1/2
        -1.3863
    """
    ids = jnp.asarray(ids)
    if ids.ndim != 2 or jnp.shape(counts) != ids.shape:
        raise ValueError(f"`ids` and `counts` must have the same shape (num_docs, W), got "
                         f"{ids.shape} and {jnp.shape(counts)}.")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"`ids` must be integer word indices, got dtype {ids.dtype}.")
    if (log_c is not None or inv_temperatures is not None) and not joint:
        raise ValueError("`log_c` and `inv_temperatures` are for `joint=True` (JointWordCounts).")
    beta, theta_prior = _priors(num_topics, vocab_size, alpha, eta)
    with numpyro.plate("docs", ids.shape[0], subsample_size=subsample_size, dim=-1) as idx:
        theta = numpyro.sample("theta", theta_prior)  # (B, K)
        doc_ids = ids[idx]
        beta_words = jnp.take(beta, doc_ids, axis=1)  # (K, B, W)
        if joint:
            words = JointWordCounts(theta, jnp.moveaxis(beta_words, 0, 1),
                                    None if log_c is None else jnp.asarray(log_c)[idx],
                                    inv_temperatures)
        else:
            words = WordCounts(jnp.einsum("bk,kbw->bw", theta, beta_words))
        numpyro.sample("words", words, obs=jnp.asarray(counts)[idx])
