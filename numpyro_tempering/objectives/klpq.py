r"""KLpq: minimise KL(p || q) with self-normalised importance weights (reweighted wake-sleep).

Pradier et al. 2019, appendix B, eq. 3 (after Ji et al. 2010):

.. math::

    \mathrm{UB}_{KLpq}(q) = \mathbb{E}_{p(z \mid x)}\big[\log p(x, z) - \log q(z)\big]
    = \log p(x) + \mathrm{KL}(p(z \mid x) \,\|\, q(z)) \;\ge\; \log p(x),

so minimising the bound over q minimises the inclusive KL(p || q). The posterior expectation
is estimated by self-normalised importance sampling from q (the "wake phase" of reweighted
wake-sleep; Edward's ``KLpq``), which needs no reparameterisation: q may have discrete sites.

The guide runs under :class:`~numpyro_tempering.handlers.stop_sample_gradients` (fixed
samples) and, by default, the model under
:class:`~numpyro_tempering.handlers.stop_param_gradients` (fixed model parameters).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from numpyro_tempering import bounds
from numpyro_tempering.handlers import stop_param_gradients as stop_param_gradients
from numpyro_tempering.handlers import stop_sample_gradients
from numpyro_tempering.objectives.base import UpperBoundELBO, weighted_surrogate

__all__ = ["KLpq"]


class KLpq(UpperBoundELBO):
    r"""Minimise KL(p || q) via the KLpq upper bound (Pradier et al. 2019, eq. 3).

    For S particles :math:`z_s \sim q` with log weights
    :math:`\log w_s = \log p(x, z_s) - \log q(z_s)` and self-normalised weights
    :math:`\bar w_s = w_s / \sum_t w_t` (held constant, stop-gradient), the gradient with
    respect to the guide parameters :math:`\phi` is

    .. math::

        \nabla_\phi = -\sum_s \bar w_s \nabla_\phi \log q_\phi(z_s) \Big|_{z_s\ \text{fixed}},

    the self-normalised estimate of
    :math:`\nabla_\phi \mathrm{KL}(p\|q) = -\mathbb{E}_p[\nabla_\phi \log q]`.
    ``z_s`` is held fixed by running the guide under :class:`stop_sample_gradients`: the
    samples are drawn as usual (same RNG) but the gradient of ``log q(z_s)`` is taken with
    respect to the density's parameters only, never through the reparameterised sample.

    **Model parameters** (``numpyro.param`` in the model) are held fixed by default: an
    upper bound is a bound on the evidence of a *fixed* model. The model runs under
    :class:`stop_param_gradients`, so the gradient with respect to a model-only parameter
    is exactly zero (an optimiser that moves parameters without a gradient, such as weight
    decay, would still change it); a parameter used by both model and guide keeps its
    guide-side gradient. With ``learn_model_params=True`` the model parameters
    :math:`\theta` get the importance-weighted ELBO gradient

    .. math::

        \nabla_\theta = -\sum_s \bar w_s \nabla_\theta \log p_\theta(x, z_s),

    i.e. they ascend :func:`~numpyro_tempering.bounds.iwae` (maximum evidence, reweighted
    wake-sleep's wake-phase model update); the loss is then a bound for the *current*
    model only, no longer an upper bound for a fixed model.

    **Loss value.** The loss SVI receives is the self-normalised KLpq estimate
    :math:`\sum_s \bar w_s \log w_s` (:func:`numpyro_tempering.bounds.klpq`), an estimate
    of :math:`\log p(x) + \mathrm{KL}(p\|q)` in log-evidence units; it always lies between
    the IWAE estimate and ``2 * CUBO_2 - IWAE`` of the same particles and decreases towards
    :math:`\log p(x)` as q approaches the posterior. ``svi.run(...).losses`` are these
    estimates (at the parameters before each update). Its gradient is the one above, not
    the derivative of the value.

    **Effective sample size.** The estimates are only as good as the weights: use
    :meth:`diagnose` for the Kish ESS (and the non-finite count) on the loss's particles.

    **Non-finite weights** are never dropped (see :mod:`numpyro_tempering.bounds`):
    ``nan`` or ``+inf`` makes the loss and the gradient ``nan`` (never a silent zero
    gradient), as does a sample in which every weight is zero (e.g. ``nan`` in the data);
    a single ``-inf`` weight is a zero weight (it contributes nothing to the value or the
    surrogate, though the gradient of its -inf density may still be ``nan``);
    :meth:`diagnose` counts them.

    **Discrete sites and enumeration.** Guide sites may be discrete: KLpq needs only
    :math:`\log q` at fixed samples. It therefore sets ``can_infer_discrete = True``, the
    attribute NumPyro's :class:`~numpyro.infer.SVI` reads (only) to decide whether to warn
    at ``init`` about discrete latent sites, as :class:`~numpyro.infer.TraceGraph_ELBO`
    (which also samples them) does. KLpq does **not** enumerate: a site marked for
    enumeration (``config_enumerate``) that the guide does not sample, or any guide site
    so marked, is an error naming the site.

    **Restrictions.** Subsampled plates are refused (the self-normalisation couples all
    data points); every model latent site must be in the guide.

    Args:
        num_particles: particles S >= 2 per step (an integer).
        vectorize_particles: as in :class:`~numpyro.infer.Trace_ELBO`.
        learn_model_params: keyword-only; ``False`` (default) holds the model's parameters
            fixed, ``True`` fits them by the IWAE gradient (see above).
        warn: keyword-only; per-step host-side warnings (non-finite weights, an effective
            sample size of the self-normalised weights below 1% of the particles), see
            :class:`~numpyro_tempering.objectives.base.UpperBoundELBO`.

    Example:
        >>> import jax, jax.numpy as jnp, optax, numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import SVI
        >>> from numpyro_tempering.objectives.klpq import KLpq
        >>> def model():
        ...     numpyro.sample("z", dist.Normal(0.0, 1.0))
        >>> def guide():
        ...     loc = numpyro.param("loc", 0.5)
        ...     numpyro.sample("z", dist.Normal(loc, 1.0))
        >>> svi = SVI(model, guide, optax.sgd(0.1), KLpq(num_particles=100))
        >>> result = svi.run(jax.random.PRNGKey(0), 200, progress_bar=False)
        >>> abs(float(result.params["loc"])) < 0.1
        True
    """

    #: Discrete latent sites are fine as long as the guide samples them (no enumeration).
    can_infer_discrete = True

    owner = "KLpq"

    def __init__(
        self,
        num_particles: int = 2,
        vectorize_particles: bool | Callable = True,
        *,
        learn_model_params: bool = False,
        warn: bool = False,
    ) -> None:
        super().__init__(
            num_particles, vectorize_particles, learn_model_params=learn_model_params, warn=warn
        )

    def prepare(self, model: Callable, guide: Callable) -> tuple[Callable, Callable]:
        model, guide = super().prepare(model, guide)
        return model, stop_sample_gradients(guide)

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        weights = self.log_weights(rng_key, param_map, model, guide, args, kwargs)
        self.check_step(weights.log_w, 1.0)  # the self-normalised weights' ESS
        log_w = jax.lax.stop_gradient(weights.log_w)
        surrogate = weighted_surrogate(log_w, weights.log_joint + weights.log_q)
        loss = bounds.klpq(log_w) + surrogate - jax.lax.stop_gradient(surrogate)
        return {"loss": loss, "mutable_state": weights.mutable_state}
