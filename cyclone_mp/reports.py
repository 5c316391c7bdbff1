"""What process control tells the other parts: the outcomes of ended attempts, sent to
the outcome writer in batches (at once when a claim can ride along or a deadline is
near, else coalesced a few milliseconds), and the snapshot of its children and their
attempts that the registry row and ``cyclone-mp workers`` show.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psutil

from .config import COALESCE_MAX, COALESCE_PER_WORKER

if TYPE_CHECKING:
    from .control import ProcessControl


class Reports:
    """The outcomes and snapshots of ``control`` (a :class:`~cyclone_mp.control.ProcessControl`), on its thread."""

    def __init__(self, control: ProcessControl) -> None:
        self.control = control

    def flush_at(self, *, arriving: bool = False) -> float | None:
        """When the gathered outcomes go to the writer (None: there are none). At once,
        except with prefetch while held steps keep every child busy: then they wait up to
        COALESCE_MAX (0.1 s) for COALESCE_PER_WORKER (4) outcomes per child, so steps of
        about 20 ms share statements (pgqueuer buffers its completions the same way). An
        outcome never waits into the last COALESCE_MAX before its attempt's deadline.
        ``arriving``: the statement in flight came back with rows that are held and about to
        start; they count as held only if the children and their queues cannot take them."""
        if not self.control.outcomes:
            return None
        since = self.control.outcomes_since if self.control.outcomes_since is not None else self.control.clock()
        due = [d - COALESCE_MAX for _, d in self.control.outcomes if d is not None]
        if self.control.config.prefetch and self.control.batches_out and not self.control.draining and not arriving:
            # One statement in flight: these go in the next one, with all that ends meanwhile
            # and a claim for all the room there is (Written says when; the writer could not
            # start another statement before then anyway).
            return min([since + self.control.config.write_bound, *due])
        workers = self.control.config.workers
        held = self.control.claims.held_after_start() if arriving else len(self.control.held)
        if (not self.control.config.prefetch or self.control.draining
                or len(self.control.outcomes) >= COALESCE_PER_WORKER * workers or held < workers):
            return since
        return min([since + COALESCE_MAX, *due])

    def send_outcomes(self, force: bool = False, arriving: bool = False) -> None:
        """Post the gathered outcomes when due (``force``: now), with a claim for the room
        the freed slots leave (one statement). ``arriving``: as for :meth:`flush_at`; the
        claim leaves those rows their places."""
        flush_at = self.flush_at(arriving=arriving)
        if flush_at is None or (not force and flush_at > self.control.clock()):
            return
        claim = self.control.claims.claim_limit(standalone=False, arriving=arriving)
        start_now = self.control.claims.start_now(claim)
        outcomes, self.control.outcomes, self.control.outcomes_since = self.control.outcomes, [], None
        self.control.claiming += claim
        self.control.batches_out += 1
        self.control.writer.post_batch(tuple(o for o, _ in outcomes), claim, start_now)

    def publish_snapshot(self, now: float) -> None:
        """What ``cyclone-mp workers`` shows, as plain data for maintenance to write."""
        kids = []
        for child in self.control.pool.children:
            att = child.attempt or next(iter(child.concurrent.values()), None)
            info: dict[str, Any] = {"pid": child.pid, "steps_run": child.steps_run, "ready": child.ready}
            if child.concurrent:
                info["side_by_side"] = len(child.concurrent)  # async attempts it runs at once
            if child.proc is not None:
                try:
                    info["cpu_percent"] = child.proc.cpu_percent(None)
                    info["rss"] = child.proc.memory_info().rss
                except psutil.Error:
                    pass
            if att is not None:
                info.update({"run_id": att.run_id, "node": att.node, "step": att.step_name,
                             "attempt": att.attempt, "elapsed": round(now - att.started, 3)})
                if att.limits:
                    info["limits"] = att.limits.as_json()
            kids.append(info)
        self.control.snapshot = {
            "workers": self.control.config.workers, "queues": list(self.control.config.queues), "names": list(self.control.mux.step_names),
            "draining": self.control.draining, "children": kids, "prefetched": len(self.control.held),
            "prefetch": self.control.holding.prefetch_share(), "limits": self.control.confinement.mechanism.as_dict(),
        }
