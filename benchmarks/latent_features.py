"""Beta-Bernoulli latent features: four local schemes x three temperings, held-out likelihood.

``python benchmarks/latent_features.py --data {toy,synthetic,digits,PATH.npy} --features K
--passes P --seeds S [--json FILE]``

Fits the finite beta-Bernoulli linear-Gaussian model
(:mod:`numpyro_tempering.models.latent_features`) with the four local schemes of Shah et al.
(Mimno-SVI, MF-SSVI, Titsias-SSVI, Gibbs-SSVI) and batch mean-field VI, each at T = 1,
annealed (linear T_0 = 2 -> 1 over the first half of the steps, local and global updates divided
by T: Mandt et al. 2016, eq. 16-17) and multicanonically (one temperature per data point,
eq. 18), from the same S initialisations (seed s: the same q0 and key for every method).

Data (20% held out at random; the rest is the training set):

* ``toy``: the classic 6 x 6 toy (4 binary features, D = 36), ``--num-data`` points
  (default 1000), pi = 0.5, noise 0.3;
* ``synthetic``: K_true = 20 Gaussian features, D = 64, pi = 0.2, noise 0.5, ``--num-data``
  points (the issue's full size is 10^4);
* ``digits``: scikit-learn's 8 x 8 digits (N = 1797, D = 64, from the installed package);
* ``PATH.npy``: an N x D float array.

Real data (digits, PATH.npy) are centred per column and divided by their overall standard
deviation (the model has no mean term); toy and synthetic data are used as generated.

Reported per method: held-out log-likelihood per point at the posterior-mean globals
(importance sampling over each held-out point's z with w integrated out; mean over seeds, the
estimator's standard error over held-out points, and the range over seeds); the change
against the same scheme at T = 1 (paired per point and seed, with its standard error over
points, and seeds better/worse by more than 3 s.e.); feature recovery (mean |cos| of the
learnt features matched to the truth, toy and synthetic only); seconds per pass after
compilation (median over seeds) and the compile time of the scheme (one compilation serves
its three temperings and all seeds). A fit with a non-finite result counts as a failure and
is excluded from the means (the count is shown).

``--json FILE`` writes ``{method: {"heldout", "heldout_se", "seconds_per_pass", ...}}`` with
methods named ``mimno, mf_ssvi, titsias_ssvi, gibbs_ssvi, batch_mf`` and the tempered
variants suffixed ``_annealed`` and ``_mvi``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_tempering.models import latent_features as lf
from numpyro_tempering.models.latent_features.svi import (
    SCHEMES,
    TEMPERINGS,
    Settings,
    annealing_temperatures,
    make_fit,
)

SUFFIX = {"none": "", "annealed": "_annealed", "mvi": "_mvi"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="toy", help="toy, synthetic, digits or PATH.npy")
    parser.add_argument("--features", type=int, default=None,
                        help="K of the fit (default: 4 toy, 20 synthetic, 16 digits/array)")
    parser.add_argument("--passes", type=int, default=20, help="passes over the training set")
    parser.add_argument("--seeds", type=int, default=5, help="initialisations per method")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--num-data", type=int, default=None,
                        help="toy/synthetic: N (default 1000 toy, 10000 synthetic)")
    parser.add_argument("--batch-size", type=int, default=50, help="SVI minibatch")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--temperings", nargs="+", default=list(TEMPERINGS),
                        choices=list(TEMPERINGS))
    parser.add_argument("--t-start", type=float, default=2.0, help="annealing: initial T")
    parser.add_argument("--ladder-max", type=float, default=10.0, help="MVI: largest T")
    parser.add_argument("--sweeps", type=int, default=10, help="Gibbs sweeps kept per visit")
    parser.add_argument("--local-steps", type=int, default=20,
                        help="L-BFGS iterations of MF-SSVI/Titsias-SSVI per visit")
    parser.add_argument("--is-samples", type=int, default=100,
                        help="importance samples per held-out point")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: toy, N = 300, 3 passes, 2 seeds")
    args = parser.parse_args(argv)
    if args.quick:
        args.data, args.num_data, args.passes, args.seeds = "toy", 300, 3, 2
    return args


# -- data ------------------------------------------------------------------------------------
def standardise(y: np.ndarray) -> np.ndarray:
    """Centre every column, then divide by the overall standard deviation."""
    y = np.asarray(y, np.float64)
    y = y - y.mean(0)
    return y / y.std()


def load_data(args):
    """``(y, true features or None, description)``."""
    key = jax.random.PRNGKey(0)
    if args.data == "toy":
        data = lf.make_toy_data(key, args.num_data or 1000)
        return np.asarray(data.y), np.asarray(data.phi), "6x6 toy (K_true = 4, D = 36)"
    if args.data == "synthetic":
        data = lf.make_data(key, args.num_data or 10_000, num_features=20, dim=64, pi=0.2,
                            noise_std=0.5)
        return np.asarray(data.y), np.asarray(data.phi), "synthetic (K_true = 20, D = 64)"
    if args.data == "digits":
        from sklearn.datasets import load_digits

        return standardise(load_digits().data), None, "scikit-learn digits (8x8, N = 1797)"
    path = Path(args.data)
    if path.suffix != ".npy" or not path.exists():
        raise SystemExit(f"--data must be toy, synthetic, digits or an existing .npy file, "
                         f"got {args.data!r}.")
    y = np.load(path)
    if y.ndim != 2 or not np.issubdtype(y.dtype, np.number) or not np.all(np.isfinite(y)):
        raise SystemExit(f"{path}: expected a finite N x D numeric array, got shape {y.shape} "
                         f"and dtype {y.dtype}.")
    return standardise(y), None, f"{path.name} ({y.shape[0]} x {y.shape[1]})"


# -- fitting ---------------------------------------------------------------------------------
def run_scheme(scheme, train, test, truth, args, settings, num_features):
    """All temperings and seeds of one scheme (one compilation)."""
    n = train.shape[0]
    start = time.perf_counter()
    run = make_fit(scheme, n, num_features, lf.DEFAULT_PRIOR, settings)
    schedule = annealing_temperatures(scheme, n, settings)
    ladder = settings.ladder()
    q0 = lf.init_params(jax.random.PRNGKey(10_000), train, num_features)
    compiled = run.lower(jax.random.PRNGKey(0), train, q0, jnp.int32(0), schedule,
                         ladder).compile()
    compile_s = time.perf_counter() - start
    out = {}
    for tempering in args.temperings:
        code = jnp.int32(TEMPERINGS.index(tempering))
        rows = []
        for seed in range(args.seeds):
            q0 = lf.init_params(jax.random.PRNGKey(100 + seed), train, num_features)
            t = time.perf_counter()
            result = jax.block_until_ready(
                compiled(jax.random.PRNGKey(200 + seed), train, q0, code, schedule, ladder))
            seconds = time.perf_counter() - t
            rows.append(evaluate(result, test, truth, args, seed, seconds / args.passes))
        out[scheme + SUFFIX[tempering]] = rows
    return out, compile_s


def evaluate(result, test, truth, args, seed, seconds_per_pass):
    finite = all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(result.params))
    row = {"seconds_per_pass": seconds_per_pass, "finite": finite,
           "temperature_end": float(result.temperature[-1])}
    if not finite:
        return row
    value = lf.point_estimate(result.params)
    held = lf.heldout_log_lik(jax.random.PRNGKey(300 + seed), test, value,
                              num_samples=args.is_samples)
    row.update(per_point=held.per_point, heldout=held.mean, se=held.se,
               min_ess=float(np.min(held.ess)), finite=held.num_nonfinite == 0)
    if truth is not None:
        row["recovery"] = lf.feature_recovery(value.phi, truth)[0]
    return row


# -- summaries -------------------------------------------------------------------------------
def summarise(rows, reference):
    ok = [r for r in rows if r["finite"]]
    out = {"failures": len(rows) - len(ok),
           "seconds_per_pass": float(np.median([r["seconds_per_pass"] for r in rows]))}
    if not ok:
        out.update(heldout=float("nan"), heldout_se=float("nan"))
        return out
    per_point = np.mean([r["per_point"] for r in ok], axis=0)  # seed average, per point
    out.update(
        heldout=float(per_point.mean()),
        heldout_se=float(per_point.std(ddof=1) / math.sqrt(per_point.size)),
        heldout_seeds=[float(r["heldout"]) for r in ok],
        min_ess=float(min(r["min_ess"] for r in ok)),
        temperature_end=float(np.mean([r["temperature_end"] for r in ok])),
    )
    if "recovery" in ok[0]:
        out["recovery"] = float(np.mean([r["recovery"] for r in ok]))
    if reference is not None:
        pairs = [(r, s) for r, s in zip(rows, reference, strict=True)
                 if r["finite"] and s["finite"]]
        if pairs:
            diffs = np.array([r["per_point"] - s["per_point"] for r, s in pairs])  # (S, N')
            mean_diff = diffs.mean(0)
            se = mean_diff.std(ddof=1) / math.sqrt(mean_diff.size)
            seed_se = diffs.std(1, ddof=1) / math.sqrt(diffs.shape[1])
            seed_mean = diffs.mean(1)
            out.update(
                delta_vs_t1=float(mean_diff.mean()),
                delta_vs_t1_se=float(se),
                seeds_better=int(np.sum(seed_mean > 3 * seed_se)),
                seeds_worse=int(np.sum(seed_mean < -3 * seed_se)),
            )
    return out


def print_table(summary, description, args, train, test, num_features, compile_times):
    print()
    print(f"data: {description}; train {train.shape[0]}, test {test.shape[0]}, fit K = "
          f"{num_features}; {args.passes} passes, {args.seeds} seeds, batch {args.batch_size}")
    header = (f"{'method':<22} {'held-out/pt':>11} {'s.e.':>6} {'seeds [min, max]':>18} "
              f"{'vs T=1':>8} {'s.e.':>5} {'+/-':>5} {'recov':>6} {'T_end':>5} "
              f"{'s/pass':>7} {'fail':>4}")
    print(header)
    print("-" * len(header))
    for name, s in summary.items():
        seeds = s.get("heldout_seeds", [float("nan")])
        delta = (f"{s['delta_vs_t1']:>8.3f} {s['delta_vs_t1_se']:>5.3f} "
                 f"{s['seeds_better']:>2}/{s['seeds_worse']:<2}" if "delta_vs_t1" in s
                 else f"{'':>8} {'':>5} {'':>5}")
        recov = f"{s['recovery']:>6.3f}" if "recovery" in s else f"{'':>6}"
        print(f"{name:<22} {s['heldout']:>11.3f} {s['heldout_se']:>6.3f} "
              f"[{min(seeds):>7.2f}, {max(seeds):>7.2f}] {delta} {recov} "
              f"{s.get('temperature_end', float('nan')):>5.2f} {s['seconds_per_pass']:>7.3f} "
              f"{s['failures']:>4}")
    print("(held-out/pt: mean over seeds of the importance-sampled log p(y | E_q[globals]) per "
          "held-out point; s.e. over held-out points; vs T=1: paired change against the same "
          "scheme at T = 1; +/-: seeds better/worse by > 3 s.e.; recov: mean |cos| of matched "
          "features; T_end: mean temperature used in the last pass)")
    print("compile seconds per scheme: "
          + ", ".join(f"{k} {v:.1f}" for k, v in compile_times.items()))


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    y, truth, description = load_data(args)
    default_k = {"toy": 4, "synthetic": 20}.get(args.data, 16)
    num_features = args.features or default_k
    train, test, _ = lf.split_heldout(jax.random.PRNGKey(1), jnp.asarray(y, jnp.float32), 0.2)
    batch = min(args.batch_size, train.shape[0])
    settings = Settings(batch_size=batch, num_passes=args.passes, t_start=args.t_start,
                        ladder_max=args.ladder_max, num_sweeps=args.sweeps,
                        local_steps=args.local_steps)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, load average "
          f"{os.getloadavg()[0]:.1f}; {settings}")
    rows, compile_times = {}, {}
    for scheme in args.schemes:
        out, compile_times[scheme] = run_scheme(scheme, train, test, truth, args, settings,
                                                num_features)
        rows.update(out)
        print(f"  {scheme}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    summary = {}
    for name, r in rows.items():
        base = next(s for s in args.schemes if name == s or name.startswith(s + "_"))
        reference = rows.get(base) if name != base else None
        summary[name] = summarise(r, reference)
    print_table(summary, description, args, train, test, num_features, compile_times)
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.json}")
    return summary


if __name__ == "__main__":
    main()
