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

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from numpyro.util import not_jax_tracer

Schedule = Callable[[jax.typing.ArrayLike], jax.Array]

__all__ = [
    "Schedule",
    "constant",
    "linear",
    "geometric",
    "from_ladder",
    "trajectory",
    "validate",
]

#: Steps at which :func:`validate` checks a schedule of unknown length: every step up to
#: 2^12, then every power of two up to 2^30.
PROBE_STEPS = np.concatenate([np.arange(4096), 2 ** np.arange(12, 31)]).astype(np.int32)


def check_temperature(temperature: Any, name: str = "temperature") -> None:
    """The package's one temperature check: raise if a concrete ``temperature`` (a number or
    an array) is empty, not numeric, not finite or not > 0, naming ``name``; traced values
    pass (their trouble becomes NaN downstream, see ``handlers.inverse_temperature``).

    Example:
        >>> check_temperature([1.0, 2.0])
        >>> check_temperature(0.0, "start")
        Traceback (most recent call last):
        ...
        ValueError: `start` must be finite and > 0, got 0.0.
    """
    if not not_jax_tracer(temperature):
        return
    value = np.asarray(temperature)
    if value.size == 0:
        raise ValueError(f"`{name}` is empty.")
    if not np.issubdtype(value.dtype, np.number):
        raise TypeError(f"`{name}` must be numeric, got dtype {value.dtype}.")
    if not np.all(np.isfinite(value)) or np.any(value <= 0):
        bad = value[~(np.isfinite(value) & (value > 0))] if value.ndim else value
        raise ValueError(f"`{name}` must be finite and > 0, got {bad}.")


def _check_temperature(value: float, name: str, allow_below_one: bool) -> float:
    check_temperature(value, name)
    if jnp.ndim(value) != 0:
        raise ValueError(f"`{name}` must be a scalar temperature, got shape {jnp.shape(value)} "
                         "(per-site temperatures: temper(model, T) with an array T).")
    value = float(value)
    if value < 1 and not allow_below_one:
        raise ValueError(
            f"`{name}`={value} is below 1, which sharpens the likelihood rather than "
            "tempering it; pass allow_below_one=True if that is intended."
        )
    return value


def _check_steps(num_steps: int) -> int:
    if isinstance(num_steps, bool) or int(num_steps) != num_steps or num_steps < 1:
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

    This is the schedule of the paper's experiments (Mandt et al. 2016,
    section 4: FMM "started at T = 10 and ended in T = 1"; LDA with the temperature updated
    every 1000 iterations, ``every=1000``).

    ``T(step)`` reaches ``end`` at ``step = num_steps`` (optax's convention). ``SVI.run(key,
    n)`` takes updates ``0 .. n - 1``, so with ``num_steps = n`` its last update is still
    above ``end``: anneal over fewer steps than the run (e.g. half of them, as the paper's
    FMM does) so that the fit ends at ``end``.

    Example:
        >>> sched = linear(10.0, 1.0, num_steps=100)
        >>> float(sched(0)), round(float(sched(99)), 2), float(sched(100)), float(sched(10**6))
        (10.0, 1.09, 1.0, 1.0)
    """
    start = _check_temperature(start, "start", allow_below_one)
    end = _check_temperature(end, "end", allow_below_one)
    num_steps = _check_steps(num_steps)
    sched = optax.linear_schedule(start, end, transition_steps=num_steps)
    return _snap(_staircase(sched, every), end, num_steps)  # end from num_steps on


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
    return _snap(_staircase(sched, every), end, num_steps)  # end from num_steps on


def from_ladder(
    temperatures: Sequence[float] | jax.typing.ArrayLike,
    num_steps: int,
    *,
    weights: Sequence[float] | jax.typing.ArrayLike | None = None,
    every: int = 1,
) -> Schedule:
    """Linear annealing that starts at the mean temperature of a ladder and reaches T = 1.

    The paper's annealing baseline for LDA (Mandt et al. 2016, section 4.1):
    "linear schedules that started in the mean temperature under a uniform distribution over
    T_m, and then used a linearly decreasing annealing schedule that ended in T = 1 after t_A".
    ``weights`` are the ladder's prior weights pi_m (uniform by default).
    """
    temps = np.asarray(temperatures, dtype=np.float64)
    if temps.ndim != 1 or temps.size == 0:
        raise ValueError("`temperatures` must be a non-empty 1-D sequence.")
    if not np.all(np.isfinite(temps) & (temps > 0)):
        raise ValueError(f"`temperatures` must be finite and > 0, got {temps.tolist()}.")
    if weights is None:
        weights = np.full(temps.shape, 1.0 / temps.size)
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != temps.shape or np.any(weights < 0) or not np.isclose(weights.sum(), 1):
        raise ValueError("`weights` must be non-negative, sum to 1 and match `temperatures`.")
    start = float(np.sum(weights * temps))
    if not start >= 1.0:
        raise ValueError(f"the ladder's mean temperature is {start:.4g} < 1: `temperatures` "
                         "(weighted by `weights`) must average at least 1, the schedule's end.")
    return linear(start, 1.0, num_steps, every=every)


def validate(
    schedule: Schedule, num_steps: int | None = None, *, name: str = "schedule"
) -> None:
    """Check a schedule before it is used: finite, > 0 at every step, and ending at T = 1.

    The schedule is evaluated (vectorised) at steps ``0 .. num_steps - 1`` if ``num_steps``
    is given, else at :data:`PROBE_STEPS` (every step up to 4096, then powers of two up to
    2^30). A value that is not a finite scalar > 0 raises ``ValueError`` naming the first bad
    step; a schedule whose last checked value is not 1 warns (``UserWarning``): the fit then
    ends at the *tempered* model, not the model. (At run time, a traced T that is not finite
    and > 0 makes the tempered densities NaN.)

    Example:
        >>> from numpyro_tempering import schedules
        >>> schedules.validate(schedules.linear(10.0, 1.0, num_steps=100))
        >>> try:
        ...     schedules.validate(lambda step: 5.0 - step)
        ... except ValueError as err:
        ...     print(str(err).split("; ")[1])
        at step 5 it returned 0.0.
    """
    steps = PROBE_STEPS if num_steps is None else np.arange(_check_steps(num_steps))
    try:
        values = np.asarray(jax.vmap(schedule)(jnp.asarray(steps)))
    except Exception:  # not vectorisable (Python control flow on the step): step by step
        steps = steps[:64] if num_steps is None else steps
        values = np.asarray([np.asarray(schedule(int(s))) for s in steps])
    if values.shape != steps.shape:
        raise ValueError(
            f"`{name}` must return a scalar temperature per step, got shape "
            f"{values.shape[1:]} at step 0."
        )
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        first = int(np.argmax(bad))
        raise ValueError(
            f"`{name}` must return a finite temperature > 0 at every step; at step "
            f"{int(steps[first])} it returned {values[first]}."
        )
    if values[-1] != 1.0:
        warnings.warn(
            f"`{name}` ends at T = {values[-1]:g} (step {int(steps[-1])}), not at T = 1: the "
            "fit then ends at the tempered model, not the model itself.",
            UserWarning,
            stacklevel=3,
        )


def trajectory(schedule: Schedule, num_steps: int) -> jax.Array:
    """The temperatures a schedule realises at steps ``0 .. num_steps - 1``.

    Because the annealing clock advances by exactly one per SVI update, this is the
    temperature used at every step of ``svi.run(key, num_steps, ...)``.
    """
    return jax.vmap(schedule)(jnp.arange(_check_steps(num_steps)))
