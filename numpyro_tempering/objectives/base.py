r"""What the package's objectives share: one call to the log-weight engine, and checks.

Every objective of :mod:`numpyro_tempering.objectives` is a :class:`numpyro.infer.elbo.ELBO`
whose loss is a function of the engine's :class:`~numpyro_tempering.engine.LogWeights`
(:func:`~numpyro_tempering.engine.log_weights`). :class:`EngineELBO` holds that one call:
the particle options of Trace_ELBO (``num_particles``, ``vectorize_particles``,
``multi_sample_guide``, via :func:`~numpyro_tempering.engine.particle_options`) and a
:meth:`EngineELBO.diagnose` that reports, on the loss's own particles, the evidence
estimators, the effective sample size and the number of non-finite weights
(:func:`numpyro_tempering.bounds.summarise`). A subclass says how it prepares the model
and guide (:meth:`EngineELBO.prepare`) and how it reduces the weights to a loss.

:class:`UpperBoundELBO` adds what the upper bounds (:class:`~numpyro_tempering.CUBO`,
:class:`~numpyro_tempering.KLpq`) need: model/guide checks (:func:`checked`: every model
latent sampled by the guide, no enumeration, no subsampled plate, reparameterisable guide
sites where the gradient needs them) and the model's parameters held fixed
(:class:`~numpyro_tempering.handlers.stop_param_gradients`) unless
``learn_model_params=True``.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer.elbo import ELBO
from numpyro.primitives import Messenger

from numpyro_tempering import bounds
from numpyro_tempering.engine import LogWeights, log_weights, particle_options, point_mass
from numpyro_tempering.handlers import stop_param_gradients, stop_sample_gradients

__all__ = [
    "EngineELBO",
    "UpperBoundELBO",
    "check_num_particles",
    "checked",
    "concrete_real",
    "weighted_surrogate",
]


class EngineELBO(ELBO):
    """Base of the package's objectives: the engine call with Trace_ELBO's particle options.

    Subclasses override :meth:`prepare` (the model and guide as the objective sees them) and
    ``loss_with_mutable_state``; :meth:`log_weights` and :meth:`diagnose` are shared.
    """

    def prepare(self, model: Callable, guide: Callable) -> tuple[Callable, Callable]:
        """The (model, guide) pair the engine runs; default unchanged."""
        return model, guide

    def log_weights(
        self,
        rng_key: jax.Array,
        param_map: dict,
        model: Callable,
        guide: Callable,
        args: tuple,
        kwargs: dict,
        **options: Any,
    ) -> LogWeights:
        """The engine's log weights of :meth:`prepare`'s pair, with this objective's particle
        options (``options`` are passed on to :func:`~numpyro_tempering.engine.log_weights`)."""
        model, guide = self.prepare(model, guide)
        return log_weights(
            rng_key, param_map, model, guide, args, kwargs, **{**particle_options(self), **options}
        )

    def diagnose(
        self, rng_key: jax.Array, param_map: dict, model: Callable, guide: Callable, *args, **kwargs
    ) -> bounds.BoundSummary:
        """Estimates, Kish ESS and non-finite count on the loss's own particles (same key).

        ``param_map`` is e.g. ``svi.get_params(state)``. See
        :func:`numpyro_tempering.bounds.summarise`.
        """
        weights = self.log_weights(rng_key, param_map, model, guide, args, kwargs)
        return bounds.summarise(weights.log_w, getattr(self, "n", 2.0))


class UpperBoundELBO(EngineELBO):
    """Base of the upper-bound objectives (CUBO, KLpq): checks and fixed model parameters.

    Args:
        num_particles: particles S >= 2 (the estimates are log-means over particles).
        vectorize_particles: as in :class:`~numpyro.infer.Trace_ELBO`.
        learn_model_params: ``False`` holds the model's ``numpyro.param`` sites fixed
            (:class:`~numpyro_tempering.handlers.stop_param_gradients`).
        warn: check every step's weights on the host
            (:func:`~numpyro_tempering.diagnostics.training_flags` through
            ``jax.debug.callback``) and issue a
            :class:`~numpyro_tempering.diagnostics.BoundWarning` for non-finite weights, a
            degenerate effective sample size (< 1% of the particles) or, with
            ``lower_bound``, a CUBO estimate below it.
        lower_bound: a known lower bound on log p(x) (e.g. a warm start's ELBO), for
            ``warn``.
    """

    #: Name used in error messages.
    owner = "UpperBoundELBO"
    #: Whether the gradient differentiates through the guide's samples.
    require_rsample = False

    def __init__(
        self,
        num_particles: int = 2,
        vectorize_particles: bool | Callable = True,
        *,
        learn_model_params: bool = False,
        warn: bool = False,
        lower_bound: float | None = None,
    ) -> None:
        num_particles = check_num_particles(num_particles, self.owner)
        for name, flag in (("learn_model_params", learn_model_params), ("warn", warn)):
            if not isinstance(flag, bool):
                raise ValueError(f"{self.owner}: `{name}` must be True or False, got {flag!r}.")
        if lower_bound is not None:
            value = concrete_real(lower_bound, self.owner, "lower_bound")
            if value is None:
                raise ValueError(
                    f"{self.owner}: `lower_bound` must be None or a finite real number, got "
                    f"{lower_bound!r}."
                )
            lower_bound = value
        self.learn_model_params = learn_model_params
        self.warn = warn
        self.lower_bound = lower_bound
        super().__init__(num_particles=num_particles, vectorize_particles=vectorize_particles)

    def check_step(self, log_w: jax.Array, n: float) -> None:
        """With ``warn=True``: the host-side :class:`~numpyro_tempering.diagnostics.BoundWarning`
        check of this step's weights (CUBO_n's gradient weights :math:`w^n`)."""
        if not self.warn:
            return
        from numpyro_tempering.diagnostics import training_flags, warn_training_flags

        flags = training_flags(jax.lax.stop_gradient(log_w), n=n, lower_bound=self.lower_bound)
        jax.debug.callback(functools.partial(warn_training_flags, owner=self.owner), flags)

    def prepare(self, model: Callable, guide: Callable) -> tuple[Callable, Callable]:
        model, guide = checked(model, guide, self.owner, require_rsample=self.require_rsample)
        if not self.learn_model_params:
            model = stop_param_gradients(model)
        return model, guide

    def fixed_sample_weights(
        self, rng_key: jax.Array, param_map: dict, model: Callable, guide: Callable, args, kwargs
    ) -> LogWeights:
        """Log weights at the same particles with the samples held fixed and the model's
        parameters live (the model side of ``learn_model_params``)."""
        model, guide = checked(model, guide, self.owner, require_rsample=False)
        return log_weights(
            rng_key,
            param_map,
            model,
            stop_sample_gradients(guide),
            args,
            kwargs,
            **particle_options(self),
        )




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
        self.point_masses: set[str] = set()
        super().__init__(fn)

    def __enter__(self):
        self.names.clear()
        self.point_masses = set()
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None and self.names and self.point_masses == self.names:
            raise ValueError(
                f"{self.owner}: every latent site of the guide ({sorted(self.names)}) is a "
                "point mass (Delta: AutoDelta, or AutoLaplaceApproximation in SVI): q has no "
                "density, KL(p || q) and the chi^2 divergence are infinite, and the upper "
                "bound with them; the objective would report log p(x, z-hat), which lies "
                "below log p(x). Use a guide with a density (e.g. AutoNormal)."
            )

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or msg.get("is_observed"):
            return
        self.names.add(msg["name"])
        if point_mass(msg["fn"]):
            self.point_masses.add(msg["name"])
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


