-- 0001: runs, steps (the seed's columns), signals, and the supervisor registry.

CREATE TABLE cyclone_runs (
    id               uuid PRIMARY KEY,
    name             text NOT NULL,                 -- step or workflow name
    kind             text NOT NULL DEFAULT 'step' CHECK (kind IN ('step', 'workflow')),
    state            text NOT NULL DEFAULT 'running'
                     CHECK (state IN ('running', 'paused', 'completed', 'discarded', 'cancelled')),
    input            jsonb NOT NULL DEFAULT 'null',
    idempotency_key  text UNIQUE,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz
);

CREATE TABLE cyclone_steps (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id            uuid NOT NULL REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    node              text NOT NULL,                -- unique within the run
    step_name         text,                         -- the handler's step name (task nodes)
    kind              text NOT NULL DEFAULT 'task' CHECK (kind IN ('task', 'signal', 'timer')),
    depends_on        text[] NOT NULL DEFAULT '{}',
    queue             text NOT NULL DEFAULT 'default',
    priority          integer NOT NULL DEFAULT 0,
    state             text NOT NULL
                      CHECK (state IN ('pending', 'available', 'running', 'waiting_signal', 'waiting_timer',
                                       'paused', 'completed', 'discarded', 'cancelled')),
    paused_from       text,                         -- the state a paused step returns to on resume
    attempt           integer NOT NULL DEFAULT 1,
    max_attempts      integer NOT NULL DEFAULT 25,
    reclaims          integer NOT NULL DEFAULT 0,
    max_reclaims      integer,
    timeout           interval,                     -- per attempt, compared with now() (seed)
    timer_delay       interval,                     -- timer nodes: due = reached + delay
    due_at            timestamptz,                  -- timer nodes: when it fires (DB clock, UTC)
    scheduled_at      timestamptz NOT NULL DEFAULT now(),
    started_at        timestamptz,
    finished_at       timestamptz,
    lease_owner       text,
    lease_expiry      timestamptz,
    lease_generation  bigint NOT NULL DEFAULT 0,
    heartbeat_at      timestamptz,
    error             text,
    error_kind        text,
    errors            jsonb NOT NULL DEFAULT '[]',  -- one entry per ended attempt that failed
    output            jsonb,
    progress          jsonb,
    UNIQUE (run_id, node)
);

-- The claim: available rows by queue, priority, scheduled_at (partial: stays small).
CREATE INDEX cyclone_steps_claim_idx ON cyclone_steps (queue, priority, scheduled_at, id)
    WHERE state = 'available';
-- The sweep: running rows only.
CREATE INDEX cyclone_steps_running_idx ON cyclone_steps (lease_expiry) WHERE state = 'running';
-- Timers due.
CREATE INDEX cyclone_steps_timer_idx ON cyclone_steps (due_at) WHERE state = 'waiting_timer';
CREATE INDEX cyclone_runs_state_idx ON cyclone_runs (state, created_at);

CREATE TABLE cyclone_signals (
    run_id      uuid NOT NULL REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    name        text NOT NULL,
    payload     jsonb NOT NULL DEFAULT 'null',
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, name)
);

-- Live supervisors, for `cyclone-mp workers`. Recovery never reads it (scenario SC-05).
CREATE TABLE cyclone_workers (
    id            text PRIMARY KEY,
    hostname      text NOT NULL,
    pid           integer NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    info          jsonb NOT NULL DEFAULT '{}'
);
