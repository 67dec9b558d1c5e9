r"""Black-box LDA: stock NumPyro ``SVI`` on collapsed LDA with any guide, plain, annealed or
multicanonical.

The model is :func:`numpyro_tempering.models.lda.corpus_model`, collapsed LDA with the
topic assignments summed out (Mandt et al. 2016, supplement eq. 5), on a sparse corpus
(documents as padded ``(index, count)`` arrays, minibatches by ``plate("docs",
subsample_size=B)``). Unlike the conjugate route (:mod:`~numpyro_tempering.models.lda_svi`,
closed-form updates), the guide here is arbitrary and fitted by reparameterised Monte Carlo
gradients of the (tempered) ELBO with Adam. Every guide puts
:math:`q(\beta_k) = \mathrm{Dir}(\lambda_k)` on the topics (param ``lam`` (K, V)), so the
fitted topics are scored by the same document-completion function as every other method
(:func:`~numpyro_tempering.models.lda_svi.heldout_log_likelihood` on ``lam``), and one of
three families on the proportions :math:`\theta_d`:

* ``"dirichlet"``: mean field, :math:`q(\theta_d) = \mathrm{Dir}(\gamma_d)`, one free
  :math:`\gamma_d` per document (param ``gamma`` (D, K));
* ``"logistic_normal"``: :math:`\theta_d = \mathrm{softmax}([u_d, 0])`,
  :math:`u_d \sim \mathcal N(\mu_d, \mathrm{diag}\,\sigma_d^2)` (params ``loc``, ``scale``
  (D, K-1); :class:`numpyro_tempering.guides.LogisticNormal`);
* ``"amortised"``: an encoder for LDA as a VAE (amortised inference, cf. Srivastava and
  Sutton 2017):
  :math:`\gamma_d = \mathrm{MLP}(w_d)`, :math:`q(\theta_d) = \mathrm{Dir}(\gamma_d)`, one
  network for all documents (:func:`encoder_apply`, plain JAX; params ``enc_*``);
* ``"local"`` (the default of :func:`fit`): :math:`q(\theta_d) = \mathrm{Dir}(\gamma_d)`
  with :math:`\gamma_d` not a parameter but the minibatch's local optimum given the current
  topics -- a fixed number of the coordinate-ascent sweeps of online VB's local step
  (Hoffman et al. 2013; :func:`local_gamma`), held fixed for the gradient -- so that only
  the topics are learnt by Monte Carlo gradients. No parameters besides ``lam``.

Why ``"local"`` is the default (``benchmarks/lda_blackbox.py``, docs/reproductions.md): a
free :math:`\gamma_d` per document gets one Adam step each time its document is in a
minibatch (about one per pass), so the proportions, and with them the topics' gradient, stay
near the prior for tens of passes; the encoder learns no faster at these budgets. With the
local optimum and Adam's step size 0.2 on :math:`\log\lambda` (0.05 moved
:math:`\log\lambda` by at most 0.05 per update, too little to separate the words in a few
dozen updates), Reuters K = 20 reaches the conjugate route's held-out score after 2 passes
within 4 passes.

The topics' draws (:class:`ImplicitDirichlet`) are numpyro's Dirichlet with a sampler and an
implicit reparameterisation gradient (Figurnov et al. 2018) vectorised over the (K, V)
array: JAX draws and differentiates Gamma variates one element at a time on a CPU, which
made an update 250-400x one log density + gradient of its minibatch.

Temperatures (``temperature=`` of :func:`fit`): a number T (``TemperedELBO(temperature=T)``;
T = 1 is plain SVI, where the loss equals ``Trace_ELBO``'s), a schedule ``step -> T``
(annealing: ``SVI(temper(model, schedule), ..., TemperedELBO())``, Mandt et al. 2016,
eq. 7), or a :class:`~numpyro_tempering.Ladder` (MVI: ``MulticanonicalELBO(ladder,
plate="docs", joint=True)``, a temperature per document with :math:`q(y_d)` by eq. 18).

MVI tempers each word's joint :math:`p(w, z\mid\theta,\beta)` before its topic is summed
out (:class:`~numpyro_tempering.models.lda.JointWordCounts`), as the conjugate route and the
paper's updates do, so that the document's normaliser is the exact
:math:`C_d(T\mid\bar\beta)` of :mod:`~numpyro_tempering.models.lda_partition` (the same
one as :mod:`~numpyro_tempering.models.lda_svi`'s), computed at the topics' current mean
:math:`\bar\beta = \lambda/\sum_v\lambda` and recomputed every ``log_c_every`` updates
as the topics are learnt. The normaliser is passed to the model as data (``log_c``) and
sits inside the tempered likelihood, so the ladder's own log C is 0. A ladder that already
holds per-document ``element_log_c`` (e.g. :func:`mvi_ladder`'s, the supplement's
prior Monte Carlo for the collapsed likelihood, eq. 6-7, biased low for long documents)
runs the collapsed form with those values instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import random
from numpyro.infer import SVI

from numpyro_tempering import schedules
from numpyro_tempering.guides import LogisticNormal
from numpyro_tempering.handlers import Selection, temper
from numpyro_tempering.ladder import UNCHECKED, Ladder
from numpyro_tempering.models import lda, lda_partition, lda_svi
from numpyro_tempering.models.corpora import Corpus
from numpyro_tempering.objectives import MulticanonicalELBO, TemperedELBO

__all__ = [
    "DEFAULT_LEARNING_RATE",
    "GUIDES",
    "LOCAL_SWEEPS",
    "BlackBoxResult",
    "ImplicitDirichlet",
    "default_optimizer",
    "encoder_apply",
    "encoder_init",
    "fit",
    "gamma_log_grad",
    "local_gamma",
    "make_guide",
    "make_model",
    "mvi_ladder",
]

#: The families on the topic proportions.
GUIDES = ("dirichlet", "logistic_normal", "amortised", "local")
_FLOOR = 1e-3  # smallest Dirichlet concentration the encoder emits
_ENCODER_PARAMS = ("enc_b1", "enc_b2", "enc_w1", "enc_w2")
#: Adam's step size in :func:`fit` unless given.
DEFAULT_LEARNING_RATE = 0.2


def default_optimizer(learning_rate: float = DEFAULT_LEARNING_RATE
                      ) -> optax.GradientTransformation:
    """The optimiser of :func:`fit`: ``optax.adam(learning_rate)``, constant (a cosine decay
    to 0 over the fit was no better on Reuters, docs/reproductions.md).

    Example:
        >>> opt = default_optimizer(0.05)
        >>> callable(opt.update)
        True
    """
    return optax.adam(learning_rate)


_SERIES_TERMS = 12  # x < 1: the series' first omitted term is below 1/13! < 2e-10


def _log_gamma_draw(key: jax.Array, alpha: jax.Array) -> jax.Array:
    """log Gamma(alpha, 1) draws by Marsaglia and Tsang (2000) on the whole array at once:
    rounds of one normal and one uniform per element until every element has accepted a
    proposal (about 95% accept in each round), boosted in log space for alpha < 1
    (Gamma(a) = Gamma(a + 1) U^(1/a)), as ``jax.random.loggamma`` does one element at a
    time (10x slower for a (K, V) array on a CPU; a different stream of draws)."""
    dtype = alpha.dtype
    boost = alpha < 1
    d = jnp.where(boost, alpha + 1, alpha) - 1.0 / 3.0
    c = jax.lax.rsqrt(9.0 * d)
    key, key_boost = random.split(key)

    def body(state):
        key, log_dv, done = state
        key, key_x, key_u = random.split(key, 3)
        x = random.normal(key_x, alpha.shape, dtype)
        u = random.uniform(key_u, alpha.shape, dtype)
        v = (1 + c * x) ** 3
        ok = (v > 0) & (jnp.log(u) < 0.5 * x * x + d - d * v + d * jnp.log(v))
        log_dv = jnp.where(done | ~ok, log_dv, jnp.log(d) + jnp.log(v))
        return key, log_dv, done | ok

    valid = jnp.isfinite(alpha) & (alpha > 0)  # others never accept: NaN, not a hang
    _, log_dv, _ = jax.lax.while_loop(lambda state: ~jnp.all(state[2]), body,
                                      (key, jnp.where(valid, 0.0, jnp.nan).astype(dtype),
                                       ~valid))
    log_u = -random.exponential(key_boost, alpha.shape, dtype)
    return log_dv + jnp.where(boost, log_u / alpha, 0.0)


def gamma_log_grad(alpha: jax.typing.ArrayLike, log_x: jax.typing.ArrayLike) -> jax.Array:
    r"""The implicit reparameterisation gradient (Figurnov et al. 2018) of a
    :math:`\mathrm{Gamma}(\alpha, 1)` draw :math:`x`, in log space:
    :math:`\partial\log x/\partial\alpha = -\frac{\partial F(x;\alpha)/\partial\alpha}
    {x\,p(x;\alpha)}`, :math:`F` the CDF.

    For :math:`x < 1` (most draws of small concentrations) from the series
    :math:`F = \frac{x^\alpha}{\Gamma(\alpha)}\sum_n \frac{(-x)^n}{n!\,(\alpha+n)}`
    (Abramowitz and Stegun 6.5.29), differentiated in :math:`\alpha` and arranged so that
    nothing cancels as :math:`\alpha \to 0`:

    .. math::

        \frac{\partial\log x}{\partial\alpha} = -e^{x}\Big[(\log x - \psi(\alpha + 1))
            \sum_{n\ge 0}\frac{(-x)^n}{n!\,(\alpha+n)}
            + \frac1\alpha\sum_{n\ge 1}\frac{n\,(-x)^n}{n!\,(\alpha+n)^2}\Big]

    (12 terms, elementwise, from :math:`\log x`: no underflow for tiny :math:`x`); for
    :math:`x \ge 1` by ``jax.lax.random_gamma_grad(alpha, x) / x`` on those elements
    only, gathered in chunks of an eighth of the array (its iterative series and continued
    fraction then run on the chunk, not on every element).

    Example:
        >>> a, x = jnp.array([0.01, 0.5, 3.0, 40.0]), jnp.array([1e-30, 0.2, 2.5, 39.0])
        >>> bool(jnp.allclose(gamma_log_grad(a, jnp.log(x)),
        ...                   jax.lax.random_gamma_grad(a, x) / x, rtol=1e-4))
        True
    """
    alpha = jnp.asarray(alpha)
    log_x = jnp.asarray(log_x, alpha.dtype)
    alpha, log_x = jnp.broadcast_arrays(alpha, log_x)
    x = jnp.exp(log_x)
    small = x < 1.0
    xs = jnp.where(small, x, 0.0)
    s1, s2, term = 1.0 / alpha, jnp.zeros_like(alpha), jnp.ones_like(alpha)
    for n in range(1, _SERIES_TERMS + 1):
        term = term * (-xs) / n
        s1 = s1 + term / (alpha + n)
        s2 = s2 + term * n / (alpha + n) ** 2
    series = -jnp.exp(xs) * ((jnp.where(small, log_x, 0.0)
                              - lda_svi.digamma_positive(alpha + 1)) * s1 + s2 / alpha)
    big = ~small.ravel()
    if big.size == 0:
        return series
    cap = max(1, -(-big.size // 8))
    rank = jnp.cumsum(big) - 1
    a_flat, x_flat = alpha.ravel(), x.ravel()

    def chunk(state):  # the next `cap` elements with x >= 1 (JAX's series / continued
        j, flat = state  # fraction; x = 0 disables an element's iterations)
        sel = big & (rank // cap == j)
        (idx,) = jnp.nonzero(sel, size=cap, fill_value=0)
        keep = sel[idx]
        xb = jnp.where(keep, x_flat[idx], 0.0)
        out = jax.lax.random_gamma_grad(jnp.where(keep, a_flat[idx], 1.0), xb) / jnp.where(
            keep, xb, 1.0)
        return j + 1, flat.at[idx].set(jnp.where(keep, out, flat[idx]))

    _, flat = jax.lax.while_loop(lambda state: state[0] * cap < jnp.sum(big), chunk,
                                 (0, series.ravel()))
    return flat.reshape(alpha.shape)


@jax.custom_jvp
def _log_gamma(key: jax.Array, alpha: jax.Array) -> jax.Array:
    """log Gamma(alpha, 1) draws (:func:`_log_gamma_draw`) with the implicit gradient of
    :func:`gamma_log_grad`."""
    return _log_gamma_draw(key, alpha)


@_log_gamma.defjvp
def _log_gamma_jvp(primals, tangents):
    key, alpha = primals
    log_x = _log_gamma(key, alpha)
    return log_x, tangents[1] * gamma_log_grad(alpha, log_x)


class ImplicitDirichlet(dist.Dirichlet):
    r"""``numpyro.distributions.Dirichlet`` with a faster sampler and implicit
    reparameterisation gradient (Figurnov et al. 2018) for large concentration arrays such
    as the (K, V) topics: :math:`\beta = x/\sum_k x_k` with :math:`x_k \sim
    \mathrm{Gamma}(\alpha_k, 1)` drawn in log space by Marsaglia and Tsang (2000) on the
    whole array (:func:`_log_gamma_draw`), and

    .. math::

        \frac{\partial x_k}{\partial\alpha_k} = -\frac{\partial F(x_k;\alpha_k)/
        \partial\alpha_k}{p(x_k;\alpha_k)}

    by :func:`gamma_log_grad`. The same distribution and gradient as numpyro's
    ``Dirichlet`` (whose draws and, on a CPU, whose gradient JAX computes one element at a
    time); a different stream of draws for the same key. ``benchmarks/lda_blackbox.py``
    times both.

    Example:
        >>> lam = jnp.array([[0.3, 2.0, 5.0]])
        >>> draws = ImplicitDirichlet(lam).sample(jax.random.PRNGKey(0), (4000,))
        >>> bool(jnp.allclose(draws.mean(0), lam / lam.sum(), atol=0.02))
        True
    """

    def sample(self, key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        shape = sample_shape + self.batch_shape + self.event_shape
        conc = jnp.broadcast_to(self.concentration, shape)
        samples = jax.nn.softmax(_log_gamma(key, conc), axis=-1)
        finfo = jnp.finfo(samples.dtype)
        return jnp.clip(samples, finfo.tiny, 1 - finfo.eps)


def encoder_init(
    key: jax.Array, vocab_size: int, num_topics: int, hidden: int = 100, dtype: Any = None
) -> dict[str, jax.Array]:
    """Parameters of the amortised encoder (:func:`encoder_apply`): ``enc_w1`` (V, H),
    ``enc_b1`` (H,), ``enc_w2`` (H, K), ``enc_b2`` (K,); Gaussian weights (standard
    deviation 0.1 for the first layer, :math:`1/\\sqrt H` for the second), zero biases.

    Example:
        >>> p = encoder_init(jax.random.PRNGKey(0), 30, 4, hidden=8)
        >>> {k: v.shape for k, v in sorted(p.items())}
        {'enc_b1': (8,), 'enc_b2': (4,), 'enc_w1': (30, 8), 'enc_w2': (8, 4)}
    """
    dtype = jnp.result_type(float) if dtype is None else dtype
    k1, k2 = random.split(key)
    return {
        "enc_w1": 0.1 * random.normal(k1, (vocab_size, hidden), dtype),
        "enc_b1": jnp.zeros((hidden,), dtype),
        "enc_w2": random.normal(k2, (hidden, num_topics), dtype) / math.sqrt(hidden),
        "enc_b2": jnp.zeros((num_topics,), dtype),
    }


def encoder_apply(
    params: dict[str, jax.Array], ids: jax.typing.ArrayLike, counts: jax.typing.ArrayLike
) -> jax.Array:
    r"""Dirichlet concentrations :math:`\gamma_d = \mathrm{MLP}(w_d)` (amortised LDA, cf.
    Srivastava and Sutton 2017) for documents as padded ``(index, count)`` rows (B, W):

    .. math::

        h_d = \mathrm{softplus}\big(\textstyle\sum_w \log(1 + n_{dw})\,W_1[v_w] + b_1\big),
        \qquad \gamma_d = \mathrm{softplus}(h_d W_2 + b_2) + 10^{-3},

    the first layer a sparse product (rows of :math:`W_1` gathered at the listed words, never
    a dense bag of words). Returns (B, K), every entry :math:`\ge 10^{-3}`.

    Example:
        >>> p = encoder_init(jax.random.PRNGKey(0), 30, 4, hidden=8)
        >>> g = encoder_apply(p, jnp.array([[1, 5, 0]]), jnp.array([[2, 1, 0]]))
        >>> g.shape, bool(jnp.all(g > 0))
        ((1, 4), True)
    """
    w1 = params["enc_w1"]
    x = jnp.log1p(jnp.asarray(counts, w1.dtype))  # padding: log 1 = 0
    h = jax.nn.softplus(jnp.einsum("bw,bwh->bh", x, jnp.take(w1, jnp.asarray(ids), axis=0))
                        + params["enc_b1"])
    return jax.nn.softplus(h @ params["enc_w2"] + params["enc_b2"]) + _FLOOR


#: sweeps of the ``"local"`` guide's fixed point per update (:func:`local_gamma`): 20 gave the
#: same held-out as 30 at 8 passes (Reuters, 3 seeds) and an update of 18.4-18.7x a log
#: density + gradient of its minibatch instead of 21-22x (docs/reproductions.md, issue 22)
LOCAL_SWEEPS = 20


def local_gamma(
    lam: jax.typing.ArrayLike,
    ids: jax.typing.ArrayLike,
    counts: jax.typing.ArrayLike,
    alpha: float,
    num_iter: int = LOCAL_SWEEPS,
) -> jax.Array:
    r"""The documents' mean-field :math:`\gamma_d` (B, K) under topics
    :math:`q(\beta) = \mathrm{Dir}(\lambda)`: ``num_iter`` sweeps of the coordinate-ascent
    fixed point (Hoffman et al. 2013, online VB's local step) from :math:`\gamma = 1`,

    .. math::

        \gamma_{dk} \leftarrow \alpha + e^{\mathbb E\log\theta_{dk}} \sum_w
        \frac{n_{dw}\, e^{\mathbb E\log\beta_{kv_w}}}{\sum_j e^{\mathbb E\log\theta_{dj}}
        e^{\mathbb E\log\beta_{jv_w}}},

    for documents as padded ``(index, count)`` rows (B, W). A fixed number of sweeps (no
    tolerance), so that its cost is known; no gradient flows to ``lam``. The sweeps are
    T = 1's also when :func:`fit` tempers the likelihood: there the guide is still a valid
    family, not the tempered local optimum.

    Example:
        >>> lam = jnp.array([[5.0, 1.0, 1.0], [1.0, 1.0, 5.0]])
        >>> g = local_gamma(lam, jnp.array([[0, 2]]), jnp.array([[3, 0]]), 0.5)
        >>> [round(float(x), 2) for x in g[0]]  # alpha = 1/2, + ~3 words to topic 0
        [3.48, 0.52]
    """
    lam = jax.lax.stop_gradient(jnp.asarray(lam))
    counts = jnp.asarray(counts, lam.dtype)
    elog = lda_svi._gather(lda_svi.expected_log_topics(lam), jnp.asarray(ids))
    ew = jnp.exp(elog - jnp.max(elog, axis=1, keepdims=True))  # scaled as lda_svi's
    num_docs = counts.shape[0]
    sweep = lda_svi._fixed_sweep(jnp.asarray(alpha, lam.dtype), jnp.finfo(lam.dtype).tiny)
    ones, docs = jnp.ones((num_docs,), lam.dtype), jnp.arange(num_docs)  # T = 1, a row each
    return jax.lax.fori_loop(0, int(num_iter),
                             lambda _, g: sweep(g, ones, (ew, counts), docs)[0],
                             jnp.ones((num_docs, lam.shape[0]), lam.dtype))


def make_model(
    num_topics: int,
    vocab_size: int,
    *,
    alpha: float | None = None,
    eta: float | None = None,
    subsample_size: int | None = None,
    joint: bool = False,
    inv_temperatures: Any = None,
) -> Callable:
    """:func:`~numpyro_tempering.models.lda.corpus_model` with its static settings bound:
    ``model(ids, counts)`` (``model(ids, counts, log_c)`` with ``joint``, see there).

    Example:
        >>> from numpyro.infer.util import log_density
        >>> m = make_model(2, 3)
        >>> lp, _ = log_density(m, (jnp.array([[0]]), jnp.array([[1]])), {},
        ...                     {"beta": jnp.array([[0.5, 0.3, 0.2], [0.1, 0.5, 0.4]]),
        ...                      "theta": jnp.array([[0.9, 0.1]])})
        >>> bool(jnp.isfinite(lp))
        True
    """
    return partial(lda.corpus_model, num_topics=num_topics, vocab_size=vocab_size,
                   alpha=alpha, eta=eta, subsample_size=subsample_size, joint=joint,
                   inv_temperatures=inv_temperatures)


def make_guide(
    kind: str,
    num_topics: int,
    vocab_size: int,
    *,
    subsample_size: int | None = None,
    hidden: int = 100,
    alpha: float | None = None,
    local_iter: int = LOCAL_SWEEPS,
) -> Callable:
    r"""A guide ``guide(ids, counts, log_c=None)`` for :func:`make_model`: :math:`q(\beta_k) =
    \mathrm{Dir}(\lambda_k)` (param ``lam``, initialised
    :math:`\exp\{\mathcal N(0, 0.1^2)\}`, about online VB's
    :math:`\mathrm{Gamma}(100, 0.01)`) and ``kind`` in :data:`GUIDES` on :math:`\theta_d`
    (see the module docstring). ``subsample_size`` must be the model's; ``alpha`` (default
    1/K) and ``local_iter`` are the ``"local"`` guide's prior concentration and sweeps
    (:func:`local_gamma`).

    Example:
        >>> from numpyro import handlers
        >>> guide = make_guide("amortised", 2, 3, hidden=4)
        >>> values = {"beta": jnp.full((2, 3), 1 / 3), "theta": jnp.full((1, 2), 0.5)}
        >>> tr = handlers.trace(handlers.substitute(handlers.seed(guide, 0), values)).get_trace(
        ...     jnp.array([[0, 2]]), jnp.array([[3, 1]]))
        >>> sorted(n for n, site in tr.items() if site["type"] == "param")
        ['enc_b1', 'enc_b2', 'enc_w1', 'enc_w2', 'lam']
    """
    if kind not in GUIDES:
        raise ValueError(f"`guide` must be one of {GUIDES}, got {kind!r}.")
    if int(local_iter) != local_iter or local_iter < 1:
        raise ValueError(f"`local_iter` must be a positive integer, got {local_iter!r}.")
    k, v = int(num_topics), int(vocab_size)
    alpha = 1.0 / k if alpha is None else float(alpha)

    def guide(ids, counts, log_c=None):
        ids = jnp.asarray(ids)
        num_docs = ids.shape[0]
        lam = numpyro.param("lam", lambda key: jnp.exp(0.1 * random.normal(key, (k, v))),
                            constraint=dist.constraints.positive)
        numpyro.sample("beta", ImplicitDirichlet(lam).to_event(1))
        if kind == "dirichlet":
            gamma = numpyro.param("gamma", jnp.ones((num_docs, k)),
                                  constraint=dist.constraints.positive)
        elif kind == "logistic_normal":
            loc = numpyro.param("loc", jnp.zeros((num_docs, k - 1)))
            scale = numpyro.param("scale", jnp.full((num_docs, k - 1), 0.5),
                                  constraint=dist.constraints.positive)
        elif kind == "amortised":
            enc = {name: numpyro.param(name, lambda key, name=name: encoder_init(
                key, v, k, hidden)[name]) for name in _ENCODER_PARAMS}
        with numpyro.plate("docs", num_docs, subsample_size=subsample_size, dim=-1) as idx:
            if kind == "dirichlet":
                numpyro.sample("theta", ImplicitDirichlet(gamma[idx]))
            elif kind == "logistic_normal":
                numpyro.sample("theta", LogisticNormal(loc[idx], scale[idx]))
            elif kind == "local":
                numpyro.sample("theta", ImplicitDirichlet(local_gamma(
                    lam, ids[idx], jnp.asarray(counts)[idx], alpha, local_iter)))
            else:
                numpyro.sample("theta", ImplicitDirichlet(
                    encoder_apply(enc, ids[idx], jnp.asarray(counts)[idx])))

    return guide


def mvi_ladder(
    ladder: Ladder,
    corpus: Corpus,
    num_topics: int,
    *,
    seed: int = 0,
    alpha: float | None = None,
    eta: float | None = None,
    **kwargs: Any,
) -> Ladder:
    r"""``ladder`` with the per-document :math:`\log c_d(T_m)` of the collapsed word
    likelihood of ``corpus`` (plate ``"docs"``): the supplement's route, eq. 6-7
    (:func:`~numpyro_tempering.models.lda_svi.document_log_partition` with
    ``form="collapsed"``, the normaliser of :class:`~numpyro_tempering.models.lda.WordCounts`
    raised to :math:`1/T`), by document length. A Monte Carlo estimate from prior draws,
    biased low for long documents (docs/lda.md); ``sizes=UNCHECKED``: the values are
    for this corpus only. ``kwargs`` go to ``document_log_partition``.

    Example:
        >>> from numpyro_tempering.models import corpora
        >>> data, _ = corpora.synthetic(0, 5, 10, 2, 8)
        >>> lad = mvi_ladder(Ladder([1.0, 2.0]), data, 2)
        >>> lad.element_log_c.shape, lad.plate
        ((2, 5), 'docs')
    """
    log_c = lda_svi.document_log_partition(seed, ladder.temperatures, num_topics,
                                           corpus.vocab_size, alpha=alpha, eta=eta,
                                           form="collapsed", **kwargs)
    elements = np.asarray(log_c(corpus.lengths)).T  # (M, D)
    return ladder.with_log_partition_values(element_log_c=elements, plate="docs",
                                            sizes=UNCHECKED)


def _joint_log_c(lam: jax.Array, ladder: Ladder, alpha: float | None,
                 lengths: np.ndarray) -> jax.Array:
    """(D, M) exact log C_d(T_m | mean topics) of the joint form, as the model's data
    (``alpha`` None: the model's default 1/K)."""
    lam = np.asarray(lam, np.float64)
    alpha = 1.0 / lam.shape[0] if alpha is None else alpha
    if not np.all(np.isfinite(lam) & (lam > 0)):  # the fit went non-finite: NaN, not a guess
        return jnp.full((len(lengths), len(ladder.temperatures)), jnp.nan)
    table = lda_partition.conditional_log_partition(lam, ladder.temperatures, alpha, lengths,
                                                    topics="mean")
    return jnp.asarray(table, jnp.result_type(float))


class BlackBoxResult(NamedTuple):
    """A black-box fit: ``lam`` (K, V) the topics' Dirichlet parameters (NaN if the fit
    went non-finite); ``params`` every guide parameter; ``losses`` (steps,) the SVI loss per
    update (minibatch estimates); ``temperatures`` (steps,) T per update (MVI: the
    minibatch mean of :math:`\\mathbb E_{q(y_d)}[T]`, evaluated after each update);
    ``seconds`` (updates, compilation excluded), ``compile_seconds``, ``num_steps``,
    ``docs_per_second``, ``num_nonfinite`` (updates whose loss was not finite)."""

    lam: np.ndarray
    params: dict
    losses: np.ndarray
    temperatures: np.ndarray
    seconds: float
    compile_seconds: float
    num_steps: int
    docs_per_second: float
    num_nonfinite: int


def fit(
    corpus: Corpus,
    num_topics: int,
    *,
    guide: str = "local",
    passes: float = 1.0,
    batch_size: int = 100,
    temperature: float | Callable | Ladder = 1.0,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    num_particles: int = 1,
    hidden: int = 100,
    local_iter: int = LOCAL_SWEEPS,
    alpha: float | None = None,
    eta: float | None = None,
    seed: int = 0,
    log_c_every: int = 10,
    progress_bar: bool = False,
    callback: Callable[[int, dict], Any] | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> BlackBoxResult:
    r"""Fit collapsed LDA with stock NumPyro ``SVI`` and Adam (``optax.adam(learning_rate)``).

    Args:
        corpus: training documents.
        num_topics: K.
        guide: a family of :data:`GUIDES`.
        passes: ``ceil(passes * D / batch_size)`` updates, each on a random minibatch of
            ``batch_size`` documents (``plate`` subsampling, without replacement).
        temperature: T (``TemperedELBO(temperature=T)``), a schedule ``step -> T``
            (annealing, ``temper(model, schedule)``), or a :class:`~numpyro_tempering.Ladder`
            (MVI with a temperature per document: joint tempering with the exact
            :math:`\log C_d(T\mid\bar\beta)`, see the module docstring; a ladder holding
            per-document ``element_log_c`` runs the collapsed form with those).
        learning_rate, num_particles: Adam's step size (on the unconstrained
            :math:`\log\lambda`, :data:`DEFAULT_LEARNING_RATE`); Monte Carlo particles per
            update.
        hidden: width of the amortised encoder's hidden layer.
        local_iter: sweeps of the ``"local"`` guide's fixed point per update.
        alpha, eta: Dirichlet concentrations (default 1/K).
        seed: initialisation, minibatches and Monte Carlo draws.
        log_c_every: MVI (joint form): recompute the documents' normalisers from the
            current topics every this many updates (their time is in ``seconds``).
        progress_bar: show a tqdm bar.
        callback: called as ``callback(step, params)`` after every update (``step`` counts
            from 1; ``params`` the constrained guide parameters), e.g. to score the topics
            at chosen passes; its time is in ``seconds``.
        optimizer: an optax optimiser instead of the default
            (:func:`default_optimizer`; ``learning_rate`` is then unused).

    The initialisation and the update (``svi.update``) are compiled once per call and timed
    separately (``compile_seconds``).

    Example (a fit compiles for 10-30 s on a CPU: the reparameterised Dirichlet sampler and
    its implicit gradient; ``tests/test_lda_blackbox.py`` runs fits):

        >>> from numpyro_tempering.models import corpora
        >>> data, _ = corpora.synthetic(0, 30, 20, 2, 15)
        >>> fit(data, 2, guide="gaussian")
        Traceback (most recent call last):
        ...
        ValueError: `guide` must be one of ('dirichlet', ...), got 'gaussian'.
    """
    num_docs = corpus.num_docs
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
    batch_size = min(int(batch_size), num_docs)
    if not (math.isfinite(passes) and passes > 0):
        raise ValueError(f"`passes` must be a finite number > 0, got {passes!r}.")
    if not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"`learning_rate` must be a finite number > 0, got {learning_rate!r}.")
    if guide not in GUIDES:
        raise ValueError(f"`guide` must be one of {GUIDES}, got {guide!r}.")
    num_steps = int(math.ceil(passes * num_docs / batch_size))
    subsample = None if batch_size == num_docs else batch_size
    mvi = isinstance(temperature, Ladder)
    joint = mvi and temperature.element_log_c is None
    if int(log_c_every) != log_c_every or log_c_every < 1:
        raise ValueError(f"`log_c_every` must be a positive integer, got {log_c_every!r}.")
    ladder = temperature if mvi else None
    if joint:  # the normaliser lives in the model (JointWordCounts): the ladder's log C is 0
        ladder = temperature.with_log_partition_values(
            element_log_c=np.zeros((len(temperature.temperatures), num_docs)), plate="docs",
            sizes=UNCHECKED, selection=Selection.of(joint=True))
    model = make_model(num_topics, corpus.vocab_size, alpha=alpha, eta=eta,
                       subsample_size=subsample, joint=joint,
                       inv_temperatures=(jnp.asarray(ladder.inverse_temperatures) if joint
                                         else None))
    q = make_guide(guide, num_topics, corpus.vocab_size, subsample_size=subsample,
                   hidden=hidden, alpha=alpha, local_iter=local_iter)
    if mvi:
        objective = MulticanonicalELBO(ladder, plate="docs", num_particles=num_particles)
        temps = None
    elif callable(temperature):
        schedules.validate(temperature, name="temperature")
        model = temper(model, temperature)
        objective = TemperedELBO(num_particles)
        temps = np.asarray(schedules.trajectory(temperature, num_steps))
    else:
        t = float(temperature)
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"`temperature` must be a finite T > 0, a schedule or a Ladder, "
                             f"got {temperature!r}.")
        objective = TemperedELBO(num_particles, temperature=t)
        temps = np.full(num_steps, t)
    if optimizer is None:
        optimizer = default_optimizer(learning_rate)
    svi = SVI(model, q, optimizer, objective)
    ids, counts = jnp.asarray(corpus.ids), jnp.asarray(corpus.counts)
    key_init, key_post = random.split(random.PRNGKey(seed))
    start = time.perf_counter()
    # compiled: eager initialisation runs the Dirichlet sampler op by op (10x slower)

    def data_at(lam):
        """The model's arguments; in the joint form with log C_d at the topics ``lam``
        (``None``: initialisation only traces the model, any table of the shape will do)."""
        if not joint:
            return ids, counts
        if lam is None:
            return ids, counts, jnp.zeros((num_docs, len(ladder.temperatures)))
        return ids, counts, _joint_log_c(lam, ladder, alpha, corpus.lengths)

    state = jax.jit(lambda key: svi.init(key, *data_at(None)))(key_init)
    data = data_at(svi.get_params(state)["lam"])
    update = jax.jit(svi.update).lower(state, *data).compile()
    posterior = None
    if mvi:
        posterior = jax.jit(lambda params, key, *data: objective.temperature_posterior(
            key, params, model, q, *data).mean_temperature.mean())
        posterior(svi.get_params(state), key_post, *data)  # compiled here, not in the timing
    compile_seconds = time.perf_counter() - start

    bar = lda_svi.progress(num_steps, progress_bar, "black-box LDA")
    losses, mvi_temps = [], []
    start = time.perf_counter()
    for step in range(num_steps):
        if joint and step and step % log_c_every == 0:
            data = data_at(svi.get_params(state)["lam"])
        state, loss = update(state, *data)
        losses.append(loss)
        if callback is not None:
            callback(step + 1, svi.get_params(state))
        if posterior is not None:
            mvi_temps.append(posterior(svi.get_params(state), random.fold_in(key_post, step),
                                       *data))
        if bar is not None:
            bar.update(1)
    params = jax.block_until_ready(svi.get_params(state))
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    losses = np.asarray(jnp.stack(losses))
    if mvi:
        temps = np.asarray(jnp.stack(mvi_temps))
    lam = np.asarray(params["lam"])
    if not np.all(np.isfinite(lam)):
        lam = np.full_like(lam, np.nan)  # numerical trouble is NaN, never a finite guess
    return BlackBoxResult(lam, params, losses, temps, seconds, compile_seconds, num_steps,
                          num_steps * batch_size / seconds if seconds > 0 else float("inf"),
                          int(np.sum(~np.isfinite(losses))))

