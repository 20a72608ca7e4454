"""The package's import graph: no circles, and nothing climbs back up.

Every module of ``mcore_ext`` is parsed (ast, nothing imported) for its imports of ``mcore_ext``.
A *room* is a top-level module or subpackage (``hf``, ``moe``, ``checkpoint``); the package's own
``__init__`` is the room ``mcore_ext``.

Imports inside functions (lazy imports) count like module-level ones: they defer a heavy or
optional dependency, but a lazy import that closes a circle only hides two modules that each
need the other (``moe`` <-> ``layer_kinds`` was such a circle). Not counted: the parent packages
Python imports before a submodule (``mcore_ext/__init__.py`` before any of them), as in
import-linter; a package's ``__init__`` therefore never depends on its submodules' importers.
"""

import ast
import functools
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mcore_ext"
ROOT_ROOM = "mcore_ext"

# The launchers and adapters: each is a thin entry onto what lies below, so no other room imports
# them and none imports another (what two of them share belongs below both).
ADAPTERS = {"training", "megatron_lm", "bridge"}
# The repository's folders above the package: it imports none of them.
OUTSIDE = ("launch", "tests", "benchmarks", "scripts")


@functools.lru_cache(maxsize=None)
def _module_files() -> dict:
    """{dotted module name: path} of every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


@functools.lru_cache(maxsize=None)
def _imports() -> tuple:
    """(importer, imported module, line, lazy) for every import of an mcore_ext module."""
    modules = _module_files()
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(node, lazy):
            for child in ast.iter_child_nodes(node):
                in_function = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                targets = []
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:  # relative: from the package, one level up per extra dot
                        anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join(anchor + ([base] if base else []))
                    # `from a import b` imports the module a.b when there is one, else a
                    targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                               else base for alias in child.names]
                for target in dict.fromkeys(targets):  # once per statement and module
                    if target.split(".")[0] in (ROOT_ROOM, *OUTSIDE):
                        found.append((name, target, child.lineno, in_function))
                visit(child, in_function)

        visit(ast.parse(path.read_text(), filename=str(path)), False)
    return tuple(found)


def _internal() -> list:
    return [edge for edge in _imports() if edge[1].split(".")[0] == ROOT_ROOM]


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_ROOM


def _describe(edge) -> str:
    importer, target, line, lazy = edge
    path = _module_files()[importer].relative_to(PACKAGE.parent)
    return f"{path}:{line} imports {target}{' (inside a function)' if lazy else ''}"


def _cycles(graph: dict) -> list:
    """The strongly connected components of ``graph`` with more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _cycle_report(edges: list, key) -> list:
    """One line per circle: its members and the imports that make it."""
    graph = defaultdict(set)
    for edge in edges:
        if key(edge[0]) != key(edge[1]):
            graph[key(edge[0])].add(key(edge[1]))
    report = []
    for component in _cycles(graph):
        members = set(component)
        inside = [_describe(e) for e in edges
                  if key(e[0]) in members and key(e[1]) in members and key(e[0]) != key(e[1])]
        report.append(f"{' <-> '.join(component)}: " + "; ".join(inside))
    return report


def test_no_module_imports_another_that_imports_it_back():
    """(a) No circle between mcore_ext modules, lazy imports included."""
    report = _cycle_report(_internal(), key=lambda module: module)
    assert not report, "import circles between modules:\n" + "\n".join(report)


def test_no_room_imports_a_room_that_imports_it_back():
    """(b) The rooms form one order: no circle between them either (a module of ``moe`` using
    ``layer_kinds`` while another module of ``layer_kinds`` uses ``moe`` is a tangle too)."""
    report = _cycle_report(_internal(), key=_room)
    assert not report, "import circles between rooms:\n" + "\n".join(report)


def test_nothing_below_imports_an_adapter_and_adapters_stand_apart():
    """(c) training, megatron_lm and bridge are imported by no other room, nor by each other:
    hf, plan, checkpoint, run_config, attention, models and the layer pieces sit below them."""
    climbs = [_describe(e) for e in _internal()
              if _room(e[1]) in ADAPTERS and _room(e[0]) != _room(e[1])]
    assert not climbs, "imports of an adapter (training / megatron_lm / bridge):\n" + "\n".join(
        climbs)


def test_the_package_imports_nothing_of_the_repository_above_it():
    """Dependencies point one way: launch/, tests/, benchmarks/ -> mcore_ext -> megatron.core."""
    outward = [_describe(e) for e in _imports() if e[1].split(".")[0] in OUTSIDE]
    assert not outward, "mcore_ext imports from outside the package:\n" + "\n".join(outward)


def test_every_room_is_placed():
    """The rooms this test knows of are the package's: a renamed adapter would otherwise pass
    (c) unnoticed."""
    rooms = {_room(module) for module in _module_files()}
    assert ADAPTERS <= rooms, f"adapters missing from the package: {sorted(ADAPTERS - rooms)}"
