-- 0013: the dashboard's "recent kills" also lists attempts that died of a cause of issue
-- 20 (a resource cap, or the kernel's OOM killer): its index covers those kinds too.

DROP INDEX IF EXISTS cyclone_steps_kills_idx;
CREATE INDEX cyclone_steps_kills_idx ON cyclone_steps (((errors -> -1 ->> 'at')), id)
    WHERE (errors -> -1 ->> 'kind') IN ('timeout', 'child_exited', 'reclaim_limit',
                                        'memory_limit', 'cpu_limit', 'process_limit', 'oom_killed');
