"""Shared exact answers for the tests: the Normal-Normal model and its tempered evidence.

mu ~ N(M0, S0), x_n | mu ~ N(mu, SIGMA), n = 1..N. With the likelihood tempered by
beta = 1/T the posterior is Normal and the tempered evidence
int p(mu) prod_n N(x_n | mu, SIGMA)^beta dmu is a Gaussian integral (closed forms below, in
float64 with numpy/scipy, independent of the package).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import scipy.stats

M0, S0, SIGMA = 0.5, 2.0, 1.0
X = jnp.array([1.3, 0.4, 2.1, 1.7, 0.9, 1.1, 1.5, 0.2])


def model(x):
    mu = numpyro.sample("mu", dist.Normal(M0, S0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, SIGMA), obs=x)


def guide(x, *_):
    loc = numpyro.param("loc", 0.0)
    scale = numpyro.param("scale", 1.0, constraint=dist.constraints.positive)
    numpyro.sample("mu", dist.Normal(loc, scale))


def tempered_posterior(beta: float = 1.0, x=X) -> tuple[float, float]:
    """Mean and sd of p(mu | x) with the likelihood raised to beta."""
    x = np.asarray(x, np.float64)
    precision = 1 / S0**2 + beta * x.shape[0] / SIGMA**2
    mean = (M0 / S0**2 + beta * x.sum() / SIGMA**2) / precision
    return mean, precision**-0.5


def tempered_log_evidence(beta: float = 1.0, x=X) -> float:
    """log int N(mu | M0, S0) prod_n N(x_n | mu, SIGMA)^beta dmu.

    N(x | mu, s)^beta = N(x | mu, s / sqrt(beta)) (2 pi s^2)^((1 - beta)/2) beta^(-1/2).
    """
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    cov = SIGMA**2 / beta * np.eye(n) + S0**2 * np.ones((n, n))
    per_point = 0.5 * (1 - beta) * np.log(2 * np.pi * SIGMA**2) - 0.5 * np.log(beta)
    return n * per_point + scipy.stats.multivariate_normal(np.full(n, M0), cov).logpdf(x)
