-- 0008: queues that a step with a key or a limit ever entered (written at enqueue, issue
-- 21). A claim of queues none of which is listed uses the plain statement of before (one
-- ordered scan, no walk over keys, no slots): queues without flow control pay nothing for
-- it. (Its own migration: 0007 was already applied to databases this table postdates.)
CREATE TABLE cyclone_flow_queues (
    queue  text PRIMARY KEY,
    since  timestamptz NOT NULL DEFAULT now()
);
