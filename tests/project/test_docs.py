"""The documentation stays true to the code.

* Every public name (``asynccoll.__all__``, ``asynccoll.testing.__all__``,
  ``streams.__all__``) has a docstring, every public method and property of a public
  class too, and each name has an entry in ``docs/reference/``; every entry there
  names something that exists.
* Every complete script in the docs runs. Convention (as in ``tests/project/test_readme.py``):
  a ```python block that contains ``if __name__ == "__main__":`` is a complete
  script; it is written to a file and run with this Python, the repository on
  ``PYTHONPATH``, under a deadline. A script whose first line is
  ``# requires: cuda`` runs only where CUDA and nccl4py are present and is skipped
  with that reason elsewhere. Every other ```python block is a fragment: it must
  at least compile (top-level ``await`` allowed).
* The version is the same in ``pyproject.toml``, ``asynccoll.__version__`` and the
  newest ``CHANGELOG.md`` entry; every option of ``python -m asynccoll.diagnose`` is
  documented.

``make docs`` builds the pages with warnings as errors (a reference entry that does not
import, a broken link); this file needs no documentation tool.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

import asynccoll
import asynccoll.testing
import streams
from tests.support.paths import ROOT, child_env

DOCS = ROOT / "docs"
GUARD = 'if __name__ == "__main__":'
NEEDS_CUDA = "# requires: cuda"
PUBLIC = {"asynccoll": asynccoll, "asynccoll.testing": asynccoll.testing, "streams": streams}

# ``.. autofunction:: x.y`` (inside ```{eval-rst} blocks) and MyST's ```{autofunction} x.y
_ENTRY = re.compile(
    r"^(?:\.\.\s+|```\{)(?:auto(?:function|class|exception|data|attribute|method|module)|"
    r"py:(?:function|class|exception|data|attribute|method))(?:::|\})\s+([\w.]+)",
    re.M,
)
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def reference_entries() -> dict[str, str]:
    """Each documented name -> the text that follows its directive (up to the next one)."""
    entries: dict[str, str] = {}
    for page in sorted((DOCS / "reference").glob("*.md")):
        text = page.read_text()
        found = list(_ENTRY.finditer(text))
        for i, m in enumerate(found):
            end = found[i + 1].start() if i + 1 < len(found) else len(text)
            entries[m[1]] = text[m.end() : end]
    return entries


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _own_doc(obj: Any) -> str:
    """The docstring written for ``obj`` itself (a class's, not one inherited from its base)."""
    if inspect.isclass(obj):
        return (vars(obj).get("__doc__") or "").strip()
    if inspect.isfunction(obj) or inspect.ismethod(obj) or isinstance(obj, property):
        return (obj.__doc__ or "").strip()
    return ""


def public_names() -> list[str]:
    return [f"{mod}.{name}" for mod, m in PUBLIC.items() for name in m.__all__]


def test_public_lists_are_what_the_packages_export() -> None:
    for mod, m in PUBLIC.items():
        exported = {
            n for n in dir(m) if not n.startswith("_") and not inspect.ismodule(getattr(m, n))
        }
        assert set(m.__all__) == exported, f"{mod}: __all__ and the module's public names differ"


def test_every_public_name_has_a_docstring() -> None:
    entries = reference_entries()
    missing = []
    for dotted in public_names():
        obj = _resolve(dotted)
        if inspect.isclass(obj) or inspect.isroutine(obj):
            if not _own_doc(obj):
                missing.append(dotted)
        elif not entries.get(dotted, "").strip(" `\n"):
            # A type alias has no docstring of its own: its reference entry must say what it is.
            missing.append(f"{dotted} (an alias: describe it under its py:data entry)")
    assert not missing, f"public names without a docstring: {missing}"


def _public_members(cls: type) -> dict[str, Any]:
    """Public methods and properties that ``cls`` and its bases in our packages define."""
    members: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        if base.__module__.split(".")[0] not in ("asynccoll", "streams"):
            continue
        for name, value in vars(base).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                members[name] = value
    return members


def test_every_public_method_has_a_docstring() -> None:
    missing = []
    for dotted in public_names():
        obj = _resolve(dotted)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            missing += [f"{dotted}.{n}" for n, v in _public_members(obj).items() if not _own_doc(v)]
    assert not missing, f"public methods and properties without a docstring: {missing}"


def test_every_public_name_is_in_the_reference() -> None:
    entries = reference_entries()
    missing = [name for name in public_names() if name not in entries]
    assert not missing, f"public names missing from docs/reference/: {missing}"


def test_every_reference_entry_exists() -> None:
    stale = []
    for dotted in reference_entries():
        try:
            _resolve(dotted)
        except (ImportError, AttributeError):
            stale.append(dotted)
    assert not stale, f"docs/reference/ documents names that do not exist: {stale}"


# ------------------------------------------------------------------ code in the pages
def _blocks() -> list[tuple[str, int, str]]:
    return [
        (str(page.relative_to(DOCS)), i, block)
        for page in _pages()
        for i, block in enumerate(_BLOCK.findall(page.read_text()))
    ]


SCRIPTS = [(page, i, b) for page, i, b in _blocks() if GUARD in b]
FRAGMENTS = [(page, i, b) for page, i, b in _blocks() if GUARD not in b]


def _why_no_gpu() -> str | None:
    """Why the NCCL path cannot run here (the library's own answer), or None."""
    from asynccoll._backends.nccl import missing

    return missing()


def test_guides_have_scripts() -> None:
    pages = {page for page, _, _ in SCRIPTS}
    for guide in ("training", "coalescing", "faults", "debugging", "trio", "gpu"):
        assert f"guides/{guide}.md" in pages, f"docs/guides/{guide}.md has no complete script"


@pytest.mark.parametrize(
    ("page", "index", "block"), FRAGMENTS, ids=[f"{p}:{i}" for p, i, _ in FRAGMENTS]
)
def test_fragment_compiles(page: str, index: int, block: str) -> None:
    compile(
        block,
        f"{page} block {index}",
        "exec",
        flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
        dont_inherit=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("page", "index", "block"), SCRIPTS, ids=[f"{p}:{i}" for p, i, _ in SCRIPTS]
)
def test_script_runs(page: str, index: int, block: str, tmp_path: Path) -> None:
    compile(block, f"{page} block {index}", "exec", dont_inherit=True)
    if block.startswith(NEEDS_CUDA) and (why := _why_no_gpu()) is not None:
        pytest.skip(f"{page} block {index} needs a CUDA GPU and nccl4py: {why}")
    script = tmp_path / f"docs_snippet_{index}.py"
    script.write_text(block)
    env = child_env()
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, (
        f"{page} block {index} failed:\n{block}\n--- stdout ---\n{proc.stdout[-3000:]}\n"
        f"--- stderr ---\n{proc.stderr[-4000:]}"
    )


# ------------------------------------------------------------------ facts the pages state
def test_versions_agree() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    newest = re.search(r"^## \[?(\d+\.\d+\.\d+[^\]\s]*)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest is not None, "CHANGELOG.md has no version heading"
    assert meta["version"] == asynccoll.__version__ == newest[1]


def test_every_extra_is_documented() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    install = (DOCS / "install.md").read_text()
    missing = [e for e in extras if f"[{e}]" not in install and f"`{e}`" not in install]
    assert not missing, f"extras not described in docs/install.md: {missing}"


def test_diagnose_options_are_documented() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asynccoll.diagnose", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr
    options = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", proc.stdout)) - {"--help"}
    assert options, proc.stdout
    page = (DOCS / "reference" / "cli.md").read_text()
    assert not [o for o in options if o not in page], (
        f"options of asynccoll.diagnose not in docs: {options}"
    )
