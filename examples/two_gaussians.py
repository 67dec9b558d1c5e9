r"""Fig. 1 of annealed-and-multicanonical-vi: deterministic annealing of a two-Gaussian mixture.

A 1-D mixture of two unit-variance Gaussians with unknown means (mu0, mu1), equal weights and
explicit assignments z_n:

    mu_j ~ N(0, 5^2),   z_n ~ Bern(1/2),   x_n ~ N(mu_{z_n}, 1).

The data come from *three* clusters (20 points at -5, 40 at 0, 40 at 5), so that at T = 1
the objective has a global optimum (one mean on the right cluster, the other between the
left and middle clusters, near (-1.6, 5.0)) and a worse local optimum (the left cluster
alone, the middle and right clusters shared, near (-5.1, 2.6)), each twice by the label
symmetry mu0 <-> mu1.

What is plotted is the tempered ELBO of eq. 7 with a point mass on (mu0, mu1) and the
optimal q(z_n) for each point: maximising eq. 7 over q(z_n) gives

    L(mu; T) = log p(mu) + sum_n log sum_{z_n} p(x_n, z_n | mu)^(1/T),

the likelihood tempered *jointly* with the assignments (eq. 4). It is computed with the
package: the model is wrapped in ``temper(model, T, latent="z")`` (T traced, so one compiled
function serves every temperature), and :func:`numpyro_tempering.log_weights` with
``plate="data"`` returns (1/T) log p(x_n, z_n | mu) per data point for z = 0 and z = 1
(a guide that pins mu and z), from which the sum over z_n is a logsumexp. Everything is
vmapped over the (mu0, mu1) grid and the temperatures.

At T = 20 the objective has a single optimum on the diagonal mu0 = mu1 (both means near the
data mean); by T = 13 it has split into the symmetric pair; at T = 1 the worse local optima
have appeared too. The white path is gradient ascent annealed linearly from T = 20 to 1 (then
held at 1), drawn up to each panel's temperature; the grey path starts at the same point
(x) at T = 1 and ends in the local optimum; the red dots are the global optima on the grid.

Run: ``python examples/two_gaussians.py`` (writes examples/output/two_gaussians.png).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.scipy.special import logsumexp

from numpyro_tempering import log_weights, schedules, temper

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TEMPERATURES = (20.0, 13.0, 8.5, 1.0)
PRIOR_SCALE = 5.0


def make_data(seed: int = 0) -> jax.Array:
    """Three clusters: 20 points at -5, 40 at 0 and 40 at 5 (standard deviation 0.6)."""
    rng = np.random.default_rng(seed)
    centres, sizes = (-5.0, 0.0, 5.0), (20, 40, 40)
    return jnp.asarray(
        np.concatenate([c + 0.6 * rng.normal(size=n) for c, n in zip(centres, sizes, strict=True)])
    )


def model(x, mu_value=None, z_value=None):
    """Two-Gaussian mixture with explicit assignments (``*_value`` are for the guide)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SCALE).expand([2]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        z = numpyro.sample("z", dist.Bernoulli(0.5))
        numpyro.sample("x", dist.Normal(mu[z.astype(jnp.int32)], 1.0), obs=x)


def point_guide(x, mu_value=None, z_value=None):
    """A point mass at (mu, z): log q = 0, so the engine returns the tempered log joint."""
    numpyro.sample("mu", dist.Delta(mu_value, event_dim=1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("z", dist.Delta(z_value))


def objective(mu: jax.Array, x: jax.Array, temperature: jax.Array) -> jax.Array:
    """L(mu; T) = log p(mu) + sum_n logsumexp_z (1/T) log p(x_n, z | mu)."""
    tempered = temper(model, temperature, latent="z")

    def terms(z):
        w = log_weights(
            jax.random.PRNGKey(0),
            {},
            tempered,
            point_guide,
            (x,),
            {"mu_value": mu, "z_value": jnp.full(x.shape, z)},
            plate="data",
        )
        return w.log_prior[0], w.log_lik_elements[0]

    log_prior, per_point = jax.vmap(terms)(jnp.array([0.0, 1.0]))
    return log_prior[0] + jnp.sum(logsumexp(per_point, axis=0))


def ascend(x, start, temperatures, lr=0.2):
    """Gradient ascent on L(mu; T_t) with T_t given per step (one compiled scan).

    The step is ``lr * T / N`` times the gradient: the likelihood's gradient scales as N / T,
    so this moves each mean a fraction ``lr`` of the way to its responsibility-weighted data
    average, like an EM step, at every temperature.
    """
    grad = jax.grad(objective)

    def step(mu, temperature):
        mu = mu + lr * temperature / x.shape[0] * grad(mu, x, temperature)
        return mu, mu

    _, path = jax.lax.scan(step, start, temperatures)
    return jnp.concatenate([start[None], path])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, default=161, help="grid points per axis")
    parser.add_argument("--steps", type=int, default=600, help="gradient-ascent steps")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "output" / "two_gaussians.png"
    )
    args = parser.parse_args()

    x = make_data()
    lim = 7.0
    axis = jnp.linspace(-lim, lim, args.grid)
    grid = jnp.stack(jnp.meshgrid(axis, axis, indexing="ij"), -1).reshape(-1, 2)
    temps = jnp.asarray(TEMPERATURES)
    over_grid = jax.vmap(objective, in_axes=(0, None, None))
    surfaces = jax.jit(jax.vmap(over_grid, in_axes=(None, None, 0)))(grid, x, temps)
    surfaces = np.asarray(surfaces).reshape(len(TEMPERATURES), args.grid, args.grid)

    start = jnp.array([-5.5, 0.3])
    annealed = schedules.trajectory(schedules.linear(20.0, 1.0, args.steps // 2), args.steps)
    fixed = jnp.ones(args.steps)
    run = jax.jit(ascend)
    path_annealed = np.asarray(run(x, start, annealed))
    path_fixed = np.asarray(run(x, start, fixed))
    final = {"annealed": path_annealed[-1], "T = 1 only": path_fixed[-1]}

    fig, axes = plt.subplots(1, len(TEMPERATURES), figsize=(4 * len(TEMPERATURES), 4.2))
    annealed_np = np.asarray(annealed)
    for ax, temperature, surface in zip(axes, TEMPERATURES, surfaces, strict=True):
        levels = surface.max() - np.geomspace(0.01, 0.6, 25)[::-1] * np.ptp(surface)
        levels = np.unique(np.concatenate([levels, [surface.max() - 1e-6]]))
        ax.contourf(axis, axis, surface.T, levels=levels, cmap="viridis", extend="min")
        ax.contour(axis, axis, surface.T, levels=levels, colors="k", linewidths=0.3)
        best = surface.max()
        i, j = np.nonzero(surface >= best - 1e-9 * max(1.0, abs(best)))
        ax.plot(axis[i], axis[j], "o", color="red", ms=7, mec="white", zorder=5)
        ax.plot(axis[j], axis[i], "o", color="red", ms=7, mec="white", zorder=5)
        upto = np.searchsorted(-annealed_np, -temperature, side="right") + 1
        ax.plot(*path_annealed[:upto].T, color="white", lw=1.8)
        ax.plot(*start, "x", color="white", ms=8, mew=2)
        if temperature == 1.0:
            ax.plot(*path_fixed.T, color="0.6", lw=1.8, ls="--")
        ax.set_title(f"T = {temperature:g}")
        ax.set_xlabel(r"$\mu_0$")
        ax.set_aspect("equal")
    axes[0].set_ylabel(r"$\mu_1$")
    fig.suptitle(
        "Tempered objective of a two-Gaussian mixture (red: global optimum; white: "
        "annealed ascent from x; grey: ascent at T = 1 from x)",
        fontsize=10,
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)

    at_one = jax.jit(objective)
    print(f"data: {x.shape[0]} points; figure: {args.out}")
    for name, mu in final.items():
        print(
            f"{name:>11}: mu = ({mu[0]:+.2f}, {mu[1]:+.2f}), "
            f"L(mu; T=1) = {float(at_one(jnp.asarray(mu), x, 1.0)):.2f}"
        )
    k = np.argmax(surfaces[-1])
    print(
        f"grid optimum at T = 1: mu = ({axis[k // args.grid]:+.2f}, "
        f"{axis[k % args.grid]:+.2f}), L = {surfaces[-1].max():.2f}"
    )


if __name__ == "__main__":
    main()
