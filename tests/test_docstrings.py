"""Every ``>>>`` example in the package's docstrings runs and prints what it claims."""

import doctest
import importlib
import pkgutil

import pytest

import numpyro_tempering

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(numpyro_tempering.__path__, "numpyro_tempering.")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    failures, _ = doctest.testmod(module, optionflags=flags)
    assert failures == 0
