-- One live execution of a step at a time, after a timeout or a cancel too.
--
-- A step settled while its attempt's process may still run (the recovery sweep ends a
-- timed-out attempt at its database deadline; client.cancel ends a running one at once)
-- is not claimed again, and its concurrency slot is not given to another step, until that
-- process is dead: its supervisor reports it reaped (dead_by = 'epoch'), or, with that
-- supervisor gone, once dead_by passes on the database clock.
--
-- dead_by: NULL while nothing is known (set NULL by every claim); else the time by which
--   the last attempt's processes are dead at the latest ('epoch': reaped).
-- kill_within: written by the claim, from the claiming supervisor's settings: how long
--   after a cancel its handler may still live (kill_grace, the watchdog's slack, and the
--   time to reap), so that any supervisor's sweep can compute dead_by.
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS dead_by timestamptz,
                          ADD COLUMN IF NOT EXISTS kill_within interval;
ALTER TABLE cyclone_steps_archive ADD COLUMN IF NOT EXISTS dead_by timestamptz,
                                  ADD COLUMN IF NOT EXISTS kill_within interval;
