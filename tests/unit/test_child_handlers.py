"""A child's handlers found by the reference each task carries, with no process: found
once and kept, and a reference that cannot be found fails each time it is asked for (a
failure is never kept)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from cyclone_mp import unhealable
from cyclone_mp._handler import Handlers
from cyclone_mp._tasks import task_inputs


def test_a_handler_is_found_once_and_a_missing_one_fails_every_time(tmp_path, monkeypatch):
    handlers = Handlers()
    ref = {"module": "json", "qualname": "dumps", "path": None}
    assert handlers.resolve(ref) is json.dumps
    assert handlers.resolve(dict(ref)) is json.dumps  # a fresh frame's reference: the same handler
    missing = {"module": "cyclone_mp_no_such_module", "qualname": "f", "path": None}
    for _ in range(2):
        with pytest.raises(unhealable.NotImportable):
            handlers.resolve(missing)
    # the module appears later (a deploy in progress): the next task finds it
    (tmp_path / "cyclone_mp_no_such_module.py").write_text("def f(ctx, inp):\n    return 'found'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert handlers.resolve(missing)(None, None) == "found"
    finally:
        sys.modules.pop("cyclone_mp_no_such_module", None)


def test_a_handler_reassigned_reloaded_or_removed_is_looked_up_again(tmp_path, monkeypatch):
    (tmp_path / "cyclone_mp_swapped.py").write_text("def f(ctx, inp):\n    return 'first'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    handlers = Handlers()
    ref = {"module": "cyclone_mp_swapped", "qualname": "f", "path": None}
    try:
        assert handlers.resolve(ref)(None, None) == "first"
        module = sys.modules["cyclone_mp_swapped"]
        module.f = lambda ctx, inp: "reassigned"
        assert handlers.resolve(ref)(None, None) == "reassigned"
        (tmp_path / "cyclone_mp_swapped.py").write_text("def f(ctx, inp):\n    return 'reloaded'\n")
        importlib.reload(module)
        assert handlers.resolve(ref)(None, None) == "reloaded"
        module.f = 42
        with pytest.raises(unhealable.NotImportable):
            handlers.resolve(ref)
        del module.f
        with pytest.raises(unhealable.NotImportable):
            handlers.resolve(ref)
    finally:
        sys.modules.pop("cyclone_mp_swapped", None)


@pytest.mark.parametrize("upstream_json,upstream", [("{}", {}), ('{"a": [1]}', {"a": [1]}), (None, {})])
def test_a_tasks_upstream_outputs_are_read_from_its_text(upstream_json, upstream):
    inp, got = task_inputs({"input_json": "null", "upstream_json": upstream_json})
    assert inp is None and got == upstream
