"""The import graph of cyclone_mp and its CLI, read from the source with :mod:`ast`.

Every ``import`` counts, at module level or inside a function, since either can close
a loop at run time. ``from . import name`` is an edge to the module ``name`` when it is
one, else to the package itself; importing ``pkg.mod`` from outside ``pkg`` is an edge to
``pkg`` too (its ``__init__`` runs first). A loop is a strongly connected component of more than
one module. The child's trampoline (``_child``, ``_zygote``, ``_concurrent``: a child's
start-up path, which imports lazily on purpose) is the one loop allowed.

Usage: ``python scripts/import_graph.py`` prints the loops, the function-level imports
without a comment saying why, and the modules over 500 lines; it exits 1 when any is
found. ``tests/unit/test_layout.py`` runs the same checks.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cyclone_mp", "cli")
TRAMPOLINE = frozenset({"cyclone_mp._child", "cyclone_mp._zygote", "cyclone_mp._concurrent"})
MAX_LINES = 500


@dataclass
class Module:
    """One source file: its dotted name, path, lines and the imports it makes."""

    name: str
    path: Path
    is_package: bool
    lines: list[str]
    imports: set[str] = field(default_factory=set)
    lazy: list[tuple[int, str]] = field(default_factory=list)  # (line number, what it imports)


def module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def collect(root: Path = ROOT) -> dict[str, Module]:
    """Every module of the packages, with its imports resolved to modules of the packages."""
    modules: dict[str, Module] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name, is_package = module_name(path)
            modules[name] = Module(name, path, is_package, path.read_text().splitlines())
    for module in modules.values():
        tree = ast.parse("\n".join(module.lines), str(module.path))
        for node, nested in _imports(tree):
            if nested:
                module.lazy.append((node.lineno, _spelled(node)))
            for target in _targets(module, node, modules):
                module.imports.update(t for t in (target, *_entered(module, target, modules)) if t != module.name)
    return modules


def _imports(tree: ast.AST):
    """(import node, inside a function or class body?) for every import in the tree."""

    def walk(node: ast.AST, nested: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, nested
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # read by type checkers only, never run
            else:
                inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, inner)

    yield from walk(tree, False)


def _spelled(node: ast.Import | ast.ImportFrom) -> str:
    if isinstance(node, ast.Import):
        return ", ".join(alias.name for alias in node.names)
    return "." * node.level + (node.module or "")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(module: Module, node: ast.Import | ast.ImportFrom, modules: dict[str, Module]) -> list[str]:
    if isinstance(node, ast.Import):
        return [_owner(alias.name, modules) for alias in node.names if _owner(alias.name, modules)]
    if node.level:
        base = module.name.split(".")
        if not module.is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    found = []
    for alias in node.names:
        candidate = f"{stem}.{alias.name}"
        owner = candidate if candidate in modules else _owner(stem, modules)
        if owner:
            found.append(owner)
    return found


def _entered(module: Module, target: str, modules: dict[str, Module]) -> list[str]:
    """The packages whose ``__init__`` importing ``target`` runs first: each package
    above it that ``module`` is not inside of (inside, the package is already loading)."""
    parts = target.split(".")
    found = []
    for end in range(1, len(parts)):
        package = ".".join(parts[:end])
        if package in modules and not module.name.startswith(package + "."):
            found.append(package)
    return found


def _owner(dotted: str, modules: dict[str, Module]) -> str | None:
    """The module of the packages that `dotted` names (or lies in), if any."""
    parts = dotted.split(".")
    while parts:
        name = ".".join(parts)
        if name in modules:
            return name
        parts.pop()
    return None


def loops(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        work = [(start, iter(sorted(modules[start].imports)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(modules[target].imports))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def forbidden_loops(modules: dict[str, Module]) -> list[list[str]]:
    """The loops other than the child's trampoline."""
    return [loop for loop in loops(modules) if not set(loop) <= TRAMPOLINE]


def uncommented_lazy_imports(modules: dict[str, Module]) -> list[str]:
    """Function-level imports with no comment on their line or the line above."""
    found = []
    for module in modules.values():
        for lineno, target in sorted(set(module.lazy)):
            here = module.lines[lineno - 1]
            above = module.lines[lineno - 2].strip() if lineno > 1 else ""
            if "#" not in here and not above.startswith("#"):
                found.append(f"{module.path.relative_to(ROOT)}:{lineno} imports {target}")
    return found


def long_modules(modules: dict[str, Module], limit: int = MAX_LINES) -> list[str]:
    return [f"{m.path.relative_to(ROOT)}: {len(m.lines)} lines"
            for m in modules.values() if len(m.lines) > limit]


def main() -> int:
    modules = collect()
    problems = 0
    for title, items in (
        ("loops", [" <-> ".join(loop) for loop in forbidden_loops(modules)]),
        ("function-level imports without a comment", uncommented_lazy_imports(modules)),
        (f"modules over {MAX_LINES} lines", long_modules(modules)),
    ):
        print(f"{title}: {len(items)}")
        for item in items:
            print(f"  {item}")
        problems += len(items)
    edges = sum(len(m.imports) for m in modules.values())
    print(f"{len(modules)} modules, {edges} import edges")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
