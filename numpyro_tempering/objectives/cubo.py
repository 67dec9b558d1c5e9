r"""CUBO: minimise the chi-divergence upper bound on the log evidence (CHIVI).

Chi-square-upper-bounds-challenges (Pradier, Hughes, Doshi-Velez), eq. 1, for general order
n > 1 (Dieng et al. 2017):

.. math::

    \mathrm{CUBO}_n(q) = \frac1n \log \mathbb{E}_{q(z)}\Big[\Big(\frac{p(x, z)}{q(z)}\Big)^n\Big]
    \;\ge\; \log p(x),

with equality iff q is the posterior. :class:`CUBO` is an :class:`numpyro.infer.elbo.ELBO`
that :class:`numpyro.infer.SVI` *minimises*. NumPyro's ``RenyiELBO(alpha=1 - n)`` computes the
same statistic but SVI *maximises* it there (its loss is the negated bound), i.e. it pushes
the upper bound up; :class:`CUBO` has the right sign.

This module also holds the model/guide checks shared with :class:`~numpyro_tempering.KLpq`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from numpyro.infer.elbo import ELBO
from numpyro.primitives import Messenger

from numpyro_tempering import bounds
from numpyro_tempering.engine import log_weights

__all__ = ["CUBO"]


# -- model / guide checks shared by the upper-bound objectives --------------------------------


class _GuideCheck(Messenger):
    """Record the guide's latent sites; optionally require reparameterised sampling."""

    def __init__(self, fn: Callable, owner: str, require_rsample: bool, names: set) -> None:
        self.owner = owner
        self.require_rsample = require_rsample
        self.names = names
        super().__init__(fn)

    def __enter__(self):
        self.names.clear()
        return super().__enter__()

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or msg.get("is_observed"):
            return
        self.names.add(msg["name"])
        if self.require_rsample and not getattr(msg["fn"], "has_rsample", False):
            raise ValueError(
                f"{self.owner}: guide site '{msg['name']}' ({type(msg['fn']).__name__}) is not "
                "reparameterisable; this objective differentiates through the guide's samples. "
                "Use a reparameterisable (e.g. continuous relaxed) guide for this site, or "
                "KLpq, which only needs log q at fixed samples."
            )

    def postprocess_message(self, msg: dict) -> None:
        _check_plate(msg, self.owner)


class _ModelCheck(Messenger):
    """Every model latent must come from the guide; no subsampled plates."""

    def __init__(self, fn: Callable, owner: str, guide_names: set) -> None:
        self.owner = owner
        self.guide_names = guide_names
        super().__init__(fn)

    def postprocess_message(self, msg: dict) -> None:
        _check_plate(msg, self.owner)
        if (
            msg["type"] == "sample"
            and not msg.get("is_observed")
            and msg["name"] not in self.guide_names
            and (msg.get("infer") or {}).get("enumerate") != "parallel"
        ):
            raise ValueError(
                f"{self.owner}: model latent site '{msg['name']}' is not sampled by the guide "
                f"(guide latent sites: {sorted(self.guide_names)}). The importance weights "
                "p(x, z) / q(z) need q over every latent site; add it to the guide."
            )


def _check_plate(msg: dict, owner: str) -> None:
    if msg["type"] != "plate" or msg.get("value") is None:
        return
    size, subsample = msg["args"][0], jnp.shape(msg["value"])[0]
    if subsample < size:
        raise ValueError(
            f"{owner}: plate '{msg['name']}' is subsampled ({subsample} of {size}). This bound "
            "is a log-expectation over the whole joint and does not decompose over data "
            "points, so a rescaled minibatch does not give an unbiased estimate of it; use the "
            "full plate (subsample_size=None)."
        )


def checked(
    model: Callable, guide: Callable, owner: str, *, require_rsample: bool
) -> tuple[Callable, Callable]:
    """Wrap ``model`` and ``guide`` with the checks of the upper-bound objectives.

    The guide must sample every latent site of the model (else the weights are wrong: NumPyro
    only warns), no plate may be subsampled, and with ``require_rsample`` every guide sample
    site must be reparameterisable. Errors name the offending site; checks run at trace time.
    """
    names: set[str] = set()
    return _ModelCheck(model, owner, names), _GuideCheck(guide, owner, require_rsample, names)


def check_num_particles(num_particles: int, owner: str) -> None:
    if isinstance(num_particles, bool) or int(num_particles) != num_particles or num_particles < 2:
        raise ValueError(
            f"{owner}: `num_particles` must be an integer >= 2 (the estimate is a "
            f"log-mean over particles), got {num_particles!r}."
        )


# -- the objective --------------------------------------------------------------------------


class CUBO(ELBO):
    r"""Minimise the chi upper bound :math:`\mathrm{CUBO}_n` (chi-square-upper-bounds, eq. 1).

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
      :math:`e^{-nc}`. A float ``shift=c`` keeps c constant, so the gradient is exactly
      :math:`e^{-nc}/n\,\nabla\mathbb{E}_q[w^n]` in expectation; choose c near
      :math:`\log p(x)` (e.g. an ELBO) or exp overflows/underflows.

    ``"direct"`` is the default because its gradient is the derivative of the reported loss
    (what SVI users expect, and the correctly-signed counterpart of
    ``RenyiELBO(alpha=1-n)``), it is invariant to the scale of the weights so learning rates
    transfer between models, and the stable exponentiated estimator differs from it only by
    the random step factor r above.

    **Non-finite log weights** are never dropped: a ``nan`` weight makes the loss ``nan``,
    a ``-inf`` one (p(x, z_s) = 0) is a zero weight in the value but can make the gradient
    ``nan``. :meth:`diagnose` reports the count with the estimate and the effective sample
    size (see :mod:`numpyro_tempering.bounds`).

    **Restrictions.** The bound does not decompose over data points, so subsampled plates
    are refused (like :class:`numpyro.infer.RenyiELBO`'s check, but for every plate); every
    guide site must be reparameterisable (:class:`~numpyro_tempering.KLpq` is not so
    restricted); every model latent site must be in the guide. Errors name the site.

    Args:
        n: order of the bound, > 1 (the paper uses 2).
        num_particles: particles S >= 2 per estimate.
        gradient: ``"direct"`` or ``"exponentiated"``.
        shift: for ``"exponentiated"``: ``None`` for the running max (stable), or a constant c.

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

    def __init__(
        self,
        n: float = 2.0,
        num_particles: int = 2,
        gradient: Literal["direct", "exponentiated"] = "direct",
        shift: float | None = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not 1 < n < math.inf:
            raise ValueError(f"CUBO: `n` must be a finite number > 1, got {n!r}.")
        check_num_particles(num_particles, "CUBO")
        if gradient not in ("direct", "exponentiated"):
            raise ValueError(
                f"CUBO: `gradient` must be 'direct' or 'exponentiated', got {gradient!r}."
            )
        if shift is not None:
            if gradient != "exponentiated":
                raise ValueError("CUBO: `shift` only applies to gradient='exponentiated'.")
            if not isinstance(shift, (int, float)) or not math.isfinite(shift):
                raise ValueError(f"CUBO: `shift` must be None or a finite number, got {shift!r}.")
        self.n = float(n)
        self.gradient = gradient
        self.shift = shift
        super().__init__(num_particles=num_particles)

    def _log_weights(self, rng_key, param_map, model, guide, args, kwargs):
        model, guide = checked(model, guide, "CUBO", require_rsample=True)
        return log_weights(
            rng_key, param_map, model, guide, args, kwargs, num_particles=self.num_particles
        )

    def surrogate(self, log_w: jax.Array) -> jax.Array:
        """The differentiated quantity: the CUBO estimate, or the exponentiated surrogate."""
        if self.gradient == "direct":
            return bounds.cubo(log_w, self.n)
        shift = jax.lax.stop_gradient(jnp.max(log_w)) if self.shift is None else self.shift
        return jnp.mean(jnp.exp(self.n * (log_w - shift))) / self.n

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        weights = self._log_weights(rng_key, param_map, model, guide, args, kwargs)
        value = bounds.cubo(weights.log_w, self.n)
        if self.gradient == "direct":
            loss = value
        else:
            surrogate = self.surrogate(weights.log_w)
            loss = jax.lax.stop_gradient(value) + surrogate - jax.lax.stop_gradient(surrogate)
        return {"loss": loss, "mutable_state": weights.mutable_state}

    def diagnose(
        self, rng_key: jax.Array, param_map: dict, model: Callable, guide: Callable, *args, **kwargs
    ) -> bounds.BoundSummary:
        """Estimates, effective sample size and non-finite count on the loss's particles.

        Uses the same key and particles as :meth:`loss`, so ``diagnose(...).cubo`` equals the
        loss value. ``param_map`` is e.g. ``svi.get_params(state)``.
        """
        weights = self._log_weights(rng_key, param_map, model, guide, args, kwargs)
        return bounds.summarise(weights.log_w, self.n)
