-- The slot rows of a (step, key) group go away once no step of the group waits or runs
-- (delete_idle_slots, by the history pass and by prune): a key used once no longer keeps
-- its rows for ever.
--
-- period: a rate slot's period (the step's rate_period, written at enqueue): the slot is
-- deleted only once its last use is a whole period old, so a group enqueued again starts
-- with no more room than its limit allows.
-- cyclone_steps_live_groups_idx: the live steps of limited groups, by (step, key): what the
-- cleanup asks ("does any step of this group wait or run?") is one index probe.
ALTER TABLE cyclone_slots ADD COLUMN IF NOT EXISTS period interval;
CREATE INDEX IF NOT EXISTS cyclone_steps_live_groups_idx ON cyclone_steps (step_name, concurrency_key)
    WHERE state NOT IN ('completed', 'discarded', 'cancelled')
      AND (concurrency IS NOT NULL OR rate_count IS NOT NULL);
