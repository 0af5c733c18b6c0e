"""The layout guard: rooms, arrows, sizes and private reaches, read from the source.

Everything here parses the package with ``ast``; nothing is imported, so the whole file
runs in well under a second. Definitions (the tests below apply them as written):

* **Module**: every ``.py`` file under ``asynccoll/`` and ``streams/``; a package is its
  ``__init__.py``. Production modules are all of them (the test kit ships in the wheel).
* **Import edge** A -> B: every ``import B`` and ``from B import x`` in A, resolved when
  relative, wherever it stands: at module level, under ``if TYPE_CHECKING:``, or inside a
  function. ``from P import m`` is also an edge A -> P.m when ``P.m`` is a module. Importing
  ``P.m`` is not counted as importing ``P``'s parents (their ``__init__`` runs first, but
  only the named module is a dependency of A).
* **Cycle**: a strongly connected component of two or more modules in that graph.
* **Room**: the first component under ``asynccoll`` (``_base``, ``_core``, ...);
  ``streams`` is a room of its own. A room may import only the rooms :data:`ROOMS` lists
  for it (itself always): the arrows point down.
* **Private reach**: (a) ``x._name`` where ``x`` is not the bare name ``self`` or ``cls``,
  ``_name`` is not a dunder, and ``_name`` is not defined in the same module; or (b)
  ``from m import _name`` with ``m`` another module (a private *module*, ``from . import
  _pool``, is not a reach). *Defined in a module*: bound there by
  ``def``/``class``, as an assignment target (a name, class-body annotations included,
  or ``self.``/``cls.`` attribute: writing ``other._x`` is a reach, not a definition),
  a ``__slots__`` entry or an import alias. The rule reads source,
  not types: a reach into a vendor's private name (``torch._C``, ``pg._allgather_base``)
  counts like one into ours, except the few underscored names their owners document as
  public API (:data:`VENDOR_PUBLIC`).
* **The friend**: the ledger settling Works (``_core/ledger.py`` using names that
  ``_core/work.py`` defines: ``work._settle``, ``_DONE``, ``_FAILED``). It is the one
  documented reach, not counted.
"""

from __future__ import annotations

import ast
import collections
import functools
from pathlib import Path

from tests.support.paths import ROOT

PACKAGES = ("asynccoll", "streams")

#: What each room may import besides itself (the arrows, all pointing down).
ROOMS: dict[str, set[str]] = {
    "streams": set(),
    "_base": set(),
    "_core": {"_base"},
    "_faults": {"_base", "_core"},
    "_diag": {"_base", "_core"},
    "_backends": {"_base", "_core", "streams"},
    "_train": {"_base", "_core"},
    # torch.distributed on a communicator: a ProcessGroup over the public API, and the
    # "asynccoll" backend, whose creator builds a communicator with init().
    "_torch": {"_base", "_core", "_bootstrap"},
    "_bootstrap": {"_base", "_core", "_faults", "_diag", "_backends", "streams"},
    # The top: the public names, the CLI and the test kit stand on everything.
    "__init__": {"*"},
    "diagnose": {"*"},
    "doctor": {"*"},
    "store": set(),  # python -m asynccoll.store: torch's TCPStore, nothing of asynccoll
    "testing": {"*"},
}

# Counted after `ruff format` (width 100). Splits should follow concepts, not the count:
# a module near the guard is a prompt to find the concept that wants its own module.
MAX_LINES = 600

# ------------------------------------------------------------------ allowlists
# Files another engineer is rewriting right now; each entry names the issue whose work
# removes it. The lead empties these lists when that work lands.
#: Import cycles still allowed, as the set of modules of each cycle.
CYCLES_ALLOWED: list[set[str]] = []
#: Modules over MAX_LINES still allowed.
LONG_ALLOWED: dict[str, str] = {}
#: Modules whose private reaches are not counted yet.
REACHES_ALLOWED: dict[str, str] = {}
#: Underscored vendor names documented as public API by their owners (not counted).
VENDOR_PUBLIC = {
    "os._exit",  # the os module's docs: "exit the process ... without calling cleanup handlers"
    "asyncio._get_running_loop",  # in asyncio.events.__all__: the loop or None, without raising
}
#: At most this many private reaches outside the friend and the allowlist.
MAX_REACHES = 10


# ------------------------------------------------------------------ the reader
class Module:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rel = path.relative_to(ROOT).as_posix()
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        self.is_package = parts[-1] == "__init__"
        if self.is_package:
            parts = parts[:-1]
        self.name = ".".join(parts)
        self.source = path.read_text()
        self.tree = ast.parse(self.source, self.rel)
        self.lines = len(self.source.splitlines())

    @property
    def room(self) -> str:
        parts = self.name.split(".")
        if parts[0] == "streams":
            return "streams"
        return parts[1] if len(parts) > 1 else "__init__"

    def resolve(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        base = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))


@functools.cache
def modules() -> dict[str, Module]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mod = Module(path)
            found[mod.name] = mod
    return found


def imports(mod: Module, known: dict[str, Module]) -> set[str]:
    """The package modules ``mod`` imports, anywhere in its source."""
    out: set[str] = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = mod.resolve(node.module, node.level)
            subs = {f"{target}.{alias.name}" for alias in node.names} & set(known)
            out |= subs
            if target in known and len(subs) < len(node.names):
                out.add(target)  # some name comes from the package or module itself
    out.discard(mod.name)
    return out


@functools.cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(mod, known) for name, mod in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _defined(tree: ast.AST) -> set[str]:
    """Every name the module binds (see the module docstring)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)  # (``other._x = v`` defines nothing: it reaches into other)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            for const in ast.walk(node.value):
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    names.add(const.value)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def reaches(mod: Module, known: dict[str, Module]) -> list[tuple[int, str]]:
    """``(line, what)`` for each private reach in ``mod`` (see the module docstring)."""
    defined = _defined(mod.tree)
    out = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in defined:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            out.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom):
            target = mod.resolve(node.module, node.level)
            for alias in node.names:
                if _private(alias.name) and f"{target}.{alias.name}" not in known:
                    out.append((node.lineno, f"from {target} import {alias.name}"))
    return sorted(out)


def _friend(mod: Module, what: str, work_names: set[str]) -> bool:
    if mod.name != "asynccoll._core.ledger":
        return False
    name = what.rsplit(" ", 1)[-1].rsplit(".", 1)[-1]
    return name in work_names


def counted_reaches() -> tuple[list[str], list[str], list[str]]:
    """(counted, friend, allowlisted) reaches of the whole package, as ``path:line what``."""
    known = modules()
    work_names = _defined(known["asynccoll._core.work"].tree)
    counted, friend, allowed = [], [], []
    for mod in known.values():
        for line, what in reaches(mod, known):
            if what in VENDOR_PUBLIC:
                continue
            entry = f"{mod.rel}:{line} {what}"
            if _friend(mod, what, work_names):
                friend.append(entry)
            elif any(mod.rel.startswith(prefix) for prefix in REACHES_ALLOWED):
                allowed.append(entry)
            else:
                counted.append(entry)
    return counted, friend, allowed


# ------------------------------------------------------------------ the rules
def test_the_reader_sees_the_package() -> None:
    known = modules()
    assert "asynccoll._core.ledger" in known and "streams._watcher" in known
    edges = graph()
    # A relative, a package-relative and a function-level import are all edges.
    assert "asynccoll._core.work" in edges["asynccoll._core.ledger"]
    assert "asynccoll._core.validate" in edges["asynccoll._core.communicator"]
    assert "asynccoll._backends.flatten" in edges["asynccoll._backends.torch_pg"]
    assert "asynccoll._core.backend" in edges["asynccoll._core.coalescing"]  # under TYPE_CHECKING
    # ``from . import m`` is an edge to the module m, not to the package.
    assert "asynccoll._backends.nccl" not in edges["asynccoll._backends.nccl.launcher"]
    # The cycle finder: each strongly connected component once, nothing acyclic.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_reach_counter_counts_what_it_says() -> None:
    src = (
        "from .work import _DONE\n"
        "from . import _sub\n"
        "import torch\n"
        "class A:\n"
        "    __slots__ = ('_own',)\n"
        "    def f(self, other):\n"
        "        self._x = 1\n"
        "        other._x, other._own, self._y, cls._z = 2, 3, 4, 5\n"
        "        other._written = 6\n"
        "        torch._C; other._elsewhere; other.__dict__\n"
    )
    path = ROOT / "asynccoll" / "_core" / "_probe.py"
    mod = Module.__new__(Module)
    mod.path, mod.rel, mod.is_package, mod.name = (
        path,
        "asynccoll/_core/_probe.py",
        False,
        "asynccoll._core._probe",
    )
    mod.source, mod.tree = src, ast.parse(src)
    known = {"asynccoll._core._sub": mod}
    found = [what for _line, what in reaches(mod, known)]
    assert found == [
        "from asynccoll._core.work import _DONE",
        "other._written",
        "other._elsewhere",
        "torch._C",
    ]


def test_no_import_cycles() -> None:
    found = [c for c in cycles(graph()) if c not in CYCLES_ALLOWED]
    assert not found, f"import cycles (TYPE_CHECKING and function-level imports count): {found}"


def test_rooms_import_only_downwards() -> None:
    known = modules()
    edges = graph()
    wrong = []
    for name, targets in sorted(edges.items()):
        room = known[name].room
        allowed = ROOMS[room]
        for target in sorted(targets):
            other = known[target].room
            if other != room and "*" not in allowed and other not in allowed:
                wrong.append(f"{name} ({room}) -> {target} ({other})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_every_room_is_known() -> None:
    rooms = {mod.room for mod in modules().values()}
    assert rooms <= set(ROOMS), rooms - set(ROOMS)


def test_no_module_over_the_size_guard() -> None:
    long = {
        mod.rel: mod.lines
        for mod in modules().values()
        if mod.lines > MAX_LINES and mod.rel not in LONG_ALLOWED
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_allowlists_hold_only_what_still_breaks_a_rule() -> None:
    """An entry whose file now keeps the rule must leave the list (so the lists only shrink)."""
    known = {mod.rel: mod for mod in modules().values()}
    for rel in LONG_ALLOWED:
        assert rel in known and known[rel].lines > MAX_LINES, (
            f"{rel} is short now: drop it from LONG_ALLOWED"
        )
    found = cycles(graph())
    for cycle in CYCLES_ALLOWED:
        assert cycle in found, f"{sorted(cycle)} is no longer a cycle: drop it from CYCLES_ALLOWED"
    _counted, _friend_, allowed = counted_reaches()
    for prefix in REACHES_ALLOWED:
        assert any(entry.startswith(prefix) for entry in allowed), (
            f"{prefix} reaches nothing now: drop it"
        )


def test_private_reaches_at_most_ten() -> None:
    counted, friend, _allowed = counted_reaches()
    assert friend, "the ledger settles Works through their private API: the friend should be seen"
    assert len(counted) <= MAX_REACHES, "cross-module private reaches:\n" + "\n".join(counted)


def test_capability_tables_live_on_backends() -> None:
    """``Caps(...)`` tables are built only in ``_backends/`` (the interface's permissive
    default aside), and ``_core/validate.py`` asks the backend instead of keeping one."""
    builders = collections.defaultdict(list)
    for mod in modules().values():
        for node in ast.walk(mod.tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Caps"
            ):
                builders[mod.rel].append(node.lineno)
    outside = {
        rel: lines for rel, lines in builders.items() if not rel.startswith("asynccoll/_backends/")
    }
    assert set(outside) <= {"asynccoll/_core/backend.py"}, outside
    assert len(outside.get("asynccoll/_core/backend.py", [])) <= 1, outside
    assert any(rel.startswith("asynccoll/_backends/") for rel in builders), (
        "no backend declares a table"
    )
    validate = (ROOT / "asynccoll/_core/validate.py").read_text()
    for table in ("CAPS", "_GLOO", "_NCCL", "float16"):
        assert table not in validate, f"validate.py still holds a dtype table ({table})"


def test_backends_forward_nothing_by_getattr() -> None:
    """A backend wrapper forwards the declared attributes explicitly, never by ``__getattr__``."""
    for mod in modules().values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(b).endswith("Backend") for b in node.bases
            ):
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                assert "__getattr__" not in methods, (
                    f"{mod.rel}: {node.name} forwards by __getattr__"
                )


def test_nobody_discovers_backend_features() -> None:
    """What a backend can do is declared on ``Backend``: nobody asks with ``hasattr``/``getattr``."""
    found = []
    for mod in modules().values():
        for node in ast.walk(mod.tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
                and len(node.args) > 1
                and "backend" in ast.unparse(node.args[0]).lower()
                and isinstance(node.args[1], ast.Constant)
                and not str(node.args[1].value).startswith("__")
            ):
                found.append(f"{mod.rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, found
