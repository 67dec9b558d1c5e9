r"""Time (and accuracy) of precomputing log C(T) on a 100-temperature ladder for an LDA-sized model.

Model: collapsed LDA with per-word Categorical likelihood (:mod:`numpyro_tempering.models.lda`),
K = 50 topics, V = 4,000 words, D = 50 documents of L = 100 words, alpha = eta = 1/K (the
paper's choice), the paper's ladder (100 temperatures from 1 to 10, geometric). The
tempered sites are the words, so (variational-tempering supplement, eq. 5-7)

.. math::

    C(T) = \mathbb{E}_{\beta}\prod_d \mathbb{E}_{\theta_d}\big[s(\theta_d, \beta)^L\big],
    \qquad s(\theta, \beta) = \sum_v \Big(\sum_k \theta_k \beta_{kv}\Big)^{1/T}.

Two facts bracket it exactly, whatever the Monte Carlo says:

* **upper bound**: :math:`p \mapsto p^{1/T}` is concave, so :math:`s \le V^{1 - 1/T}` with
  equality at the uniform p, hence :math:`\log C(T) \le DL(1 - 1/T)\log V`. This is exactly
  the analytic approximation of supplement eq. 4 (``analytic_log_partition``: beta at its
  prior mean, the uniform topic, makes every p uniform whatever theta is);
* **lower bound**: Jensen (supplement eq. 8, first line, ``jensen_bounds(...).mean_log``):
  :math:`\log C \ge DL\,\mathbb{E}_{\beta,\theta}[\log s]`, whose Monte Carlo estimate is a
  plain mean (small, reliable standard error).

Rows (each a single call, compilation included, as a user would run it; ``log_partition``
compiles per call):

* ``MC full corpus``: the plain Monte Carlo estimator (``log_partition(..., plate="docs",
  method="prior")``, eq. 7; the tempered-SMC default falls back to it for LDA, whose
  untempered per-document theta would need a pseudo-marginal SMC)
  on the whole corpus, one theta per document per outer draw;
* ``MC per document x D``: the same estimator on a one-document model with many inner theta
  draws, times D. Documents are exchangeable and of equal length, so this is
  :math:`D \log \mathbb{E}_\beta \mathbb{E}_\theta[s^L]` -- the per-element share
  :math:`\log C / D` that a *local* (per-document) temperature uses -- and a lower bound of
  the whole-corpus :math:`\log C = \log \mathbb{E}_\beta[(\mathbb{E}_\theta s^L)^D]`
  (Jensen for :math:`x \mapsto x^D`). (Running the full model with
  ``plate("docs", subsample_size=1)`` instead would *not* do this: the estimator multiplies
  each inner draw by N/B before the inner average, i.e. estimates
  :math:`\log \mathbb{E}_\theta[s^{LD}]`, see the report.)
* ``analytic eq. 4``: the exact upper bound above;
* ``Jensen eq. 8``: the lower bound above.

For the Monte Carlo rows, ``--keys`` independent runs show the run-to-run spread next to the
reported standard error (SE) and outer effective sample size (ESS). Values are per word,
:math:`\log C / (DL)`, at T = 1.5, 3 and 10.

Run: ``python benchmarks/log_partition_lda.py`` (a few minutes on 2 cores: the S = 100 row
alone is most of it), ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro

from numpyro_tempering import Ladder, analytic_log_partition, jensen_bounds, log_partition
from numpyro_tempering.models import lda

SHOW_T = (1.5, 3.0, 10.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topics", type=int, default=50)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--docs", type=int, default=50)
    parser.add_argument("--length", type=int, default=100, help="words per document")
    parser.add_argument("--ladder", type=int, default=100, help="number of temperatures")
    parser.add_argument("--keys", type=int, default=2, help="independent runs per MC row")
    parser.add_argument("--quick", action="store_true", help="smoke run: small S, one key")
    return parser.parse_args()


def timed(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    k, v, d, length = args.topics, args.vocab, args.docs, args.length
    words_per_corpus = d * length
    data = lda.make_corpus(jax.random.PRNGKey(0), d, length, k, v)
    one_doc = data.words[:1]
    ladder = Ladder.geometric(1.0, 10.0, args.ladder)
    temps = jnp.asarray(ladder.temperatures)
    cols = [int(np.argmin(np.abs(np.asarray(temps) - t))) for t in SHOW_T]
    keys = 1 if args.quick else args.keys
    s_big, s_small, inner = (10, 4, 20) if args.quick else (100, 10, 200)

    print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, {jax.default_backend()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; K = {k}, V = {v}, "
          f"D = {d} documents x L = {length} words, M = {args.ladder} temperatures 1..10")
    mc_rows = [
        (f"MC full corpus, S={s_big}, batch 10", lambda key: log_partition(
            key, lda.model, temps, data.words, k, v, num_samples=s_big, plate="docs",
            batch_size=10, method="prior"), 1.0),
        (f"MC full corpus, S={s_small}", lambda key: log_partition(
            key, lda.model, temps, data.words, k, v, num_samples=s_small, plate="docs",
            method="prior"), 1.0),
        (f"MC per document x D, S={s_small}, inner {inner}", lambda key: log_partition(
            key, lda.model, temps, one_doc, k, v, num_samples=s_small, num_inner=inner,
            plate="docs", method="prior"), float(d)),
    ]
    header = (f"{'method':<44} {'time s':>7} | " + " | ".join(
        f"{'T=' + str(t):^21}" for t in SHOW_T) + f" | {'SE':>6} {'ESS':>5} (T=10)")
    print(header)
    print(f"{'':<44} {'':>7} | " + " | ".join(f"{'log C / word':^21}" for _ in SHOW_T))
    print("-" * len(header))
    for label, run, factor in mc_rows:
        for r in range(keys):
            est, seconds = timed(lambda run=run, r=r: run(jax.random.PRNGKey(10 + r)))
            per_word = np.asarray(est.log_c) * factor / words_per_corpus
            values = " | ".join(f"{per_word[c]:^21.4f}" for c in cols)
            se, ess = float(est.stderr[cols[-1]]), float(est.ess[cols[-1]])
            print(f"{label + (f' (key {r})' if keys > 1 else ''):<44} {seconds:>7.1f} | "
                  f"{values} | {se:>6.3f} {ess:>5.1f}")

    upper, seconds = timed(lambda: analytic_log_partition(
        jax.random.PRNGKey(0), lda.model, temps, data.words, k, v, plate="docs"))
    per_word = np.asarray(upper) / words_per_corpus
    closed = (1 - 1 / np.asarray(temps)) * np.log(v)
    assert np.allclose(per_word, closed, rtol=1e-4, atol=1e-4), "eq. 4 != (1 - 1/T) log V"
    print(f"{'analytic eq. 4 = exact upper bound':<44} {seconds:>7.1f} | "
          + " | ".join(f"{per_word[c]:^21.4f}" for c in cols) + f" | {'exact':>6}")

    bounds, seconds = timed(lambda: jensen_bounds(
        jax.random.PRNGKey(1), lda.model, temps, data.words, k, v, num_samples=s_small,
        plate="docs"))
    lower = np.asarray(bounds.mean_log) / words_per_corpus
    se = np.asarray(bounds.mean_log_stderr) / words_per_corpus
    print(f"{f'Jensen eq. 8 lower bound, S={s_small}':<44} {seconds:>7.1f} | "
          + " | ".join(f"{f'{lower[c]:.4f} +- {se[c]:.4f}':^21}" for c in cols)
          + " | (SE/word shown)")
    print("\nSE: the estimator's delta-method standard error of log C (total, not per word); "
          "ESS: Kish effective\nsample size of the S outer draws. Differences between keys "
          "far beyond the SE mean the SE is unreliable\n(heavy-tailed weights). The upper "
          "bound is exact; the lower bound is exact up to its (reliable) standard error.")


if __name__ == "__main__":
    main()
