"""The log-weight engine: model + guide + params + particles -> per-particle log densities.

Every objective and estimator in this package is a function of the quantities computed
here, so traces are walked in exactly one place. For S particles z_s ~ q it returns

* ``log_q[s]``     = log q(z_s), the guide's density (with its site scales);
* ``log_prior[s]`` = sum of the model's *untempered* sample sites' log densities at z_s;
* ``log_lik[s]``   = sum of the *tempered* sites' log densities, i.e. of the sites a
  :class:`~numpyro_tempering.temper` handler marked (``msg["infer"]["tempered"]``), including
  any scale already on them (subsampling, or a temperature the model applies itself);
* ``log_lik_elements[s, i]`` (only when a ``plate`` is named): ``log_lik`` split over the
  elements ``i`` of that plate, each with its site scale, so that
  ``log_lik_elements.sum(-1) == log_lik``.

so that log p(x, z_s) = log_prior + log_lik and the log importance weight is
``log_w = log_prior + log_lik - log_q``. The tempered joint of annealed-and-multicanonical-vi
eq. 4 is ``log_prior + log_lik / T`` (up to log C(T)).

Random numbers follow :class:`numpyro.infer.Trace_ELBO` exactly: one particle uses the key as
given, S > 1 particles use ``random.split(key, S)``, and each particle splits its key into a
model and a guide seed. At T = 1 every objective built on the engine therefore reproduces the
stock NumPyro estimator on the same key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import random
from numpyro.handlers import replay, seed
from numpyro.infer.elbo import _validate_model
from numpyro.infer.util import compute_log_probs
from numpyro.util import check_model_guide_match

from numpyro_tempering.handlers import TEMPERED

__all__ = ["LogWeights", "log_weights", "particle_keys"]


class LogWeights(NamedTuple):
    """Per-particle log densities; every array has a leading particle axis of size S."""

    log_prior: jax.Array
    log_lik: jax.Array
    log_q: jax.Array
    log_lik_elements: jax.Array | None = None
    plate_scale: jax.Array | None = None
    mutable_state: dict | None = None

    @property
    def log_joint(self) -> jax.Array:
        """log p(x, z_s) = log prior + log likelihood (as the model's scales define it)."""
        return self.log_prior + self.log_lik

    @property
    def log_w(self) -> jax.Array:
        """Log importance weights log p(x, z_s) - log q(z_s)."""
        return self.log_prior + self.log_lik - self.log_q

    def tempered_log_w(self, inv_temperature: jax.typing.ArrayLike) -> jax.Array:
        """log p(beta, z) + log p(x, z | beta) / T - log q: the eq. 7 integrand."""
        return self.log_prior + inv_temperature * self.log_lik - self.log_q


def particle_keys(rng_key: jax.Array, num_particles: int) -> jax.Array:
    """Keys of the particles, exactly as :class:`numpyro.infer.Trace_ELBO` draws them."""
    if num_particles == 1:
        return rng_key[None]
    return random.split(rng_key, num_particles)


def _fresh_params(param_map: dict) -> dict:
    # New containers for every run, so a handler mutating a mutable site in place (the
    # schedule clock) never sees a value another run already advanced.
    return jax.tree.map(lambda x: x, param_map)


def _element_log_lik(site: dict, log_prob: jax.Array, plate: str) -> jax.Array:
    frames = [f for f in site["cond_indep_stack"] if f.name == plate]
    if not frames:
        raise ValueError(
            f"tempered site '{site['name']}' is not inside plate '{plate}': a per-element "
            "temperature needs every tempered site in that plate."
        )
    dim = frames[0].dim
    log_prob = jnp.asarray(log_prob)
    ndim = max(log_prob.ndim, -dim)
    log_prob = jnp.reshape(log_prob, (1,) * (ndim - log_prob.ndim) + log_prob.shape)
    axis = ndim + dim
    if log_prob.shape[axis] == 1:  # site broadcast against the plate
        log_prob = jnp.broadcast_to(
            log_prob,
            log_prob.shape[:axis] + (site["fn"].batch_shape[dim],) + log_prob.shape[axis + 1 :],
        )
    other = tuple(a for a in range(ndim) if a != axis)
    return jnp.sum(log_prob, axis=other)


def _plate_scale(model_trace: dict, plate: str) -> jax.Array:
    site = model_trace.get(plate)
    if site is None or site["type"] != "plate":
        plates = sorted(n for n, s in model_trace.items() if s["type"] == "plate")
        raise ValueError(f"plate '{plate}' is not in the model; its plates are {plates}.")
    size, subsample = site["args"][0], jnp.shape(site["value"])[0]
    return jnp.asarray(size / subsample)


def _single_particle(
    rng_key: jax.Array,
    param_map: dict,
    model: Callable,
    guide: Callable,
    args: tuple,
    kwargs: dict,
    plate: str | None,
) -> LogWeights:
    model_seed, guide_seed = random.split(rng_key)
    params = _fresh_params(param_map)
    guide_log_probs, guide_trace = compute_log_probs(seed(guide, guide_seed), args, kwargs, params)
    mutable = {n: s["value"] for n, s in guide_trace.items() if s["type"] == "mutable"}
    params.update(mutable)
    model_log_probs, model_trace = compute_log_probs(
        replay(seed(model, model_seed), guide_trace),
        args,
        kwargs,
        params,
        sum_log_prob=False,
    )
    check_model_guide_match(model_trace, guide_trace)
    _validate_model(model_trace, plate_warning="loose")
    mutable.update({n: s["value"] for n, s in model_trace.items() if s["type"] == "mutable"})

    scale = None if plate is None else _plate_scale(model_trace, plate)
    zero = jnp.zeros(())
    log_prior, log_lik, elements = zero, zero, zero
    for name, log_prob in model_log_probs.items():
        site = model_trace[name]
        if site["infer"].get(TEMPERED, False):
            log_lik = log_lik + jnp.sum(log_prob)
            if plate is not None:
                elements = elements + _element_log_lik(site, log_prob, plate)
        else:
            log_prior = log_prior + jnp.sum(log_prob)
    log_q = sum(guide_log_probs.values(), start=zero)
    return LogWeights(
        log_prior=log_prior,
        log_lik=log_lik,
        log_q=log_q,
        log_lik_elements=elements if plate is not None else None,
        plate_scale=scale,
        mutable_state=mutable or None,
    )


def log_weights(
    rng_key: jax.Array,
    param_map: dict[str, Any],
    model: Callable,
    guide: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    num_particles: int = 1,
    plate: str | None = None,
) -> LogWeights:
    """Per-particle log prior, tempered-group log likelihood and log q, vectorised with vmap.

    Args:
        rng_key: PRNG key; particles draw from it as :class:`numpyro.infer.Trace_ELBO` does.
        param_map: constrained parameter values (and mutable state), as SVI passes them.
        model: the model; sites marked by a :class:`~numpyro_tempering.temper` handler form
            the likelihood group, every other sample site the prior group.
        guide: the guide, whose sample sites are replayed into the model.
        args, kwargs: model and guide arguments.
        num_particles: number of particles S.
        plate: optional plate name: also return the likelihood per element of that plate.

    Returns:
        :class:`LogWeights` with arrays of shape ``(S,)`` (``(S, B)`` for the plate elements).
        ``mutable_state`` is the first particle's (all particles share the same clock).

    Example:
        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> from numpyro_tempering import temper
        >>> from numpyro_tempering.engine import log_weights
        >>> def model(x):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> def guide(x):
        ...     numpyro.sample("mu", dist.Normal(0.0, 1.0))
        >>> lw = log_weights(jax.random.PRNGKey(0), {}, temper(model), guide, (1.0,),
        ...                  num_particles=4)
        >>> lw.log_w.shape
        (4,)
    """
    if int(num_particles) != num_particles or num_particles < 1:
        raise ValueError(f"`num_particles` must be a positive integer, got {num_particles!r}.")
    kwargs = {} if kwargs is None else kwargs

    def one(key):
        return _single_particle(key, param_map, model, guide, args, kwargs, plate)

    if num_particles == 1:  # as Trace_ELBO: no vmap over a single particle (cheaper)
        weights = one(rng_key)
        elements = weights.log_lik_elements
        return weights._replace(
            log_prior=weights.log_prior[None],
            log_lik=weights.log_lik[None],
            log_q=weights.log_q[None],
            log_lik_elements=None if elements is None else elements[None],
        )
    weights = jax.vmap(one)(particle_keys(rng_key, num_particles))
    state = weights.mutable_state
    if state is not None:
        state = jax.tree.map(lambda x: x[0], state)
    scale = None if weights.plate_scale is None else weights.plate_scale[0]
    return weights._replace(mutable_state=state, plate_scale=scale)
