r"""The latent ladder temperature: its posterior (Mandt et al. 2016, eq. 18) and its record.

Multicanonical VI (Mandt et al. 2016, eq. 10-13) gives the temperature a latent assignment
:math:`y` over a ladder :math:`T_1 < \dots < T_M` with prior :math:`\pi`. Given the tempered
log-likelihood :math:`\ell_m` at each rung (:math:`\ell/T_m`, or
:math:`\log\sum_k p(x, z = k)^{1/T_m}` for a jointly tempered mixture) and the log
partition function :math:`\log C(T_m)`, the optimal :math:`q(y)` is eq. 18,

.. math::

    r_m \propto \exp\{\ell_m - \log C(T_m) + \log\pi_m\},

the same formula whether :math:`\ell_m` is an expectation under a variational :math:`q`
(the M-ELBO, :class:`~numpyro_tempering.objectives.MulticanonicalELBO`), the value at one
draw (the exact conditional :math:`p(y \mid x, z, \beta)` of
:class:`~numpyro_tempering.multicanonical_model.multicanonical`), or a closed-form local
expectation (the conjugate routes of :mod:`numpyro_tempering.models`). This module is the
one home of that formula: :func:`temperature_posterior`. Its log normaliser
:math:`\log\sum_m \exp\{\ell_m - \log C(T_m) + \log\pi_m\}` is the log marginal over
:math:`y` (the value of eq. 13's :math:`y`-terms at the optimum, by Gibbs' inequality).

With a per-element temperature (one :math:`y_n` per element of a plate) every quantity gets
a leading element axis and :math:`\log C` is replaced by the elements' own
:math:`\log c_n(T_m)` (:func:`element_log_partition`).

The learnt trajectory in SVI
----------------------------
Stock :class:`~numpyro.infer.SVI` carries only one piece of state between steps, the
``numpyro.mutable`` sites. :func:`record_temperatures` adds a :class:`TemperatureRecord`
there; every multicanonical objective writes a row per step into every record it finds
(whatever its name), and :func:`temperature_history` reads it back.
:func:`mean_inverse_temperature` is the one call for the current
:math:`\mathbb{E}_q[1/T]`.

Example:
    >>> import jax.numpy as jnp
    >>> from numpyro_tempering.ladder import Ladder
    >>> ladder = Ladder([1.0, 2.0]).with_log_partition_values([0.0, 1.0])
    >>> post = temperature_posterior(jnp.array([-3.0, -1.5]), ladder)  # l = -3 at T = 1, 2
    >>> # logits log(1/2) + (-3 - 0, -3/2 - 1)
    >>> [round(float(p), 4) for p in post.probs], round(float(post.log_marginal), 4)
    ([0.3775, 0.6225], -2.7191)
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.primitives import mutable

from numpyro_tempering.ladder import Ladder

__all__ = [
    "TemperatureHistory",
    "TemperaturePosterior",
    "TemperatureRecord",
    "damped_log_weights",
    "element_log_partition",
    "mean_inverse_temperature",
    "posterior_from_arrays",
    "record_temperatures",
    "robbins_monro",
    "temperature_history",
    "temperature_posterior",
    "warn_if_flagged",
]


class TemperaturePosterior(NamedTuple):
    r""":math:`q(y)` of eq. 18 and its moments.

    One temperature: ``probs`` has shape ``(M,)`` and the rest are scalars; per element:
    ``(B, M)`` and ``(B,)``.

    Attributes:
        probs: :math:`r_m`.
        mean_temperature: :math:`\mathbb{E}_r[T_y]`.
        mean_inverse_temperature: :math:`\mathbb{E}_r[1/T_y]`, the effective inverse
            temperature of the gradient (eq. 15-17).
        log_marginal: :math:`\log\sum_m\exp\{\ell_m - \log C(T_m) + \log\pi_m\}`.
    """

    probs: jax.Array
    mean_temperature: jax.Array
    mean_inverse_temperature: jax.Array
    log_marginal: jax.Array


def temperature_posterior(
    tempered_log_lik: jax.typing.ArrayLike,
    ladder: Ladder,
    *,
    log_c: jax.typing.ArrayLike | None = None,
) -> TemperaturePosterior:
    r"""Eq. 18 of Mandt et al. 2016: :math:`r_m \propto \exp\{\ell_m - \log C(T_m) + \log\pi_m\}`.

    Args:
        tempered_log_lik: :math:`\ell_m`, the tempered log-likelihood at every rung, shape
            ``(..., M)`` (e.g. ``ell[..., None] / ladder.temperatures``; for a jointly
            tempered mixture the joint value per rung). Held as given: wrap it in
            ``jax.lax.stop_gradient`` if the posterior must not carry gradients.
        ladder: the :class:`~numpyro_tempering.ladder.Ladder` (temperatures, prior
            :math:`\pi` and, unless ``log_c`` is given, its ``log_c``).
        log_c: :math:`\log C(T_m)` to use instead of the ladder's, broadcastable to
            ``tempered_log_lik`` (e.g. per-element ``(B, M)`` from
            :func:`element_log_partition`).

    Returns:
        :class:`TemperaturePosterior`. Non-finite :math:`\ell` gives NaN probabilities
        (never a silently chosen rung).

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro_tempering.ladder import Ladder
        >>> lad = Ladder([1.0, 4.0]).with_log_partition_values([0.0, 0.0])
        >>> post = temperature_posterior(jnp.array([[-8.0, -2.0], [0.0, 0.0]]), lad)
        >>> post.probs.shape, [round(float(t), 3) for t in post.mean_temperature]
        ((2, 2), [3.993, 2.5])
    """
    ell = jnp.asarray(tempered_log_lik)
    dtype = jnp.result_type(ell.dtype, float)
    inv_t = jnp.asarray(ladder.inverse_temperatures, dtype)
    if ell.shape[-1:] != inv_t.shape:
        raise ValueError(
            f"`tempered_log_lik` must end in the ladder's {inv_t.shape[0]} temperatures, got "
            f"shape {ell.shape}."
        )
    if log_c is None:
        ladder.require_log_partition()
        log_c = ladder.log_c
    log_pi = jnp.log(jnp.asarray(ladder.weights, dtype))  # -inf where a weight is 0
    return posterior_from_arrays(ell.astype(dtype), log_pi, inv_t, jnp.asarray(log_c, dtype))


def posterior_from_arrays(
    tempered_log_lik: jax.Array,
    log_prior: jax.Array,
    inverse_temperatures: jax.Array,
    log_c: jax.Array,
) -> TemperaturePosterior:
    r"""Eq. 18 on plain arrays (``(..., M)``, broadcasting; ``inverse_temperatures`` is
    the ladder's ``(M,)``): what
    :func:`temperature_posterior` computes for a :class:`~numpyro_tempering.ladder.Ladder`,
    for code that carries the ladder as arrays inside ``jit`` (e.g. the conjugate LDA
    route's per-document sweep).

    One pass of exponentials: with :math:`a_m` the logits and :math:`a^* = \max_m a_m`
    (0 if not finite, as ``logsumexp`` does), :math:`e_m = \exp(a_m - a^*)`, and the
    normaliser and both moments are one product :math:`e\,[1, T, 1/T]`:
    :math:`r = e / \sum_m e_m`, :math:`\log\sum_m e^{a_m} = a^* + \log\sum_m e_m`. The same
    numbers as ``logsumexp`` followed by ``exp(a - logsumexp(a))`` up to rounding, with one
    exponential per entry instead of two (what a ``(N, M)`` per-element array costs in the
    multicanonical local step: ``benchmarks/multicanonical.py``).

    Example:
        >>> import jax.numpy as jnp
        >>> post = posterior_from_arrays(jnp.array([-3.0, -1.5]), jnp.log(jnp.array([0.5, 0.5])),
        ...                              jnp.array([1.0, 0.5]), jnp.array([0.0, 1.0]))
        >>> [round(float(p), 4) for p in post.probs], round(float(post.log_marginal), 4)
        ([0.3775, 0.6225], -2.7191)
    """
    inv_t = jnp.asarray(inverse_temperatures)
    if inv_t.ndim != 1:
        raise ValueError(
            f"`inverse_temperatures` must be the ladder's (M,), got shape {inv_t.shape}."
        )
    logits = log_prior + tempered_log_lik - log_c
    shift = jnp.max(logits, axis=-1, keepdims=True)
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(shift), shift, 0.0))
    e = jnp.exp(logits - shift)
    # one product for the three sums (no second pass over e)
    columns = jnp.stack([jnp.ones_like(inv_t), 1.0 / inv_t, inv_t], axis=-1).astype(e.dtype)
    sums = jnp.matmul(e, columns, precision=jax.lax.Precision.HIGHEST)
    total, sum_t, sum_inv_t = sums[..., 0], sums[..., 1], sums[..., 2]
    return TemperaturePosterior(
        e / total[..., None],
        sum_t / total,
        sum_inv_t / total,
        shift[..., 0] + jnp.log(total),
    )


def robbins_monro(tau: float = 1024.0, kappa: float = 0.7) -> Callable[[Any], jax.Array]:
    r"""The step-size schedule :math:`\rho_t = (\tau + t)^{-\kappa}`, :math:`t = 1, 2, \dots`

    The paper's schedule for its stochastic updates (Mandt et al. 2016, section 4.1:
    :math:`\tau = 1024`, :math:`\kappa = 0.7`); a damped :math:`q(y)`
    (:func:`damped_log_weights`) uses it as ``step_size``.

    Example:
        >>> rho = robbins_monro(tau=1.0, kappa=1.0)
        >>> [round(float(rho(t)), 4) for t in (1, 3)]
        [0.5, 0.25]
    """
    if not (tau >= 0.0 and 0.5 < kappa <= 1.0):
        raise ValueError(
            f"Robbins-Monro needs tau >= 0 and 0.5 < kappa <= 1, got tau={tau}, kappa={kappa}."
        )

    def schedule(t: Any) -> jax.Array:
        return (tau + jnp.asarray(t, jnp.result_type(float))) ** (-kappa)

    return schedule


def damped_log_weights(
    previous: jax.typing.ArrayLike,
    tempered_log_lik: jax.typing.ArrayLike,
    ladder: Ladder,
    step_size: jax.typing.ArrayLike,
    *,
    log_c: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""One damped update of :math:`q(y)`'s log-weights: a running average of eq. 18's.

    With :math:`a^*_m = \ell_m - \log C(T_m) + \log\pi_m` the log-weights of eq. 18 of
    Mandt et al. 2016 at the current fit,

    .. math::

        a_t = (1 - \rho_t)\, a_{t-1} + \rho_t\, a^*_t, \qquad q_t(y = m) \propto e^{a_{t,m}},

    started at :math:`a_0 = \log\pi` (the paper's uniform initial :math:`q(y)`). Since
    :math:`\log C` and :math:`\log\pi` are fixed, :math:`a_t = \log\pi + \sum_s w_s
    (\ell_{s,m} - \log C_m)` with weights :math:`w_s` summing to :math:`1 - \prod_s
    (1 - \rho_s)`: eq. 18 at a running average of the expected log-likelihood. ``step_size``
    :math:`\rho_t = 1` gives eq. 18 exactly; rungs with :math:`\pi_m = 0` stay at
    :math:`-\infty`. The probabilities are ``posterior_from_arrays(a_t, 0, 1/T, 0).probs``.

    Args:
        previous: :math:`a_{t-1}`, shape ``(M,)``.
        tempered_log_lik: :math:`\ell_m` at every rung, ``(M,)`` (as for
            :func:`temperature_posterior`).
        ladder: the ladder (prior and, unless ``log_c`` is given, :math:`\log C`).
        step_size: :math:`\rho_t \in [0, 1]`; 0 holds ``previous`` as it is, whatever
            :math:`\ell_m` (a schedule that updates :math:`q(y)` only every n steps, as
            the paper does, is 1 at those steps and 0 between).
        log_c: :math:`\log C(T_m)` to use instead of the ladder's.

    Example:
        >>> import jax.numpy as jnp
        >>> from numpyro_tempering.ladder import Ladder
        >>> lad = Ladder([1.0, 2.0]).with_log_partition_values([0.0, 1.0])
        >>> prior = jnp.log(jnp.array([0.5, 0.5]))
        >>> # eq. 18's log-weights log(1/2) + (-3 - 0, -1.5 - 1), averaged with rho = 0.25
        >>> a = damped_log_weights(prior, jnp.array([-3.0, -1.5]), lad, 0.25)
        >>> [round(float(v), 4) for v in a]
        [-1.4431, -1.3181]
    """
    ell = jnp.asarray(tempered_log_lik)
    dtype = jnp.result_type(ell.dtype, float)
    if log_c is None:
        ladder.require_log_partition()
        log_c = ladder.log_c
    log_pi = jnp.log(jnp.asarray(ladder.weights, dtype))
    target = log_pi + ell.astype(dtype) - jnp.asarray(log_c, dtype)
    prev = jnp.asarray(previous, dtype)
    if prev.shape != target.shape:
        raise ValueError(
            f"`previous` log-weights of shape {prev.shape} do not match the ladder's "
            f"{target.shape}."
        )
    rho = jnp.asarray(step_size, dtype)
    # 0 * (-inf) is NaN: rungs without prior mass stay at -inf
    average = (1.0 - rho) * jnp.where(jnp.isfinite(prev), prev, 0.0) + rho * target
    average = jnp.where(rho == 0, prev, average)  # held: whatever the fit's l_m
    return jnp.where(jnp.isfinite(log_pi), average, -jnp.inf)


def element_log_partition(
    ladder: Ladder, plate_size: int, indices: jax.Array | None, dtype: Any
) -> jax.Array:
    r"""The (mini)batch's per-element :math:`\log c_n(T_m)`, shape ``(B, M)``.

    ``indices``: the plate's subsample indices (``LogWeights.plate_indices``), or ``None``
    for the full plate of ``plate_size`` elements.
    """
    table = ladder.element_log_c
    if table is None:
        ladder.require_element_log_partition(ladder.plate or "<plate>")
    if table.shape[1] != plate_size:
        raise ValueError(
            f"the ladder's element_log_c has {table.shape[1]} elements but plate "
            f"'{ladder.plate}' has {plate_size}."
        )
    table = jnp.asarray(table, dtype).T  # (N, M)
    return table if indices is None else table[jnp.asarray(indices)]


def warn_if_flagged(ladder: Ladder, who: str) -> None:
    """Warn if the ladder's log C is flagged as untrusted at some temperatures."""
    flagged = ladder.flagged
    if flagged.any():
        temps = [round(float(t), 4) for t in ladder.temperatures[flagged]]
        warnings.warn(
            f"{who}: the ladder's log C(T) is flagged as untrusted at T = {temps[:8]}"
            f"{' ...' if len(temps) > 8 else ''} (see ladder.summary()): the multicanonical "
            "weights exp(l/T - log C(T)) inherit its error, e^d for d nats.",
            UserWarning,
            stacklevel=3,
        )


# ---------------------------------------------------------------------------------------
# The trajectory in SVI's mutable state
# ---------------------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class TemperatureRecord:
    r"""A fixed-size history of :math:`q(y)` per SVI step, kept in a ``numpyro.mutable`` site.

    Rows ``0 .. step - 1`` are filled (rows beyond the size are dropped); a per-element
    temperature records the minibatch averages. Printed, it is one line (the arrays are in
    its attributes).

    Attributes:
        step: steps recorded so far.
        probs: ``(num_steps, M)`` :math:`q(y)`.
        mean_temperature: ``(num_steps,)`` :math:`\mathbb{E}_q[T]`.
        mean_inverse_temperature: ``(num_steps,)`` :math:`\mathbb{E}_q[1/T]`.
        log_weights: ``(M,)`` the running log-weights :math:`a_t` of a damped :math:`q(y)`
            (:func:`damped_log_weights`; :math:`\log\pi` before the first step), or
            ``None`` for a record made without a ladder prior.
    """

    def __init__(
        self,
        step: Any,
        probs: Any,
        mean_temperature: Any,
        mean_inverse_temperature: Any,
        log_weights: Any = None,
    ) -> None:
        self.step = step
        self.probs = probs
        self.mean_temperature = mean_temperature
        self.mean_inverse_temperature = mean_inverse_temperature
        self.log_weights = log_weights

    @classmethod
    def empty(
        cls,
        num_steps: int,
        num_temperatures: int,
        dtype: Any,
        log_prior: Any = None,
    ) -> TemperatureRecord:
        r"""An empty record; ``log_prior`` (``(M,)``, :math:`\log\pi`) starts the running
        log-weights of a damped :math:`q(y)` (the paper's uniform initialisation)."""
        nan = functools.partial(jnp.full, fill_value=jnp.nan, dtype=dtype)
        return cls(
            jnp.zeros((), jnp.int32),
            nan((num_steps, num_temperatures)),
            nan((num_steps,)),
            nan((num_steps,)),
            None if log_prior is None else jnp.asarray(log_prior, dtype),
        )

    def tree_flatten(self) -> tuple[tuple, None]:
        return (
            self.step,
            self.probs,
            self.mean_temperature,
            self.mean_inverse_temperature,
            self.log_weights,
        ), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple) -> TemperatureRecord:
        return cls(*children)

    def append(
        self, posterior: TemperaturePosterior, log_weights: Any = None
    ) -> TemperatureRecord:
        """The record with ``posterior`` written at row ``step`` (minibatch-averaged), and
        ``log_weights`` (if given) as the new running log-weights of a damped :math:`q(y)`."""
        probs = posterior.probs
        mean_t, mean_inv_t = posterior.mean_temperature, posterior.mean_inverse_temperature
        if probs.ndim > 1:  # per-element temperature: minibatch average
            probs, mean_t, mean_inv_t = probs.mean(0), mean_t.mean(), mean_inv_t.mean()

        def put(rows: jax.Array, value: jax.Array) -> jax.Array:
            return rows.at[self.step].set(value.astype(rows.dtype), mode="drop")

        return TemperatureRecord(
            self.step + 1,
            put(self.probs, probs),
            put(self.mean_temperature, mean_t),
            put(self.mean_inverse_temperature, mean_inv_t),
            self.log_weights if log_weights is None else log_weights,
        )

    def __repr__(self) -> str:
        try:
            step, size = int(self.step), int(self.probs.shape[0])
            last = min(step, size) - 1
            at = f" (at step {last + 1}: the record is full)" if step > size else ""
            now = (
                f", E[T] = {float(self.mean_temperature[last]):.4g}"
                f", E[1/T] = {float(self.mean_inverse_temperature[last]):.4g}{at}"
                if last >= 0
                else ""
            )
            return (
                f"TemperatureRecord(step={step}, rows={size}, "
                f"temperatures={int(self.probs.shape[-1])}{now})"
            )
        except (TypeError, jax.errors.ConcretizationTypeError):  # traced
            return f"TemperatureRecord(<traced>, probs={getattr(self.probs, 'shape', None)})"


def record_temperatures(
    model: Callable, ladder: Ladder, num_steps: int, *, name: str = "_temperature_record"
) -> Callable:
    """Wrap ``model`` so that SVI with a multicanonical objective records q(y) per step.

    The wrapper adds a ``numpyro.mutable`` site ``name`` holding a :class:`TemperatureRecord`
    of ``num_steps`` rows; :class:`~numpyro_tempering.objectives.MulticanonicalELBO` writes
    row ``step`` at every update, in every record it finds (so ``name`` is free). Give the
    *wrapped* model to SVI and the plain one to the guide. Read the record with
    :func:`temperature_history` or :func:`mean_inverse_temperature`. Other objectives leave
    it untouched.
    """
    if isinstance(num_steps, bool) or int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"`num_steps` must be a positive integer, got {num_steps!r}.")
    if not isinstance(name, str) or not name:
        raise TypeError(f"`name` must be a non-empty string, got {name!r}.")
    m = ladder.num_temperatures
    dtype = jnp.result_type(float)
    log_prior = np.log(np.asarray(ladder.weights, float))  # -inf where a weight is 0

    @functools.wraps(model, updated=())
    def recorded(*args, **kwargs):
        mutable(name, TemperatureRecord.empty(int(num_steps), m, dtype, log_prior))
        return model(*args, **kwargs)

    return recorded


def record_names(state: dict | None) -> tuple[str, ...]:
    """Names of the :class:`TemperatureRecord` sites in a mutable-state (or param) dict: the
    same for every particle (the objective appends to them once per step), so the engine
    keeps them whatever the number of particles."""
    if not isinstance(state, dict):
        return ()
    return tuple(k for k, v in state.items() if isinstance(v, TemperatureRecord))


def update_records(
    state: dict | None, posterior: TemperaturePosterior, log_weights: Any = None
) -> dict | None:
    """Append ``posterior`` (and the new running ``log_weights`` of a damped :math:`q(y)`,
    if given) to every :class:`TemperatureRecord` in a mutable-state dict."""
    if not state:
        return state
    return {
        k: v.append(posterior, log_weights) if isinstance(v, TemperatureRecord) else v
        for k, v in state.items()
    }


class TemperatureHistory(NamedTuple):
    r"""Per step: :math:`q(y)` ``(steps, M)``, :math:`\mathbb{E}_q[T]` and
    :math:`\mathbb{E}_q[1/T]` ``(steps,)``."""

    probs: jax.Array
    mean_temperature: jax.Array
    mean_inverse_temperature: jax.Array


def _find_record(result: Any, name: str | None) -> TemperatureRecord:
    state = getattr(result, "state", result)
    state = getattr(state, "mutable_state", state)
    records = (
        {k: v for k, v in state.items() if isinstance(v, TemperatureRecord)}
        if isinstance(state, dict)
        else {}
    )
    if name is not None:
        if name not in records:
            raise ValueError(
                f"no TemperatureRecord '{name}' in the SVI state (records: {sorted(records)}): "
                "wrap the model given to SVI with record_temperatures(model, ladder, num_steps)."
            )
        return records[name]
    if len(records) != 1:
        raise ValueError(
            f"expected one TemperatureRecord in the SVI state, found {sorted(records)}: wrap "
            "the model given to SVI with record_temperatures(model, ladder, num_steps), and "
            "pass `name=` if there are several."
        )
    return next(iter(records.values()))


def _stale_message(steps: int, rows: int) -> str:
    return (
        f"the TemperatureRecord holds q(y) for the first {rows} of the {steps} SVI steps "
        f"(record_temperatures(..., num_steps={rows})): its last row is step {rows}'s, not "
        "the final one. Record with num_steps >= the number of SVI steps."
    )


def temperature_history(result: Any, *, name: str | None = None) -> TemperatureHistory:
    """The recorded trajectory from an ``SVIRunResult``, ``SVIState`` or mutable-state dict,
    trimmed to the steps taken; the last row is the final :math:`q(y)`. ``name``: which
    record, if the state holds several. A record shorter than the run (SVI took more steps
    than ``record_temperatures(..., num_steps)``) holds the first ``num_steps`` only: a
    warning says so (its last row is then not the final :math:`q(y)`)."""
    rec = _find_record(result, name)
    n = min(int(rec.step), rec.probs.shape[0])
    if int(rec.step) > n:
        warnings.warn(_stale_message(int(rec.step), n), UserWarning, stacklevel=2)
    return TemperatureHistory(
        rec.probs[:n], rec.mean_temperature[:n], rec.mean_inverse_temperature[:n]
    )


def mean_inverse_temperature(result: Any, *, name: str | None = None) -> float:
    r"""The current :math:`\mathbb{E}_q[1/T]` (the last recorded step) of an SVI run.

    NaN if no step was recorded yet; a ``ValueError`` if SVI ran more steps than the record
    holds (the last row is then an earlier step's, not the current value).
    """
    rec = _find_record(result, name)
    if int(rec.step) > rec.probs.shape[0]:
        raise ValueError(_stale_message(int(rec.step), rec.probs.shape[0]))
    hist = temperature_history(result, name=name)
    values = np.asarray(hist.mean_inverse_temperature)
    return float(values[-1]) if values.size else float("nan")
