-- 0007: flow control (per-key concurrency and rate limits, fair claiming by key) and
-- periodic schedules (issue 21).

-- A step's key: the group its queue serves round-robin, and the group its limits count
-- in ('' is the group of steps enqueued without a key). Its limits are stored at enqueue,
-- as timeout and max_attempts are, so every supervisor's claim applies the same bounds.
ALTER TABLE cyclone_steps
    ADD COLUMN concurrency_key text NOT NULL DEFAULT '',
    ADD COLUMN concurrency integer CHECK (concurrency >= 1),         -- running at once per (step, key)
    ADD COLUMN rate_count integer CHECK (rate_count >= 1),           -- starts per rate_period per (step, key)
    ADD COLUMN rate_period interval CHECK (rate_period > interval '0');

-- The claim walks the keys of a queue in order and reads each key's first available
-- steps: one index serves both (a loose scan over keys, then an ordered range per key).
-- It replaces the claim index of 0001, whose order it keeps within each key.
DROP INDEX IF EXISTS cyclone_steps_claim_idx;
CREATE INDEX cyclone_steps_claim_key_idx ON cyclone_steps (queue, concurrency_key, priority, scheduled_at, id)
    WHERE state = 'available';

-- Slots of the limits. A (step, key) with concurrency n has concurrency slots 1..n
-- (kind 'c'); with a rate limit of n starts per period, rate slots 1..n (kind 'r'). The
-- rows are made at enqueue. The claim takes a free slot with FOR UPDATE SKIP LOCKED and
-- writes its holder in the same statement, so no lock outlives the claim's transaction:
-- * a concurrency slot is free when its holder attempt (step_id, generation) no longer
--   runs, as seen by a snapshot that includes the claim which took it (claim_xid);
--   a crashed supervisor's slots free when the sweep reclaims its expired leases;
-- * a rate slot is free when it was last used (used_at, the claim's now()) at least one
--   period ago: at most n starts in any window of one period, on the database clock.
CREATE TABLE cyclone_slots (
    step_name   text NOT NULL,
    key         text NOT NULL,
    kind        "char" NOT NULL CHECK (kind IN ('c', 'r')),
    slot        integer NOT NULL,
    step_id     bigint,
    generation  bigint,
    claim_xid   xid8,
    used_at     timestamptz,
    PRIMARY KEY (step_name, key, kind, slot)
);

-- Periodic schedules (mux.schedule). A row per schedule name, written by the supervisors
-- whose mux defines it: the definition they last saw, the last slot enqueued and the next
-- one (database clock). Each slot's run has the idempotency key
-- 'cyclone-schedule:<name>:<slot>', so a slot never has two runs.
CREATE TABLE cyclone_schedules (
    name          text PRIMARY KEY,
    target        text NOT NULL,                  -- the step or workflow enqueued
    spec          jsonb NOT NULL,                 -- cron/every, tz, catch_up, input
    last_slot     timestamptz,                    -- the latest slot decided (enqueued or skipped)
    last_run_id   uuid,
    next_at       timestamptz,                    -- the next slot (NULL: the expression has none)
    runs          bigint NOT NULL DEFAULT 0,      -- slots enqueued
    skipped       bigint NOT NULL DEFAULT 0,      -- slots dropped by the catch_up policy
    seen_at       timestamptz NOT NULL DEFAULT now(),  -- a supervisor defining it last ticked
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX cyclone_schedules_next_idx ON cyclone_schedules (next_at);
