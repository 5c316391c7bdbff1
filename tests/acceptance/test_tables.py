"""The CLI's tables at every terminal width: ``status``, ``runs``, ``workers``,
``schedules``, the ``enqueue --wait`` view and the demo's final table, printed on a rich
``Console(width=...)`` from 60 to 220 columns (unit tests on sample data), and the real
CLI with ``COLUMNS`` set (on a database).

Whatever the width: no line is wider than the terminal, nothing is cut short (no
``…``), no column is squeezed so narrow that its header breaks inside a word (a column
printed a letter per line), and the values that must read whole (run ids, states,
attempts, the concurrency key, the limit a step waits on) do, each on one line.
"""

from __future__ import annotations

import re
from typing import Callable

import pytest
from rich.console import Console
from rich.text import Text

import table_samples as samples
from cli_run import APP, _env, client_for, dsn, pg, run_cli  # noqa: F401 - fixtures

from cyclone_mp_cli import render, tables  # noqa: E402 - test_cli makes it importable
from cyclone_mp_cli.folding import Column, FoldingTable  # noqa: E402

WIDTHS = (60, 80, 100, 120, 160, 220)
HEADER_WORDS = {word for spec in (tables.STEP_COLUMNS, tables.ATTEMPT_COLUMNS, tables.RUN_COLUMNS,
                                  tables.SCHEDULE_COLUMNS, tables.CHILD_COLUMNS, tables.DEMO_COLUMNS)
                for column in spec for name in (column.name, column.host_name or "") for word in name.split()}


def _printed(width: int, draw: Callable[[Console], None]) -> str:
    con = Console(width=width, record=True, color_system=None, force_terminal=False, highlight=False)
    draw(con)
    return con.export_text()


def _headers(text: str) -> list[list[str]]:
    """Each table's column headers, as printed (a header that wraps is joined again)."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if not line.startswith("┏"):
            continue
        cuts = [m.start() for m in re.finditer("[┏┳┓]", line)]
        rows = []
        for row in lines[i + 1:]:
            if row.startswith("┡") or row.startswith("└"):
                break
            rows.append(row)
        found.append([" ".join(" ".join(row[a + 1:b] for row in rows).split()) for a, b in zip(cuts, cuts[1:])])
    return found


def flat(text: str) -> str:
    """The words of ``text`` without the tables' rules (what wraps inside a cell reads on)."""
    return " ".join(re.sub("[│┃]", " ", text).split())


def check(text: str, width: int, whole: list[str]) -> None:
    lines = text.splitlines()
    wide = [line for line in lines if len(line) > width and "://" not in line]  # (a DSN is printed whole, to copy)
    assert not wide, f"lines wider than {width} columns:\n" + "\n".join(wide)
    assert "…" not in text, text
    for table in _headers(text):
        for header in table:
            broken = [word for word in header.split() if word not in HEADER_WORDS]
            assert not broken, f"a column too narrow for its header at {width} columns ({header!r}):\n{text}"
    for value in whole:
        assert any(value in line for line in lines), f"{value!r} is not whole on one line at {width}:\n{text}"


@pytest.mark.parametrize("width", WIDTHS)
def test_status(width: int) -> None:
    status = samples.run_status()
    text = _printed(width, lambda con: render.print_status(con, status))
    check(text, width, [status.id, "completed", "running", "discarded", "pending", "1/3", "2/3", "3/3", "0/3",
                        samples.KEY, "concurrency", "fetch", "transcode", "notify", "SIGKILL", "3/10"])
    assert "waiting on" in flat(text)


@pytest.mark.parametrize("width", WIDTHS)
def test_wait_view(width: int) -> None:
    status = samples.run_status()
    text = _printed(width, lambda con: con.print(render.wait_view(status, 1.5)))
    check(text, width, [status.id, "running", "2/3", samples.KEY, "concurrency"])


@pytest.mark.parametrize("width", WIDTHS)
def test_runs(width: int) -> None:
    rows = samples.run_rows()
    text = _printed(width, lambda con: con.print(render.runs_table(rows)))
    check(text, width, [*samples.RUN_IDS[:4], "running", "completed", "discarded", "cancelled", samples.KEY,
                        "globex", "concurrency", "nightly"])
    assert "waiting on" in flat(text) and "rate limit" in text


@pytest.mark.parametrize("width", WIDTHS)
def test_workers(width: int) -> None:
    rows = samples.worker_rows()
    text = _printed(width, lambda con: render.print_workers(con, rows))
    check(text, width, [samples.RUN_IDS[0], "4242001", "4242002", "4242003", "idle", "starting", "resize"])


@pytest.mark.parametrize("width", WIDTHS)
def test_schedules(width: int) -> None:
    rows = samples.schedule_rows()
    text = _printed(width, lambda con: con.print(render.schedules_table(rows)))
    check(text, width, ["nightly", "heartbeat", "Europe/Paris", "every 30s"])


@pytest.mark.parametrize("width", WIDTHS)
def test_demo_table(width: int) -> None:
    report = samples.demo_report()
    text = _printed(width, lambda con: render.print_demo(con, report))
    check(text, width, ["demo.crunch", "demo.wedge", "demo.crash", "demo.grandchild", "completed", "discarded",
                        "running", "2/3", "child_exited", "SIGKILL", "timeout"])
    assert "expected" in text and "(timeout)" in text  # (the one that did not end as expected)


def test_the_key_and_the_waiting_reason_show_at_80_columns() -> None:
    """At 80 columns nothing is hidden any more: the key and the limit a run waits on
    fold under its name."""
    text = _printed(80, lambda con: con.print(render.runs_table(samples.run_rows())))
    row = text.split(samples.RUN_IDS[0])[1].split(samples.RUN_IDS[1])[0]  # the first run's lines
    assert samples.KEY in row and "waiting on concurrency" in flat(row)


def test_wide_prints_every_column_in_its_own_place_at_any_width() -> None:
    status = samples.run_status()
    text = _printed(60, lambda con: render.print_status(con, status, wide=True))
    headers = _headers(text)
    assert headers[0] == ["node", "state", "attempt", "reclaims", "error_kind", "took", "started", "finished",
                          "key / limit", "progress", "last error"]
    assert "tree" in headers[1] and "killed by supervisor" in headers[1]
    assert samples.LONG_ERROR in text.replace("\n", "")  # (the error column may wrap; never squeezed)


# -- the folding itself ---------------------------------------------------------------------------


def _table(rows: list[dict[str, str]]) -> FoldingTable:
    return FoldingTable([
        Column("id", keep=100, whole=True),
        Column("note", keep=80, min_width=10, always=True),
        Column("a", keep=10, whole=True, label="alpha"),
        Column("b", keep=20, whole=True),
        Column("c", keep=30, whole=True, quiet=("0",)),
    ], rows, host="note")


def test_the_least_kept_column_folds_first_with_its_label() -> None:
    rows = [{"id": "x" * 30, "note": "hello", "a": "aaaaaaaaaa", "b": "bbbbbbbbbb", "c": "0"}]
    full = _printed(200, lambda con: con.print(_table(rows)))
    assert _headers(full) == [["id", "note", "a", "b", "c"]]
    narrower = _printed(70, lambda con: con.print(_table(rows)))
    assert _headers(narrower) == [["id", "note", "b", "c"]]
    assert "alpha aaaaaaaaaa" in narrower
    narrowest = _printed(50, lambda con: con.print(_table(rows)))
    assert _headers(narrowest) == [["id", "note"]]
    assert "alpha aaaaaaaaaa" in flat(narrowest) and "b bbbbbbbbbb" in narrowest
    assert "c 0" not in narrowest  # a quiet value says nothing once folded


def test_empty_columns_are_left_out_and_the_measure_spans_folded_to_unfolded() -> None:
    rows = [{"id": "1", "note": "n", "a": "", "b": None, "c": "3"}]
    text = _printed(200, lambda con: con.print(_table(rows)))
    assert _headers(text) == [["id", "note", "c"]]
    con = Console(width=200)
    measure = con.measure(_table([{"id": "x" * 30, "note": "hello", "a": "a" * 10, "b": "b" * 10, "c": "1"}]))
    assert measure.maximum == 30 + 5 + 10 + 10 + 1 + 3 * 5 + 1  # the widths, a space each side, the rules
    assert measure.minimum < measure.maximum


def test_a_host_cell_packs_whole_parts_per_line() -> None:
    rows = [{"id": "1", "note": Text("n"), "a": "a" * 8, "b": "b" * 8, "c": "c" * 8}]
    text = _printed(24, lambda con: con.print(_table(rows)))
    for part in ("alpha aaaaaaaa", "b bbbbbbbb", "c cccccccc"):
        assert part in text, text


# -- the real CLI -------------------------------------------------------------------------------------


@pytest.mark.parametrize("columns", ["60", "100", "140"])
def test_the_cli_folds_to_columns(dsn: str, columns: str) -> None:  # noqa: F811
    client = client_for(dsn)
    keyed = run_cli("enqueue", APP, "echo", "--input", "{}", "--delay", "1h", "--concurrency-key", "tenant-acme",
                    dsn=dsn).stdout.strip()
    plain = run_cli("enqueue", APP, "echo", "--input", "{}", "--delay", "1h", dsn=dsn).stdout.strip()
    assert client.status(keyed).step.concurrency_key == "tenant-acme"
    env = {**_env(), "COLUMNS": columns}
    for args, whole in ((["runs"], [keyed, plain, "tenant-acme", "running"]),
                        (["status", keyed], [keyed, "available", "0/3", "tenant-acme"])):
        proc = run_cli(*args, dsn=dsn, env=env)
        assert proc.returncode == 0, proc.stderr
        check(proc.stdout, int(columns), whole)
