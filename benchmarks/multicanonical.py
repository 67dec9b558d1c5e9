"""Overhead of MulticanonicalELBO over Trace_ELBO: time per jitted ``svi.update``.

Same model, guide, optimiser and number of particles; the multicanonical objective uses the
paper's ladder of 100 temperatures (1..10, geometric) with a precomputed log C, with one
global temperature and with one temperature per element of the data plate (local). Models:

* **FMM** (N = 1000, K = 8, D = 16): the model that ``examples/fmm_multicanonical.py`` fits
  with MVI -- the jointly tempered factorial mixture with the local step done analytically
  (factor ``x_z`` = expected complete-data log-likelihood under q(z_n) over the 2^8
  configurations, tempered; factor ``z_entropy`` untempered); log C in closed form
  (``fmm.log_partition``);
* **regression** (N = 2000): the hierarchical linear regression of ``benchmarks/overhead.py``;
  log C from the prior Monte Carlo estimator (``method="prior"``, computed once, not timed;
  only its shape matters for the step time).

The reference is ``Trace_ELBO`` on the *same* model. For each objective, ``--steps``
consecutive updates are compiled once into one ``jax.lax.scan`` and warmed up; each repeat
runs it and blocks on the result; objectives are interleaved within a repeat so that machine
load affects them alike; the time is the median over ``--repeats``, in microseconds per
step. ratio = time / Trace_ELBO time (target <= 1.15). The ``+ record`` row also stores q(y)
and E[T] for every step (``record_temperatures``), as the example does.

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
from timing import interleaved, print_ratios

from numpyro_tempering import Ladder, MulticanonicalELBO
from numpyro_tempering.models import fmm
from numpyro_tempering.models.regression import hierarchical_regression, regression_data
from numpyro_tempering.objectives.multicanonical import record_temperatures
from numpyro_tempering.partition_function import model_sizes


def problems(key, num_temperatures):
    """(label, model, args, ladder, objective options) per problem."""
    ladder = Ladder.geometric(1.0, 10.0, num_temperatures)
    data = fmm.make_toy_data(key, 1000)
    x = data.x
    fmm_args = (x, 0.5)
    log_c = fmm.log_partition(jnp.asarray(ladder.temperatures), *x.shape, 0.3, 0.1)
    fmm_ladder = ladder.with_log_partition_values(
        np.asarray(log_c),
        sizes=model_sizes(fmm.multicanonical_model, *fmm_args, exclude="z_entropy"),
    )
    reg_args = regression_data(key)
    # the step time does not depend on how log C was estimated: the quick prior Monte Carlo
    # (the default tempered SMC costs minutes on a 100-rung ladder at N = 2000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg_ladder = ladder.with_log_partition(hierarchical_regression, key, *reg_args,
                                              num_samples=100, method="prior")
    return [
        ("FMM (N=1000, K=8, D=16)", fmm.multicanonical_model, fmm_args, fmm_ladder,
         {"exclude": "z_entropy"}),
        ("regression (N=2000)", hierarchical_regression, reg_args, reg_ladder, {}),
    ]


def make_updates(model, args, ladder, options, num_particles, num_steps, key):
    """One (svi, state) per objective, all on the same model, guide and optimiser."""
    guide = AutoNormal(model)
    optim = optax.adam(1e-3)
    configs: dict[str, tuple[Callable, object]] = {
        "Trace_ELBO": (model, Trace_ELBO(num_particles=num_particles)),
        "M-ELBO global": (model, MulticanonicalELBO(ladder, num_particles=num_particles,
                                                    **options)),
        "M-ELBO global + record": (
            record_temperatures(model, ladder, num_steps),
            MulticanonicalELBO(ladder, num_particles=num_particles, **options)),
        "M-ELBO local (data)": (model, MulticanonicalELBO(
            ladder, plate="data", num_particles=num_particles, **options)),
    }
    out = {}
    for name, (m, loss) in configs.items():
        svi = SVI(m, guide, optim, loss)
        out[name] = (svi, svi.init(key, *args))
    return out


def benchmark(model, args, ladder, options, num_particles, steps, repeats, key):
    updates = make_updates(model, args, ladder, options, num_particles, steps * (repeats + 1),
                           key)
    return interleaved(updates, args, steps, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="updates per repeat")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--particles", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ladder", type=int, default=100, help="number of temperatures")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 steps, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats, args.particles = 20, 3, [1]

    key = jax.random.PRNGKey(0)
    print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, backend "
          f"{jax.default_backend()}, load average {os.getloadavg()[0]:.1f}; M = {args.ladder} "
          f"temperatures; median of {args.repeats} x {args.steps} steps")
    header = f"{'model':<24} {'S':>2}  {'objective':<24} {'us/step':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for label, model, data, ladder, options in problems(key, args.ladder):
        for num_particles in args.particles:
            result = benchmark(model, data, ladder, options, num_particles, args.steps,
                               args.repeats, key)
            worst = max(worst, print_ratios(label, num_particles, result, 24))
    print(f"worst ratio: {worst:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
