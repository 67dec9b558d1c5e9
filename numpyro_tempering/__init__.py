"""numpyro-tempering: tempering, multicanonical VI and evidence bounds for NumPyro."""

from numpyro_tempering import (
    bounds,
    diagnostics,
    guides,
    models,
    partition,
    schedules,
    temperatures,
    tempered_families,  # registers its closed forms with partition's registry
    warmstart,
)
from numpyro_tempering.engine import LogWeights, log_weights
from numpyro_tempering.handlers import Selection, temper
from numpyro_tempering.ladder import Ladder
from numpyro_tempering.multicanonical_model import multicanonical
from numpyro_tempering.objectives import CUBO, Annealed, KLpq, MulticanonicalELBO, TemperedELBO
from numpyro_tempering.partition_function import (
    analytic_log_partition,
    jensen_bounds,
    log_partition,
)
from numpyro_tempering.temperatures import (
    mean_inverse_temperature,
    record_temperatures,
    temperature_history,
    temperature_posterior,
)

__version__ = "0.1.0"

__all__ = [
    "Annealed",
    "CUBO",
    "KLpq",
    "Ladder",
    "LogWeights",
    "MulticanonicalELBO",
    "Selection",
    "TemperedELBO",
    "analytic_log_partition",
    "bounds",
    "diagnostics",
    "guides",
    "jensen_bounds",
    "log_partition",
    "log_weights",
    "mean_inverse_temperature",
    "models",
    "multicanonical",
    "partition",
    "record_temperatures",
    "schedules",
    "temper",
    "temperature_history",
    "temperature_posterior",
    "temperatures",
    "tempered_families",
    "warmstart",
]
