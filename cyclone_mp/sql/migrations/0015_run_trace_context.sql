-- Traces (issue 24): the trace context of the enqueue that made a run (W3C traceparent
-- and tracestate, as JSON), when OpenTelemetry was importable there; each attempt's span
-- links to it. NULL otherwise (adding a nullable column rewrites nothing).
ALTER TABLE cyclone_runs ADD COLUMN trace jsonb;
