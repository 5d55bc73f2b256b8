"""Sphinx configuration: `pip install -e ".[docs]"`, then, from the repository root,
`sphinx-build -c docs . docs/_build` (tests/test_docs.py builds it with warnings as
errors). The source directory is the repository's root, so that the pages under docs/
link to notebooks/ by the same relative paths on GitHub and on the site. Pages are
Markdown (MyST); the notebooks are rendered as stored, without outputs (the tests run
them); the Python API comes from the docstrings."""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # autodoc imports jaxmoe; nothing runs
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

project = "jaxmoe"
author = "the jaxmoe authors"
copyright = "the jaxmoe authors"
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"
root_doc = "docs/index"
include_patterns = ["docs/**.md", "notebooks/*.ipynb"]
exclude_patterns = ["docs/_build"]
html_theme = "furo"
html_title = "jaxmoe"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}


def _front_door(app, exception):
    """The site's pages live under docs/ (the source directory is the repository's root):
    the output's own index.html leads there."""
    if exception is None and app.builder.format == "html":
        Path(app.outdir, "index.html").write_text(
            '<!doctype html><meta http-equiv="refresh" content="0; url=docs/index.html">'
            '<a href="docs/index.html">jaxmoe documentation</a>\n')


def setup(app):
    app.connect("build-finished", _front_door)
