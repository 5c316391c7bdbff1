"""A module-level workflow for tests/acceptance/test_dashboard_*.py (worker processes import it by name).

``release``: ``fetch`` runs at once; then ``approve`` waits for a signal, ``cooldown`` for a
one-hour timer, and ``publish`` (pending) for both. Once ``fetch`` completed, the run
holds a node in each of ``completed``, ``waiting_signal``, ``waiting_timer`` and ``pending``.
"""

from __future__ import annotations

import cyclone_mp as cy
from handlers import ok

release = cy.Workflow("release")
_fetch = release.add(ok, name="fetch")
_approve = release.signal("approve", after=[_fetch])
_cooldown = release.timer("cooldown", seconds=3600, after=[_fetch])
release.add(ok, name="publish", after=[_approve, _cooldown])
