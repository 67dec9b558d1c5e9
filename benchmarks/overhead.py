"""Overhead of TemperedELBO over numpyro's Trace_ELBO: time per jitted ``svi.update``.

For each model (the collapsed factorial mixture model and a hierarchical linear regression)
and each particle count (1 and 8), this times three SVI objectives on the same model, guide
and optimiser, measured in the same process and interleaved so that machine load affects
them alike:

* ``Trace_ELBO``                            -- stock NumPyro (the reference);
* ``TemperedELBO(T=2)``                     -- fixed temperature, ``temper`` applied inside;
* ``TemperedELBO()`` + ``temper(schedule)`` -- annealing, the clock in SVI's mutable state.

For each objective, ``--steps`` consecutive ``svi.update`` calls are compiled once into one
``jax.lax.scan`` (so Python dispatch, identical for all objectives, does not blur the
comparison) and warmed up; a repeat runs it and blocks on the result; the reported time is
the median over ``--repeats`` repeats, in microseconds per step. The ratio column is the
median over repeats of time / Trace_ELBO time in the same repeat, ± half its interquartile
range (the run-to-run noise); target <= 1.03. The last line is the worst ratio.
Run: ``python benchmarks/overhead.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import numpyro
import optax
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from timing import interleaved_times, print_ratios

from numpyro_tempering import TemperedELBO, schedules, temper
from numpyro_tempering.models import fmm
from numpyro_tempering.models.regression import hierarchical_regression, regression_data


def problems(key) -> dict[str, tuple[Callable, tuple]]:
    data = fmm.make_toy_data(key, 1000)
    return {
        "collapsed FMM (N=1000, K=8, D=16)": (fmm.collapsed_model, (data.x,)),
        "hierarchical regression (N=2000)": (hierarchical_regression, regression_data(key)),
    }


def make_updates(model, args, num_particles, key):
    """Jitted update functions and initial states, one per objective."""
    guide = AutoNormal(model)
    optim = optax.adam(1e-3)
    configs = {
        "Trace_ELBO": (model, Trace_ELBO(num_particles=num_particles)),
        "TemperedELBO(T=2)": (model, TemperedELBO(num_particles=num_particles, temperature=2.0)),
        "TemperedELBO+schedule": (
            temper(model, schedules.linear(10.0, 1.0, 10_000)),
            TemperedELBO(num_particles=num_particles),
        ),
    }
    out = {}
    for name, (m, loss) in configs.items():
        svi = SVI(m, guide, optim, loss)
        state = svi.init(key, *args)
        out[name] = (svi, state)
    return out


def benchmark(model, args, num_particles, steps, repeats, key, data_as_arguments=False):
    return interleaved_times(make_updates(model, args, num_particles, key), args, steps, repeats,
                             data_as_arguments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="updates per repeat")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--particles", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--data-as-arguments", action="store_true",
                        help="pass the data to the compiled loop as arguments (a hand-written "
                             "jitted loop) instead of capturing them as constants (SVI.run)")
    args = parser.parse_args()

    key = jax.random.PRNGKey(0)
    print(
        f"jax {jax.__version__}, numpyro {numpyro.__version__}, backend "
        f"{jax.default_backend()}; median of {args.repeats} x {args.steps} steps"
    )
    header = f"{'model':<36} {'S':>2}  {'objective':<24} {'us/step':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for label, (model, data) in problems(key).items():
        for num_particles in args.particles:
            result = benchmark(model, data, num_particles, args.steps, args.repeats, key,
                               args.data_as_arguments)
            worst = max(worst, print_ratios(label, num_particles, result, 36))
    print(f"worst ratio: {worst:.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
