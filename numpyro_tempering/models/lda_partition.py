r"""The per-document tempered normaliser of LDA, exactly: :math:`\log C_d(T \mid \beta)`.

Which normaliser
----------------
Multicanonical VI for LDA gives every document its own temperature :math:`T_d = T_{y_d}`
(Mandt et al. 2016, Algorithm 1 and eq. 18 per document) while the topics :math:`\beta` are
shared. The multicanonical joint of eq. 10-11 must be a proper distribution for eq. 18 to be
the variational update of a model at all. The paper's normaliser (supplement eq. 1, 5-7)
integrates :math:`\beta` out, :math:`C(T) = \int p(\beta)\prod_d C_d(T\mid\beta)\,d\beta`:
that normalises a model with **one** temperature for the whole corpus. With one temperature
per document the product over documents of :math:`\beta`-integrated factors does not
normalise anything (the :math:`\beta` integral of a product is not the product of
integrals). The normaliser that does is the document's own, conditional on the topics,

.. math::

    C_d(T\mid\beta) = \sum_{w_d, z_d}\int d\theta_d\; p(\theta_d)\,
        p(w_d, z_d\mid\theta_d,\beta)^{1/T}
      = \mathbb E_{\theta\sim\mathrm{Dir}(\alpha)}\big[s(\theta,\beta;T)^{L_d}\big],
    \qquad s = \sum_k \theta_k^{1/T}\, b_k(T),\quad b_k(T) = \sum_v \beta_{kv}^{1/T},

for a document of :math:`L_d` words, tempering the joint :math:`p(w, z\mid\theta,\beta)`
as the updates of supplement eq. 9 do (they temper :math:`z`). Then

.. math::

    p(\beta)\prod_d \pi_{y_d}\,p(\theta_d)\,
        \frac{p(w_d, z_d\mid\theta_d,\beta)^{1/T_{y_d}}}{C_d(T_{y_d}\mid\beta)}

sums and integrates to one (documents, then :math:`\theta_d`, then :math:`\beta`), and the
eq. 18 update of :math:`q(y_d)` holds with :math:`\mathbb E_{q(\beta)}[\log C_d(T_m\mid
\beta)]` in place of :math:`\log C(T_m)` (``tests/test_lda_partition.py`` checks the
normalisation by summing over every document of a small vocabulary). The normaliser depends
on the topics, so it must follow them as they are learnt: :func:`conditional_log_partition`
computes it from the current :math:`q(\beta) = \mathrm{Dir}(\lambda)`, and
:func:`numpyro_tempering.models.lda_svi.fit` recomputes it as :math:`\lambda` moves. (The
topics' natural-gradient step itself keeps the paper's eq. 16, which omits
:math:`\partial\log C_d/\partial\lambda`.)

:math:`\mathbb E_{q(\beta)}[\log C_d]` is taken at :math:`\mathbb E_{q}[b_k(T)] = \sum_v
\mathbb E_q[\beta_{kv}^{1/T}]`, which is exact in closed form for a Dirichlet,
:math:`\mathbb E[\beta_{kv}^{h}] = \frac{\Gamma(\lambda_{kv}+h)\Gamma(\Lambda_k)}
{\Gamma(\lambda_{kv})\Gamma(\Lambda_k + h)}`: :math:`b_k` is a sum over the whole
vocabulary of nearly independent bounded terms, so it barely fluctuates under
:math:`q(\beta)` and :math:`\log C_d` is taken at its concentrated value. The Jensen gap
this leaves, measured with draws from :math:`q(\beta)` in
``tests/test_lda_partition.py``, is within 0.1 nats for a 100-word document when the topics
hold about two counts per word (where :math:`\log C_d` itself varies by 0.5 nats from draw
to draw), and shrinks as they gain counts. At T = 1, :math:`b_k = 1` and :math:`C_d = 1`
exactly.

The exact computation
---------------------
Expanding :math:`s^L` multinomially and using the Dirichlet moments
:math:`\mathbb E[\prod_k\theta_k^{a_k}] = \frac{\Gamma(A)}{\Gamma(A + \sum a_k)}\prod_k
\frac{\Gamma(\alpha_k + a_k)}{\Gamma(\alpha_k)}` (:math:`A = \sum_k\alpha_k`),

.. math::

    C_d(T\mid\beta) = \frac{L!\,\Gamma(A)}{\Gamma(A + L/T)}
        \sum_{n_1+\dots+n_K = L}\;\prod_k f_k(n_k), \qquad
    f_k(n) = \frac{b_k^{\,n}\,\Gamma(\alpha_k + n/T)}{\Gamma(\alpha_k)\,n!},

and the sum over compositions is the coefficient of :math:`x^L` in :math:`\prod_k\sum_n
f_k(n)x^n`: K convolutions of sequences of length :math:`L_{\max}+1`, in log space, give
:math:`\log C` for **every** length up to :math:`L_{\max}` at once, exactly (no Monte Carlo,
no error bar to report: its only error is float64 rounding). Cost
:math:`O(K L_{\max}^2)` per temperature. Monte Carlo over prior draws of :math:`\theta` --
the supplement's route, eq. 7 -- is biased low by hundreds of nats for long documents at
:math:`\alpha = 1/K` (the tilted target :math:`p(\theta)s^L` puts its mass on which few
topics are active, :math:`2^K` configurations a prior draw rarely hits), which is why MVI
heated up instead of cooling with it (docs/lda.md, "Why MVI heated up").
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaln

__all__ = [
    "conditional_log_partition",
    "length_log_partition",
    "topic_log_sums",
]


def _inverse_temperatures(temperatures) -> np.ndarray:
    inv_t = 1.0 / np.asarray(temperatures, np.float64)
    if inv_t.ndim != 1 or inv_t.size == 0 or not np.all(np.isfinite(inv_t) & (inv_t > 0)):
        raise ValueError(f"`temperatures` must be a non-empty 1-D array of finite T > 0, got "
                         f"{temperatures!r}.")
    return inv_t


def _concentrations(alpha, num_topics: int) -> np.ndarray:
    a = np.broadcast_to(np.asarray(alpha, np.float64), (num_topics,))
    if not np.all(np.isfinite(a) & (a > 0)):
        raise ValueError(f"`alpha` must be finite concentrations > 0, got {alpha!r}.")
    return np.array(a)


@jax.jit
def _expected_topic_log_sums(lam, inv_t):
    total = jnp.sum(lam, axis=1)  # (K,)

    def one(h):
        per_word = gammaln(lam + h) - gammaln(lam)  # log E[beta_kv^h] + log-Gamma(sum) part
        return (jax.nn.logsumexp(per_word, axis=1)
                - (gammaln(total + h) - gammaln(total)))

    return jax.lax.map(one, inv_t)  # (M, K)


@jax.jit
def _plugin_topic_log_sums(log_beta, inv_t):
    return jax.nn.logsumexp(inv_t[:, None, None] * log_beta[None], axis=-1)


def topic_log_sums(topics: np.typing.ArrayLike, temperatures: np.typing.ArrayLike, *,
                   expected: bool = True) -> np.ndarray:
    r""":math:`\log b_k(T_m)`, (M, K): the topics' tempered word sums.

    ``expected=True``: ``topics`` is :math:`\lambda` (K, V), the Dirichlet parameters of
    :math:`q(\beta_k)`, and the result is :math:`\log\mathbb E_q[\sum_v\beta_{kv}^{1/T}]`
    (closed form, see the module docstring). ``expected=False``: ``topics`` is
    :math:`\beta` itself (rows on the simplex) and the result is
    :math:`\log\sum_v\beta_{kv}^{1/T}`. Computed in float64.

    Example:
        >>> b = topic_log_sums(np.full((2, 4), 0.25), [1.0, 2.0], expected=False)
        >>> np.round(np.exp(b), 6).tolist()  # sum_v (1/4)^(1/T): 1 and 4 * 1/2
        [[1.0, 1.0], [2.0, 2.0]]
    """
    inv_t = _inverse_temperatures(temperatures)
    x = np.asarray(topics, np.float64)
    if x.ndim != 2:
        raise ValueError(f"`topics` must be a (K, V) array, got shape {x.shape}.")
    with jax.enable_x64(True):
        if expected:
            if not np.all(np.isfinite(x) & (x > 0)):
                raise ValueError("`topics` (Dirichlet parameters lambda) must be finite and > 0.")
            out = _expected_topic_log_sums(jnp.asarray(x), jnp.asarray(inv_t))
        else:
            if np.any(x < 0) or not np.allclose(x.sum(axis=1), 1.0, atol=1e-6):
                raise ValueError("`topics` (beta) must have rows on the simplex.")
            with np.errstate(divide="ignore"):
                out = _plugin_topic_log_sums(jnp.asarray(np.log(x)), jnp.asarray(inv_t))
        return np.asarray(out)


@partial(jax.jit, static_argnums=3)
def _length_table(log_b, inv_t, alpha, max_length):
    n = jnp.arange(max_length + 1.0)
    total = jnp.sum(alpha)
    lag = jnp.arange(max_length + 1)[:, None] - jnp.arange(max_length + 1)[None, :]
    valid = lag >= 0
    lag = jnp.where(valid, lag, 0)

    def one(args):
        lb, h = args
        log_f = (n[:, None] * lb[None, :] + gammaln(alpha[None, :] + n[:, None] * h)
                 - gammaln(alpha)[None, :] - gammaln(n + 1.0)[:, None])  # (L+1, K)

        def convolve(acc, lf):
            terms = jnp.where(valid, acc[None, :] + lf[lag], -jnp.inf)
            return jax.nn.logsumexp(terms, axis=1), None

        acc, _ = jax.lax.scan(convolve, log_f[:, 0], log_f[:, 1:].T)
        return acc + gammaln(n + 1.0) + gammaln(total) - gammaln(total + n * h)

    return jax.lax.map(one, (log_b, inv_t)).T  # (L+1, M)


def length_log_partition(log_b: np.typing.ArrayLike, temperatures: np.typing.ArrayLike,
                         alpha: np.typing.ArrayLike, max_length: int) -> np.ndarray:
    r"""Exact :math:`\log C(T_m)` of a document of every length :math:`L = 0..`
    ``max_length``, (max_length + 1, M), given the topics' :math:`\log b_k(T_m)` (M, K).

    The multinomial expansion of the module docstring, by K log-space convolutions
    (float64; :math:`O(K L_{\max}^2)` per temperature). Row 0 (the empty document) is 0,
    and so is every row at :math:`T = 1` when :math:`b_k(1) = 1`.

    Example:
        >>> t = length_log_partition(np.zeros((1, 3)), [1.0], 0.3, 20)  # T = 1, b = 1
        >>> bool(np.max(np.abs(t)) < 1e-10)
        True
        >>> # K = 1: C = b^L E[theta^(L/T)] = b^L exactly (theta = 1)
        >>> t = length_log_partition(np.log([[3.0]]), [2.0], 0.5, 4)
        >>> np.round(t[:, 0], 6).tolist() == np.round(np.arange(5) * np.log(3.0), 6).tolist()
        True
    """
    inv_t = _inverse_temperatures(temperatures)
    log_b = np.asarray(log_b, np.float64)
    if log_b.ndim != 2 or log_b.shape[0] != inv_t.size:
        raise ValueError(f"`log_b` must have shape (M={inv_t.size}, K), got {log_b.shape}.")
    if int(max_length) != max_length or max_length < 0:
        raise ValueError(f"`max_length` must be an integer >= 0, got {max_length!r}.")
    alpha = _concentrations(alpha, log_b.shape[1])
    if not np.all(np.isfinite(log_b)):
        return np.full((int(max_length) + 1, inv_t.size), np.nan)
    with jax.enable_x64(True):
        table = _length_table(jnp.asarray(log_b), jnp.asarray(inv_t), jnp.asarray(alpha),
                              int(max_length))
        return np.asarray(table)


def conditional_log_partition(lam: np.typing.ArrayLike, temperatures: np.typing.ArrayLike,
                              alpha: np.typing.ArrayLike, lengths: np.typing.ArrayLike, *,
                              topics: str = "expected") -> np.ndarray:
    r""":math:`\mathbb E_{q(\beta)}[\log C_d(T_m\mid\beta)]` per document, (D, M): the
    normaliser of eq. 18 for documents of the given ``lengths`` under the current topics
    :math:`q(\beta) = \mathrm{Dir}(\lambda)` (taken at :math:`\mathbb E_q[b_k]`, see the
    module docstring). Exact up to that; float64.

    Example:
        >>> lam = np.array([[5.0, 1.0, 1.0], [1.0, 1.0, 5.0]])
        >>> c = conditional_log_partition(lam, [1.0, 4.0], 0.5, [0, 3, 10])
        >>> c.shape, bool(np.all(np.abs(c[:, 0]) < 1e-9)), bool(np.all(c[1:, 1] > 0))
        ((3, 2), True, True)
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or np.any(lengths < 0) or np.any(lengths != np.round(lengths)):
        raise ValueError("`lengths` must be a 1-D array of integers >= 0 (words per document).")
    if topics == "expected":
        log_b = topic_log_sums(lam, temperatures)
    elif topics == "mean":
        lam = np.asarray(lam, np.float64)
        log_b = topic_log_sums(lam / lam.sum(axis=1, keepdims=True), temperatures,
                               expected=False)
    else:
        raise ValueError(f"`topics` must be 'expected' or 'mean', got {topics!r}.")
    max_length = int(lengths.max()) if lengths.size else 0
    table = length_log_partition(log_b, temperatures, alpha, max_length)
    return table[lengths.astype(np.int64)]
