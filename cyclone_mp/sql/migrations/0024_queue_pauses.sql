-- Paused queues (client.pause_queue, cyclone-mp queue pause): no supervisor claims a step of
-- a queue listed here (every claim statement looks, by primary key); steps already running
-- finish. Resuming deletes the row and wakes the queue's supervisors.
CREATE TABLE IF NOT EXISTS cyclone_queue_pauses (
    queue      text PRIMARY KEY,
    paused_at  timestamptz NOT NULL DEFAULT now(),
    reason     text
);
