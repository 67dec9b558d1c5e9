r"""The multicanonical ELBO of multicanonical VI (Mandt et al. 2016, eq. 13, 18).

The multicanonical model (eq. 10-11) draws a temperature :math:`y \sim \mathrm{Mult}(\pi)`
from a ladder and tempers the likelihood at :math:`T_y`, normalised by :math:`C(T_y)`. With
the mean-field family :math:`q(\beta, z)\, q(y)` (eq. 12) the bound is eq. 13:

.. math::

    \mathcal{L}_M = \mathbb{E}_q[\log p(\beta) - \log q(\beta, z)]
        + \sum_m r_m \Big(\frac{\ell}{T_m} - \log C(T_m) + \log \pi_m - \log r_m\Big),
    \qquad \ell = \mathbb{E}_q[\log p(x, z \mid \beta)],

and its maximiser over :math:`q(y) = r` is the closed form eq. 18,

.. math::

    r_m^* \propto \exp\Big\{\frac{\ell}{T_m} - \log C(T_m) + \log \pi_m\Big\}.

:class:`MulticanonicalELBO` recomputes :math:`r^*` at every step from the current
(Monte Carlo) expected log-likelihood, held fixed for the gradient, so the gradient is that
of the tempered ELBO (eq. 7) at the *effective inverse temperature*
:math:`\mathbb{E}_{r^*}[1/T_y]` (eq. 15-17); since :math:`r^*` is the maximiser, this is
also the gradient of :math:`\max_r \mathcal{L}_M` (envelope theorem). The loss is
:math:`-\mathcal{L}_M(r^*)`.

Global or local temperature
---------------------------
* ``plate=None``: one temperature for the whole model (the paper's FMM).
* ``plate="docs"``: one temperature per element of that plate (the paper's per-document
  temperatures for LDA): :math:`q(y_n) \propto \exp\{\ell_n / T_m - \log c_n(T_m) +
  \log\pi_m\}` with :math:`\ell_n` the expected log-likelihood of element :math:`n` and
  :math:`\log c_n(T)` that element's own normaliser, from the ladder's ``element_log_c``
  (shape ``(M, N)``; see :mod:`numpyro_tempering.ladder`). Elements differ -- noise scales,
  document lengths -- so an even split :math:`\log C/N` is exact only for identical
  elements; a ladder without per-element values is refused. They are exact when the
  per-element normaliser does not depend on the globals; otherwise
  :func:`~numpyro_tempering.partition_function.log_partition` returns a documented split that
  adds up to :math:`\log C`. Every tempered site must be inside the plate.

Subsampling (``plate(..., subsample_size=B)``) works: the engine's per-element
log-likelihoods carry the scale :math:`N/B` and the subsample indices
(``LogWeights.plate_indices``) that pick the minibatch's :math:`\log c_n`; the local
:math:`\ell_n` is divided by the scale, and the per-element terms are scaled back by
:math:`N/B`. With several particles every particle sees the same minibatch (the engine
draws one subsample per step: per-element averages over particles must be of the same
elements). A global temperature uses the unbiased minibatch estimate of :math:`\ell` (as
the paper's Algorithm 1 does), but eq. 18 and the M-ELBO are nonlinear in :math:`\ell`
(a log-sum-exp over the rungs): with a minibatch, :math:`q(y)` follows the minibatch's
noise and the loss is biased (its expectation is above the full-data M-ELBO, by Jensen's
inequality; a probe measured +2.3 nats at N = 8, B = 2 with one particle and +0.22 with
16, ``tests/test_multicanonical.py::test_a_global_temperature_on_minibatches_is_biased_upward``).
The gradient follows the same minibatch q(y); use larger minibatches or more particles
where that matters.

Joint tempering
---------------
``joint=True`` tempers an observed mixture whose discrete local is summed out jointly, as
:class:`~numpyro_tempering.temper` does: :math:`\ell_m = \log\sum_k p(x, z = k \mid
\beta)^{1/T_m}` is no longer :math:`\ell / T_m`, so the objective evaluates the tempered
log-likelihood at every temperature (one vectorised model run per rung) and uses
:math:`\mathbb{E}_q[\ell_m]` in place of :math:`\ell/T_m` in eq. 13 and 18. The ladder must
be computed with the same ``joint=True``.

What is checked
---------------
The model's sizes against the ladder's (a ladder without sizes is refused, see
:mod:`numpyro_tempering.ladder`); ``numpyro.param`` sites in the model are refused (SVI
would change them and make the ladder's log C stale); a ladder with temperatures flagged
as untrusted gives a warning.

Damped q(y)
-----------
``step_size=rho`` (or a schedule such as
:func:`~numpyro_tempering.temperatures.robbins_monro`) replaces eq. 18 by a running average
of its log-weights, :math:`a_t = (1-\rho_t)\,a_{t-1} + \rho_t\,(\ell_t/T_m - \log C(T_m) +
\log\pi_m)`, from the paper's uniform start :math:`a_0 = \log\pi`: eq. 18 at a lagged
:math:`\ell`, which slows the learnt schedule's cooling down to the pace of the fit's
progress averaged over about :math:`1/\rho` steps (the paper updates T only every 1000
iterations, section 4.1). The state lives in the model's :func:`record_temperatures`
record. Global temperature only.

The learnt temperature trajectory
---------------------------------
Stock :class:`~numpyro.infer.SVI` returns only the loss per step, so this module offers:

* :meth:`MulticanonicalELBO.temperature_posterior` -- :math:`q(y)` and :math:`\mathbb{E}[T]`
  at given parameters (e.g. ``svi.get_params(state)``); and
  :meth:`MulticanonicalELBO.temperature_trajectory` for a list of saved parameters;
* :func:`record_temperatures` -- wrap the model given to SVI to carry a fixed-size history
  (one row per step: :math:`q(y)` and :math:`\mathbb{E}_q[T]`; for a local temperature the
  minibatch average) in a ``numpyro.mutable`` site, the one piece of state SVI carries
  between updates; :func:`temperature_history` reads it from the result of ``svi.run``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from numpyro_tempering.engine import LogWeights
from numpyro_tempering.handlers import Selection, already_tempered, temper
from numpyro_tempering.ladder import Ladder
from numpyro_tempering.multicanonical_model import already_tempered_message
from numpyro_tempering.objectives.base import EngineELBO
from numpyro_tempering.structure import (
    ModelSizes,
    model_params,
    nothing_tempered,
    sizes_from_trace,
    stale_params_message,
    structure_trace,
)

# the trajectory helpers live in numpyro_tempering.temperatures; importable from here too
from numpyro_tempering.temperatures import TemperatureHistory as TemperatureHistory
from numpyro_tempering.temperatures import (
    TemperaturePosterior,
    TemperatureRecord,
    damped_log_weights,
    element_log_partition,
    posterior_from_arrays,
    record_names,
    temperature_posterior,
    update_records,
    warn_if_flagged,
)
from numpyro_tempering.temperatures import record_temperatures as record_temperatures
from numpyro_tempering.temperatures import temperature_history as temperature_history

__all__ = ["MulticanonicalELBO", "multicanonical_elbo"]


def multicanonical_elbo(
    weights: LogWeights,
    ladder: Ladder,
    plate_size: int | None = None,
    probs: jax.Array | None = None,
    *,
    log_lik_by_temperature: jax.Array | None = None,
) -> tuple[jax.Array, TemperaturePosterior]:
    r"""The M-ELBO (eq. 13) from the engine's log weights, at :math:`q(y) = ` ``probs``.

    Args:
        weights: :class:`~numpyro_tempering.engine.LogWeights` of a model whose likelihood
            sites are marked tempered (with ``log_lik_elements`` and ``plate_indices`` for a
            local temperature).
        ladder: the ladder, with ``log_c`` (and ``element_log_c`` for a local temperature).
        plate_size: ``None`` for a global temperature; the full size ``N`` of the plate of
            ``weights.log_lik_elements`` for a local one.
        probs: :math:`q(y)`, shape ``(M,)`` (or ``(B, M)``); default the optimum eq. 18,
            computed from the current :math:`\ell` under ``stop_gradient``. Gradients flow
            through a given ``probs``.
        log_lik_by_temperature: the tempered log-likelihood at every temperature,
            ``(S, M)`` (or ``(S, B, M)``, with the subsample scale), when it is not
            ``log_lik / T`` (joint tempering); default ``log_lik[..., None] / T``.

    Returns:
        ``(m_elbo, posterior)``; the gradient of ``m_elbo`` flows only through the
        log weights: :math:`\sum_m r_m \nabla\ell_m`, i.e. the tempered ELBO's at the
        effective inverse temperature :math:`\mathbb{E}_q[1/T_y]` when
        :math:`\ell_m = \ell / T_m`.

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro_tempering.engine import LogWeights
        >>> w = LogWeights(jnp.zeros(1), jnp.array([-3.0]), jnp.zeros(1))
        >>> lad = Ladder([1.0, 2.0]).with_log_partition_values([0.0, 1.0])
        >>> value, post = multicanonical_elbo(w, lad)
        >>> # eq. 18: logits log(1/2) + (-3/1 - 0, -3/2 - 1); value = logsumexp(logits)
        >>> round(float(value), 4), [round(float(p), 4) for p in post.probs]
        (-2.7191, [0.3775, 0.6225])
    """
    dtype = jnp.result_type(weights.log_lik.dtype, float)
    inv_t, log_pi, log_c = ladder.arrays(dtype)
    per_element = plate_size is not None
    if per_element and weights.log_lik_elements is None:
        raise ValueError("a local temperature needs log_lik_elements (engine plate=...).")
    # l_m = l / T_m unless given per rung (joint tempering): then the (S, [B,] M) array is
    # never formed, and sum_m r_m l_m = E_r[1/T] l (the fused form)
    linear = log_lik_by_temperature is None
    base = weights.log_lik_elements if per_element else weights.log_lik  # (S, [B])
    scale = weights.plate_scale if per_element else 1.0
    # the expected log-likelihood l ((B,) per element, unscaled; () global), held fixed for
    # q(y) (envelope theorem), and l_m at every rung ((B, M) or (M,))
    mean_lik = jax.lax.stop_gradient(jnp.mean(base, axis=0) / scale)
    if linear:
        ell = mean_lik[..., None] * inv_t
    else:
        ell = jax.lax.stop_gradient(jnp.mean(log_lik_by_temperature, axis=0) / scale)
    if per_element:
        indices = weights.plate_indices
        if indices is None and ell.shape[0] != plate_size:
            raise ValueError(
                "a subsampled plate needs LogWeights.plate_indices to pick the elements' "
                "log c_n."
            )
        log_c = element_log_partition(ladder, plate_size, indices, dtype)
    # eq. 18 at the current ell
    optimum = temperature_posterior(ell, ladder, log_c=log_c)
    if probs is None:
        posterior = optimum
        # y-only terms at the optimum, where log r_m = l_m + log pi_m - log C_m - log Z
        # (eq. 18): sum_m r_m (log pi_m - log C_m - log r_m) = log Z - sum_m r_m l_m, and
        # sum_m r_m l_m = E_r[1/T] l when l_m = l / T_m -- no second (B, M) pass
        expected_ell = (
            mean_lik * optimum.mean_inverse_temperature
            if linear
            else jnp.sum(optimum.probs * ell, axis=-1)
        )
        const = optimum.log_marginal - expected_ell
    else:
        r = jnp.asarray(probs, dtype)
        posterior = TemperaturePosterior(
            r, jnp.sum(r / inv_t, axis=-1), jnp.sum(r * inv_t, axis=-1), optimum.log_marginal
        )
        # y-only terms: sum_m r_m (log pi_m - log C_m - log r_m), with 0 log 0 = 0
        log_r = jnp.log(jnp.where(r > 0, r, 1.0))
        const = jnp.sum(jnp.where(r > 0, r * (log_pi - log_c - log_r), 0.0), axis=-1)
    r = posterior.probs
    if linear:
        expected = base * posterior.mean_inverse_temperature  # (S,) or (S, B)
    else:
        expected = jnp.sum(r * log_lik_by_temperature, axis=-1)
    if per_element:
        expected = jnp.sum(expected, axis=-1)
    value = jnp.mean(weights.log_prior + expected - weights.log_q) + scale * jnp.sum(const)
    return value, posterior


class MulticanonicalELBO(EngineELBO):
    r"""Multicanonical ELBO (eq. 13) with the closed-form optimal :math:`q(y)` (eq. 18).

    Args:
        ladder: a :class:`~numpyro_tempering.ladder.Ladder` holding :math:`\log C(T_m)` for
            this model (``ladder.with_log_partition(model, key, *args, ...)``, with
            ``plate`` for a per-element temperature), the model sizes and the tempering
            selection it is for. The paper's default is
            ``Ladder.geometric(1.0, 10.0, 100)``.
        plate: ``None`` for one global temperature, or the name of a plate for one
            temperature per element (see the module docstring; the ladder must hold that
            plate's per-element :math:`\log c_n`).
        sites, latent, exclude, joint: which sites form the tempered likelihood and how,
            as in :class:`~numpyro_tempering.temper`. Default: the ladder's
            :attr:`~numpyro_tempering.ladder.Ladder.selection` (given once, to
            ``with_log_partition``), else the observed sites; a selection other than the
            ladder's is a ``ValueError`` (:meth:`~numpyro_tempering.ladder.Ladder.selection_for`).
        num_particles: Monte Carlo particles.
        vectorize_particles: as in :class:`~numpyro.infer.Trace_ELBO` (``jax.vmap``,
            ``jax.lax.map`` or a callable).
        step_size: ``None`` (default): :math:`q(y)` is eq. 18 at every step. Otherwise a
            *damped* :math:`q(y)`, global temperature only: a running average of eq. 18's
            log-weights, :math:`a_t = (1 - \rho_t) a_{t-1} + \rho_t a^*_t` from
            :math:`a_0 = \log\pi` (:func:`~numpyro_tempering.temperatures.damped_log_weights`),
            with :math:`\rho_t` this constant in (0, 1] or a schedule of the step count
            :math:`t = 1, 2, \dots` (e.g.
            :func:`~numpyro_tempering.temperatures.robbins_monro`); ``1.0`` is eq. 18. The
            running log-weights live in the model's
            :func:`~numpyro_tempering.temperatures.record_temperatures` record, which is then
            required. The loss is :math:`-\mathcal{L}_M` at that :math:`q(y)`, a lower bound
            on eq. 18's value, with the gradient of the tempered ELBO at its
            :math:`\mathbb{E}_q[1/T_y]`. See docs/multicanonical.md, "Why MVI settled hot
            on the FMM".

    The loss is :math:`-\mathcal{L}_M` at :math:`q(y) = r^*`. A ladder with only
    :math:`T = 1` and :math:`\log C(1) = 0` gives exactly
    :class:`~numpyro.infer.Trace_ELBO` (value and gradient, same key). A model of other
    sizes than the ladder's (plate sizes, tempered sites, their shapes), a ladder that
    records no sizes, and a model with ``numpyro.param`` sites are errors.

    :math:`q(y)` is the exact maximiser at the *current* parameters at every step, including
    the first. (The paper's Algorithm 1 starts from a uniform :math:`q(y)` and updates it
    after each global step, i.e. one step behind; the closed form needs no initial value.)

    Example:
        >>> import jax, jax.numpy as jnp, optax, numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import SVI
        >>> from numpyro.infer.autoguide import AutoNormal
        >>> from numpyro_tempering.ladder import Ladder
        >>> from numpyro_tempering.objectives.multicanonical import (
        ...     MulticanonicalELBO, record_temperatures, temperature_history)
        >>> def model(x):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> x = jnp.linspace(-1.0, 3.0, 20)
        >>> ladder = Ladder.geometric(1.0, 10.0, 10).with_log_partition(
        ...     model, jax.random.PRNGKey(0), x)
        >>> svi = SVI(record_temperatures(model, ladder, 300), AutoNormal(model),
        ...           optax.adam(0.05), MulticanonicalELBO(ladder))
        >>> result = svi.run(jax.random.PRNGKey(1), 300, x, progress_bar=False)
        >>> hist = temperature_history(result)
        >>> hist.probs.shape, bool(hist.mean_temperature[-1] < hist.mean_temperature[0])
        ((300, 10), True)
    """

    can_infer_discrete = False

    def __init__(
        self,
        ladder: Ladder,
        *,
        plate: str | None = None,
        sites: str | Collection[str] | Callable | Selection | None = None,
        latent: str | Collection[str] = (),
        exclude: str | Collection[str] = (),
        joint: bool = False,
        num_particles: int = 1,
        vectorize_particles: bool | Callable = True,
        step_size: float | Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(ladder, Ladder):
            raise TypeError(f"`ladder` must be a Ladder, got {type(ladder).__name__}.")
        ladder.require_log_partition()
        if plate is not None and not isinstance(plate, str):
            raise TypeError(f"`plate` must be a plate name (str) or None, got {plate!r}.")
        if plate is not None:
            ladder.require_element_log_partition(plate)
        warn_if_flagged(ladder, "MulticanonicalELBO")
        if step_size is not None:
            if plate is not None:
                raise ValueError(
                    "a damped q(y) (`step_size`) is implemented for a global temperature "
                    "(plate=None) only."
                )
            if not callable(step_size) and not 0.0 < float(step_size) <= 1.0:
                raise ValueError(f"`step_size` must be in (0, 1] or a schedule, got {step_size}.")
        self.step_size = step_size
        self.ladder = ladder
        self.plate = plate
        self.selection = ladder.selection_for(Selection.of(sites, latent, exclude, joint))
        self._sizes_cache: dict[Any, tuple[ModelSizes, list[str]]] = {}
        super().__init__(num_particles=num_particles, vectorize_particles=vectorize_particles)

    def tempered_model(self, model: Callable, temperature: Any = 1.0) -> Callable:
        """The model with its likelihood sites marked (``temper(model, 1.0, ...)``), or
        tempered at ``temperature``."""
        return temper(model, temperature, sites=self.selection)

    # -- size checks ----------------------------------------------------------------------
    def _structure(self, model: Callable, args: tuple, kwargs: dict) -> tuple:
        signature = jax.tree.map(
            lambda x: (jnp.shape(x), jnp.result_type(x)) if hasattr(x, "shape") else x,
            (args, kwargs),
        )
        try:
            key = (id(model), repr(signature))
        except Exception:  # pragma: no cover - unrepresentable arguments: no caching
            key = None
        if key is not None and key in self._sizes_cache:
            return self._sizes_cache[key]
        tr = structure_trace(self.tempered_model(model), args, kwargs)
        for name, site in tr.items():
            if site["type"] == "sample" and already_tempered(site["fn"]):
                raise ValueError(already_tempered_message(name, "MulticanonicalELBO"))
        found = (sizes_from_trace(tr), model_params(tr))
        if not found[0].sites:
            raise nothing_tempered(tr, "MulticanonicalELBO")
        if key is not None:
            self._sizes_cache[key] = found
        return found

    def model_sizes(self, model: Callable, *args: Any, **kwargs: Any) -> ModelSizes:
        """Sizes of ``model`` (checked against the ladder's); cached per model and shapes."""
        return self._structure(model, args, kwargs)[0]

    def _plate_size(self, model: Callable, args: tuple, kwargs: dict) -> int | None:
        sizes, params = self._structure(model, args, kwargs)
        if params:
            raise ValueError(stale_params_message(params, "MulticanonicalELBO"))
        self.ladder.check_sizes(sizes)
        if self.plate is None:
            return None
        return sizes.plate_size(self.plate)

    # -- evaluation -----------------------------------------------------------------------
    def _weights(self, rng_key, param_map, model, guide, args, kwargs):
        """Log weights, and the tempered log-likelihood at every rung if ``joint``."""

        records = record_names(param_map)  # per step, not per particle: kept for S > 1

        def at(temperature: Any) -> LogWeights:
            tempered = self.tempered_model(model, temperature)
            return self.log_weights(
                rng_key, param_map, tempered, guide, args, kwargs, plate=self.plate,
                shared_state=records,
            )

        if not self.selection.joint:
            return at(1.0), None
        # l_m is not l / T_m: one run per rung, same draws (the sampling ignores T)
        temps = jnp.asarray(self.ladder.temperatures, jnp.result_type(float))
        stacked = jax.vmap(at)(temps)
        lik = stacked.log_lik if self.plate is None else stacked.log_lik_elements
        first = jax.tree.map(lambda v: v[0], stacked)
        return first, jnp.moveaxis(lik, 0, -1)

    def _evaluate(
        self, rng_key, param_map, model, guide, args, kwargs
    ) -> tuple[jax.Array, TemperaturePosterior, dict | None]:
        plate_size = self._plate_size(model, args, kwargs)
        weights, by_temperature = self._weights(rng_key, param_map, model, guide, args, kwargs)
        record = self._damping_record(param_map)
        if record is None:
            value, posterior = multicanonical_elbo(
                weights, self.ladder, plate_size, log_lik_by_temperature=by_temperature
            )
            return value, posterior, weights.mutable_state, None
        # damped q(y): a running average of eq. 18's log-weights, held fixed for the gradient
        dtype = jnp.result_type(weights.log_lik.dtype, float)
        inv_t = jnp.asarray(self.ladder.inverse_temperatures, dtype)
        if by_temperature is None:
            ell = jnp.mean(weights.log_lik) * inv_t
        else:
            ell = jnp.mean(by_temperature, axis=0)
        t = record.step + 1
        rho = self.step_size(t) if callable(self.step_size) else self.step_size
        log_w = jax.lax.stop_gradient(
            damped_log_weights(record.log_weights, ell, self.ladder, rho)
        )
        zero = jnp.zeros_like(inv_t)
        probs = posterior_from_arrays(log_w, zero, inv_t, zero).probs
        value, posterior = multicanonical_elbo(
            weights, self.ladder, plate_size, probs, log_lik_by_temperature=by_temperature
        )
        return value, posterior, weights.mutable_state, log_w

    def _damping_record(self, param_map: dict) -> TemperatureRecord | None:
        """The record carrying the running log-weights, or ``None`` for eq. 18 exactly."""
        if self.step_size is None:
            return None
        names = sorted(record_names(param_map))
        if not names or param_map[names[0]].log_weights is None:
            raise ValueError(
                "a damped q(y) (`step_size`) keeps its running log-weights in a "
                "TemperatureRecord: give SVI the model wrapped with "
                "record_temperatures(model, ladder, num_steps)."
            )
        return param_map[names[0]]

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        value, posterior, state, log_w = self._evaluate(
            rng_key, param_map, model, guide, args, kwargs
        )
        return {"loss": -value, "mutable_state": update_records(state, posterior, log_w)}

    def temperature_posterior(
        self, rng_key: jax.Array, params: dict, model: Callable, guide: Callable, *args, **kwargs
    ) -> TemperaturePosterior:
        """:math:`q(y)` (eq. 18) at ``params`` (e.g. ``svi.get_params(state)``), estimated
        with this objective's particles and key ``rng_key``. With ``step_size``, ``params``
        must carry the record (e.g. ``{**params, **state.mutable_state}``), and the result
        is the next damped update from it."""
        return self._evaluate(rng_key, params, model, guide, args, kwargs)[1]

    def temperature_trajectory(
        self,
        rng_key: jax.Array,
        params_history: Sequence[dict] | dict,
        model: Callable,
        guide: Callable,
        *args: Any,
        **kwargs: Any,
    ) -> TemperaturePosterior:
        """:meth:`temperature_posterior` along saved parameters (a list of param dicts, or
        one dict of arrays with a leading step axis), with the same key at every step.
        Returns arrays with a leading step axis."""
        if not isinstance(params_history, dict):
            params_history = jax.tree.map(lambda *xs: jnp.stack(xs), *params_history)
        return jax.vmap(
            lambda p: self.temperature_posterior(rng_key, p, model, guide, *args, **kwargs)
        )(params_history)
