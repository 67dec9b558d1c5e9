r"""Learnt features against the truth: the beta-Bernoulli latent feature model on the 6x6 toy.

Fits the finite beta-Bernoulli linear-Gaussian model
(:mod:`numpyro_tempering.models.latent_features`; Shah et al., supplement) to the classic
6 x 6 toy (four binary features in the four quadrants, D = 36, each switched on with
probability 0.5 and weighted by N(0, 1), noise 0.3) -- or to the larger synthetic set
(``--data synthetic``: 20 Gaussian features, D = 64) -- with every local scheme at T = 1,
annealed and multicanonically, from one shared initialisation, and shows

* a table: held-out log-likelihood per point (importance sampling, with its standard
  error), feature recovery (mean |cos| after matching to the truth), the temperature of the
  last pass and the seconds per pass;
* a figure (``examples/output/latent_features.png``): the true features, then per method
  the learnt posterior-mean features matched to them (order, sign and scale are not
  identifiable), and the final per-point temperatures of multicanonical VI.

Run: ``python examples/latent_features.py`` (about 1-3 minutes on 2 CPU cores, mostly
compilation: one per scheme); ``--quick`` for a smoke run; ``--schemes gibbs_ssvi mf_ssvi``
for a subset. The benchmark ``benchmarks/latent_features.py`` runs the same comparison over
several seeds and data sets.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

from numpyro_tempering.models import latent_features as lf
from numpyro_tempering.models.latent_features.svi import (
    SCHEMES,
    TEMPERINGS,
    Settings,
    annealing_temperatures,
    make_fit,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("toy", "synthetic"), default="toy")
    parser.add_argument("--num-data", type=int, default=1000, help="N (20%% held out)")
    parser.add_argument("--features", type=int, default=None,
                        help="K of the fit (default: the true number)")
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="initialisation and SVI key")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--t-start", type=float, default=2.0, help="annealing: initial T")
    parser.add_argument("--quick", action="store_true", help="smoke run: N = 300, 3 passes")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "output" / "latent_features.png")
    args = parser.parse_args()
    if args.quick:
        args.num_data, args.passes = 300, 3
    return args


def make_data(args):
    key = jax.random.PRNGKey(0)
    if args.data == "toy":
        data = lf.make_toy_data(key, args.num_data)
        side = 6
    else:
        data = lf.make_data(key, args.num_data, num_features=20, dim=64, pi=0.2, noise_std=0.5)
        side = 8
    train, test, _ = lf.split_heldout(jax.random.PRNGKey(1), data.y)
    return data, train, test, side


def fit_all(args, train, test, truth):
    settings = Settings(batch_size=args.batch_size, num_passes=args.passes,
                        t_start=args.t_start, local_steps=20)
    k = args.features or truth.shape[0]
    q0 = lf.init_params(jax.random.PRNGKey(100 + args.seed), train, k)
    results = {}
    for scheme in args.schemes:
        start = time.perf_counter()
        run = make_fit(scheme, train.shape[0], k, lf.DEFAULT_PRIOR, settings)
        schedule = annealing_temperatures(scheme, train.shape[0], settings)
        run = run.lower(jax.random.PRNGKey(0), train, q0, jnp.int32(0), schedule,
                        settings.ladder()).compile()  # timings below exclude compilation
        for tempering in TEMPERINGS:
            t = time.perf_counter()
            res = jax.block_until_ready(
                run(jax.random.PRNGKey(200 + args.seed), train, q0,
                    jnp.int32(TEMPERINGS.index(tempering)), schedule, settings.ladder()))
            seconds = time.perf_counter() - t
            value = lf.point_estimate(res.params)
            finite = all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(value))
            row = {"finite": finite, "seconds_per_pass": seconds / args.passes,
                   "temperature": np.asarray(res.temperature),
                   "inv_temperature": np.asarray(res.inv_temperature)}
            if finite:
                held = lf.heldout_log_lik(jax.random.PRNGKey(3), test, value)
                score, perm, signs = lf.feature_recovery(value.phi, truth)
                row.update(heldout=held.mean, se=held.se, recovery=score,
                           phi=np.asarray(value.phi)[perm] * signs[:, None])
            results[(scheme, tempering)] = row
        print(f"{scheme}: 3 temperings in {time.perf_counter() - start:.1f} s "
              "(one compilation)", flush=True)
    return results


def print_table(results, truth_heldout):
    print()
    print(f"{'scheme':<13} {'tempering':<9} {'held-out/pt':>11} {'s.e.':>6} {'recovery':>8} "
          f"{'T last pass':>11} {'s/pass':>7}")
    for (scheme, tempering), r in results.items():
        if not r["finite"]:
            print(f"{scheme:<13} {tempering:<9} {'non-finite fit':>11}")
            continue
        print(f"{scheme:<13} {tempering:<9} {r['heldout']:>11.3f} {r['se']:>6.3f} "
              f"{r['recovery']:>8.3f} {r['temperature'][-1]:>11.2f} "
              f"{r['seconds_per_pass']:>7.3f}")
    print(f"(the true globals: {truth_heldout:.3f} per held-out point)")


def plot(args, results, truth, side):
    methods = [m for m, r in results.items() if r["finite"]]
    k_true = truth.shape[0]
    fig = plt.figure(figsize=(2 + 0.9 * k_true, 0.85 * (len(methods) + 1) + 2.2))
    grid = fig.add_gridspec(len(methods) + 2, 1, hspace=0.5)
    rows = [("truth", truth)] + [
        (f"{s} {t}\n{results[(s, t)]['heldout']:.2f}/pt, |cos| "
         f"{results[(s, t)]['recovery']:.2f}", results[(s, t)]["phi"]) for s, t in methods]
    for i, (label, phi) in enumerate(rows):
        sub = grid[i].subgridspec(1, k_true, wspace=0.08)
        vmax = float(np.max(np.abs(phi))) or 1.0
        for k in range(k_true):
            a = fig.add_subplot(sub[0, k])
            a.imshow(phi[k].reshape(side, side), cmap="RdBu_r", vmin=-vmax, vmax=vmax)
            a.set_xticks([])
            a.set_yticks([])
            if k == 0:
                a.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
    ax = fig.add_subplot(grid[-1])
    for (scheme, tempering), r in results.items():
        if tempering == "mvi" and r["finite"]:
            ax.hist(1.0 / r["inv_temperature"], bins=30, histtype="step", label=scheme)
    ax.set_xlabel("MVI: final 1 / E_q(y_n)[1/T] per training point")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100, bbox_inches="tight")


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    data, train, test, side = make_data(args)
    truth = np.asarray(data.phi)
    true_value = lf.Globals(data.pi, data.phi, jnp.asarray(data.noise_std**-2.0),
                            jnp.asarray(1.0))
    truth_heldout = lf.heldout_log_lik(jax.random.PRNGKey(3), test, true_value).mean
    results = fit_all(args, train, test, truth)
    print_table(results, truth_heldout)
    plot(args, results, truth, side)
    print(f"figure: {args.out}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
