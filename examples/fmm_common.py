"""What the factorial-mixture examples share: initial states, the VI/AVI/MVI update step,
evaluation at T = 1, the seed-by-seed verdict and table, and the feature pictures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_tempering import temper
from numpyro_tempering.engine import log_weights
from numpyro_tempering.models import fmm
from numpyro_tempering.temperatures import TemperatureRecord


def prior_inits(keys, shape, scale: float) -> list:
    """One draw of the features from the prior N(0, scale^2) per seed (same for every method)."""
    return [scale * jax.random.normal(jax.random.fold_in(k, 1), shape) for k in keys]


def batch_states(svi, keys, inits, *args):
    """SVI states of all seeds stacked on a leading axis, each started at its prior draw."""
    states = [
        svi.init(k, *args, init_params={"mu_auto_loc": mu0})
        for k, mu0 in zip(keys, inits, strict=True)
    ]
    return jax.tree.map(lambda *s: jnp.stack(s), *states)


def unstack_params(svi, final, num_seeds: int) -> list[dict]:
    """The constrained parameters of each seed from a stacked final state."""
    return [svi.get_params(jax.tree.map(lambda a, i=i: a[i], final)) for i in range(num_seeds)]


def make_step(name: str, svi, x, inv_t):
    """``((state, E[1/T]), T) -> ((state, E[1/T]), temperature used)`` for VI, AVI or MVI.

    VI ignores T; AVI passes it to the model (``temperature=``); MVI passes the current
    effective inverse temperature and reads q(y) (eq. 18) of this step from the record.
    """

    def step(carry, temperature):
        state, beta = carry
        if name == "VI":
            state, _ = svi.update(state, x)
            return (state, beta), 1.0
        if name == "AVI":
            state, _ = svi.update(state, x, temperature=temperature)
            return (state, beta), temperature
        state, _ = svi.update(state, x, beta)
        (record,) = (v for v in state.mutable_state.values() if isinstance(v, TemperatureRecord))
        last = record.step - 1
        return (state, record.mean_inverse_temperature[last]), record.mean_temperature[last]

    return step


def evaluate(params, guide, x, truth, key, num_particles, pi=0.3, sigma_n=0.1) -> dict:
    """Final ELBO at T = 1 (mean, standard error), log p(x | E[mu]) and component error."""
    weights = log_weights(
        key, params, temper(fmm.collapsed_model, 1.0), guide, (x,), num_particles=num_particles
    )
    log_w = np.asarray(weights.log_w)
    if not np.all(np.isfinite(log_w)):
        raise FloatingPointError(f"{np.sum(~np.isfinite(log_w))} non-finite log weights")
    mu = params["mu_auto_loc"]
    return {
        "elbo": float(log_w.mean()),
        "se": float(log_w.std(ddof=1) / np.sqrt(log_w.size)),
        "loglik": float(fmm.FactorialMixture(mu, pi, sigma_n).log_prob(x).sum()),
        "error": fmm.component_error(mu, truth),
        "mu": np.asarray(mu),
    }


def verdict(mine: dict, ref: dict) -> int:
    """+1 / -1 if ``mine``'s ELBO is higher / lower than ``ref``'s by > 3 s.e., else 0."""
    margin = 3.0 * np.hypot(mine["se"], ref["se"])
    if mine["elbo"] > ref["elbo"] + margin:
        return 1
    return -1 if mine["elbo"] < ref["elbo"] - margin else 0


def print_seed_table(
    results: list[dict], methods, truth_loglik: float, width: int, decimals: int, extra=None
) -> None:
    """One row per seed: ELBO at T = 1 (marked +/=/- against VI by :func:`verdict`),
    log p(x | E_q[mu]) and the feature error of every method; ``extra = (title, unit,
    values)`` adds one last column (e.g. MVI's final E[T])."""
    names = "".join(f"{m:>{width}}" for m in methods)
    span = width * len(methods)
    tail = ("", "") if extra is None else (f" | {extra[0]}", f" | {extra[1]}")
    print()
    print(
        f"{'':>4} | {'ELBO at T = 1':^{span}} | {'log p(x | E_q[mu])':^{span}} | "
        f"{'component RMSE':^{span}}{tail[0]}"
    )
    print(f"{'seed':>4} | {names} | {names} | {names}{tail[1]}")
    for seed, row in enumerate(results):
        marks = {m: " " if m == "VI" else "+=-"[1 - verdict(row[m], row["VI"])] for m in methods}
        elbo = "".join(f"{row[m]['elbo']:>{width - 1}.{decimals}f}{marks[m]}" for m in methods)
        loglik = "".join(f"{row[m]['loglik']:>{width}.{decimals}f}" for m in methods)
        error = "".join(f"{row[m]['error']:>{width}.3f}" for m in methods)
        more = "" if extra is None else f" | {extra[2][seed]:>8.3f}"
        print(f"{seed:>4} | {elbo} | {loglik} | {error}{more}")
    print(
        f"(+/-/= : ELBO higher/lower than VI's by > 3 s.e., or a tie; the ELBO's s.e. is "
        f"<= {max(r[m]['se'] for r in results for m in methods):.2f})"
    )
    print(f"log p(x | true mu) = {truth_loglik:.1f}")


def plot_features(fig, column, results_of_seed: dict, methods, truth, side: int = 4) -> None:
    """One row of feature images per method (matched to the truth), the truth on top."""
    rows = [("truth", truth)] + [
        (
            f"{m}\nerr {results_of_seed[m]['error']:.3f}",
            results_of_seed[m]["mu"][fmm.match_components(results_of_seed[m]["mu"], truth)],
        )
        for m in methods
    ]
    vmax = float(np.max(np.abs(truth)))
    for i, (label, mu) in enumerate(rows):
        sub = column[i].subgridspec(1, mu.shape[0], wspace=0.08)
        for k in range(mu.shape[0]):
            a = fig.add_subplot(sub[0, k])
            a.imshow(mu[k].reshape(side, side), cmap="RdBu_r", vmin=-vmax, vmax=vmax)
            a.set_xticks([])
            a.set_yticks([])
            if k == 0:
                a.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=9)
