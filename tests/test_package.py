"""The package's public surface: submodules reachable, no public name shadowing a submodule."""

import importlib
import pkgutil

import numpyro_tempering


def test_submodules_are_reachable_from_the_package():
    for name in ("guides", "models", "warmstart", "bounds", "partition", "schedules"):
        assert getattr(numpyro_tempering, name).__name__ == f"numpyro_tempering.{name}"


def test_no_public_name_shadows_a_submodule():
    submodules = {m.name for m in pkgutil.iter_modules(numpyro_tempering.__path__)}
    for name in numpyro_tempering.__all__:
        value = getattr(numpyro_tempering, name)
        if name in submodules:  # allowed only if the name *is* that submodule
            assert value is importlib.import_module(f"numpyro_tempering.{name}"), name


def test_readme_layout_lists_every_module_once():
    # the README's module map ("Layout") is the one place a reader looks up a concept's home
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `numpyro_tempering\.([a-z_]+)`(?:, `([a-z_]+)`)?", layout, re.M)
    listed = [name for row in rows for name in row if name]
    assert len(listed) == len(set(listed)), listed
    modules = {m.name for m in pkgutil.iter_modules(numpyro_tempering.__path__)}
    assert set(listed) == modules
