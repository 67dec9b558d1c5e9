r"""Held-out log-likelihood of the latent feature model at fitted globals.

Given globals :math:`\beta` (e.g. the posterior means of q,
:func:`~numpyro_tempering.models.latent_features.conjugate.point_estimate`), the weights
integrate out in closed form:

.. math::

    p(y \mid z, \beta) = \mathcal{N}\big(y;\, 0,\, C_z\big), \qquad
    C_z = \gamma_{obs}^{-1} I_D + \gamma_w^{-1}\,\Phi^\top D_z \Phi,

with :math:`D_z = \mathrm{diag}(z)`, evaluated in K dimensions with the Woodbury identity
and :math:`M_z = \gamma_w I_K + \gamma_{obs} D_z\Phi\Phi^\top D_z`:
:math:`\log|C_z| = -D\log\gamma_{obs} + \log|M_z| - K\log\gamma_w` and
:math:`y^\top C_z^{-1}y = \gamma_{obs}\|y\|^2 - \gamma_{obs}^2 v^\top M_z^{-1} v`,
:math:`v = D_z\Phi y`. What remains is a sum over :math:`2^K` configurations of z:

* :func:`exact_log_lik` enumerates them (K <= 12);
* :func:`heldout_log_lik` importance-samples them per held-out point (the issue's
  "importance-sampled over the held-out points' locals with the fitted globals"): proposal
  :math:`\prod_k \mathrm{Bern}(\tilde\theta_{k})` with :math:`\tilde\theta` the Gibbs
  marginals of the point's z (blocked Gibbs of
  :func:`~numpyro_tempering.models.latent_features.local.gibbs_local_stats` at the fitted
  globals), clipped to ``[clip, 1 - clip]``;
  :math:`\log\hat p(y_n) = \log\frac1S\sum_s p(y_n, z_s\mid\beta)/\tilde q(z_s)`.
  Its expectation is below :math:`\log p(y_n\mid\beta)` (Jensen); the reported standard
  error is that of the mean over held-out points (their spread), and the effective sample
  sizes of the importance weights are returned so that a poor proposal is visible.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from jax.scipy.special import logsumexp

from numpyro_tempering.models.latent_features.conjugate import Globals, point_moments
from numpyro_tempering.models.latent_features.local import gibbs_local_stats

__all__ = [
    "HeldOut",
    "exact_log_lik",
    "heldout_log_lik",
    "log_joint_collapsed",
]

#: the largest K :func:`exact_log_lik` enumerates (2^12 configurations)
MAX_EXACT_FEATURES = 12
_LOG_2PI = math.log(2 * math.pi)


def log_joint_collapsed(y: jax.Array, z: jax.Array, value: Globals) -> jax.Array:
    r""":math:`\log p(y, z \mid \beta)` with the weights integrated out, for one point ``y``
    (D,) and configurations ``z`` (..., K) (see the module docstring).

    Example:
        >>> import jax.numpy as jnp
        >>> g = Globals(jnp.array([0.5]), jnp.array([[1.0]]), jnp.array(1.0), jnp.array(1.0))
        >>> # z = 1: y ~ N(0, 1 + 1); log(1/2) + log N(0; 0, 2)
        >>> round(float(log_joint_collapsed(jnp.array([0.0]), jnp.array([1.0]), g)), 4)
        -1.9587
    """
    z = jnp.asarray(z, y.dtype)
    pi, phi = value.pi, value.phi
    g, gw = value.gamma_obs, value.gamma_w
    k, d = phi.shape
    log_prior = jnp.sum(z * jnp.log(pi) + (1 - z) * jnp.log1p(-pi), -1)
    outer = phi @ phi.T
    m = gw * jnp.eye(k, dtype=y.dtype) + g * z[..., :, None] * outer * z[..., None, :]
    chol = jnp.linalg.cholesky(m)
    v = z * (phi @ y)
    sol = jax.scipy.linalg.solve_triangular(chol, v[..., None], lower=True)[..., 0]
    logdet_m = 2 * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), -1)
    logdet_c = -d * jnp.log(g) + logdet_m - k * jnp.log(gw)
    quad = g * jnp.sum(y**2) - g**2 * jnp.sum(sol**2, -1)
    return log_prior - 0.5 * (d * _LOG_2PI + logdet_c + quad)


def exact_log_lik(y: jax.typing.ArrayLike, value: Globals) -> jax.Array:
    """:math:`\\log p(y_n\\mid\\beta)` per point, enumerating all :math:`2^K` configurations.

    Example:
        >>> import jax.numpy as jnp
        >>> g = Globals(jnp.array([0.5]), jnp.array([[1.0]]), jnp.array(1.0), jnp.array(1.0))
        >>> exact_log_lik(jnp.zeros((3, 1)), g).shape
        (3,)
    """
    y = jnp.asarray(y)
    k = value.phi.shape[0]
    if k > MAX_EXACT_FEATURES:
        raise ValueError(
            f"exact_log_lik enumerates 2^K configurations; K = {k} > {MAX_EXACT_FEATURES} "
            "is too many (use heldout_log_lik)."
        )
    configs = jnp.asarray(list(itertools.product((0.0, 1.0), repeat=k)), y.dtype)
    return _exact(y, value, configs)


@jax.jit
def _exact(y, value, configs):
    one = lambda yi: logsumexp(log_joint_collapsed(yi, configs, value))  # noqa: E731
    return lax.map(one, y, batch_size=64)


class HeldOut(NamedTuple):
    """Held-out log-likelihood: ``mean`` per point, its standard error ``se`` (over points),
    ``per_point`` values, the importance sampling ``ess`` per point (out of S) and
    ``num_nonfinite``, the points whose estimate is not finite (then ``mean`` is NaN)."""

    mean: float
    se: float
    per_point: np.ndarray
    ess: np.ndarray
    num_nonfinite: int


def heldout_log_lik(
    rng_key: jax.Array,
    y: jax.typing.ArrayLike,
    value: Globals,
    *,
    num_samples: int = 200,
    num_sweeps: int = 30,
    burn_in: int = 10,
    clip: float = 0.02,
    batch_size: int = 32,
) -> HeldOut:
    """Importance-sampled :math:`\\frac1{N'}\\sum_n\\log p(y_n\\mid\\beta)` over held-out
    points ``y`` (N', D) at globals ``value``, with standard error (module docstring).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> g = Globals(jnp.array([0.5, 0.3]), jnp.eye(2), jnp.array(4.0), jnp.array(1.0))
        >>> y = jnp.array([[1.0, 0.0], [0.0, -1.0], [0.1, 0.1]])
        >>> est = heldout_log_lik(jax.random.PRNGKey(0), y, g, num_samples=500)
        >>> bool(abs(est.mean - float(exact_log_lik(y, g).mean())) < 0.01)
        True
    """
    y = jnp.asarray(y)
    if y.ndim != 2:
        raise ValueError(f"`y` must have shape (N, D), got {y.shape}.")
    if not 0 < clip < 0.5:
        raise ValueError(f"`clip` must be in (0, 0.5), got {clip!r}.")
    for name, v in (("num_samples", num_samples), ("num_sweeps", num_sweeps),
                    ("batch_size", batch_size)):
        if int(v) != v or v < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {v!r}.")
    per_point, ess = _importance(rng_key, y, value, num_samples, num_sweeps, burn_in, clip,
                                 batch_size)
    per_point = np.asarray(per_point, dtype=float)
    n = per_point.size
    bad = int(np.sum(~np.isfinite(per_point)))
    mean = float(np.mean(per_point)) if bad == 0 else float("nan")
    se = float(np.std(per_point, ddof=1) / math.sqrt(n)) if n > 1 and bad == 0 else float("nan")
    return HeldOut(mean=mean, se=se, per_point=per_point, ess=np.asarray(ess), num_nonfinite=bad)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _importance(rng_key, y, value, num_samples, num_sweeps, burn_in, clip, batch_size):
    k_gibbs, k_is = random.split(rng_key)
    stats = gibbs_local_stats(k_gibbs, y, point_moments(value), 1.0, num_sweeps=num_sweeps,
                              burn_in=burn_in)
    probs = jnp.clip(stats.z, clip, 1 - clip)
    keys = random.split(k_is, y.shape[0])

    def one(args):
        yi, pi, key = args
        z = random.bernoulli(key, pi, (num_samples, pi.shape[0])).astype(y.dtype)
        log_q = jnp.sum(z * jnp.log(pi) + (1 - z) * jnp.log1p(-pi), -1)
        log_w = log_joint_collapsed(yi, z, value) - log_q
        est = logsumexp(log_w) - jnp.log(num_samples)
        w = jnp.exp(log_w - jnp.max(log_w))
        return est, jnp.sum(w) ** 2 / jnp.sum(w**2)

    return lax.map(one, (y, probs, keys), batch_size=batch_size)
