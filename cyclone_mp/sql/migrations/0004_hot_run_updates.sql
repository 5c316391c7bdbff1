-- 0004: a run's completion becomes a HOT update (issue 8). No index of cyclone_runs names
-- state, finished_at or updated_at any more, so the one update a run gets when its step
-- ends writes no index entries and usually stays on its page: completing a single-step
-- run cost about 15 us less PostgreSQL CPU (of about 70) in a paired measurement.
-- The state index served `runs --state` (now a backward scan of cyclone_runs_created_idx
-- with a filter) and pruning (which reads every finished run either way).
DROP INDEX IF EXISTS cyclone_runs_state_idx;
