"""Overhead of MulticanonicalELBO over annealing and Trace_ELBO: time per jitted ``svi.update``.

Same model, guide, optimiser and number of particles; the multicanonical objective uses the
paper's ladder of 100 temperatures (1..10, geometric) with a precomputed log C, with one
global temperature and with one temperature per element of the data plate (local, with the
elements' own log c_n). Models:

* **FMM** (N = 1000, K = 8, D = 16): the model that ``examples/fmm_multicanonical.py`` fits
  with MVI -- the jointly tempered factorial mixture with the local step done analytically
  (factor ``x_z`` = expected complete-data log-likelihood under q(z_n) over the 2^8
  configurations, tempered; factor ``z_entropy`` untempered); log C in closed form
  (``fmm.log_partition``), a sum of N identical per-point terms, so log c_n = log C / N;
* **regression** (N = 2000): the hierarchical linear regression of ``benchmarks/overhead.py``;
  log C and the per-element log c_n from the prior Monte Carlo estimator
  (``method="prior", plate="data"``, computed once, not timed; only their shape matters for
  the step time).

Objectives: ``Trace_ELBO`` (the ratio column is time / Trace_ELBO time); ``annealed
(schedule)``, i.e. ``TemperedELBO()`` on ``temper(model, schedules.linear(10, 1, 10_000))``
with the same tempered sites (the reference of issue 9, item 10); ``M-ELBO global``;
``M-ELBO global + record`` (also stores q(y) and E[T] for every step with
``record_temperatures``, as the example does); ``M-ELBO local (data)``. For each objective,
``--steps`` consecutive updates are compiled once into one ``jax.lax.scan`` and warmed up;
each repeat runs it and blocks on the result; objectives are interleaved within a repeat so
that machine load affects them alike; the time is the median over ``--repeats``, in
microseconds per step (the ratio column: median over repeats of the paired per-repeat
ratio, ± half its interquartile range). After the table: M-ELBO local / annealed (targets:
<= 1.05 on the FMM, <= 1.5 on the regression) and M-ELBO global / annealed per problem and
particle count; the last line is the worst local ratio relative to its target.

Run: ``python benchmarks/multicanonical.py`` (a few minutes on 2 CPU cores);
``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import optax
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from timing import interleaved_times, paired_ratio, print_ratios

from numpyro_tempering import Ladder, MulticanonicalELBO, TemperedELBO, schedules, temper
from numpyro_tempering.models import fmm
from numpyro_tempering.models.regression import hierarchical_regression, regression_data
from numpyro_tempering.objectives.multicanonical import record_temperatures
from numpyro_tempering.partition_function import model_sizes

ANNEALED = "annealed (schedule)"
GLOBAL = "M-ELBO global"
LOCAL = "M-ELBO local (data)"


#: target of (M-ELBO local step time) / (annealed step time), per problem (issue 9, item 10)
LOCAL_TARGETS = {"FMM": 1.05, "regression": 1.5}


def problems(key, num_temperatures):
    """(label, model, args, ladder, tempering options, local target) per problem."""
    ladder = Ladder.geometric(1.0, 10.0, num_temperatures)
    data = fmm.make_toy_data(key, 1000)
    x = data.x
    num_data = x.shape[0]
    fmm_args = (x, 0.5)
    log_c = np.asarray(fmm.log_partition(jnp.asarray(ladder.temperatures), *x.shape, 0.3, 0.1))
    # fmm.log_partition is num_data times one per-point term (C(T) = prod_n c(T), the same
    # c(T) for every point, independent of mu): each element's own log c_n(T) is log C / N
    fmm_ladder = ladder.with_log_partition_values(
        log_c,
        sizes=model_sizes(fmm.multicanonical_model, *fmm_args, exclude="z_entropy"),
        element_log_c=np.repeat(log_c[:, None] / num_data, num_data, axis=1),
        plate="data",
    )
    reg_args = regression_data(key)
    # the step time does not depend on how log C was estimated: the quick prior Monte Carlo
    # (the default tempered SMC costs minutes on a 100-rung ladder at N = 2000), with the
    # per-element log c_n of the data plate for the local temperature
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg_ladder = ladder.with_log_partition(
            hierarchical_regression,
            key,
            *reg_args,
            num_samples=100,
            method="prior",
            plate="data",
        )
    return [
        (
            "FMM (N=1000, K=8, D=16)",
            fmm.multicanonical_model,
            fmm_args,
            fmm_ladder,
            {"exclude": "z_entropy"},
            LOCAL_TARGETS["FMM"],
        ),
        (
            "regression (N=2000)",
            hierarchical_regression,
            reg_args,
            reg_ladder,
            {},
            LOCAL_TARGETS["regression"],
        ),
    ]


FLOOR = "floor: (B, M) log-sum-exp"


class FloorStep:
    """The floor of an exact per-element q(y_n): one (B, M) pass of exponentials.

    Stands in for an SVI object in :func:`timing.interleaved_times` (``update(state) ->
    (state, value)``): one log-sum-exp over the M rungs of a (B, M) array of log-weights and
    one weighted sum (E[1/T] per element), of the model's dtype. The state (a scalar added
    to the array) changes every step, so the compiled scan cannot hoist the pass out of its
    loop.
    """

    def __init__(self, num_elements: int, ladder, dtype) -> None:
        inv_t = np.asarray(ladder.inverse_temperatures)
        self.table = jnp.asarray(
            np.linspace(-1.0, 1.0, num_elements)[:, None] * inv_t[None, :], dtype
        )
        self.inv_t = jnp.asarray(inv_t, dtype)

    def update(self, shift: jax.Array, *args) -> tuple[jax.Array, jax.Array]:
        logits = self.table + shift
        peak = jnp.max(logits, axis=-1, keepdims=True)
        e = jnp.exp(logits - peak)
        total = jnp.sum(e, axis=-1)
        value = jnp.sum(peak[:, 0] + jnp.log(total)) + jnp.sum(e @ self.inv_t / total)
        return 1e-3 * jnp.tanh(value), value


def make_updates(model, args, ladder, options, num_particles, num_steps, key):
    """One (svi, state) per objective, all on the same model, guide and optimiser."""
    # the regression's quick prior Monte Carlo log C is flagged as untrusted: expected, and
    # irrelevant to the step time
    warnings.filterwarnings("ignore", "MulticanonicalELBO: the ladder's log C", UserWarning)
    guide = AutoNormal(model)
    optim = optax.adam(1e-3)
    configs: dict[str, tuple[Callable, object]] = {
        "Trace_ELBO": (model, Trace_ELBO(num_particles=num_particles)),
        ANNEALED: (
            temper(model, schedules.linear(10.0, 1.0, 10_000), **options),
            TemperedELBO(num_particles=num_particles),
        ),
        GLOBAL: (model, MulticanonicalELBO(ladder, num_particles=num_particles, **options)),
        "M-ELBO global + record": (
            record_temperatures(model, ladder, num_steps),
            MulticanonicalELBO(ladder, num_particles=num_particles, **options),
        ),
        LOCAL: (
            model,
            MulticanonicalELBO(ladder, plate="data", num_particles=num_particles, **options),
        ),
    }
    out = {}
    for name, (m, loss) in configs.items():
        svi = SVI(m, guide, optim, loss)
        out[name] = (svi, svi.init(key, *args))
    num_elements = model_sizes(model, *args, **options).plate_size("data")
    dtype = jnp.result_type(float)
    out[FLOOR] = (FloorStep(num_elements, ladder, dtype), jnp.zeros((), dtype))
    return out


def benchmark(model, args, ladder, options, num_particles, steps, repeats, key):
    updates = make_updates(model, args, ladder, options, num_particles, steps * (repeats + 1), key)
    return interleaved_times(updates, args, steps, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="updates per repeat")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--particles", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ladder", type=int, default=100, help="number of temperatures")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 steps, 3 repeats")
    parser.add_argument("--problems", default="FMM,regression",
                        help="which problems (comma-separated label prefixes)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats, args.particles = 20, 3, [1]

    key = jax.random.PRNGKey(0)
    print(
        f"jax {jax.__version__}, numpyro {numpyro.__version__}, backend "
        f"{jax.default_backend()}, load average {os.getloadavg()[0]:.1f}; M = {args.ladder} "
        f"temperatures; median of {args.repeats} x {args.steps} steps"
    )
    header = f"{'model':<24} {'S':>2}  {'objective':<24} {'us/step':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    summary = []  # (label, S, local / annealed, its noise, global / annealed, its noise, target)
    # (label, S, floor seconds, local excess / floor, its noise, global / Trace_ELBO, noise)
    floors = []
    wanted = tuple(p.strip() for p in args.problems.split(","))
    for label, model, data, ladder, options, target in problems(key, args.ladder):
        if not label.startswith(wanted):
            continue
        for num_particles in args.particles:
            times = benchmark(
                model, data, ladder, options, num_particles, args.steps, args.repeats, key
            )
            floor = times.pop(FLOOR)
            worst = max(worst, print_ratios(label, num_particles, times, 24))
            local = paired_ratio(times, LOCAL, ANNEALED)
            glob = paired_ratio(times, GLOBAL, ANNEALED)
            summary.append((label, num_particles, *local, *glob, target))
            glob_trace = paired_ratio(times, GLOBAL, "Trace_ELBO")
            excess = (times[LOCAL] - times["Trace_ELBO"]) / floor  # paired per repeat
            low, mid, high = np.percentile(excess, [25, 50, 75])
            floors.append((label, num_particles, float(np.median(floor)), float(mid),
                           float((high - low) / 2), *glob_trace))
    print(f"worst ratio to Trace_ELBO: {worst:.3f}")
    print()
    print("ratios to the annealed step (median over repeats of the paired ratio, ± half its IQR)")
    print(f"{'model':<24} {'S':>2}  {'local/annealed':>16} {'target':>7}  {'global/annealed':>16}")
    for label, num_particles, local, noise, glob, glob_noise, target in summary:
        mark = "" if local <= target else "  missed"
        print(
            f"{label:<24} {num_particles:>2}  {local:>9.3f} ±{noise:.3f} {'<= ' + str(target):>7}"
            f"  {glob:>9.3f} ±{glob_noise:.3f}{mark}"
        )
    label, num_particles, local, noise, *_, target = max(summary, key=lambda r: r[2] / r[-1])
    print(
        f"worst local/annealed (relative to its target): {local:.3f} ±{noise:.3f} on {label}, "
        f"S = {num_particles} (target <= {target})"
    )
    print()
    print("the floor of a per-element q(y_n): one jitted log-sum-exp and weighted sum over a "
          "(B, M) array, timed in the same repeats; local excess = (M-ELBO local - Trace_ELBO) "
          "/ floor, paired per repeat (median ± half its IQR); global = M-ELBO global / "
          "Trace_ELBO")
    print(f"{'model':<24} {'S':>2}  {'floor us':>9} {'local excess':>16} {'global':>16}")
    for label, num_particles, floor, excess, noise, glob, glob_noise in floors:
        print(f"{label:<24} {num_particles:>2}  {1e6 * floor:>9.1f} {excess:>9.3f} ±{noise:.3f}"
              f"  {glob:>9.3f} ±{glob_noise:.3f}")
    print(f"worst global ratio: {max(r[5] for r in floors):.3f}")
    print(f"worst local excess over floor: {max(r[3] for r in floors):.3f}")


if __name__ == "__main__":
    main()
