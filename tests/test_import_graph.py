"""Dependencies point down, and nothing imports in a circle.

Checked statically over the source files with ``ast`` (every ``import`` anywhere in a module, function-local
ones included, and ``importlib.import_module`` / ``__import__`` of a literal name), so a lazy import cannot
hide an upward dependency or a circle. Two checks over the whole package:

* **floors**: each folder of ``fbs`` (and each top-level module) belongs to a floor in :data:`FLOORS`; a module
  imports only its own floor and floors below it; within a floor, the folders are ordered too
  (:data:`FOLDER_ORDER`): the core (``model`` <- ``native``), then the engine, then the layers above it.
* **no circles**: neither between modules nor between folders.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "fbs"

#: Every folder (``fbs.<folder>``) and top-level module in import order: a unit may import only units before it
#: (and itself). ``fbs`` is the package's public face (its ``__init__``: the model's API), ``cli`` the ``fbs``
#: command, ``cli_args`` the command-line options every command shares (below the commands' own ``cli``
#: modules in serve, train, eval, ... that use them).
FOLDER_ORDER = ("jsonl", "model", "native", "provenance", "fbs", "engine", "cli_args", "data", "baselines", "eval",
                "train", "rl", "serve", "bench", "cli")
#: The floors the issue names, over the units of :data:`FOLDER_ORDER`.
FLOORS = {"core": ("jsonl", "model", "native", "provenance", "fbs"), "engine": ("engine",), "options": ("cli_args",),
          "upper": ("data", "baselines", "eval", "train", "rl", "serve", "bench"), "top": ("cli",)}
#: What the library's core and engine never import: command-line parsing belongs to the commands.
CLI_ONLY = ("argparse",)
#: The one import that points up, by design: the model's ``generate`` / ``stream`` convenience methods hand the
#: model to the engine (a function-local import; the engine never imports the model class).
ALLOWED_UP = {("fbs.model.causal_lm", "fbs.engine")}
#: The recipes, evaluation, benchmark, data, RL, server and CLI: what the core, the engine and the baselines'
#: policies never import.
UPPER = ("fbs.train", "fbs.eval", "fbs.bench", "fbs.rl", "fbs.data", "fbs.serve", "fbs.cli")


def upward(names: set[str]) -> set[str]:
    return {n for n in names if any(n == u or n.startswith(u + ".") for u in UPPER)}


@functools.cache
def all_modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def imported_names(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of everything ``module``'s source imports, wherever the import statement is."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _walk_outside_main(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)  # `from fbs import train`
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname in ("import_module", "__import__"):
                names.add(node.args[0].value)
    return names


def _walk_outside_main(tree):
    """``ast.walk`` without the bodies of ``if __name__ == "__main__":`` (a script's entry point, not an import of
    the module)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) \
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            todo.extend(node.orelse)
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


@functools.cache
def module_edges_of_package() -> dict[str, frozenset[str]]:
    return {k: frozenset(v) for k, v in module_edges(all_modules()).items()}


def module_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports. ``from pkg import name`` counts ``pkg.name`` when that is a
    module, else ``pkg``; a name resolves to its longest module prefix."""
    edges = {}
    for mod, path in modules.items():
        names = imported_names(path.read_text(), mod, path.name == "__init__.py")
        targets = set()
        for n in names:
            parts = n.split(".")
            for i in range(len(parts), 0, -1):
                head = ".".join(parts[:i])
                if head in modules:
                    targets.add(head)
                    break
        # `from fbs.x import y` adds both fbs.x and fbs.x.y: keep the module actually named
        for t in list(targets):
            if any(o != t and o.startswith(t + ".") and o in targets and f"{t}.{o[len(t) + 1:]}" in names
                   and not _names_attr(names, t) for o in targets):
                targets.discard(t)
        edges[mod] = targets - {mod}
    return edges


def _names_attr(names: set[str], pkg: str) -> bool:
    """Whether an import names a non-module attribute of ``pkg`` (then ``pkg`` itself is imported)."""
    mods = all_modules()
    return any(n.startswith(pkg + ".") and n not in mods and n.rpartition(".")[0] == pkg for n in names)


def unit(module: str) -> str:
    """The folder (``fbs.model.layer`` -> ``model``) or top-level module (``fbs.cli`` -> ``cli``) of a module;
    a ``__main__`` (``python -m fbs.bench``) is a command entry point, part of ``cli``."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "cli"
    return "fbs" if len(parts) == 1 else parts[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def allowed(src: str, dst: str) -> bool:
    return any(src == a and (dst == b or dst.startswith(b + ".")) for a, b in ALLOWED_UP)


def test_the_checker_sees_lazy_relative_and_dynamic_imports():
    src = '''
import torch
from .config import FBSConfig

def f():
    from .train.lora import ADAPTERS_NAME
    from . import eval as e
    import importlib
    importlib.import_module("fbs.bench.runner")

class C:
    def g(self):
        from ..data import corpus
'''
    names = imported_names(src, "fbs.model.gate")
    assert {"fbs.model.config", "fbs.bench.runner", "fbs.data.corpus", "fbs.model.train.lora", "fbs.model.eval"} \
        <= names
    top = imported_names(src, "fbs.engine", is_package=True)
    assert {"fbs.engine.config", "fbs.engine.train.lora.ADAPTERS_NAME", "fbs.bench.runner", "fbs.data"} <= top


def test_cycle_finder_finds_a_circle_and_only_circles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_folder_has_a_floor_and_a_place_in_the_order():
    units = {unit(m) for m in all_modules()}
    assert units <= set(FOLDER_ORDER), f"place {sorted(units - set(FOLDER_ORDER))} in FOLDER_ORDER"
    assert [u for floor in FLOORS.values() for u in floor] == list(FOLDER_ORDER)
    assert {"model", "native", "engine"} <= units


@pytest.mark.parametrize("module", sorted(all_modules()))
def test_module_imports_only_its_floor_and_below(module):
    edges = module_edges_of_package()
    rank = {u: i for i, u in enumerate(FOLDER_ORDER)}
    bad = sorted(d for d in edges[module] if rank[unit(d)] > rank[unit(module)] and not allowed(module, d))
    assert not bad, f"{module} imports {bad}, which sit above {unit(module)!r} in {FOLDER_ORDER}"


def test_no_circles_between_modules():
    edges = module_edges_of_package()
    assert cycles(edges) == []


def test_no_circles_between_folders():
    edges = module_edges_of_package()
    folders: dict[str, set[str]] = {}
    for src, dsts in edges.items():
        for dst in dsts:
            if unit(src) != unit(dst) and not allowed(src, dst):
                folders.setdefault(unit(src), set()).add(unit(dst))
    assert cycles(folders) == []


def test_no_module_imports_a_private_name_from_another_package():
    modules = all_modules()
    bad = []
    for mod, path in modules.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level else []
                src = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                src_pkg = src if src in modules and modules[src].name == "__init__.py" else src.rpartition(".")[0]
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private and src_pkg != pkg:
                    bad.append(f"{mod}: from {src} import {private}")
    assert not bad, bad


def _package(module: str) -> str:
    return module if all_modules()[module].name == "__init__.py" else module.rpartition(".")[0]


def private_reads(source: str, module: str) -> set[str]:
    """``pkg.module._name`` read through a module object that an import of ``module``'s source bound (``import
    fbs.x.y``, ``from fbs.x import y``, ``from . import y``), where the module sits in another package."""
    modules, own = all_modules(), _package(module)
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the package module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own.split(".")
                src = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                if f"{src}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{src}.{a.name}"
    out = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        target = bound[value.id]
        for part in reversed(chain):  # `fbs.engine.fused._x`: walk down the dotted module path
            target = f"{target}.{part}" if f"{target}.{part}" in modules else None
            if target is None:
                break
        if target is not None and _package(target) != own:
            out.add(f"{target}.{node.attr}")
    return out


def test_private_reads_are_found_through_module_objects():
    src = """
import fbs.engine.fused
from fbs.eval import datasets as ds
from ..model import layer
from . import cache

def f(x):
    return ds._hidden(x), fbs.engine.fused._rms(x), layer._helper, cache._mine, x._attr, ds.public
"""
    assert private_reads(src, "fbs.engine.decoder") == {"fbs.eval.datasets._hidden", "fbs.model.layer._helper"}
    assert private_reads(src, "fbs.rl.pool") >= {"fbs.engine.fused._rms", "fbs.eval.datasets._hidden"}


def test_no_module_reads_a_private_name_of_another_package():
    bad = sorted((mod, name) for mod, path in all_modules().items() for name in private_reads(path.read_text(), mod))
    assert bad == []


@pytest.mark.parametrize("floor", ["core", "engine"])
def test_the_core_and_engine_parse_no_command_lines(floor):
    """The model, native and engine folders take arguments, not command lines: argparse lives in the commands and
    :mod:`fbs.cli_args`."""
    bad = []
    for mod, path in all_modules().items():
        if unit(mod) in FLOORS[floor]:
            names = imported_names(path.read_text(), mod, path.name == "__init__.py")
            bad += [f"{mod} imports {n}" for n in sorted(names) if n.split(".")[0] in CLI_ONLY]
    assert not bad, bad
