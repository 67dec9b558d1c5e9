r"""The local steps: from (minibatch, moments of the globals) to expected local statistics.

Every function here maps a minibatch ``y`` (B, D), the :class:`GlobalMoments` of the globals
(expectations under q, or one sample of q) and an inverse temperature :math:`\beta = 1/T`
(a scalar, or one per data point) to the expected local sufficient statistics
(:class:`LocalStats`) the global step needs. They are pure and ``vmap`` over the data points;
the samplers' sweeps and the optimisers' steps run in ``lax.scan``.

The target of every local step is the tempered local joint (Mandt et al. 2016, eq. 4 and 17:
the local natural parameters divided by T)

.. math::

    \log \tilde p_\beta(\psi_i) = \beta\, \mathbb{E}_{\mathrm{m}}\big[\log p(y_i, z_i, w_i
        \mid \beta)\big] + \mathrm{const}
    = \beta\Big[\textstyle\sum_k z_{ik}\,\rho_k - \frac{\bar\gamma_w}{2}\|w_i\|^2
        + \bar\gamma\, u_i^\top b_i - \frac{\bar\gamma}{2}\, u_i^\top A\, u_i\Big]
        + \mathrm{const},

with :math:`u_i = z_i \circ w_i`, :math:`\rho_k = \mathbb{E}\log\pi_k - \mathbb{E}\log(1 -
\pi_k)`, :math:`A = \mathbb{E}[\Phi\Phi^\top]`, :math:`b_i = \mathbb{E}[\Phi]\, y_i` and
bars for the moments of the precisions (Shah et al., supplement, Mimno-SVI and Gibbs-SSVI:
the supplement's expansion, with :math:`\mathbb{E}[\Phi_k\Phi_k^\top] = \|\mu_k\|^2/\tau_k^2
+ D/\tau_k` -- the supplement drops the factor D). With moments under q this is
:math:`\log q_{\mathrm{Mimno}}`; with the moments of a sample it is the true local
conditional :math:`\log p(\psi_i \mid y_i, \beta^{(t)})` of Gibbs-SSVI.

* :func:`gibbs_local_stats` -- Gibbs sweeps on that target (Mimno-SVI, Gibbs-SSVI). Each
  feature is updated as a block :math:`(z_{ik}, w_{ik})`: :math:`z_{ik}` from its conditional
  with :math:`w_{ik}` integrated out, then :math:`w_{ik} \mid z_{ik}` Gaussian. This is a
  Gibbs sampler of the same target as the supplement's (z and w updated one at a time), but
  it can switch a feature on without first drawing a lucky :math:`w_{ik}` from the prior.
  Statistics are Rao-Blackwellised where this is cheap (:math:`z`, :math:`u`,
  :math:`\sum_k w^2`) and sample averages for :math:`u u^\top`.
* :func:`mean_field_local_stats` -- MF-SSVI: :math:`q(z_{ik})q(w_{ik})` fully factorised,
  local ELBO (supplement, MF-SSVI) maximised by a gradient method (L-BFGS).
* :func:`titsias_local_stats` -- Titsias-SSVI: :math:`q(z_{ik}) q(w_{ik} \mid z_{ik})` with
  :math:`q(w \mid z = 1)` Gaussian and :math:`q(w \mid z=0)` the (tempered) prior
  :math:`\mathcal{N}(0, T/\gamma_w)`, its optimum; local ELBO (supplement, Titsias-SSVI)
  maximised likewise.
* :func:`mean_field_cavi` -- the same mean-field family by closed-form coordinate ascent
  (batch mean-field VI's local step).

Local ELBOs are :math:`\beta\,\ell(\text{stats}) + H[q]`, with :math:`\ell` =
:func:`expected_log_lik`, the expected complete-data log-likelihood (linear in the
statistics). The supplement's printed ELBOs have garbled details (:math:`\theta_{ik}\,
\pi_k/(1-\pi_k)` for :math:`\theta_{ik}\log(\pi_k/(1-\pi_k))`, the MF prior term in the
Titsias ELBO); this module's are re-derived and checked against brute-force enumeration.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax, random

from numpyro_tempering.models.latent_features.conjugate import GlobalMoments, expected_residual

__all__ = [
    "LocalStats",
    "MeanFieldParams",
    "expected_log_lik",
    "gibbs_local_stats",
    "mean_field_cavi",
    "mean_field_elbo",
    "mean_field_init",
    "mean_field_local_stats",
    "mean_field_stats",
    "titsias_elbo",
    "titsias_local_stats",
    "titsias_stats",
]

_LOG_2PI = math.log(2 * math.pi)
_MAX_LOGIT, _MAX_LOG_VAR = 30.0, 30.0


class LocalStats(NamedTuple):
    """Expected local sufficient statistics (leading batch axes allowed).

    ``z`` (K,): :math:`\\mathbb{E}z_{ik}`; ``w2``: :math:`\\sum_k\\mathbb{E}w_{ik}^2`; ``u``
    (K,): :math:`\\mathbb{E}[z_{ik}w_{ik}]`; ``uu`` (K, K): :math:`\\mathbb{E}[u_iu_i^\\top]`.
    """

    z: jax.Array
    w2: jax.Array
    u: jax.Array
    uu: jax.Array


def expected_log_lik(y: jax.Array, stats: LocalStats, moments: GlobalMoments) -> jax.Array:
    r""":math:`\ell_i = \mathbb{E}[\log p(y_i, z_i, w_i \mid \beta)]` per data point::

        sum_k [E z_k E log pi_k + (1 - E z_k) E log(1 - pi_k)]
          + K/2 (E log g_w - log 2 pi) - E[g_w]/2 sum_k E w_k^2
          + D/2 (E log g_obs - log 2 pi) - E[g_obs]/2 E||y - u Phi||^2

    This is what eq. 18 (Mandt et al. 2016) weighs per temperature, and the locals' part of
    the ELBO. Shape: ``y.shape[:-1]``.
    """
    k, d = stats.z.shape[-1], y.shape[-1]
    # 0 log 0 = 0: a sampled pi may be exactly 0 or 1 in float32
    bern = jnp.sum(_xlog(stats.z, moments.log_pi) + _xlog(1 - stats.z, moments.log1m_pi), -1)
    weights = 0.5 * k * (moments.log_gamma_w - _LOG_2PI) - 0.5 * moments.gamma_w * stats.w2
    resid = _residual(y, stats, moments)
    obs = 0.5 * d * (moments.log_gamma_obs - _LOG_2PI) - 0.5 * moments.gamma_obs * resid
    return bern + weights + obs


def _xlog(x, log_y):
    return jnp.where(x == 0, 0.0, x * log_y)


def _residual(y, stats, moments):
    if y.ndim == 1:
        return expected_residual(y[None], jax.tree.map(lambda a: a[None], stats), moments)[0]
    return expected_residual(y, stats, moments)


def _per_point(inv_temperature, y) -> jax.Array:
    beta = jnp.asarray(inv_temperature, y.dtype)
    if beta.ndim > 1 or (beta.ndim == 1 and beta.shape[0] != y.shape[0]):
        raise ValueError(
            f"`inv_temperature` must be a scalar or have shape ({y.shape[0]},), got "
            f"{beta.shape}."
        )
    return jnp.broadcast_to(beta, y.shape[:1])


def _check_batch(y) -> jax.Array:
    y = jnp.asarray(y)
    if y.ndim != 2:
        raise ValueError(f"`y` must be a minibatch of shape (B, D), got {y.shape}.")
    return y


# -- Gibbs sweeps ------------------------------------------------------------------------------
def _gibbs_one(key, y, beta, moments: GlobalMoments, num_sweeps: int, burn_in: int):
    """Blocked Gibbs on one data point; returns its LocalStats (averages over kept sweeps)."""
    a = moments.phi_outer
    b = moments.phi @ y
    g, gw, rho = moments.gamma_obs, moments.gamma_w, moments.prior_logit
    k = rho.shape[0]
    diag = jnp.diagonal(a)
    prec = gw + g * diag  # P_k: precision of w_k given z_k = 1 (before tempering)
    half_log_ratio = 0.5 * (jnp.log(gw) - jnp.log(prec))

    def update(j, carry):
        u, r, w2, ez, eu, noise = carry
        h = g * (r[j] + diag[j] * u[j])  # gamma (b_j - sum_{l != j} A_jl u_l)
        mean1 = h / prec[j]
        logit = beta * rho[j] + half_log_ratio[j] + 0.5 * beta * h * mean1
        p = jax.nn.sigmoid(logit)
        on = noise[0, j] < p
        # w_k | z_k = 0 is the tempered prior; only u = z w enters the rest of the sweep
        u_new = jnp.where(on, mean1 + noise[1, j] * lax.rsqrt(beta * prec[j]), 0.0)
        r = r - a[:, j] * (u_new - u[j])
        var1 = 1.0 / (beta * prec[j])
        ew2 = p * (mean1**2 + var1) + (1 - p) / (beta * gw)
        return (u.at[j].set(u_new), r, w2 + ew2, ez.at[j].set(p), eu.at[j].set(p * mean1),
                noise)

    def sweep(state, key):
        u, r = state
        k1, k2 = random.split(key)
        noise = jnp.stack([random.uniform(k1, (k,), y.dtype), random.normal(k2, (k,), y.dtype)])
        zero = jnp.zeros((k,), y.dtype)
        u, r, w2, ez, eu, _ = lax.fori_loop(
            0, k, update, (u, r, jnp.zeros((), y.dtype), zero, zero, noise)
        )
        return (u, r), LocalStats(ez, w2, eu, jnp.outer(u, u))

    u0 = jnp.zeros((k,), y.dtype)
    keys = random.split(key, burn_in + num_sweeps)
    (u, r), _ = lax.scan(sweep, (u0, b), keys[:burn_in])
    _, kept = lax.scan(sweep, (u, r), keys[burn_in:])
    return jax.tree.map(lambda s: jnp.mean(s, 0), kept)


def gibbs_local_stats(
    rng_key: jax.Array,
    y: jax.typing.ArrayLike,
    moments: GlobalMoments,
    inv_temperature: jax.typing.ArrayLike = 1.0,
    *,
    num_sweeps: int = 10,
    burn_in: int = 5,
) -> LocalStats:
    r"""Mimno-SVI / Gibbs-SSVI local step: blocked Gibbs sweeps on the tempered local target.

    With ``moments`` under q the target is :math:`q_{\mathrm{Mimno}}(\psi_i)^{\beta}`
    (Shah et al., supplement, Mimno-SVI); with the moments of a sample
    :math:`\beta^{(t)}\sim q` it is :math:`p(\psi_i\mid y_i,\beta^{(t)})^{\beta}`
    (supplement, Gibbs-SSVI). For feature k, with :math:`h = \bar\gamma(b_k - \sum_{j\ne k}
    A_{kj}u_j)` and :math:`P = \bar\gamma_w + \bar\gamma A_{kk}`:

    .. math::

        \mathrm{logit}\,p(z_k = 1\mid\cdot) = \beta\rho_k + \tfrac12\log(\bar\gamma_w/P)
            + \beta h^2/(2P), \qquad
        w_k \mid z_k = 1 \sim \mathcal{N}(h/P, 1/(\beta P)), \quad
        w_k \mid z_k = 0 \sim \mathcal{N}(0, 1/(\beta\bar\gamma_w)).

    Each point starts at :math:`z = 0`; ``burn_in`` sweeps are discarded and the statistics
    are averaged over ``num_sweeps`` sweeps (one key per data point).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import Prior, init_params
        >>> from numpyro_tempering.models.latent_features import expected_moments
        >>> y = jnp.ones((5, 3))
        >>> m = expected_moments(init_params(jax.random.PRNGKey(0), y, 2))
        >>> gibbs_local_stats(jax.random.PRNGKey(1), y, m).uu.shape
        (5, 2, 2)
    """
    y = _check_batch(y)
    beta = _per_point(inv_temperature, y)
    keys = random.split(rng_key, y.shape[0])
    one = lambda key, yi, bi: _gibbs_one(key, yi, bi, moments, num_sweeps, burn_in)  # noqa: E731
    return jax.vmap(one)(keys, y, beta)


# -- mean-field and Titsias families ---------------------------------------------------------------
class MeanFieldParams(NamedTuple):
    r"""Local variational parameters per data point: ``theta`` (K,) :math:`q(z_{ik}=1)`,
    ``mean`` and ``var`` (K,): the Gaussian :math:`q(w_{ik})` (mean field) or
    :math:`q(w_{ik}\mid z_{ik}=1)` (Titsias). (The supplement's :math:`\nu/\kappa` and
    :math:`1/\kappa`.)"""

    theta: jax.Array
    mean: jax.Array
    var: jax.Array


def _stats_from(theta, mean, var, w2) -> LocalStats:
    u = theta * mean
    u2 = theta * (mean**2 + var)
    uu = u[..., :, None] * u[..., None, :]
    diag = jnp.eye(theta.shape[-1], dtype=theta.dtype)
    uu = uu + diag * (u2 - u**2)[..., None, :]
    return LocalStats(theta, w2, u, uu)


def mean_field_stats(params: MeanFieldParams) -> LocalStats:
    r"""Statistics of :math:`\prod_k q(z_k)q(w_k)`: :math:`\mathbb{E}u_k = \theta_k m_k`,
    :math:`\mathbb{E}u_k^2 = \theta_k(m_k^2 + v_k)`, independent across k."""
    w2 = jnp.sum(params.mean**2 + params.var, -1)
    return _stats_from(params.theta, params.mean, params.var, w2)


def titsias_stats(
    params: MeanFieldParams, moments: GlobalMoments, inv_temperature: jax.typing.ArrayLike
) -> LocalStats:
    r"""Statistics of :math:`\prod_k q(z_k)q(w_k\mid z_k)`, :math:`q(w_k\mid z_k=0) =
    \mathcal{N}(0, 1/(\beta\bar\gamma_w))`: as the mean field's, except
    :math:`\mathbb{E}w_k^2 = \theta_k(m_k^2+v_k) + (1-\theta_k)/(\beta\bar\gamma_w)`."""
    beta = jnp.asarray(inv_temperature)[..., None]
    off = 1.0 / (beta * moments.gamma_w)
    theta = params.theta
    w2 = jnp.sum(theta * (params.mean**2 + params.var) + (1 - theta) * off, -1)
    return _stats_from(theta, params.mean, params.var, w2)


def _bernoulli_entropy(theta):
    # clipped so that a saturated theta (exactly 0 or 1 in float32) has a finite gradient
    eps = jnp.finfo(jnp.result_type(theta, float)).eps
    t = jnp.clip(theta, jnp.finfo(jnp.result_type(theta, float)).tiny, 1 - eps)
    return -(t * jnp.log(t) + (1 - t) * jnp.log1p(-t))


def mean_field_elbo(
    params: MeanFieldParams,
    y: jax.Array,
    moments: GlobalMoments,
    inv_temperature: jax.typing.ArrayLike = 1.0,
) -> jax.Array:
    r"""Local tempered ELBO of the mean-field family (Shah et al., supplement, MF-SSVI):
    :math:`\beta\,\ell(\mathrm{stats}) + \sum_k [H(\theta_k) + \tfrac12\log(2\pi e v_k)]`,
    per data point (``y`` (..., D) against params (..., K))."""
    beta = jnp.asarray(inv_temperature)
    ent = _bernoulli_entropy(params.theta) + 0.5 * jnp.log(2 * jnp.pi * jnp.e * params.var)
    return beta * expected_log_lik(y, mean_field_stats(params), moments) + jnp.sum(ent, -1)


def titsias_elbo(
    params: MeanFieldParams,
    y: jax.Array,
    moments: GlobalMoments,
    inv_temperature: jax.typing.ArrayLike = 1.0,
) -> jax.Array:
    r"""Local tempered ELBO of the Titsias family (Shah et al., supplement, Titsias-SSVI):
    :math:`\beta\,\ell(\mathrm{stats}) + \sum_k [H(\theta_k) + \theta_k\tfrac12\log(2\pi e
    v_k) + (1-\theta_k)\tfrac12\log(2\pi e/(\beta\bar\gamma_w))]`, per data point."""
    beta = jnp.asarray(inv_temperature)
    theta = params.theta
    off_var = 1.0 / (beta[..., None] * moments.gamma_w)
    ent = (
        _bernoulli_entropy(theta)
        + theta * 0.5 * jnp.log(2 * jnp.pi * jnp.e * params.var)
        + (1 - theta) * 0.5 * jnp.log(2 * jnp.pi * jnp.e * off_var)
    )
    stats = titsias_stats(params, moments, beta)
    return beta * expected_log_lik(y, stats, moments) + jnp.sum(ent, -1)


def mean_field_init(
    y: jax.Array, moments: GlobalMoments, inv_temperature: jax.typing.ArrayLike = 1.0
) -> MeanFieldParams:
    r"""Starting local parameters: :math:`\theta_k = \sigma(\rho_k)`, and the single-feature
    optimum :math:`m_k = \bar\gamma b_k / P_k`, :math:`v_k = 1/(\beta P_k)`,
    :math:`P_k = \bar\gamma_w + \bar\gamma A_{kk}`."""
    y = _check_batch(y)
    beta = _per_point(inv_temperature, y)[:, None]
    prec = moments.gamma_w + moments.gamma_obs * jnp.diagonal(moments.phi_outer)
    b = y @ moments.phi.T
    theta = jnp.broadcast_to(jax.nn.sigmoid(moments.prior_logit), b.shape)
    return MeanFieldParams(theta, moments.gamma_obs * b / prec, 1.0 / (beta * prec))


def _optimise(elbo_fn, y, moments, beta, init: MeanFieldParams, num_steps):
    """L-BFGS (optax, zoom line search) on (logit theta, mean, log var) of every point."""
    eps = jnp.finfo(y.dtype).eps
    theta = jnp.clip(init.theta, eps, 1 - eps)
    x0 = jnp.stack([jnp.log(theta) - jnp.log1p(-theta), init.mean, jnp.log(init.var)], 1)
    opt = optax.lbfgs()

    def unpack(x):
        # bounded logits and log variances: a line search cannot overflow them
        logit = jnp.clip(x[..., 0, :], -_MAX_LOGIT, _MAX_LOGIT)
        log_var = jnp.clip(x[..., 2, :], -_MAX_LOG_VAR, _MAX_LOG_VAR)
        return MeanFieldParams(jax.nn.sigmoid(logit), x[..., 1, :], jnp.exp(log_var))

    def one(x, yi, bi):
        loss = lambda x: -elbo_fn(unpack(x), yi, moments, bi)  # noqa: E731
        value_and_grad = optax.value_and_grad_from_state(loss)

        def step(carry, _):
            x, state = carry
            value, grad = value_and_grad(x, state=state)
            updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=loss)
            return (optax.apply_updates(x, updates), state), None

        (x, _), _ = lax.scan(step, (x, opt.init(x)), None, num_steps)
        return x

    return unpack(jax.vmap(one)(x0, y, beta))


def mean_field_local_stats(
    y: jax.typing.ArrayLike,
    moments: GlobalMoments,
    inv_temperature: jax.typing.ArrayLike = 1.0,
    *,
    num_steps: int = 50,
    init: MeanFieldParams | None = None,
) -> LocalStats:
    r"""MF-SSVI local step: maximise :func:`mean_field_elbo` by ``num_steps`` iterations of
    a gradient method (L-BFGS with line search, ``optax.lbfgs``, on the logit of
    :math:`\theta`, the mean and the log variance; Shah et al., supplement, MF-SSVI:
    "optimized ... using gradient descent") from :func:`mean_field_init` (or ``init``);
    return the optimum's statistics. (Plain gradient steps or Adam stall in the flat
    directions of a saturating :math:`\theta`; L-BFGS reaches the enumerated optimum.)

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import Prior, init_params
        >>> from numpyro_tempering.models.latent_features import expected_moments
        >>> y = jnp.ones((5, 3))
        >>> m = expected_moments(init_params(jax.random.PRNGKey(0), y, 2))
        >>> mean_field_local_stats(y, m, num_steps=5).z.shape
        (5, 2)
    """
    y = _check_batch(y)
    beta = _per_point(inv_temperature, y)
    init = mean_field_init(y, moments, beta) if init is None else init
    params = _optimise(mean_field_elbo, y, moments, beta, init, num_steps)
    return mean_field_stats(params)


def titsias_local_stats(
    y: jax.typing.ArrayLike,
    moments: GlobalMoments,
    inv_temperature: jax.typing.ArrayLike = 1.0,
    *,
    num_steps: int = 50,
    init: MeanFieldParams | None = None,
) -> LocalStats:
    r"""Titsias-SSVI local step: maximise :func:`titsias_elbo` by ``num_steps`` L-BFGS
    iterations, as :func:`mean_field_local_stats` (Shah et al., supplement, Titsias-SSVI);
    return the optimum's statistics.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import Prior, init_params
        >>> from numpyro_tempering.models.latent_features import expected_moments
        >>> y = jnp.ones((5, 3))
        >>> m = expected_moments(init_params(jax.random.PRNGKey(0), y, 2))
        >>> titsias_local_stats(y, m, num_steps=5).w2.shape
        (5,)
    """
    y = _check_batch(y)
    beta = _per_point(inv_temperature, y)
    init = mean_field_init(y, moments, beta) if init is None else init
    params = _optimise(titsias_elbo, y, moments, beta, init, num_steps)
    return titsias_stats(params, moments, beta)


def mean_field_cavi(
    y: jax.typing.ArrayLike,
    moments: GlobalMoments,
    inv_temperature: jax.typing.ArrayLike = 1.0,
    init: MeanFieldParams | None = None,
    *,
    num_sweeps: int = 5,
) -> tuple[LocalStats, MeanFieldParams]:
    r"""Batch mean-field VI's local step: closed-form coordinate ascent on
    :func:`mean_field_elbo`, features in turn, ``num_sweeps`` sweeps. For feature k, with
    :math:`r_k = b_k - \sum_{j\ne k} A_{kj}\theta_j m_j`:

    .. math::

        v_k = 1/(\beta(\bar\gamma_w + \bar\gamma\theta_k A_{kk})), \quad
        m_k = \beta\bar\gamma\theta_k r_k v_k, \quad
        \mathrm{logit}\,\theta_k = \beta\big[\rho_k - \tfrac{\bar\gamma}{2}(A_{kk}(m_k^2 +
        v_k) - 2 m_k r_k)\big].

    Returns the statistics and the parameters (to warm-start the next pass).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import Prior, init_params
        >>> from numpyro_tempering.models.latent_features import expected_moments
        >>> y = jnp.ones((5, 3))
        >>> m = expected_moments(init_params(jax.random.PRNGKey(0), y, 2))
        >>> stats, params = mean_field_cavi(y, m)
        >>> params.theta.shape
        (5, 2)
    """
    y = _check_batch(y)
    beta = _per_point(inv_temperature, y)
    init = mean_field_init(y, moments, beta) if init is None else init
    a = moments.phi_outer
    diag = jnp.diagonal(a)
    g, gw, rho = moments.gamma_obs, moments.gamma_w, moments.prior_logit
    k = rho.shape[0]
    eps = jnp.finfo(y.dtype).eps

    def one(params, yi, bi):
        b = moments.phi @ yi

        def update(j, p):
            theta, mean, var = p
            u = theta * mean
            r = b[j] - a[j] @ u + diag[j] * u[j]
            v = 1.0 / (bi * (gw + g * theta[j] * diag[j]))
            m = bi * g * theta[j] * r * v
            logit = bi * (rho[j] - 0.5 * g * (diag[j] * (m**2 + v) - 2 * m * r))
            th = jnp.clip(jax.nn.sigmoid(logit), eps, 1 - eps)
            return MeanFieldParams(theta.at[j].set(th), mean.at[j].set(m), var.at[j].set(v))

        def sweep(p, _):
            return lax.fori_loop(0, k, update, p), None

        p, _ = lax.scan(sweep, params, None, num_sweeps)
        return p

    params = jax.vmap(one)(init, y, beta)
    return mean_field_stats(params), params
