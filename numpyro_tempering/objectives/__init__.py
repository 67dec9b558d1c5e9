"""Objectives for :class:`numpyro.infer.SVI`, each a thin layer over the log-weight engine."""

from numpyro_tempering.objectives.tempered import TemperedELBO

__all__ = ["TemperedELBO"]
