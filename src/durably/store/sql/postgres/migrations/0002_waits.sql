-- Waiting runs: external events delivered to a run (an inbox keyed by the sender's event
-- id), and cancellation requested while a worker holds the run.

ALTER TABLE durably_runs ADD COLUMN cancel_requested SMALLINT NOT NULL DEFAULT 0;

-- Events sent to a run. Delivered once per (run_id, event_id); consumed in arrival order
-- by the wait_for_event call that settles with them (consumed_by is its step id).
CREATE TABLE durably_signals (
    run_id        TEXT NOT NULL REFERENCES durably_runs (run_id),
    event_id      TEXT NOT NULL,
    name          TEXT NOT NULL,
    payload_json  TEXT NOT NULL,
    received_at   DOUBLE PRECISION NOT NULL,
    consumed_by   TEXT,
    PRIMARY KEY (run_id, event_id)
);

-- A waiting run is claimable once its wake-up time (timer, wait timeout) is due.
DROP INDEX durably_runs_runnable;
CREATE INDEX durably_runs_runnable ON durably_runs (available_at, created_at)
    WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval');
