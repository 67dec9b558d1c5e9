r"""The factorial mixture model (FMM) of Mandt et al. 2016, section 4.2.

Generative process (eq. 19), for N data points :math:`x_n \in \mathbb{R}^D` and K components:

.. math::

    \mu_k \sim \mathcal{N}(0, \sigma_\mu^2 I_D), \qquad
    z_{nk} \sim \mathrm{Bern}(\pi_k), \qquad
    x_n = \textstyle\sum_k z_{nk} \mu_k + \varepsilon_n, \quad
    \varepsilon_n \sim \mathcal{N}(0, \sigma_n^2 I_D).

Every :math:`z_{nk}` is an independent switch, so a data point is a *sum* of features rather
than one of them. (The paper writes :math:`\mathcal{N}(0, \sigma)`; we read
:math:`\sigma_\mu, \sigma_n` as standard deviations, which is what makes its toy settings
:math:`\sigma_n = 0.1`, :math:`\sigma_\mu = 0.35` sensible for features of size 0.5-1.)

What this module provides
-------------------------
* :func:`toy_components`, :func:`make_toy_data`: the paper's toy data set (Fig. 5): 8 binary
  4x4 images, each weighted by a U[0.5, 1] draw, mixed with :math:`\pi_k = 0.3` and
  :math:`\sigma_n = 0.1`. The images are our own, made by code.
* :func:`model`: the FMM with explicit binary locals ``z`` (generation, partition-function
  checks, or tempering of the locals with ``temper(model, T, latent="z")``).
* :func:`collapsed_model`: the same with ``z`` summed out exactly over all :math:`2^K`
  configurations (:class:`FactorialMixture`); this is what SVI fits with a Gaussian guide on
  :math:`\mu`.
* :func:`jointly_tempered_log_lik` and :func:`log_partition`: the paper's *joint* tempering
  of :math:`p(x_n, z_n \mid \mu)` and its partition function (supplement, section C).
* :func:`match_components`, :func:`component_error`: compare recovered and true features up
  to the permutation symmetry of the components.

Two ways of tempering the collapsed model
-----------------------------------------
The paper (eq. 4) tempers :math:`p(x_n, z_n \mid \mu)^{1/T}` *jointly*. Summing the locals out
of that gives

.. math::

    \log \sum_{z} p(x_n, z \mid \mu)^{1/T}
      = \log Z_N(T) + \textstyle\sum_k \log Z_{B,k}(T)
        + \log \mathrm{FMM}\big(x_n; \mu, \pi_T, \sigma_n \sqrt{T}\big),

    Z_{B,k}(T) = \pi_k^{1/T} + (1-\pi_k)^{1/T}, \quad
    \pi_{T,k} = \pi_k^{1/T} / Z_{B,k}(T), \quad
    Z_N(T) = (2\pi\sigma_n^2)^{(1 - 1/T) D / 2}\, T^{D/2},

i.e. an FMM whose switches are closer to fair coins and whose noise is :math:`\sqrt{T}` times
wider, times a constant. This *changes the landscape*: at high T nearby configurations blur
together and the features are pulled towards shared averages (deterministic annealing). It is
exactly the tempered ELBO (eq. 7) maximised over a free-form :math:`q(z_n)`, because
:math:`\max_{q} \mathbb{E}_q[\log p(x_n, z \mid \mu)]/T + H[q]
= \log \sum_z p(x_n, z \mid \mu)^{1/T}`.

``temper(collapsed_model, T)`` instead tempers the *marginal* :math:`p(x_n \mid \mu)^{1/T}`:
the likelihood surface keeps its shape and is only down-weighted against the prior and the
guide's entropy (a wider posterior, the same optima). Both are legitimate tempered models; the
joint one is the paper's. ``collapsed_model(..., temperature=T)`` gives the joint one (with its
partition function included, so that its density is :math:`\sum_z p(x_n, z\mid\mu)^{1/T}`
exactly); ``temper`` on top of it would temper a second time.

Cost: the collapsed likelihood evaluates :math:`2^K` Gaussian means per data point with one
matrix product (:math:`N \times 2^K \times D` flops); K = 8 gives 256 configurations, and K is
limited to 16.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from jax.scipy.special import logsumexp
from numpyro.distributions import constraints
from numpyro.distributions.util import validate_sample
from numpyro.util import not_jax_tracer

__all__ = [
    "COMPONENT_NAMES",
    "FMMData",
    "FactorialMixture",
    "collapsed_model",
    "component_error",
    "jointly_tempered_log_lik",
    "jointly_tempered_params",
    "log_partition",
    "make_toy_data",
    "match_components",
    "model",
    "multicanonical_model",
    "toy_components",
]

#: Maximum number of components of the exactly collapsed likelihood (2^16 configurations).
MAX_COMPONENTS = 16

_SHAPES: dict[str, list[tuple[int, int]]] = {
    "top bar": [(0, c) for c in range(4)],
    "right bar": [(r, 3) for r in range(4)],
    "diagonal": [(i, i) for i in range(4)],
    "anti-diagonal": [(i, 3 - i) for i in range(4)],
    "centre square": [(1, 1), (1, 2), (2, 1), (2, 2)],
    "L": [(1, 0), (2, 0), (3, 0), (3, 1)],
    "top-left block": [(0, 0), (0, 1), (1, 0), (1, 1)],
    "arrow": [(1, 2), (2, 2), (2, 3), (3, 2)],
}
#: Names of the 8 hand-made components, in the order of :func:`toy_components`.
COMPONENT_NAMES: tuple[str, ...] = tuple(_SHAPES)


def toy_components() -> np.ndarray:
    """The 8 hand-made binary 4x4 features of the toy data, flattened: shape ``(8, 16)``.

    Bars, diagonals, blocks and small shapes (:data:`COMPONENT_NAMES`), chosen so that the
    8 images are linearly independent and any two distinct on/off configurations differ in
    at least 4 pixels (so that every configuration is identifiable at :math:`\\sigma_n = 0.1`).

    Example:
        >>> import numpy as np
        >>> from numpyro_tempering.models.fmm import toy_components
        >>> b = toy_components()
        >>> b.shape, int(b.sum(1).min()), int(np.linalg.matrix_rank(b))
        ((8, 16), 4, 8)
    """
    images = np.zeros((len(_SHAPES), 4, 4))
    for k, cells in enumerate(_SHAPES.values()):
        for r, c in cells:
            images[k, r, c] = 1.0
    return images.reshape(len(_SHAPES), 16)


class FMMData(NamedTuple):
    """Toy FMM data: observations ``x`` (N, D), switches ``z`` (N, K), features ``mu`` (K, D)
    and the per-feature weights (K,) (``mu = weights[:, None] * binary images``)."""

    x: jax.Array
    z: jax.Array
    mu: jax.Array
    weights: jax.Array


def make_toy_data(
    rng_key: jax.Array,
    num_data: int = 500,
    *,
    pi: float = 0.3,
    sigma_n: float = 0.1,
    weight_range: tuple[float, float] = (0.5, 1.0),
    components: jax.typing.ArrayLike | None = None,
) -> FMMData:
    """Generate the paper's toy FMM data (section 4.2, Fig. 5).

    ``mu_k = w_k b_k`` with ``w_k ~ U[weight_range]`` and ``b_k`` the binary images of
    :func:`toy_components` (or ``components``), ``z_nk ~ Bern(pi)`` and
    ``x_n = sum_k z_nk mu_k + N(0, sigma_n^2 I)``. The paper uses N = 10,000.

    Example:
        >>> import jax
        >>> from numpyro_tempering.models.fmm import make_toy_data
        >>> data = make_toy_data(jax.random.PRNGKey(0), 100)
        >>> data.x.shape, data.z.shape, data.mu.shape
        ((100, 16), (100, 8), (8, 16))
    """
    if int(num_data) != num_data or num_data < 1:
        raise ValueError(f"`num_data` must be a positive integer, got {num_data!r}.")
    _check_pi_sigma(pi, sigma_n)
    low, high = weight_range
    if not 0 <= low <= high:
        raise ValueError(
            f"`weight_range` must be (low, high) with 0 <= low <= high, got {weight_range!r}."
        )
    images = jnp.asarray(toy_components() if components is None else components)
    if images.ndim != 2:
        raise ValueError(f"`components` must have shape (K, D), got {images.shape}.")
    num_components = images.shape[0]
    k_w, k_z, k_eps = random.split(rng_key, 3)
    dtype = jnp.result_type(float)
    weights = random.uniform(k_w, (num_components,), dtype, minval=low, maxval=high)
    mu = weights[:, None] * images.astype(dtype)
    probs = jnp.broadcast_to(jnp.asarray(pi, dtype), (num_components,))
    z = random.bernoulli(k_z, probs, (int(num_data), num_components)).astype(dtype)
    x = z @ mu + sigma_n * random.normal(k_eps, (int(num_data), mu.shape[1]), dtype)
    return FMMData(x=x, z=z, mu=mu, weights=weights)


# -- the collapsed likelihood --------------------------------------------------------------
def _check_pi_sigma(pi, sigma_n) -> None:
    for name, value, ok in (
        ("pi", pi, lambda v: np.all((v > 0) & (v < 1))),
        ("sigma_n", sigma_n, lambda v: np.all(v > 0)),
    ):
        if not not_jax_tracer(value):
            continue
        v = np.asarray(value)
        if not np.all(np.isfinite(v)) or not ok(v):
            raise ValueError(
                f"`{name}` must be {'in (0, 1)' if name == 'pi' else '> 0'}, got {value!r}."
            )


def _configurations(num_components: int, dtype) -> jax.Array:
    """All 2^K binary configurations, shape (2^K, K), in lexicographic order."""
    if num_components > MAX_COMPONENTS:
        raise ValueError(
            f"the collapsed FMM enumerates 2^K configurations; K = {num_components} > "
            f"{MAX_COMPONENTS} is too many."
        )
    configs = np.array(list(itertools.product((0.0, 1.0), repeat=num_components)))
    return jnp.asarray(configs.reshape(-1, num_components), dtype=dtype)


def _config_log_joint(x: jax.Array, mu: jax.Array, pi: jax.Array, sigma_n: jax.Array) -> jax.Array:
    """log p(x_n, z = c | mu) for every configuration c: shape batch + (2^K,).

    ``x``: (..., D); ``mu``: (..., K, D); ``pi``: (..., K); ``sigma_n``: (...). The squared
    distance is expanded as |x|^2 - 2 x.m_c + |m_c|^2 so that no (N, 2^K, D) array is built.
    """
    num_components, dim = mu.shape[-2], mu.shape[-1]
    configs = _configurations(num_components, mu.dtype)
    log_prior = jnp.matmul(jnp.log(pi), configs.T) + jnp.matmul(jnp.log1p(-pi), 1 - configs.T)
    means = jnp.matmul(configs, mu)  # (..., C, D)
    cross = jnp.matmul(x[..., None, :], jnp.swapaxes(means, -1, -2))[..., 0, :]
    sq_dist = jnp.sum(x**2, -1)[..., None] - 2 * cross + jnp.sum(means**2, -1)
    sq_dist = jnp.maximum(sq_dist, 0.0)
    var = jnp.asarray(sigma_n, mu.dtype)[..., None] ** 2
    log_gauss = -0.5 * sq_dist / var - 0.5 * dim * jnp.log(2 * jnp.pi * var)
    return log_prior + log_gauss


class FactorialMixture(dist.Distribution):
    r"""The FMM likelihood with the binary switches summed out exactly (eq. 19):

    .. math::

        p(x \mid \mu) = \sum_{c \in \{0,1\}^K} \prod_k \pi_k^{c_k} (1-\pi_k)^{1-c_k}\;
            \mathcal{N}\big(x; \textstyle\sum_k c_k \mu_k, \sigma_n^2 I_D\big).

    Args:
        mu: features, shape ``batch + (K, D)``.
        pi: switch probabilities, broadcastable to ``batch + (K,)``.
        sigma_n: noise standard deviation, broadcastable to ``batch``.

    The event shape is ``(D,)``. ``log_prob`` is one log-sum-exp over the :math:`2^K`
    configurations; ``sample`` draws the switches and the noise.

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro_tempering.models.fmm import FactorialMixture
        >>> d = FactorialMixture(jnp.array([[1.0], [2.0]]), 0.5, 1.0)
        >>> d.event_shape, d.log_prob(jnp.zeros((3, 1))).shape
        ((1,), (3,))
    """

    arg_constraints = {
        "mu": constraints.independent(constraints.real, 2),
        "pi": constraints.independent(constraints.open_interval(0.0, 1.0), 1),
        "sigma_n": constraints.positive,
    }
    support = constraints.real_vector
    reparametrized_params = ["mu", "sigma_n"]

    def __init__(self, mu, pi=0.3, sigma_n=0.1, *, validate_args=None):
        mu = jnp.asarray(mu)
        if mu.ndim < 2:
            raise ValueError(f"FactorialMixture: `mu` must have shape (..., K, D), got {mu.shape}.")
        if not jnp.issubdtype(mu.dtype, jnp.floating):
            mu = mu.astype(jnp.result_type(float))
        num_components, dim = mu.shape[-2:]
        _configurations(num_components, mu.dtype)  # validates K
        _check_pi_sigma(pi, sigma_n)
        pi = jnp.asarray(pi, mu.dtype)
        if pi.ndim == 0:
            pi = jnp.broadcast_to(pi, (num_components,))
        if pi.shape[-1] != num_components:
            raise ValueError(
                f"FactorialMixture: `pi` must have K = {num_components} entries "
                f"in its last axis, got shape {pi.shape}."
            )
        sigma_n = jnp.asarray(sigma_n, mu.dtype)
        batch_shape = jax.lax.broadcast_shapes(mu.shape[:-2], pi.shape[:-1], sigma_n.shape)
        self.mu = jnp.broadcast_to(mu, batch_shape + (num_components, dim))
        self.pi = jnp.broadcast_to(pi, batch_shape + (num_components,))
        self.sigma_n = jnp.broadcast_to(sigma_n, batch_shape)
        super().__init__(batch_shape=batch_shape, event_shape=(dim,), validate_args=validate_args)

    @property
    def num_components(self) -> int:
        return self.mu.shape[-2]

    def sample(self, key, sample_shape=()):
        k_z, k_eps = random.split(key)
        shape = tuple(sample_shape) + self.batch_shape
        z = random.bernoulli(k_z, self.pi, shape + (self.num_components,)).astype(self.mu.dtype)
        mean = jnp.matmul(z[..., None, :], self.mu)[..., 0, :]
        noise = random.normal(k_eps, shape + self.event_shape, self.mu.dtype)
        return mean + self.sigma_n[..., None] * noise

    def config_log_joint(self, value: jax.Array) -> jax.Array:
        """log p(x, z = c | mu) for all 2^K configurations c (last axis)."""
        return _config_log_joint(value, self.mu, self.pi, self.sigma_n)

    #: NumPyro's mixture name for the same thing: ``temper(..., joint=True)`` reads it.
    component_log_probs = config_log_joint

    @validate_sample
    def log_prob(self, value):
        return logsumexp(self.config_log_joint(value), axis=-1)

    @property
    def mean(self):
        return jnp.matmul(self.pi[..., None, :], self.mu)[..., 0, :]


# -- joint tempering --------------------------------------------------------------------------
def jointly_tempered_params(
    temperature: jax.typing.ArrayLike,
    pi: jax.typing.ArrayLike = 0.3,
    sigma_n: jax.typing.ArrayLike = 0.1,
) -> tuple[jax.Array, jax.Array]:
    r"""The FMM parameters of the jointly tempered model: :math:`(\pi_T, \sigma_n\sqrt{T})`.

    :math:`\pi_T = \pi^{1/T} / (\pi^{1/T} + (1-\pi)^{1/T})` (computed in log space).

    Example:
        >>> from numpyro_tempering.models.fmm import jointly_tempered_params
        >>> [round(float(v), 4) for v in jointly_tempered_params(4.0, 0.3, 0.1)]
        [0.4472, 0.2]
    """
    beta = 1.0 / jnp.asarray(temperature)
    pi = jnp.asarray(pi)
    pi_t = jax.nn.sigmoid(beta * (jnp.log(pi) - jnp.log1p(-pi)))
    return pi_t, jnp.asarray(sigma_n) * jnp.sqrt(jnp.asarray(temperature))


def _log_local_partition(temperature, dim, pi, sigma_n, num_components, normalised):
    """log of the per-datum tempered partition function (see :func:`log_partition`)."""
    temperature = jnp.asarray(temperature)
    beta = 1.0 / temperature
    pi = jnp.asarray(pi)
    if pi.ndim == 0:
        pi = jnp.broadcast_to(pi, (num_components,))
    elif pi.shape[-1] != num_components:
        raise ValueError(
            f"`pi` has {pi.shape[-1]} entries but `num_components` is {num_components}."
        )
    # log(pi^(1/T) + (1-pi)^(1/T)) for every component, summed
    log_z_bern = jnp.logaddexp(beta[..., None] * jnp.log(pi), beta[..., None] * jnp.log1p(-pi))
    log_c = jnp.sum(log_z_bern, -1) + 0.5 * dim * jnp.log(temperature)
    if normalised:
        log_c = log_c + 0.5 * dim * (1.0 - beta) * jnp.log(2 * jnp.pi * jnp.asarray(sigma_n) ** 2)
    return log_c


def jointly_tempered_log_lik(
    x: jax.typing.ArrayLike,
    mu: jax.typing.ArrayLike,
    temperature: jax.typing.ArrayLike,
    pi: jax.typing.ArrayLike = 0.3,
    sigma_n: jax.typing.ArrayLike = 0.1,
) -> jax.Array:
    r"""Per-datum :math:`\log \sum_{z_n} p(x_n, z_n \mid \mu)^{1/T}` (eq. 4 with z summed out).

    The paper's tempering of the local joint (Mandt et al. 2016, eq. 4 and 7;
    supplement section C), evaluated exactly by enumerating the :math:`2^K` configurations:
    ``logsumexp_c [log p(x_n, c | mu) / T]``. It equals the tempered ELBO's local terms
    maximised over :math:`q(z_n)`, and, by the identity in the module docstring,
    ``log_partition(T, 1, D, pi, sigma_n) + FactorialMixture(mu, pi_T, sigma_n sqrt(T))
    .log_prob(x)``. At T = 1 it is ``FactorialMixture(mu, pi, sigma_n).log_prob(x)``.

    Args:
        x: data, shape ``(..., D)``.
        mu: features, shape ``(..., K, D)``.
        temperature: T > 0, a scalar or broadcastable to the batch shape of ``x`` (e.g. one
            temperature per data point, for multicanonical VI).
        pi, sigma_n: as in :class:`FactorialMixture`.

    Returns:
        shape ``batch`` (e.g. ``(N,)`` for x of shape (N, D)).

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro_tempering.models.fmm import FactorialMixture, jointly_tempered_log_lik
        >>> mu, x = jnp.array([[1.0], [2.0]]), jnp.array([[0.5], [3.0]])
        >>> a = jointly_tempered_log_lik(x, mu, 1.0, 0.3, 0.5)
        >>> bool(jnp.allclose(a, FactorialMixture(mu, 0.3, 0.5).log_prob(x)))
        True
    """
    mixture = FactorialMixture(mu, pi, sigma_n)
    x = jnp.asarray(x, mixture.mu.dtype)
    log_joint = mixture.config_log_joint(x)
    beta = 1.0 / jnp.asarray(temperature, log_joint.dtype)
    return logsumexp(beta[..., None] * log_joint, axis=-1)


def log_partition(
    temperature: jax.typing.ArrayLike,
    num_data: int,
    dim: int,
    pi: jax.typing.ArrayLike = 0.3,
    sigma_n: jax.typing.ArrayLike = 0.1,
    *,
    num_components: int | None = None,
    normalised: bool = True,
) -> jax.Array:
    r"""Log tempered partition function :math:`\log C(T)` of the jointly tempered FMM.

    With the locals tempered jointly (eq. 4, :math:`p(\mu) \prod_n p(x_n, z_n\mid\mu)^{1/T}`),

    .. math::

        C(T) = \int d\mu\, p(\mu) \prod_n \sum_{z_n} \int dx_n\, p(x_n, z_n \mid \mu)^{1/T}
             = \prod_n \Big[\prod_k \big(\pi_k^{1/T} + (1 - \pi_k)^{1/T}\big)\Big]
               \Big[(2\pi\sigma_n^2)^{(1 - 1/T) D / 2}\; T^{D/2}\Big],

    independent of :math:`\mu`: the x-integral of a tempered Gaussian is
    :math:`(2\pi\sigma_n^2)^{-D/(2T)} (2\pi\sigma_n^2 T)^{D/2}` whatever its mean. This is the
    normaliser of the density NumPyro computes for ``temper(model, T, latent="z")`` (the full,
    normalised Gaussian and Bernoulli log densities, scaled by 1/T), and what an evidence or
    multicanonical weight built on that density needs.

    The paper (supplement section C, eq. 12-14; main text section 4.2) tempers only the
    *exponent* of the Gaussian and keeps its normaliser :math:`(2\pi\sigma_n^2)^{-D/2}` at
    power one, which gives :math:`\log C(T) = \tfrac{ND}{2}\log T + N\sum_k
    \log(\pi_k^{1/T} + (1-\pi_k)^{1/T})`; that is ``normalised=False``. The two differ by
    :math:`\tfrac{ND}{2}(1 - 1/T)\log(2\pi\sigma_n^2)`, which is not small: for
    :math:`\sigma_n = 0.1` and T = 10 it is about -1.5 nats per dimension and datum.

    Args:
        temperature: T > 0 (scalar or array: the result has its shape).
        num_data, dim: N and D.
        pi: switch probabilities, a scalar or shape (K,).
        sigma_n: noise standard deviation (only used when ``normalised``).
        num_components: K when ``pi`` is a scalar (default 8, the paper's toy model).
        normalised: ``True`` for NumPyro's normalised density, ``False`` for the paper's.

    Example:
        >>> from numpyro_tempering.models.fmm import log_partition
        >>> float(log_partition(1.0, 100, 16, 0.3, 0.1))  # C(1) = 1
        0.0
        >>> round(float(log_partition(2.0, 1, 1, 0.5, 1.0, num_components=1,
        ...                           normalised=False)), 4)  # log(sqrt(2) * 2 * sqrt(0.5))
        0.6931
    """
    if num_components is None:
        num_components = 8 if jnp.ndim(pi) == 0 else jnp.shape(pi)[-1]
    if int(num_data) != num_data or num_data < 1 or int(dim) != dim or dim < 1:
        raise ValueError(
            f"`num_data` and `dim` must be positive integers, got {num_data!r} and {dim!r}."
        )
    _check_pi_sigma(pi, sigma_n)
    local = _log_local_partition(temperature, dim, pi, sigma_n, num_components, normalised)
    return num_data * local


# -- models ---------------------------------------------------------------------------------
def _data_shape(x, num_data, dim) -> tuple[int, int]:
    if x is None:
        if num_data is None or dim is None:
            raise ValueError("without data `x`, give `num_data` and `dim` to generate data.")
        return int(num_data), int(dim)
    if jnp.ndim(x) != 2:
        raise ValueError(f"`x` must have shape (num_data, dim), got {jnp.shape(x)}.")
    n, d = jnp.shape(x)
    if (num_data is not None and num_data != n) or (dim is not None and dim != d):
        raise ValueError(f"`x` has shape {(n, d)} but num_data={num_data}, dim={dim}.")
    return n, d


def _prior(num_components: int, dim: int, sigma_mu) -> jax.Array:
    if num_components < 1:
        raise ValueError(f"`num_components` must be >= 1, got {num_components}.")
    return numpyro.sample(
        "mu", dist.Normal(0.0, sigma_mu).expand([num_components, dim]).to_event(2)
    )


def model(
    x: jax.typing.ArrayLike | None = None,
    num_components: int = 8,
    pi: jax.typing.ArrayLike = 0.3,
    sigma_n: float = 0.1,
    sigma_mu: float = 0.35,
    *,
    num_data: int | None = None,
    dim: int | None = None,
) -> None:
    """The FMM with explicit binary switches (eq. 19).

    Sites: ``mu`` (K, D) global features; inside ``plate("data", N)``: ``z`` (N, K) Bernoulli
    switches (``to_event(1)``) and ``x`` (N, D) observations. With ``x=None`` it generates
    data (give ``num_data`` and ``dim``). The paper's jointly tempered model is
    ``temper(model, T, latent="z")``; its normaliser is :func:`log_partition`.

    Example:
        >>> import jax
        >>> from numpyro.infer import Predictive
        >>> from numpyro_tempering.models import fmm
        >>> draws = Predictive(fmm.model, num_samples=2)(jax.random.PRNGKey(0), num_data=5, dim=3)
        >>> draws["x"].shape, draws["z"].shape, draws["mu"].shape
        ((2, 5, 3), (2, 5, 8), (2, 8, 3))
    """
    n, d = _data_shape(x, num_data, dim)
    _check_pi_sigma(pi, sigma_n)
    mu = _prior(num_components, d, sigma_mu)
    probs = jnp.broadcast_to(jnp.asarray(pi, mu.dtype), (num_components,))
    with numpyro.plate("data", n):
        z = numpyro.sample("z", dist.Bernoulli(probs=probs).to_event(1))
        mean = jnp.matmul(jnp.asarray(z, mu.dtype), mu)
        numpyro.sample("x", dist.Normal(mean, sigma_n).to_event(1), obs=x)


def collapsed_model(
    x: jax.typing.ArrayLike | None = None,
    num_components: int = 8,
    pi: jax.typing.ArrayLike = 0.3,
    sigma_n: float = 0.1,
    sigma_mu: float = 0.35,
    *,
    num_data: int | None = None,
    dim: int | None = None,
    subsample_size: int | None = None,
    temperature: jax.typing.ArrayLike | None = None,
) -> None:
    r"""The FMM with the switches summed out: ``x_n ~ FactorialMixture(mu, pi, sigma_n)``.

    Sites: ``mu`` (K, D) and, inside ``plate("data", N, subsample_size)``, the observed ``x``.
    This is the model to fit with SVI and a Gaussian guide on ``mu`` (e.g. ``AutoNormal``).

    * ``temper(collapsed_model, T)`` tempers the marginal likelihood
      :math:`p(x_n \mid \mu)^{1/T}` (see the module docstring);
    * ``temperature=T`` (a number or a traced scalar, e.g. inside ``lax.scan``) instead makes
      ``x`` the paper's jointly tempered local, density
      :math:`\sum_{z_n} p(x_n, z_n \mid \mu)^{1/T}` (normalised: its integral over x is
      ``exp(log_partition(T, 1, D, ...))``), implemented as the FMM with parameters
      :func:`jointly_tempered_params` plus a ``log_partition`` factor. The site keeps its
      name and is observed, so ``temper`` on top would temper it a second time.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from numpyro.infer.util import log_density
        >>> from numpyro_tempering.models import fmm
        >>> data = fmm.make_toy_data(jax.random.PRNGKey(0), 50)
        >>> lp, _ = log_density(fmm.collapsed_model, (data.x,), {}, {"mu": data.mu})
        >>> lp.shape
        ()
    """
    n, d = _data_shape(x, num_data, dim)
    _check_pi_sigma(pi, sigma_n)
    mu = _prior(num_components, d, sigma_mu)
    if temperature is None:
        likelihood = FactorialMixture(mu, pi, sigma_n)
    else:
        pi_t, sigma_t = jointly_tempered_params(temperature, pi, sigma_n)
        likelihood = FactorialMixture(mu, pi_t, sigma_t)
    with numpyro.plate("data", n, subsample_size=subsample_size) as idx:
        obs = x if x is None or subsample_size is None else jnp.asarray(x)[idx]
        numpyro.sample("x", likelihood, obs=obs)
    if temperature is not None:
        numpyro.factor(
            "x_log_partition",
            log_partition(temperature, n, d, pi, sigma_n, num_components=num_components),
        )


# -- comparing features -----------------------------------------------------------------------
def multicanonical_model(
    x: jax.typing.ArrayLike,
    beta_z: jax.typing.ArrayLike,
    num_components: int = 8,
    pi: jax.typing.ArrayLike = 0.3,
    sigma_n: jax.typing.ArrayLike = 0.1,
    sigma_mu: jax.typing.ArrayLike = 0.35,
) -> None:
    r"""The FMM with the local step done analytically at inverse temperature ``beta_z``.

    For multicanonical VI (Mandt et al. 2016, eq. 13 and Algorithm 1): with
    :math:`q(z_n = c) \propto p(x_n, c \mid \mu)^{\beta_z}` over all 2^K configurations,

    * ``x_z`` (to be tempered): :math:`\mathbb{E}_{q(z_n)}[\log p(x_n, z_n \mid \mu)]`, the
      expectation of exactly what ``temper(model, T, latent="z")`` tempers, so
      :func:`log_partition` is its normaliser;
    * ``z_entropy`` (exclude it from tempering): :math:`H[q(z_n)]`.

    At ``beta_z = 1`` the two factors add up to log p(x_n | mu) exactly. Use with
    ``MulticanonicalELBO(ladder, exclude="z_entropy")`` and ``beta_z`` the previous step's
    :math:`\mathbb{E}_{q(y)}[1/T_y]`.
    """
    num_data, dim = jnp.shape(x)
    mu = _prior(num_components, dim, sigma_mu)
    log_joint = FactorialMixture(mu, pi, sigma_n).config_log_joint(x)  # (N, 2^K)
    log_q = jax.nn.log_softmax(beta_z * log_joint, axis=-1)
    q = jnp.exp(log_q)
    with numpyro.plate("data", num_data):
        numpyro.factor("x_z", jnp.sum(q * log_joint, -1))
        numpyro.factor("z_entropy", -jnp.sum(q * log_q, -1))


def match_components(estimated: jax.typing.ArrayLike, truth: jax.typing.ArrayLike) -> np.ndarray:
    """The permutation of estimated components that best matches the true ones.

    Solves the assignment problem (``scipy.optimize.linear_sum_assignment``) on the squared
    Euclidean distances between components, the rows of ``(K, D)`` arrays. Returns ``perm``
    with ``estimated[perm][k]`` matched to ``truth[k]``.

    Example:
        >>> import numpy as np
        >>> from numpyro_tempering.models.fmm import match_components
        >>> truth = np.eye(3)
        >>> match_components(truth[[2, 0, 1]], truth).tolist()
        [1, 2, 0]
    """
    from scipy.optimize import linear_sum_assignment

    est, true = np.asarray(estimated, float), np.asarray(truth, float)
    if est.ndim != 2 or est.shape != true.shape:
        raise ValueError(
            f"`estimated` and `truth` must both be (K, D) arrays of the same "
            f"shape, got {est.shape} and {true.shape}."
        )
    cost = ((true[:, None, :] - est[None, :, :]) ** 2).sum(-1)
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(len(rows), dtype=int)
    perm[rows] = cols
    return perm


def component_error(estimated: jax.typing.ArrayLike, truth: jax.typing.ArrayLike) -> float:
    """Root-mean-square error between the features after :func:`match_components`.

    Example:
        >>> import numpy as np
        >>> from numpyro_tempering.models.fmm import component_error
        >>> truth = np.eye(3)
        >>> component_error(truth[[2, 0, 1]], truth)
        0.0
    """
    est, true = np.asarray(estimated, float), np.asarray(truth, float)
    perm = match_components(est, true)
    return float(math.sqrt(np.mean((est[perm] - true) ** 2)))
