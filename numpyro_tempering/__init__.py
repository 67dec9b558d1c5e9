"""numpyro-tempering: tempering, multicanonical VI and evidence bounds for NumPyro."""

from numpyro_tempering import schedules
from numpyro_tempering.engine import LogWeights, log_weights
from numpyro_tempering.handlers import temper
from numpyro_tempering.objectives import TemperedELBO

__version__ = "0.1.0"

__all__ = ["LogWeights", "TemperedELBO", "log_weights", "schedules", "temper"]
