"""Every ```python block of docs/*.md runs here, so the documentation cannot rot (issue 6).

How a block runs depends on its fence:

* ```` ```python title="name.py" ```` is a **file** of the example project. Every such
  block of a page is written to ``tmp_path/name.py`` before any block of that page runs,
  so other blocks (and the child processes that import handlers by module path) can
  import it. Its own test imports it, which checks that it imports cleanly.
* ```` ```python title="test_name.py" ```` is a **pytest file**: it runs with pytest in
  a subprocess (``cwd=tmp_path``), on this session's PostgreSQL server through
  ``CYCLONE_TEST_DSN``, so the example exercises the installed pytest plugin for real.
* A block without a title is a **script**: it is written to a module file under
  ``tmp_path`` and imported. When it mentions ``dsn``, the test gives it one (the
  ``cyclone_dsn`` fixture: a fresh migrated database) as a module global before it runs.

A block is skipped only when the line right before its fence is ``<!-- no-run -->``.
After each block, every ``cy.Client`` and ``Env`` it left in its module namespace is
stopped and closed, and its modules are forgotten so the next page's ``tasks.py`` is
imported afresh.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
NO_RUN = "<!-- no-run -->"
FENCE_OPEN = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})python\b(?P<attrs>[^`]*)$")
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
USES_DSN = re.compile(r"\bdsn\b")
BLOCK_TIMEOUT = 120  # seconds; past it the test process dumps its stacks and exits


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its optional file title, its code."""

    page: str
    line: int  # 1-based line of the opening fence
    title: str | None
    code: str
    skip: bool

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}" + (f"[{self.title}]" if self.title else "")

    @property
    def is_test_file(self) -> bool:
        return bool(self.title) and Path(self.title).name.startswith("test_")


def extract(page: Path) -> list[Block]:
    """The python blocks of one Markdown page, in order."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE_OPEN.match(lines[i])
        if not match:
            i += 1
            continue
        indent, ticks = len(match["indent"]), match["ticks"]
        title_match = TITLE.search(match["attrs"])
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"{page.name}:{i + 1}: unclosed code fence")
        blocks.append(Block(
            page=page.name, line=i + 1, title=title_match["title"] if title_match else None,
            code="\n".join(body) + "\n", skip=previous == NO_RUN,
        ))
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    blocks = [b for page in sorted(DOCS.glob("*.md")) for b in extract(page)]
    for page in {b.page for b in blocks}:
        titles = [b.title for b in blocks if b.page == page and b.title]
        dupes = {t for t in titles if titles.count(t) > 1}
        if dupes:
            raise ValueError(f"{page}: file title used twice: {sorted(dupes)}")
    return blocks


BLOCKS = all_blocks()


def test_docs_have_python_examples() -> None:
    """Guard against a parser regression silently collecting nothing."""
    assert len(BLOCKS) >= 20, [b.id for b in BLOCKS]
    skipped = [b.id for b in BLOCKS if b.skip]
    assert len(skipped) <= len(BLOCKS) // 5, f"too many <!-- no-run --> blocks: {skipped}"


def test_sql_in_the_docs_is_the_sql_that_runs() -> None:
    """Every ```sql block of the docs is quoted from a cyclone_mp/sql/*.sql file, verbatim."""
    import importlib.resources

    files = [f for f in importlib.resources.files("cyclone_mp.sql").iterdir() if f.name.endswith(".sql")]
    queries = " ".join(" ".join(f.read_text().split()) for f in files)
    found = 0
    for page in sorted(DOCS.glob("*.md")):
        for sql in re.findall(r"^```sql\n(.*?)^```", page.read_text(), flags=re.M | re.S):
            found += 1
            quoted = " ".join(sql.split()).rstrip(";")
            assert quoted in queries, f"{page.name}: this SQL is not in sql/*.sql any more:\n{sql}"
    assert found >= 1


def test_every_client_option_is_documented() -> None:
    """The hand-written options table of steps-and-client.md names every Client keyword."""
    import inspect

    from cyclone_mp.client import Client

    page = (DOCS / "steps-and-client.md").read_text()
    table = "\n".join(line for line in page.splitlines() if line.startswith("| `"))
    missing = [name for name in inspect.signature(Client).parameters if f"`{name}`" not in table]
    assert not missing, f"Client options missing from the table in steps-and-client.md: {missing}"


REPO = DOCS.parent
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def test_the_testing_extra_is_slim_and_the_docs_name_it() -> None:
    """Issue 19, item 10: users testing their own steps install pytest and testcontainers,
    not the repository's own suite (playwright, mkdocs, the dashboard)."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = sorted(re.split(r"[\[<>=!~ ]", req, maxsplit=1)[0] for req in extras["testing"])
    assert names == ["pytest", "testcontainers"], extras["testing"]
    page = (DOCS / "testing.md").read_text()
    assert "pip install 'cyclone-mp[testing]'" in page
    assert "pip install 'cyclone-mp[test]'" not in page


def test_docs_say_retry_reopens_only_single_step_cancelled_runs() -> None:
    """Issue 19, item 10: a cancelled workflow is refused by retry; no page says otherwise."""
    from cyclone_mp_cli.runs import retry

    def sentences(text: str) -> list[str]:  # lines of markdown wrap mid-sentence
        return re.split(r"(?<=[.;])\s+|\n\s*\n|\n(?=[-|#`])", text)

    claims = [(page.name, " ".join(sentence.split())) for page in PAGES for sentence in sentences(page.read_text())
              if re.search(r"reopen.*\bcancelled\b", sentence, flags=re.I | re.S)]
    claims += [("cyclone-mp retry --help", " ".join(sentence.split())) for sentence in sentences(retry.help or "")
               if re.search(r"reopen.*\bcancelled\b", sentence, flags=re.I | re.S)]
    assert claims, "no page says what retry does with a cancelled run"
    wrong = [claim for claim in claims if "single-step" not in claim[1]]
    assert not wrong, f"retry reopens only a cancelled single-step run: {wrong}"


def _index_columns(dsn: str) -> dict[str, str]:
    """``{index name: "col, col"}`` of the cyclone tables after every migration."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename LIKE 'cyclone%%'").fetchall()
    out = {}
    for name, definition in rows:
        inner = definition.split(" USING ", 1)[1]
        inner = inner[inner.index("(") + 1:]
        depth, cols = 1, ""
        for ch in inner:  # up to the matching parenthesis
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
            cols += ch
        out[name] = cols
    return out


def test_indexes_the_docs_name_exist(cyclone_dsn: str) -> None:
    """Issue 19, item 10: every index the docs name, by name or by its columns
    ("the `(state, created_at)` index"), is one the migrations create."""
    indexes = _index_columns(cyclone_dsn)
    problems = []
    for page in PAGES:
        text = " ".join(page.read_text().split())
        for name in set(re.findall(r"`(cyclone_\w+_idx)`", text)):
            if name not in indexes:
                problems.append(f"{page.name}: no index {name}")
        for name, cols in re.findall(r"`(cyclone_\w+_idx)` on `\(([^)`]+)\)", text):
            if name in indexes and indexes[name] != cols:
                problems.append(f"{page.name}: {name} is on ({indexes[name]}), not ({cols})")
        for cols in re.findall(r"`\(([\w, ]+)\)` index", text):
            if cols not in indexes.values():
                problems.append(f"{page.name}: no index on ({cols})")
    assert not problems, problems


def _module_name(block: Block) -> str:
    if block.title:
        return Path(block.title).stem
    stem = re.sub(r"\W", "_", Path(block.page).stem)
    return f"docblock_{stem}_{block.line}"


def _write_page_files(block: Block, where: Path) -> list[str]:
    """Write every titled block of the block's page; returns their module names."""
    names = []
    for other in BLOCKS:
        if other.page == block.page and other.title:
            target = where / other.title
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(other.code)
            names.append(Path(other.title).stem)
    return names


def _forget(names: list[str]) -> None:
    for name in list(sys.modules):
        if name in names or any(name.startswith(n + ".") for n in names):
            del sys.modules[name]


def _cleanup(namespace: dict[str, Any]) -> None:
    """Stop and close whatever supervisors, clients and envs a block left behind."""
    from cyclone_mp.client import Client
    from cyclone_mp.testing import Env

    for value in list(namespace.values()):
        if isinstance(value, Env):
            value.close()
        elif isinstance(value, Client):
            if value.supervisor is not None and not value.supervisor.stopped.is_set():
                value.stop()
            value.close()


def _run_test_file(block: Block, where: Path, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("cyclone_server")
    env = {**os.environ, "CYCLONE_TEST_DSN": server.admin_dsn, "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", block.title],
        cwd=where, env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, (
        f"{block.id} failed under pytest:\n{result.stdout[-4000:]}\n{result.stderr[-3000:]}"
    )


def _run_script(block: Block, where: Path, request: pytest.FixtureRequest, names: list[str]) -> None:
    name = _module_name(block)
    if block.title:
        path = where / block.title
    else:
        path = where / f"{name}.py"
        path.write_text(block.code)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if not block.title and USES_DSN.search(block.code):
        module.dsn = request.getfixturevalue("cyclone_dsn")
    sys.modules[name] = module
    faulthandler.dump_traceback_later(BLOCK_TIMEOUT, exit=True)  # a hung example must not hang CI
    try:
        spec.loader.exec_module(module)
    finally:
        faulthandler.cancel_dump_traceback_later()
        _cleanup(vars(module))
        _forget([*names, name])


# A block that is a test file runs a whole pytest session of the user's (16 s for
# testing.md's): slow; tests/acceptance/test_plugin.py runs the plugin in the default suite.
@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.slow) if b.is_test_file else b for b in BLOCKS],
                         ids=[b.id for b in BLOCKS])
def test_doc_example(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if block.skip:
        pytest.skip(f"{block.id} is marked {NO_RUN}")
    names = _write_page_files(block, tmp_path)
    if block.is_test_file:
        _run_test_file(block, tmp_path, request)
        return
    sys.path.insert(0, str(tmp_path))
    _forget(names)
    try:
        _run_script(block, tmp_path, request, names)
    finally:
        sys.path.remove(str(tmp_path))


# -- comparison.md's claims ---------------------------------------------------------------------

#: What the "At a glance" table of comparison.md claims of cyclone_mp, row by row: a text
#: its cyclone_mp cell must hold, and the public names that implement the claim, which
#: must exist: ``Name``, ``Name.attribute`` (of ``cyclone_mp``), ``callable(parameter)``,
#: or a dotted module path.
COMPARED = {
    "stops a handler that never returns": ("`kill_grace`", ["Client(kill_grace)", "Context.cancelled"]),
    "timeout clock": ("`started_at + timeout`", ["step(timeout)", "Client(timeout)"]),
    "worker crash, defaults": ("`lease_ttl`", ["Client(lease_ttl)", "Client(max_reclaims)"]),
    "retries": ("`max_attempts`", ["step(max_attempts)", "step(backoff)", "Permanent"]),
    "enqueue in your transaction": ("`conn=`", ["Client.enqueue(conn)", "AsyncClient.enqueue(conn)"]),
    "bulk enqueue": ("`enqueue_many`", ["Client.enqueue_many", "AsyncClient.enqueue_many"]),
    "workflows": ("signals, timers, pause/resume", ["Workflow", "Client.signal", "Client.pause", "Client.resume"]),
    "periodic jobs": ("`mux.schedule`", ["Mux.schedule(cron)", "Mux.schedule(every)", "Mux.schedule(tz)",
                                         "Mux.schedule(catch_up)"]),
    "per-key concurrency and rate limits": ("`rate_limit`", ["step(concurrency)", "step(concurrency_key)",
                                                             "step(rate_limit)"]),
    "`async def` handlers": ("`cy.AsyncClient`", ["AsyncClient", "Step.is_async"]),
    "memory, CPU and process caps per job": ("`memory_limit`", ["step(memory_limit)", "step(cpu_limit)",
                                                                 "step(max_processes)", "step(max_open_files)"]),
    "crash-simulation test fixtures": ("pytest plugin", ["cyclone_mp.testing.Env", "cyclone_mp.testing.plugin"]),
}
#: Claims the page once made that the product outgrew: none may come back.
OUTGROWN = [r"no periodic scheduler", r"none built in", r"handlers are synchronous", r"run an event loop inside"]


def _public(name: str) -> bool:
    """Whether the public name ``name`` (see :data:`COMPARED`) exists."""
    import importlib
    import inspect

    import cyclone_mp

    name, _, param = name.partition("(")
    if name.startswith("cyclone_mp."):
        module, _, attr = name.rpartition(".")
        try:
            found: Any = getattr(importlib.import_module(module), attr, None) or importlib.import_module(name)
        except ImportError:
            return False
    else:
        found = cyclone_mp
        for part in name.split("."):
            found = getattr(found, part, None)
            if found is None:
                return False
    if param:
        return param.rstrip(")") in inspect.signature(found).parameters
    return True


def test_comparison_claims_what_the_api_has() -> None:
    """Each feature the comparison's table credits cyclone_mp with names the public API
    that implements it, and that API exists; no cell denies a feature the API has."""
    import cyclone_mp as cy

    page = (DOCS / "comparison.md").read_text()
    cells = {}
    for line in page.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(parts) == 6:
            cells[parts[0]] = parts[1]
    problems = []
    for row, (text, names) in COMPARED.items():
        cell = cells.get(row)
        if cell is None:
            problems.append(f"no row {row!r} in the comparison's table")
            continue
        if text not in cell:
            problems.append(f"{row!r}: the cyclone_mp cell does not say {text!r}: {cell!r}")
        if re.match(r"(\*\*)?(no|none|–|-)\b", cell, flags=re.I):
            problems.append(f"{row!r}: the cyclone_mp cell denies it: {cell!r}")
        problems += [f"{row!r}: {name} does not exist" for name in names if not _public(name)]
    for claim in OUTGROWN:
        if re.search(claim, " ".join(page.split()), flags=re.I):
            problems.append(f"comparison.md says {claim!r} again")
    assert not problems, problems

    @cy.step("compared_async")
    async def handler(ctx: cy.Context, inp: dict) -> dict:  # an async handler is a step like any other
        return inp

    assert handler.is_async


def test_user_docs_cite_no_internal_specs_or_issues() -> None:
    """The docs read as user documentation: no project-internal issue numbers, spec
    sections or design seeds (what a user cannot look up)."""
    internal = re.compile(r"\b[Ii]ssues? \d+|\bSPEC\b|\b[Ss]eeds?\b|\b[Ii]tems? \d+\b|peer-bench/")
    found = [(page.name, line.strip()) for page in PAGES for line in page.read_text().splitlines()
             if internal.search(line) and "random seed" not in line]
    assert not found, found
