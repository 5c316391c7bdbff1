-- 0012: per-step resource limits (issue 20), stored at enqueue like timeout and
-- max_attempts, so every supervisor that claims the step enforces the same caps on its
-- attempt's whole process tree. NULL: no cap.

ALTER TABLE cyclone_steps
    ADD COLUMN memory_limit    bigint CHECK (memory_limit > 0),            -- bytes
    ADD COLUMN cpu_limit       double precision CHECK (cpu_limit > 0),     -- CPU seconds of the tree per attempt
    ADD COLUMN max_processes   integer CHECK (max_processes > 0),          -- processes of the tree at once
    ADD COLUMN max_open_files  integer CHECK (max_open_files > 0);         -- descriptors per process (RLIMIT_NOFILE)
