"""Timing shared by the benchmarks: compiled SVI update loops, timed interleaved.

Every benchmark compares objectives measured in the same process: each objective's
``num_steps`` consecutive ``svi.update`` calls are compiled once into one ``lax.scan``, then
the objectives are timed in turn within every repeat, so that machine load affects them
alike, and the median time per step is reported.
"""

from __future__ import annotations

import time

import jax
import numpy as np


def compile_steps(svi, args, num_steps: int):
    """``state -> (state, losses)``: ``num_steps`` updates in one compiled scan."""

    def run(state):
        return jax.lax.scan(lambda s, _: svi.update(s, *args), state, None, num_steps)

    return jax.jit(run)


def time_steps(run, state, num_steps: int):
    """Seconds per step of one compiled run, and the state it ends in; non-finite losses raise."""
    start = time.perf_counter()
    state, losses = jax.block_until_ready(run(state))
    if not np.all(np.isfinite(np.asarray(losses))):
        raise FloatingPointError("non-finite loss during the benchmark")
    return (time.perf_counter() - start) / num_steps, state


def interleaved(updates: dict, args, steps: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of each ``name -> (svi, state)``, timed in turn per repeat."""
    runs, states = {}, {}
    for name, (svi, state) in updates.items():
        runs[name] = compile_steps(svi, args, steps)
        _, states[name] = time_steps(runs[name], state, steps)  # compile + warm up
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            seconds, states[name] = time_steps(run, states[name], steps)
            times[name].append(seconds)
    return {name: float(np.median(t)) for name, t in times.items()}


def print_ratios(label: str, num_particles: int, result: dict[str, float], width: int) -> float:
    """One row per objective with its ratio to ``Trace_ELBO``; returns the worst ratio."""
    reference = result["Trace_ELBO"]
    worst = 0.0
    for name, seconds in result.items():
        ratio = seconds / reference
        if name != "Trace_ELBO":
            worst = max(worst, ratio)
        row = f"{label:<{width}} {num_particles:>2}  {name:<24} {1e6 * seconds:>9.1f}"
        print(f"{row} {ratio:>6.3f}")
    return worst
