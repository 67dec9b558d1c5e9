"""Every ``>>>`` example in the package's docstrings runs and prints what it claims.

One test class per module: under ``--dist loadscope`` (pyproject) a class is a work unit of
its own, so the modules' examples spread over the xdist workers (as one file they were the
longest unit of the suite).
"""

import doctest
import importlib
import pkgutil

import numpyro_tempering

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# Scheduling hint only (every module is tested whatever this says): the modules whose
# examples took over 10 s each (measured, 2 cores) are queued first, so the quick ones are
# left to fill the gaps at the end of the run.
SLOW = (
    "guides",
    "partition_function",
    "warmstart",
    "models.fmm",
    "models.lda",
    "models.lda_svi",
    "models.latent_features",
)


def is_slow(name: str) -> bool:
    short = name.removeprefix("numpyro_tempering.")
    return any(short == s or short.startswith(s + ".") for s in SLOW)


MODULES = sorted(
    (m.name for m in pkgutil.walk_packages(numpyro_tempering.__path__, "numpyro_tempering.")),
    key=lambda name: (not is_slow(name), name),
)


def run_examples(name: str) -> doctest.TestResults:
    """Run module ``name``'s docstring examples; (failed, attempted)."""
    return doctest.testmod(importlib.import_module(name), optionflags=FLAGS)


def unit_class(name: str) -> type:
    """``Test_<module>``, holding the one test ``test_docstring_examples`` of ``name``."""

    def test_docstring_examples(self) -> None:
        result = run_examples(name)
        assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"

    short = name.removeprefix("numpyro_tempering.").replace(".", "_")
    body = {"test_docstring_examples": test_docstring_examples, "__module__": __name__}
    return type(f"Test_{short}", (), body)


for _name in MODULES:
    _cls = unit_class(_name)
    assert _cls.__name__ not in globals(), _name  # one class per module
    globals()[_cls.__name__] = _cls
