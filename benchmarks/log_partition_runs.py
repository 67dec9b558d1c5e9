r"""Time of log C(T) for a logistic regression: the SMC runs vectorised together or in groups.

``log_partition`` runs R replicates x M temperatures of tempered SMC, P particles each. It
used to vectorise all of them together (``vmap``), so that every array of the tempered
likelihood had R M P N elements (N observations): 3,072 x N for the defaults at three
temperatures, far beyond the cache for N in the thousands. Now the runs are vectorised in
groups whose particles' largest array stays within ``tempered_smc.RUN_BUDGET`` elements,
the groups one after the other (``tempered_smc.map_runs``). Both give the same numbers
(the same random streams per run); this prints the time of a call after compilation and of
the first call (compilation included) for each, in turn in the same process, and their
ratio. The model: :math:`w \sim \mathcal N(0, I_5)`, :math:`b \sim \mathcal N(0, 1)`,
:math:`y_n \sim \mathrm{Bernoulli}(\mathrm{logits} = x_n^\top w + b)`, T = 1, 3.16, 10.

Run: ``python benchmarks/log_partition_runs.py [--sizes 200 1000 5000] [--repeats 2]``
(about 10 minutes on 2 cores with the defaults).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

from numpyro_tempering import log_partition, tempered_smc
from numpyro_tempering import partition_function as pf

TEMPS = np.array([1.0, 3.16, 10.0])


def model(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)


def data(n: int, d: int = 5):
    x = jax.random.normal(jax.random.PRNGKey(0), (n, d))
    p = jax.nn.sigmoid(x @ jnp.linspace(-1.0, 1.0, d) + 0.3)
    return x, (jax.random.uniform(jax.random.PRNGKey(1), (n,)) < p).astype(jnp.float32)


def timed(budget: int, x, y, key: int) -> tuple[float, float, np.ndarray]:
    """(first call's seconds, second call's seconds, log C) with ``RUN_BUDGET = budget``,
    compiled afresh."""
    tempered_smc.RUN_BUDGET = budget
    pf._SMC_CACHE.clear()
    times = []
    for k in (key, key + 1):
        start = time.perf_counter()
        est = log_partition(jax.random.PRNGKey(k), model, TEMPS, x, y, plate="data",
                            progress_bar=False)
        np.asarray(est.log_c)
        times.append(time.perf_counter() - start)
    return times[0], times[1], np.asarray(est.log_c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 1000, 5000])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    default = tempered_smc.RUN_BUDGET
    configs = {"all runs vectorised (before)": 2**62, "grouped (RUN_BUDGET)": default}
    print(f"jax {jax.__version__}, backend {jax.default_backend()}; 4 replicates x 3 "
          f"temperatures x 256 particles; median over {args.repeats} repeats, interleaved")
    header = f"{'N':>6}  {'runs':<30} {'call s':>8} {'first call s':>13} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        x, y = data(n)
        results = {name: [] for name in configs}
        for r in range(args.repeats):
            for name, budget in configs.items():
                results[name].append(timed(budget, x, y, 2 * r))
        base = np.median([t[1] for t in results[next(iter(configs))]])
        values = [res[-1][2] for res in results.values()]
        for name, res in results.items():
            call, first = np.median([t[1] for t in res]), np.median([t[0] for t in res])
            print(f"{n:>6}  {name:<30} {call:8.2f} {first:13.2f} {call / base:6.3f}")
        print(f"        largest difference of log C between the two: "
              f"{np.max(np.abs(values[0] - values[1])):.2e}")
    tempered_smc.RUN_BUDGET = default


if __name__ == "__main__":
    main()
