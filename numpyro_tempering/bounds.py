r"""Evidence-bound estimators: pure functions of a vector of log importance weights.

For particles :math:`z_s \sim q`, :math:`s = 1..S`, with log weights
:math:`\log w_s = \log p(x, z_s) - \log q(z_s)` (``LogWeights.log_w`` from
:func:`numpyro_tempering.engine.log_weights`), this module estimates the bounds on the log
evidence :math:`\log Z = \log p(x)` of Pradier et al. 2019:

=====================  =============================================================  ========
function               estimate                                                       bound
=====================  =============================================================  ========
:func:`elbo`           :math:`\frac1S\sum_s \log w_s`                                 lower
:func:`iwae`           :math:`\log \frac1S\sum_s w_s` (log-mean-exp)                  lower
:func:`cubo`           :math:`\frac1n \log \frac1S\sum_s w_s^n` (eq. 1, n > 1)        upper
:func:`klpq`           :math:`\sum_s \bar w_s \log w_s` (eq. 3, self-normalised)      upper
=====================  =============================================================  ========

with self-normalised weights :math:`\bar w_s = w_s / \sum_t w_t`
(:func:`self_normalised_weights`). "lower"/"upper" describe the population quantity; the
upper-bound *estimates* are biased downwards at finite S (the paper's point), while on any
single set of weights the following hold deterministically (power-mean and Jensen
inequalities, checked by property tests):

.. math::

    \mathrm{elbo} \le \mathrm{iwae} \le \mathrm{cubo}_n \le \mathrm{cubo}_m
    \quad (1 \le n \le m), \qquad
    \mathrm{iwae} \le \mathrm{klpq} \le 2\,\mathrm{cubo}_2 - \mathrm{iwae},

with equality throughout when all weights are equal (q is the posterior). Indeed
:math:`\mathrm{klpq} - \mathrm{iwae} = \log S - H(\bar w) \ge 0`.

Every function reduces over the **last** axis, so ``log_w`` may have shape ``(S,)`` or
``(..., S)``; dtypes (float32/float64) are preserved and all work is in log space.

Non-finite log weights
----------------------
Nothing is ever dropped: every estimator uses all S entries, so trouble is visible in the
estimate instead of being averaged away, and :func:`count_nonfinite` reports how many
entries were not finite. The rule is "NaN in, NaN out": an estimate is never a finite
number, nor the best possible value of a minimised upper bound, when the weights are bad.

* ``-inf`` is a legitimate weight of zero (p(x, z_s) = 0, e.g. a draw outside the model's
  support). :func:`iwae`, :func:`cubo`, :func:`klpq`, :func:`self_normalised_weights` and
  :func:`effective_sample_size` treat it exactly as w_s = 0 (still dividing by all S);
  :func:`elbo` becomes ``-inf`` (correctly: the ELBO of such a q is -inf). It is still
  counted by :func:`count_nonfinite`, and gradients stay finite at such an entry.
* ``nan`` anywhere along the particle axis makes every estimate ``nan`` (value and
  gradient), as do the weights and the ESS.
* ``+inf`` cannot be a real weight (z_s was drawn from q, so q(z_s) > 0, and p is
  finite): it is an overflow, and every estimate, the weights and the ESS are ``nan``.
* If **all** entries are ``-inf`` (no particle has positive weight: e.g. ``nan`` in the
  data, whose log density NumPyro's validation makes ``-inf``) the sample says nothing
  about the upper bounds: :func:`cubo`, :func:`klpq`, :func:`self_normalised_weights` and
  :func:`effective_sample_size` return ``nan`` (a ``-inf`` CUBO would be the best
  possible value of a minimised bound). The lower bounds :func:`elbo` and :func:`iwae`
  return ``-inf``, a true (trivial) lower bound and the worst possible value for a
  maximiser.

:func:`summarise` returns all estimates together with the count, for diagnostics such as an
evidence sandwich.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from numpyro.util import not_jax_tracer

__all__ = [
    "BoundSummary",
    "count_nonfinite",
    "cubo",
    "effective_sample_size",
    "elbo",
    "iwae",
    "klpq",
    "self_normalised_weights",
    "summarise",
]


def _as_log_weights(log_w: jax.typing.ArrayLike) -> jax.Array:
    log_w = jnp.asarray(log_w)
    if jnp.issubdtype(log_w.dtype, jnp.complexfloating):
        raise ValueError(f"`log_w` must be real, got dtype {log_w.dtype}.")
    if not jnp.issubdtype(log_w.dtype, jnp.floating):
        log_w = log_w.astype(jnp.result_type(float))
    if log_w.ndim == 0:
        raise ValueError(
            "`log_w` must have a trailing particle axis of shape (S,) or (..., S); got a scalar."
        )
    if log_w.shape[-1] == 0:
        raise ValueError(f"`log_w` has no particles: shape {log_w.shape}.")
    return log_w


def _log_num(log_w: jax.Array) -> jax.Array:
    return jnp.log(jnp.asarray(log_w.shape[-1], dtype=log_w.dtype))


def _trouble(log_w: jax.Array) -> jax.Array:
    """True (per batch entry) where some log weight is ``nan`` or ``+inf``."""
    return jnp.any(jnp.isnan(log_w) | (log_w == jnp.inf), axis=-1)


def _all_zero(log_w: jax.Array) -> jax.Array:
    """True (per batch entry) where every weight is zero (every log weight is ``-inf``)."""
    return jnp.all(log_w == -jnp.inf, axis=-1)


def _nan_where(value: jax.Array, bad: jax.Array) -> jax.Array:
    """``value`` with ``nan`` wherever ``bad``; the gradient there is ``nan`` too.

    A multiplication by a constant 1 or nan (not a ``jnp.where`` on ``value``), so that
    the gradient is exactly unchanged where ``bad`` is False and ``nan`` where it is True.
    """
    bad = jax.lax.stop_gradient(bad)
    if jnp.ndim(value) > jnp.ndim(bad):
        bad = jnp.expand_dims(bad, -1)
    return value * jnp.where(bad, jnp.nan, 1.0).astype(value.dtype)


def elbo(log_w: jax.typing.ArrayLike) -> jax.Array:
    r"""ELBO estimate :math:`\frac1S\sum_s \log w_s` (mean of the log weights).

    ``-inf`` if some weight is zero; ``nan`` if some log weight is ``nan`` or ``+inf``.

    Example:
        >>> import jax.numpy as jnp
        >>> float(elbo(jnp.array([0.0, 2.0])))
        1.0
    """
    log_w = _as_log_weights(log_w)
    return _nan_where(jnp.mean(log_w, axis=-1), _trouble(log_w))


def iwae(log_w: jax.typing.ArrayLike) -> jax.Array:
    r"""Importance-weighted (IWAE) estimate :math:`\log \frac1S \sum_s w_s` (log-mean-exp).

    Zero weights (``-inf``) count in the mean (all zero: ``-inf``); ``nan`` if some log
    weight is ``nan`` or ``+inf``.

    Example:
        >>> import jax.numpy as jnp
        >>> round(float(iwae(jnp.log(jnp.array([1.0, 3.0])))), 6)  # log 2
        0.693147
    """
    log_w = _as_log_weights(log_w)
    return _nan_where(logsumexp(log_w, axis=-1) - _log_num(log_w), _trouble(log_w))


def _check_order(n: jax.typing.ArrayLike) -> None:
    if not not_jax_tracer(n):
        return
    arr = np.asarray(n)
    if (
        arr.dtype == np.bool_
        or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating))
        or arr.ndim != 0
        or not np.isfinite(arr)
        or float(arr) < 1
    ):
        raise ValueError(
            f"`n` must be a finite real scalar >= 1 (n > 1 for an upper bound), got {n!r}."
        )


def cubo(log_w: jax.typing.ArrayLike, n: jax.typing.ArrayLike = 2.0) -> jax.Array:
    r"""CUBO estimate :math:`\frac1n \log \frac1S \sum_s w_s^n` (Pradier et al. 2019, eq. 1).

    The Monte Carlo estimate of :math:`\mathrm{CUBO}_n = \frac1n \log \mathbb{E}_q[w^n]`, an
    upper bound on :math:`\log p(x)` for n > 1 (n = 2 is the paper's eq. 1). The estimate
    itself is biased low (Jensen) and can fall below :math:`\log p(x)` at finite S. ``n = 1``
    is allowed and equals :func:`iwae` (except when all weights are zero: then :func:`iwae`
    is ``-inf`` and this is ``nan``, see the module docstring). A concrete ``n`` that is not
    a finite real >= 1 raises; a traced one gives ``nan``.

    Example:
        >>> import jax.numpy as jnp
        >>> round(float(cubo(jnp.log(jnp.array([1.0, 3.0])), n=2)), 6)  # 0.5 log 5
        0.804719
    """
    _check_order(n)
    log_w = _as_log_weights(log_w)
    n = jnp.asarray(n, dtype=log_w.dtype)
    value = (logsumexp(n * log_w, axis=-1) - _log_num(log_w)) / n
    bad_order = ~(jnp.isfinite(n) & (n >= 1))
    return _nan_where(value, _trouble(log_w) | _all_zero(log_w) | bad_order)


def self_normalised_weights(log_w: jax.typing.ArrayLike) -> jax.Array:
    r"""Self-normalised importance weights :math:`\bar w_s = w_s / \sum_t w_t` (a softmax).

    ``nan`` (all entries) if some log weight is ``nan`` or ``+inf``, or all are ``-inf``.

    Example:
        >>> import jax.numpy as jnp
        >>> self_normalised_weights(jnp.log(jnp.array([1.0, 3.0]))).round(4).tolist()
        [0.25, 0.75]
    """
    log_w = _as_log_weights(log_w)
    w = jax.nn.softmax(log_w, axis=-1)
    return _nan_where(w, _trouble(log_w) | _all_zero(log_w))


def klpq(log_w: jax.typing.ArrayLike) -> jax.Array:
    r"""Self-normalised estimate of the KLpq upper bound (Pradier et al. 2019, eq. 3).

    Eq. 3 is :math:`\mathrm{UB}_{KLpq} = \mathbb{E}_{p(z \mid x)}[\log p(x, z) - \log q(z)]
    = \log p(x) + \mathrm{KL}(p \,\|\, q)`. The paper averages over posterior (HMC) draws;
    here the posterior expectation is estimated by self-normalised importance sampling from
    q, :math:`\sum_s \bar w_s \log w_s`. On any weights it satisfies
    ``iwae <= klpq <= 2 * cubo(n=2) - iwae``. A weight of zero (``-inf``) contributes 0;
    ``nan`` if some log weight is ``nan`` or ``+inf``, or all are ``-inf``.

    Example:
        >>> import jax.numpy as jnp
        >>> round(float(klpq(jnp.log(jnp.array([1.0, 3.0])))), 6)  # 0.75 log 3
        0.823959
    """
    log_w = _as_log_weights(log_w)
    w = jax.nn.softmax(log_w, axis=-1)
    zero = w == 0  # False for nan, which must propagate
    # w log w -> 0 as w -> 0; the double `where` keeps gradients finite at log_w = -inf.
    safe_log_w = jnp.where(zero, 0.0, log_w)
    total = jnp.sum(jnp.where(zero, 0.0, w * safe_log_w), axis=-1)
    return _nan_where(total, _trouble(log_w) | _all_zero(log_w))


def effective_sample_size(log_w: jax.typing.ArrayLike) -> jax.Array:
    r"""Kish effective sample size :math:`1 / \sum_s \bar w_s^2`, between 1 and S.

    Computed in log space as :math:`\exp(2\,\mathrm{lse}(\log w) - \mathrm{lse}(2 \log w))`.
    Zero weights count as zero; ``nan`` if some log weight is ``nan`` or ``+inf``, or all
    are ``-inf``.

    Example:
        >>> import jax.numpy as jnp
        >>> float(effective_sample_size(jnp.zeros(8)))
        8.0
    """
    log_w = _as_log_weights(log_w)
    ess = jnp.exp(2.0 * logsumexp(log_w, axis=-1) - logsumexp(2.0 * log_w, axis=-1))
    return _nan_where(ess, _trouble(log_w) | _all_zero(log_w))


def count_nonfinite(log_w: jax.typing.ArrayLike) -> jax.Array:
    """Number of entries of ``log_w`` (along the last axis) that are ``nan`` or ``+-inf``.

    ``-inf`` (a zero weight) is counted too, although the estimators handle it exactly; see
    the module docstring for what each kind of entry does to the estimates.

    Example:
        >>> import jax.numpy as jnp
        >>> int(count_nonfinite(jnp.array([0.0, jnp.nan, -jnp.inf, 1.0])))
        2
    """
    return jnp.sum(~jnp.isfinite(_as_log_weights(log_w)), axis=-1)


class BoundSummary(NamedTuple):
    """All estimates of one set of log weights (each reduced over the particle axis)."""

    elbo: jax.Array
    iwae: jax.Array
    cubo: jax.Array
    klpq: jax.Array
    effective_sample_size: jax.Array
    num_nonfinite: jax.Array
    num_particles: int


def summarise(log_w: jax.typing.ArrayLike, n: jax.typing.ArrayLike = 2.0) -> BoundSummary:
    """ELBO, IWAE, CUBO_n and KLpq estimates, Kish ESS and the non-finite count of ``log_w``.

    Example:
        >>> import jax.numpy as jnp
        >>> s = summarise(jnp.zeros(4))
        >>> float(s.elbo), float(s.cubo), float(s.effective_sample_size), int(s.num_nonfinite)
        (0.0, 0.0, 4.0, 0)
    """
    log_w = _as_log_weights(log_w)
    return BoundSummary(
        elbo=elbo(log_w),
        iwae=iwae(log_w),
        cubo=cubo(log_w, n),
        klpq=klpq(log_w),
        effective_sample_size=effective_sample_size(log_w),
        num_nonfinite=count_nonfinite(log_w),
        num_particles=log_w.shape[-1],
    )
