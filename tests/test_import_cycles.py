"""The import graph of the ``pimm`` package has no cycles (issue 35).

The graph is read from the source with :mod:`ast` (nothing is imported), so a
cycle fails here even when import order happens to make it work at run time.

What counts as an edge ``A -> B`` (both modules of ``pimm``):

* every ``import`` / ``from ... import`` in ``A``, at module level **and inside
  functions and methods**: an import moved into a function to dodge a cycle
  still ties the two modules together, so it is a cycle too. Only the body of
  ``if TYPE_CHECKING:`` is left out (it never runs);
* ``import pimm.a.b`` and ``from pimm.a import b`` (``b`` a submodule) are
  edges to ``pimm.a.b`` only, not to the packages above it: otherwise every
  package ``__init__`` that re-exports its submodules would be a cycle;
* ``from pimm.a import name`` where ``name`` is not a submodule is an edge to
  the package ``pimm.a`` itself (its ``__init__``). So a submodule that takes
  a name from its own package's ``__init__``, while that ``__init__`` imports
  the submodule, is a cycle: submodules import their siblings directly;
* relative imports are resolved against the importing module's package.

* an old path of a moved module (``pimm.engines.scheduler``, kept importable by
  :mod:`pimm.utils.module_aliases`) is an edge to the module it now names.

Imports by string (``importlib.import_module``) are not followed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pimm
from pimm.utils.module_aliases import MOVED

PACKAGE_ROOT = Path(pimm.__file__).resolve().parent


def module_files(package_dir: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every .py under ``package_dir``."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree`` at any depth, except under ``if TYPE_CHECKING:``."""
    found = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return found


def _existing(name: str, modules: dict) -> str | None:
    """``name`` or its nearest enclosing module that is a file of the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _current(name: str, moved: dict[str, str]) -> str:
    """``name`` with an old path of a moved module (or of a package above it) replaced by the new one."""
    head = name
    while head:
        if head in moved:
            return moved[head] + name[len(head):]
        head = head.rpartition(".")[0]
    return name


def import_graph(package_dir: Path, moved: dict[str, str] | None = None) -> tuple[dict[str, dict[str, list[int]]], dict]:
    """module -> {imported module: [line numbers]} for imports within the package."""
    moved = MOVED if moved is None else moved
    modules = module_files(package_dir)
    top = package_dir.name
    graph: dict[str, dict[str, list[int]]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in import_nodes(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [_existing(_current(alias.name, moved), modules) for alias in node.names
                           if alias.name.split(".")[0] == top]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != top:
                    continue
                named = [_current(f"{source}.{alias.name}", moved) for alias in node.names]
                source = _current(source, moved)
                targets = [name_ if name_ in modules else _existing(source, modules) for name_ in named]
            for target in targets:
                if target and target != name:
                    edges.setdefault(target, []).append(node.lineno)
    return graph, modules


def strongly_connected(graph: dict[str, dict]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def describe(component: list[str], graph: dict, modules: dict) -> str:
    """One cycle: its modules and the import lines that tie them together."""
    members = set(component)
    lines = [" <-> ".join(component)]
    for name in component:
        path = modules[name][0].relative_to(PACKAGE_ROOT.parent)
        for target, line_numbers in sorted(graph[name].items()):
            if target in members:
                lines.append(f"    {path}:{','.join(map(str, sorted(set(line_numbers))))} imports {target}")
    return "\n".join(lines)


def test_pimm_has_no_import_cycles():
    graph, modules = import_graph(PACKAGE_ROOT)
    assert len(modules) > 100 and sum(len(e) for e in graph.values()) > 300  # the walker sees the package
    cycles = strongly_connected(graph)
    assert not cycles, (
        f"{len(cycles)} import cycle(s) in pimm; move the shared names to the module that owns them "
        "(or a small module both import), not into a function:\n"
        + "\n".join(describe(c, graph, modules) for c in cycles))


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pimm"
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_walker_finds_cycles_through_functions_relative_imports_and_package_inits(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from pimm import a\n",  # hidden in a function: still a cycle
        "pkg/__init__.py": "from .sub import g\nNAME = 1\n",
        "pkg/sub.py": "from . import NAME\ndef g(): pass\n",  # a name from its own package's __init__
        "c.py": "import pimm.d\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pimm import c\n",
        "e.py": "from pimm.pkg import sub\n",  # a submodule: an edge to pimm.pkg.sub, not to pimm.pkg
    })
    graph, _ = import_graph(root, moved={})
    assert strongly_connected(graph) == [["pimm.a", "pimm.b"], ["pimm.pkg", "pimm.pkg.sub"]]
    assert set(graph["pimm.e"]) == {"pimm.pkg.sub"} and set(graph["pimm.c"]) == {"pimm.d"}
    assert graph["pimm.d"] == {}  # TYPE_CHECKING imports never run


def test_old_paths_of_moved_modules_are_edges_to_their_new_homes(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "new/__init__.py": "",
        "new/mod.py": "from pimm.user import f\n",
        "user.py": "import pimm.old_mod\nfrom pimm import old_mod\ndef f(): pass\n",
    })
    graph, _ = import_graph(root, moved={"pimm.old_mod": "pimm.new.mod"})
    assert set(graph["pimm.user"]) == {"pimm.new.mod"}
    assert strongly_connected(graph) == [["pimm.new.mod", "pimm.user"]]
