"""Module-level handlers of the hostile-data tests (issue 18); children import them by path."""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

import cyclone_mp as cy


def _no_backoff(attempt: int) -> float:
    return 0.0


def nested(depth: int) -> Any:
    """A list nested ``depth`` levels deep (``nested(2) == [[]]``), built without recursion."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


@cy.step("h18_echo", max_attempts=1)
def echo(ctx: cy.Context, inp: Any) -> Any:
    return inp


@cy.step("h18_deep_output", max_attempts=1)
def deep_output(ctx: cy.Context, inp: dict) -> Any:
    """Returns a value ``inp["depth"]`` levels deep (issue 18: 975-990 was dropped)."""
    return nested(inp["depth"])


@cy.step("h18_deep_progress", max_attempts=1)
def deep_progress(ctx: cy.Context, inp: dict) -> Any:
    ctx.set_progress(nested(inp["depth"]), 10)
    return {"finished": True}


@cy.step("h18_memory_error", max_attempts=1)
def memory_error(ctx: cy.Context, inp: dict) -> Any:
    """A real failed allocation (a petabyte), not a raised instance."""
    return bytearray(1 << 50)


@cy.step("h18_sys_exit", max_attempts=1)
def sys_exit(ctx: cy.Context, inp: dict) -> Any:
    sys.exit(inp.get("code", 0))


@cy.step("h18_environment", max_attempts=1)
def environment(ctx: cy.Context, inp: dict) -> dict:
    """What a handler can read of its own environment and of its watchdog's."""
    with open("/proc/self/environ", "rb") as fh:
        raw = fh.read().decode(errors="replace").replace("\x00", "\n")
    return {"environ": dict(os.environ), "raw": raw}


@cy.step("h18_sleep_until", max_attempts=1)
def sleep_until(ctx: cy.Context, inp: dict) -> dict:
    """Runs until the file ``inp["path"]`` exists (at most ``inp["max"]`` seconds)."""
    deadline = time.monotonic() + inp.get("max", 60)
    while not os.path.exists(inp["path"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"saw_file": os.path.exists(inp["path"])}


@cy.step("h18_big", max_attempts=1)
def big(ctx: cy.Context, inp: dict) -> str:
    """A string of ``inp["mb"]`` million characters (jsonb compresses it on disk)."""
    return "x" * (inp["mb"] * 1_000_000)


# -- the fuzz generator (the test and the handler draw the same values) ---------------------------


def fuzz_value(seed: int, max_bytes: int) -> Any:
    """A random JSON-ish value: mostly ordinary, sometimes deep (around and past the
    depth limit, or past the decoder's), huge (past ``max_bytes``), or holding what
    PostgreSQL refuses (NUL, a lone surrogate) or JSON refuses (NaN, a set)."""
    rng = random.Random(seed)
    shape = rng.choice(["plain", "plain", "plain", "deep", "huge", "bad"])
    if shape == "deep":
        depth = rng.choice([2, 50, 199, 200, 201, 202, 250, 985, 3000])
        value: Any = rng.choice([[], {}, 0, "leaf"])
        for _ in range(depth - (1 if isinstance(value, (list, dict)) else 0)):
            value = [value] if rng.random() < 0.5 else {"k": value}
        return value
    if shape == "huge":
        size = rng.choice([max_bytes // 2, max_bytes - 4096, max_bytes + 10, 2 * max_bytes])
        return {"blob": "y" * size}
    if shape == "bad":
        return rng.choice([
            {"nul": "a\x00b"}, ["lone \ud800 surrogate"], {"nan": float("nan")}, {"inf": float("inf")},
            {"set": {1, 2}}, {1.5: "float key"}, {"nested": [{"deeper": "ok\x00"}]},
        ])
    return _plain(rng, 0)


def _plain(rng: random.Random, level: int) -> Any:
    kind = rng.choice(["int", "float", "str", "bool", "null", "list", "dict"] if level < 4 else
                      ["int", "float", "str", "bool", "null"])
    if kind == "int":
        return rng.choice([0, -1, 1, 2**31, -(2**63), 10**30, rng.randint(-1000, 1000)])
    if kind == "float":
        return round(rng.uniform(-1e6, 1e6), rng.randint(0, 6))
    if kind == "str":
        alphabet = "abc xyz\t\n\"\\/é中😀'"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_plain(rng, level + 1) for _ in range(rng.randint(0, 5))]
    return {"".join(rng.choice("kéy😀") for _ in range(rng.randint(0, 4))): _plain(rng, level + 1)
            for _ in range(rng.randint(0, 5))}


@cy.step("h18_fuzz_output", max_attempts=1)
def fuzz_output(ctx: cy.Context, inp: dict) -> Any:
    return fuzz_value(inp["seed"], inp["max_bytes"])


signal_flow = cy.Workflow("h18_signal_flow")
signal_flow.signal("payload")

fan_in = cy.Workflow("h18_fan_in")
_parts = [fan_in.add(big, name=f"part{i}") for i in range(5)]
fan_in.add(echo, after=_parts, name="join")


@cy.step("h18_noise", max_attempts=1)
def noise(ctx: cy.Context, inp: dict) -> str:
    """``inp["bytes"]`` random hex digits (jsonb cannot compress them much on disk)."""
    return os.urandom(inp["bytes"] // 2).hex()


noisy_fan_in = cy.Workflow("h18_noisy_fan_in")
_noisy = [noisy_fan_in.add(noise, name=f"part{i}") for i in range(5)]
noisy_fan_in.add(echo, after=_noisy, name="join")
