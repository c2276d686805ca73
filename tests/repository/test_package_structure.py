"""The package's modules form a layered graph: no import cycles among
``torch_bn_grad``'s modules, its subpackages' included (imports inside
functions too), and no module reaches into another's private (underscore)
names. Modules are named by their dotted path in the package (``nn``,
``bench.ops``; a subpackage's ``__init__`` by the subpackage's name). Private *modules*
(``_compat``, ``_convert``, ...) are the package's own and may be imported
anywhere in it; the compiled extension ``_C`` is not a Python module here.
Read from the source (``ast``), so it checks what a reader sees.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Optional

PACKAGE = "torch_bn_grad"
ROOT = pathlib.Path(__file__).resolve().parents[2] / PACKAGE


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(path): ast.parse(path.read_text(), str(path)) for path in sorted(ROOT.rglob("*.py"))}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _submodule(dotted: Optional[str], modules: set[str]) -> Optional[str]:
    """The longest project module that ``torch_bn_grad.<dotted>`` names
    (``bench.ops`` for ``torch_bn_grad.bench.ops``), else None."""
    if dotted is None or not dotted.startswith(PACKAGE + "."):
        return None
    parts = dotted.split(".")[1:]
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) if parts else dotted.split(".")[1]


def _uses(name: str, tree: ast.Module, modules: set[str]) -> tuple[set[str], list[str]]:
    """(the project modules ``name`` imports, its uses of other modules' private names)."""
    imported: set[str] = set()
    aliases: dict[str, str] = {}  # local name -> project module
    private: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            owner = None if node.module == PACKAGE else _submodule(node.module, modules)
            if node.module != PACKAGE and owner is None:
                continue
            for alias in node.names:
                module = f"{owner}.{alias.name}" if owner else alias.name
                if module in modules:  # a module imported from its package
                    imported.add(module)
                    aliases[alias.asname or alias.name] = module
                elif owner is not None:
                    imported.add(owner)
                    if _is_private(alias.name):
                        private.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if (owner := _submodule(alias.name, modules)) is not None:
                    imported.add(owner)
                    if alias.asname:
                        aliases[alias.asname] = owner
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and aliases[node.value.id] != name and _is_private(node.attr)):
            private.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    imported -= {name, "__init__"}
    return imported & modules, private


def _graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    trees = _modules()
    names = set(trees) - {"__init__"}
    graph, private = {}, {}
    for name, tree in trees.items():
        graph[name], private[name] = _uses(name, tree, names)
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that lies on one (depth-first search)."""
    found, state = [], {}  # state: 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_checks_see_what_they_look_for():
    """The checks find a cycle and a private use when there is one (so a pass means something)."""
    a = ast.parse("from torch_bn_grad import b\nb._helper()\n")
    b = ast.parse("from torch_bn_grad.a import _thing\n")
    assert _uses("a", a, {"a", "b"}) == ({"b"}, ["line 2: b._helper"])
    assert _uses("b", b, {"a", "b"}) == ({"a"}, ["line 1: from torch_bn_grad.a import _thing"])
    c = ast.parse("from torch_bn_grad.sub import d\nfrom torch_bn_grad.sub.d import _x\n")
    assert _uses("c", c, {"c", "sub", "sub.d"}) == ({"sub.d"}, ["line 2: from torch_bn_grad.sub.d import _x"])
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_the_modules():
    graph, _ = _graph()
    assert graph["nn"], "the import graph is empty: the parser no longer sees the imports"
    assert _cycles(graph) == [], "import cycles (each as a path that comes back to its start)"


def test_no_module_uses_another_modules_private_names():
    _, private = _graph()
    offenders = {name: uses for name, uses in private.items() if uses}
    assert offenders == {}, "make the shared helper public (no underscore) in the module that owns it"


def test_private_modules_live_in_subpackages_by_idea():
    """The package's top holds the public modules (where users import them) and
    ``_compat``; every other private module sits in a subpackage whose docstring
    says what it holds, and nothing is left that no subpackage file names."""
    top_private = sorted(path.stem for path in ROOT.glob("_*.py") if path.stem not in ("__init__", "_compat"))
    assert top_private == [], "private modules belong in a subpackage (_rules, _forward, _library, ...)"
    for package in sorted(path for path in ROOT.iterdir() if path.is_dir() and (path / "__init__.py").exists()):
        tree = ast.parse((package / "__init__.py").read_text())
        doc = ast.get_docstring(tree) or ""
        assert doc, f"{package.name}/__init__.py: a docstring saying what the subpackage holds"
        if package.name.startswith("_"):
            unnamed = [p.name for p in sorted(package.glob("*.py")) if p.name != "__init__.py" and p.name not in doc]
            assert unnamed == [], f"{package.name}/__init__.py's docstring does not name {unnamed}"
