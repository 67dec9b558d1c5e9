r"""CUBO: minimise the chi-divergence upper bound on the log evidence (CHIVI).

Pradier et al. 2019, eq. 1, for general order
n > 1 (Dieng et al. 2017):

.. math::

    \mathrm{CUBO}_n(q) = \frac1n \log \mathbb{E}_{q(z)}\Big[\Big(\frac{p(x, z)}{q(z)}\Big)^n\Big]
    \;\ge\; \log p(x),

with equality iff q is the posterior. :class:`CUBO` is an :class:`numpyro.infer.elbo.ELBO`
that :class:`numpyro.infer.SVI` *minimises*. NumPyro's ``RenyiELBO(alpha=1 - n)`` computes the
same statistic but SVI *maximises* it there (its loss is the negated bound), i.e. it pushes
the upper bound up; :class:`CUBO` has the right sign.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from numpyro_tempering import bounds
from numpyro_tempering.handlers import stop_param_gradients
from numpyro_tempering.objectives.base import (
    UpperBoundELBO,
    checked,
    concrete_real,
    weighted_surrogate,
)

__all__ = ["CUBO"]


class CUBO(UpperBoundELBO):
    r"""Minimise the chi upper bound :math:`\mathrm{CUBO}_n` (Pradier et al. 2019, eq. 1).

    With :math:`\log w_s = \log p(x, z_s) - \log q(z_s)` for S reparameterised particles
    :math:`z_s \sim q` (vectorised by the engine), the estimate is

    .. math::

        \widehat{\mathrm{CUBO}}_n = \frac1n \log \frac1S \sum_{s=1}^S w_s^n
        \qquad (\text{:func:`numpyro_tempering.bounds.cubo`}).

    **Loss value.** The loss SVI receives is :math:`+\widehat{\mathrm{CUBO}}_n` itself, in
    log-evidence units, in both gradient modes; ``svi.run(...).losses`` is therefore the
    sequence of CUBO estimates (at the parameters before each update, from that step's
    particles). SVI minimises it, so it should decrease towards :math:`\log p(x)` from above;
    ``-losses`` of ``Trace_ELBO`` are the matching lower bounds. The estimate is biased low
    at finite S and may fall *below* :math:`\log p(x)`.

    **Gradient modes** (the loss value is the same; only the gradient differs):

    * ``"direct"`` (default): the reparameterisation gradient of the biased estimate,
      :math:`\nabla \widehat{\mathrm{CUBO}}_n = \sum_s \bar w^{(n)}_s \nabla \log w_s` with
      :math:`\bar w^{(n)} = \mathrm{softmax}(n \log w)`.
    * ``"exponentiated"``: the gradient of the surrogate
      :math:`\frac1n \frac1S \sum_s \exp(n(\log w_s - c))` with c held fixed, i.e.
      :math:`e^{-nc} / n` times an **unbiased** estimate of
      :math:`\nabla \mathbb{E}_q[w^n] = \nabla \exp(n\,\mathrm{CUBO}_n)` (the paper's
      "exponentiated CUBO"). With ``shift=None`` (default), c = max_s log w_s
      (stop-gradient), as CHIVI does for numerical stability: then the gradient equals the
      direct one multiplied by :math:`r = \frac1S \sum_s \exp(n(\log w_s - c)) \in [1/S, 1]`:
      **the same direction with a random step size** that shrinks when the weights
      degenerate, and is unbiased only up to the sample-dependent factor
      :math:`e^{-nc}`. A constant ``shift=c`` (a Python number or a concrete 0-d array such
      as ``jnp.array(-3.0)``, stored as a float) keeps c fixed, so the gradient is exactly
      :math:`e^{-nc}/n\,\nabla\mathbb{E}_q[w^n]` in expectation; choose c near
      :math:`\log p(x)` (e.g. an ELBO) or exp overflows/underflows.

    ``"direct"`` is the default because its gradient is the derivative of the reported loss
    (what SVI users expect, and the correctly-signed counterpart of
    ``RenyiELBO(alpha=1-n)``), it is invariant to the scale of the weights so learning rates
    transfer between models, and the stable exponentiated estimator differs from it only by
    the random step factor r above.

    **Model parameters** (``numpyro.param`` sites of the model) are held fixed by default:
    an upper bound is a bound on the evidence of a *fixed* model, and minimising it over
    the model would minimise the evidence itself (a likelihood scale collapses to zero and
    the "bound" to minus infinity). The model runs under
    :class:`~numpyro_tempering.handlers.stop_param_gradients`, so the gradient with
    respect to a model-only parameter is exactly zero (SVI's optimiser still holds it; an
    optimiser that moves parameters without a gradient, such as weight decay, would still
    change it). A parameter used by both model and guide keeps its
    guide-side gradient. With ``learn_model_params=True`` the model parameters instead
    follow the importance-weighted (IWAE) gradient
    :math:`-\sum_s \bar w_s \nabla_\theta \log p_\theta(x, z_s)` at fixed :math:`z_s`, i.e.
    they *ascend* :func:`~numpyro_tempering.bounds.iwae` (maximum evidence, as
    :class:`~numpyro_tempering.KLpq` does) while the guide descends the CUBO; this costs a
    second pass through the model, and the loss is then a bound for the *current* model
    only, no longer an upper bound for a fixed model.

    **Non-finite log weights** are never dropped (see :mod:`numpyro_tempering.bounds`): a
    ``nan`` or ``+inf`` weight makes the loss ``nan``, as does a sample in which every
    weight is zero (e.g. ``nan`` in the data, whose log density NumPyro's validation makes
    ``-inf``), which would otherwise give the best possible loss ``-inf``. A single ``-inf``
    (p(x, z_s) = 0) is a zero weight in the value, but can make the gradient ``nan``.
    :meth:`diagnose` reports the count with the estimate and the effective sample size.

    **Restrictions.** The bound does not decompose over data points, so subsampled plates
    are refused (like :class:`numpyro.infer.RenyiELBO`'s check, but for every plate); every
    guide site must be reparameterisable (:class:`~numpyro_tempering.KLpq` is not so
    restricted); every model latent site must be in the guide, and none may be marked for
    enumeration (``config_enumerate``): CUBO samples latents, it does not sum them out.
    Errors name the site. ``can_infer_discrete`` is ``False`` (SVI warns about discrete
    latent sites at ``init``).

    Args:
        n: order of the bound, a finite real > 1 (the paper uses 2).
        num_particles: particles S >= 2 per estimate (an integer).
        gradient: ``"direct"`` or ``"exponentiated"``.
        shift: for ``"exponentiated"``: ``None`` for the running max (stable), or a constant c.
        vectorize_particles: keyword-only; as in :class:`~numpyro.infer.Trace_ELBO`.
        learn_model_params: keyword-only; ``False`` (default) holds the model's parameters
            fixed, ``True`` fits them by the IWAE gradient (see above).
        warn, lower_bound: keyword-only; per-step host-side warnings (non-finite weights,
            degenerate ESS, an estimate below ``lower_bound``), see
            :class:`~numpyro_tempering.objectives.base.UpperBoundELBO`.

    Example:
        >>> import jax, jax.numpy as jnp, optax, numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import SVI
        >>> from numpyro_tempering.objectives.cubo import CUBO
        >>> def model():
        ...     numpyro.sample("z", dist.Normal(0.0, 1.0))
        >>> def guide():
        ...     loc = numpyro.param("loc", 0.5)
        ...     numpyro.sample("z", dist.Normal(loc, 1.0))
        >>> svi = SVI(model, guide, optax.sgd(0.1), CUBO(num_particles=100))
        >>> result = svi.run(jax.random.PRNGKey(0), 200, progress_bar=False)
        >>> abs(float(result.params["loc"])) < 0.1
        True
    """

    can_infer_discrete = False
    owner = "CUBO"
    require_rsample = True

    def __init__(
        self,
        n: float = 2.0,
        num_particles: int = 2,
        gradient: Literal["direct", "exponentiated"] = "direct",
        shift: float | None = None,
        *,
        vectorize_particles: bool | Callable = True,
        learn_model_params: bool = False,
        warn: bool = False,
        lower_bound: float | None = None,
    ) -> None:
        order = concrete_real(n, "CUBO", "n")
        if order is None or not order > 1:
            raise ValueError(f"CUBO: `n` must be a finite real number > 1, got {n!r}.")
        if gradient not in ("direct", "exponentiated"):
            raise ValueError(
                f"CUBO: `gradient` must be 'direct' or 'exponentiated', got {gradient!r}."
            )
        if shift is not None:
            if gradient != "exponentiated":
                raise ValueError("CUBO: `shift` only applies to gradient='exponentiated'.")
            value = concrete_real(shift, "CUBO", "shift")
            if value is None:
                raise ValueError(
                    "CUBO: `shift` must be None or a finite real scalar (a Python number or a "
                    f"0-d array), got {shift!r}."
                )
            shift = value
        self.n = order
        self.gradient = gradient
        self.shift = shift
        super().__init__(
            num_particles,
            vectorize_particles,
            learn_model_params=learn_model_params,
            warn=warn,
            lower_bound=lower_bound,
        )

    def prepare(self, model: Callable, guide: Callable) -> tuple[Callable, Callable]:
        # the guide's pass always holds the model's parameters fixed; with
        # learn_model_params they get their (IWAE) gradient from a second, fixed-sample pass
        model, guide = checked(model, guide, self.owner, require_rsample=True)
        return stop_param_gradients(model), guide

    def surrogate(self, log_w: jax.Array) -> jax.Array:
        """The differentiated quantity: the CUBO estimate, or the exponentiated surrogate."""
        if self.gradient == "direct":
            return bounds.cubo(log_w, self.n)
        shift = jax.lax.stop_gradient(jnp.max(log_w)) if self.shift is None else self.shift
        return jnp.mean(jnp.exp(self.n * (log_w - shift))) / self.n

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        weights = self.log_weights(rng_key, param_map, model, guide, args, kwargs)
        self.check_step(weights.log_w, self.n)
        value = bounds.cubo(weights.log_w, self.n)
        if self.gradient == "direct":
            loss = value
        else:
            surrogate = self.surrogate(weights.log_w)
            loss = jax.lax.stop_gradient(value) + surrogate - jax.lax.stop_gradient(surrogate)
        if self.learn_model_params:
            # Same key, so the same particles: log p(x, z_s) with z_s fixed and the model's
            # parameters live; its weighted surrogate is minus the IWAE gradient.
            fixed = self.fixed_sample_weights(rng_key, param_map, model, guide, args, kwargs)
            model_side = weighted_surrogate(weights.log_w, fixed.log_joint)
            loss = loss + model_side - jax.lax.stop_gradient(model_side)
        return {"loss": loss, "mutable_state": weights.mutable_state}
