r"""KLpq: minimise KL(p || q) with self-normalised importance weights (reweighted wake-sleep).

Chi-square-upper-bounds-challenges, appendix B, eq. 3 (after Ji et al. 2010):

.. math::

    \mathrm{UB}_{KLpq}(q) = \mathbb{E}_{p(z \mid x)}\big[\log p(x, z) - \log q(z)\big]
    = \log p(x) + \mathrm{KL}(p(z \mid x) \,\|\, q(z)) \;\ge\; \log p(x),

so minimising the bound over q minimises the inclusive KL(p || q). The posterior expectation
is estimated by self-normalised importance sampling from q (the "wake phase" of reweighted
wake-sleep; Edward's ``KLpq``), which needs no reparameterisation: q may have discrete sites.

This module also holds the two handlers the upper-bound objectives run the model and guide
under: :class:`stop_sample_gradients` (fixed samples) and :class:`stop_param_gradients`
(fixed model parameters).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from numpyro.distributions import Distribution
from numpyro.infer.elbo import ELBO
from numpyro.primitives import Messenger

from numpyro_tempering import bounds
from numpyro_tempering.engine import log_weights
from numpyro_tempering.objectives.cubo import (
    check_num_particles,
    checked,
    weighted_surrogate,
)

__all__ = ["KLpq", "stop_param_gradients", "stop_sample_gradients"]


class _FixedSample(Distribution):
    """``base`` whose samples carry no gradient; log_prob is base's at the (fixed) value."""

    def __init__(self, base: Distribution) -> None:
        self.base_dist = base
        super().__init__(batch_shape=base.batch_shape, event_shape=base.event_shape)

    @property
    def support(self):
        return self.base_dist.support

    @property
    def has_rsample(self) -> bool:
        return False

    @property
    def is_discrete(self) -> bool:
        return self.base_dist.is_discrete

    def sample_with_intermediates(self, key, sample_shape=()):
        value, _ = self.base_dist.sample_with_intermediates(key, sample_shape)
        # No intermediates: log_prob must be recomputed from the fixed value (e.g. by
        # inverting a TransformedDistribution's transforms), not from differentiable
        # pre-transform samples.
        return jax.lax.stop_gradient(value), []

    def sample(self, key, sample_shape=()):
        return self.sample_with_intermediates(key, sample_shape)[0]

    def log_prob(self, value, intermediates=None):
        return self.base_dist.log_prob(value)


class stop_sample_gradients(Messenger):
    """Hold the latent samples of ``fn`` fixed: no gradient flows through the sampled values.

    Every unobserved sample site draws its value as usual (same RNG, same value) but wrapped
    in ``jax.lax.stop_gradient``, and its recorded log density is the distribution's
    ``log_prob`` at that fixed value, differentiable in the distribution's parameters only.
    (For a ``TransformedDistribution`` the value is mapped back through the inverse
    transforms, so a guide with transforms lacking an inverse, such as IAF flows, raises.)
    Because the model replays these values, ``log p(x, z_s)`` is also at fixed ``z_s``.

    Example:
        >>> import jax, numpyro, numpyro.distributions as dist
        >>> from numpyro.handlers import seed, substitute, trace
        >>> def guide():
        ...     numpyro.sample("z", dist.Normal(numpyro.param("loc", 0.0), 1.0))
        >>> def value(loc):
        ...     g = substitute(seed(stop_sample_gradients(guide), 0), {"loc": loc})
        ...     return trace(g).get_trace()["z"]["value"]
        >>> float(jax.grad(value)(0.0))
        0.0
    """

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "sample" and not msg.get("is_observed"):
            msg["fn"] = _FixedSample(msg["fn"])


class stop_param_gradients(Messenger):
    """Hold the ``param`` sites of ``fn`` fixed: their values carry no gradient.

    Each ``numpyro.param`` site of ``fn`` returns its usual value (from SVI's substitution,
    or its initial value) wrapped in ``jax.lax.stop_gradient`` (leaf by leaf for a pytree
    value), so a loss computed from ``fn`` has exactly zero gradient with respect to those
    parameters. Only the wrapped function is affected: the same parameter used by another
    function (a guide) keeps its gradient there.

    NumPyro's :func:`~numpyro.primitives.apply_stack` runs ``process_message`` from the
    innermost handler outwards and ``postprocess_message`` from the outermost inwards, so
    the value an outer ``substitute`` sets (SVI passes parameters this way) is final by the
    time this handler's ``postprocess_message`` runs; the ``param`` primitive then returns
    ``msg["value"]``.

    Example:
        >>> import jax, numpyro, numpyro.distributions as dist
        >>> from numpyro.handlers import substitute
        >>> def model():
        ...     return 3.0 * numpyro.param("sigma", 1.0)
        >>> def value(fn, sigma):
        ...     return substitute(fn, {"sigma": sigma})()
        >>> float(jax.grad(lambda s: value(model, s))(1.0))
        3.0
        >>> float(jax.grad(lambda s: value(stop_param_gradients(model), s))(1.0))
        0.0
    """

    def postprocess_message(self, msg: dict) -> None:
        if msg["type"] == "param":
            msg["value"] = jax.tree.map(jax.lax.stop_gradient, msg["value"])


class KLpq(ELBO):
    r"""Minimise KL(p || q) via the KLpq upper bound (chi-square-upper-bounds, eq. 3).

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
        learn_model_params: keyword-only; ``False`` (default) holds the model's parameters
            fixed, ``True`` fits them by the IWAE gradient (see above).

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

    def __init__(self, num_particles: int = 2, *, learn_model_params: bool = False) -> None:
        num_particles = check_num_particles(num_particles, "KLpq")
        if not isinstance(learn_model_params, bool):
            raise ValueError(
                f"KLpq: `learn_model_params` must be True or False, got {learn_model_params!r}."
            )
        self.learn_model_params = learn_model_params
        super().__init__(num_particles=num_particles)

    def _log_weights(self, rng_key, param_map, model, guide, args, kwargs):
        model, guide = checked(model, guide, "KLpq", require_rsample=False)
        if not self.learn_model_params:
            model = stop_param_gradients(model)
        return log_weights(
            rng_key,
            param_map,
            model,
            stop_sample_gradients(guide),
            args,
            kwargs,
            num_particles=self.num_particles,
        )

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        weights = self._log_weights(rng_key, param_map, model, guide, args, kwargs)
        log_w = jax.lax.stop_gradient(weights.log_w)
        surrogate = weighted_surrogate(log_w, weights.log_joint + weights.log_q)
        loss = bounds.klpq(log_w) + surrogate - jax.lax.stop_gradient(surrogate)
        return {"loss": loss, "mutable_state": weights.mutable_state}

    def diagnose(
        self, rng_key: jax.Array, param_map: dict, model: Callable, guide: Callable, *args, **kwargs
    ) -> bounds.BoundSummary:
        """Estimates (``.klpq`` equals the loss), Kish ESS and non-finite count, same particles.

        ``param_map`` is e.g. ``svi.get_params(state)``; the ``cubo`` field is CUBO_2.
        """
        weights = self._log_weights(rng_key, param_map, model, guide, args, kwargs)
        return bounds.summarise(weights.log_w)
