r"""Black-box LDA (issue 22, item 4): held-out score after N passes, and the step time.

Two measurements on one corpus (default Reuters, K = 20, minibatches of 100, the train/test
split and document-completion scoring of ``benchmarks/lda.py``):

1. **Convergence.** For each seed, the conjugate route (``lda_svi.fit`` at T = 1, online VB,
   scikit-learn's tau = 10, kappa = 0.7) after ``--conjugate-passes`` passes, and every
   black-box configuration (``--guides`` x ``--lrs``, ``lda_blackbox.fit``) scored at each
   pass count of ``--checkpoints`` within one fit (``fit(callback=...)`` keeps the topics at
   those updates). Printed: held-out nats/word, mean +- sd over seeds, and the gap to the
   conjugate route's mean (the issue's target: within 0.02 nats/word at <= 4x its passes).
2. **Step time.** For each guide, one jitted ``svi.update`` on a minibatch of ``B``
   documents against one jitted log density + gradient of the model on the same minibatch
   (``jax.value_and_grad`` of ``log_density`` in the topics and proportions), and against
   the reparameterised draw of the (K, V) topics with its implicit gradient alone
   (``Dirichlet(lam).rsample`` and the gradient of a linear function of the draw, Figurnov
   et al. 2018), timed interleaved in the same process: median over ``--repeats`` blocks of
   ``--calls`` calls, +- half the interquartile range of the per-block ratios.

Run (about 10-15 minutes on 2 shared cores)::

    python benchmarks/lda_blackbox.py --seeds 2 --checkpoints 2,4,8

Extra ``lda_blackbox.fit`` options for every black-box row: ``--fit-options
'{"num_particles": 2}'`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.infer import SVI
from numpyro.infer.util import log_density

from numpyro_tempering import TemperedELBO
from numpyro_tempering.models import corpora, lda_blackbox, lda_svi


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="reuters", help="reuters or synthetic")
    parser.add_argument("--topics", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--checkpoints", default="2,4,8", help="passes at which to score")
    parser.add_argument("--conjugate-passes", type=float, default=2)
    parser.add_argument("--guides", default="local,dirichlet,logistic_normal,amortised")
    parser.add_argument("--lrs", default="default",
                        help="comma-separated Adam step sizes; 'default' = fit's default")
    parser.add_argument("--fit-options", default="{}", help="JSON dict for lda_blackbox.fit")
    parser.add_argument("--repeats", type=int, default=7, help="timing blocks")
    parser.add_argument("--calls", type=int, default=10, help="calls per timing block")
    parser.add_argument("--warmup", type=int, default=None,
                        help="updates before the step is timed (default: 2 passes)")
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--json", default=None, help="write the results to this file")
    return parser.parse_args(argv)


def load(args):
    if args.corpus == "reuters":
        corpus = corpora.reuters()
    elif args.corpus == "synthetic":
        corpus, _ = corpora.synthetic(0, 2000, 100, args.topics, 2000)
    else:
        raise SystemExit(f"--corpus must be reuters or synthetic, got {args.corpus!r}")
    num_test = max(1, int(round(0.1 * corpus.num_docs)))
    train, test = corpora.train_test_split(corpus, num_test, seed=0)
    return train, corpora.completion_split(test, seed=0)


def convergence(args, train, observed, heldout) -> dict:
    checkpoints = [float(p) for p in args.checkpoints.split(",")]
    steps_at = {int(math.ceil(p * train.num_docs / args.batch_size)): p for p in checkpoints}
    options = json.loads(args.fit_options)
    configs = [(g.strip(), lr.strip()) for g in args.guides.split(",") if g.strip()
               for lr in args.lrs.split(",") if lr.strip()]
    scores: dict[str, list] = {"conjugate": []}
    seconds: dict[str, list] = {"conjugate": []}
    for seed in range(args.seeds):
        res = lda_svi.fit(train, args.topics, passes=args.conjugate_passes,
                          batch_size=args.batch_size, seed=seed,
                          tau=lda_svi.SKLEARN["tau"], kappa=lda_svi.SKLEARN["kappa"])
        s = lda_svi.heldout_log_likelihood(res.lam, observed, heldout)
        scores["conjugate"].append([s])
        seconds["conjugate"].append(res.seconds / res.num_steps)
        print(f"  seed {seed} conjugate {args.conjugate_passes:g} passes: {s:.4f}", flush=True)
        for guide, lr in configs:
            kept = {}
            kwargs = dict(options)
            if lr != "default":
                kwargs["learning_rate"] = float(lr)
            res = lda_blackbox.fit(
                train, args.topics, guide=guide, passes=max(checkpoints),
                batch_size=args.batch_size, seed=seed,
                callback=lambda step, params, kept=kept: kept.__setitem__(
                    step, np.asarray(params["lam"])) if step in steps_at else None,
                **kwargs)
            row = [lda_svi.heldout_log_likelihood(kept[st], observed, heldout)
                   for st in sorted(steps_at)]
            name = f"{guide} lr={lr}"
            scores.setdefault(name, []).append(row)
            seconds.setdefault(name, []).append(res.seconds / res.num_steps)
            print(f"  seed {seed} {name:<28} " + " ".join(f"{x:8.4f}" for x in row)
                  + f"  ({res.seconds / res.num_steps * 1e3:.0f} ms/update, "
                  f"{res.num_nonfinite} non-finite)", flush=True)
    ref = float(np.mean(scores["conjugate"]))
    print(f"\nheld-out nats/word, mean +- sd over {args.seeds} seeds; conjugate route after "
          f"{args.conjugate_passes:g} passes: {ref:.4f} +- "
          f"{np.std(scores['conjugate'], ddof=1) if args.seeds > 1 else 0:.4f}")
    print(f"{'black-box':<30}" + "".join(f"{f'{p:g} passes':>22}" for p in sorted(checkpoints))
          + "   gap at last   ms/update")
    rows = {"conjugate": {"heldout": ref, "passes": args.conjugate_passes,
                          "ms_per_update": 1e3 * float(np.mean(seconds["conjugate"]))}}
    for name, runs in scores.items():
        if name == "conjugate":
            continue
        a = np.asarray(runs)  # (seeds, checkpoints)
        mean, sd = a.mean(0), a.std(0, ddof=1) if len(a) > 1 else np.zeros(a.shape[1])
        ms = 1e3 * float(np.mean(seconds[name]))
        print(f"{name:<30}" + "".join(f"{m:13.4f} +- {s:.4f}" for m, s in zip(mean, sd,
                                                                               strict=True))
              + f"   {mean[-1] - ref:+.4f}   {ms:9.1f}")
        rows[name] = {"heldout": mean.tolist(), "heldout_sd": sd.tolist(),
                      "passes": sorted(checkpoints), "gap": float(mean[-1] - ref),
                      "ms_per_update": ms}
    return rows


def _block(fn, calls: int) -> float:
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def timing(args, train) -> dict:
    """Per guide, after ``--warmup`` updates from the initialisation (the topics' draw costs
    more while most concentrations are near 1): one update / one log density + gradient of
    the same minibatch; the topics' draw with its implicit gradient at the current topics
    (ours, and once numpyro's Dirichlet with JAX's element-wise rule) / the same baseline."""
    k, v, b, d = args.topics, train.vocab_size, args.batch_size, train.num_docs
    options = json.loads(args.fit_options)
    guide_options = {n: options[n] for n in ("hidden", "local_iter") if n in options}
    ids, counts = jnp.asarray(train.ids), jnp.asarray(train.counts)
    mb_ids, mb_counts = ids[:b], counts[:b]
    model_b = lda_blackbox.make_model(k, v)  # the minibatch itself, unsubsampled
    rng = np.random.default_rng(0)
    values = {"beta": jnp.asarray(rng.dirichlet(np.ones(v), k)),
              "theta": jnp.asarray(rng.dirichlet(np.ones(k), b))}
    logp_grad = jax.jit(jax.value_and_grad(
        lambda vals: log_density(model_b, (mb_ids, mb_counts), {}, vals)[0]))
    weights = jnp.asarray(rng.normal(size=(k, v)))

    def draw(family):
        return jax.jit(jax.value_and_grad(
            lambda lam, key: jnp.sum(weights * family(lam).rsample(key))))

    draw_grad, stock_grad = draw(lda_blackbox.ImplicitDirichlet), draw(dist.Dirichlet)
    local = jax.jit(lambda lam: lda_blackbox.local_gamma(
        lam, mb_ids, mb_counts, 1.0 / k, options.get("local_iter", lda_blackbox.LOCAL_SWEEPS)))
    key = jax.random.PRNGKey(0)
    warmup = args.warmup if args.warmup is not None else 2 * math.ceil(d / b)
    rows = {}
    print(f"\nstep time, minibatch of {b} documents (padded width {train.ids.shape[1]}), "
          f"K = {k}, V = {v}, after {warmup} updates; median of {args.repeats} blocks of "
          f"{args.calls} calls, +- half the IQR of the per-block ratios")
    print(f"{'guide':<16} {'update ms':>9} {'logp+grad ms':>12} {'ratio':>14} "
          f"{'draw+grad ms':>12} {'ratio':>14} {'stock draw ratio':>17}")
    iqr = lambda x: 0.5 * float(np.subtract(*np.percentile(x, [75, 25])))  # noqa: E731
    for guide in [g.strip() for g in args.guides.split(",") if g.strip()]:
        subsample = None if b >= d else b
        model = lda_blackbox.make_model(k, v, subsample_size=subsample)
        q = lda_blackbox.make_guide(guide, k, v, subsample_size=subsample, **guide_options)
        svi = SVI(model, q, lda_blackbox.default_optimizer(
            options.get("learning_rate", lda_blackbox.DEFAULT_LEARNING_RATE)),
            TemperedELBO(options.get("num_particles", 1), temperature=1.0))
        state = jax.jit(svi.init)(key, ids, counts)
        update = jax.jit(svi.update)
        for _ in range(warmup):
            state, _ = update(state, ids, counts)
        lam = svi.get_params(state)["lam"]
        box = {"state": state}

        def step(box=box, update=update):
            box["state"], loss = update(box["state"], ids, counts)
            return loss

        t_up, t_lp, t_dr, t_st, t_lo = [], [], [], [], []
        for _ in range(args.repeats):  # interleaved: the load affects all of them alike
            t_up.append(_block(step, args.calls))
            t_lp.append(_block(lambda: logp_grad(values), args.calls))
            t_dr.append(_block(lambda lam=lam: draw_grad(lam, key), args.calls))
            t_st.append(_block(lambda lam=lam: stock_grad(lam, key), 1))
            if guide == "local":
                t_lo.append(_block(lambda lam=lam: local(lam), args.calls))
        t_up, t_lp, t_dr, t_st = map(np.asarray, (t_up, t_lp, t_dr, t_st))
        r_up, r_dr, r_st = t_up / t_lp, t_dr / t_lp, t_st / t_lp
        print(f"{guide:<16} {1e3 * np.median(t_up):9.2f} {1e3 * np.median(t_lp):12.2f} "
              f"{np.median(r_up):7.1f} +- {iqr(r_up):4.1f} {1e3 * np.median(t_dr):12.2f} "
              f"{np.median(r_dr):7.1f} +- {iqr(r_dr):4.1f} {np.median(r_st):9.1f} +- "
              f"{iqr(r_st):5.1f}", flush=True)
        rows[guide] = {"update_ms": 1e3 * float(np.median(t_up)),
                       "logp_grad_ms": 1e3 * float(np.median(t_lp)),
                       "ratio": float(np.median(r_up)), "ratio_half_iqr": iqr(r_up),
                       "draw_grad_ms": 1e3 * float(np.median(t_dr)),
                       "draw_ratio": float(np.median(r_dr)),
                       "stock_draw_ratio": float(np.median(r_st))}
        if t_lo:
            r_lo = np.asarray(t_lo) / t_lp
            sweeps = options.get("local_iter", lda_blackbox.LOCAL_SWEEPS)
            print(f"{'':<16} of which the local step ({sweeps} sweeps): "
                  f"{1e3 * np.median(t_lo):.2f} ms, {np.median(r_lo):.1f} +- {iqr(r_lo):.1f} "
                  f"x logp+grad", flush=True)
            rows[guide]["local_ratio"] = float(np.median(r_lo))
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    train, (observed, heldout) = load(args)
    print(f"corpus {args.corpus}: {train.num_docs} training documents, V = {train.vocab_size}, "
          f"K = {args.topics}, minibatches of {args.batch_size}", flush=True)
    out = {}
    if not args.skip_timing:
        out["timing"] = timing(args, train)
    if not args.skip_convergence:
        out["convergence"] = convergence(args, train, observed, heldout)
    if args.json:  # the rows, for docs/reproductions.md
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
