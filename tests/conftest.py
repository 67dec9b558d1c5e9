"""Settings for the whole test session.

XLA's CPU backend optimisation level 0: most tests compile many small functions once and
run them a few times, so compilation dominates the suite; at level 0 it is about 20-25%
faster end to end on 2 cores (measured: 8.6 instead of 11.0 minutes for the whole suite).
The maths is the same; only the last bits of float rounding may differ (tolerances are
set for float32 anyway). The optimisation level the user runs with is kept in
``USER_XLA_FLAGS`` for tests that must run a user's configuration in a subprocess (the
stall test of ``test_log_partition_modes.py``).
"""

import os

USER_XLA_FLAGS = "NUMPYRO_TEMPERING_USER_XLA_FLAGS"
_FAST_COMPILE = "--xla_backend_optimization_level=0"

os.environ.setdefault(USER_XLA_FLAGS, os.environ.get("XLA_FLAGS", ""))
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

#: the work units (files, or test classes: pytest-xdist's ``loadscope``) that take longest,
#: longest first (measured with a per-worker timeline of a whole run): handed out first
#: (``--no-loadscope-reorder`` in pyproject.toml keeps this order), so that no worker ends
#: the run alone inside one of them while the other idles (longest processing time first);
#: the units left after these take under ~15 s each on a quiet machine
SLOWEST_FIRST = (
    "test_log_partition_locals.py::TestPoissonFunnel",
    "test_log_partition_modes.py",
    "test_partition_smc.py",
    "test_log_partition_locals.py",
    "test_site_roles.py",
    "test_entry_points.py",
    "test_partition.py",
    "test_latent_features.py",
    "test_guides.py",
    "test_lda_blackbox.py",
    "test_tempered_elbo.py",
    "test_cubo_klpq.py",
    "test_diagnostics.py",
    "test_lda_svi.py",
    "test_log_partition.py",
    "test_lda_partition.py",
    "test_engine.py",
    "test_bounds.py",
    "test_upper_bounds_composition.py",
    "test_lda_mesh.py",
    "test_docstrings.py::Test_partition_function",
    "test_models_fmm.py",
    "test_log_partition_ladder.py",
    "test_tempered_families.py",
    "test_multicanonical.py",
    "test_docs.py::Test_partition",
)


def _rank(item) -> int:
    scope = item.path.name
    unit = f"{scope}::{item.cls.__name__}" if getattr(item, "cls", None) else scope
    for i, name in enumerate(SLOWEST_FIRST):
        if name in (unit, scope):
            return i
    return len(SLOWEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)  # stable: the others keep their order
