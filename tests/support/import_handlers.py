"""Steps whose module is slow or broken to import in a child (tests/acceptance/test_preload.py).

Children carry their supervisor's id in ``CYCLONE_MP_SUPERVISOR``; the test process does
not, so it imports this module at once and without error.
"""

from __future__ import annotations

import os
import time

import cyclone_mp as cy

IN_CHILD = bool(os.environ.get("CYCLONE_MP_SUPERVISOR"))
if IN_CHILD:
    time.sleep(float(os.environ.get("IMPORT_HANDLERS_SLEEP", "0")))  # an app with heavy imports
    if os.environ.get("IMPORT_HANDLERS_FAIL"):
        raise RuntimeError("import_handlers: broken on purpose")
    if os.environ.get("IMPORT_HANDLERS_EXIT"):
        os._exit(5)  # kills the importing process (as a crashing C extension would)
    if os.environ.get("IMPORT_HANDLERS_HANG"):
        time.sleep(3600)


@cy.step("imported_quick", max_attempts=2, backoff=lambda n: 0.0)
def imported_quick(ctx: cy.Context, inp: dict) -> dict:
    return {"attempt": ctx.attempt, "pid": os.getpid()}
