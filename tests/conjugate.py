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
import scipy.special
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


def normal_log_z(T, sigma):
    """log int N(x | mu, sigma)^(1/T) dx = (1 - 1/T)/2 log(2 pi sigma^2) + log(T)/2: the
    tempered normaliser of one Normal observation (free of mu)."""
    t = np.asarray(T, np.float64)
    return 0.5 * (1 - 1 / t) * np.log(2 * np.pi * np.asarray(sigma) ** 2) + 0.5 * np.log(t)


def tempered_log_evidence(beta: float = 1.0, x=X) -> float:
    """log int N(mu | M0, S0) prod_n N(x_n | mu, SIGMA)^beta dmu.

    N(x | mu, s)^beta = N(x | mu, s / sqrt(beta)) (2 pi s^2)^((1 - beta)/2) beta^(-1/2).
    """
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    cov = SIGMA**2 / beta * np.eye(n) + S0**2 * np.ones((n, n))
    per_point = normal_log_z(1.0 / beta, SIGMA)
    return n * per_point + scipy.stats.multivariate_normal(np.full(n, M0), cov).logpdf(x)


# A two-component Normal mixture with the component summed out: under joint tempering each
# element's normaliser is log sum_k w_k^(1/T) Z_k(T), free of the component means (exact).
W_MIX, S_MIX = np.array([0.3, 0.7]), np.array([0.5, 2.0])


def mixture_model(x):
    loc = numpyro.sample("loc", dist.Normal(0.0, 3.0).expand([2]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        mix = dist.MixtureSameFamily(
            dist.Categorical(jnp.asarray(W_MIX)), dist.Normal(loc, jnp.asarray(S_MIX))
        )
        numpyro.sample("x", mix, obs=x)


def joint_mixture_log_c(temps, n: int = 1) -> np.ndarray:
    """log C(T) of ``mixture_model`` on n points, jointly tempered: n log sum_k w_k^(1/T)
    Z_k(T), with Z_k(T) = (2 pi s_k^2)^((1 - 1/T)/2) T^(1/2)."""
    t = np.asarray(temps, np.float64)[:, None]
    log_z = normal_log_z(t, S_MIX)
    return n * scipy.special.logsumexp(np.log(W_MIX) / t + log_z, axis=-1)
