-- 0003: a durable backoff spec per step (seconds, or a schedule of seconds), set at enqueue
-- so every supervisor's sweep and failure write apply the same delays.
ALTER TABLE cyclone_steps ADD COLUMN backoff jsonb;
