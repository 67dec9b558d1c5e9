r"""The finite beta-Bernoulli linear-Gaussian latent feature model and its data.

Shah et al. 2015 (supplement, section "Variational Inference
Schemes"): for :math:`N` observations :math:`y_i \in \mathbb{R}^D` and :math:`K` features,

.. math::

    \pi_k \sim \mathrm{Beta}(\alpha/K, 1), \quad
    \Phi_k \sim \mathcal{N}(0, \sigma_\Phi^2 I_D), \quad
    \gamma_{obs} \sim \mathrm{Gamma}(a_{obs}, b_{obs}), \quad
    \gamma_w \sim \mathrm{Gamma}(a_w, b_w),

    z_{ik} \sim \mathrm{Bern}(\pi_k), \quad
    w_{ik} \sim \mathcal{N}(0, 1/\gamma_w), \quad
    y_i \sim \mathcal{N}\big((z_i \circ w_i)\,\Phi,\; \gamma_{obs}^{-1} I_D\big).

Globals :math:`\beta = (\pi, \Phi, \gamma_{obs}, \gamma_w)`, locals
:math:`\psi_i = (z_i, w_i)`. Gamma distributions are shape/rate.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.util import not_jax_tracer

__all__ = [
    "DEFAULT_PRIOR",
    "LatentFeatureData",
    "Prior",
    "TOY_FEATURE_NAMES",
    "check_prior",
    "feature_recovery",
    "make_data",
    "make_toy_data",
    "model",
    "split_heldout",
    "toy_features",
]


class Prior(NamedTuple):
    """Hyperparameters of the model (Gamma priors are shape/rate).

    ``alpha``: :math:`\\pi_k \\sim \\mathrm{Beta}(\\alpha/K, 1)`; ``sigma_phi``: prior standard
    deviation of the feature entries; ``obs_shape, obs_rate``: prior of the noise precision
    :math:`\\gamma_{obs}`; ``w_shape, w_rate``: prior of the weight precision :math:`\\gamma_w`.
    """

    alpha: float = 2.0
    sigma_phi: float = 1.0
    obs_shape: float = 1.0
    obs_rate: float = 1.0
    w_shape: float = 1.0
    w_rate: float = 1.0


#: the default hyperparameters
DEFAULT_PRIOR = Prior()


def check_prior(prior: Prior) -> Prior:
    """Raise ``TypeError``/``ValueError`` unless ``prior`` is a :class:`Prior` of finite
    positive numbers (traced values are not checked)."""
    if not isinstance(prior, Prior):
        raise TypeError(f"`prior` must be a latent_features.Prior, got {type(prior).__name__}.")
    for name, value in prior._asdict().items():
        if not_jax_tracer(value):
            v = np.asarray(value, dtype=float)
            if v.shape != () or not np.isfinite(v) or v <= 0:
                raise ValueError(f"`prior.{name}` must be a finite number > 0, got {value!r}.")
    return prior


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


def _data_shape(y, num_data, dim) -> tuple[int, int]:
    if y is None:
        if num_data is None or dim is None:
            raise ValueError("without data `y`, give `num_data` and `dim` to generate data.")
        return _check_count(num_data, "num_data"), _check_count(dim, "dim")
    if jnp.ndim(y) != 2:
        raise ValueError(f"`y` must have shape (num_data, dim), got {jnp.shape(y)}.")
    n, d = jnp.shape(y)
    if (num_data is not None and num_data != n) or (dim is not None and dim != d):
        raise ValueError(f"`y` has shape {(n, d)} but num_data={num_data}, dim={dim}.")
    return n, d


def model(
    y: jax.typing.ArrayLike | None = None,
    num_features: int = 4,
    prior: Prior = DEFAULT_PRIOR,
    *,
    num_data: int | None = None,
    dim: int | None = None,
    subsample_size: int | None = None,
) -> None:
    r"""The beta-Bernoulli latent feature model (Shah et al., supplement, model section).

    Sites: ``pi`` (K,), ``phi`` (K, D), ``gamma_obs`` and ``gamma_w`` (scalars); inside
    ``plate("features", K, dim=-2)`` and ``plate("data", N, subsample_size, dim=-1)``: ``z``
    (K, N) Bernoulli and ``w`` (K, N) Normal -- one element per feature and data point, so
    that MCMC's discrete kernels can update them one at a time -- and inside the data plate
    the observed ``y`` (N, D). (Note the (K, N) layout of the locals, the transpose of the
    rest of this package's (N, K).) With ``y=None`` it generates data (give ``num_data`` and
    ``dim``).

    * The paper's tempered joint :math:`p(\beta)\prod_i p(y_i, z_i, w_i\mid\beta)^{1/T}`
      (Mandt et al. 2016, eq. 4) is ``temper(model, T, latent=("z", "w"))``; a temperature of
      shape ``(N,)`` gives one temperature per data point (multicanonical, eq. 10).
    * MCMC: ``z`` is discrete, so use ``DiscreteHMCGibbs(NUTS(model))`` or
      ``MixedHMC(HMC(model))``; tempering works there with a fixed T.
    * SVI: any guide that samples ``z`` (e.g. with ``Bernoulli`` sites) and the continuous
      sites; the structured schemes of :mod:`~numpyro_tempering.models.latent_features.svi`
      are the conjugate, closed-form route.

    Example:
        >>> import jax
        >>> from numpyro.infer import Predictive
        >>> from numpyro_tempering.models import latent_features as lf
        >>> draws = Predictive(lf.model, num_samples=2)(jax.random.PRNGKey(0), num_data=5, dim=3)
        >>> draws["y"].shape, draws["z"].shape, draws["phi"].shape
        ((2, 5, 3), (2, 4, 5), (2, 4, 3))
    """
    n, d = _data_shape(y, num_data, dim)
    k = _check_count(num_features, "num_features")
    check_prior(prior)
    pi = numpyro.sample("pi", dist.Beta(prior.alpha / k, 1.0).expand([k]).to_event(1))
    phi = numpyro.sample("phi", dist.Normal(0.0, prior.sigma_phi).expand([k, d]).to_event(2))
    gamma_obs = numpyro.sample("gamma_obs", dist.Gamma(prior.obs_shape, prior.obs_rate))
    gamma_w = numpyro.sample("gamma_w", dist.Gamma(prior.w_shape, prior.w_rate))
    data = numpyro.plate("data", n, subsample_size=subsample_size, dim=-1)
    with numpyro.plate("features", k, dim=-2), data:
        z = numpyro.sample("z", dist.Bernoulli(probs=pi[:, None]))  # (K, N)
        w = numpyro.sample("w", dist.Normal(0.0, jax.lax.rsqrt(gamma_w)))  # (K, N)
    with data as idx:
        mean = jnp.matmul((jnp.asarray(z, phi.dtype) * w).T, phi)  # (N, D)
        obs = y if y is None or subsample_size is None else jnp.asarray(y)[idx]
        numpyro.sample("y", dist.Normal(mean, jax.lax.rsqrt(gamma_obs)).to_event(1), obs=obs)


# -- data ---------------------------------------------------------------------------------------
_TOY: dict[str, list[tuple[int, int]]] = {
    "ring": [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1), (2, 2)],
    "cross": [(0, 4), (1, 3), (1, 4), (1, 5), (2, 4)],
    "L": [(3, 0), (4, 0), (5, 0), (5, 1), (5, 2)],
    "diagonal": [(3, 3), (4, 4), (5, 5), (3, 5), (5, 3)],
}
#: Names of the four 6 x 6 toy features, in the order of :func:`toy_features`.
TOY_FEATURE_NAMES: tuple[str, ...] = tuple(_TOY)


def toy_features() -> np.ndarray:
    """The four binary 6 x 6 features of the classic toy (one per 3 x 3 quadrant, in the
    spirit of Griffiths and Ghahramani's IBP demonstration), flattened: shape ``(4, 36)``.

    Example:
        >>> import numpy as np
        >>> from numpyro_tempering.models.latent_features import toy_features
        >>> f = toy_features()
        >>> f.shape, f.sum(1).tolist(), int(np.linalg.matrix_rank(f))
        ((4, 36), [8.0, 5.0, 5.0, 5.0], 4)
    """
    images = np.zeros((len(_TOY), 6, 6))
    for k, cells in enumerate(_TOY.values()):
        for r, c in cells:
            images[k, r, c] = 1.0
    return images.reshape(len(_TOY), 36)


class LatentFeatureData(NamedTuple):
    """Data drawn from the model: ``y`` (N, D), the true ``z`` and ``w`` (N, K), features
    ``phi`` (K, D), probabilities ``pi`` (K,) and the noise standard deviation."""

    y: jax.Array
    z: jax.Array
    w: jax.Array
    phi: jax.Array
    pi: jax.Array
    noise_std: float


def make_data(
    rng_key: jax.Array,
    num_data: int,
    features: jax.typing.ArrayLike | None = None,
    *,
    num_features: int = 20,
    dim: int = 64,
    pi: jax.typing.ArrayLike = 0.2,
    noise_std: float = 0.5,
    weight_std: float = 1.0,
) -> LatentFeatureData:
    r"""Draw data from the model's local process with given (or random) features.

    :math:`z_{ik} \sim \mathrm{Bern}(\pi_k)`, :math:`w_{ik} \sim \mathcal{N}(0,
    \mathtt{weight\_std}^2)`, :math:`y_i = (z_i \circ w_i)\Phi + \mathcal{N}(0,
    \mathtt{noise\_std}^2 I)`. Without ``features`` the features are drawn from
    :math:`\mathcal{N}(0, 1)`, shape ``(num_features, dim)`` (the issue's larger synthetic set
    is N = 10^4, K = 20, D = 64).

    Example:
        >>> import jax
        >>> from numpyro_tempering.models.latent_features import make_data
        >>> data = make_data(jax.random.PRNGKey(0), 50, num_features=3, dim=5)
        >>> data.y.shape, data.z.shape, data.phi.shape
        ((50, 5), (50, 3), (3, 5))
    """
    num_data = _check_count(num_data, "num_data")
    for name, value in (("noise_std", noise_std), ("weight_std", weight_std)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
    k_phi, k_z, k_w, k_eps = random.split(rng_key, 4)
    dtype = jnp.result_type(float)
    if features is None:
        phi = random.normal(k_phi, (_check_count(num_features, "num_features"),
                                    _check_count(dim, "dim")), dtype)
    else:
        phi = jnp.asarray(features, dtype)
        if phi.ndim != 2:
            raise ValueError(f"`features` must have shape (K, D), got {phi.shape}.")
    k, d = phi.shape
    pi_arr = np.asarray(pi, dtype=float)
    if np.any(~np.isfinite(pi_arr)) or np.any(pi_arr <= 0) or np.any(pi_arr >= 1):
        raise ValueError(f"`pi` must be in (0, 1), got {pi!r}.")
    probs = jnp.broadcast_to(jnp.asarray(pi, dtype), (k,))
    z = random.bernoulli(k_z, probs, (num_data, k)).astype(dtype)
    w = weight_std * random.normal(k_w, (num_data, k), dtype)
    y = (z * w) @ phi + noise_std * random.normal(k_eps, (num_data, d), dtype)
    return LatentFeatureData(y=y, z=z, w=w, phi=phi, pi=probs, noise_std=float(noise_std))


def make_toy_data(
    rng_key: jax.Array,
    num_data: int = 1000,
    *,
    pi: float = 0.5,
    noise_std: float = 0.3,
    weight_std: float = 1.0,
) -> LatentFeatureData:
    """The classic 6 x 6 toy: the four :func:`toy_features` (D = 36) mixed by the model.

    Example:
        >>> import jax
        >>> from numpyro_tempering.models.latent_features import make_toy_data
        >>> make_toy_data(jax.random.PRNGKey(0), 10).y.shape
        (10, 36)
    """
    return make_data(rng_key, num_data, toy_features(), pi=pi, noise_std=noise_std,
                     weight_std=weight_std)


def split_heldout(
    rng_key: jax.Array, y: jax.typing.ArrayLike, fraction: float = 0.2
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Random split into ``(train, test, test_indices)`` with ``fraction`` held out.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import split_heldout
        >>> train, test, idx = split_heldout(jax.random.PRNGKey(0), jnp.zeros((10, 2)))
        >>> train.shape, test.shape
        ((8, 2), (2, 2))
    """
    y = jnp.asarray(y)
    if y.ndim != 2:
        raise ValueError(f"`y` must have shape (N, D), got {y.shape}.")
    if not 0 < fraction < 1:
        raise ValueError(f"`fraction` must be in (0, 1), got {fraction!r}.")
    n = y.shape[0]
    num_test = int(round(fraction * n))
    if num_test < 1 or num_test >= n:
        raise ValueError(f"holding out {fraction} of N = {n} leaves an empty set.")
    perm = random.permutation(rng_key, n)
    test_idx = jnp.sort(perm[:num_test])
    train_idx = jnp.sort(perm[num_test:])
    return y[train_idx], y[test_idx], test_idx


def feature_recovery(
    estimated: jax.typing.ArrayLike, truth: jax.typing.ArrayLike
) -> tuple[float, np.ndarray, np.ndarray]:
    r"""Match learnt features to true ones up to order, sign and scale.

    The model is invariant to permuting features and to :math:`(w_k, \Phi_k) \to (c\,w_k,
    \Phi_k / c)` (a sign flip included, as :math:`w` is symmetric), so features are compared
    by the absolute cosine similarity :math:`|\cos(\hat\Phi_j, \Phi_k)|`; the assignment
    maximising its sum is found with ``scipy.optimize.linear_sum_assignment`` (rectangular:
    more learnt features than true ones is fine). Returns ``(mean |cos| over the true
    features, perm, signs)`` with ``signs[k] * estimated[perm[k]]`` matched to ``truth[k]``.
    (The FMM's ``component_error`` compares in Euclidean distance, which the scale symmetry
    here makes meaningless.)

    Example:
        >>> import numpy as np
        >>> from numpyro_tempering.models.latent_features import feature_recovery
        >>> truth = np.eye(3)
        >>> score, perm, signs = feature_recovery(-2 * truth[[2, 0, 1]], truth)
        >>> score, perm.tolist(), signs.tolist()
        (1.0, [1, 2, 0], [-1.0, -1.0, -1.0])
    """
    from scipy.optimize import linear_sum_assignment

    est, true = np.asarray(estimated, float), np.asarray(truth, float)
    if est.ndim != 2 or true.ndim != 2 or est.shape[1] != true.shape[1]:
        raise ValueError(
            f"`estimated` (J, D) and `truth` (K, D) must be 2-D with the same D, got "
            f"{est.shape} and {true.shape}."
        )
    if est.shape[0] < true.shape[0]:
        raise ValueError(
            f"need at least as many learnt features as true ones, got {est.shape[0]} < "
            f"{true.shape[0]}."
        )
    norm = lambda a: a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-300)  # noqa: E731
    cos = norm(true) @ norm(est).T  # (K, J)
    rows, cols = linear_sum_assignment(-np.abs(cos))
    perm = np.empty(true.shape[0], dtype=int)
    perm[rows] = cols
    matched = cos[np.arange(true.shape[0]), perm]
    signs = np.where(matched < 0, -1.0, 1.0)
    return float(np.mean(np.abs(matched))), perm, signs
