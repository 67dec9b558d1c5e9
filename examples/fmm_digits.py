r"""VI vs annealed VI vs multicanonical VI: factorial mixture model on scikit-learn's digits.

The real-data experiment of annealed-and-multicanonical-vi, section 4 (Fig. 4 middle), with
scikit-learn's bundled 8x8 handwritten digits (1,797 images) in place of the Yale faces. As
the paper did for the faces, the pixels are standardised with the mean and standard deviation
of *all* pixels, and sigma_n = sigma_mu = 0.5; K components (default 8, so 2^8 switch
configurations are enumerated exactly), switch probability pi (default 0.3, not given in
the paper). 500 images are held out.

* **VI**: ``Trace_ELBO`` on the collapsed model (z summed out exactly);
* **AVI**: the paper's joint tempering p(x_n, z_n | mu)^(1/T), ``collapsed_model(x,
  temperature=T_t)``, linear schedule T = 6 -> 1 (the paper's schedule for the faces);
* **MVI**: ``MulticanonicalELBO`` with the paper's ladder (100 temperatures 1..10), log C in
  closed form (``fmm.log_partition``, consistent with the tempering applied: see
  ``examples/fmm_multicanonical.py``, both use ``fmm.multicanonical_model``);
* **MVI+T1**: MVI's result continued for a few hundred plain-VI steps (T = 1) with MVI's
  optimiser state: on real data the learnt E[T] need not reach 1 (a misspecified model
  never fits the data as well as the model at T = 1 expects), and this separates "where MVI
  led" from "MVI's final temperature".

Held-out log predictive per test image, exact in the switches (all 2^K configurations
enumerated): the posterior predictive :math:`\log \frac1S\sum_s p(x^*\mid\mu_s)`,
:math:`\mu_s \sim q(\mu)` (S = 256 draws), and the plug-in :math:`\log p(x^*\mid
\mathbb{E}_q[\mu])`; also the training ELBO at T = 1 per image. Every method starts from
the same prior draw per seed and is compiled once (seeds vmapped).

Needs scikit-learn (an ``examples`` extra). Run: ``python examples/fmm_digits.py``
(defaults: 10 seeds, 1500 steps; 2 to 4 minutes on 2 CPU cores), ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from fmm_common import batch_states, make_step, prior_inits
from jax.scipy.special import logsumexp
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

from numpyro_tempering import Ladder, MulticanonicalELBO, log_weights, temper
from numpyro_tempering.models import fmm
from numpyro_tempering.objectives.multicanonical import record_temperatures
from numpyro_tempering.partition_function import model_sizes

METHODS = ("VI", "AVI", "MVI", "MVI+T1")


def load_digits_standardised(test_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Digits as (N, 64) float arrays, standardised by the mean/std of all pixels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "examples/fmm_digits.py needs scikit-learn for its bundled digits data set: "
            "pip install scikit-learn (or the package's `examples` extra)."
        ) from err
    images = load_digits().data.astype(np.float64)
    images = (images - images.mean()) / images.std()
    order = np.random.default_rng(seed).permutation(len(images))
    return images[order[test_size:]], images[order[:test_size]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--components", type=int, default=8, help="K")
    parser.add_argument("--pi", type=float, default=0.3)
    parser.add_argument("--sigma", type=float, default=0.5, help="sigma_n = sigma_mu")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--polish-steps", type=int, default=300,
                        help="MVI+T1: plain-VI steps continuing MVI's optimiser")
    parser.add_argument("--t0", type=float, default=6.0, help="AVI: initial temperature")
    parser.add_argument("--anneal-steps", type=int, default=750)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--test-size", type=int, default=500)
    parser.add_argument("--draws", type=int, default=256, help="q(mu) draws, predictive")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: K = 6, 2 seeds, 200 steps, 600 training images")
    args = parser.parse_args()
    args.max_train = None
    if args.quick:
        args.components, args.seeds, args.steps, args.anneal_steps = 6, 2, 200, 100
        args.polish_steps = 50
        args.max_train, args.draws = 600, 64
    return args


def make_fit(name, svi, x, inv_t):
    """(state, AVI temperatures) -> (final state, E[T] per step)."""

    step = make_step(name, svi, x, inv_t)

    def fit(state, temperatures):
        (state, _), mean_t = jax.lax.scan(step, (state, jnp.mean(inv_t)), temperatures)
        return state, mean_t

    return fit


def evaluate(params, model, guide, hyper, x_train, x_test, key, draws):
    """Per image: training ELBO at T = 1, held-out predictive and plug-in log-likelihood."""
    weights = log_weights(key, params, temper(model, 1.0), guide, (x_train,), num_particles=32)
    loc, scale = params["mu_auto_loc"], params["mu_auto_scale"]
    eps = jax.random.normal(jax.random.fold_in(key, 1), (draws,) + loc.shape)
    mus = loc + scale * eps
    per_draw = jax.vmap(
        lambda mu: fmm.FactorialMixture(mu, hyper["pi"], hyper["sigma_n"]).log_prob(x_test)
    )(mus)  # (S, N_test)
    predictive = logsumexp(per_draw, axis=0) - np.log(draws)
    plug_in = fmm.FactorialMixture(loc, hyper["pi"], hyper["sigma_n"]).log_prob(x_test)
    return {
        "elbo": float(np.mean(weights.log_w)) / x_train.shape[0],
        "elbo_se": float(np.std(weights.log_w, ddof=1) / np.sqrt(32)) / x_train.shape[0],
        "predictive": float(np.mean(predictive)),
        "per_image": np.asarray(predictive),
        "plug_in": float(np.mean(plug_in)),
    }


def paired_verdict(mine: np.ndarray, ref: np.ndarray) -> int:
    """+1 / -1 if the mean per-image difference exceeds 3 paired standard errors, else 0."""
    diff = mine - ref
    se = np.std(diff, ddof=1) / np.sqrt(diff.size)
    return int(np.sign(diff.mean())) if abs(diff.mean()) > 3 * se else 0


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    x_train, x_test = load_digits_standardised(args.test_size, seed=0)
    if args.max_train:
        x_train = x_train[: args.max_train]
    x_train, x_test = jnp.asarray(x_train, jnp.float32), jnp.asarray(x_test, jnp.float32)
    hyper = dict(num_components=args.components, pi=args.pi, sigma_n=args.sigma,
                 sigma_mu=args.sigma)
    model = functools.partial(fmm.collapsed_model, **hyper)
    mvi = functools.partial(fmm.multicanonical_model, **hyper)
    num_train, dim = x_train.shape

    ladder = Ladder.geometric(1.0, 10.0, 100)
    log_c = fmm.log_partition(jnp.asarray(ladder.temperatures), num_train, dim, args.pi,
                              args.sigma, num_components=args.components)
    ladder = ladder.with_log_partition_values(
        np.asarray(log_c), sizes=model_sizes(mvi, x_train, 1.0, exclude="z_entropy"))
    inv_t = jnp.asarray(ladder.inverse_temperatures, x_train.dtype)

    optim = optax.adam(optax.cosine_decay_schedule(args.lr, args.steps, alpha=0.05), b2=0.99)
    guides = {m: AutoNormal(mvi if m == "MVI" else model, init_scale=0.1) for m in METHODS[:3]}
    svis = {
        "VI": SVI(model, guides["VI"], optim, Trace_ELBO()),
        "AVI": SVI(model, guides["AVI"], optim, Trace_ELBO()),
        "MVI": SVI(record_temperatures(mvi, ladder, args.steps), guides["MVI"], optim,
                   MulticanonicalELBO(ladder, exclude="z_entropy")),
    }
    frac = jnp.clip(jnp.arange(args.steps) / args.anneal_steps, 0.0, 1.0)
    avi_temps = args.t0 + (1.0 - args.t0) * frac

    keys = jax.random.split(jax.random.PRNGKey(1), args.seeds)
    mu_shape = (args.components, dim)
    inits = prior_inits(keys, mu_shape, args.sigma)
    init_args = {"VI": (x_train,), "AVI": (x_train,), "MVI": (x_train, 1.0)}
    print(f"digits: {num_train} training / {x_test.shape[0]} held-out images, D = {dim}, "
          f"K = {args.components}, pi = {args.pi}, sigma_n = sigma_mu = {args.sigma}")
    # MVI+T1: MVI's result continued at T = 1 (plain VI) with MVI's optimiser state
    polish = SVI(model, guides["VI"], optim, Trace_ELBO())
    polish.init(keys[0], x_train)  # sets up its parameter transforms; the state is MVI's
    svis["MVI+T1"] = polish
    results, mean_ts, finals = {}, {}, {}
    for name, svi in svis.items():
        if name == "MVI+T1":
            batch = finals["MVI"]._replace(mutable_state=None)
            temps, fit = jnp.ones(args.polish_steps), make_fit("VI", svi, x_train, inv_t)
        else:
            batch = batch_states(svi, keys, inits, *init_args[name])
            temps, fit = avi_temps, make_fit(name, svi, x_train, inv_t)
        t = time.perf_counter()
        final, mean_t = jax.jit(jax.vmap(fit, in_axes=(0, None)))(batch, temps)
        jax.block_until_ready(mean_t)
        print(f"{name:>6}: {args.seeds} seeds x {temps.shape[0]} steps in "
              f"{time.perf_counter() - t:.1f} s (one compile)")
        mean_ts[name], finals[name] = np.asarray(mean_t), final
        results[name] = [
            evaluate(svi.get_params(jax.tree.map(lambda a, i=i: a[i], final)), model,
                     guides["VI"], hyper, x_train, x_test, jax.random.PRNGKey(2), args.draws)
            for i in range(args.seeds)
        ]

    print()
    width = 8 * len(METHODS)
    print(f"{'':>4} | {'train ELBO(T=1) / image':^{width}} | "
          f"{'held-out log predictive / image':^{width}} | "
          f"{'plug-in log p(x*|E[mu])':^{width}}")
    names = "".join(f"{m:>8}" for m in METHODS)
    print(f"{'seed':>4} | {names} | {names} | {names}")
    for s in range(args.seeds):
        cells = {key: "".join(f"{results[m][s][key]:>8.2f}" for m in METHODS)
                 for key in ("elbo", "predictive", "plug_in")}
        print(f"{s:>4} | {cells['elbo']} | {cells['predictive']} | {cells['plug_in']}")
    print()
    print(f"{'method':>6} | {'mean ELBO':>9} | {'mean predictive':>15} | "
          f"{'best predictive in':>18} | {'ELBO > VI':>9} | {'> VI (raw)':>10} | "
          f"{'vs VI: win/tie/loss':>19}")
    for m in METHODS:
        pred = np.array([r["predictive"] for r in results[m]])
        best = sum(
            pred[s] >= max(results[o][s]["predictive"] for o in METHODS) for s in range(args.seeds)
        )
        versus = raw = elbo_wins = "-"
        if m != "VI":
            pairs = zip(results[m], results["VI"], strict=True)
            elbo_wins = f"{sum(r['elbo'] > v['elbo'] for r, v in pairs)}/{args.seeds}"
            raw = f"{sum(pred[s] > results['VI'][s]['predictive'] for s in range(args.seeds))}"
            raw += f"/{args.seeds}"
            verdicts = [paired_verdict(results[m][s]["per_image"], results["VI"][s]["per_image"])
                        for s in range(args.seeds)]
            versus = "/".join(str(verdicts.count(v)) for v in (1, 0, -1))
        print(f"{m:>6} | {np.mean([r['elbo'] for r in results[m]]):>9.2f} | "
              f"{pred.mean():>15.2f} | {best:>15}/{args.seeds} | {elbo_wins:>9} | {raw:>10} | "
              f"{versus:>19}")
    final_t = mean_ts["MVI"][:, -1]
    elbo_se = max(r["elbo_se"] for m in METHODS for r in results[m])
    print("(ELBO > VI: seeds with a higher training ELBO at T = 1 than VI's (its Monte Carlo "
          f"s.e. is <= {elbo_se:.4f} per image);\n"
          "> VI (raw): seeds with a higher held-out predictive than VI's; win/loss: higher/"
          "lower than VI's by more than 3 paired standard\n"
          f"errors over the {x_test.shape[0]} test images)\nMVI: E[T] at step 1 "
          f"{np.median(mean_ts['MVI'][:, 0]):.2f}, at the end in [{final_t.min():.3f}, "
          f"{final_t.max():.3f}]; total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
