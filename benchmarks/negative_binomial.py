r"""Time of the tempered negative-binomial normaliser (``numpyro_tempering.tempered_families``:
128 exact terms, then a rigorous tail bound or a fixed-cost tail sum) against the series of
terms it replaced (the Poisson's loop: chunks of 128 terms until the tail bound is met), in
the same run.

One jitted, vmapped value-and-gradient of :math:`\sum_n \log Z_n(T)` over 256 particles of
a 50-element regression, :math:`\bar k_n = \exp(b_0 + b_1 x_n)`, concentration 2, T = 2,
float32 -- what ``log_partition``'s SMC evaluates at every HMC step of a negative-binomial
model. The particles' spread sets the largest mean the batch reaches; the series needs
about :math:`T\bar k/a` terms per element, and a vmapped loop runs until its slowest
element is done; rows where it would take more than a minute a call are left out.

Run: ``python benchmarks/negative_binomial.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist

from numpyro_tempering import tempered_families as tf
from numpyro_tempering.partition import _make_series_log_sum, tempered_log_normalizer

X = jnp.linspace(-1.0, 1.0, 50)
REPEATS = 5
SERIES = _make_series_log_sum(tf._nb_term, tf._nb_tail, tf._nb_term_grad)


def batch(b: jax.Array, t: float) -> jax.Array:
    mean = jnp.exp(b[0] + b[1] * X)
    return tempered_log_normalizer(dist.NegativeBinomial2(mean, 2.0), t).sum()


def batch_series(b: jax.Array, t: float) -> jax.Array:
    mean = jnp.exp(b[0] + b[1] * X)
    params = tf._nb_params(dist.NegativeBinomial2(mean, 2.0), jnp.asarray(t, mean.dtype))
    return SERIES(params).sum()


def timed(f, b) -> tuple[float, float]:
    """Median and spread (max - min) of REPEATS calls after a warm-up call."""
    f(b)[0].block_until_ready()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        f(b)[0].block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(np.ptp(times))


def main() -> None:
    print(f"{'spread':>6} {'largest mean':>12} {'head + tail sum (s)':>19} "
          f"{'series (s)':>16} {'ratio':>6}")
    for spread, series_too in ((0.3, True), (1.0, True), (3.0, False)):
        b = jnp.asarray(np.random.default_rng(0).normal([3.0, 0.0], spread, (256, 2)),
                        jnp.float32)
        largest = float(jnp.exp(b[:, 0] + jnp.abs(b[:, 1])).max())
        new = jax.jit(jax.vmap(jax.value_and_grad(lambda b: batch(b, 2.0))))
        t_new, s_new = timed(new, b)
        row = f"{spread:6.1f} {largest:12.3g} {t_new:12.3f} +- {s_new:.3f}"
        if series_too:
            old = jax.jit(jax.vmap(jax.value_and_grad(lambda b: batch_series(b, 2.0))))
            t_old, s_old = timed(old, b)
            row += f" {t_old:9.3f} +- {s_old:.3f} {t_old / t_new:6.1f}"
        else:
            row += f" {'(minutes)':>16}"
        print(row)


if __name__ == "__main__":
    main()
