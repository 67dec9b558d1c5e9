"""Objectives for :class:`numpyro.infer.SVI`, each a thin layer over the log-weight engine."""

from numpyro_tempering.handlers import stop_param_gradients, stop_sample_gradients
from numpyro_tempering.objectives.annealed import Annealed
from numpyro_tempering.objectives.base import EngineELBO, UpperBoundELBO
from numpyro_tempering.objectives.cubo import CUBO
from numpyro_tempering.objectives.klpq import KLpq
from numpyro_tempering.objectives.multicanonical import MulticanonicalELBO
from numpyro_tempering.objectives.tempered import TemperedELBO

__all__ = [
    "Annealed",
    "CUBO",
    "EngineELBO",
    "KLpq",
    "MulticanonicalELBO",
    "TemperedELBO",
    "UpperBoundELBO",
    "stop_param_gradients",
    "stop_sample_gradients",
]
