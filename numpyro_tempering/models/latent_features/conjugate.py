r"""q over the globals: natural parameters, moments, the conjugate (natural-gradient) step.

The variational family over the globals (Shah et al., supplement, all schemes) is

.. math::

    q(\beta) = \prod_k \mathrm{Beta}(\pi_k; a_k, b_k)\;
        \prod_{d} \mathcal{N}\big(\Phi_{:d};\, \Lambda^{-1} H_{:d},\, \Lambda^{-1}\big)\;
        \mathrm{Gamma}(\gamma_{obs}; a_{obs}, b_{obs})\;\mathrm{Gamma}(\gamma_w; a_w, b_w),

each factor in the family of its complete conditional. The natural parameters are
:math:`(a_k - 1, b_k - 1)`, :math:`(H, -\tfrac12\Lambda)` and :math:`(a - 1, -b)`; all of
them are affine in the stored :class:`GlobalParams`, so a convex combination of stored
parameters is the same convex combination of natural parameters. ``q(Phi)`` is jointly
Gaussian over the K features (one K x K precision :math:`\Lambda` shared by the D columns):
this is the family of :math:`p(\Phi \mid y, z, w, \gamma_{obs})`, and its marginals are the
supplement's :math:`q(\Phi_k) = \mathcal{N}(\mu_k/\tau_k, \tau_k^{-1} I)`; the supplement's
factorised :math:`q(\Phi) = \prod_k q(\Phi_k)` is the special case of a diagonal
:math:`\Lambda` (and would make the parallel step below a Jacobi sweep over k).

The global step (Mandt et al. 2016, eq. 15-16; Hoffman et al.'s SVI with the tempered
statistics of Algorithm 1)

.. math::

    \hat\lambda = \lambda_0 + \sum_{i \in B} \omega_i\, \mathbb{E}[t(y_i, \psi_i)], \qquad
    \lambda \leftarrow (1 - \rho)\lambda + \rho\hat\lambda,

with :math:`\omega_i = (N/|B|)/T_i` (minibatch scale over temperature; a per-point
:math:`T_i` for multicanonical VI). The statistics of a data point are
:math:`z_i`, :math:`\sum_k w_{ik}^2`, :math:`u_i = z_i\circ w_i`, :math:`u_i u_i^\top` and
:math:`u_i^\top y_i` (:class:`~numpyro_tempering.models.latent_features.local.LocalStats`),
and where a block's conditional involves another global block (:math:`\gamma_{obs}` in the
update of :math:`\Phi`, :math:`\Phi` in that of :math:`\gamma_{obs}`) the other block enters
through its :class:`GlobalMoments`: the expectations under q (mean-field VI, Mimno-SVI) or
the values of one sample :math:`\beta^{(t)} \sim q` (the structured SSVI schemes: "computed
as a function of the optimized parameters and global variable samples", Shah et al.,
supplement, MF-SSVI). With :math:`\rho = 1`, :math:`B` the whole data set, :math:`T = 1`
and moments under q, the step is batch CAVI's update of every block given the others'
current factors.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax import random
from jax.scipy.special import digamma

from numpyro_tempering.models.latent_features.model import DEFAULT_PRIOR, Prior, check_prior
from numpyro_tempering.partition import tempered_log_normalizer

__all__ = [
    "GlobalMoments",
    "GlobalParams",
    "Globals",
    "SufficientSums",
    "elbo_globals",
    "expected_moments",
    "global_step",
    "global_target",
    "init_params",
    "local_log_partition",
    "point_estimate",
    "point_moments",
    "prior_params",
    "sample_globals",
    "sufficient_sums",
]


class GlobalParams(NamedTuple):
    """Parameters of q over the globals (affine in its natural parameters).

    ``pi_a, pi_b`` (K,): Beta; ``phi_precision`` (K, K): :math:`\\Lambda`; ``phi_shift``
    (K, D): :math:`H = \\Lambda\\,\\mathbb{E}[\\Phi]`; ``obs_shape, obs_rate`` and
    ``w_shape, w_rate``: Gamma shape/rate of :math:`\\gamma_{obs}` and :math:`\\gamma_w`.
    """

    pi_a: jax.Array
    pi_b: jax.Array
    phi_precision: jax.Array
    phi_shift: jax.Array
    obs_shape: jax.Array
    obs_rate: jax.Array
    w_shape: jax.Array
    w_rate: jax.Array

    @property
    def num_features(self) -> int:
        return self.pi_a.shape[-1]

    @property
    def dim(self) -> int:
        return self.phi_shift.shape[-1]


class Globals(NamedTuple):
    """One value of the globals: ``pi`` (K,), ``phi`` (K, D), ``gamma_obs``, ``gamma_w``."""

    pi: jax.Array
    phi: jax.Array
    gamma_obs: jax.Array
    gamma_w: jax.Array


class GlobalMoments(NamedTuple):
    r"""What the local steps and the global step read of the globals.

    ``log_pi``, ``log1m_pi`` (K,): :math:`\mathbb{E}\log\pi_k`, :math:`\mathbb{E}\log(1-\pi_k)`;
    ``gamma_obs``, ``log_gamma_obs``, ``gamma_w``, ``log_gamma_w``: :math:`\mathbb{E}\gamma`,
    :math:`\mathbb{E}\log\gamma`; ``phi`` (K, D): :math:`\mathbb{E}\Phi`; ``phi_outer``
    (K, K): :math:`\mathbb{E}[\Phi\Phi^\top]`. Either expectations under q
    (:func:`expected_moments`) or the values of one draw (:func:`point_moments`).
    """

    log_pi: jax.Array
    log1m_pi: jax.Array
    gamma_obs: jax.Array
    log_gamma_obs: jax.Array
    gamma_w: jax.Array
    log_gamma_w: jax.Array
    phi: jax.Array
    phi_outer: jax.Array

    @property
    def prior_logit(self) -> jax.Array:
        r""":math:`\mathbb{E}\log\pi_k - \mathbb{E}\log(1 - \pi_k)`."""
        return self.log_pi - self.log1m_pi


def _phi_mean_chol(q: GlobalParams) -> tuple[jax.Array, jax.Array]:
    chol = jnp.linalg.cholesky(q.phi_precision)
    mean = jax.scipy.linalg.cho_solve((chol, True), q.phi_shift)
    return mean, chol


def expected_moments(q: GlobalParams) -> GlobalMoments:
    r"""Expectations under q: digammas for Beta/Gamma logs;
    :math:`\mathbb{E}[\Phi\Phi^\top] = M M^\top + D\,\Lambda^{-1}` with :math:`M = \Lambda^{-1}H`.

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import Prior, prior_params
        >>> m = expected_moments(prior_params(Prior(sigma_phi=2.0), 2, 3))
        >>> m.phi_outer.tolist()  # D sigma_phi^2 I
        [[12.0, 0.0], [0.0, 12.0]]
    """
    mean, chol = _phi_mean_chol(q)
    eye = jnp.eye(q.num_features, dtype=mean.dtype)
    cov = jax.scipy.linalg.cho_solve((chol, True), eye)
    total = digamma(q.pi_a + q.pi_b)
    return GlobalMoments(
        log_pi=digamma(q.pi_a) - total,
        log1m_pi=digamma(q.pi_b) - total,
        gamma_obs=q.obs_shape / q.obs_rate,
        log_gamma_obs=digamma(q.obs_shape) - jnp.log(q.obs_rate),
        gamma_w=q.w_shape / q.w_rate,
        log_gamma_w=digamma(q.w_shape) - jnp.log(q.w_rate),
        phi=mean,
        phi_outer=mean @ mean.T + q.dim * cov,
    )


def point_moments(value: Globals) -> GlobalMoments:
    """The moments of a point mass at ``value`` (the SSVI schemes' sampled globals).

    Example:
        >>> import jax.numpy as jnp
        >>> g = Globals(jnp.array([0.5]), jnp.array([[1.0, 2.0]]), jnp.array(4.0), jnp.array(1.0))
        >>> point_moments(g).phi_outer.tolist()
        [[5.0]]
    """
    pi = jnp.asarray(value.pi)
    return GlobalMoments(
        log_pi=jnp.log(pi),
        log1m_pi=jnp.log1p(-pi),
        gamma_obs=value.gamma_obs,
        log_gamma_obs=jnp.log(value.gamma_obs),
        gamma_w=value.gamma_w,
        log_gamma_w=jnp.log(value.gamma_w),
        phi=value.phi,
        phi_outer=value.phi @ value.phi.T,
    )


def sample_globals(rng_key: jax.Array, q: GlobalParams, sample_shape: tuple = ()) -> Globals:
    r"""Draws :math:`\beta \sim q(\beta)`, with leading axes ``sample_shape``
    (:math:`\Phi = M + L^{-\top}\epsilon` with :math:`\Lambda = L L^\top`; :math:`\pi`
    from two log-Gamma draws, so that it is never exactly 0 or 1).

    Example:
        >>> import jax
        >>> from numpyro_tempering.models.latent_features import Prior, prior_params
        >>> sample_globals(jax.random.PRNGKey(0), prior_params(Prior(), 3, 2), (5,)).phi.shape
        (5, 3, 2)
    """
    shape = tuple(sample_shape)
    k_pi, k_phi = random.split(rng_key)
    mean, chol = _phi_mean_chol(q)
    eps = random.normal(k_phi, shape + mean.shape, mean.dtype)
    noise = jax.scipy.linalg.solve_triangular(
        chol.T, jnp.moveaxis(eps, -2, 0).reshape(mean.shape[0], -1), lower=False
    )
    phi = mean + jnp.moveaxis(noise.reshape((mean.shape[0],) + shape + mean.shape[1:]), 0, -2)
    # all Gamma variates in one call (one rejection sampler to compile), in log space
    k = q.num_features
    shapes = jnp.concatenate([q.pi_a, q.pi_b, q.obs_shape[None], q.w_shape[None]])
    log_g = random.loggamma(k_pi, shapes, shape + shapes.shape)
    pi = jax.nn.sigmoid(log_g[..., :k] - log_g[..., k:2 * k])
    gamma_obs = jnp.exp(log_g[..., 2 * k]) / q.obs_rate
    gamma_w = jnp.exp(log_g[..., 2 * k + 1]) / q.w_rate
    return Globals(pi=pi, phi=phi, gamma_obs=gamma_obs, gamma_w=gamma_w)


def point_estimate(q: GlobalParams) -> Globals:
    """The posterior means of q: :math:`a/(a+b)`, :math:`\\Lambda^{-1}H`, shape/rate.

    Example:
        >>> from numpyro_tempering.models.latent_features import Prior, prior_params
        >>> float(point_estimate(prior_params(Prior(alpha=2.0), 2, 1)).pi[0])  # Beta(1, 1)
        0.5
    """
    mean, _ = _phi_mean_chol(q)
    return Globals(
        pi=q.pi_a / (q.pi_a + q.pi_b),
        phi=mean,
        gamma_obs=q.obs_shape / q.obs_rate,
        gamma_w=q.w_shape / q.w_rate,
    )


def prior_params(prior: Prior, num_features: int, dim: int, dtype=None) -> GlobalParams:
    """The prior written as :class:`GlobalParams` (:math:`\\lambda_0` of eq. 16).

    Example:
        >>> from numpyro_tempering.models.latent_features import Prior
        >>> prior_params(Prior(alpha=2.0), 4, 3).pi_a.tolist()
        [0.5, 0.5, 0.5, 0.5]
    """
    check_prior(prior)
    dtype = jnp.result_type(float) if dtype is None else dtype
    k = int(num_features)
    full = lambda v, shape=(): jnp.full(shape, v, dtype)  # noqa: E731
    return GlobalParams(
        pi_a=full(prior.alpha / k, (k,)),
        pi_b=full(1.0, (k,)),
        phi_precision=jnp.eye(k, dtype=dtype) / jnp.asarray(prior.sigma_phi, dtype) ** 2,
        phi_shift=jnp.zeros((k, int(dim)), dtype),
        obs_shape=full(prior.obs_shape),
        obs_rate=full(prior.obs_rate),
        w_shape=full(prior.w_shape),
        w_rate=full(prior.w_rate),
    )


def init_params(
    rng_key: jax.Array,
    y: jax.typing.ArrayLike,
    num_features: int,
    prior: Prior = DEFAULT_PRIOR,
    *,
    phi_scale: float = 0.5,
    phi_precision: float = 100.0,
    strength: float = 10.0,
) -> GlobalParams:
    r"""A data-driven starting q: :math:`\mathbb{E}\Phi_k` = ``phi_scale`` times K distinct
    random data points, :math:`\Lambda` = ``phi_precision`` :math:`I`, q(pi) = Beta(1, 1),
    :math:`\mathbb{E}\gamma_{obs} = 1 / \mathrm{mean}(y^2)`, :math:`\mathbb{E}\gamma_w = 1`,
    both Gammas of shape ``strength``. Every scheme of a seed starts from the same q.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> q = init_params(jax.random.PRNGKey(0), jnp.ones((10, 3)), 2)
        >>> q.phi_shift.shape, float(q.obs_shape / q.obs_rate)
        ((2, 3), 1.0)
    """
    y = jnp.asarray(y)
    if y.ndim != 2:
        raise ValueError(f"`y` must have shape (N, D), got {y.shape}.")
    n, d = y.shape
    k = int(num_features)
    if k > n:
        raise ValueError(f"`num_features` = {k} exceeds the number of data points {n}.")
    q0 = prior_params(prior, k, d, y.dtype)
    idx = random.choice(rng_key, n, (k,), replace=False)
    lam = jnp.eye(k, dtype=y.dtype) * phi_precision
    mean = phi_scale * y[idx]
    one = jnp.ones((), y.dtype)
    return q0._replace(
        pi_a=jnp.ones((k,), y.dtype),
        pi_b=jnp.ones((k,), y.dtype),
        phi_precision=lam,
        phi_shift=lam @ mean,
        obs_shape=strength * one,
        obs_rate=strength * jnp.mean(y**2) * one,
        w_shape=strength * one,
        w_rate=strength * one,
    )


class SufficientSums(NamedTuple):
    r"""Weighted sums over a minibatch of the local statistics, :math:`\sum_i \omega_i t_i`.

    ``count``: :math:`\sum\omega_i`; ``z`` (K,); ``w2``: :math:`\sum\omega_i \sum_k
    \mathbb{E}w_{ik}^2`; ``uu`` (K, K); ``uy`` (K, D): :math:`\sum\omega_i\mathbb{E}[u_i]^\top
    y_i`; ``residual``: :math:`\sum\omega_i\mathbb{E}\|y_i - u_i\Phi\|^2` under the moments.
    """

    count: jax.Array
    z: jax.Array
    w2: jax.Array
    uu: jax.Array
    uy: jax.Array
    residual: jax.Array


def expected_residual(y: jax.Array, stats, moments: GlobalMoments) -> jax.Array:
    r""":math:`\mathbb{E}\|y_i - u_i\Phi\|^2 = \|y_i\|^2 - 2\,\mathbb{E}[u_i]\,
    \mathbb{E}[\Phi] y_i + \mathrm{tr}(\mathbb{E}[u_i u_i^\top]\,\mathbb{E}[\Phi\Phi^\top])`
    (locals and globals independent under q; exact for a point mass), per data point."""
    proj = y @ moments.phi.T  # (B, K)
    return (
        jnp.sum(y**2, -1)
        - 2 * jnp.sum(stats.u * proj, -1)
        + jnp.sum(stats.uu * moments.phi_outer, (-2, -1))
    )


def sufficient_sums(
    y: jax.Array, stats, moments: GlobalMoments, weights: jax.typing.ArrayLike
) -> SufficientSums:
    """Weighted minibatch sums of the local statistics (``weights``: :math:`\\omega_i`,
    scalar or shape (B,))."""
    weights = jnp.broadcast_to(jnp.asarray(weights, y.dtype), y.shape[:1])
    return SufficientSums(
        count=jnp.sum(weights),
        z=weights @ stats.z,
        w2=weights @ stats.w2,
        uu=jnp.einsum("b,bjk->jk", weights, stats.uu),
        uy=(weights[:, None] * stats.u).T @ y,
        residual=weights @ expected_residual(y, stats, moments),
    )


def global_target(
    prior: Prior, sums: SufficientSums, moments: GlobalMoments, num_features: int, dim: int
) -> GlobalParams:
    r""":math:`\hat\lambda` of Mandt et al. 2016, eq. 16 (the coordinate optimum of every
    block given the others' moments)::

        a_k = alpha/K + sum w z_k            b_k = 1 + sum w (1 - z_k)
        Lambda = I / sigma_phi^2 + E[g_obs] sum w u u^T      H = E[g_obs] sum w u^T y
        a_obs = a0 + D/2 sum w               b_obs = b0 + 1/2 sum w E||y - u Phi||^2
        a_w = a0_w + K/2 sum w               b_w = b0_w + 1/2 sum w sum_k E w_k^2
    """
    q0 = prior_params(prior, num_features, dim, sums.uy.dtype)
    return GlobalParams(
        pi_a=q0.pi_a + sums.z,
        pi_b=q0.pi_b + sums.count - sums.z,
        phi_precision=q0.phi_precision + moments.gamma_obs * sums.uu,
        phi_shift=q0.phi_shift + moments.gamma_obs * sums.uy,
        obs_shape=q0.obs_shape + 0.5 * dim * sums.count,
        obs_rate=q0.obs_rate + 0.5 * sums.residual,
        w_shape=q0.w_shape + 0.5 * num_features * sums.count,
        w_rate=q0.w_rate + 0.5 * sums.w2,
    )


def global_step(
    q: GlobalParams,
    prior: Prior,
    y: jax.Array,
    stats,
    moments: GlobalMoments,
    weights: jax.typing.ArrayLike,
    rho: jax.typing.ArrayLike,
) -> GlobalParams:
    r"""One natural-gradient step :math:`\lambda \leftarrow (1-\rho)\lambda + \rho\hat\lambda`
    (Mandt et al. 2016, eq. 16; Algorithm 1, steps 5-6).

    Args:
        q: current parameters.
        prior: the model's :class:`Prior`.
        y: minibatch (B, D).
        stats: its expected local statistics (``LocalStats`` with leading axis B).
        moments: moments of the *other* blocks (under q, or of a sample of q).
        weights: :math:`\omega_i = (N/B) / T_i` (scalar or (B,)).
        rho: step size; ``rho = 1`` with the whole data set, ``weights = 1`` and moments
            under q is batch CAVI's update.

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import Prior, prior_params
        >>> from numpyro_tempering.models.latent_features.local import LocalStats
        >>> q0, y = prior_params(Prior(), 1, 1), jnp.array([[2.0]])
        >>> st = LocalStats(jnp.ones((1, 1)), jnp.ones(1), jnp.ones((1, 1)), jnp.ones((1, 1, 1)))
        >>> q1 = global_step(q0, Prior(), y, st, expected_moments(q0), 1.0, 1.0)
        >>> float(q1.phi_precision[0, 0]), float(q1.phi_shift[0, 0])  # 1 + E[g] 1, E[g] 2
        (2.0, 2.0)
    """
    sums = sufficient_sums(y, stats, moments, weights)
    target = global_target(prior, sums, moments, q.num_features, q.dim)
    return jax.tree.map(lambda a, b: (1 - rho) * a + rho * b, q, target)


# -- the ELBO's global terms --------------------------------------------------------------------
def elbo_globals(q: GlobalParams, prior: Prior) -> jax.Array:
    r""":math:`\mathbb{E}_q[\log p(\beta)] - \mathbb{E}_q[\log q(\beta)]` in closed form."""
    m = expected_moments(q)
    k, d = q.num_features, q.dim
    a0 = prior.alpha / k
    log_beta_fn = jax.scipy.special.betaln(a0, 1.0)
    e_log_p_pi = jnp.sum((a0 - 1) * m.log_pi - log_beta_fn)
    h_pi = jnp.sum(dist.Beta(q.pi_a, q.pi_b).entropy())
    var = prior.sigma_phi**2
    e_log_p_phi = -0.5 * k * d * jnp.log(2 * jnp.pi * var) - 0.5 * jnp.trace(m.phi_outer) / var
    chol = jnp.linalg.cholesky(q.phi_precision)
    logdet = 2 * jnp.sum(jnp.log(jnp.diagonal(chol)))
    h_phi = 0.5 * d * (k * jnp.log(2 * jnp.pi * jnp.e) - logdet)

    def gamma_terms(shape0, rate0, shape, rate, mean, log_mean):
        e_log_p = (
            shape0 * jnp.log(rate0) - jax.scipy.special.gammaln(shape0)
            + (shape0 - 1) * log_mean - rate0 * mean
        )
        return e_log_p + dist.Gamma(shape, rate).entropy()

    g_obs = gamma_terms(prior.obs_shape, prior.obs_rate, q.obs_shape, q.obs_rate,
                        m.gamma_obs, m.log_gamma_obs)
    g_w = gamma_terms(prior.w_shape, prior.w_rate, q.w_shape, q.w_rate, m.gamma_w,
                      m.log_gamma_w)
    return e_log_p_pi + h_pi + e_log_p_phi + h_phi + g_obs + g_w


# -- the tempered local normaliser ---------------------------------------------------------------
def local_log_partition(
    temperatures: jax.typing.ArrayLike, moments: GlobalMoments, dim: int
) -> jax.Array:
    r"""Per data point :math:`\mathbb{E}_q[\log c(T, \beta)]`, with
    :math:`c(T,\beta) = \int p(y_i, z_i, w_i \mid \beta)^{1/T}\,dy_i\,dw_i\,dz_i`.

    The local joint factorises into K Bernoullis, K Normals :math:`\mathcal{N}(0, 1/\gamma_w)`
    and D Normals of variance :math:`1/\gamma_{obs}` (whose normaliser does not depend on the
    mean), so :math:`\log c` is a sum of closed forms from
    :func:`numpyro_tempering.partition.tempered_log_normalizer` (the variational-tempering
    supplement's Bernoulli eq. 14 and the tempered Gaussian with its normaliser tempered
    too). The Gaussian terms are affine in :math:`\log\gamma`, so evaluating them at
    :math:`\gamma = \exp\mathbb{E}\log\gamma` gives their exact expectation under q; the
    Bernoulli terms are evaluated at :math:`\sigma(\mathbb{E}\log\pi - \mathbb{E}\log(1-\pi))`
    (exact for point moments, a plug-in otherwise).

    Returns shape ``shape(temperatures)``. :math:`\log c(1) = 0`.

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import Prior, prior_params
        >>> m = expected_moments(prior_params(Prior(), 2, 3))
        >>> local_log_partition(jnp.array([1.0, 2.0]), m, 3)[0].item()
        0.0
    """
    temps = jnp.asarray(temperatures, moments.phi.dtype)
    t = temps[..., None]  # against the K features
    bern = dist.Bernoulli(logits=moments.prior_logit)
    log_z_bern = jnp.sum(tempered_log_normalizer(bern, t), -1)
    w_scale = jnp.exp(-0.5 * moments.log_gamma_w)
    obs_scale = jnp.exp(-0.5 * moments.log_gamma_obs)
    k = moments.log_pi.shape[-1]
    log_z_w = k * tempered_log_normalizer(dist.Normal(0.0, w_scale), temps)
    log_z_obs = dim * tempered_log_normalizer(dist.Normal(0.0, obs_scale), temps)
    return log_z_bern + log_z_w + log_z_obs
