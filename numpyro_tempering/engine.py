"""The log-weight engine: model + guide + params + particles -> per-particle log densities.

Every objective and estimator in this package is a function of the quantities computed
here, so traces are walked in exactly one place. For S particles z_s ~ q it returns

* ``log_q[s]``     = log q(z_s), the guide's density (with its site scales);
* ``log_prior[s]`` = sum of the model's *untempered* sample sites' log densities at z_s;
* ``log_lik[s]``   = sum of the *tempered* sites' log densities, i.e. of the sites a
  :class:`~numpyro_tempering.temper` handler marked (``msg["infer"]["tempered"]``), including
  any scale already on them (subsampling, ``handlers.scale``) and the temper handler's own
  power 1/T if the model was tempered at T != 1;
* ``log_lik_elements[s, i]`` (only when a ``plate`` is named): ``log_lik`` split over the
  elements ``i`` of that plate, each with its site scale, so that
  ``log_lik_elements.sum(-1) == log_lik``;
* ``site_log_w[name][s]`` (only with ``per_site=True``): log p_name - log q_name per site,
  which sum to ``log_w``.

so that log p(x, z_s) = log_prior + log_lik and the log importance weight is
``log_w = log_prior + log_lik - log_q``. The tempered joint of Mandt et al. 2016, eq. 4 is
``log_prior + log_lik / T`` (up to log C(T)).

Particles follow :class:`numpyro.infer.Trace_ELBO` exactly, so that at T = 1 every objective
built on the engine reproduces the stock NumPyro estimator on the same key:

* one particle uses the key as given, S > 1 particles use ``random.split(key, S)``, and each
  particle splits its key into a model and a guide seed;
* ``vectorize_particles``: ``True`` maps the particles with ``jax.vmap``, ``False`` with
  ``jax.lax.map`` (less memory), or a callable ``(fn, keys) -> outputs`` (e.g.
  ``lambda f, k: jax.pmap(f)(k)``);
* ``multi_sample_guide=True``: the guide draws K samples at once (a leading axis on every
  sample site); the model is evaluated at each (``jax.vmap``) and the model's log densities
  are summed over the K samples, as ``Trace_ELBO(multi_sample_guide=True)`` does;
* the model/guide checks are NumPyro's (``check_model_guide_match``, ``_validate_model``), with
  the same warnings; a model latent site missing from the guide is drawn from the prior, as
  in Trace_ELBO.

A runtime temperature
---------------------
A site tempered at a temperature known only when the program runs (a schedule's, or a T
passed to a compiled function) sums its log density through :func:`_tempered_total`, whose
derivative multiplies the *inputs'* tangents by 1/T instead of the output's: the same
derivative (it is linear in the tangents), but in reverse mode the likelihood's per-element
backward pass then receives the objective's own constant cotangent, as under ``Trace_ELBO``,
and XLA folds it as it does there. With ``1/T`` on the output, a shared scale's gradient
(the sum over N data of a broadcast cotangent) was no longer folded: an annealed
hierarchical regression took 1.21x Trace_ELBO's step with 8 particles, 1.035x now
(docs/reproductions.md, issue 22, item 1). Value, gradient, forward mode and second order
equal a literal T's (``tests/test_tempered_elbo.py``).

What the engine does not do
---------------------------
It does not enumerate. A model latent site marked for parallel enumeration
(``infer={"enumerate": "parallel"}``, e.g. by ``config_enumerate``) that the guide does not
sample is refused with a ``ValueError`` (Trace_ELBO would silently draw it from the prior):
sum it out with ``numpyro.infer.TraceEnum_ELBO`` on ``temper(model, T)``, or sample it in the
guide.

Mutable state
-------------
With one particle, every ``numpyro.mutable`` site's new value is returned, as Trace_ELBO does.
With S > 1 particles (or K > 1 samples of a multi-sample guide) each particle computes its own
update. The schedule clock of a :class:`~numpyro_tempering.temper` handler (the mutable site
named by its ``clock``, :data:`~numpyro_tempering.handlers.DEFAULT_CLOCK` by default) does not
depend on the particle, so it is kept (particle 0's value, equal to all others), as are the
sites named in ``shared_state``. Any other mutable state cannot be merged over particles: the
engine warns exactly like Trace_ELBO ("mutable state is currently ignored when num_particles >
1.") and ignores the update, returning the value it came in with (so the state's structure,
and ``svi.run``'s scan, are unchanged; Trace_ELBO drops the whole state instead).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import random
from numpyro.distributions import Delta, Distribution
from numpyro.distributions.util import is_identically_one, lazy_property
from numpyro.handlers import replay, seed, substitute
from numpyro.infer.util import compute_log_probs
from numpyro.primitives import _PYRO_STACK, Messenger
from numpyro.util import _validate_model, check_model_guide_match, not_jax_tracer

from numpyro_tempering.handlers import DEFAULT_CLOCK, TEMPERED, Tempered, resolve_clocks, temper
from numpyro_tempering.structure import plate_not_found, subsample_scale

__all__ = [
    "LogWeights",
    "MUTABLE_STATE_WARNING",
    "log_weights",
    "particle_keys",
    "particle_map",
    "particle_options",
]

#: Trace_ELBO's warning when per-particle mutable state is ignored (same text and category).
MUTABLE_STATE_WARNING = "mutable state is currently ignored when num_particles > 1."


class LogWeights(NamedTuple):
    """Per-particle log densities; every array has a leading particle axis of size S."""

    log_prior: jax.Array
    log_lik: jax.Array
    log_q: jax.Array
    log_lik_elements: jax.Array | None = None
    plate_scale: jax.Array | None = None
    mutable_state: dict | None = None
    #: subsample indices of the named plate, shape ``(B,)`` (``arange(N)`` if not subsampled)
    plate_indices: jax.Array | None = None
    #: per-site log p - log q, each of shape ``(S,)`` (only with ``per_site=True``)
    site_log_w: dict[str, jax.Array] | None = None

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


def point_mass(fn: Any) -> bool:
    """Whether a guide site's distribution is a point mass (a ``Delta``, also inside
    NumPyro's wrappers): its ``log_prob`` is then no density of q, and a guide whose every
    latent site is one (``AutoDelta``, ``AutoLaplaceApproximation`` in SVI) gives no
    importance weight, so no bound on log p(x) (checked by ``evidence_bounds``, ``CUBO`` and
    ``KLpq``)."""
    while True:
        if isinstance(fn, Delta):
            return True
        fn = getattr(fn, "base_dist", None)
        if fn is None:
            return False


class _shared_subsample(Messenger):
    """Draw the subsample of ``plate`` from ``rng_key``, the same in every particle (and in
    the model and the guide): the per-element log likelihoods of several particles are then
    of the same elements, so that their average over particles and the subsample indices
    (``LogWeights.plate_indices``) belong together. Under Trace_ELBO each particle draws its
    own minibatch; a per-element objective averaged particle by particle over different
    minibatches mixed different elements' terms (1.1 nats low at S = 16, found by a probe).
    A plate whose value a handler outside has set (``substitute``, ``replay``) is left alone.
    """

    def __init__(self, fn: Callable, plate: str, rng_key: jax.Array) -> None:
        self.plate, self.rng_key = plate, rng_key
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "plate" and msg["name"] == self.plate and msg["value"] is None:
            size, subsample_size = msg["args"]
            msg["value"] = msg["fn"](size, subsample_size, rng_key=self.rng_key)


def particle_keys(rng_key: jax.Array, num_particles: int) -> jax.Array:
    """Keys of the particles, exactly as :class:`numpyro.infer.Trace_ELBO` draws them."""
    if num_particles == 1:
        return rng_key[None]
    return random.split(rng_key, num_particles)


def particle_map(vectorize_particles: bool | Callable) -> Callable:
    """How particles are mapped, as NumPyro's ``ELBO(vectorize_particles=...)``.

    ``True``: ``jax.vmap``; ``False``: ``jax.lax.map``; a callable ``(fn, keys) -> outputs``
    is used as given (e.g. ``lambda f, k: jax.pmap(f)(k)``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> particle_map(False)(lambda k: k.sum(), jnp.ones((3, 2))).tolist()
        [2.0, 2.0, 2.0]
    """
    if callable(vectorize_particles):
        return vectorize_particles
    if vectorize_particles is True:
        return lambda fn, keys: jax.vmap(fn)(keys)
    if vectorize_particles is False:
        return jax.lax.map
    raise ValueError(
        "`vectorize_particles` must be True (jax.vmap), False (jax.lax.map) or a callable "
        f"(fn, keys) -> outputs such as `lambda f, k: jax.pmap(f)(k)`, got {vectorize_particles!r}."
    )


def particle_options(elbo: Any) -> dict[str, Any]:
    """The engine's particle options of a NumPyro ELBO instance, for ``log_weights(**...)``.

    Reads ``num_particles``, ``vectorize_particles`` and ``multi_sample_guide`` (as set by
    NumPyro's ``ELBO``/``Trace_ELBO`` constructors), so that every objective built on the
    engine takes Trace_ELBO's options by passing them to ``ELBO.__init__``.

    Example:
        >>> from numpyro.infer import Trace_ELBO
        >>> particle_options(Trace_ELBO(3, vectorize_particles=False))
        {'num_particles': 3, 'vectorize_particles': False, 'multi_sample_guide': False}
    """
    return {
        "num_particles": elbo.num_particles,
        "vectorize_particles": getattr(elbo, "vectorize_particles", True),
        "multi_sample_guide": getattr(elbo, "multi_sample_guide", False),
    }


def _fresh_params(param_map: dict) -> dict:
    # New containers for every run, so a handler mutating a mutable site in place (the
    # schedule clock) never sees a value another run already advanced.
    return jax.tree.map(lambda x: x, param_map)


class _find_clocks(Messenger):
    """Record the ``clock`` names of the ``temper`` handlers a model runs under."""

    def __init__(self, fn: Callable, found: set[str]) -> None:
        self.found = found
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        for handler in _PYRO_STACK:
            if isinstance(handler, temper):
                self.found.add(handler.clock)


def _mutable(trace: dict) -> dict:
    return {n: s["value"] for n, s in trace.items() if s["type"] == "mutable"}


def _check_not_enumerated(model_trace: dict, guide_trace: dict) -> None:
    for name, site in model_trace.items():
        if (
            site["type"] == "sample"
            and not site.get("is_observed", False)
            and name not in guide_trace
            and (site.get("infer") or {}).get("enumerate") == "parallel"
        ):
            raise ValueError(
                f"site '{name}' is marked for parallel enumeration (infer={{'enumerate': "
                "'parallel'}, e.g. by config_enumerate) but the guide does not sample it. "
                "The log-weight engine (TemperedELBO, CUBO, KLpq, MulticanonicalELBO) does "
                f"not enumerate: it would draw '{name}' from the prior. Sum it out exactly "
                f"with numpyro.infer.TraceEnum_ELBO on temper(model, T), or sample '{name}' "
                "in the guide."
            )


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


def _plate_site(model_trace: dict, plate: str) -> dict:
    site = model_trace.get(plate)
    if site is None or site["type"] != "plate":
        raise plate_not_found(plate, (n for n, s in model_trace.items() if s["type"] == "plate"))
    return site


def _plate_scale(model_trace: dict, plate: str) -> jax.Array:
    site = _plate_site(model_trace, plate)
    return subsample_scale(site["args"][0], jnp.shape(site["value"])[0])


class _ModelTerms(NamedTuple):
    log_prior: jax.Array
    log_lik: jax.Array
    log_lik_elements: jax.Array | None
    plate_scale: jax.Array | None
    plate_indices: jax.Array | None
    site_log_p: dict | None


def _site_log_prob(fn, value, scale):
    log_prob = fn.log_prob(value)
    return log_prob if scale is None else scale * log_prob


@jax.custom_jvp
def _tempered_total(inv_temperature, fn, value, scale):
    """``inv_temperature * sum(scale * fn.log_prob(value))``, differentiated with the power
    applied to the *tangents of the inputs* (``fn``'s parameters and ``value``) instead of
    to the output. The derivative is the same (the density is linear in its tangent), but
    in reverse mode the cotangent that reaches the site's per-element backward pass is
    then the objective's own (a constant such as -1/S), not -beta/S: with a runtime T (a
    schedule, a traced T) XLA folds the per-element cotangents into constants as it does
    for ``Trace_ELBO`` (e.g. the sum over the N data of a broadcast cotangent for a shared
    scale, which it cannot simplify through a runtime beta), and beta multiplies the
    parameters' cotangents once, after."""
    return inv_temperature * jnp.sum(_site_log_prob(fn, value, scale))


def _scale_tangent(beta, t):
    return t if t.dtype == jax.dtypes.float0 else beta * t


@_tempered_total.defjvp
def _tempered_total_jvp(primals, tangents):
    beta, fn, value, scale = primals
    d_beta, *d_args = tangents
    d_args = jax.tree.map(partial(_scale_tangent, beta), tuple(d_args))
    total, d_total = jax.jvp(
        lambda f, v, s: jnp.sum(_site_log_prob(f, v, s)), (fn, value, scale), d_args
    )
    return beta * total, d_total + d_beta * total


def _rebuilds(fn) -> bool:
    """Whether the distribution ``fn`` survives JAX's flatten/unflatten (which
    :func:`_tempered_total` puts it through): every attribute it holds is a pytree field, or
    a ``lazy_property`` recomputed on demand, also in the distributions it wraps. A
    distribution keeping an undeclared attribute would lose it."""
    try:
        leaves, treedef = jax.tree.flatten(fn)
        rebuilt = jax.tree.unflatten(treedef, leaves)
    except Exception:  # noqa: BLE001 - any failure: take the unfactored path
        return False
    for name, value in vars(fn).items():
        if name not in vars(rebuilt) and not isinstance(getattr(type(fn), name, None),
                                                          lazy_property):
            return False
        if isinstance(value, Distribution) and not _rebuilds(value):
            return False
    return True


def _factorable(site: dict) -> bool:
    """A site tempered at a runtime scalar power 1/T (a schedule's, or a traced T): its sum
    goes through :func:`_tempered_total` (a literal T folds into the constants anyway)."""
    fn = site["fn"]
    return (
        isinstance(fn, Tempered)
        and not not_jax_tracer(fn.inv_temperature)
        and jnp.ndim(fn.inv_temperature) == 0
        and not site["intermediates"]
        and _rebuilds(fn.base_dist)
    )


def _model_log_probs(model, args, kwargs, params):
    """numpyro's ``compute_log_probs(..., sum_log_prob=False)``, and ``totals``: the summed
    log density of each site tempered at a runtime scalar T, by :func:`_tempered_total`
    (the per-element log density of such a site is then only used for a plate's elements;
    unused, the compiler drops it)."""
    log_probs, model_trace = compute_log_probs(model, args, kwargs, params, sum_log_prob=False)
    totals = {}
    for name, site in model_trace.items():
        if site["type"] == "sample" and _factorable(site):
            scale = site["scale"]
            scale = None if scale is None or is_identically_one(scale) else scale
            fn = site["fn"]
            totals[name] = _tempered_total(fn.inv_temperature, fn.base_dist, site["value"],
                                           scale)
    return log_probs, totals, model_trace


def _model_terms(
    model_trace: dict, log_probs: dict, plate: str | None, per_site: bool, totals: dict
):
    """Split the model's (unsummed) site log densities into the prior and tempered groups;
    ``totals``: sites whose sum is already computed (:func:`_model_log_probs`)."""
    plate_site = None if plate is None else _plate_site(model_trace, plate)
    zero = jnp.zeros(())
    log_prior, log_lik, elements = zero, zero, zero
    site_log_p = {}
    for name, log_prob in log_probs.items():
        site = model_trace[name]
        total = totals[name] if name in totals else jnp.sum(log_prob)
        site_log_p[name] = total
        if site["infer"].get(TEMPERED, False):
            log_lik = log_lik + total
            if plate is not None:
                elements = elements + _element_log_lik(site, log_prob, plate)
        else:
            log_prior = log_prior + total
    return _ModelTerms(
        log_prior=log_prior,
        log_lik=log_lik,
        log_lik_elements=elements if plate is not None else None,
        plate_scale=None if plate is None else _plate_scale(model_trace, plate),
        plate_indices=None if plate_site is None else jnp.asarray(plate_site["value"]),
        site_log_p=site_log_p if per_site else None,
    )


def _collapse_state(state: dict, shared: set[str], param_map: dict, message: str) -> dict:
    """One mutable state from per-particle states (leading axis): keep the shared sites,
    ignore (with ``message``) the others, which keep the value they came in with."""
    kept = {n: jax.tree.map(lambda x: x[0], v) for n, v in state.items() if n in shared}
    ignored = [n for n in state if n not in shared]
    if ignored:
        warnings.warn(message, UserWarning, stacklevel=3)
        kept.update({n: param_map[n] for n in ignored if n in param_map})
    return kept


def _single_sample_model(
    model_seed, params, model, guide_trace, args, kwargs, plate, per_site
) -> tuple[_ModelTerms, dict]:
    model_log_probs, totals, model_trace = _model_log_probs(
        replay(seed(model, model_seed), guide_trace), args, kwargs, params
    )
    check_model_guide_match(model_trace, guide_trace)
    _validate_model(model_trace, plate_warning="loose")
    _check_not_enumerated(model_trace, guide_trace)
    terms = _model_terms(model_trace, model_log_probs, plate, per_site, totals)
    return terms, _mutable(model_trace)


def _multi_sample_model(
    model_seed, params, param_map, model, guide_trace, args, kwargs, plate, per_site, shared
) -> tuple[_ModelTerms, dict]:
    # As Trace_ELBO(multi_sample_guide=True): every guide sample site has a leading axis of
    # K samples; the model runs at each (vmap) and its log densities are summed over them.
    plates = {n: s["value"] for n, s in guide_trace.items() if s["type"] == "plate"}
    num_samples = next(
        (jnp.shape(s["value"])[0] for s in guide_trace.values() if s["type"] == "sample"), None
    )
    if num_samples is None:
        raise ValueError(
            "multi_sample_guide=True: the guide has no sample sites (the leading axis of its "
            "samples is the number of guide samples)."
        )
    latents = {
        n: s["value"]
        for n, s in guide_trace.items()
        if (s["type"] == "sample" and jnp.size(s["value"]) > 0) or s["type"] == "deterministic"
    }

    def one(key, latent):
        with seed(rng_seed=key), substitute(data={**latent, **plates}):
            log_probs, totals, model_trace = _model_log_probs(
                model, args, kwargs, _fresh_params(params)
            )
        _validate_model(model_trace, plate_warning="loose")
        _check_not_enumerated(model_trace, guide_trace)
        terms = _model_terms(model_trace, log_probs, plate, per_site, totals)
        return terms, _mutable(model_trace)

    terms, state = jax.vmap(one)(random.split(model_seed, num_samples), latents)

    def total(x):
        return None if x is None else jnp.sum(x, axis=0)

    terms = _ModelTerms(
        log_prior=total(terms.log_prior),
        log_lik=total(terms.log_lik),
        log_lik_elements=total(terms.log_lik_elements),
        plate_scale=None if terms.plate_scale is None else terms.plate_scale[0],
        plate_indices=None if terms.plate_indices is None else terms.plate_indices[0],
        site_log_p=None if terms.site_log_p is None else jax.tree.map(total, terms.site_log_p),
    )
    message = "mutable state of the model is ignored with multi_sample_guide=True."
    return terms, _collapse_state(state, shared, param_map, message)


def _single_particle(
    rng_key: jax.Array,
    param_map: dict,
    model: Callable,
    guide: Callable,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    multi_sample_guide: bool,
    per_site: bool,
    shared: set[str],
) -> LogWeights:
    model_seed, guide_seed = random.split(rng_key)
    params = _fresh_params(param_map)
    guide_log_probs, guide_trace = compute_log_probs(seed(guide, guide_seed), args, kwargs, params)
    mutable = _mutable(guide_trace)
    params.update(mutable)
    if multi_sample_guide:
        terms, model_state = _multi_sample_model(
            model_seed, params, param_map, model, guide_trace, args, kwargs, plate, per_site,
            shared,
        )
    else:
        terms, model_state = _single_sample_model(
            model_seed, params, model, guide_trace, args, kwargs, plate, per_site
        )
    mutable.update(model_state)
    zero = jnp.zeros(())
    site_log_w = None
    if per_site:  # as Trace_ELBO(sum_sites=False): log p - log q over the union of sites
        site_log_w = {
            name: terms.site_log_p.get(name, zero) - guide_log_probs.get(name, zero)
            for name in set(terms.site_log_p) | set(guide_log_probs)
        }
    return LogWeights(
        log_prior=terms.log_prior,
        log_lik=terms.log_lik,
        log_q=sum(guide_log_probs.values(), start=zero),
        log_lik_elements=terms.log_lik_elements,
        plate_scale=terms.plate_scale,
        mutable_state=mutable or None,
        plate_indices=terms.plate_indices,
        site_log_w=site_log_w,
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
    vectorize_particles: bool | Callable = True,
    multi_sample_guide: bool = False,
    per_site: bool = False,
    shared_state: Collection[str] = (),
) -> LogWeights:
    """Per-particle log prior, tempered-group log likelihood and log q.

    Args:
        rng_key: PRNG key; particles draw from it as :class:`numpyro.infer.Trace_ELBO` does.
        param_map: constrained parameter values (and mutable state), as SVI passes them.
        model: the model; sites marked by a :class:`~numpyro_tempering.temper` handler form
            the likelihood group, every other sample site the prior group.
        guide: the guide, whose sample sites are replayed into the model.
        args, kwargs: model and guide arguments.
        num_particles: number of particles S.
        plate: optional plate name: also return the likelihood per element of that plate
            (a subsampled one: with S > 1 every particle sees the same subsample of it).
        vectorize_particles: ``True`` (``jax.vmap``), ``False`` (``jax.lax.map``) or a
            callable ``(fn, keys) -> outputs``, as in Trace_ELBO.
        multi_sample_guide: the guide draws several samples at once (Trace_ELBO's option).
        per_site: also return ``site_log_w``, log p - log q per site (which sum to
            ``log_w``), for ``sum_sites=False``.
        shared_state: names of further ``numpyro.mutable`` sites that are the same for every
            particle by construction and are kept with S > 1 particles (temper's schedule
            clocks always are).

    Returns:
        :class:`LogWeights` with arrays of shape ``(S,)`` (``(S, B)`` for the plate elements).
        ``mutable_state``: see the module docstring (all of it with one particle; with
        S > 1 the shared sites, and a Trace_ELBO-style warning for the others).

    Raises:
        ValueError: a model site marked for parallel enumeration is not in the guide (the
            engine does not enumerate), ``plate`` is not in the model, or
            ``vectorize_particles``/``num_particles`` is invalid.

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
        ...                  num_particles=4, vectorize_particles=False, per_site=True)
        >>> lw.log_w.shape
        (4,)
        >>> bool(jnp.allclose(lw.site_log_w["mu"] + lw.site_log_w["x"], lw.log_w))
        True
    """
    if isinstance(num_particles, bool) or int(num_particles) != num_particles or num_particles < 1:
        raise ValueError(f"`num_particles` must be a positive integer, got {num_particles!r}.")
    num_particles = int(num_particles)
    map_fn = particle_map(vectorize_particles)
    kwargs = {} if kwargs is None else kwargs
    if isinstance(shared_state, str):
        shared_state = (shared_state,)
    shared = {DEFAULT_CLOCK, *shared_state}  # temper's clocks are added while tracing
    # T(step) of temper(model, schedule) once per step, not inside the particle map
    model = _find_clocks(resolve_clocks(model, param_map), shared)
    guide = _find_clocks(guide, shared)

    def one(key):
        return _single_particle(
            key, param_map, model, guide, args, kwargs, plate, bool(multi_sample_guide),
            per_site, shared,
        )

    if num_particles == 1:  # as Trace_ELBO: no map over a single particle (cheaper)
        weights = one(rng_key)

        def lead(x):
            return None if x is None else jax.tree.map(lambda a: a[None], x)

        return weights._replace(
            log_prior=lead(weights.log_prior),
            log_lik=lead(weights.log_lik),
            log_q=lead(weights.log_q),
            log_lik_elements=lead(weights.log_lik_elements),
            site_log_w=lead(weights.site_log_w),
        )
    if plate is not None:  # one minibatch for all particles (see _shared_subsample)
        key_subsample = random.fold_in(rng_key, num_particles)
        model = _shared_subsample(model, plate, key_subsample)
        guide = _shared_subsample(guide, plate, key_subsample)
    weights = map_fn(one, particle_keys(rng_key, num_particles))
    state = weights.mutable_state
    if state is not None:
        state = _collapse_state(state, shared, param_map, MUTABLE_STATE_WARNING) or None
    scale = None if weights.plate_scale is None else weights.plate_scale[0]
    indices = None if weights.plate_indices is None else weights.plate_indices[0]
    return weights._replace(mutable_state=state, plate_scale=scale, plate_indices=indices)
