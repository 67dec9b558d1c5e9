r"""Why multicanonical VI settles hot in stuck runs on the toy FMM: a controlled experiment.

Issue 19, item 4. Same data, ladder, guides, optimiser and initial features as
``examples/fmm_multicanonical.py`` (which this script imports). Three candidate causes of a
final :math:`\mathbb{E}_{q(y)}[T] \approx 1.5`-2.3 in runs that end in a poor local optimum:

1. **Noise**: eq. 18 of Mandt et al. 2016 is a softmax of the Monte Carlo expected
   log-likelihood :math:`\ell` (one particle per step); the softmax of a noisy estimate is
   biased. Test: at every MVI run's final fit, :math:`\ell` from 256 particles, the
   standard deviation of the one-particle estimate, the gap between the two best
   log-weights of eq. 18 (in nats), and :math:`\mathbb{E}[T]` of eq. 18 averaged over
   one-particle estimates against :math:`\mathbb{E}[T]` at the 256-particle mean.
2. **The ladder's prior**: uniform over 100 geometric rungs (more mass at high T per unit
   T). Test: eq. 18 at the same fit with a prior :math:`\pi_m \propto T_m^{-3}` (1000 times
   more weight at T = 1 than at T = 10), and the log-weight gap between T = 1 and the
   optimum, to compare with :math:`\log(\pi_{\max}/\pi_{\min})`.
3. **The dynamics**: eq. 18 is exact for the current fit, and a fit in a poor local optimum
   looks hot; the harm is done early, when eq. 18 cools as fast as Adam improves the fit,
   before the features have separated. Test: the E[T] trajectory per seed against the
   outcome, and the same runs with a *damped* q(y) (``MulticanonicalELBO(step_size=...)``:
   a running average of eq. 18's log-weights), everything else equal.

Run: ``python examples/fmm_mvi_diagnosis.py`` (20 seeds, N = 1000: VI and four MVI variants,
25 minutes on 2 busy cores); ``--causes-only`` for eq. 18's runs and the noise / prior table
(18 minutes busy); ``--quick`` for a smoke run. Prints the tables quoted in
docs/multicanonical.md.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from fmm_common import batch_states, evaluate, prior_inits, verdict
from fmm_multicanonical import PI, SIGMA_MU, SIGMA_N, build, make_fit, make_ladder, run_method
from numpyro.infer import SVI

from numpyro_tempering import Ladder, MulticanonicalELBO
from numpyro_tempering.models import fmm
from numpyro_tempering.objectives.multicanonical import record_temperatures
from numpyro_tempering.temperatures import (
    TemperatureRecord,
    robbins_monro,
    temperature_posterior,
)

#: the q(y) updates compared: name -> MulticanonicalELBO(step_size=...)
VARIANTS = {
    "eq. 18": None,
    "RM 1024/0.7": robbins_monro(1024.0, 0.7),
    "rho 0.01": 0.01,
    "rho 0.002": 0.002,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--num-data", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--particles", type=int, default=256,
                        help="particles of the reference expected log-likelihood")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS),
                        help=f"q(y) updates to run, of {list(VARIANTS)}")
    parser.add_argument("--causes-only", action="store_true",
                        help="only eq. 18's runs and the noise / prior table (no VI, no damping)")
    parser.add_argument("--quick", action="store_true", help="3 seeds, N = 300, 300 steps")
    args = parser.parse_args()
    # what fmm_multicanonical's helpers read
    args.t0, args.anneal_steps, args.ladder, args.t_max = 10.0, args.steps // 2, 100, 10.0
    args.lr, args.eval_every, args.eval_particles, args.data_seed = 0.02, 50, 64, 0
    args.q_y_step = "eq18"  # build()'s own MVI is not used here
    if args.quick:
        args.seeds, args.num_data, args.steps, args.anneal_steps = 3, 300, 300, 150
    return args


def ell_particles(params, guide, x, beta, ladder, key, num):
    """One-particle estimates of l = E_q[sum_n E_q(z_n)[log p(x_n, z_n | mu)]] at q(z)'s
    inverse temperature ``beta`` (the tempered group of the M-ELBO), ``(num,)``."""
    elbo = MulticanonicalELBO(ladder, exclude="z_entropy", num_particles=num)
    weights, _ = elbo._weights(key, params, fmm.multicanonical_model, guide, (x, beta), {})
    return np.asarray(weights.log_lik, float)


def residual_ratio(mu, x, beta) -> float:
    """Mean squared residual per pixel over sigma_n^2, under q(z_n = c) proportional to
    p(x_n, c | mu)^beta at the guide's mean features: the temperature at which the tempered
    model's noise (variance T sigma_n^2) explains the residuals."""
    k = mu.shape[0]
    configs = jnp.array(np.array(np.meshgrid(*[[0, 1]] * k, indexing="ij")).reshape(k, -1).T,
                        x.dtype)  # (2^K, K)
    sq = jnp.sum((x[:, None, :] - (configs @ mu)[None]) ** 2, -1)  # (N, 2^K)
    log_prior = configs @ jnp.full(k, np.log(PI)) + (1 - configs) @ jnp.full(k, np.log(1 - PI))
    q = jax.nn.softmax(beta * (log_prior - sq / (2 * SIGMA_N**2)), axis=-1)
    return float(jnp.mean(jnp.sum(q * sq, -1)) / (x.shape[1] * SIGMA_N**2))


def cause_table(params_list, final_beta, guide, x, ladder, num):
    """Causes 1 and 2 at each final fit."""
    temps = np.asarray(ladder.temperatures, float)
    inv_t = 1.0 / temps
    log_c = np.asarray(ladder.log_c, float)
    cold_pi = temps ** -3.0
    cold = Ladder(temps, weights=cold_pi / cold_pi.sum()).with_log_partition_values(log_c)
    rows = []
    for s, params in enumerate(params_list):
        ell = ell_particles(params, guide, x, float(final_beta[s]), ladder,
                            jax.random.PRNGKey(1000 + s), num)
        mean = ell.mean()
        exact = temperature_posterior(jnp.asarray(mean * inv_t), ladder)
        noisy = temperature_posterior(jnp.asarray(ell[:, None] * inv_t), ladder)
        logits = mean * inv_t - log_c  # uniform prior: log pi is a constant
        top = np.max(logits)
        rows.append({
            "ell": mean,
            "sd": ell.std(ddof=1),
            "t_sd": float(np.std(noisy.mean_temperature)),
            "t1_gap": top - logits[0],
            "t_exact": float(exact.mean_temperature),
            "t_noisy": float(np.mean(noisy.mean_temperature)),
            "resid": residual_ratio(params["mu_auto_loc"], x, float(final_beta[s])),
            "t_cold": float(temperature_posterior(jnp.asarray(mean * inv_t), cold)
                            .mean_temperature),
        })
    return rows


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    data = fmm.make_toy_data(jax.random.PRNGKey(args.data_seed), args.num_data, pi=PI,
                             sigma_n=SIGMA_N)
    x = data.x
    ladder = make_ladder(args, x)
    inv_t = jnp.asarray(ladder.inverse_temperatures, x.dtype)
    guides, svis, avi_temperatures, optim = build(args, x, ladder)
    keys = jax.random.split(jax.random.PRNGKey(1), args.seeds)
    inits = prior_inits(keys, data.mu.shape, SIGMA_MU)
    eval_key = jax.random.PRNGKey(2)

    def fit_and_evaluate(name, svi, init_args):
        batch = batch_states(svi, keys, inits, *init_args)
        fit = make_fit(name, svi, guides["VI"], x, inv_t, args.eval_every)
        finals, traces, mean_t, states = run_method(name, svi, batch, fit, avi_temperatures,
                                                    args.seeds)
        results = [evaluate(p, guides["VI"], x, data.mu, eval_key, args.eval_particles, PI,
                            SIGMA_N) for p in finals]
        records = [v for v in (states.mutable_state or {}).values()
                   if isinstance(v, TemperatureRecord)]
        beta = np.asarray(records[0].mean_inverse_temperature[:, -1]) if records else None
        return finals, traces, mean_t, results, beta

    if args.causes_only:
        args.variants = ["eq. 18"]
    else:
        vi = fit_and_evaluate("VI", svis["VI"], (x,))[3]
    runs = {}
    for name in args.variants:
        svi = SVI(record_temperatures(fmm.multicanonical_model, ladder, args.steps),
                  guides["MVI"], optim,
                  MulticanonicalELBO(ladder, exclude="z_entropy", step_size=VARIANTS[name]))
        runs[name] = fit_and_evaluate("MVI", svi, (x, 1.0))

    # -- 3: outcomes and trajectories ------------------------------------------------------
    if not args.causes_only:
        outcomes(args, runs, vi)
    causes(args, runs, guides, x, ladder)
    print(f"\ntotal time {time.perf_counter() - start:.0f} s")


def outcomes(args, runs, vi) -> None:
    """Cause 3: each q(y) update's outcome per seed and its E[T] trajectory."""
    print("\nELBO at T = 1 per seed (+/=/- against VI by 3 s.e.) and final E[T]")
    print(f"{'seed':>4} {'VI':>7} | " + " | ".join(f"{n:>17}" for n in runs))
    for s in range(args.seeds):
        cells = []
        for _name, (_, _, mean_t, res, _) in runs.items():
            mark = "+=-"[1 - verdict(res[s], vi[s])]
            cells.append(f"{res[s]['elbo']:>7.0f}{mark} T={mean_t[s, -1]:5.2f}")
        print(f"{s:>4} {vi[s]['elbo']:>7.0f} | " + " | ".join(f"{c:>17}" for c in cells))
    print(f"\n{'q(y) update':>12} | win/tie/loss vs VI | stuck (ELBO < 8600) | E[T] at step "
          "10 / 50 / 100 / 200 / 500 / 1000 (median) | first step E[T] < 2 (median)")
    for name, (_, _, mean_t, res, _) in runs.items():
        v = [verdict(res[s], vi[s]) for s in range(args.seeds)]
        stuck = sum(r["elbo"] < 8600 * args.num_data / 1000 for r in res)
        at = [float(np.median(mean_t[:, min(i, mean_t.shape[1]) - 1]))
              for i in (10, 50, 100, 200, 500, 1000)]
        below = [int(np.argmax(t < 2.0)) + 1 if np.any(t < 2.0) else -1 for t in mean_t]
        print(f"{name:>12} | {v.count(1):>4}/{v.count(0)}/{v.count(-1):<9} | "
              f"{stuck:>6}/{args.seeds:<12} | "
              + " / ".join(f"{a:.2f}" for a in at)
              + f" | {int(np.median(below))}")

    # trajectory against outcome, eq. 18 (the undamped update)
    if "eq. 18" in runs:
        _, traces, mean_t, res, _ = runs["eq. 18"]
        print("\neq. 18 per seed: E[T] at steps 25/50/100/200 and ELBO(T=1) at steps 100/200/"
              "500/end; final verdict against VI")
        for s in range(args.seeds):
            v = "+=-"[1 - verdict(res[s], vi[s])]
            ts = " ".join(f"{mean_t[s, min(i, args.steps) - 1]:5.2f}"
                          for i in (25, 50, 100, 200))
            es = " ".join(f"{traces[s, min(i, args.steps) // args.eval_every - 1]:7.0f}"
                          for i in (100, 200, 500, args.steps))
            print(f"{s:>4} {v} | T {ts} | ELBO {es} | final T {mean_t[s, -1]:.2f}")



def causes(args, runs, guides, x, ladder) -> None:
    """Causes 1 and 2: noise and prior at eq. 18's final fits."""
    for name in [n for n in ("eq. 18",) if n in runs]:
        finals, _, mean_t, res, final_beta = runs[name]  # beta: q(z)'s last E[1/T]
        temps = np.asarray(ladder.temperatures)
        rows = cause_table(finals, final_beta, guides["MVI"], x, ladder, args.particles)
        print(f"\n{name}: at each final fit, l from {args.particles} particles")
        print(f"{'seed':>4} {'ELBO':>7} | {'l':>9} {'sd(l)':>6} | {'E[T]':>6} "
              f"{'E[T] 1-part.':>12} {'E[T] cold pi':>12} | {'sd 1-part.':>11} "
              f"{'gap to T=1':>10} | {'resid/sn^2':>10}")
        for s, r in enumerate(rows):
            print(f"{s:>4} {res[s]['elbo']:>7.0f} | {r['ell']:>9.1f} {r['sd']:>6.2f} | "
                  f"{r['t_exact']:>6.3f} {r['t_noisy']:>12.3f} {r['t_cold']:>12.3f} | "
                  f"{r['t_sd']:>11.4f} {r['t1_gap']:>10.1f} | {r['resid']:>10.3f}")
        print(f"(log pi range of the cold prior: {3 * np.log(temps[-1] / temps[0]):.1f} nats; "
              "uniform prior: 0)")


if __name__ == "__main__":
    main()
