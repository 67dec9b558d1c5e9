"""Annealing schedules: callables ``step -> T``.

A schedule maps the SVI step counter (an integer, possibly traced under ``jax.jit``) to a
temperature. Any callable with that signature is accepted wherever a schedule is; the
constructors here cover the forms used in the papers and are thin wrappers over
`optax schedules <https://optax.readthedocs.io/en/latest/api/optimizer_schedules.html>`_,
which already do the clipping and interpolation.

Temperatures below 1 sharpen the likelihood instead of flattening it ("over-fitting" the
data). They are never produced by default: every constructor raises unless the caller passes
``allow_below_one=True``.

Example:
    >>> from numpyro_tempering import schedules
    >>> sched = schedules.linear(10.0, 1.0, num_steps=100)
    >>> float(sched(0)), float(sched(50)), float(sched(500))
    (10.0, 5.5, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

Schedule = Callable[[jax.typing.ArrayLike], jax.Array]

__all__ = ["Schedule", "constant", "linear", "geometric", "from_ladder", "trajectory"]


def _check_temperature(value: float, name: str, allow_below_one: bool) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a finite temperature > 0, got {value}.")
    if value < 1 and not allow_below_one:
        raise ValueError(
            f"`{name}`={value} is below 1, which sharpens the likelihood rather than "
            "tempering it; pass allow_below_one=True if that is intended."
        )
    return value


def _check_steps(num_steps: int) -> int:
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"`num_steps` must be a positive integer, got {num_steps!r}.")
    return int(num_steps)


def _snap(schedule: Schedule, end: float, num_steps: int) -> Schedule:
    """Return exactly ``end`` once the transition is over.

    Under ``jax.jit`` XLA may turn ``count / steps`` into a multiplication by the reciprocal,
    which leaves optax's schedules a few ulps away from ``end`` (1.0000002 instead of 1).
    T = 1 must be exact: it is where the tempered objective equals the original one.
    """
    return lambda step: jnp.where(jnp.asarray(step) >= num_steps, end, schedule(step))


def _staircase(schedule: Schedule, every: int) -> Schedule:
    """Hold the temperature for ``every`` steps (the paper updates T every 1000 iterations)."""
    if every == 1:
        return schedule
    if int(every) != every or every < 1:
        raise ValueError(f"`every` must be a positive integer, got {every!r}.")
    return lambda step: schedule((jnp.asarray(step) // every) * every)


def constant(temperature: float, *, allow_below_one: bool = False) -> Schedule:
    """T(step) = ``temperature`` for every step."""
    temperature = _check_temperature(temperature, "temperature", allow_below_one)
    return optax.constant_schedule(temperature)


def linear(
    start: float,
    end: float = 1.0,
    num_steps: int = 1000,
    *,
    every: int = 1,
    allow_below_one: bool = False,
) -> Schedule:
    """Linear annealing from ``start`` to ``end`` over ``num_steps`` steps, then constant.

    This is the schedule of the paper's experiments (annealed-and-multicanonical-vi,
    section 4: FMM "started at T = 10 and ended in T = 1"; LDA with the temperature updated
    every 1000 iterations, ``every=1000``).
    """
    start = _check_temperature(start, "start", allow_below_one)
    end = _check_temperature(end, "end", allow_below_one)
    num_steps = _check_steps(num_steps)
    sched = optax.linear_schedule(start, end, transition_steps=num_steps)
    return _staircase(_snap(sched, end, num_steps), every)


def geometric(
    start: float,
    end: float = 1.0,
    num_steps: int = 1000,
    *,
    every: int = 1,
    allow_below_one: bool = False,
) -> Schedule:
    """Exponential (geometric) annealing: T(t) = start * (end/start)^(t/num_steps), clipped.

    Equal ratios per step, so the schedule spends as long between T = 10 and 5 as between
    2 and 1.
    """
    start = _check_temperature(start, "start", allow_below_one)
    end = _check_temperature(end, "end", allow_below_one)
    num_steps = _check_steps(num_steps)
    if start == end:
        return _staircase(optax.constant_schedule(start), every)
    sched = optax.exponential_decay(
        init_value=start,
        transition_steps=num_steps,
        decay_rate=end / start,
        end_value=end,
    )
    return _staircase(_snap(sched, end, num_steps), every)


def from_ladder(
    temperatures: Sequence[float] | jax.typing.ArrayLike,
    num_steps: int,
    *,
    weights: Sequence[float] | jax.typing.ArrayLike | None = None,
    every: int = 1,
) -> Schedule:
    """Linear annealing that starts at the mean temperature of a ladder and reaches T = 1.

    The paper's annealing baseline for LDA (annealed-and-multicanonical-vi, section 4.1):
    "linear schedules that started in the mean temperature under a uniform distribution over
    T_m, and then used a linearly decreasing annealing schedule that ended in T = 1 after t_A".
    ``weights`` are the ladder's prior weights pi_m (uniform by default).
    """
    temps = np.asarray(temperatures, dtype=np.float64)
    if temps.ndim != 1 or temps.size == 0:
        raise ValueError("`temperatures` must be a non-empty 1-D sequence.")
    if weights is None:
        weights = np.full(temps.shape, 1.0 / temps.size)
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != temps.shape or np.any(weights < 0) or not np.isclose(weights.sum(), 1):
        raise ValueError("`weights` must be non-negative, sum to 1 and match `temperatures`.")
    start = float(np.sum(weights * temps))
    return linear(start, 1.0, num_steps, every=every)


def trajectory(schedule: Schedule, num_steps: int) -> jax.Array:
    """The temperatures a schedule realises at steps ``0 .. num_steps - 1``.

    Because the annealing clock advances by exactly one per SVI update, this is the
    temperature used at every step of ``svi.run(key, num_steps, ...)``.
    """
    return jax.vmap(schedule)(jnp.arange(_check_steps(num_steps)))
