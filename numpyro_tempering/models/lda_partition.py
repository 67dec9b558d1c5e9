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

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaln
from scipy import special
from scipy.special import digamma

__all__ = [
    "ExactTable",
    "TableEnds",
    "conditional_log_partition",
    "convex_bracket",
    "exact_table",
    "exact_temperature_posterior",
    "fast_topic_log_sums",
    "fitted_topic_log_sums",
    "length_log_partition",
    "stale_table",
    "table_ends",
    "topic_log_sums",
]


def _inverse_temperatures(temperatures) -> np.ndarray:
    inv_t = 1.0 / np.asarray(temperatures, np.float64)
    if inv_t.ndim != 1 or inv_t.size == 0 or not np.all(np.isfinite(inv_t) & (inv_t > 0)):
        raise ValueError(f"`temperatures` must be a non-empty 1-D array of finite T > 0, got "
                         f"{temperatures!r}.")
    return inv_t


def _concentrations(alpha, num_topics: int) -> np.ndarray:
    a = np.asarray(alpha, np.float64)
    if a.ndim > 1 or (a.ndim == 1 and a.size not in (1, num_topics)):
        raise ValueError(f"`alpha` must be a number or K={num_topics} concentrations, got "
                         f"shape {a.shape}.")
    a = np.broadcast_to(a, (num_topics,))
    if not np.all(np.isfinite(a) & (a > 0)):
        raise ValueError(f"`alpha` must be finite concentrations > 0, got {alpha!r}.")
    return np.array(a)


@jax.jit
def _expected_topic_log_sums(lam, h):
    """(K,) at one inverse temperature ``h`` (a scalar)."""
    total = jnp.sum(lam, axis=1)  # (K,)
    per_word = gammaln(lam + h) - gammaln(lam)  # log E[beta_kv^h] + log-Gamma(sum) part
    return jax.nn.logsumexp(per_word, axis=1) - (gammaln(total + h) - gammaln(total))


@jax.jit
def _plugin_topic_log_sums(log_beta, h):
    """(K,) at one inverse temperature ``h`` (a scalar)."""
    return jax.nn.logsumexp(h * log_beta, axis=-1)


def _rung_by_rung(fn, x: jax.Array, inv_t: np.ndarray) -> np.ndarray:
    """(M, ...) ``fn(x, h)`` for every ``h`` in ``inv_t``, one call per rung: one compiled
    program serves any number of rungs (a refresh recomputes 1 to M of them; compiling for
    each count cost more than the sums themselves), and the calls are dispatched before
    any result is read."""
    outs = [fn(x, jnp.asarray(h, x.dtype)) for h in inv_t]
    return np.stack([np.asarray(o) for o in outs]) if outs else np.zeros((0, x.shape[0]))


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
            out = _rung_by_rung(_expected_topic_log_sums, jnp.asarray(x), inv_t)
        else:
            if np.any(x < 0) or not np.allclose(x.sum(axis=1), 1.0, atol=1e-6):
                raise ValueError("`topics` (beta) must have rows on the simplex.")
            with np.errstate(divide="ignore"):
                out = _rung_by_rung(_plugin_topic_log_sums, jnp.asarray(np.log(x)), inv_t)
        return np.asarray(out)


def fitted_topic_log_sums(lam: np.typing.ArrayLike, temperatures: np.typing.ArrayLike,
                          topics: str = "expected") -> np.ndarray:
    r""":func:`topic_log_sums` (M, K) of fitted topics :math:`q(\beta) = \mathrm{Dir}(\lambda)`:
    ``"expected"``, :math:`\log\mathbb E_q[b_k(T)]`; ``"mean"``, :math:`\log b_k(T)` at the
    posterior mean :math:`\lambda/\sum_v\lambda`.

    Example:
        >>> lam = np.array([[2.0, 2.0], [1.0, 3.0]])
        >>> # T = 2: log(2 sqrt(1/2)) and log(sqrt(1/4) + sqrt(3/4))
        >>> np.round(fitted_topic_log_sums(lam, [1.0, 2.0], "mean")[1], 4).tolist()
        [0.3466, 0.3119]
    """
    if topics == "expected":
        return topic_log_sums(lam, temperatures)
    if topics == "mean":
        lam = np.asarray(lam, np.float64)
        return topic_log_sums(lam / lam.sum(axis=1, keepdims=True), temperatures,
                              expected=False)
    raise ValueError(f"`topics` must be 'expected' or 'mean', got {topics!r}.")


@jax.jit
def _fast_plugin_sums(log_beta, inv_t):
    lb32 = log_beta.astype(jnp.float32)
    top = jnp.max(lb32, axis=1)  # (K,)
    x = inv_t.astype(jnp.float32)[:, None, None] * (lb32 - top[:, None])[None]  # <= 0
    sums = jnp.sum(jnp.exp(x).astype(jnp.float64), axis=-1)
    return jnp.log(sums) + inv_t[:, None] * top.astype(jnp.float64)[None]


def fast_topic_log_sums(lam: np.typing.ArrayLike, temperatures: np.typing.ArrayLike,
                        topics: str = "mean") -> tuple[np.ndarray, np.ndarray]:
    r""":func:`fitted_topic_log_sums` (M, K) with float32 exponentials summed in float64,
    and a bound on its error (M, K): ``(log_b, allowance)``.

    With ``"mean"`` topics each term :math:`\bar\beta_{kv}^{h} = e^{h(\log\bar\beta_{kv} -
    c_k)}e^{hc_k}`, :math:`c_k = \max_v\log\bar\beta_{kv}`, has its exponent rounded to
    float32 (the logs, the product, the exponential: a relative error below
    :math:`2^{-23}(h(|c_k| + r_k) + 2)` with :math:`r_k` the range of the logs), and a sum
    of positive terms, each within that relative error, is within it too: that is the
    ``allowance``, at most :math:`2^{-23}(\max_v|\log\bar\beta_{kv}| + 2)`, about
    :math:`4\cdot 10^{-6}` for words as rare as :math:`e^{-30}`. About 8x faster than the
    float64 sums on a CPU (50 topics, 10,000 words, 100 rungs: 0.03 s instead of 0.27 s).
    ``"expected"`` topics, and T = 1, are :func:`fitted_topic_log_sums` itself
    (``allowance`` 0).

    Example:
        >>> lam = np.array([[2.0, 2.0, 1.0], [1.0, 3.0, 0.5]])
        >>> fast, allowance = fast_topic_log_sums(lam, [1.0, 2.5])
        >>> exact = fitted_topic_log_sums(lam, [1.0, 2.5], "mean")
        >>> bool(np.all(np.abs(fast - exact) <= allowance)), bool(allowance.max() < 1e-6)
        (True, True)
    """
    if topics != "mean":
        exact = fitted_topic_log_sums(lam, temperatures, topics)
        return exact, np.zeros_like(exact)
    inv_t = _inverse_temperatures(temperatures)
    lam = np.asarray(lam, np.float64)
    if lam.ndim != 2 or not np.all(np.isfinite(lam) & (lam > 0)):
        raise ValueError("`lam` must be a (K, V) array of finite Dirichlet parameters > 0.")
    log_beta = np.log(lam) - np.log(lam.sum(axis=1, keepdims=True))
    with jax.enable_x64(True):
        log_b = np.array(_fast_plugin_sums(jnp.asarray(log_beta), jnp.asarray(inv_t)))
    top, low = log_beta.max(axis=1), log_beta.min(axis=1)
    allowance = 2.0**-23 * (inv_t[:, None] * (np.abs(top) + top - low)[None] + 2.0)
    one = inv_t == 1.0  # T = 1 (log b = 0 up to rounding): the float64 sums themselves
    if np.any(one):
        log_b[one] = fitted_topic_log_sums(lam, 1.0 / inv_t[one], "mean")
        allowance[one] = 0.0
    return log_b, allowance


def _log_terms(log_b: np.ndarray, inv_t: np.ndarray, alpha: np.ndarray,
               size: int) -> np.ndarray:
    """(M, size, K) log f_k(n) = n log b_k + log Gamma(alpha_k + n h) - log Gamma(alpha_k)
    - log n!, n < size (NumPy; the Gamma terms once per distinct alpha_k)."""
    n = np.arange(size, dtype=np.float64)
    values, which = np.unique(alpha, return_inverse=True)
    gamma = np.stack([special.gammaln(a + n[None, :] * inv_t[:, None]) - special.gammaln(a)
                      for a in values], axis=-1)  # (M, size, distinct alphas)
    return (n[None, :, None] * log_b[:, None, :] + gamma[..., which.reshape(-1)]
            - special.gammaln(n + 1.0)[None, :, None])


def _dirichlet_factor(inv_t: np.ndarray, alpha: np.ndarray, size: int) -> np.ndarray:
    """(size, M) log of L! Gamma(A) / Gamma(A + L h), the factor that turns the
    coefficient of x^L into log C (A = sum_k alpha_k)."""
    n = np.arange(size, dtype=np.float64)
    total = np.sum(alpha)
    return (special.gammaln(n + 1.0)[:, None] + special.gammaln(total)
            - special.gammaln(total + n[:, None] * inv_t[None, :]))


def _exact_coefficients(log_f: np.ndarray) -> np.ndarray:
    """:func:`_log_coefficients` of a float64 NumPy ``log_f`` (M, L+1, K), computed in
    float64 one rung per call (one compilation per length, whatever the number of rungs)."""
    with jax.enable_x64(True):
        outs = [_log_coefficients(jnp.asarray(lf, jnp.float64)) for lf in log_f]
        return (np.stack([np.asarray(o) for o in outs]) if outs
                else np.zeros(log_f.shape[:2]))


@jax.jit
def _log_coefficients(log_f):
    """(L+1,) log of the coefficients of x^L in prod_k sum_n f_k(n) x^n, from one rung's
    log_f (L+1, K): K convolutions in log space (log-sum-exp: exact whatever the range)."""
    size = log_f.shape[0]
    lag = jnp.arange(size)[:, None] - jnp.arange(size)[None, :]
    valid = lag >= 0
    lag = jnp.where(valid, lag, 0)

    def convolve(acc, lf):
        terms = jnp.where(valid, acc[None, :] + lf[lag], -jnp.inf)
        return jax.nn.logsumexp(terms, axis=1), None

    acc, _ = jax.lax.scan(convolve, log_f[:, 0], log_f[:, 1:].T)
    return acc


#: values below this (relative to a sequence's maximum) are set to 0 in the linear passes:
#: then no product of two stays below float64's normal range (subnormal arithmetic is ~100x
#: slower), what is flushed is < 1e-150 of a pass's maximum (far below PASS_FLOOR), and each
#: tilted sequence keeps only the few hundred terms around its peak that the convolutions need
FLUSH = 1e-150


def _supports(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and one-past-last index of the nonzero entries of each column of ``x``
    (equal where a column is all zero)."""
    nonzero = x > 0
    lo = np.argmax(nonzero, axis=0)
    hi = np.where(nonzero.any(axis=0), x.shape[0] - np.argmax(nonzero[::-1], axis=0), lo)
    return lo, hi


def _tilted_pass(log_f: np.ndarray, rho: float) -> tuple[np.ndarray, np.ndarray]:
    """log of the coefficients c_L (L < log_f.shape[0]) of prod_k sum_n f_k(n) x^n for one
    rung (log_f: (L+1, K)) and one tilt rho, by K direct convolutions in linear space: the
    sequences tilted by e^(n rho), scaled to their maxima and cut to their support above
    :data:`FLUSH`, the running product rescaled to its maximum after each topic (its log
    scale carried). Every coefficient is a sum of positive terms, so it is exact to rounding
    wherever it does not underflow; ``rel`` is log(coefficient / maximum), -inf where it
    underflowed (another tilt must supply it). NumPy on the host: ``np.convolve`` of the cut
    supports is several times faster than XLA's CPU convolution and, unlike it, does not
    slow down by orders of magnitude when the cores are shared."""
    size, num_topics = log_f.shape
    lengths = np.arange(size, dtype=np.float64)
    g = log_f + lengths[:, None] * rho
    shift = np.max(g, axis=0)
    with np.errstate(under="ignore"):
        x = np.exp(g - shift)
    x[x < FLUSH] = 0.0
    lo, hi = _supports(x)
    # the running product as a segment acc starting at length `first`, trimmed to its
    # entries >= FLUSH (relative to its maximum, 1)
    first, acc, scale = lo[0], x[lo[0]:hi[0], 0], shift[0]
    for k in range(1, num_topics):
        first = first + lo[k]
        if first >= size or acc.size == 0 or hi[k] == lo[k]:
            return np.full(size, np.nan), np.full(size, -np.inf)
        acc = np.convolve(acc, x[lo[k]:hi[k], k])[: size - first]
        top = np.max(acc)
        keep = np.flatnonzero(acc >= FLUSH * top)
        first, acc = first + keep[0], acc[keep[0]: keep[-1] + 1] / top
        scale += np.log(top)
    full = np.zeros(size)
    full[first: first + acc.size] = acc
    with np.errstate(divide="ignore"):
        rel = np.log(full)
    value = rel + scale + np.sum(shift[1:]) - lengths * rho
    return value, rel


#: documents up to this length get the log-space convolution (no tilt needed); longer ones
#: tilted linear-space passes that continue from it
EXACT_LENGTH = 128
#: a pass's value is used where it is at least exp(-PASS_FLOOR) (~1e-130) of the pass's
#: maximum: a sum of terms of which none was flushed to 0 but ones < 1e-150
PASS_FLOOR = 300.0


def _windowed_table(log_f, exact):
    """Extend the log-coefficients known exactly for lengths <= EXACT_LENGTH ((M, E+1)) to
    every length of ``log_f`` (M, L+1, K) by tilted linear-space passes
    (:func:`_tilted_pass`). Each pass is tilted by minus the log-coefficients' slope at the
    frontier (the last length known), so that the coefficients beyond it decay from about
    the scale they have there; it yields every length whose coefficient stays within
    exp(-PASS_FLOOR) of the pass's maximum, and the next pass starts from the new frontier.
    Only the rungs still short of the end are passed. A rung the passes cannot finish gets
    the log-space convolution for its whole length (exact, slower)."""
    m, size = log_f.shape[0], log_f.shape[1]
    max_length = size - 1
    coef = np.full((m, size), np.nan)
    coef[:, : exact.shape[1]] = exact
    known = np.zeros((m, size), bool)
    known[:, : exact.shape[1]] = True
    stuck = np.zeros(m, bool)
    for _ in range(64):
        frontier = np.cumprod(known, axis=1).sum(axis=1) - 1
        todo = np.flatnonzero((frontier < max_length) & ~stuck)
        if todo.size == 0:
            break
        slope = coef[todo, frontier[todo]] - coef[todo, frontier[todo] - 1]
        passes = [_tilted_pass(log_f[rung], -tilt) for rung, tilt in
                  zip(todo, slope, strict=True)]
        value = np.stack([v for v, _ in passes])
        rel = np.stack([r for _, r in passes])
        fresh = (rel >= -PASS_FLOOR) & np.isfinite(value) & ~known[todo]
        coef[todo] = np.where(fresh, value, coef[todo])
        known[todo] |= fresh
        stuck[todo] = ~fresh.any(axis=1)
    left = np.flatnonzero(~known.all(axis=1))
    if left.size:
        coef[left] = _exact_coefficients(log_f[left])
    return coef


def length_log_partition(log_b: np.typing.ArrayLike, temperatures: np.typing.ArrayLike,
                         alpha: np.typing.ArrayLike, max_length: int) -> np.ndarray:
    r"""Exact :math:`\log C(T_m)` of a document of every length :math:`L = 0..`
    ``max_length``, (max_length + 1, M), given the topics' :math:`\log b_k(T_m)` (M, K).

    The multinomial expansion of the module docstring, in float64, :math:`O(K L_{\max}^2)`
    per temperature, by two routes: up to :data:`EXACT_LENGTH` words, K convolutions in log
    space (log-sum-exp, exact whatever the range of the terms); beyond, K direct
    convolutions in linear space of the sequences tilted by :math:`e^{n\rho}` (a few times
    cheaper: multiply-adds instead of exponentials), each pass continuing from the last
    length known with :math:`\rho` set to minus the log-coefficients' slope there, and
    keeping the lengths whose coefficient is a sum of terms of which none underflowed (every
    coefficient is a sum of positive terms, so no cancellation: exact to rounding).
    ``tests/test_lda_partition.py`` checks the second route against the first to 1e-9 up
    to 600 words. A rung whose passes stall (its coefficients' profile outruns the
    floating-point range) falls back to the log-space route for its whole length. Row 0 (the empty
    document) is 0, and so is every row at :math:`T = 1` when :math:`b_k(1) = 1`.

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
    max_length = int(max_length)
    log_f = _log_terms(log_b, inv_t, alpha, max_length + 1)
    head = _exact_coefficients(log_f[:, : min(max_length, EXACT_LENGTH) + 1])
    coef = _windowed_table(log_f, head) if max_length > EXACT_LENGTH else head
    return coef.T + _dirichlet_factor(inv_t, alpha, max_length + 1)


#: :func:`exact_temperature_posterior` enumerates at most this many assignments
MAX_ASSIGNMENTS = 10**6


def exact_temperature_posterior(topics: np.typing.ArrayLike, words: np.typing.ArrayLike,
                                temperatures: np.typing.ArrayLike,
                                log_weights: np.typing.ArrayLike,
                                alpha: np.typing.ArrayLike) -> np.ndarray:
    r"""The exact posterior of one document's temperature over the ladder, by enumeration
    (a reference for tiny problems, :math:`K^L \le` ``MAX_ASSIGNMENTS``):

    .. math::

        p(y = m\mid w, \beta) \propto \pi_m\,\frac{\sum_z \mathbb E_{\theta\sim\mathrm{Dir}
        (\alpha)}\big[\prod_n \theta_{z_n}^{1/T_m}\big]\prod_n \beta_{z_n w_n}^{1/T_m}}
        {C(T_m\mid\beta)},

    every assignment :math:`z` of the ``words`` (token ids, in any order) summed, the
    Dirichlet moments in closed form, :math:`C` from :func:`length_log_partition`
    (``topics`` (K, V) the topics :math:`\beta`, ``log_weights`` the ladder's
    :math:`\log\pi_m`). This is the multicanonical model's own posterior, against which
    eq. 18's variational :math:`q(y_d)` can be compared (docs/lda.md, "Short documents stay
    hot"). Returns the (M,) probabilities.

    Example:
        >>> beta = np.array([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7]])
        >>> uniform = np.full(3, -np.log(3.0))
        >>> post = exact_temperature_posterior(beta, [0, 0, 2], [1.0, 2.0, 4.0], uniform, 0.5)
        >>> post.shape, bool(abs(post.sum() - 1) < 1e-12)
        ((3,), True)
    """
    beta = np.asarray(topics, np.float64)
    words = np.asarray(words, int).reshape(-1)
    inv_t = _inverse_temperatures(temperatures)
    num_topics, length = beta.shape[0], words.size
    if num_topics**length > MAX_ASSIGNMENTS:
        raise ValueError(f"exact_temperature_posterior enumerates K^L = {num_topics}^{length} "
                         f"assignments, more than MAX_ASSIGNMENTS = {MAX_ASSIGNMENTS}.")
    alpha = _concentrations(alpha, num_topics)
    z = np.array(list(itertools.product(range(num_topics), repeat=length)), int)
    z = z.reshape(-1, length)  # (K^L, L); one empty assignment for L = 0
    counts = np.stack([np.bincount(a, minlength=num_topics) for a in z]).astype(float)
    log_lik = np.log(beta)[z, words[None, :]].sum(1)  # (K^L,)
    lgam = special.gammaln
    moments = (lgam(alpha.sum()) - lgam(alpha.sum() + length * inv_t)[:, None]
               + np.sum(lgam(alpha + counts[None] * inv_t[:, None, None]) - lgam(alpha), -1))
    log_b = topic_log_sums(beta, temperatures, expected=False)
    log_c = length_log_partition(log_b, temperatures, alpha, length)[length]
    log_post = (np.asarray(log_weights, np.float64)
                + special.logsumexp(moments + inv_t[:, None] * log_lik, axis=1) - log_c)
    return np.exp(log_post - special.logsumexp(log_post))


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
    log_b = fitted_topic_log_sums(lam, temperatures, topics)
    max_length = int(lengths.max()) if lengths.size else 0
    table = length_log_partition(log_b, temperatures, alpha, max_length)
    return table[lengths.astype(np.int64)]


# -- following the topics without recomputing every rung ----------------------------------------


class ExactTable(NamedTuple):
    r"""Per-rung tables and the topics they were computed at.

    ``table`` (L_max + 1, M): :math:`\log C(T_m)` for every length (rung m at
    ``log_b[m]``); ``log_b`` (M, K): the :math:`\log b_k(T_m)` each rung was computed at.
    Rungs may have been computed at different topics (:func:`exact_table` with ``rungs``).
    ``error`` (L_max + 1, M) or ``None`` (all 0): a bound on each entry's error at its own
    topics, 0 where computed exactly, a half-width where the rung was bracketed by
    convexity (:func:`convex_bracket`).
    """

    table: np.ndarray
    log_b: np.ndarray
    error: np.ndarray | None = None


def exact_table(log_b: np.typing.ArrayLike, temperatures: np.typing.ArrayLike,
                alpha: np.typing.ArrayLike, max_length: int, *,
                previous: ExactTable | None = None,
                rungs: np.typing.ArrayLike | None = None) -> ExactTable:
    r""":func:`length_log_partition` at ``log_b`` (M, K) for the ``rungs`` listed (default
    all), the other rungs kept from ``previous`` (as they were, at their own topics).

    Example:
        >>> temps = [1.0, 2.0, 4.0]
        >>> old = exact_table(np.zeros((3, 2)), temps, 0.5, 10)
        >>> new = exact_table(np.full((3, 2), 0.1), temps, 0.5, 10, previous=old, rungs=[2])
        >>> new.log_b[:, 0].tolist(), bool(np.allclose(new.table[:, :2], old.table[:, :2]))
        ([0.0, 0.0, 0.1], True)
    """
    log_b = np.asarray(log_b, np.float64)
    m = log_b.shape[0]
    rungs = np.arange(m) if rungs is None else np.asarray(rungs, np.int64).reshape(-1)
    temps = np.asarray(temperatures, np.float64)
    if previous is None:
        if rungs.size != m:
            raise ValueError("`rungs` needs a `previous` table to keep the other rungs from.")
        return ExactTable(length_log_partition(log_b, temps, alpha, max_length), log_b.copy())
    if previous.table.shape != (int(max_length) + 1, m) or previous.log_b.shape != log_b.shape:
        raise ValueError(f"`previous` has shapes {previous.table.shape}, "
                         f"{previous.log_b.shape}; expected {(int(max_length) + 1, m)}, "
                         f"{log_b.shape}.")
    table, kept = previous.table.copy(), previous.log_b.copy()
    error = None if previous.error is None else previous.error.copy()
    if rungs.size:
        table[:, rungs] = length_log_partition(log_b[rungs], temps[rungs], alpha, max_length)
        kept[rungs] = log_b[rungs]
        if error is not None:
            error[:, rungs] = 0.0
    return ExactTable(table, kept, error)


def stale_table(exact: ExactTable, log_b: np.typing.ArrayLike
                ) -> tuple[np.ndarray, np.ndarray]:
    r"""The table at new topics ``log_b`` (M, K) from an exact one at older topics, with
    an exact bound on its error: ``(table, bound)``, both (L_max + 1, M).

    :math:`C_L = \sum_{|n| = L} w(n)\prod_k b_k^{n_k}` with :math:`w(n) \ge 0` (module
    docstring), so moving every :math:`\log b_k` by :math:`\delta_k` moves :math:`\log C_L`
    by between :math:`L\min_k\delta_k` and :math:`L\max_k\delta_k`. The returned table adds
    the midpoint :math:`L(\max_k\delta_k + \min_k\delta_k)/2` to the exact one; its error is
    at most ``bound`` :math:`= L(\max_k\delta_k - \min_k\delta_k)/2` (0 where the topics
    did not move, and at T = 1 where :math:`b_k = 1` always), plus the table's own
    ``error`` where it has one.

    Example:
        >>> temps = [1.0, 3.0]
        >>> old = exact_table(np.zeros((2, 2)), temps, 0.5, 30)
        >>> new_b = np.array([[0.0, 0.0], [0.02, -0.01]])
        >>> table, bound = stale_table(old, new_b)
        >>> exact = length_log_partition(new_b, temps, 0.5, 30)
        >>> bool(np.all(np.abs(table - exact) <= bound + 1e-9)), round(float(bound[30, 1]), 6)
        (True, 0.45)
    """
    delta = np.asarray(log_b, np.float64) - exact.log_b
    if delta.shape != exact.log_b.shape:
        raise ValueError(f"`log_b` must have shape {exact.log_b.shape}, got {delta.shape}.")
    lengths = np.arange(exact.table.shape[0], dtype=np.float64)[:, None]
    hi, lo = np.max(delta, axis=1), np.min(delta, axis=1)
    bound = lengths * (hi - lo) / 2
    if exact.error is not None:
        bound = bound + exact.error
    return exact.table + lengths * (hi + lo) / 2, bound


# -- bracketing rungs between computed ones: log C is convex in 1/T ------------------------------


class TableEnds(NamedTuple):
    r"""What is known in closed form about :math:`f_L(h) = \log C_L(1/h)` at the ends of
    :math:`h \in [0, 1]`, per word (multiply by L): :math:`f_L(0) = L\,` ``value0``,
    :math:`f_L'(0) = L\,` ``slope0``, :math:`f_L(1) = 0` and :math:`f_L'(1) = L\,`
    ``slope1`` (:func:`table_ends`)."""

    value0: float
    slope0: float
    slope1: float


def table_ends(lam: np.typing.ArrayLike, alpha: np.typing.ArrayLike,
               topics: str = "mean") -> TableEnds:
    r"""The closed-form ends of :math:`f_L(h) = \log C_L(T = 1/h\mid\beta)` (module
    docstring) for topics :math:`q(\beta) = \mathrm{Dir}(\lambda)` taken as
    :func:`fitted_topic_log_sums` takes them.

    :math:`C_L(h) = \sum_{w, z}\int p(\theta)\prod_n(\theta_{z_n}\beta_{z_n w_n})^h
    d\theta` (with :math:`\mathbb E_q` over :math:`\beta` inside :math:`b_k` for
    ``"expected"``), so :math:`f_L'(h)` is the expected log joint under the tempered model:

    * :math:`h = 1` (the model itself): :math:`f = 0` and :math:`f'/L = \sum_k
      \frac{\alpha_k}{A}\big[\psi(\alpha_k + 1) - \psi(A + 1) + \sum_v
      \mathbb E\,\beta_{kv}\log\beta_{kv}\big]`;
    * :math:`h = 0` (words and topics uniform): :math:`f/L = \log(KV)` and
      :math:`f'/L = \frac1K\sum_k[\psi(\alpha_k) - \psi(A)] + \frac{1}{KV}\sum_{kv}
      \mathbb E\log\beta_{kv}`.

    Example:
        >>> lam = np.array([[2.0, 1.0, 1.0], [1.0, 1.0, 3.0]])
        >>> ends = table_ends(lam, 0.5)
        >>> h = 1 - 1e-5  # f'(1) against a finite difference of the exact table at L = 7
        >>> t = length_log_partition(fitted_topic_log_sums(lam, [1 / h], "mean"), [1 / h],
        ...                          0.5, 7)
        >>> bool(abs(-t[7, 0] / 1e-5 - 7 * ends.slope1) < 1e-3)
        True
    """
    lam = np.asarray(lam, np.float64)
    if lam.ndim != 2 or not np.all(np.isfinite(lam) & (lam > 0)):
        raise ValueError("`lam` must be a (K, V) array of finite Dirichlet parameters > 0.")
    num_topics, vocab = lam.shape
    a = _concentrations(alpha, num_topics)
    total = a.sum()
    row = lam.sum(axis=1, keepdims=True)
    if topics == "mean":
        log_beta = np.log(lam) - np.log(row)
        beta_log_beta = np.sum(np.exp(log_beta) * log_beta, axis=1)
        mean_log_beta = np.mean(log_beta)
    elif topics == "expected":
        beta_log_beta = np.sum(lam / row * (digamma(lam + 1.0) - digamma(row + 1.0)), axis=1)
        mean_log_beta = np.mean(digamma(lam) - digamma(row))
    else:
        raise ValueError(f"`topics` must be 'expected' or 'mean', got {topics!r}.")
    slope1 = np.sum(a / total * (digamma(a + 1.0) - digamma(total + 1.0) + beta_log_beta))
    slope0 = np.mean(digamma(a) - digamma(total)) + mean_log_beta
    return TableEnds(math.log(num_topics * vocab), float(slope0), float(slope1))


def convex_bracket(inv_t_known: np.typing.ArrayLike, known: np.typing.ArrayLike,
                   inv_t: np.typing.ArrayLike, ends: TableEnds) -> tuple[np.ndarray, np.ndarray]:
    r"""Bracket :math:`f_L(h) = \log C_L(T = 1/h)` at ``inv_t`` (a number, or (q,)) for
    every length from exact tables ``known`` (L + 1, n) at ``inv_t_known`` (n,) of the same
    topics: ``(midpoint, half_width)``, each (L + 1,) (or (L + 1, q)).

    :math:`C_L(h)` is a sum over words and topics of integrals of
    :math:`e^{h\log p(w, z\mid\theta,\beta)}` (:func:`table_ends`), so :math:`f_L` is
    convex in h (Hoelder). Between neighbouring knots (the tables, and h = 0 and 1 from
    :func:`table_ends`) the chord is above :math:`f_L`; the secants of the neighbouring
    intervals, extended, and the tangents at h = 0 and 1 are below it. The half-width
    includes the knots' float64 rounding (1e-9 relative), as each line amplifies it (a
    secant through two close knots, extended, amplifies it so much that it bounds nothing).
    Exact knots narrow it quadratically: near T = 1 :math:`f_L'' = \mathrm{Var}[\log p]`
    is of order L per word at :math:`\alpha = 1/K` and the bracket is wide; between hot
    rungs it is narrow.

    Example:
        >>> lam = np.array([[2.0, 1.0, 1.0], [1.0, 1.0, 3.0]])
        >>> temps = np.array([1.5, 2.0, 3.0])
        >>> b = fitted_topic_log_sums(lam, temps, "mean")
        >>> t = length_log_partition(b, temps, 0.5, 30)
        >>> mid, half = convex_bracket(1 / temps[[0, 2]], t[:, [0, 2]], 0.5, table_ends(lam, 0.5))
        >>> bool(np.all(np.abs(mid - t[:, 1]) <= half)), bool(half[30] < 0.5)
        (True, True)
    """
    known = np.asarray(known, np.float64)
    h_known = np.asarray(inv_t_known, np.float64).reshape(-1)
    if known.ndim != 2 or known.shape[1] != h_known.size:
        raise ValueError(f"`known` must be (L + 1, {h_known.size}), got {known.shape}.")
    ell = np.arange(known.shape[0], dtype=np.float64)[:, None]
    keep = (h_known > 0) & (h_known < 1)
    hs, first = np.unique(np.concatenate([[0.0], h_known[keep], [1.0]]), return_index=True)
    fs = np.concatenate([ell * ends.value0, known[:, keep], np.zeros_like(ell)], axis=1)
    fs = fs[:, first]
    # each knot's rounding error; a line through two knots, evaluated at q, carries it
    # times (|q - h_j| + |q - h_j+1|) / (h_j+1 - h_j): 1 on the chord, large when a secant
    # through close knots is extended (then that lower bound is dropped, not trusted)
    err = 1e-9 * (1.0 + np.max(np.abs(fs), axis=1, keepdims=True))
    h = np.asarray(inv_t, np.float64)
    q = h.reshape(-1)
    i = np.clip(np.searchsorted(hs, q, side="right") - 1, 0, hs.size - 2)

    def line(j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # knots j, j + 1, at q
        j = np.clip(j, 0, hs.size - 2)
        width = hs[j + 1] - hs[j]
        value = fs[:, j] + (fs[:, j + 1] - fs[:, j]) * (q - hs[j]) / width
        return value, err * (np.abs(q - hs[j]) + np.abs(q - hs[j + 1])) / width

    value, rounding = line(i)
    upper = value + rounding
    lower = np.maximum(ell * ends.slope1 * (q - 1.0), ell * (ends.value0 + ends.slope0 * q))
    lower = lower - err
    for j, valid in ((i - 1, i >= 1), (i + 1, i + 2 < hs.size)):
        value, rounding = line(j)
        lower = np.maximum(lower, np.where(valid, value - rounding, -np.inf))
    mid, half = (upper + lower) / 2, np.maximum((upper - lower) / 2, 0.0)
    shape = (known.shape[0],) + h.shape
    return mid.reshape(shape), half.reshape(shape)
