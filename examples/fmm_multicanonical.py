r"""VI vs annealed VI vs multicanonical VI on the toy factorial mixture model.

Reproduces the toy experiment of annealed-and-multicanonical-vi, section 4 (Fig. 4 left and
Fig. 5): 8 hand-made binary 4x4 features weighted by U[0.5, 1] (``fmm.make_toy_data``),
switch probability pi = 0.3, noise sigma_n = 0.1, prior sigma_mu = 0.35. A mean-field
Gaussian guide on the 8 x 16 feature matrix (``AutoNormal``) is fitted from the same random
initialisation (a draw from the prior) with the same optimiser and number of steps by:

* **VI**: ``Trace_ELBO`` on the collapsed model (the switches z summed out exactly);
* **AVI**: the paper's annealing, a linear schedule T = 10 -> 1, tempering the *local joint*
  p(x_n, z_n | mu)^(1/T) (eq. 4 and 7): ``fmm.collapsed_model(x, temperature=T_t)``, whose
  density is sum_z p(x_n, z | mu)^(1/T), i.e. the tempered ELBO maximised over a free-form
  q(z_n | mu);
* **MVI**: :class:`~numpyro_tempering.MulticanonicalELBO` (eq. 13 with the closed-form q(y)
  of eq. 18) with the paper's ladder, 100 temperatures from 1 to 10 on a geometric scale,
  and by default a *damped* q(y) (``--q-y-step``, ``MulticanonicalELBO(step_size=...)``):
  a Robbins-Monro average of eq. 18's log-weights with the paper's
  :math:`\rho_t = (1024 + t)^{-0.7}`, from the paper's uniform q(y). ``--q-y-step eq18``
  recomputes eq. 18 at every step instead; docs/multicanonical.md ("Why MVI settled hot on
  the FMM, and the remedy") shows why the damped update is the default and what it does
  not fix;
* **MVI+T1** (a diagnostic): MVI's result continued for ``--polish-steps`` plain-VI steps
  with MVI's optimiser state. The learnt E[T] need not return to 1 (in a poor local optimum
  the data look "hot" to the model), and this separates the optimum MVI led to from its
  final temperature.

Which tempering, and which log C
--------------------------------
The paper tempers p(x_n, z_n | mu) *jointly*; its partition function is independent of mu and
known in closed form, :func:`numpyro_tempering.models.fmm.log_partition` (with
``normalised=True``: the Gaussian and Bernoulli densities tempered *whole*, normalisers
included, as NumPyro computes them; the paper's section C drops the Gaussian normaliser).
Tempering the *collapsed* likelihood p(x_n | mu)^(1/T) instead (``temper(collapsed_model)``)
would need :math:`\int p(x_n\mid\mu)^{1/T} dx_n` of a 256-component mixture in 16
dimensions, which depends on mu and has no closed form, so we do not use it.

The M-ELBO (eq. 13) needs the expected tempered group :math:`\ell = \mathbb{E}_q[\log p(x, z
\mid \mu)]` under a q(z), and the entropy of q(z) untempered.
:func:`~numpyro_tempering.models.fmm.multicanonical_model` supplies both for the optimal
local factor of the current effective inverse temperature
:math:`\bar\beta = \mathbb{E}_{q(y)}[1/T_y]` (eq. 15-17, the local step of Algorithm 1),

.. math::

    q(z_n = c \mid \mu) = \mathrm{softmax}_c\big(\bar\beta \log p(x_n, c \mid \mu)\big),

enumerated over the 2^8 configurations c: a factor ``x_z`` with
:math:`\mathbb{E}_{q(z_n)}[\log p(x_n, z_n \mid \mu)]` (the tempered group) and a factor
``z_entropy`` with :math:`H[q(z_n)]`, excluded from tempering. MulticanonicalELBO then
computes q(y) by eq. 18 from the current :math:`\ell` and returns the M-ELBO; the new
:math:`\bar\beta` read from its recorded q(y) is used for q(z) at the next step (as in
Algorithm 1: local step at the current temperature, global step, then the temperature
update). At :math:`\bar\beta` the objective equals the jointly tempered ELBO that AVI
optimises, :math:`\mathbb{E}_q[\log p(\mu) - \log q(\mu) + \sum_n \log \sum_z p(x_n, z\mid
\mu)^{\bar\beta}]`, up to y-only terms -- so VI, AVI and MVI differ *only* in the inverse
temperature schedule: 1, linear in T, or chosen by the data. The tempered group of
:func:`~numpyro_tempering.models.fmm.multicanonical_model` is the expectation of
exactly the tempered group of ``temper(fmm.model, T, latent="z")``, whose normaliser is
``fmm.log_partition``; the script checks this closed form against the package's generic
estimator (``log_partition(..., latent="z")``) before fitting.

Evaluation: the ELBO at T = 1 (z summed out exactly; mean +- standard error over many
particles from the log-weight engine), the exact log-likelihood log p(x | E_q[mu]) (z
enumerated) and the RMS error of the features after matching them to the truth
(``fmm.component_error``). A method *wins* a seed against VI when its final ELBO is higher by
more than 3 standard errors (a loss when lower by as much; otherwise a tie).

Every method is compiled once (its seeds are vmapped in one ``jax.jit``).
Run: ``python examples/fmm_multicanonical.py`` (defaults: 20 seeds, N = 1000, 2000 steps;
3 to 5 minutes on 2 CPU cores), ``--quick`` for a smoke run (about 25 s); writes
examples/output/fmm_multicanonical.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from fmm_common import (
    batch_states,
    evaluate,
    make_step,
    plot_features,
    print_seed_table,
    prior_inits,
    unstack_params,
    verdict,
)
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

from numpyro_tempering import Ladder, MulticanonicalELBO, log_partition
from numpyro_tempering.models import fmm
from numpyro_tempering.objectives.multicanonical import record_temperatures
from numpyro_tempering.partition_function import model_sizes
from numpyro_tempering.temperatures import robbins_monro

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = ("VI", "AVI", "MVI", "MVI+T1")
FITTED = METHODS[:3]
COLOURS = {"VI": "tab:grey", "AVI": "tab:blue", "MVI": "tab:red", "MVI+T1": "tab:purple"}
PI, SIGMA_N, SIGMA_MU, K = 0.3, 0.1, 0.35, 8
#: MVI's q(y) update (``--q-y-step``); see docs/multicanonical.md, "Why MVI settled hot"
DEFAULT_Q_Y_STEP = "rm:1024,0.7"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="number of random restarts")
    parser.add_argument("--steps", type=int, default=2000, help="Adam steps per run")
    parser.add_argument("--num-data", type=int, default=1000, help="N (the paper: 10,000)")
    parser.add_argument("--t0", type=float, default=10.0, help="AVI: initial temperature")
    parser.add_argument("--anneal-steps", type=int, default=1000,
                        help="AVI: steps of linear annealing from T0 to 1")
    parser.add_argument("--ladder", type=int, default=100, help="MVI: number of temperatures")
    parser.add_argument("--t-max", type=float, default=10.0, help="MVI: largest temperature")
    parser.add_argument("--q-y-step", default=DEFAULT_Q_Y_STEP,
                        help="MVI: q(y)'s update, MulticanonicalELBO(step_size=...): 'eq18' "
                             "(the exact optimum at every step), a constant rho in (0, 1], or "
                             "'rm:TAU,KAPPA' (Robbins-Monro rho_t = (TAU + t)^-KAPPA), or "
                             "'every:N' (eq. 18 every N steps, held between: the paper's); "
                             "default %(default)s")
    parser.add_argument("--lr", type=float, default=0.02, help="Adam learning rate (cosine decay)")
    parser.add_argument("--polish-steps", type=int, default=300,
                        help="MVI+T1: steps of plain VI (T = 1) continuing MVI's optimiser "
                             "(at its final learning rate)")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between ELBO(T=1)")
    parser.add_argument("--eval-particles", type=int, default=64,
                        help="particles of the final ELBO estimate")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 3 seeds, N = 300, 300 steps")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "output" / "fmm_multicanonical.png")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.num_data, args.steps, args.anneal_steps = 3, 300, 300, 150
        args.polish_steps = 100
    if args.steps % args.eval_every or args.polish_steps % args.eval_every:
        parser.error("--steps and --polish-steps must be multiples of --eval-every")
    return args


def q_y_step_size(spec: str):
    """``--q-y-step`` as ``MulticanonicalELBO``'s ``step_size``."""
    if spec == "eq18":
        return None
    if spec.startswith("every:"):
        every = int(spec[6:])
        return lambda t: jnp.where(jnp.asarray(t) % every == 0, 1.0, 0.0)
    if spec.startswith("rm:"):
        tau, kappa = (float(v) for v in spec[3:].split(","))
        return robbins_monro(tau, kappa)
    return float(spec)


def make_ladder(args, x) -> Ladder:
    """The paper's ladder with the closed-form log C of the jointly tempered FMM.

    Checked against the generic estimator run on the explicit model with z tempered (the
    estimate has zero variance here: C(T) does not depend on mu).
    """
    num_data, dim = x.shape
    ladder = Ladder.geometric(1.0, args.t_max, args.ladder)
    temps = jnp.asarray(ladder.temperatures)
    closed = np.asarray(fmm.log_partition(temps, num_data, dim, PI, SIGMA_N))
    generic = log_partition(jax.random.PRNGKey(3), fmm.model, temps, x, num_samples=2,
                            latent="z")
    if not np.allclose(generic.log_c, closed, rtol=1e-4, atol=1e-2):
        raise AssertionError(f"log C mismatch: closed form {closed[-1]}, generic "
                             f"{float(generic.log_c[-1])} at T = {args.t_max}")
    sizes = model_sizes(fmm.multicanonical_model, x, 1.0, exclude="z_entropy")
    return ladder.with_log_partition_values(closed, sizes=sizes)


def build(args, x, ladder):
    """SVI objects (one guide each: the models take different arguments) and T schedules."""
    optim = optax.adam(optax.cosine_decay_schedule(args.lr, args.steps, alpha=0.05), b2=0.99)
    guides = {"VI": AutoNormal(fmm.collapsed_model, init_scale=0.1),
              "AVI": AutoNormal(fmm.collapsed_model, init_scale=0.1),
              "MVI": AutoNormal(fmm.multicanonical_model, init_scale=0.1)}
    svis = {
        "VI": SVI(fmm.collapsed_model, guides["VI"], optim, Trace_ELBO()),
        "AVI": SVI(fmm.collapsed_model, guides["AVI"], optim, Trace_ELBO()),
        "MVI": SVI(
            record_temperatures(fmm.multicanonical_model, ladder, args.steps),
            guides["MVI"],
            optim,
            MulticanonicalELBO(ladder, exclude="z_entropy",
                               step_size=q_y_step_size(args.q_y_step)),
        ),
    }
    frac = jnp.clip(jnp.arange(args.steps) / args.anneal_steps, 0.0, 1.0)
    avi_temperatures = args.t0 + (1.0 - args.t0) * frac
    return guides, svis, avi_temperatures, optim


def make_fit(name, svi, eval_guide, x, inv_t, eval_every):
    """(state, AVI temperatures) -> (final state, ELBO at T = 1 every ``eval_every`` steps,
    E[T] per step)."""
    elbo = Trace_ELBO(num_particles=8)
    step = make_step(name, svi, x, inv_t)  # MVI: q(z) at the current E[1/T]

    def chunk(carry, inputs):
        index, temps = inputs
        carry, mean_t = jax.lax.scan(step, carry, temps)
        key = jax.random.fold_in(jax.random.PRNGKey(123), index)
        params = svi.get_params(carry[0])
        return carry, (-elbo.loss(key, params, fmm.collapsed_model, eval_guide, x), mean_t)

    def fit(state, temperatures):
        temps = temperatures.reshape(-1, eval_every)
        beta0 = jnp.mean(inv_t)  # q(y) uniform at the start (the paper's initialisation)
        (state, _), (trace, mean_t) = jax.lax.scan(
            chunk, (state, beta0), (jnp.arange(temps.shape[0]), temps))
        return state, trace, mean_t.reshape(-1)

    return fit


def print_table(results, truth_loglik, final_t):
    print_seed_table(results, METHODS, truth_loglik, width=9, decimals=0,
                     extra=("MVI", "E[T] end", final_t))
    print()
    print(f"{'method':>6} | {'mean ELBO':>9} | {'median':>7} | {'mean RMSE':>9} | "
          f"{'RMSE<0.05':>9} | {'vs VI: win/tie/loss (3 s.e.)':>28} | {'RMSE < VI':>9}")
    num = len(results)
    for m in METHODS:
        elbos = np.array([r[m]["elbo"] for r in results])
        errors = np.array([r[m]["error"] for r in results])
        found = int(np.sum(errors < 0.05))
        if m == "VI":
            versus, lower = "-", "-"
        else:
            v = [verdict(r[m], r["VI"]) for r in results]
            versus = f"{v.count(1)}/{v.count(0)}/{v.count(-1)} ({v.count(1) / num:.0%} wins)"
            lower = f"{sum(r[m]['error'] < r['VI']['error'] - 1e-3 for r in results)}/{num}"
        print(f"{m:>6} | {elbos.mean():>9.0f} | {np.median(elbos):>7.0f} | "
              f"{errors.mean():>9.3f} | {found:>6}/{num:<2} | {versus:>28} | {lower:>9}")
    print("(RMSE<0.05: all 8 features recovered; RMSE < VI: seeds with a lower feature error "
          "than VI's by > 0.001; MVI+T1: MVI's result followed by a short plain-VI finish)")


def plot(args, results, traces, mean_ts, truth):
    fig = plt.figure(figsize=(16, 6))
    grid = fig.add_gridspec(len(METHODS) + 1, 3, width_ratios=[1.1, 1.1, 1.6], wspace=0.4)
    ax = fig.add_subplot(grid[:, 0])
    steps = np.arange(1, traces["VI"].shape[1] + 1) * args.eval_every
    finals = [r[m]["elbo"] for r in results for m in METHODS]
    spread = max(max(finals) - min(finals), 100.0)
    for m in FITTED:
        for s, trace in enumerate(traces[m]):
            ax.plot(steps, trace, color=COLOURS[m], alpha=0.6, lw=1.0,
                    label=m if s == 0 else None)
    ax.set_ylim(min(finals) - 0.6 * spread, max(finals) + 0.1 * spread)
    ax.set_xlabel("Adam step")
    ax.set_ylabel("ELBO at T = 1 (8 particles)")
    ax.set_title(f"{args.seeds} seeds, N = {args.num_data}")
    ax.legend(loc="lower right")

    ax = fig.add_subplot(grid[:, 1])
    step_axis = np.arange(1, args.steps + 1)
    for s, mean_t in enumerate(mean_ts["MVI"]):
        ax.plot(step_axis, mean_t, color=COLOURS["MVI"], alpha=0.4, lw=1.0,
                label="MVI: E_q(y)[T] (eq. 18), per seed" if s == 0 else None)
    ax.plot(step_axis, mean_ts["AVI"][0], color=COLOURS["AVI"], lw=2, ls="--",
            label="AVI: linear schedule")
    ax.set_xscale("log")
    ax.set_xlabel("Adam step")
    ax.set_ylabel("temperature")
    ax.set_title("learnt temperature")
    ax.legend(loc="center left")

    gains = [r["MVI"]["elbo"] - r["VI"]["elbo"] for r in results]
    seed = int(np.argmax(gains))
    plot_features(fig, [grid[i, 2] for i in range(len(METHODS) + 1)], results[seed], METHODS,
                  truth)
    fig.text(0.74, 0.97, f"features after matching to the truth (seed {seed}: largest "
             "MVI gain)", ha="center")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110, bbox_inches="tight")


def run_method(name, svi, batch, fit, temperatures, num_seeds):
    """Fit all seeds (a batch of states) in one compiled, vmapped call; return final params,
    ELBO traces, E[T] per step and the final states."""
    t = time.perf_counter()
    final, trace, mean_t = jax.jit(jax.vmap(fit, in_axes=(0, None)))(batch, temperatures)
    jax.block_until_ready(trace)
    seconds = time.perf_counter() - t
    print(f"{name:>6}: {num_seeds} seeds x {temperatures.shape[0]} steps in {seconds:.1f} s "
          "(one compile)")
    params = unstack_params(svi, final, num_seeds)
    return params, np.asarray(trace), np.asarray(mean_t), final


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    data = fmm.make_toy_data(jax.random.PRNGKey(args.data_seed), args.num_data,
                             pi=PI, sigma_n=SIGMA_N)
    x = data.x
    ladder = make_ladder(args, x)
    inv_t = jnp.asarray(ladder.inverse_temperatures, x.dtype)
    guides, svis, avi_temperatures, optim = build(args, x, ladder)
    truth_loglik = float(fmm.FactorialMixture(data.mu, PI, SIGMA_N).log_prob(x).sum())

    keys = jax.random.split(jax.random.PRNGKey(1), args.seeds)
    # the same initial features per seed for every method: a draw from the prior
    inits = prior_inits(keys, data.mu.shape, SIGMA_MU)
    init_args = {"VI": (x,), "AVI": (x,), "MVI": (x, 1.0)}
    traces, mean_ts, finals, states = {}, {}, {}, {}
    for name, svi in svis.items():
        batch = batch_states(svi, keys, inits, *init_args[name])
        fit = make_fit(name, svi, guides["VI"], x, inv_t, args.eval_every)
        finals[name], traces[name], mean_ts[name], states[name] = run_method(
            name, svi, batch, fit, avi_temperatures, args.seeds)

    # MVI+T1: MVI's result (which may end at E[T] > 1) continued with plain VI at T = 1,
    # with MVI's optimiser state (so at its final, decayed learning rate)
    polish = SVI(fmm.collapsed_model, guides["VI"], optim, Trace_ELBO())
    polish.init(keys[0], x)  # sets up its parameter transforms; the state is MVI's
    fit = make_fit("VI", polish, guides["VI"], x, inv_t, args.eval_every)
    finals["MVI+T1"], traces["MVI+T1"], _, _ = run_method(
        "MVI+T1", polish, states["MVI"]._replace(mutable_state=None), fit,
        jnp.ones(args.polish_steps), args.seeds)

    eval_key = jax.random.PRNGKey(2)
    results = [
        {m: evaluate(finals[m][s], guides["VI"], x, data.mu, eval_key, args.eval_particles,
                     PI, SIGMA_N)
         for m in METHODS}
        for s in range(args.seeds)
    ]
    final_t = mean_ts["MVI"][:, -1]
    print_table(results, truth_loglik, final_t)
    reached = [np.any(t < 1.05) for t in mean_ts["MVI"]]
    print(f"\nMVI (q(y) update {args.q_y_step}): E[T] at step 1 = "
          f"{np.median(mean_ts['MVI'][:, 0]):.2f} (median over seeds); "
          f"E[T] fell below 1.05 in {sum(reached)}/{args.seeds} seeds; final E[T] in "
          f"[{final_t.min():.3f}, {final_t.max():.3f}]")
    plot(args, results, traces, mean_ts, np.asarray(data.mu))
    print(f"figure: {args.out}; total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
