"""Black-box LDA in stock SVI: plain (T = 1), annealed and multicanonical (the joint form with
the exact per-document normaliser), on a synthetic corpus drawn from LDA at T = 1.

    python benchmarks/lda_blackbox_mvi.py [--passes 10] [--seeds 2]

Prints, per method and seed, the held-out per-word log likelihood (document completion),
E[T] at the first update, a quarter, half way and the last update, and the time per update.
The numbers are quoted in docs/lda.md ("Multicanonical, black box").
"""

from __future__ import annotations

import argparse

import numpy as np

from numpyro_tempering import Ladder, schedules
from numpyro_tempering.models import corpora, lda_blackbox, lda_svi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=float, default=10.0)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    k, v = 5, 200
    corpus, _ = corpora.synthetic(0, 600, 80, k, v, alpha=0.2, eta=0.1)
    train, test = corpora.train_test_split(corpus, 100, seed=0)
    observed, heldout = corpora.completion_split(test, seed=0)
    steps = int(args.passes * train.num_docs / 100)
    methods = [("T=1", 1.0), ("mvi", Ladder.geometric(1.0, 10.0, 20)),
               ("annealed", schedules.linear(4.0, 1.0, num_steps=int(0.3 * steps)))]
    for name, temperature in methods:
        scores = []
        for seed in range(args.seeds):
            res = lda_blackbox.fit(train, k, guide="dirichlet", passes=args.passes,
                                   batch_size=100, temperature=temperature, seed=seed,
                                   learning_rate=0.05)
            scores.append(lda_svi.heldout_log_likelihood(res.lam, observed, heldout))
            t = res.temperatures
            marks = np.round(t[[0, len(t) // 4, len(t) // 2, -1]], 3).tolist()
            print(f"{name:9s} seed {seed}: held-out {scores[-1]:.4f}  E[T] {marks}  "
                  f"{1e3 * res.seconds / res.num_steps:.1f} ms/update", flush=True)
        print(f"{name:9s} mean {np.mean(scores):.4f} (seeds {np.round(scores, 4).tolist()})",
              flush=True)


if __name__ == "__main__":
    main()
