-- 0010: whether a step with a rate limit entered a queue (issue 21). Queues with
-- concurrency limits but no rate-limited step are claimed by the concurrency claim,
-- whose plan leaves the rate slots out (about half the nodes of the full limited claim).
-- Rows from before are taken as rate-limited (the safe side).
ALTER TABLE cyclone_flow_queues ADD COLUMN rates boolean NOT NULL DEFAULT true;
