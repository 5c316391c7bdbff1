-- 0009: whether a step with a limit (not only a key) entered a queue (issue 21). Queues
-- with keys but no limited step are claimed by the fair claim without slots, which costs
-- less than the limited one. Rows from before are taken as limited (the safe side).
ALTER TABLE cyclone_flow_queues ADD COLUMN limits boolean NOT NULL DEFAULT true;
