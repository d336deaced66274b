"""No module of raggedfsdp reads another module's private names.

A leading underscore is the only privacy Python has: ``p._rank`` read outside the module that
defines it ties two modules to one implementation detail, and the reader cannot tell from the
owner's public surface that anyone depends on it. This test parses every module (no imports) and
fails on

* ``x._name`` read where ``x`` is not ``self`` / ``cls`` and ``_name`` is defined only in *other*
  raggedfsdp modules (a ``def``, a ``class``, a module or class attribute, an attribute assigned
  anywhere as ``obj._name = ...``, or a private attribute name held in a module constant or
  passed to ``setattr``);
* ``Name._name`` where ``Name`` was imported from another raggedfsdp module that defines
  ``_name`` (e.g. calling ``OtherClass._method(self, ...)`` as an unbound method);
* ``getattr(x, "_name")`` / ``hasattr(x, "_name")`` with such a name;
* ``from raggedfsdp.mod import _name``.

Torch's own private names (``module._parameters``, ``torch._C``) are defined nowhere in
raggedfsdp and are not ours to police. Dunder names are public protocol.

It also holds raggedfsdp and the recipes to one screen per function (``MAX_FUNCTION_LINES``)
and to imports without cycles (``import_cycles``).
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import raggedfsdp
import recipes

PACKAGE = Path(raggedfsdp.__file__).parent
RECIPES = Path(recipes.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _string_arg(call: ast.Call, index: int) -> str | None:
    if len(call.args) > index:
        arg = call.args[index]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


@dataclass
class _Module:
    """What one source file defines and imports, from its syntax tree alone."""

    dotted: str
    tree: ast.Module
    defines: set[str] = field(default_factory=set)
    imported: dict[str, str] = field(default_factory=dict)  # local name -> raggedfsdp module

    def __post_init__(self) -> None:
        self._scope(self.tree.body)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.defines.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                self.defines.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                self.defines.add(_string_arg(node, 1) or "")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("raggedfsdp"):
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = node.module or ""

    def _scope(self, body: list[ast.stmt]) -> None:
        """Names bound at module or class level (globals, class attributes, ``__slots__``)."""
        for node in body:
            if isinstance(node, ast.ClassDef):
                self._scope(node.body)
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                self.defines.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            value = getattr(node, "value", None)
            if targets and value is not None:  # attribute names kept in constants or slots
                for const in ast.walk(value):
                    text = const.value if isinstance(const, ast.Constant) else None
                    if isinstance(text, str) and text.isidentifier() and _private(text):
                        self.defines.add(text)


def _modules(root: Path, package: str) -> dict[str, _Module]:
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[dotted] = _Module(dotted, ast.parse(path.read_text(), str(path)))
    return modules


def private_reads(root: Path, package: str = "raggedfsdp") -> list[str]:
    """Every read of another module's private name under ``root``, as ``module:line: why``."""
    modules = _modules(root, package)
    found = []
    for mod in modules.values():
        for line, name, why in _reads(mod, modules):
            if name not in mod.defines and why:
                found.append(f"{mod.dotted}:{line}: {why}")
    return found


def _reads(mod: _Module, modules: dict[str, _Module]) -> Iterator[tuple[int, str, str]]:
    def owners(name: str) -> list[str]:
        return sorted(m.dotted for m in modules.values() if m is not mod and name in m.defines)

    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name = node.attr
            base = node.value.id if isinstance(node.value, ast.Name) else ""
            if not _private(name) or base in ("self", "cls"):
                continue
            source = modules.get(mod.imported.get(base, ""))
            if source is not None and source is not mod and name in source.defines:
                yield node.lineno, "", f"{base}.{name} of {source.dotted}"
            elif where := owners(name):
                yield node.lineno, name, f".{name} (defined only in {', '.join(where)})"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = _string_arg(node, 1) or ""
            if (
                node.func.id in ("getattr", "hasattr")
                and _private(name)
                and (where := owners(name))
            ):
                yield node.lineno, name, f"{node.func.id}(..., {name!r}) (defined in {where})"
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            for alias in node.names:
                if _private(alias.name) and alias.name in modules[node.module].defines:
                    yield node.lineno, "", f"imports {node.module}.{alias.name}"


def test_no_module_reads_another_modules_private_names() -> None:
    found = private_reads(PACKAGE)
    assert not found, "modules read other modules' private names:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_read(tmp_path: Path) -> None:
    """The rule on a small package: each kind of cross-module read is caught, reads of a
    module's own privates and of torch's are not."""
    files = {
        "__init__.py": "",
        "owner.py": """
            ATTR = "_hidden_attr"

            class Owner:
                __slots__ = ("_slot",)

                def __init__(self):
                    self._secret = 1

                def _method(self):
                    return self._secret

            def _helper():
                return 0
            """,
        "reader.py": """
            import torch
            from pkg.owner import Owner, _helper

            def read(o, module):
                o._secret
                o._slot
                Owner._method(o)
                getattr(module, "_hidden_attr", None)
                module._parameters  # torch's
                torch._C  # torch's
                o._mine = 1
                return o._mine  # defined here
            """,
    }
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    found = private_reads(tmp_path, "pkg")
    lines = sorted(int(f.split(":")[1]) for f in found)
    assert lines == [3, 6, 7, 8, 9], found


MAX_FUNCTION_LINES = 80


def long_functions(root: Path) -> list[str]:
    """Every function under ``root`` longer than ``MAX_FUNCTION_LINES``, as ``path:line name``."""
    long = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines})")
    return long


@pytest.mark.parametrize("root", [PACKAGE, RECIPES], ids=["raggedfsdp", "recipes"])
def test_no_function_is_longer_than_a_screen(root: Path) -> None:
    """A function that does not fit on a screen does several things; name them instead. The
    recipes are read as examples, so they keep the rule too."""
    long = long_functions(root)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _imports(mod: _Module, modules: dict[str, _Module]) -> set[str]:
    """The modules of the package ``mod`` imports anywhere: at the top, under ``TYPE_CHECKING``
    or inside a function (a deferred import hides a cycle, it does not remove one)."""
    found = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            base = node.module or ""
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `from pkg import name` of a non-module
                name = name.rpartition(".")[0]
            if name and name != mod.dotted:
                found.add(name)
    return found


def import_cycles(root: Path, package: str) -> list[list[str]]:
    """Every set of modules under ``root`` that import each other, directly or around a ring."""
    modules = _modules(root, package)
    graph = {name: _imports(mod, modules) for name, mod in modules.items()}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reachable = {name: reach(name) for name in graph}
    cycles = {
        tuple(sorted(m for m in reachable[name] if name in reachable[m]))
        for name in graph
        if name in reachable[name]
    }
    return [list(cycle) for cycle in sorted(cycles)]


@pytest.mark.parametrize("root", [PACKAGE, RECIPES], ids=["raggedfsdp", "recipes"])
def test_no_modules_import_each_other(root: Path) -> None:
    """Two modules that need each other are one concept split in two, or share a piece that
    belongs below both (as ``ManagedParam`` does under ``param_group`` and ``float8_gather``)."""
    cycles = import_cycles(root, root.name)
    assert not cycles, f"modules importing each other: {cycles}"


def test_the_cycle_check_sees_deferred_and_type_checking_imports(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "a.py": "from pkg.b import B\n",
        "b.py": """
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from pkg.c import C

            class B: ...
            """,
        "c.py": "def make():\n    from pkg import a\n",
        "d.py": "from pkg.a import B\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    assert import_cycles(tmp_path, "pkg") == [["pkg.a", "pkg.b", "pkg.c"]]
