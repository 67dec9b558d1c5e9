"""log C(T) of models with continuous locals: the quadrature route and the joint SMC
against exact references (issue 20, scope 5).

``python benchmarks/log_partition_locals.py [--models normal,lognormal,gamma,poisson,binomial,
rats] [--route quadrature|joint-smc] [--num N]``

``rats``: Beta locals under Binomial counts (the rat-tumour shape, 18 experiments), which
``log_partition`` integrates in closed form (``numpyro_tempering.conjugate``; the default
route, the globals alone).

Per model and temperature (T in {1, 1.5, 3, 10}, float32, defaults): the error against the
exact value, the standard error, the measured quadrature error (quadrature route), the
number of SMC stages, and the wall time of the first call (with compilation) and of a
second call with another key (compiled).
"""

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from scipy.special import gammaln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_collapsed_locals import RAT_COUNTS, rats, rats_exact  # noqa: E402
from test_log_partition_locals import (  # noqa: E402
    SHAPE,
    TAU,
    S,
    binomial_log_c64,
    exact_log_c,
    gamma_exact,
    gamma_local,
    logit_normal_binomial,
    lognormal_local,
    normal_local,
    poisson_log_link,
    poisson_reference,
)

from numpyro_tempering import local_quadrature  # noqa: E402
from numpyro_tempering.partition_function import log_partition  # noqa: E402

TEMPS = jnp.array([1.0, 1.5, 3.0, 10.0])


def normal_gamma_local(x):
    """Two locals per element (d = 2): z_n ~ N(beta, S) and lambda_n as in gamma_local;
    x_n ~ N(0, e^{z_n} lambda_n^{-1/2}) tempered."""
    beta = numpyro.sample("beta", dist.Normal(0.0, TAU))
    with numpyro.plate("data", x.shape[0]):
        z = numpyro.sample("z", dist.Normal(beta, S))
        lam = numpyro.sample("lam", dist.Gamma(SHAPE, SHAPE * jnp.exp(beta)))
        numpyro.sample("x", dist.Normal(0.0, jnp.exp(z) * lam**-0.5), obs=x)


def normal_gamma_exact(temps, num):
    """log c_n = K + 3 c beta (E e^{2 c z} = e^{2 c beta + 2 c^2 S^2}, E lambda^{-c} as in
    gamma_exact), so log C = N K + (3 N c TAU)^2 / 2."""
    t = np.asarray(temps, np.float64)
    c = 0.5 * (1.0 - 1.0 / t)
    per = (c * math.log(2 * math.pi) + 0.5 * np.log(t) + 2 * c**2 * S**2
           + c * math.log(SHAPE) + gammaln(SHAPE - c) - gammaln(SHAPE))
    return num * per + 0.5 * (3 * num * c * TAU) ** 2


def binomial_exact(temps, num):
    """log C of ``logit_normal_binomial`` (N = num) by float64 quadrature: per (mu, log
    sigma) on a grid, each element's integral over z (a dense grid, or Gauss-Hermite for
    sigma < 0.02), raised to the N, integrated against the priors; within 1e-3 nats of a
    grid twice as fine in each direction at N = 200."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(40)
    z = np.linspace(-40, 40, 4001)
    mus, log_s = np.linspace(-8, 8, 401), np.linspace(-12, 3, 601)
    out = []
    for t in np.asarray(temps, np.float64):
        log_c = binomial_log_c64(z, t)
        grid = np.empty((mus.size, log_s.size))
        for j, ls in enumerate(log_s):
            s = math.exp(ls)
            if s < 0.02:
                zz = mus[:, None] + s * nodes[None]
                inner = np.logaddexp.reduce(
                    binomial_log_c64(zz.ravel(), t).reshape(zz.shape)
                    + np.log(weights / math.sqrt(2 * math.pi)), axis=1)
            else:
                log_n = (-0.5 * ((z[None] - mus[:, None]) / s) ** 2 - ls
                         - 0.5 * math.log(2 * math.pi))
                inner = np.logaddexp.reduce(log_n + log_c[None], axis=1) + math.log(z[1] - z[0])
            grid[:, j] = (num * inner - 0.5 * mus**2 - 0.5 * math.log(2 * math.pi)
                          + math.log(2) - 0.5 * s**2 - 0.5 * math.log(2 * math.pi) + ls)
        out.append(np.logaddexp.reduce(grid.ravel()) + math.log(mus[1] - mus[0])
                   + math.log(log_s[1] - log_s[0]))
    return np.array(out)


MODELS = {
    "normal": (normal_local, lambda n: exact_log_c(TEMPS, n), 500),
    "lognormal": (lognormal_local, lambda n: exact_log_c(TEMPS, n), 500),
    "gamma": (gamma_local, lambda n: gamma_exact(TEMPS, n), 500),
    "normal_gamma": (normal_gamma_local, lambda n: normal_gamma_exact(TEMPS, n), 500),
    "poisson": (poisson_log_link, lambda n: np.array([poisson_reference(float(t))
                                                      for t in TEMPS]), 4),
    "binomial": (logit_normal_binomial, lambda n: binomial_exact(TEMPS, n), 200),
    "rats": (rats, lambda n: np.array([rats_exact(float(t)) for t in TEMPS]), RAT_COUNTS.size),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="normal,lognormal,gamma,poisson")
    parser.add_argument("--route", default="quadrature", choices=["quadrature", "joint-smc"])
    parser.add_argument("--num", type=int, default=None)
    parser.add_argument("--no-second", action="store_true")
    opts = parser.parse_args()
    if opts.route == "joint-smc":
        local_quadrature.MAX_DIM = 0  # route="quadrature" then runs the joint SMC
    for name in opts.models.split(","):
        model, exact_fn, num = MODELS[name]
        num = opts.num or num
        exact = exact_fn(num)
        for i, key in enumerate([0] if opts.no_second else [0, 1]):
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if name == "rats":  # its locals are collapsed: the default route
                    est = log_partition(jax.random.PRNGKey(key), model, TEMPS,
                                        jnp.asarray(RAT_COUNTS, jnp.float32), plate="exp",
                                        progress_bar=False)
                else:
                    data = jnp.zeros(num, jnp.int32 if name == "binomial" else jnp.float32)
                    est = log_partition(jax.random.PRNGKey(key), model, TEMPS, data,
                                        plate="data", progress_bar=False, route="quadrature")
            secs = time.perf_counter() - start
            err = np.asarray(est.log_c, np.float64) - exact
            se = np.asarray(est.stderr, np.float64)
            quad = getattr(est, "quadrature_error", None)
            ok = (np.all(np.abs(err) <= 0.1) and np.all(np.abs(err) <= 3 * se + 0.02)
                  and np.all(se <= 0.1) and not np.any(est.flagged))
            print(f"{name} N={num} route={opts.route} call={i} {secs:.1f}s contract={ok}")
            for m, t in enumerate(np.asarray(TEMPS)):
                q = "" if quad is None else f" quad={quad[m]:+.4f}"
                print(f"  T={t:5.1f} exact={exact[m]:10.3f} err={err[m]:+.4f} se={se[m]:.4f}"
                      f"{q} stages={est.num_stages[m]:.1f} flagged={est.flagged[m]}")
            for w in caught:
                print("  warning:", str(w.message)[:300])
            sys.stdout.flush()


if __name__ == "__main__":
    main()
