"""Sphinx configuration of the logit_dp documentation.

Build (warnings are errors):

    pip install -e '.[docs]'
    sphinx-build -W --keep-going -b html docs docs/_build/html

The quickstart notebook is rendered from its stored outputs (nothing executes at build time);
the API reference is generated from the docstrings (Google style, read by napoleon).
"""

import os
import re
import sys

sys.path.insert(0, os.path.abspath(".."))

import logit_dp  # noqa: E402

project = "logit_dp"
author = "logit_dp authors"
copyright = "the logit_dp authors"
release = logit_dp.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

exclude_patterns = [
    "_build",
    "results/**",
    "benchmarks/**",
    "**.ipynb_checkpoints",
]
templates_path = ["_templates"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# MyST: `$...$` maths, fenced ```{directive} blocks, heading anchors for in-page links.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 4
# Notebooks are shown with the outputs stored in them.
nb_execution_mode = "off"

# API reference: autosummary pages from each module's `__all__`, Google-style docstrings.
autosummary_generate = True
autosummary_ignore_module_all = False
autosummary_imported_members = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# `Attributes:` sections as fields, so that NamedTuple fields are not described twice.
napoleon_use_ivar = True

html_theme = "sphinx_book_theme"
html_title = f"logit_dp {release}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}

# The docstrings write maths as plain text: |x| is a norm or an absolute value, never a
# reStructuredText substitution, and a signature's bare `*` (keyword-only marker) is not emphasis.
_NORM_BARS = re.compile(r"(?<!\\)\|")
_KEYWORD_ONLY_STAR = re.compile(r"(?<=[(,] )\*(?=[,)])")


def _plain_text_maths(app, what, name, obj, options, lines):
  del app, what, name, obj, options
  lines[:] = [_KEYWORD_ONLY_STAR.sub(r"\\*", _NORM_BARS.sub(r"\\|", line)) for line in lines]


def setup(app):
  app.connect("autodoc-process-docstring", _plain_text_maths)
