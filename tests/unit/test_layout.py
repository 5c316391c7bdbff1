"""The package's layout holds: no import loop but the child's trampoline, every
function-level import says why it is one, no module over 500 lines, and psycopg only
behind the store (``scripts/import_graph.py`` prints the same findings)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = graph  # dataclasses look their module up by name
_spec.loader.exec_module(graph)

MODULES = graph.collect()


def test_the_graph_sees_every_module_and_its_imports():
    assert "cyclone_mp.supervisor" in MODULES and "cli.main" in MODULES
    assert "cyclone_mp.errors" in MODULES["cyclone_mp.context"].imports


def test_no_import_loop_but_the_childs_trampoline():
    assert graph.forbidden_loops(MODULES) == []


def test_the_loop_finder_finds_a_loop():
    a = graph.Module("p.a", ROOT / "a.py", False, [], {"p.b"})
    b = graph.Module("p.b", ROOT / "b.py", False, [], {"p.c"})
    c = graph.Module("p.c", ROOT / "c.py", False, [], {"p.a"})
    d = graph.Module("p.d", ROOT / "d.py", False, [], {"p.a"})
    assert graph.loops({m.name: m for m in (a, b, c, d)}) == [["p.a", "p.b", "p.c"]]


def test_every_function_level_import_says_why():
    assert graph.uncommented_lazy_imports(MODULES) == []


def test_no_module_over_500_lines():
    assert graph.long_modules(MODULES) == []


def test_psycopg_only_behind_the_store():
    """``grep -l psycopg cyclone_mp``: the store, the connections module, the test helpers."""
    allowed = ("cyclone_mp/store/", "cyclone_mp/connections.py", "cyclone_mp/testing/")
    found = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "cyclone_mp").rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and b"psycopg" in p.read_bytes()]
    assert [p for p in found if not p.startswith(allowed)] == []


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages the wheel installs by hand: every folder of the
    library with Python in it is listed (a missing one installs fine in editable mode and
    breaks every non-editable install at its first import), and every listed one exists."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    folders = {"cyclone_mp_cli": ROOT / "cli"}
    for init in (ROOT / "cyclone_mp").rglob("*.py"):
        folder = init.parent
        if "__pycache__" not in folder.parts:
            folders[".".join(folder.relative_to(ROOT).parts)] = folder
    assert set(folders) - listed == set(), "packages missing from pyproject.toml's [tool.setuptools] packages"
    missing = {name for name in listed if not (ROOT / setup.get("package-dir", {}).get(name, name.replace(".", "/"))).is_dir()}
    assert missing == set(), "listed packages that do not exist"
