"""Timing shared by the benchmarks: compiled SVI update loops, timed interleaved.

Every benchmark compares objectives measured in the same process: each objective's
``num_steps`` consecutive ``svi.update`` calls are compiled once into one ``lax.scan``, then
the objectives are timed in turn within every repeat, so that machine load affects them
alike, and the median time per step is reported; a ratio between two objectives is the
median of their per-repeat ratios (paired within a repeat), with half its interquartile
range as its noise.
"""

from __future__ import annotations

import time

import jax
import numpy as np


def compile_steps(svi, args, num_steps: int, data_as_arguments: bool = False):
    """``state -> (state, losses)``: ``num_steps`` updates in one compiled scan, the data
    ``args`` captured as constants of the program, as ``SVI.run`` captures them (or, with
    ``data_as_arguments``, passed to it as arguments, as a hand-written jitted loop would)."""

    def run(state, *data):
        return jax.lax.scan(lambda s, _: svi.update(s, *data), state, None, num_steps)

    if data_as_arguments:
        compiled = jax.jit(run)
        return lambda state: compiled(state, *args)
    return jax.jit(lambda state: run(state, *args))


def time_steps(run, state, num_steps: int):
    """Seconds per step of one compiled run, and the state it ends in; non-finite losses raise."""
    start = time.perf_counter()
    state, losses = jax.block_until_ready(run(state))
    if not np.all(np.isfinite(np.asarray(losses))):
        raise FloatingPointError("non-finite loss during the benchmark")
    return (time.perf_counter() - start) / num_steps, state


def interleaved_times(updates: dict, args, steps: int, repeats: int,
                      data_as_arguments: bool = False) -> dict[str, np.ndarray]:
    """Seconds per step of each ``name -> (svi, state)`` in every repeat, timed in turn per
    repeat (the order rotates from one repeat to the next, so that no objective always runs
    first or last); ``data_as_arguments``: see :func:`compile_steps`."""
    runs, states = {}, {}
    for name, (svi, state) in updates.items():
        runs[name] = compile_steps(svi, args, steps, data_as_arguments)
        _, states[name] = time_steps(runs[name], state, steps)  # compile + warm up
    names = list(runs)
    times = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, states[name] = time_steps(runs[name], states[name], steps)
            times[name].append(seconds)
    return {name: np.asarray(t) for name, t in times.items()}


def interleaved(updates: dict, args, steps: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of each ``name -> (svi, state)``, timed in turn per repeat."""
    times = interleaved_times(updates, args, steps, repeats)
    return {name: float(np.median(t)) for name, t in times.items()}


def paired_ratio(times: dict[str, np.ndarray], name: str, reference: str) -> tuple[float, float]:
    """Median over repeats of ``name``'s time over ``reference``'s in the same repeat, and
    half the interquartile range of those ratios (their run-to-run noise)."""
    ratios = times[name] / times[reference]
    low, mid, high = np.percentile(ratios, [25, 50, 75])
    return float(mid), float((high - low) / 2)


def print_ratios(
    label: str,
    num_particles: int,
    result: dict[str, float] | dict[str, np.ndarray],
    width: int,
    reference: str = "Trace_ELBO",
) -> float:
    """One row per objective with its ratio to ``reference``; returns the worst ratio (over
    the objectives other than ``reference``).

    ``result``: median seconds per step (:func:`interleaved`), or the per-repeat times
    (:func:`interleaved_times`), for which the ratio is :func:`paired_ratio` and its noise
    (half the interquartile range over repeats) is printed after it.
    """
    worst = 0.0
    for name, seconds in result.items():
        if np.ndim(seconds):
            value, noise = paired_ratio(result, name, reference)
            seconds, spread = float(np.median(seconds)), f" ±{noise:.3f}"
        else:
            value, spread = seconds / result[reference], ""
        if name != reference:
            worst = max(worst, value)
        row = f"{label:<{width}} {num_particles:>2}  {name:<24} {1e6 * seconds:>9.1f}"
        print(f"{row} {value:>6.3f}{spread}")
    return worst
