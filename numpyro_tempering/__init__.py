"""numpyro-tempering: tempering, multicanonical VI and evidence bounds for NumPyro."""

from numpyro_tempering import bounds, partition, schedules
from numpyro_tempering.engine import LogWeights, log_weights
from numpyro_tempering.handlers import temper
from numpyro_tempering.ladder import Ladder
from numpyro_tempering.log_partition import analytic_log_partition, jensen_bounds, log_partition
from numpyro_tempering.multicanonical import multicanonical
from numpyro_tempering.objectives import CUBO, KLpq, MulticanonicalELBO, TemperedELBO

__version__ = "0.1.0"

__all__ = [
    "CUBO",
    "KLpq",
    "Ladder",
    "LogWeights",
    "MulticanonicalELBO",
    "TemperedELBO",
    "analytic_log_partition",
    "bounds",
    "jensen_bounds",
    "log_partition",
    "log_weights",
    "multicanonical",
    "partition",
    "schedules",
    "temper",
]
