-- Every scrape of /metrics, on every worker, reads the events that are facts for metrics
-- (duplicates reconciliations found, forks blocked). They are few among millions of events:
-- a partial index each keeps that read at milliseconds instead of a scan of the event log,
-- and costs nothing to the events it leaves out. One index per type, not one for both: a
-- query's `type = ...` lets SQLite use a partial index only when the index says the same.

CREATE INDEX durably_events_reconciled ON durably_events (run_id)
    WHERE type = 'effect_reconciled';

CREATE INDEX durably_events_paused ON durably_events (run_id) WHERE type = 'run_paused';
