"""Example models of the papers, ready for annealed / multicanonical inference.

* :mod:`numpyro_tempering.models.fmm` -- the factorial mixture model of
  annealed-and-multicanonical-vi, section 4.2 (explicit and collapsed forms, the toy data of
  Fig. 5, the closed-form tempered partition function and component matching).
"""

from numpyro_tempering.models import fmm

__all__ = ["fmm"]
