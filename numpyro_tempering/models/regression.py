"""A small hierarchical linear regression: the cheap model of the benchmarks.

y_n ~ N(a_{g(n)} + x_n . b, s^2), a_j ~ N(m, t^2): every step costs tens of microseconds, so
any per-step overhead of an objective shows up in its ratio to ``Trace_ELBO``.

Example:
    >>> import jax
    >>> x, group, y = regression_data(jax.random.PRNGKey(0), num_data=50)
    >>> x.shape, group.shape, y.shape
    ((50, 5), (50,), (50,))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

__all__ = ["hierarchical_regression", "regression_data"]


def hierarchical_regression(x, group, y=None, num_groups: int = 10) -> None:
    """y_n ~ N(a_{g(n)} + x_n . b, s^2), a_j ~ N(m, t^2), in a ``data`` plate."""
    m = numpyro.sample("m", dist.Normal(0.0, 5.0))
    t = numpyro.sample("t", dist.HalfNormal(2.0))
    with numpyro.plate("groups", num_groups):
        a = numpyro.sample("a", dist.Normal(m, t))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(a[group] + x @ b, s), obs=y)


def regression_data(
    key: jax.Array, num_data: int = 2000, dim: int = 5, num_groups: int = 10
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Synthetic (x, group, y) with group intercepts 0..num_groups-1 and slopes 1."""
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (num_data, dim))
    group = jax.random.randint(k2, (num_data,), 0, num_groups)
    y = jnp.arange(num_groups, dtype=float)[group] + x @ jnp.ones(dim)
    return x, group, y + jax.random.normal(k3, (num_data,))
