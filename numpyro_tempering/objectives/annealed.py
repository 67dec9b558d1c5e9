"""Anneal with any NumPyro ELBO: carry ``temper``'s schedule clock through SVI's state.

A schedule's step counter lives in a ``numpyro.mutable`` site of the tempered model (see
:mod:`numpyro_tempering.handlers`), and stock :class:`numpyro.infer.SVI` carries it from one
update to the next only if the objective returns it. :class:`~numpyro_tempering.TemperedELBO`
does; NumPyro's ``TraceEnum_ELBO`` raises ("does not support mutable state") and
``Trace_ELBO`` with ``num_particles > 1`` drops it with a warning, after which the schedule
would stay at step 0. :class:`Annealed` wraps any of them so that annealing works, for example
with enumerated discrete locals::

    SVI(temper(model, schedule), guide, optim, Annealed(TraceEnum_ELBO()))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.elbo import ELBO

__all__ = ["Annealed"]


class Annealed(ELBO):
    """Wrap an ELBO so that the schedule clocks of ``temper`` handlers advance every update.

    The loss (value and gradient) is the wrapped objective's, computed at the current step's
    temperature; the returned mutable state holds every ``numpyro.mutable`` site of the model
    after one run with the current state (so each clock advances by exactly one per update),
    together with any state the wrapped objective returns. The extra model run samples its
    latents from the prior and costs one model evaluation per step.

    Args:
        elbo: any :class:`numpyro.infer.elbo.ELBO` (e.g. ``TraceEnum_ELBO()``).

    Example:
        >>> import jax, jax.numpy as jnp, optax, numpyro, numpyro.distributions as dist
        >>> from numpyro.contrib.funsor import config_enumerate
        >>> from numpyro.infer import SVI, TraceEnum_ELBO
        >>> from numpyro_tempering import schedules, temper
        >>> @config_enumerate
        ... def model(x):
        ...     loc = numpyro.sample("loc", dist.Normal(0.0, 5.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         z = numpyro.sample("z", dist.Bernoulli(0.5))
        ...         numpyro.sample("x", dist.Normal(jnp.where(z, loc, -loc), 1.0), obs=x)
        >>> def guide(x):
        ...     numpyro.sample("loc", dist.Normal(numpyro.param("m", 0.5), 0.1))
        >>> annealed = temper(model, schedules.linear(5.0, 1.0, num_steps=50), latent="z")
        >>> svi = SVI(annealed, guide, optax.adam(0.05), Annealed(TraceEnum_ELBO()))
        >>> result = svi.run(jax.random.PRNGKey(0), 60, jnp.array([2.0, -2.1, 1.9]),
        ...                  progress_bar=False)
        >>> clock = result.state.mutable_state["_temper_clock"]
        >>> int(clock["step"]), float(clock["temperature"])
        (60, 1.0)
    """

    def __init__(self, elbo: ELBO) -> None:
        if not isinstance(elbo, ELBO):
            raise TypeError(f"`elbo` must be a numpyro ELBO instance, got {elbo!r}.")
        self.elbo = elbo
        super().__init__(num_particles=elbo.num_particles)

    @property
    def can_infer_discrete(self) -> bool:  # type: ignore[override]
        return self.elbo.can_infer_discrete

    def loss(self, rng_key, param_map, model, guide, *args, **kwargs):
        return self.elbo.loss(rng_key, param_map, model, guide, *args, **kwargs)

    def loss_with_mutable_state(
        self, rng_key, param_map: dict, model: Callable, guide: Callable, *args, **kwargs
    ) -> dict:
        try:
            with warnings.catch_warnings():  # the clock is carried here, not dropped
                warnings.filterwarnings("ignore", "mutable state is currently ignored")
                out = self.elbo.loss_with_mutable_state(
                    rng_key, param_map, model, guide, *args, **kwargs
                )
            loss, state = out["loss"], out["mutable_state"]
        except NotImplementedError:
            loss, state = self.elbo.loss(rng_key, param_map, model, guide, *args, **kwargs), None
        fresh = jax.tree.map(jnp.asarray, param_map)  # temper advances a clock in place
        model_trace = trace(substitute(seed(model, rng_key), data=fresh)).get_trace(*args, **kwargs)
        clocks = {n: s["value"] for n, s in model_trace.items() if s["type"] == "mutable"}
        return {"loss": loss, "mutable_state": {**(state or {}), **clocks} or None}
