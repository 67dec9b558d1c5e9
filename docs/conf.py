"""Sphinx configuration: API reference generated from the docstrings (built with -W in CI)."""

project = "numpyro-tempering"
author = "numpyro-tempering developers"
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_parser",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
myst_enable_extensions = ["dollarmath", "amsmath"]
html_theme = "furo"
html_title = "numpyro-tempering"
