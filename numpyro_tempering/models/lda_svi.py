r"""Annealed and multicanonical stochastic VI for LDA: Algorithm 1 of Mandt et al. 2016.

LDA with topic assignments (Blei et al. 2003): topics :math:`\beta_k \sim \mathrm{Dir}(\eta)`,
proportions :math:`\theta_d \sim \mathrm{Dir}(\alpha)`, assignments
:math:`z_{dn} \sim \mathrm{Cat}(\theta_d)`, words :math:`w_{dn} \sim \mathrm{Cat}(\beta_{z_{dn}})`.
Mean-field :math:`q(\beta_k) = \mathrm{Dir}(\lambda_k)`, :math:`q(\theta_d) =
\mathrm{Dir}(\gamma_d)`, :math:`q(z_{dn}) = \mathrm{Cat}(\phi_{dn})`. The tempered model
raises the local likelihood :math:`p(w_d, z_d \mid \theta_d, \beta)` to :math:`1/T` and keeps
the priors (Mandt et al. 2016, eq. 4). Its coordinate updates (Mandt et al. 2016,
supplement eq. 9, words grouped by vocabulary index v with counts :math:`n_{dv}`):

.. math::

    \phi_{dvk} \propto \exp\Big\{\tfrac1T\big(\mathbb E[\log\theta_{dk}]
        + \mathbb E[\log\beta_{kv}]\big)\Big\}, \qquad
    \gamma_{dk} = \alpha + \tfrac1T \textstyle\sum_v n_{dv}\phi_{dvk},

and the stochastic natural-gradient step on the topics from a minibatch B of documents
(Mandt et al. 2016, eq. 15-16, Algorithm 1; Hoffman et al. 2010):

.. math::

    \hat\lambda_{kv} = \eta + \frac{D}{|B|}\,\frac1T \sum_{d \in B} n_{dv}\phi_{dvk}, \qquad
    \lambda \leftarrow (1 - \rho_t)\lambda + \rho_t\hat\lambda, \qquad
    \rho_t = (\tau + t)^{-\kappa},

with t = 1 at the first update. The paper's :math:`\tau = 1024, \kappa = 0.7`
(:data:`PAPER`) and scikit-learn's :math:`\tau = 10, \kappa = 0.7` (:data:`SKLEARN`) are both
offered. **At T = 1 this is online variational Bayes** (Hoffman et al. 2010), step for step
the algorithm of scikit-learn's ``LatentDirichletAllocation(learning_method="online")``:
the same random initialisation law (:math:`\mathrm{Gamma}(100, 0.01)` for
:math:`\lambda` and each minibatch's :math:`\gamma`), the same per-document fixed-point
iteration and stopping rule (at most ``max_doc_iter`` sweeps, until the mean absolute change of
:math:`\gamma_d` is below ``tol``), the same :math:`D/|B|` with the actual size of a short
last batch. So a comparison with it isolates tempering. One difference: scikit-learn adds
float64's ``eps`` to the normaliser of :math:`\phi`; here each word's factors
:math:`e^{\mathbb E\log\beta_{kv}/T}` and each document's :math:`e^{\mathbb
E\log\theta_k/T}` are divided by their largest (which leaves :math:`\phi` unchanged) and
the normaliser is only guarded against 0/0: in float32 an absolute ``eps`` swallowed the
statistics of words rare under every topic, and at T < 1 those of every word (T = 0.2: the
fit never moved from its initialisation).

Temperatures
------------
* a number or a schedule ``step -> T`` (:mod:`numpyro_tempering.schedules`; ``step`` counts
  updates from 0): annealed VI (AVI), plain SVI at T = 1;
* a :class:`Multicanonical` ladder: multicanonical VI (MVI) with a *local* temperature per
  document: :math:`q(y_d) = \mathrm{Mult}(r_d)` over the ladder, updated inside the
  document's coordinate ascent by Mandt et al. 2016, eq. 18, per document,

  .. math::

      r_{dm} \propto \exp\Big\{\tfrac{1}{T_m}\,\ell_d - \log C_d(T_m) + \log\pi_m\Big\},
      \qquad \ell_d = \textstyle\sum_{v,k} n_{dv}\phi_{dvk}
          \big(\mathbb E[\log\theta_{dk}] + \mathbb E[\log\beta_{kv}]\big),

  and :math:`1/T` replaced by :math:`\mathbb E_{q(y_d)}[1/T_y] = \sum_m r_{dm}/T_m` in that
  document's local updates and its share of :math:`\hat\lambda` (supplement eq. 9).
  :math:`\log C_d(T)` is the document's tempered normaliser: see
  :func:`document_log_partition`.

Data are documents as padded ``(index, count)`` arrays (:class:`~numpyro_tempering.models.
corpora.Corpus`), never a dense ``D x V`` matrix; for the fit they are cut into rows of
``row_width`` distinct words (a long document spans several rows). One minibatch update is
one compiled function (compiled once per process for given settings and shapes; the
temperature is an argument) vectorised over the documents of the minibatch: all documents
iterate together, a converged document stops changing while the others go on (exactly as
scikit-learn's per-document loop), and the still-active documents are compacted into
smaller buffers as they thin out.

Evaluation: :func:`heldout_log_likelihood` (document completion, Mandt et al. 2016,
section 4; Hoffman et al. 2010) scores any topic matrix -- ours, scikit-learn's
``components_``, gensim's ``state.get_lambda()`` -- by one and the same procedure.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from scipy.special import logsumexp

from numpyro_tempering import schedules
from numpyro_tempering.models import lda_partition
from numpyro_tempering.models.corpora import Corpus
from numpyro_tempering.temperatures import posterior_from_arrays

__all__ = [
    "PAPER",
    "SKLEARN",
    "FitResult",
    "LDAConfig",
    "Multicanonical",
    "OnlineLDAState",
    "LENGTH_BINS",
    "RISK_WINDOW",
    "PROBE_EVERY",
    "StepInfo",
    "digamma_positive",
    "document_log_partition",
    "expected_log_dirichlet",
    "expected_log_topics",
    "fit",
    "heldout_log_likelihood",
    "init_state",
    "initial_gamma",
    "learning_rate",
    "local_step",
    "as_mesh",
    "update",
]

#: The paper's step sizes and minibatch (Mandt et al. 2016, "Hyperparameters and schedules").
PAPER = {"tau": 1024.0, "kappa": 0.7, "batch_size": 100}
#: scikit-learn's defaults (``learning_offset=10``, ``learning_decay=0.7``, ``batch_size=128``).
SKLEARN = {"tau": 10.0, "kappa": 0.7, "batch_size": 128}


class LDAConfig(NamedTuple):
    """Static settings of one fit (hashable: the compiled update is specialised to them).

    ``num_docs`` is D, the corpus size the minibatch statistics are scaled to; ``alpha``
    and ``eta`` are the Dirichlet concentrations (the paper's 1/K by default in
    :func:`config`); ``tau``, ``kappa`` the Robbins-Monro step sizes; ``max_doc_iter`` and
    ``tol`` the per-document stopping rule; ``mvi_topics`` the topics the multicanonical
    temperature posterior conditions on (:class:`Multicanonical`, set by :func:`fit`);
    ``stage_shrink`` how much the buffers of the per-document loop shrink from one stage to
    the next (documents divided by it, rows halved: see :func:`_stage_sizes`; it changes
    the cost of a minibatch, never its result).
    """

    num_topics: int
    vocab_size: int
    num_docs: int
    alpha: float
    eta: float
    tau: float = PAPER["tau"]
    kappa: float = PAPER["kappa"]
    max_doc_iter: int = 100
    tol: float = 1e-3
    mvi_topics: str = "mean"
    stage_shrink: int = 2


def config(
    num_topics: int,
    vocab_size: int,
    num_docs: int,
    *,
    alpha: float | None = None,
    eta: float | None = None,
    tau: float = PAPER["tau"],
    kappa: float = PAPER["kappa"],
    max_doc_iter: int = 100,
    tol: float = 1e-3,
) -> LDAConfig:
    """A validated :class:`LDAConfig` (alpha = eta = 1/K unless given).

    Example:
        >>> config(4, 100, 1000).alpha
        0.25
        >>> config(4, 100, 1000, kappa=0.4)
        Traceback (most recent call last):
        ...
        ValueError: `kappa` must be in (0.5, 1] (Robbins-Monro), got 0.4.
    """
    for name, value in (("num_topics", num_topics), ("vocab_size", vocab_size),
                        ("num_docs", num_docs), ("max_doc_iter", max_doc_iter)):
        if int(value) != value or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    for name, value in (("alpha", alpha), ("eta", eta)):
        if value is not None and np.ndim(value) != 0:
            raise ValueError(f"`{name}` must be one number (a symmetric Dirichlet; the online "
                             f"updates take no per-topic concentration), got shape "
                             f"{np.shape(value)}.")
    alpha = 1.0 / num_topics if alpha is None else float(alpha)
    eta = 1.0 / num_topics if eta is None else float(eta)
    for name, value in (("alpha", alpha), ("eta", eta)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"`{name}` must be a finite concentration > 0, got {value!r}.")
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"`tau` must be finite and >= 0, got {tau!r}.")
    if not 0.5 < kappa <= 1.0:
        raise ValueError(f"`kappa` must be in (0.5, 1] (Robbins-Monro), got {kappa!r}.")
    if not (math.isfinite(tol) and tol >= 0):
        raise ValueError(f"`tol` must be finite and >= 0, got {tol!r}.")
    return LDAConfig(int(num_topics), int(vocab_size), int(num_docs), alpha, eta,
                     float(tau), float(kappa), int(max_doc_iter), float(tol))


class OnlineLDAState(NamedTuple):
    """``lam``: the topics' Dirichlet parameters :math:`\\lambda` (K, V) (scikit-learn's
    ``components_``); ``step``: updates done so far."""

    lam: jax.Array
    step: jax.Array


class Multicanonical(NamedTuple):
    r"""A temperature ladder for MVI: a temperature per document (Mandt et al. 2016, eq. 18).

    ``temperatures`` (M,) with ``T_1 = 1``; ``log_weights`` :math:`\log\pi_m` (M,)
    (every minibatch's :math:`q(y_d)` starts at :math:`\pi`).

    ``log_c_per_length``: ``None`` (the default) uses the exact per-document normaliser
    conditional on the current topics, :math:`\log C_d(T_m\mid\beta)`
    (:func:`numpyro_tempering.models.lda_partition.conditional_log_partition`: the
    normaliser that makes a model with a temperature per document proper), recomputed from
    :math:`\lambda` before the first update (exact on every
    :data:`COARSE_STRIDE`-th rung, the others bracketed by convexity and refined as the
    first minibatch needs, below) and then whenever the step sizes summed since
    the last computation reach ``refresh`` (:math:`\lambda` has moved by about that
    fraction; 0 recomputes before every update); its cost is reported apart as
    ``FitResult.log_c_seconds``. At a refresh only the rungs where it matters are
    recomputed (``tolerance``, below); the others keep their exact table, shifted by the
    midpoint of an exact bracket (the narrower of a convexity bracket between the rungs
    computed at the current topics,
    :func:`~numpyro_tempering.models.lda_partition.convex_bracket`, and
    :func:`~numpyro_tempering.models.lda_partition.stale_table`:
    moving the topics' :math:`\log b_k(T_m)` by :math:`\delta_k` moves :math:`\log C_L`
    by between :math:`L\min_k\delta_k` and :math:`L\max_k\delta_k`), whose half-width
    :math:`e_m(L)` bounds its error for a document of L words. A callable
    ``lengths -> (n, M)`` fixes :math:`\log C_d` for the whole fit instead (e.g. the
    supplement's prior Monte Carlo, :func:`document_log_partition`, kept for comparison:
    biased low for long documents).

    ``topics``: which topics the temperature posterior conditions on. ``"mean"`` (default):
    the posterior mean :math:`\bar\beta = \lambda/\sum_v\lambda`, in both the
    documents' bounds and :math:`C_d(T\mid\bar\beta)` -- eq. 18 for the model given the
    current topics. ``"expected"``: the M-ELBO's expectation over :math:`q(\beta)` in both
    (:math:`\mathbb E_q\log\beta` and :math:`\mathbb E_q[b_k(T)]`); then :math:`q(\beta)`'s
    own uncertainty, a Jensen gap :math:`\log\mathbb E\beta - \mathbb E\log\beta` per word
    that eq. 18 divides by :math:`T_m`, favours hot rungs for as long as the topics are
    uncertain, and tempered updates keep them uncertain: on small corpora MVI then stays hot
    (docs/lda.md, "Why MVI heated up").

    ``tolerance``: the share of a minibatch's topic statistics that the stale rungs may
    move. A document's statistics are :math:`S_d = \sum_m q(y_d = m) h_m
    n\phi^{(j(m))}` (:func:`local_step`; rung m served by anchor :math:`j(m)`), of total
    at most :math:`L_d`. An error :math:`\epsilon_m`, :math:`|\epsilon_m| \le e_m`, in
    rung m's :math:`\log C_d` changes them by exactly :math:`q(y_d = m)\,c\,(h_m
    n\phi^{(j(m))} - S_d)` with :math:`|c| \le e^{e_m} - 1`, i.e. by at most
    :math:`q(y_d = m)(e^{e_m} - 1) w_{dm} L_d` in total, with :math:`w_{dm} = |h_m -
    H_{d,j(m)}| + \sum_{j \ne j(m)} H_{dj}` and :math:`H_{dj}` the :math:`q(y_d)`-weighted
    :math:`h` of the rungs anchor j serves: mass moving between neighbouring rungs of one
    anchor barely moves the statistics. So rung m moves at most :math:`a_m = \sum_d q(y_d =
    m)(e^{e_m(L_d)} - 1) w_{dm} L_d` of the :math:`\sum_d L_d` words. At a refresh the rungs
    with the smallest :math:`a_m` stay stale as long as their sum stays below ``tolerance``
    times the words (:math:`a_m` and the words averaged over the latest
    :data:`RISK_WINDOW` updates since the last computation: minibatches are drawn at random,
    so these estimate the next ones' under the current topics; an update under older topics,
    e.g. the first, hot one under random topics, says little about them; :math:`L_d`
    rounded up to :math:`2^{b+1} - 1`, :attr:`StepInfo.log_rung_words`); the others are
    recomputed. A rung no document uses
    (the hot ones, once the fit has cooled) waits until its bracket is wide enough to
    matter; all of it in log space, so that a rung whose :math:`q(y_d = m)` is
    :math:`e^{-5000}` (below any float) with a bracket of :math:`e^{1000}` is known to be
    safe, not recomputed for an overflow; 0 recomputes every rung at every refresh.
    ``FitResult.log_c_rungs`` counts the rung computations.

    ``anchors``: the number of rungs each document is fitted at (:func:`local_step`):
    evenly spaced along the ladder, T = 1 and the hottest included; the cost of the local
    step grows with it. Once the fit has cooled the hot anchors serve (almost) nothing: an
    update that fits every anchor (a *probe*: the first, then every
    :data:`PROBE_EVERY`-th) measures the share of the minibatch's :math:`q(y_d)` that the
    anchors other than T = 1 serve (:attr:`StepInfo.hot_share`), and while the latest probe
    found it below ``tolerance`` the updates in between fit the T = 1 anchor alone (every
    rung then takes its tangent). That moves at most about ``tolerance`` of the topic
    statistics, as the stale rungs above may, and costs one local fit instead of
    ``anchors``; ``tolerance = 0`` fits every anchor at every update.

    :meth:`paper` gives the paper's ladder: 100 temperatures from 1 to 10 on a geometric
    scale, uniform prior and uniform initial :math:`q(y_d)` (Mandt et al. 2016, section 4).

    Example:
        >>> mc = Multicanonical.paper()
        >>> mc.temperatures.shape, float(mc.temperatures[-1]), mc.topics
        ((100,), 10.0, 'mean')
        >>> mc.anchor_temperatures().round(2).tolist()
        [1.0, 2.15, 4.64, 10.0]
    """

    temperatures: np.ndarray
    log_weights: np.ndarray
    log_c_per_length: Callable[[np.ndarray], np.ndarray] | None = None
    refresh: float = 0.25
    anchors: int = 4
    topics: str = "mean"
    tolerance: float = 0.01

    def anchor_temperatures(self) -> np.ndarray:
        """The ``anchors`` rungs each document is fitted at (:func:`local_step`): evenly
        spaced in the ladder's order, the first (T = 1) and the last always included."""
        temps = np.asarray(self.temperatures, np.float64)
        if int(self.anchors) != self.anchors or self.anchors < 1:
            raise ValueError(f"`anchors` must be a positive integer, got {self.anchors!r}.")
        if (temps.ndim != 1 or temps.size == 0 or temps[0] != 1.0
                or not np.all(np.isfinite(temps)) or np.any(np.diff(temps) <= 0)):
            raise ValueError(f"`temperatures` must be a 1-D ladder starting at T = 1 and "
                             f"strictly increasing (finite), got {self.temperatures!r}.")
        log_w = np.asarray(self.log_weights, np.float64)
        if log_w.shape != temps.shape:
            raise ValueError(f"`log_weights` must be the {temps.size} log prior weights of the "
                             f"rungs, got shape {log_w.shape}.")
        total = np.logaddexp.reduce(log_w)  # (the ladder is not empty: checked above)
        if np.any(np.isnan(log_w)) or np.any(log_w == np.inf) or not abs(total) <= 1e-5:
            raise ValueError(f"`log_weights` must be the logs of prior weights of the rungs "
                             f"(finite or -inf, their exponentials summing to 1), got "
                             f"{log_w.tolist()} (log of the sum {total:.6g}).")
        idx = np.unique(np.round(np.linspace(0, temps.size - 1, int(self.anchors))).astype(int))
        return temps[idx]

    @classmethod
    def paper(cls, num_temperatures: int = 100, max_temperature: float = 10.0, *,
              refresh: float = 0.25, tolerance: float = 0.01) -> Multicanonical:
        r"""The paper's ladder: geometric temperatures 1..``max_temperature``, uniform
        :math:`\pi`, the conditional exact :math:`\log C_d` (Mandt et al. 2016, section 4)."""
        if int(num_temperatures) != num_temperatures or num_temperatures < 1:
            raise ValueError(f"`num_temperatures` must be a positive integer, got "
                             f"{num_temperatures!r}.")
        if not (math.isfinite(max_temperature) and max_temperature >= 1.0):
            raise ValueError(f"`max_temperature` must be finite and >= 1, got "
                             f"{max_temperature!r}.")
        if num_temperatures > 1 and max_temperature == 1.0:
            raise ValueError(f"`max_temperature` must be > 1 for a ladder of "
                             f"{num_temperatures} temperatures (they would all be T = 1).")
        temps = np.geomspace(1.0, max_temperature, int(num_temperatures))
        return cls(temps, np.full(temps.size, -math.log(temps.size)), None, refresh,
                   tolerance=tolerance)


#: documents are grouped by length in powers of 2 for the normaliser's refresh rule
LENGTH_BINS = 24
#: the refresh rule averages the words at risk over at most this many latest updates (since
#: the last computation)
RISK_WINDOW = 4
#: while the hot anchors serve less than ``Multicanonical.tolerance``, every this-many-th
#: update still fits them (a probe), so that a fit that heats up again is seen
PROBE_EVERY = 8


def _length_bin(length):
    """Row of :attr:`StepInfo.log_rung_words` for documents of ``length`` words."""
    return jnp.clip(jnp.floor(jnp.log2(length + 1.0)), 0, LENGTH_BINS - 1).astype(jnp.int32)


class StepInfo(NamedTuple):
    """Per-update record: the step size ``rho``; ``temperature``: T (AVI) or the mean over
    the minibatch's documents with words of :math:`\\mathbb E_{q(y_d)}[T]` (MVI: an empty
    document's :math:`q(y_d)` is the ladder's prior and moves nothing; NaN if the minibatch
    has no words); ``iterations``: mean local sweeps per document (MVI: summed over its
    anchor fits); ``hot_share``: the mean over the minibatch's documents with words of the
    :math:`q(y_d)` mass on rungs served by anchors other than T = 1 (MVI; 0 when only the
    T = 1 anchor was fitted, or not MVI); ``log_rung_words``
    (:data:`LENGTH_BINS`, M): :math:`\\log\\sum_d q(y_d = m) w_{dm} L_d` (the
    refresh rule's :math:`w_{dm}`, :class:`Multicanonical`) over the minibatch's
    documents of length :math:`2^b \\le L_d + 1 < 2^{b+1}` in row b (the last row also
    every longer one; :math:`-\\infty` for an empty bin), computed in log space so that a
    rung's share below the float range is kept; M = 0 unless MVI."""

    rho: jax.Array
    temperature: jax.Array
    iterations: jax.Array
    log_rung_words: jax.Array
    hot_share: jax.Array


class LocalResult(NamedTuple):
    gamma: jax.Array  # (B, K)
    sstats: jax.Array  # (R, W, K): n_dv phi_dvk E[1/T_d] per row of words
    inv_temperature: jax.Array  # (B,)
    iterations: jax.Array  # (B,)
    q_y: jax.Array | None  # (B, M) for MVI
    log_q_y: jax.Array | None = None  # (B, M) for MVI: log q(y_d = m), below float range too
    hot_mass: jax.Array | None = None  # (B,) for MVI: q(y_d) mass served by the hot anchors
    moves: jax.Array | None = None  # (B, M) for MVI: w_dm of the refresh rule


# -- building blocks ---------------------------------------------------------------------------


def digamma_positive(x: jax.typing.ArrayLike) -> jax.Array:
    r"""The digamma function :math:`\psi(x)` for :math:`x > 0`: fewer operations than
    ``jax.scipy.special.digamma`` (which also handles negative arguments); it is evaluated
    on every topic-word parameter at every update.

    Recurrence :math:`\psi(x) = \psi(x + 6) - \sum_{i<6} 1/(x+i)`, then the asymptotic
    series of :math:`\psi(y)`, :math:`y \ge 6`, to the :math:`y^{-12}` term (error below
    :math:`10^{-11}` times :math:`\max(1, |\psi(x)|)` in float64).

    Example:
        >>> round(float(digamma_positive(1.0)), 5)  # minus Euler's constant
        -0.57722
    """
    x = jnp.asarray(x)
    shift = sum(1.0 / (x + i) for i in range(6))
    y = x + 6.0
    y2 = 1.0 / (y * y)
    series = y2 * (1 / 12 - y2 * (1 / 120 - y2 * (1 / 252 - y2 * (
        1 / 240 - y2 * (1 / 132 - y2 * (691 / 32760))))))
    return jnp.log(y) - 0.5 / y - series - shift


def expected_log_dirichlet(conc: jax.typing.ArrayLike) -> jax.Array:
    r""":math:`\mathbb E[\log x_k] = \psi(c_k) - \psi(\sum_j c_j)` for
    :math:`x \sim \mathrm{Dir}(c)`, along the last axis (:func:`digamma_positive`).

    Example:
        >>> round(float(expected_log_dirichlet(jnp.array([1.0, 1.0]))[0]), 4)  # psi(1)-psi(2)
        -1.0
    """
    conc = jnp.asarray(conc)
    return digamma_positive(conc) - digamma_positive(jnp.sum(conc, axis=-1, keepdims=True))


def expected_log_topics(lam: jax.typing.ArrayLike) -> jax.Array:
    r""":func:`expected_log_dirichlet` of the (K, V) topics, one topic at a time
    (``lax.map``). The loop's result is materialised, and the local step gathers its rows
    from it: from the one-line formula XLA fuses the digammas into that gather and evaluates
    them once per row entry, not once per topic and word (that fusion took about 10 ms of
    a 15 ms update on 1,300-word documents at K = 10: docs/reproductions.md, issue 22,
    item 3).

    Example:
        >>> lam = jnp.array([[1.0, 1.0], [2.0, 6.0]])
        >>> bool(jnp.allclose(expected_log_topics(lam), expected_log_dirichlet(lam)))
        True
    """
    return jax.lax.map(expected_log_dirichlet, jnp.asarray(lam))


def learning_rate(step: jax.typing.ArrayLike, tau: float, kappa: float) -> jax.Array:
    r"""Robbins-Monro :math:`\rho_t = (\tau + t)^{-\kappa}` at update ``t = step + 1``
    (Mandt et al. 2016, section 4; Hoffman et al. 2010; scikit-learn's ``n_batch_iter_``).

    Example:
        >>> round(float(learning_rate(0, 1024.0, 0.7)), 6)  # 1025 ** -0.7
        0.007807
    """
    t = jnp.asarray(step) + 1
    return jnp.power(tau + t, -kappa)


def _rng(seed: int | np.random.Generator) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def init_state(
    seed: int | np.random.Generator, num_topics: int, vocab_size: int, dtype: Any = None
) -> OnlineLDAState:
    r"""Random topics :math:`\lambda_{kv} \sim \mathrm{Gamma}(100, 0.01)` (Hoffman et al.
    2010; scikit-learn's initialisation), drawn on the host with NumPy.

    Example:
        >>> s = init_state(0, 3, 5)
        >>> s.lam.shape, int(s.step)
        ((3, 5), 0)
    """
    dtype = jnp.result_type(float) if dtype is None else dtype
    lam = _rng(seed).gamma(100.0, 0.01, (num_topics, vocab_size))
    return OnlineLDAState(jnp.asarray(lam, dtype), jnp.zeros((), jnp.int32))


def initial_gamma(
    seed: int | np.random.Generator, batch_size: int, num_topics: int
) -> np.ndarray:
    """A minibatch's random initial :math:`\\gamma`, Gamma(100, 0.01) per entry (scikit-learn
    draws these anew for every minibatch)."""
    return _rng(seed).gamma(100.0, 0.01, (batch_size, num_topics))


def _gather(elog_beta: jax.Array, ids: jax.Array) -> jax.Array:
    """``E[log beta]`` (K, V) at the rows' word ids (R, W) -> (R, K, W), topics before words:
    in this layout XLA's CPU code for the local step's contractions over K is several times
    faster at small K than in (R, W, K) (docs/reproductions.md, issue 22, item 3)."""
    return jnp.moveaxis(jnp.take(elog_beta, ids, axis=1), 0, 1)


def _stage_sizes(batch: int, rows: int, min_size: int = 8,
                 shrink: int = 2) -> list[tuple[int, int]]:
    """(documents, rows) buffer sizes of :func:`_fixed_point`: documents divided by
    ``shrink`` and rows halved per stage while above ``2 * min_size`` documents.

    A stage's buffer keeps iterating every document in it (converged ones frozen) until the
    active ones fit the next stage's, so the row-sweeps computed exceed those the documents
    need; each stage is one more compiled loop. On NewsArticles (K = 50, minibatches of 100
    documents, sweeps per document from 12 to 100) ``shrink=4`` (3 stages) computes 1.45x
    the row-sweeps needed, ``shrink=2`` (4 stages) 1.23x.

    Example:
        >>> _stage_sizes(100, 320)
        [(100, 320), (50, 160), (25, 80), (13, 40)]
    """
    sizes = [(batch, rows)]
    while sizes[-1][0] > 2 * min_size:
        b, r = sizes[-1]
        sizes.append((max(-(-b // shrink), min_size), max(-(-r // 2), 1)))
    return sizes


def _set_rows(idx, full, rows):
    return full.at[idx].set(rows)


def _take_rows(sel, x):
    return x[sel]


def _per_row(x, row_doc):
    """``x[row_doc]`` for (docs, ...) arrays; rows of the dummy document (index >= docs,
    padding) get zeros."""
    return jnp.take(x, row_doc, axis=0, mode="fill", fill_value=0)


def _fixed_point(sweep, carry, doc_data, row_data, row_doc, max_iter: int, tol: float,
                 shrink: int = 2):
    """Run ``carry <- sweep(carry, doc_data, row_data, row_doc)`` until each document's change
    is below ``tol`` (then it is frozen), at most ``max_iter`` sweeps -- scikit-learn's
    per-document loop, vectorised over a minibatch.

    A document's words are ``row_data`` rows (padded ``(index, count)`` rows of a fixed
    width), ``row_doc`` giving the document of each row (>= B: padding). All documents start
    together; once the active documents (and their rows) fit the next stage's buffers
    (:func:`_stage_sizes`: half the documents and half the rows with the default
    ``shrink=2``), those are compacted into them, so that a few slow documents do not
    keep the whole minibatch iterating. Every document gets exactly the sweeps it would get
    alone. Returns the final carry and the sweeps per document.
    """
    batch = jax.tree.leaves(carry)[0].shape[0]
    sizes = _stage_sizes(batch, row_doc.shape[0], shrink=shrink)
    full, iters = carry, jnp.zeros((batch,), jnp.int32)
    idx = jnp.arange(batch)
    active, buf_iters = jnp.ones((batch,), bool), iters
    it = jnp.zeros((), jnp.int32)
    for stage in range(len(sizes)):
        nxt_b, nxt_r = sizes[stage + 1] if stage + 1 < len(sizes) else (0, 0)

        def cond(c, row_doc=row_doc, nxt_b=nxt_b, nxt_r=nxt_r):
            it, _, act, _ = c
            rows_active = jnp.sum(_per_row(act, row_doc))
            fits = (jnp.sum(act) <= nxt_b) & (rows_active <= nxt_r)
            return (it < max_iter) & ~fits

        def body(c, doc_data=doc_data, row_data=row_data, row_doc=row_doc):
            it, b, act, n = c
            new, change = sweep(b, doc_data, row_data, row_doc)
            b = jax.tree.map(
                lambda x, y: jnp.where(act.reshape((-1,) + (1,) * (x.ndim - 1)), y, x), b, new
            )
            n = jnp.where(act, it + 1, n)
            return it + 1, b, act & (change >= tol), n

        it, carry, active, buf_iters = lax.while_loop(cond, body,
                                                      (it, carry, active, buf_iters))
        full = jax.tree.map(partial(_set_rows, idx), full, carry)
        iters = iters.at[idx].set(buf_iters)
        if nxt_b:
            size = active.shape[0]
            sel = jnp.argsort(~active, stable=True)[:nxt_b]  # the active documents first
            new_pos = jnp.full((size + 1,), nxt_b, jnp.int32).at[sel].set(
                jnp.arange(nxt_b, dtype=jnp.int32))
            row_active = _per_row(active, row_doc)
            row_sel = jnp.argsort(~row_active, stable=True)[:nxt_r]
            row_doc = new_pos[jnp.minimum(row_doc[row_sel], size)]
            row_data = jax.tree.map(partial(_take_rows, row_sel), row_data)
            idx, active, buf_iters = idx[sel], active[sel], buf_iters[sel]
            carry = jax.tree.map(partial(_take_rows, sel), carry)
            doc_data = jax.tree.map(partial(_take_rows, sel), doc_data)
    return full, iters


def _scaled_exp(inv_t, elog_theta):
    """exp(E[log theta_dk] / T_d) over its largest entry per document (B, K): the local
    step's ratios are unchanged and the largest factor is 1 (no underflow at T < 1)."""
    return jnp.exp(inv_t[:, None] * (elog_theta - jnp.max(elog_theta, axis=1, keepdims=True)))


def _fixed_sweep(alpha, eps):
    """One tempered sweep at fixed per-document 1/T (supplement eq. 9), scikit-learn's
    arithmetic: ``phi`` is never formed, only its normaliser."""

    def sweep(gamma, inv_t, rows, row_doc):
        ew, cnt = rows  # (R, K, W) exp(E[log beta] / T_d), scaled (:func:`_tempered_fit`), (R, W)
        et = _scaled_exp(inv_t, expected_log_dirichlet(gamma))  # (B, K)
        norm = jnp.einsum("rkw,rk->rw", ew, _per_row(et, row_doc)) + eps
        per_row = jnp.einsum("rkw,rw->rk", ew, cnt / norm)
        new = alpha + inv_t[:, None] * et * jax.ops.segment_sum(per_row, row_doc, et.shape[0])
        return new, jnp.mean(jnp.abs(new - gamma), axis=-1)

    return sweep


def _tempered_fit(cfg, elog_w, counts, gamma0, inv_t, row_doc):
    """Local fixed point at a fixed 1/T per document (``inv_t`` (B,)): scikit-learn's
    arithmetic. Returns gamma, the rows' n phi / T statistics and the sweeps."""
    dtype = elog_w.dtype
    inv_t_rows = _per_row(inv_t, row_doc)
    # exp(E[log beta] / T_d) (R, K, W), each word's column over the topics divided by its
    # largest entry, as exp(E[log theta] / T_d) over its largest (_scaled_exp): phi is
    # unchanged, and the normaliser's eps only guards 0 / 0. Unscaled, at T < 1 (or for a
    # word rare under every topic) the whole normaliser fell below float32's eps, which then
    # swallowed the statistics (T = 0.2: none of a document's words counted)
    ew = jnp.exp(inv_t_rows[:, None, None] * (elog_w - jnp.max(elog_w, axis=1, keepdims=True)))
    eps = jnp.finfo(dtype).tiny
    alpha = jnp.asarray(cfg.alpha, dtype)
    gamma, iters = _fixed_point(_fixed_sweep(alpha, eps), gamma0, inv_t, (ew, counts),
                                row_doc, cfg.max_doc_iter, cfg.tol, cfg.stage_shrink)
    et = _per_row(_scaled_exp(inv_t, expected_log_dirichlet(gamma)), row_doc)
    norm = jnp.einsum("rkw,rk->rw", ew, et) + eps
    sstats = inv_t_rows[:, None, None] * (counts / norm)[:, None, :] * ew * et[:, :, None]
    return gamma, sstats, iters


def _local_bound(cfg, elog_w, counts, gamma, inv_t, row_doc):
    r"""Per document, at its own fixed :math:`h = 1/T` and fitted :math:`q(\theta) =
    \mathrm{Dir}(\gamma)` with the optimal :math:`q(z)`: the tempered local bound
    :math:`B = \mathbb E\log p(\theta) - \mathbb E\log q(\theta) + \sum_v n_v
    \log\sum_k e^{h(\mathbb E\log\theta_k + \mathbb E\log\beta_{kv})}` and its slope in
    :math:`h`, :math:`\ell = \mathbb E_q[\log p(w, z\mid\theta,\beta)]`."""
    num = gamma.shape[0]
    k = gamma.shape[1]
    elog_theta = expected_log_dirichlet(gamma)
    logits = elog_w + _per_row(elog_theta, row_doc)[:, :, None]  # (R, K, W)
    scaled = _per_row(inv_t, row_doc)[:, None, None] * logits
    phi = jax.nn.softmax(scaled, axis=1)
    free = jax.ops.segment_sum(jnp.sum(counts * jax.nn.logsumexp(scaled, axis=1), axis=1),
                               row_doc, num)
    ell = jax.ops.segment_sum(jnp.einsum("rw,rkw->r", counts, phi * logits), row_doc, num)
    alpha = jnp.asarray(cfg.alpha, gamma.dtype)
    log_p = (jax.scipy.special.gammaln(k * alpha) - k * jax.scipy.special.gammaln(alpha)
             + (alpha - 1) * jnp.sum(elog_theta, axis=1))
    log_q = (jax.scipy.special.gammaln(jnp.sum(gamma, axis=1))
             - jnp.sum(jax.scipy.special.gammaln(gamma), axis=1)
             + jnp.sum((gamma - 1) * elog_theta, axis=1))
    return free + log_p - log_q, ell


def _anchored_local(cfg, elog_w, counts, gamma0, ladder, row_doc, score_w=None):
    r"""The multicanonical local step with one local fit per anchor temperature (see
    :func:`local_step`): returns gamma (of each document's heaviest anchor), the
    statistics :math:`\sum_m r_m h_m n\phi_{j(m)}`, :math:`\mathbb E_r[1/T]`, the sweeps,
    :math:`r` and :math:`\log r`, and the mass the anchors other than the first serve."""
    inv_temps, log_pi, anchors, log_c = ladder
    batch, num_anchors = gamma0.shape[0], anchors.shape[0]
    score_w = elog_w if score_w is None else score_w

    def fit(j):
        inv_t = jnp.full((batch,), anchors[j])
        gamma_j, sstats_j, iters_j = _tempered_fit(cfg, elog_w, counts, gamma0, inv_t, row_doc)
        return (gamma_j, sstats_j, iters_j,
                *_local_bound(cfg, score_w, counts, gamma_j, inv_t, row_doc))

    # one loop per anchor: each stops at its own slowest
    fits = [fit(j) for j in range(num_anchors)]
    gamma, sstats, iters, bound, ell = (jnp.stack(x) for x in zip(*fits, strict=True))
    # tangent of anchor j at rung m: a lower bound on rung m's best local bound
    tangents = bound[..., None] + (inv_temps - anchors[:, None])[:, None, :] * ell[..., None]
    best = jnp.argmax(tangents, axis=0)  # (B, M): the anchor serving each rung
    value = jnp.max(tangents, axis=0)
    post = posterior_from_arrays(value, log_pi, inv_temps, log_c)
    r = post.probs
    log_r = value + log_pi - log_c - post.log_marginal[:, None]  # below the float range too
    served = best[None] == jnp.arange(num_anchors)[:, None, None]  # (J, B, M)
    weight = jnp.sum(jnp.where(served, r * inv_temps, 0.0), axis=-1)  # (J, B)
    row_weight = jnp.take(weight / anchors[:, None], jnp.minimum(row_doc, batch - 1), axis=1)
    row_weight = jnp.where(row_doc[None, :] < batch, row_weight, 0.0)  # (J, R)
    stats = jnp.einsum("jr,jrkw->rkw", row_weight, sstats)
    mass = jnp.sum(jnp.where(served, r, 0.0), axis=-1)  # (J, B)
    gamma = gamma[jnp.argmax(mass, axis=0), jnp.arange(batch)]
    # w_dm: how far rung m's statistics per word are from the document's (refresh rule)
    own = jnp.sum(jnp.where(served, weight[..., None], 0.0), axis=0)  # (B, M): H_{j(m)}
    moves = jnp.abs(inv_temps - own) + (jnp.sum(weight, axis=0)[:, None] - own)
    return LocalResult(gamma, stats, r @ inv_temps, jnp.sum(iters, axis=0), r, log_r,
                       jnp.sum(mass[1:], axis=0), moves)


def local_step(
    cfg: LDAConfig,
    lam: jax.Array,
    ids: jax.Array,
    counts: jax.Array,
    gamma0: jax.Array,
    inv_temperature: jax.typing.ArrayLike | tuple = 1.0,
    row_doc: jax.Array | None = None,
) -> LocalResult:
    r"""The tempered local updates of a minibatch (supplement eq. 9), vectorised over documents.

    ``ids``, ``counts``: (R, W) padded rows of ``(index, count)`` pairs; ``row_doc`` (R,):
    the document (in ``[0, B)``; ``>= B`` for padding rows) of each row, so that long
    documents span several rows (default: row d is document d). ``gamma0``: (B, K) initial
    :math:`\gamma`; ``inv_temperature``: :math:`1/T` (scalar or (B,)). Each document
    iterates until the mean absolute change of its :math:`\gamma_d` is below ``cfg.tol``, at
    most ``cfg.max_doc_iter`` sweeps. Returns :math:`\gamma`, the rows' scaled sufficient
    statistics :math:`n_{dv}\phi_{dvk}/T_d` (R, W, K), the :math:`1/T_d` used, the sweeps
    per document and (MVI) :math:`q(y_d)`.

    **Multicanonical** (``inv_temperature`` a tuple ``(1/T_m (M,), log pi (M,), anchors (J,),
    log C_d(T_m) (B, M))``, ``anchors`` the inverse temperatures of J rungs, the first 1):
    the family is :math:`q(y_d)\,q(\theta_d, z_d\mid y_d)` -- each document is fitted
    once per anchor :math:`h_j` (its tempered fixed point at :math:`T = 1/h_j`, giving
    the bound :math:`B_j` and :math:`\ell_j = \mathbb E[\log p(w_d, z_d\mid\theta_d,
    \beta)]`), and rung m takes the anchor fit whose bound at :math:`h_m` is largest. The
    tempered bound is convex in :math:`h` with slope :math:`\ell` (envelope theorem), so
    :math:`B_j + (h_m - h_j)\ell_j` is that fit's exact bound at rung m, and eq. 18
    (Mandt et al. 2016) for this family is

    .. math::

        r_{dm} \propto \pi_m\exp\Big\{\max_j\big[B_{dj} + (h_m - h_j)\ell_{dj}\big]
            - \log C_d(T_m)\Big\}.

    With one anchor at the document's :math:`\mathbb E[1/T_y]` this is the paper's
    mean-field eq. 18 (:math:`\ell_d/T_m` up to a constant in m); that coupling has a hot
    fixed point (a diffuse :math:`q(z, \theta)` fitted hot has a low :math:`\ell` at every
    rung, which confirms the hot assignment: docs/lda.md, "Why MVI heated up"), which the
    fixed anchors cannot fall into. The statistics are :math:`\sum_m r_{dm} h_m\, n_{dv}
    \phi^{(j(m))}_{dvk}` (supplement eq. 9 per rung). :math:`B_j` and :math:`\ell_j` are
    evaluated under the topics ``cfg.mvi_topics`` names (``"mean"``: :math:`\log\bar\beta`;
    ``"expected"``: :math:`\mathbb E_q\log\beta`; see :class:`Multicanonical`); the fits
    themselves use :math:`\mathbb E_q\log\beta` as always.

    Example:
        >>> cfg = config(2, 3, 10)
        >>> lam = jnp.array([[5.0, 1.0, 1.0], [1.0, 1.0, 5.0]])
        >>> out = local_step(cfg, lam, jnp.array([[0, 2]]), jnp.array([[3.0, 0.0]]),
        ...                  jnp.ones((1, 2)))
        >>> [round(float(g), 2) for g in out.gamma[0]]  # alpha = 1/2, + ~3 words to topic 0
        [3.48, 0.52]
    """
    local = _local_step(cfg, lam, ids, counts, gamma0, inv_temperature, row_doc)
    return local._replace(sstats=jnp.swapaxes(local.sstats, 1, 2))


def _local_step(cfg, lam, ids, counts, gamma0, inv_temperature, row_doc) -> LocalResult:
    """:func:`local_step` with the statistics laid out (R, K, W), as :func:`_gather` lays
    out the rows (the layout the local loops are fast in)."""
    dtype = lam.dtype
    counts = jnp.asarray(counts, dtype)
    gamma0 = jnp.asarray(gamma0, dtype)
    batch = gamma0.shape[0]
    row_doc = jnp.arange(counts.shape[0]) if row_doc is None else jnp.asarray(row_doc)
    elog_w = _gather(expected_log_topics(lam), jnp.asarray(ids))  # (R, K, W)
    if isinstance(inv_temperature, tuple):
        ladder = tuple(jnp.asarray(x, dtype) for x in inv_temperature)
        score_w = None
        if cfg.mvi_topics == "mean":
            log_mean = jnp.log(lam) - jnp.log(jnp.sum(lam, axis=1, keepdims=True))
            score_w = _gather(log_mean, jnp.asarray(ids))
        return _anchored_local(cfg, elog_w, counts, gamma0, ladder, row_doc, score_w)
    inv_t = jnp.broadcast_to(jnp.asarray(inv_temperature, dtype), (batch,))
    gamma, sstats, iters = _tempered_fit(cfg, elog_w, counts, gamma0, inv_t, row_doc)
    return LocalResult(gamma, sstats, inv_t, iters, None)


def update(
    cfg: LDAConfig,
    state: OnlineLDAState,
    ids: jax.Array,
    counts: jax.Array,
    batch_docs: jax.typing.ArrayLike,
    temperature: jax.typing.ArrayLike | tuple,
    gamma0: jax.Array,
    row_doc: jax.Array | None = None,
) -> tuple[OnlineLDAState, StepInfo]:
    r"""One step of Algorithm 1 (Mandt et al. 2016): tempered local updates, then the
    tempered natural-gradient step on :math:`\lambda` (eq. 16).

    ``ids``, ``counts``: padded rows of the minibatch's documents, ``row_doc`` the document
    of each row (see :func:`local_step`; default one row per document). Documents from
    ``batch_docs`` on must be empty: :math:`D/|B|` uses ``batch_docs``, the actual number of
    documents. ``temperature``: T (scalar), or the MVI tuple of :func:`local_step` (with
    :math:`\log C_d` per document). ``gamma0``: initial :math:`\gamma` (B, K)
    (:func:`initial_gamma`).

    Example:
        >>> cfg = config(2, 3, 10)
        >>> s = init_state(0, 2, 3)
        >>> s2, info = update(cfg, s, jnp.array([[0, 2]]), jnp.array([[3.0, 1.0]]), 1, 1.0,
        ...                   initial_gamma(0, 1, 2))
        >>> int(s2.step), bool(info.rho == learning_rate(0, cfg.tau, cfg.kappa))
        (1, True)
    """
    real = jnp.arange(gamma0.shape[0]) < batch_docs
    stats, _ = _statistics(cfg, state.lam, ids, counts, real, temperature, gamma0, row_doc)
    return _global_step(cfg, state, stats, batch_docs, temperature)


class _Stats(NamedTuple):
    """A minibatch's (or one device's share of it) contribution to the global step."""

    sstats: jax.Array  # (K, V): sum_d n_dv phi_dvk / T_d
    sum_t: jax.Array  # sum over real documents with words of E_q(y_d)[T] (MVI; 0 otherwise)
    sum_iters: jax.Array  # sum over real documents of their sweeps
    num_real: jax.Array  # number of real (not padding) documents
    log_rung_words: jax.Array  # (LENGTH_BINS, M): log sum of q(y_d = m) w_dm L_d by length bin
    hot_mass: jax.Array  # sum over real documents with words of the hot anchors' q(y_d) mass
    num_worded: jax.Array  # number of real documents with words (MVI; num_real otherwise)


def _statistics(cfg, lam, ids, counts, real, temperature, gamma0, row_doc
                ) -> tuple[_Stats, jax.Array]:
    """Local updates of the documents (``real``: not padding): their summed sufficient
    statistics (a sum over documents, so shards of a minibatch add up: ``psum``) and their
    fitted gamma."""
    dtype = lam.dtype
    if isinstance(temperature, tuple):
        local = _local_step(cfg, lam, ids, counts, gamma0, temperature, row_doc)
        expected_t = local.q_y @ (1.0 / jnp.asarray(temperature[0], dtype))
        doc_of_row = jnp.arange(counts.shape[0]) if row_doc is None else row_doc
        length = jax.ops.segment_sum(jnp.sum(counts, axis=1), doc_of_row, gamma0.shape[0])
        # an empty document's q(y_d) is the ladder's prior and moves nothing: it is left out
        # of the reported E[T] and of the hot anchors' share (which decides the probes)
        worded = real & (length > 0)
        sum_t = jnp.sum(jnp.where(worded, expected_t, 0))
        log_words = (jnp.where(real, jnp.log(length), -jnp.inf)[:, None] + local.log_q_y
                     + jnp.log(local.moves))
        log_rung_words = _segment_logsumexp(log_words, _length_bin(length), LENGTH_BINS)
        hot_mass = jnp.sum(jnp.where(worded, local.hot_mass, 0))
        num_worded = jnp.sum(worded.astype(jnp.int32))
    else:
        t = jnp.asarray(temperature, dtype)
        local = _local_step(cfg, lam, ids, counts, gamma0, 1.0 / t, row_doc)
        sum_t = jnp.zeros((), dtype)
        log_rung_words = jnp.zeros((LENGTH_BINS, 0), dtype)
        hot_mass = jnp.zeros((), dtype)
        num_worded = jnp.sum(real.astype(jnp.int32))
    k = cfg.num_topics
    sstats = jnp.zeros((k, cfg.vocab_size), dtype).at[:, jnp.ravel(ids)].add(
        jnp.moveaxis(local.sstats, 1, 0).reshape(k, -1)
    )
    sum_iters = jnp.sum(jnp.where(real, local.iterations, 0))
    return (_Stats(sstats, sum_t, sum_iters, jnp.sum(real.astype(jnp.int32)), log_rung_words,
                   hot_mass, num_worded),
            local.gamma)


def _global_step(cfg, state, stats: _Stats, batch_docs, temperature):
    """The tempered natural-gradient step on lambda (eq. 16) from summed statistics."""
    lam = state.lam
    dtype = lam.dtype
    num_real = jnp.maximum(stats.num_real, 1).astype(dtype)
    worded = stats.num_worded.astype(dtype)
    if isinstance(temperature, tuple):  # NaN for a minibatch of empty documents only
        mean_t = jnp.where(worded > 0, stats.sum_t / jnp.maximum(worded, 1), jnp.nan)
    else:
        mean_t = jnp.asarray(temperature, dtype)
    scale = jnp.asarray(cfg.num_docs, dtype) / jnp.asarray(batch_docs, dtype)
    lam_hat = cfg.eta + scale * stats.sstats
    rho = learning_rate(state.step, cfg.tau, cfg.kappa).astype(dtype)
    new_lam = (1 - rho) * lam + rho * lam_hat
    iters = stats.sum_iters.astype(dtype) / num_real
    return (OnlineLDAState(new_lam, state.step + 1),
            StepInfo(rho, mean_t, iters, stats.log_rung_words,
                     stats.hot_mass / jnp.maximum(worded, 1)))


# -- fitting -----------------------------------------------------------------------------------


class FitResult(NamedTuple):
    """A fitted model and its record.

    ``lam`` (K, V): topics' Dirichlet parameters; ``state``: the final state (resume by
    passing it to :func:`fit`); ``temperatures`` (steps,): T per update (MVI: mean
    :math:`\\mathbb E_{q(y_d)}[T]` over the minibatch); ``rho`` (steps,); ``seconds``: wall
    time of all updates after compilation (MVI: and of the first log C table);
    ``compile_seconds``; ``num_steps``; ``docs_per_second``; ``log_c_seconds``: the part
    of ``seconds`` spent computing :math:`\\log C_d` from the topics (MVI with the
    conditional normaliser; the first table, before the first update, included);
    ``log_c_rungs``: how many rung tables were computed for it (M per full computation);
    ``sweeps`` (steps,): the mean local sweeps per document of each update (MVI: summed
    over its anchor fits).
    """

    lam: np.ndarray
    state: OnlineLDAState
    temperatures: np.ndarray
    rho: np.ndarray
    seconds: float
    compile_seconds: float
    num_steps: int
    docs_per_second: float
    log_c_seconds: float = 0.0
    log_c_rungs: int = 0
    sweeps: np.ndarray | None = None


def _as_schedule(temperature) -> Callable | None:
    if isinstance(temperature, Multicanonical):
        return None
    if callable(temperature):
        return temperature
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"`temperature` must be a finite T > 0, a schedule or a "
                         f"Multicanonical ladder, got {temperature!r}.")
    return lambda step: jnp.full(jnp.shape(step), t)


def _segment_logsumexp(x: jax.Array, segment: jax.Array, num: int) -> jax.Array:
    """(num, M): the log-sum-exp of the rows of ``x`` (N, M) in each ``segment`` (N,);
    -inf for an empty one."""
    top = jax.ops.segment_max(x, segment, num)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    return top + jnp.log(jax.ops.segment_sum(jnp.exp(x - top[segment]), segment, num))


def _corpus_step(cfg, state, all_ids, all_counts, all_log_c, batch, rows, row_doc, batch_docs,
                 gamma0, temperature):
    """One update on the minibatch ``batch`` (document indices) of the device-resident
    corpus, whose words are the rows ``rows`` (``row_doc``: position in the minibatch);
    ``temperature`` is T, or ``(1/T_m, log pi_m)`` with ``all_log_c`` (MVI). Returns the
    new state, the step's record and the minibatch's fitted gamma."""
    ids, counts = all_ids[rows], all_counts[rows]
    if isinstance(temperature, tuple):
        temperature = (*temperature, all_log_c[batch])
    real = jnp.arange(gamma0.shape[0]) < batch_docs
    stats, gamma = _statistics(cfg, state.lam, ids, counts, real, temperature, gamma0,
                               row_doc)
    return (*_global_step(cfg, state, stats, batch_docs, temperature), gamma)


def _split_rows(corpus: Corpus, width: int):
    """The corpus as rows of ``width`` (index, count) pairs: (R, W) ids and counts, and the
    first row and number of rows of each document (documents keep their order)."""
    present = corpus.counts > 0
    distinct = present.sum(axis=1)
    # each document's words first (a hand-built corpus may hold zero counts between them:
    # rows are cut from the first `distinct` entries), in their order
    order = np.argsort(~present, axis=1, kind="stable")
    corpus_ids = np.take_along_axis(corpus.ids, order, axis=1)
    corpus_counts = np.take_along_axis(corpus.counts, order, axis=1)
    per_doc = -(-distinct // width)
    cols = -(-corpus_ids.shape[1] // width) * width
    pad = ((0, 0), (0, cols - corpus_ids.shape[1]))
    ids = np.pad(corpus_ids, pad).reshape(corpus.num_docs, -1, width)
    counts = np.pad(corpus_counts, pad).reshape(corpus.num_docs, -1, width)
    keep = np.arange(ids.shape[1])[None, :] < per_doc[:, None]
    start = np.concatenate([[0], np.cumsum(per_doc)[:-1]])
    return ids[keep], counts[keep], start, per_doc


def _batch_rows(docs: np.ndarray, start: np.ndarray, per_doc: np.ndarray):
    """Row indices of the documents ``docs`` and the position in ``docs`` of each row."""
    n = per_doc[docs]
    first = np.repeat(start[docs], n)
    offset = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
    return first + offset, np.repeat(np.arange(docs.size), n)


_corpus_step_jit = jax.jit(_corpus_step, static_argnums=0, donate_argnums=1)


def _sharded_step(cfg, mesh, state, all_ids, all_counts, all_log_c, batch, rows, row_doc,
                  batch_docs, gamma0, temperature):
    """:func:`_corpus_step` data-parallel over the ``"data"`` axis of ``mesh``: each device
    runs the local updates of its share of the minibatch (``batch``, ``rows``, ``row_doc``,
    ``gamma0`` are split along their first axis; ``row_doc`` counts within the share), the
    statistics are summed over devices (``psum``), and every device takes the same global
    step on its replicated copy of lambda. The fitted gamma stays split by document."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def local(lam, all_ids, all_counts, all_log_c, batch, rows, row_doc, gamma0, temperature):
        ids, counts = all_ids[rows], all_counts[rows]
        if isinstance(temperature, tuple):
            temperature = (*temperature, all_log_c[batch])
        stats, gamma = _statistics(cfg, lam, ids, counts, batch < cfg.num_docs, temperature,
                                   gamma0, row_doc)
        log_words = stats.log_rung_words  # a log of a sum: log-sum-exp over devices
        top = jax.lax.stop_gradient(jax.lax.pmax(log_words, _DATA_AXIS))
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        log_words = top + jnp.log(jax.lax.psum(jnp.exp(log_words - top), _DATA_AXIS))
        stats = jax.lax.psum(stats._replace(log_rung_words=jnp.zeros_like(log_words)),
                             _DATA_AXIS)
        return stats._replace(log_rung_words=log_words), gamma

    data, rep = P(_DATA_AXIS), P()
    stats, gamma = jax.shard_map(
        local, mesh=mesh, in_specs=(rep, rep, rep, rep, data, data, data, data, rep),
        out_specs=(rep, data), check_vma=False,  # the per-document loops mix the two
    )(state.lam, all_ids, all_counts, all_log_c, batch, rows, row_doc, gamma0, temperature)
    new_state, info = _global_step(cfg, state, stats, batch_docs, temperature)
    replicated = NamedSharding(mesh, rep)
    return (*jax.lax.with_sharding_constraint((new_state, info), replicated), gamma)


_sharded_step_jit = jax.jit(_sharded_step, static_argnums=(0, 1), donate_argnums=2)
_DATA_AXIS = "data"
_COMPILED: dict = {}


def _row_bucket(rows: int) -> int:
    """The minibatches' row buffer for ``rows`` rows at most: rounded up to one of 4 sizes
    per octave (at most a quarter of padding rows, which the staged local step drops after
    its first stage), so that another seed's shuffle, whose fullest minibatch differs by a
    few rows, reuses the compiled update instead of compiling its own (3.7-13 s)."""
    rows = max(int(rows), 1)
    step = 1 << max(rows.bit_length() - 3, 0)
    return -(-rows // step) * step


def _compiled_step(cfg, args, mesh=None) -> tuple[Callable, float]:
    """The compiled update for these static settings and shapes (compiled once per process),
    and the seconds its compilation took (0 when cached)."""
    key = (cfg, mesh, *[(x.shape, x.dtype) for x in jax.tree.leaves(args)])
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    start = time.perf_counter()
    if mesh is None:
        compiled = _corpus_step_jit.lower(cfg, *args).compile()
    else:
        compiled = _sharded_step_jit.lower(cfg, mesh, *args).compile()
    _COMPILED[key] = compiled
    return compiled, time.perf_counter() - start


def _no_placement(x, sharded: bool):
    return jax.tree.map(jnp.asarray, x)


def _place(mesh, x, sharded: bool):
    """``x`` on the mesh: split along its first axis over ``"data"``, or replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = P(_DATA_AXIS) if sharded else P()
    return jax.device_put(x, NamedSharding(mesh, spec))


def as_mesh(mesh: Any) -> Any:
    """``None`` (one device), a number of devices n (the first n of ``jax.devices()``), a
    sequence of devices, or a ``jax.sharding.Mesh`` with a ``"data"`` axis -> a Mesh or None.

    Example:
        >>> as_mesh(None) is None
        True
        >>> as_mesh(1).shape["data"]
        1
    """
    from jax.sharding import Mesh

    if mesh is None or isinstance(mesh, Mesh):
        if mesh is not None and _DATA_AXIS not in mesh.axis_names:
            raise ValueError(f"`mesh` must have a {_DATA_AXIS!r} axis, got axes "
                             f"{mesh.axis_names}.")
        return mesh
    if isinstance(mesh, (int, np.integer)) and not isinstance(mesh, bool):
        available = jax.devices()
        if not 1 <= mesh <= len(available):
            raise ValueError(f"`mesh` asks for {mesh} devices; {len(available)} available "
                             "(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N "
                             "before importing JAX).")
        return Mesh(np.array(available[:mesh]), (_DATA_AXIS,))
    try:
        devices = list(mesh)
    except TypeError:
        raise TypeError("`mesh` must be None, a number of devices, a sequence of devices or a "
                        f"jax.sharding.Mesh, got {type(mesh).__name__}.") from None
    if not devices:
        raise ValueError("`mesh` is an empty sequence of devices.")
    return Mesh(np.array(devices), (_DATA_AXIS,))


def progress(total: int, enabled: bool, desc: str = "online LDA"):
    """A tqdm bar over ``total`` minibatches, or ``None`` when not ``enabled`` (the LDA
    fitters' ``progress_bar=``)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="batch", desc=desc)


def fit(
    corpus: Corpus,
    num_topics: int,
    *,
    passes: float = 1.0,
    batch_size: int = PAPER["batch_size"],
    temperature: float | Callable | Multicanonical = 1.0,
    tau: float = PAPER["tau"],
    kappa: float = PAPER["kappa"],
    alpha: float | None = None,
    eta: float | None = None,
    max_doc_iter: int = 100,
    tol: float = 1e-3,
    seed: int = 0,
    shuffle: bool = True,
    dtype: Any = None,
    state: OnlineLDAState | None = None,
    progress_bar: bool = False,
    row_width: int = 64,
    mesh: Any = None,
    stage_shrink: int = 2,
    warm_start: bool = True,
) -> FitResult:
    r"""Fit LDA by annealed / multicanonical stochastic VI (Algorithm 1 of Mandt et al. 2016).

    Args:
        corpus: the training documents.
        num_topics: K.
        passes: effective passes through the data; ``ceil(passes * D / batch_size)`` updates.
        batch_size: documents per minibatch (the paper's 100; scikit-learn's 128).
        temperature: T (1 = online VB, Hoffman et al. 2010), a schedule ``step -> T``
            (annealing; :func:`numpyro_tempering.schedules.from_ladder` gives the paper's), or
            a :class:`Multicanonical` ladder (MVI).
        tau, kappa: Robbins-Monro step sizes (:data:`PAPER` defaults; :data:`SKLEARN`).
        alpha, eta: Dirichlet concentrations (default 1/K).
        max_doc_iter, tol: per-document stopping rule (scikit-learn's defaults).
        seed: initialisation and minibatch order.
        shuffle: draw a fresh random order of the documents every pass (else in order, as
            scikit-learn).
        dtype: float32 / float64 (default: JAX's default float).
        state: continue from a previous fit's state instead of a fresh initialisation.
        progress_bar: show a tqdm bar.
        row_width: documents are cut into rows of this many distinct words (a long document
            spans several rows), so that padding costs little whatever the spread of
            document lengths; a minibatch holds as many rows as the largest one needs.
        mesh: data parallelism (:func:`as_mesh`): ``None`` (one device, the default), a
            number of devices, a sequence of devices, or a ``jax.sharding.Mesh`` with a
            ``"data"`` axis. Each minibatch is split into equal shares of consecutive
            documents, one per device (padded with empty documents), the corpus and
            :math:`\lambda` are replicated, each device runs its documents' local updates,
            the sufficient statistics (a sum over documents) are summed over devices
            (``psum``) and every device takes the same global step: the same fit as on one
            device up to the order of floating-point additions.
        stage_shrink: how fast the per-document loop's buffers shrink
            (:attr:`LDAConfig.stage_shrink`): a speed setting, the fit is the same.
        warm_start: start each document's local fixed point from its own :math:`\gamma_d`
            of its previous visit (random Gamma(100, 0.01) at its first, as scikit-learn
            draws for every visit): the same fixed point (within ``tol``), reached in
            fewer sweeps once the topics have settled. Measured on a minibatch of 128 after
            one pass: 17 sweeps instead of 34 and 1.3x faster on NewsArticles (K = 50),
            13 instead of 31 and 2.6x faster on 1,300-word documents (K = 10). ``False``:
            fresh random :math:`\gamma` at every visit (scikit-learn's arithmetic).

    The update is compiled once per process for given settings and shapes (timed
    separately as ``compile_seconds``, 0 when reused); the schedule is evaluated on the host
    for all steps up front (``step`` = updates done before, continuing from ``state``).

    Example:
        >>> import jax
        >>> from numpyro_tempering.models import corpora
        >>> data, _ = corpora.synthetic(0, 40, 20, 3, 30)
        >>> res = fit(data, 3, passes=2, batch_size=10, temperature=2.0)
        >>> res.lam.shape, res.num_steps, set(res.temperatures.tolist())
        ((3, 30), 8, {2.0})
    """
    num_docs = corpus.num_docs
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
    if num_docs > 0 and not np.any(np.asarray(corpus.lengths) > 0):
        raise ValueError(f"`corpus` has {num_docs} documents and no words: nothing to fit.")
    batch_size = min(int(batch_size), num_docs)
    if not (math.isfinite(passes) and passes > 0):
        raise ValueError(f"`passes` must be a finite number > 0, got {passes!r}.")
    cfg = config(num_topics, corpus.vocab_size, num_docs, alpha=alpha, eta=eta, tau=tau,
                 kappa=kappa, max_doc_iter=max_doc_iter, tol=tol)
    if int(stage_shrink) != stage_shrink or stage_shrink < 2:
        raise ValueError(f"`stage_shrink` must be an integer >= 2, got {stage_shrink!r}.")
    cfg = cfg._replace(stage_shrink=int(stage_shrink))
    dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"`dtype` must be a floating-point dtype (float32 or float64), got "
                         f"{dtype}.")
    mesh = as_mesh(mesh)
    schedule = _as_schedule(temperature)
    if schedule is None:
        if temperature.topics not in ("mean", "expected"):
            raise ValueError(f"`Multicanonical.topics` must be 'mean' or 'expected', got "
                             f"{temperature.topics!r}.")
        cfg = cfg._replace(mvi_topics=temperature.topics)
    rng = np.random.default_rng(seed)
    if state is None:
        state = init_state(rng, num_topics, corpus.vocab_size, dtype)
    elif state.lam.shape != (num_topics, corpus.vocab_size):
        raise ValueError(f"`state.lam` has shape {state.lam.shape}, expected "
                         f"{(num_topics, corpus.vocab_size)}.")
    if int(row_width) != row_width or row_width < 1:
        raise ValueError(f"`row_width` must be a positive integer, got {row_width!r}.")
    # the corpus on the device as rows, plus one empty row (index R) that pads minibatches
    row_ids, row_counts, row_start, rows_per_doc = _split_rows(corpus, int(row_width))
    all_ids = jnp.asarray(np.vstack([row_ids, np.zeros((1, row_width), np.int32)]))
    all_counts = jnp.asarray(np.vstack([row_counts, np.zeros((1, row_width))]), dtype)
    steps_per_pass = -(-num_docs // batch_size)
    num_steps = int(math.ceil(passes * num_docs / batch_size))
    first_step = int(state.step)
    if schedule is not None and callable(temperature):
        # at the steps this fit runs: a schedule that has not reached T = 1 by its last
        # update warns (the topics are then those of the tempered model)
        schedules.validate(temperature, max(first_step + num_steps, 1), name="temperature")
    lengths = np.append(corpus.lengths, 0)  # the extra document D pads short minibatches
    follow_topics = schedule is None and temperature.log_c_per_length is None
    if follow_topics and not (math.isfinite(temperature.refresh) and temperature.refresh >= 0):
        raise ValueError(f"`Multicanonical.refresh` must be a finite number >= 0, got "
                         f"{temperature.refresh!r}.")
    if follow_topics and not (math.isfinite(temperature.tolerance)
                              and temperature.tolerance >= 0):
        raise ValueError(f"`Multicanonical.tolerance` must be a finite number >= 0, got "
                         f"{temperature.tolerance!r}.")
    normaliser = _Normaliser(temperature, cfg.alpha, lengths) if follow_topics else None
    first_table = time.perf_counter()  # the first log C table counts as the fit's time
    # with a tolerance, the first table is exact on the grid and bracketed between, and is
    # refined below with the first minibatch's own q(y_d)
    lazy = follow_topics and temperature.tolerance > 0
    if schedule is None:
        all_log_c = jnp.asarray(normaliser.table(state.lam, coarse=lazy) if follow_topics else
                                temperature.log_c_per_length(lengths), dtype)
        first_table = time.perf_counter() - first_table if follow_topics else 0.0
        ladder = (jnp.asarray(1.0 / np.asarray(temperature.temperatures, np.float64), dtype),
                  jnp.asarray(temperature.log_weights, dtype),
                  jnp.asarray(1.0 / temperature.anchor_temperatures(), dtype))
        temps_in = [ladder] * num_steps
    else:
        first_table, all_log_c = 0.0, None
        steps = jnp.arange(first_step, first_step + num_steps)
        temps_in = list(np.asarray(jax.vmap(schedule)(steps), np.dtype(dtype)))

    batches = []
    while len(batches) < num_steps:
        order = rng.permutation(num_docs) if shuffle else np.arange(num_docs)
        for b in range(steps_per_pass):
            batches.append(order[b * batch_size:(b + 1) * batch_size])
    batches = batches[:num_steps]
    num_rows = row_ids.shape[0]
    if mesh is None:
        shards, per_shard, put = 1, batch_size, _no_placement
    else:
        shards = mesh.shape[_DATA_AXIS]
        per_shard = -(-batch_size // shards)
        put = partial(_place, mesh)
    padded_size = shards * per_shard
    # each minibatch padded to padded_size documents (index D: empty), cut into shards of
    # per_shard consecutive documents, each with its own rows (row_doc within the shard)
    doc_shards = [np.pad(docs, (0, padded_size - docs.size), constant_values=num_docs)
                  .reshape(shards, per_shard) for docs in batches]
    rows = [[_batch_rows(chunk[chunk < num_docs], row_start, rows_per_doc) for chunk in sh]
            for sh in doc_shards]
    max_rows = _row_bucket(max(r.size for sh in rows for r, _ in sh))

    def padded(docs, sh, doc_rows):
        return (put(sh.reshape(-1), True),
                put(np.concatenate([np.pad(r, (0, max_rows - r.size), constant_values=num_rows)
                                    for r, _ in doc_rows]), True),
                put(np.concatenate([np.pad(o, (0, max_rows - o.size), constant_values=per_shard)
                                    for _, o in doc_rows]), True),
                put(np.asarray(docs.size, np.int32), False))

    # every document's gamma, row D (the padding document) all ones
    gammas = jnp.asarray(np.vstack([initial_gamma(rng, num_docs, num_topics),
                                    np.ones((1, num_topics))]), dtype)

    def first_gamma(sh):
        if warm_start:
            return put(gammas[sh.reshape(-1)], True)
        g = initial_gamma(rng, batch_size, num_topics)
        return put(np.vstack([g, np.ones((padded_size - batch_size, num_topics))])
                   .astype(dtype), True)

    state = put(jax.tree.map(jnp.array, state), False)  # donated: never the caller's arrays
    all_ids, all_counts, all_log_c = put((all_ids, all_counts, all_log_c), False)
    temps_in = [put(t, False) for t in temps_in]
    example = (state, all_ids, all_counts, all_log_c,
               *padded(batches[0], doc_shards[0], rows[0]),
               put(np.zeros((padded_size, num_topics), dtype), True), temps_in[0])
    compiled, compile_seconds = _compiled_step(cfg, example, mesh)
    # MVI: the update that fits the T = 1 anchor alone, between probes (Multicanonical)
    skip_hot = schedule is None and temperature.tolerance > 0 and ladder[2].shape[0] > 1
    if skip_hot:
        cold_only = put((*ladder[:2], ladder[2][:1]), False)
        cold_step, seconds = _compiled_step(cfg, (*example[:-1], cold_only), mesh)
        compile_seconds += seconds
        hot_share, since_probe = math.inf, 0

    gamma0 = first_gamma(doc_shards[0])
    if lazy:  # a dry run of the first update (its result dropped): which rungs it uses
        tick = time.perf_counter()
        dry = put(jax.tree.map(jnp.array, state), False)
        _, info, _ = compiled(dry, all_ids, all_counts, all_log_c,
                              *padded(batches[0], doc_shards[0], rows[0]), gamma0, temps_in[0])
        all_log_c = put(jnp.asarray(normaliser.table(
            state.lam, np.asarray(info.log_rung_words, np.float64),
            float(lengths[batches[0]].sum())), dtype), False)
        first_table += time.perf_counter() - tick
    bar = progress(num_steps, progress_bar)
    infos = []
    log_c_seconds = first_table
    moved = 0.0  # step sizes summed since log C_d was last computed from the topics
    computed = 0  # the first update under the current table
    start = time.perf_counter()
    for i, (docs, sh, doc_rows, temp) in enumerate(
            zip(batches, doc_shards, rows, temps_in, strict=True)):
        if follow_topics and i > 0 and moved >= temperature.refresh:
            moved = 0.0
            jax.block_until_ready(state.lam)
            tick = time.perf_counter()
            # the latest updates since the last computation: documents under recent topics
            first = max(computed, i - RISK_WINDOW)
            log_moves = np.stack([np.asarray(x.log_rung_words, np.float64)
                                  for x in infos[first:i]])
            log_moves = logsumexp(log_moves, axis=0) - math.log(i - first)
            words = np.mean([lengths[d].sum() for d in batches[first:i]])
            computed = i
            all_log_c = put(jnp.asarray(normaliser.table(state.lam, log_moves, words), dtype),
                            False)
            log_c_seconds += time.perf_counter() - tick
        step = compiled
        if skip_hot:
            probe = hot_share >= temperature.tolerance or since_probe + 1 >= PROBE_EVERY
            step, temp = (compiled, temp) if probe else (cold_step, cold_only)
        state, info, gamma = step(state, all_ids, all_counts, all_log_c,
                                  *padded(docs, sh, doc_rows),
                                  gamma0 if i == 0 else first_gamma(sh), temp)
        if skip_hot:
            hot_share, since_probe = ((float(info.hot_share), 0) if probe
                                      else (hot_share, since_probe + 1))
        if warm_start:
            gammas = _keep_gamma(gammas, jnp.asarray(sh.reshape(-1)), gamma, num_docs)
        infos.append(info)
        if follow_topics:
            moved += (cfg.tau + first_step + i + 1) ** -cfg.kappa  # learning_rate, on the host
        if bar is not None:
            bar.update(1)
    lam = np.asarray(jax.block_until_ready(state.lam))
    seconds = time.perf_counter() - start + first_table
    if bar is not None:
        bar.close()
    temps = np.asarray(jnp.stack([i.temperature for i in infos]))
    rho = np.asarray(jnp.stack([i.rho for i in infos]))
    if not np.all(np.isfinite(lam)):
        lam = np.full_like(lam, np.nan)  # numerical trouble is NaN, never a finite guess
    total = float(sum(docs.size for docs in batches))
    if isinstance(temperature, Multicanonical):
        _warn_if_hot(temps, corpus)
    return FitResult(lam, state, temps, rho, seconds, compile_seconds, num_steps,
                     total / seconds if seconds > 0 else float("inf"), log_c_seconds,
                     normaliser.rungs if normaliser is not None else 0,
                     np.asarray(jnp.stack([i.iterations for i in infos])))


#: MVI's last update with a mean E[T] above this ends :func:`fit` with a warning
HOT_END = 1.5


def _warn_if_hot(temperatures: np.ndarray, corpus: Corpus) -> None:
    """Warn when an MVI fit ends hot: its topics were then learnt from statistics divided
    by E[T] (docs/lda.md, "Short documents stay hot, exactly"). Documents of a few words
    stay near the ladder's prior even under the topics that generated them (exactly, by
    enumeration: E[T] 2.9 for 4-word documents on the paper's ladder); otherwise the fit
    has not yet explained its documents."""
    last = float(temperatures[-1]) if temperatures.size else float("nan")
    if not last > HOT_END:
        return
    lengths = corpus.lengths
    median = float(np.median(lengths[lengths > 0]))
    warnings.warn(
        f"lda_svi.fit: multicanonical VI ended hot: the last update's mean E[T] is "
        f"{last:.2f} (> {HOT_END}), so the topics were fitted from word counts divided by "
        f"about that much. The documents' median length is {median:.0f} words: a document "
        "of a few words carries a few nats of evidence about its temperature and the "
        "multicanonical model keeps it near the ladder's prior even under topics that fit "
        "it (docs/lda.md, 'Short documents stay hot, exactly'); for long documents, more "
        "passes let the topics explain them. For short texts prefer plain SVI "
        "(temperature=1.0) or an annealing schedule.",
        UserWarning, stacklevel=3)


@partial(jax.jit, donate_argnums=0)
def _keep_gamma(gammas, docs, gamma, num_docs):
    """Store the minibatch's fitted gamma (documents ``docs``; index ``num_docs``: padding,
    not stored)."""
    return gammas.at[jnp.where(docs < num_docs, docs, gammas.shape[0])].set(
        gamma.astype(gammas.dtype), mode="drop")


def _rungs_to_refresh(log_moves: np.ndarray, bound: np.ndarray, max_length: int,
                      tolerance: float, words: float) -> np.ndarray:
    """The rungs to recompute: all but those with the smallest statistics at risk
    :math:`a_m` (:class:`Multicanonical`, ``tolerance``) whose sum stays within
    ``tolerance`` times the ``words``; ``log_moves`` (:data:`LENGTH_BINS`, M) is
    :math:`\\log\\sum_d q(y_d = m) w_{dm} L_d` by length bin
    (:attr:`StepInfo.log_rung_words`), and :math:`a_m` is formed in log space (NaN:
    recomputed)."""
    if tolerance <= 0:
        return np.arange(bound.shape[1])
    if not words > 0:  # no words at all: nothing at risk
        return np.arange(0)
    longest = np.minimum(2 ** np.arange(1, LENGTH_BINS + 1) - 1, max_length)
    longest[-1] = max_length
    log_ratio = log_moves - math.log(words)
    e = bound[longest]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # log(e^e - 1) = e + log(1 - e^-e); -inf where the bracket is 0
        log_expm1 = e + np.log(-np.expm1(-e))
        at_risk = np.exp(logsumexp(log_ratio + log_expm1, axis=0))
    at_risk = np.where(np.isnan(at_risk), np.inf, at_risk)
    order = np.argsort(at_risk, kind="stable")
    stale = np.cumsum(at_risk[order]) <= tolerance
    return np.sort(order[~stale])


#: the first table (before any minibatch has said which rungs matter) is computed exactly at
#: every COARSE_STRIDE-th rung; the rungs between are bracketed by convexity
#: (:func:`~numpyro_tempering.models.lda_partition.convex_bracket`) until the refresh rule
#: asks for them, as is every refresh's: its risky rungs on that grid first, then those
#: still at risk
COARSE_STRIDE = 4


class _Normaliser:
    """log C_d(T_m | current topics) for a fit's documents (:class:`Multicanonical`): the
    exact table of every rung, recomputed unless its exact error bound can only move a
    small share of the topic statistics (``mc.tolerance``). A rung's bound is the smaller
    of its stale bracket (its exact table at older topics,
    :func:`~numpyro_tempering.models.lda_partition.stale_table`) and its convexity bracket
    between the rungs computed at the current topics
    (:func:`~numpyro_tempering.models.lda_partition.convex_bracket`); T = 1 is exactly 0."""

    def __init__(self, mc: Multicanonical, alpha: float, lengths: np.ndarray):
        self.mc, self.alpha, self.lengths = mc, alpha, lengths
        self.max_length = int(lengths.max()) if lengths.size else 0
        self.exact: lda_partition.ExactTable | None = None
        self.rungs = 0  # rung tables computed
        temps = np.asarray(mc.temperatures, np.float64)
        self.grid = np.unique(np.append(np.arange(0, temps.size, COARSE_STRIDE), temps.size - 1))

    def table(self, lam, log_moves: np.ndarray | None = None, words: float = 0.0, *,
              coarse: bool = False) -> np.ndarray:
        """(D + 1, M) at the topics ``lam``; ``log_moves`` (LENGTH_BINS, M): a minibatch's
        :attr:`StepInfo.log_rung_words`, and ``words`` its words, lately (``None``:
        recompute every rung, or with ``coarse`` the rungs of the grid, bracketing the
        others). The brackets of the stale rungs come from the fast
        :math:`\\log b_k` (:func:`~numpyro_tempering.models.lda_partition.fast_topic_log_sums`,
        its rounding allowance times L added to them); the rungs recomputed use the float64
        ones."""
        lam = np.asarray(lam, np.float64)
        if not np.all(np.isfinite(lam) & (lam > 0)):
            raise FloatingPointError("log C_d(T | topics) is not finite: the topics' "
                                     "Dirichlet parameters are not finite and > 0.")
        temps = np.asarray(self.mc.temperatures, np.float64)
        log_b, allowance = lda_partition.fast_topic_log_sums(lam, temps, self.mc.topics)
        slack = np.arange(self.max_length + 1.0)[:, None] * allowance.max(axis=1)
        fresh = temps == 1.0  # T = 1: log C = 0 exactly (b_k(1) = 1), never computed
        if self.exact is None:  # nothing known yet: infinitely wide brackets but at T = 1
            error = np.where(fresh, 0.0, np.inf)[None, :].repeat(self.max_length + 1, 0)
            self.exact = lda_partition.ExactTable(
                np.zeros((self.max_length + 1, temps.size)), log_b.copy(), error)
        ends = None  # the closed-form ends of log C in 1/T, once something is bracketed
        if log_moves is None:
            pending = self.grid if coarse else np.arange(temps.size)
        else:
            pending = self._at_risk(log_b, slack, log_moves, words)
            on_grid = np.intersect1d(pending, self.grid)
            pending = on_grid if on_grid.size else pending
        while True:
            pending = pending[~fresh[pending]]
            if pending.size == 0:
                break
            exact_b = self.exact.log_b.copy()
            exact_b[pending] = lda_partition.fitted_topic_log_sums(lam, temps[pending],
                                                                   self.mc.topics)
            self.exact = lda_partition.exact_table(exact_b, temps, self.alpha, self.max_length,
                                                   previous=self.exact, rungs=pending)
            self.rungs += int(pending.size)
            fresh[pending] = True
            ends = ends or lda_partition.table_ends(lam, self.alpha, self.mc.topics)
            self._bracket(log_b, slack, temps, fresh, ends)
            if log_moves is None:
                break
            pending = self._at_risk(log_b, slack, log_moves, words)
        table, _ = lda_partition.stale_table(self.exact, log_b)
        if not np.all(np.isfinite(table)):
            raise FloatingPointError("log C_d(T | topics) is not finite.")
        return table[self.lengths.astype(np.int64)]

    def _at_risk(self, log_b, slack, log_moves, words) -> np.ndarray:
        _, bound = lda_partition.stale_table(self.exact, log_b)
        return _rungs_to_refresh(np.asarray(log_moves, np.float64), bound + slack,
                                 self.max_length, self.mc.tolerance, words)

    def _bracket(self, log_b, slack, temps, fresh, ends) -> None:
        """Give every rung not computed at these topics its convexity bracket between those
        that were, where that is narrower (at the longest document) than its stale one."""
        _, bound = lda_partition.stale_table(self.exact, log_b)
        known, other = np.flatnonzero(fresh & (temps != 1.0)), np.flatnonzero(~fresh)
        mid, half = lda_partition.convex_bracket(
            1.0 / temps[known], self.exact.table[:, known], 1.0 / temps[other], ends)
        half = half + 2 * slack[:, other]  # the fast sums, here and at the next refresh
        better = half[-1] < bound[-1, other] + slack[-1, other]
        rungs = other[better]
        self.exact.table[:, rungs], self.exact.log_b[rungs] = mid[:, better], log_b[rungs]
        self.exact.error[:, rungs] = half[:, better]


# -- evaluation --------------------------------------------------------------------------------


def heldout_log_likelihood(
    topics: jax.typing.ArrayLike,
    observed: Corpus,
    heldout: Corpus,
    *,
    alpha: float | None = None,
    max_doc_iter: int = 500,
    tol: float = 1e-5,
    batch_size: int = 512,
    per_document: bool = False,
) -> float | np.ndarray:
    r"""Held-out per-word log-likelihood by document completion (Mandt et al. 2016,
    section 4; Hoffman et al. 2010).

    For each test document, :math:`\gamma_d` is fitted on its ``observed`` words by the
    local updates at T = 1 (from :math:`\gamma = 1`, to ``tol``) under the topics
    ``topics`` = :math:`\lambda` (K, V) -- the topics' Dirichlet parameters: ours,
    scikit-learn's ``components_`` or gensim's ``state.get_lambda()`` -- and the
    ``heldout`` words are scored with the posterior means
    :math:`\bar\theta_d = \gamma_d/\sum_k\gamma_{dk}`, :math:`\bar\beta_k =
    \lambda_k/\sum_v\lambda_{kv}`:

    .. math::

        \frac{\sum_d \sum_{v} n^{\mathrm{held}}_{dv} \log \sum_k \bar\theta_{dk}\bar\beta_{kv}}
             {\sum_d \sum_v n^{\mathrm{held}}_{dv}}.

    ``alpha`` defaults to 1/K. With ``per_document=True`` returns the (D,) sums of held-out
    log probabilities instead. Non-finite topics give NaN, and so does a word that every
    topic gives probability 0 (or one below the dtype's range) where it occurs; negative
    topics are an error.

    Example:
        >>> from numpyro_tempering.models import corpora
        >>> obs = corpora.from_dense(np.array([[2, 0, 0]]))
        >>> held = corpora.from_dense(np.array([[1, 0, 1]]))
        >>> lam = np.array([[10.0, 0.0001, 10.0], [0.0001, 10.0, 0.0001]])
        >>> round(heldout_log_likelihood(lam, obs, held, alpha=0.01), 2)  # ~log(1/2) per word
        -0.7
    """
    lam = jnp.asarray(topics)
    if not jnp.issubdtype(lam.dtype, jnp.floating):
        lam = lam.astype(jnp.result_type(float))
    if lam.ndim != 2 or lam.shape[1] != observed.vocab_size:
        raise ValueError(f"`topics` must have shape (K, V={observed.vocab_size}), got "
                         f"{lam.shape}.")
    if observed.num_docs != heldout.num_docs or observed.vocab_size != heldout.vocab_size:
        raise ValueError("`observed` and `heldout` must hold the same documents and vocabulary.")
    if not bool(jnp.all(jnp.isfinite(lam))):
        return np.full(observed.num_docs, np.nan) if per_document else float("nan")
    if bool(jnp.any(lam < 0)):
        raise ValueError("`topics` must be >= 0 (Dirichlet parameters or word weights), got "
                         f"a smallest entry of {float(jnp.min(lam))}.")
    k = lam.shape[0]
    cfg = config(k, observed.vocab_size, observed.num_docs, alpha=alpha,
                 max_doc_iter=max_doc_iter, tol=tol)
    beta_bar = lam / jnp.sum(lam, axis=1, keepdims=True)
    scores = [
        np.asarray(_heldout_batch(cfg, lam, beta_bar, jnp.asarray(o_ids), jnp.asarray(o_cnt),
                                  jnp.asarray(h_ids), jnp.asarray(h_cnt)))
        for o_ids, o_cnt, h_ids, h_cnt in _chunks(observed, heldout, batch_size)
    ]
    per_doc = np.concatenate(scores)
    if per_document:
        return per_doc
    if heldout.num_words == 0:
        raise ValueError("`heldout` holds no words: the held-out log-likelihood per word is "
                         "undefined (use per_document=True for the per-document sums, 0 here).")
    return float(per_doc.sum() / heldout.num_words)


def _chunks(observed: Corpus, heldout: Corpus, size: int):
    for start in range(0, observed.num_docs, size):
        sl = slice(start, start + size)
        yield observed.ids[sl], observed.counts[sl], heldout.ids[sl], heldout.counts[sl]


@partial(jax.jit, static_argnums=0)
def _heldout_batch(cfg, lam, beta_bar, o_ids, o_cnt, h_ids, h_cnt):
    gamma0 = jnp.ones((o_ids.shape[0], cfg.num_topics), lam.dtype)
    gamma = _local_step(cfg, lam, o_ids, o_cnt, gamma0, 1.0, None).gamma
    theta_bar = gamma / jnp.sum(gamma, axis=1, keepdims=True)
    probs = jnp.einsum("bk,kbl->bl", theta_bar, jnp.take(beta_bar, h_ids, axis=1))
    h_cnt = jnp.asarray(h_cnt, lam.dtype)
    return jnp.sum(jnp.where(h_cnt > 0, h_cnt * jnp.log(probs), 0.0), axis=1)


# -- multicanonical: per-document log C ---------------------------------------------------------


def document_log_partition(
    seed: int | np.random.Generator,
    temperatures: np.typing.ArrayLike,
    num_topics: int,
    vocab_size: int,
    *,
    alpha: float | None = None,
    eta: float | None = None,
    num_beta: int = 10,
    num_theta: int = 200,
    form: str = "joint",
) -> Callable[[np.ndarray], np.ndarray]:
    r"""Per-document :math:`\log C_d(T_m)` as a function of the document length.

    The supplement's LDA route (Mandt et al. 2016, supplement eq. 6-7) for one document of
    :math:`L` words: :math:`C_d(T) = \mathbb E_{\beta}\mathbb E_{\theta}[s(\theta,\beta;T)^L]`,
    estimated with ``num_beta`` prior draws of :math:`\beta` and ``num_theta`` of
    :math:`\theta` per :math:`\beta` (NumPy, float64), pooled into one average over the
    :math:`S` = ``num_beta * num_theta`` pairs, where

    * ``form="collapsed"`` (supplement eq. 6): :math:`s = \sum_v (\sum_k\theta_k
      \beta_{kv})^{1/T}`, the normaliser of the tempered *collapsed* word likelihood;
    * ``form="joint"`` (default): :math:`s = \sum_k \theta_k^{1/T}\sum_v\beta_{kv}^{1/T}`,
      the normaliser of the tempered *joint* :math:`p(w, z\mid\theta,\beta)^{1/T}` -- the
      quantity the tempered updates of supplement eq. 9 (which temper the assignments
      z too) actually normalise, hence the consistent one for eq. 18. Since
      :math:`x \mapsto x^{1/T}` is subadditive, joint :math:`\ge` collapsed.

    Returns ``lengths -> (n, M)``. Caveat: at :math:`\alpha = 1/K` this Monte Carlo average
    is dominated by rare spread-out :math:`\theta` and is biased low for long documents (by
    ~10 nats at 100 words and hundreds at 1,300 against the exact value:
    ``benchmarks/lda_mvi_diagnosis.py``), and it averages over prior draws of the topics
    where a temperature per document needs them fixed. Kept for comparison; MVI's default
    is the exact :func:`numpyro_tempering.models.lda_partition.conditional_log_partition`.

    Example:
        >>> f = document_log_partition(0, [1.0, 2.0], 3, 10)
        >>> f(np.array([0, 5])).round(3).tolist()[0]  # an empty document: log C = 0
        [0.0, 0.0]
        >>> bool(abs(f(np.array([5]))[0, 0]) < 1e-9)  # T = 1: C = 1
        True
    """
    if form not in ("joint", "collapsed"):
        raise ValueError(f"`form` must be 'joint' or 'collapsed', got {form!r}.")
    inv_t = 1.0 / np.asarray(temperatures, np.float64)
    if inv_t.ndim != 1 or not np.all(np.isfinite(inv_t) & (inv_t > 0)):
        raise ValueError("`temperatures` must be a 1-D array of finite T > 0.")
    alpha = 1.0 / num_topics if alpha is None else alpha
    eta = 1.0 / num_topics if eta is None else eta
    rng = _rng(seed)
    tiny = np.finfo(np.float64).tiny
    log_s = []
    for _ in range(num_beta):
        log_beta = np.log(np.maximum(rng.dirichlet(np.full(vocab_size, eta), num_topics), tiny))
        theta = rng.dirichlet(np.full(num_topics, alpha), num_theta)
        if form == "joint":
            b = logsumexp(inv_t[:, None, None] * log_beta[None], axis=-1)  # (M, K)
            log_theta = np.log(np.maximum(theta, tiny))
            log_s.append(logsumexp(inv_t[:, None, None] * log_theta[None]
                                       + b[:, None, :], axis=-1))  # (M, S_theta)
        else:
            log_p = np.log(theta @ np.exp(log_beta))  # (S_theta, V)
            log_s.append(np.stack([logsumexp(t * log_p, axis=-1) for t in inv_t]))
    log_s = np.concatenate(log_s, axis=1)  # (M, S)

    def log_c(lengths: np.ndarray) -> np.ndarray:
        uniq, inverse = np.unique(np.asarray(lengths, np.float64), return_inverse=True)
        table = logsumexp(uniq[:, None, None] * log_s[None], axis=-1) - np.log(
            log_s.shape[1])  # (U, M)
        return table[inverse.reshape(-1)]

    return log_c
