"""The package's floors, read from its source with ``ast``: ``ops/`` is the ground floor (its stack is listed in
ops/__init__.py), so

* no import circle among ``ops/`` modules, counting imports inside functions (a circle held together by
  function-level imports is still one: each module then needs the other to be importable, and neither can be
  read or tested alone);
* ``ops/`` imports nothing above it: not a kernel family, not ``testing/``, not an integration or a tool. The
  exceptions: the registry walking the ``kernels`` package to discover the families' manifests (``import
  mla_backend_plugin.kernels`` and ``importlib.import_module`` in ``registry._discover``), and ``manifest.lazy``,
  which imports the module a family's manifest names (the family's own) on first call.

Every import statement counts, wherever it is (module level, function, ``TYPE_CHECKING`` block).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import mla_backend_plugin

PACKAGE_DIR = pathlib.Path(mla_backend_plugin.__file__).resolve().parent
ROOT = PACKAGE_DIR.name  # "mla_backend_plugin"
OPS = f"{ROOT}.ops"
# what an ops/ module may import from the package besides ops/ itself: the package root (its __init__ runs for
# any submodule anyway) and the environment variables
OPS_MAY_IMPORT = {ROOT, f"{ROOT}.envs"}
# (importing module, imported module): the registry's discovery of kernel families
DISCOVERY = {(f"{OPS}.registry", f"{ROOT}.kernels")}
# (module, function) that may import modules by name: the registry's discovery, and ``manifest.lazy``, through
# which a kernel family's manifest imports the family's own modules on first call
DYNAMIC_IMPORT_SITES = {(f"{OPS}.registry", "_discover"), (f"{OPS}.manifest", "lazy.call")}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES.get(name, pathlib.Path()).name == "__init__.py"


def _known(name: str) -> str:
    """``name`` or, for an attribute of a module (``pkg.mod.func``), the longest prefix that is a module."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str, source: str | None = None) -> list[tuple[str, int]]:
    """(imported package module, line) of every import statement in ``module`` (its file, or ``source``) that
    names this package."""
    tree = ast.parse(MODULES[module].read_text() if source is None else source)
    package = module if _is_package(module) else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                       for alias in node.names]
        else:
            continue
        found += [(_known(t), node.lineno) for t in targets if t == ROOT or t.startswith(ROOT + ".")]
    return sorted(found, key=lambda item: item[1])


def _dynamic_imports(module: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of every ``importlib.import_module(...)`` / ``__import__(...)`` call."""
    tree = ast.parse(MODULES[module].read_text())
    found = []

    def visit(node, where: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, child.name if where == "<module>" else f"{where}.{child.name}")
                continue
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in ("import_module", "__import__"):
                    found.append((where, child.lineno))
            visit(child, where)

    visit(tree, "<module>")
    return found


OPS_MODULES = sorted(m for m in MODULES if m == OPS or m.startswith(OPS + "."))


def ops_graph() -> dict[str, dict[str, list[int]]]:
    """ops module -> ops module it imports -> lines (the parent package an import runs first is not an edge)."""
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in OPS_MODULES}
    for module in OPS_MODULES:
        for target, line in imports_of(module):
            if target in graph and target != module:
                lines = graph[module].setdefault(target, [])
                if line not in lines:
                    lines.append(line)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (each one is an import circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _short(module: str) -> str:
    return module.removeprefix(ROOT + ".")


def test_the_walk_sees_every_kind_of_import():
    """What the checks below rely on: module-level, function-level and relative imports, submodules named in a
    ``from`` list, names of a module resolved to the module (so that the checks cannot pass by reading nothing)."""
    assert f"{OPS}.api" in OPS_MODULES and f"{OPS}.registry" in OPS_MODULES and OPS in OPS_MODULES
    source = (f"import {ROOT}.ops.arch\n"
              f"from {ROOT}.ops.constants import KV_LORA_RANK\n"
              f"from {ROOT} import envs, BACKEND_NAME\n"
              "import torch\n"
              "def f():\n"
              "    from . import timing\n"
              "    from ..kernels.reference import mla_decode_reference\n"
              "    class C:\n"
              "        def g(self):\n"
              f"            import {ROOT}.testing.inputs\n")
    assert imports_of(f"{OPS}.api", source) == [
        (f"{OPS}.arch", 1), (f"{OPS}.constants", 2), (f"{ROOT}.envs", 3), (ROOT, 3), (f"{OPS}.timing", 6),
        (f"{ROOT}.kernels.reference", 7), (f"{ROOT}.testing.inputs", 10)]


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b": [1]}, "b": {"c": [2]}, "c": {"a": [3]}, "d": {"a": [4]}, "e": {}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b": [1]}, "b": {}}) == []


def test_no_import_circle_in_ops():
    graph = ops_graph()
    circles = strongly_connected(graph)
    lines = []
    for component in circles:
        members = set(component)
        edges = [f"    {_short(a)} -> {_short(b)} (line {', '.join(map(str, graph[a][b]))})"
                 for a in component for b in sorted(graph[a]) if b in members]
        lines.append(f"  circle of {', '.join(_short(m) for m in component)}:\n" + "\n".join(edges))
    assert not circles, "import circles among ops/ modules (function-level imports included):\n" + "\n".join(lines)


@pytest.mark.parametrize("module", OPS_MODULES, ids=_short)
def test_ops_imports_nothing_above_it(module):
    bad = [f"{_short(target)} (line {line})" for target, line in imports_of(module)
           if not (target == OPS or target.startswith(OPS + ".")) and target not in OPS_MAY_IMPORT
           and (module, target) not in DISCOVERY]
    assert not bad, (f"{_short(module)} imports above the ground floor (kernels/, testing/, an integration or a "
                     f"tool): {', '.join(bad)}")
    dynamic = [f"{where} (line {line})" for where, line in _dynamic_imports(module)
               if (module, where) not in DYNAMIC_IMPORT_SITES]
    assert not dynamic, f"{_short(module)} imports modules by name outside the registry's discovery: {dynamic}"


def test_ops_does_not_import_its_own_facade():
    """ops/__init__.py re-exports the kernel API for users; a module of ops/ importing from it would depend on
    everything the facade pulls in (a circle in waiting)."""
    bad = [f"{_short(m)} line {line}" for m in OPS_MODULES if m != OPS for t, line in imports_of(m) if t == OPS]
    assert not bad, f"ops/ modules import from the ops package facade: {bad}"
