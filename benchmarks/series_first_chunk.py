r"""Time of log C(T) for a Binomial logistic regression: the tempered series' first chunk.

A tempered Binomial or Poisson site has no closed-form normaliser: each element's
:math:`\log\sum_k p(k)^{1/T}` is a series summed in chunks (``partition._series_loop``).
Under the tempered SMC the series is evaluated at every particle, HMC step, Newton step and
check point, so its chunk is most of the run. ``Binomial(10, logits=b z_n)`` needs 11
terms; the loop used to sum chunks of 128 from the start. It now sums a first chunk of 16
(``partition._SERIES_FIRST_CHUNK``) and then chunks of 128.

Each variant runs in its own process (the compiled programs are cached per process), one
after the other: ``--first 128`` is the old loop (the baseline, same run), ``--first 16``
the new one. Per variant: wall time of the first call (compilation included, as a user
runs it) and of a second call with another key, and the estimates (the two loops sum the
same terms: equal to float rounding).

Run: ``python benchmarks/series_first_chunk.py`` (about 5 minutes at N = 60 on 2 cores;
``--num-data 300`` took 873 s for the old loop's first call alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np


def run_variant(first: int, num_data: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    from numpyro_tempering import log_partition, partition

    partition._SERIES_FIRST_CHUNK = first  # read when the loop is traced

    def model(z, y):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", z.shape[0]):
            numpyro.sample("y", dist.Binomial(10, logits=b * z), obs=y)

    rng = np.random.default_rng(7)
    z = rng.normal(size=num_data).astype(np.float32)
    y = rng.binomial(10, 1 / (1 + np.exp(-0.7 * z))).astype(np.float32)
    temps = jnp.asarray([1.0, 1.5, 3.0, 10.0])
    out = {"first": first}
    for label, seed in (("first_s", 0), ("again_s", 1)):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = log_partition(jax.random.PRNGKey(seed), model, temps, jnp.asarray(z),
                                jnp.asarray(y), plate="data", progress_bar=False)
        out[label] = time.perf_counter() - start
        out["log_c" if seed == 0 else "log_c_again"] = np.asarray(est.log_c).tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-data", type=int, default=60)
    parser.add_argument("--variant", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(run_variant(args.variant, args.num_data)))
        return
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"Binomial(10, logits=b z_n), N = {args.num_data}, T = [1, 1.5, 3, 10]")
    rows = []
    for first in (128, 16):
        done = subprocess.run(
            [sys.executable, __file__, "--variant", str(first), "--num-data", str(args.num_data)],
            check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"{'first chunk':>12} {'first s':>9} {'again s':>9} {'ratio first':>12} "
          f"{'ratio again':>12}  log C (seed 0)")
    for row in rows:
        print(f"{row['first']:>12} {row['first_s']:>9.1f} {row['again_s']:>9.1f} "
              f"{row['first_s'] / base['first_s']:>12.3f} {row['again_s'] / base['again_s']:>12.3f}"
              f"  {np.round(row['log_c'], 3).tolist()}")
    diff = np.max(np.abs(np.subtract(rows[0]["log_c"], rows[1]["log_c"])))
    print(f"largest difference between the variants' estimates: {diff:.2g}")


if __name__ == "__main__":
    main()
