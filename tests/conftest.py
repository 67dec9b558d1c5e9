"""Settings for the whole test session.

XLA's CPU backend optimisation level 0, and XLA:CPU's older loop emitters instead of its
fusion emitters (``--xla_cpu_use_fusion_emitters=false``): most tests compile many small
functions once and run them a few times, so compilation dominates the suite. Level 0 made it
about 20-25% faster end to end on 2 cores (8.6 instead of 11.0 minutes, when the suite was
smaller). The older emitters halve what is left of the backend's compile time (summed over
both workers, 1,233 s of the 2,174 s in tests compiling; 478 s of 1,136 s without the fusion
emitters) for programs that run up to ~1.6x slower (log C of a logistic regression: 0.8 s
instead of 0.5 s at N = 200, 45 s instead of 34 s at N = 5,000): the README's test command
took 587 s instead of 1,110 s on the same machine (2026-11-28). The maths is the same;
only the last bits of float rounding may differ (tolerances are set for float32 anyway). A
flag this jaxlib does not know would abort every process (XLA refuses unknown flags), so
each is tried in a subprocess first. The optimisation level the user runs with is kept in
``USER_XLA_FLAGS`` for tests that must run a user's configuration in a subprocess (the
stall test of ``test_log_partition_modes.py``).
"""

import gc
import os
import subprocess
import sys

USER_XLA_FLAGS = "NUMPYRO_TEMPERING_USER_XLA_FLAGS"
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")

os.environ.setdefault(USER_XLA_FLAGS, os.environ.get("XLA_FLAGS", ""))


def _known(flag: str) -> bool:
    """Whether this jaxlib's XLA starts with ``flag`` (it aborts on a flag it does not know)."""
    probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          check=False).returncode == 0


# the pytest-xdist workers inherit the flags the controller set (and do not probe again)
_missing = [f for f in _FAST_COMPILE if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
if _missing:
    _flags = [f for f in _missing if f == _FAST_COMPILE[0] or _known(f)]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_flags]).strip()

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


# Each compiled XLA:CPU program holds memory mappings (code, read-only data, data: ~6-9 for a
# small program) for as long as JAX keeps it, and JAX's caches keep every program of a live
# jitted function (and up to 4096 eager-op programs) for the life of the process. One
# pytest-xdist worker compiles enough of them to approach vm.max_map_count (65530 by default;
# measured: 42,000 mappings at 45% of the suite); once there, LLVM cannot map the next
# program: "LLVM compilation error: Cannot allocate memory" and a segfault in
# backend_compile_and_load, or "LLVM ERROR: Unable to allocate section memory!" and an abort
# on a compile thread (both reproduced by filling the table). So every few tests, once the
# process uses half of that limit, JAX's caches are dropped (later tests recompile; a drop
# took 8-14 s, about once per worker per run at the default limit; .ci/run raises the limit).
try:
    with open("/proc/sys/vm/max_map_count") as _f:
        _CLEAR_ABOVE: int | None = int(_f.read()) // 2
except (OSError, ValueError):  # not Linux
    _CLEAR_ABOVE = None
_CHECK_EVERY = 10  # counting ~40k mappings takes ~50 ms; 10 tests added at most ~8k
_teardowns = 0


def _num_mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def pytest_runtest_teardown(item, nextitem):
    global _teardowns
    _teardowns += 1
    if _CLEAR_ABOVE is None or _teardowns % _CHECK_EVERY:
        return
    if _num_mappings() > _CLEAR_ABOVE:
        import jax

        jax.clear_caches()
        gc.collect()
