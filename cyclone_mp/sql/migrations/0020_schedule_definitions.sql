-- Two definitions of one schedule at once (a rolling deploy runs old and new code side
-- by side): every definition a supervisor declares has a row here, and the one declared
-- most recently among those a live supervisor still declares is in force. Only the
-- definition in force enqueues the schedule's slots, from the schedule's own last slot,
-- so the other one's ticks neither fire nor reset anything.
CREATE TABLE cyclone_schedule_definitions (
    name           text NOT NULL REFERENCES cyclone_schedules (name) ON DELETE CASCADE,
    fingerprint    text NOT NULL,          -- a digest of target and spec (Schedule.fingerprint)
    target         text NOT NULL,
    spec           jsonb NOT NULL,
    first_seen_at  timestamptz NOT NULL,   -- declared since (again, after a minute undeclared)
    seen_at        timestamptz NOT NULL,   -- a supervisor declaring it last ticked
    PRIMARY KEY (name, fingerprint)
);

-- The definition that last decided the schedule's row (its target and spec are the
-- row's). NULL on rows made before definitions were kept: their first tick hands over
-- from the row's stored spec, as from any other definition.
ALTER TABLE cyclone_schedules ADD COLUMN IF NOT EXISTS fingerprint text;
