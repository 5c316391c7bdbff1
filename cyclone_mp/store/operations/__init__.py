"""The clients' database operations: generators of named statements that one driver runs
on a sync connection and another on an async one (:mod:`.core` explains them).
:mod:`.enqueue` makes runs, :mod:`.runs` reads and acts on them, :mod:`.archive` keeps
history. Callers use them as ``operations.<name>``.
"""

from __future__ import annotations

from . import archive, core, enqueue, runs  # noqa: F401 - the modules, for tests that patch their constants
from .archive import (  # noqa: F401 - re-exported
    FINISHED_STATES,
    HISTORY_LOCK,
    archive_batch,
    archive_days,
    archive_partitions,
    day_end,
    delete_runs,
    drop_archive_partition,
    list_workers,
    make_archive_partitions,
    prune,
    read_archive_partitions,
    retain_archived,
    xmin_horizon,
)
from .core import (  # noqa: F401 - re-exported
    MIN_SERVER_VERSION,
    Op,
    Result,
    Statement,
    Steps,
    migrate,
    operation,
    q,
)
from .enqueue import (  # noqa: F401 - re-exported
    MAX_MAP_ITEMS,
    NO_PARENT,
    NO_UNIQUE,
    UniquePlace,
    _enqueue_nodes,
    _ensure_slots,
    _insert_step,
    advance,
    advance_parent,
    delete_idle_slots,
    enqueue_many,
    enqueue_run,
    enqueue_unique_many,
    insert_spawned,
)
from .runs import (  # noqa: F401 - re-exported
    CHILDREN_SHOWN,
    cancel_run,
    finished_runs,
    get_run,
    list_runs,
    map_items,
    pause_queue,
    pause_run,
    paused_queues,
    resolve,
    resolve_run,
    resume_queue,
    resume_run,
    retry_run,
    run_id_or_prefix,
    runs_by_prefix,
    signal,
)
