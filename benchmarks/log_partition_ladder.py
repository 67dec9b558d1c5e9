r"""log C(T) on the paper's ladder: one sequential SMC run along the ladder against one SMC per
temperature (issue 20, scope 3).

The paper's ladder (Mandt et al. 2016, section 4.1): 100 temperatures from 1 to 10 on a
geometric scale. Two models with N = 2000 observations and an exact log C(T):

* ``lognormal_regression`` (the issue's two-latent model, ``tests/test_partition_smc.py``):
  w ~ N(0, 1), s ~ LogNormal(0, 0.05), x_n ~ N(w u_n, s m_n); closed form
  :math:`\log C(T) = \sum_n [\tfrac{1-a}{2}\log(2\pi m_n^2) + \tfrac12\log T] + \tfrac12 k^2
  v^2`, :math:`k = N(1 - a)`, :math:`a = 1/T` (the tilted target sits 90 prior standard
  deviations out at T = 10);
* ``beta_bernoulli``: p ~ Beta(2, 3), x_n ~ Bernoulli(p); exact by quadrature.

Per case and route (``route="ladder"``, the default for ladders of 8 rungs or more, and
``route="per-temperature"``): wall time of the first call (compilation included, as a user
runs it) and of a second call with another key, the largest absolute error over the rungs,
the largest error in reported standard errors, the largest standard error, the flags, and the
SMC stages (summed over the rungs; mean over replicates), then the same-run ratio of the
per-temperature route's times to the ladder route's.

Run: ``python benchmarks/log_partition_ladder.py`` (about 10 minutes on 2 cores, most of it
the per-temperature route); ``--rungs 20`` for a shorter ladder, ``--ladder-only`` to skip
the per-temperature route.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from log_partition import bb_exact, bb_model, timed

from numpyro_tempering import log_partition

N = 2000
V_LN = 0.05


def regression_model(x):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    s = numpyro.sample("s", dist.LogNormal(0.0, V_LN))
    n = x.shape[0]
    with numpyro.plate("data", n):
        numpyro.sample("x", dist.Normal(w * jnp.linspace(-1.0, 1.0, n),
                                        s * jnp.linspace(0.5, 2.0, n)), obs=x)


def regression_exact(T):
    a = 1.0 / T
    m = np.linspace(0.5, 2.0, N)
    k = N * (1 - a)
    return float(np.sum(0.5 * (1 - a) * np.log(2 * np.pi * m**2) + 0.5 * np.log(T))
                 + 0.5 * (k * V_LN) ** 2)


CASES = {
    "lognormal_regression": (regression_model, regression_exact),
    "beta_bernoulli": (bb_model, bb_exact),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rungs", type=int, default=100)
    parser.add_argument("--ladder-only", action="store_true")
    opts = parser.parse_args()
    temps = np.geomspace(1.0, 10.0, opts.rungs)
    routes = ("ladder",) if opts.ladder_only else ("ladder", "per-temperature")
    print(
        f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; N = {N}, {opts.rungs} rungs 1..10 geometric"
    )
    print(f"{'case':<21} {'route':<16} {'first s':>8} {'again s':>8} {'max |err|':>10} "
          f"{'max err/SE':>11} {'max SE':>7} {'flagged':>8} {'stages':>7}")
    x = jnp.zeros(N)
    for case, (model, exact_fn) in CASES.items():
        exact = np.array([exact_fn(T) for T in temps])
        times = {}
        for route in routes:
            def call(seed, route=route, model=model):
                return log_partition(jax.random.PRNGKey(seed), model, temps, x, plate="data",
                                     route=route, progress_bar=False)

            est, first = timed(lambda call=call: call(0))
            _, again = timed(lambda call=call: call(1))
            times[route] = (first, again)
            err = np.asarray(est.log_c, np.float64) - exact
            se = np.asarray(est.stderr, np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                z = np.where(se > 0, np.abs(err) / se, 0.0)
            print(
                f"{case:<21} {route:<16} {first:>8.1f} {again:>8.1f} "
                f"{np.nanmax(np.abs(err)):>10.4f} {np.nanmax(z):>11.2f} {np.nanmax(se):>7.4f} "
                f"{int(est.flagged.sum()):>8} {np.nansum(est.num_stages):>7.0f}",
                flush=True,
            )
        if len(times) == 2:
            (f_l, a_l), (f_p, a_p) = times["ladder"], times["per-temperature"]
            print(f"{case:<21} per-temperature / ladder: first call {f_p / f_l:.1f}x, "
                  f"again {a_p / a_l:.1f}x", flush=True)


if __name__ == "__main__":
    main()
