r"""Accuracy and time of log C(T): tempered SMC (the default) against plain Monte Carlo.

Three models with N = 2000 observations whose exact log C(T) is known (the cases of
``tests/test_partition_smc.py``, issue 11), at T in {1, 1.5, 2.5, 5, 10}:

* ``beta_bernoulli``: p ~ Beta(2, 3), x_n ~ Bernoulli(p); exact by quadrature of
  :math:`\int \mathrm{Beta}(p)\,(p^{1/T} + (1-p)^{1/T})^N dp` in log space;
* ``lognormal_scale``: s ~ LogNormal(0, 0.05), x_n ~ N(0, s); exact (log-normal moment):
  :math:`C(T) = T^{N/2} (2\pi)^{k/2} \mathbb{E}[s^k]`, :math:`k = N(1 - 1/T)`; the tilted
  target sits 90 prior standard deviations out at T = 10;
* ``joint_mixture``: w ~ Uniform(0, 1), x_n ~ w N(-1, 0.5) + (1 - w) N(2, 2), the discrete
  local tempered jointly (``joint=True``); exact by quadrature over w.

Per case and method: wall time of the first call (compilation included, as a user runs it)
and of a second call with another key (the SMC estimator is cached per model and shape),
the largest absolute error over the temperatures, the largest error in reported standard
errors, and whether any temperature was flagged. The old estimator is
``method="prior"`` with S = 1000 draws. (``benchmarks/timing.py`` times compiled SVI update
loops; a one-shot estimator is timed here directly with ``time.perf_counter``.)

Run: ``python benchmarks/log_partition.py`` (about a minute per case on 2 cores).
"""

from __future__ import annotations

import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from scipy.special import betaln
from scipy.special import logsumexp as sp_logsumexp

from numpyro_tempering import log_partition

TEMPS = np.array([1.0, 1.5, 2.5, 5.0, 10.0])
N = 2000


def log_trapezoid(log_f, grid):
    w = np.full(grid.size, grid[1] - grid[0])
    w[[0, -1]] /= 2
    return float(sp_logsumexp(log_f + np.log(w)))


def bb_model(x):
    p = numpyro.sample("p", dist.Beta(2.0, 3.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Bernoulli(probs=p), obs=x)


def bb_exact(T):
    a, p = 1.0 / T, np.linspace(1e-9, 1 - 1e-9, 400_001)
    log_prior = np.log(p) + 2 * np.log1p(-p) - betaln(2.0, 3.0)
    return log_trapezoid(log_prior + N * np.logaddexp(a * np.log(p), a * np.log1p(-p)), p)


def scale_model(x):
    s = numpyro.sample("s", dist.LogNormal(0.0, 0.05))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(0.0, s), obs=x)


def scale_exact(T):
    k = N * (1 - 1.0 / T)
    return 0.5 * N * np.log(T) + 0.5 * k * np.log(2 * np.pi) + 0.5 * (k * 0.05) ** 2


LOC, SCALE = np.array([-1.0, 2.0]), np.array([0.5, 2.0])


def mixture_model(x):
    w = numpyro.sample("w", dist.Uniform(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        mix = dist.MixtureSameFamily(
            dist.Categorical(probs=jnp.stack([w, 1.0 - w])),
            dist.Normal(jnp.asarray(LOC), jnp.asarray(SCALE)),
        )
        numpyro.sample("x", mix, obs=x)


def mixture_exact(T):
    a = 1.0 / T
    log_z = 0.5 * (1 - a) * np.log(2 * np.pi * SCALE**2) + 0.5 * np.log(T)
    w = np.linspace(1e-12, 1 - 1e-12, 400_001)
    return log_trapezoid(N * np.logaddexp(a * np.log(w) + log_z[0], a * np.log1p(-w) + log_z[1]), w)


CASES = {
    "beta_bernoulli": (bb_model, bb_exact, {}),
    "lognormal_scale": (scale_model, scale_exact, {}),
    "joint_mixture": (mixture_model, mixture_exact, {"joint": True}),
}
METHODS = {"smc": {"method": "smc"}, "prior S=1000": {"method": "prior", "num_samples": 1000}}


def timed(fn):
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def main() -> None:
    print(
        f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; N = {N}, T = {TEMPS.tolist()}"
    )
    head = f"{'case':<16} {'method':<13} {'first s':>8} {'again s':>8} {'max |err|':>10} "
    print(head + f"{'max err/SE':>11} {'flagged':>8}  errors per T")
    x = jnp.zeros(N)
    for case, (model, exact_fn, kw) in CASES.items():
        exact = np.array([exact_fn(T) for T in TEMPS])
        for label, mkw in METHODS.items():
            est, first = timed(
                lambda mkw=mkw, model=model, kw=kw: log_partition(
                    jax.random.PRNGKey(0), model, TEMPS, x, plate="data", **kw, **mkw
                )
            )
            _, again = timed(
                lambda mkw=mkw, model=model, kw=kw: log_partition(
                    jax.random.PRNGKey(1), model, TEMPS, x, plate="data", **kw, **mkw
                )
            )
            err = np.asarray(est.log_c, np.float64) - exact
            se = np.asarray(est.stderr, np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                z = np.where(se > 0, np.abs(err) / se, np.where(np.abs(err) > 1e-3, np.inf, 0))
            print(
                f"{case:<16} {label:<13} {first:>8.1f} {again:>8.1f} {np.max(np.abs(err)):>10.3g} "
                f"{np.max(z):>11.3g} {str(est.flagged.any()):>8}  {np.round(err, 3).tolist()}"
            )


if __name__ == "__main__":
    main()
