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
import operator
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer.elbo import ELBO
from numpyro.primitives import Messenger

from numpyro_tempering import bounds
from numpyro_tempering.engine import log_weights

__all__ = ["CUBO"]


# -- model / guide checks shared by the upper-bound objectives --------------------------------


def _enumerated(msg: dict) -> bool:
    return bool((msg.get("infer") or {}).get("enumerate"))


def _enumeration_error(owner: str, side: str, name: str, fix: str) -> ValueError:
    return ValueError(
        f"{owner}: {side} site '{name}' is marked for enumeration "
        "(infer={'enumerate': ...}, e.g. by config_enumerate), but "
        f"{owner} does not enumerate: its estimate is a function of the importance weights "
        "p(x, z) / q(z) at latents z sampled from the guide (CUBO: log E_q[(p/q)^n]), so an "
        f"enumerated site would be sampled and weighted wrongly. {fix} Use TraceEnum_ELBO "
        "to sum enumerated sites out."
    )


class _GuideCheck(Messenger):
    """Record the guide's latent sites; refuse enumeration; optionally require rsample."""

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
        if _enumerated(msg):
            raise _enumeration_error(
                self.owner, "guide", msg["name"], "Remove the mark: guide sites are sampled."
            )
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
    """Every model latent must come from the guide (none enumerated); no subsampled plates."""

    def __init__(self, fn: Callable, owner: str, guide_names: set) -> None:
        self.owner = owner
        self.guide_names = guide_names
        super().__init__(fn)

    def postprocess_message(self, msg: dict) -> None:
        _check_plate(msg, self.owner)
        if msg["type"] != "sample" or msg.get("is_observed") or msg["name"] in self.guide_names:
            return
        name = msg["name"]
        if _enumerated(msg):
            raise _enumeration_error(
                self.owner,
                "model latent",
                name,
                f"Sample '{name}' in the guide, or do not mark it for enumeration.",
            )
        raise ValueError(
            f"{self.owner}: model latent site '{name}' is not sampled by the guide "
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
    only warns), no site may be marked for enumeration unless the guide samples it (these
    objectives never enumerate), no plate may be subsampled, and with ``require_rsample``
    every guide sample site must be reparameterisable. Errors name the offending site;
    checks run at trace time.
    """
    names: set[str] = set()
    return _ModelCheck(model, owner, names), _GuideCheck(guide, owner, require_rsample, names)


def check_num_particles(num_particles: int, owner: str) -> int:
    """``num_particles`` as an ``int`` >= 2 (Python or NumPy integer; bools and floats refused)."""
    try:
        if isinstance(num_particles, (bool, np.bool_)):
            raise TypeError
        value = operator.index(num_particles)
    except TypeError:
        value = None
    if value is None or value < 2:
        raise ValueError(
            f"{owner}: `num_particles` must be an integer >= 2 (the estimate is a "
            f"log-mean over particles), got {num_particles!r}."
        )
    return value


def concrete_real(value: object, owner: str, name: str) -> float | None:
    """A concrete finite real scalar as a ``float`` (``None`` if it is not one).

    Accepts Python ints/floats and 0-d NumPy/JAX real arrays (e.g. ``jnp.array(2.0)``);
    refuses bools, complex numbers, strings, arrays with more than one element and traced
    values (a constructor argument cannot be traced: pass a Python number).
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{owner}: `{name}` must be a concrete number, got a traced value {value!r}; "
            "objective settings are fixed at construction (pass a Python float)."
        )
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        return None
    if arr.ndim != 0 or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        return None
    out = float(arr)
    return out if math.isfinite(out) else None


def weighted_surrogate(log_w: jax.Array, terms: jax.Array) -> jax.Array:
    r""":math:`-\sum_s \bar w_s\, t_s` with :math:`\bar w` = softmax(``log_w``) held constant.

    Its gradient is :math:`-\sum_s \bar w_s \nabla t_s`. A zero weight (``log_w = -inf``)
    contributes nothing even if its term is ``-inf``; a ``nan`` weight (or all weights zero)
    makes the value and the gradient ``nan``, never a silent zero.
    """
    w_bar = bounds.self_normalised_weights(jax.lax.stop_gradient(log_w))
    zero = w_bar == 0  # False for nan
    return -jnp.sum(jnp.where(zero, 0.0, w_bar * jnp.where(zero, 0.0, terms)), axis=-1)


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
    :class:`~numpyro_tempering.objectives.klpq.stop_param_gradients`, so the gradient with
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
        learn_model_params: keyword-only; ``False`` (default) holds the model's parameters
            fixed, ``True`` fits them by the IWAE gradient (see above).

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
        *,
        learn_model_params: bool = False,
    ) -> None:
        order = concrete_real(n, "CUBO", "n")
        if order is None or not order > 1:
            raise ValueError(f"CUBO: `n` must be a finite real number > 1, got {n!r}.")
        num_particles = check_num_particles(num_particles, "CUBO")
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
        if not isinstance(learn_model_params, bool):
            raise ValueError(
                f"CUBO: `learn_model_params` must be True or False, got {learn_model_params!r}."
            )
        self.n = order
        self.gradient = gradient
        self.shift = shift
        self.learn_model_params = learn_model_params
        super().__init__(num_particles=num_particles)

    def _log_weights(self, rng_key, param_map, model, guide, args, kwargs, fixed_samples=False):
        # klpq imports this module; the handlers live there for now.
        from numpyro_tempering.objectives.klpq import stop_param_gradients, stop_sample_gradients

        model, guide = checked(model, guide, "CUBO", require_rsample=not fixed_samples)
        if fixed_samples:  # the model side of learn_model_params: z fixed, params live
            guide = stop_sample_gradients(guide)
        else:
            model = stop_param_gradients(model)
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
        if self.learn_model_params:
            # Same key, so the same particles: log p(x, z_s) with z_s fixed and the model's
            # parameters live; its weighted surrogate is minus the IWAE gradient.
            fixed = self._log_weights(
                rng_key, param_map, model, guide, args, kwargs, fixed_samples=True
            )
            model_side = weighted_surrogate(weights.log_w, fixed.log_joint)
            loss = loss + model_side - jax.lax.stop_gradient(model_side)
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
