-- Maintenance that one supervisor at a time does for all (issue 22): a row per task, the
-- recovery sweep first. A supervisor takes the task's turn by moving ran_at to now when
-- the last turn is at least an interval old (sweep_turn in queries.sql); the others skip
-- it, so the sweep runs once per interval however many supervisors share the database.
-- Only a row lock for one statement, no session state: it works through PgBouncer in
-- transaction mode, and a supervisor that dies holds nothing.
CREATE TABLE IF NOT EXISTS cyclone_maintenance (
    task text PRIMARY KEY,
    holder text,  -- the supervisor that took the last turn (informational)
    ran_at timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO cyclone_maintenance (task) VALUES ('sweep') ON CONFLICT (task) DO NOTHING;
