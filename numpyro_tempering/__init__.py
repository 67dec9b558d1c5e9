"""numpyro-tempering: tempering, multicanonical VI and evidence bounds for NumPyro."""

from numpyro_tempering import bounds, schedules
from numpyro_tempering.engine import LogWeights, log_weights
from numpyro_tempering.handlers import temper
from numpyro_tempering.objectives import CUBO, KLpq, TemperedELBO

__version__ = "0.1.0"

__all__ = [
    "CUBO",
    "KLpq",
    "LogWeights",
    "TemperedELBO",
    "bounds",
    "log_weights",
    "schedules",
    "temper",
]
