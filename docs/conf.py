"""Sphinx configuration of the asynccoll documentation (``make docs``).

Sphinx + autodoc (why: see ``docs/contributing.md``). The API reference is generated
from the docstrings of the installed packages: ``tests/project/test_docs.py`` fails when a
public name has no docstring or no entry in ``docs/reference/``. The build runs
with warnings as errors (``-W``) and nitpicky cross-references (``-n``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document this checkout, not an older installed copy

import asynccoll  # noqa: E402

project = "asynccoll"
author = "the asynccoll authors"
copyright = "2026, the asynccoll authors"  # noqa: A001 (Sphinx's name)
release = asynccoll.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "tools", "Thumbs.db", ".DS_Store"]

# MyST: ```{directive} fences, $-free, heading anchors for #links between pages.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: signatures as written in the code; members in source order.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autoclass_content = "class"
autodoc_default_options = {"members": True}
add_module_names = True
python_display_short_literal_types = True

# Nitpicky: every cross-reference must resolve. The names below are third-party
# (documented elsewhere; no network here for intersphinx) or internal types that
# appear in signatures but are not part of the public API.
nitpicky = True
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(torch|typing|collections\.abc|asyncio|anyio|trio|threading|multiprocessing|contextlib|types|enum)(\..*)?",
    ),
    (r"py:.*", r"(cupy|nccl|cuda)(\..*)?"),
    (
        r"py:class",
        r"(Any|Callable|Awaitable|Iterable|Iterator|Generator|Sequence|Mapping|NoReturn|Literal|Union|Optional)",
    ),
    (
        r"py:class",
        r"(int|float|str|bool|bytes|object|list|dict|tuple|set|None|BaseException|Exception)",
    ),
    (r"py:.*", r"asynccoll\._.*"),  # internal types in signatures (the ledger, a backend, ...)
    (r"py:.*", r"streams\._.*"),
    (r"py:.*", r"(.*\.)?_[a-z]\w*"),  # a private helper named in a docstring
]

html_theme = "furo"
html_title = f"asynccoll {release}"
html_static_path = ["_static"]
html_show_sourcelink = False
