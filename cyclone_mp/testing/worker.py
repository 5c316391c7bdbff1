"""Entry point of a test supervisor process (``Env(worker="process")``).

``python -m cyclone_mp.testing.worker CONFIG_JSON``: rebuilds the mux from handler
references (children and this process import handlers by module path), runs a
:class:`~cyclone_mp.Client` supervisor, and writes its supervisor id to
``config["ready_file"]`` once running. Dies with the test process (PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from .._process import die_with_parent
from .._tasks import import_ref
from ..client import Client
from ..mux import Mux
from ..steps import Step
from ..workflow import Workflow


def find_workflow(module_name: str, wf_name: str) -> Workflow:
    """The module-level Workflow named ``wf_name`` in ``module_name``."""
    module = importlib.import_module(module_name)
    for value in vars(module).values():
        if isinstance(value, Workflow) and value.name == wf_name:
            return value
    raise LookupError(f"workflow {wf_name!r} is not a module-level attribute of {module_name}")


def build_mux(config: dict[str, Any]) -> Mux:
    """Rebuild the test's mux in this process."""
    mux = Mux()
    for ref in config["steps"]:
        target = import_ref(ref)
        if not isinstance(target, Step):
            raise TypeError(f"{ref['module']}.{ref['qualname']} is not a cy.step")
        mux.register(target)
    for ref in config["workflows"]:
        mux.register(find_workflow(ref["module"], ref["name"]))
    for spec in config.get("schedules", []):
        mux.schedule(mux.lookup(spec.pop("target")), **spec)
    return mux


def skewed_clocks(skew: float) -> dict[str, Any]:
    """``Client``'s ``clock`` and ``wall_clock`` shifted by ``skew`` seconds
    (``Env.skew_worker_clock``); none without a skew, so the supervisor keeps its own
    clocks as a user's does (a wrapper is called several times per step, and the
    benchmarks measure this supervisor)."""
    if not skew:
        return {}
    return {"clock": lambda: time.monotonic() + skew, "wall_clock": lambda: time.time() + skew}


def main(argv: list[str]) -> None:
    config = json.loads(argv[0])
    die_with_parent(config["parent_pid"])
    logging.basicConfig(level=os.environ.get("CYCLONE_MP_LOG", "WARNING"),
                        format="%(asctime)s worker %(process)d %(name)s: %(message)s")
    sys.path[:0] = [p for p in config.get("sys_path", []) if p not in sys.path]

    clocks = skewed_clocks(float(config.get("clock_skew", 0.0)))
    client = Client(config["dsn"], build_mux(config), **clocks, **config["options"])

    def announce() -> None:
        sup = None
        while sup is None:
            sup = client.supervisor
            time.sleep(0.005)
        sup.running.wait()
        tmp = config["ready_file"] + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(sup.id)
        os.replace(tmp, config["ready_file"])

    threading.Thread(target=announce, daemon=True).start()
    client.run()
    client.close()
    _exit_now()


def _exit_now(code: int = 0) -> None:
    """Exit with ``code`` without the interpreter's teardown of every module and object:
    after a clean stop that teardown is all that is left, and it took 120-190 ms of CPU
    here, paid by every test that stops a supervisor. ``atexit`` functions still run first
    (logging's shutdown is one of them), then the standard streams are flushed."""
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
