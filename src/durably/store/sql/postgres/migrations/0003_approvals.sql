-- Approvals bound to exactly what they approve. A tool call's approval binds its run,
-- step id, input hash, idempotency key and plan version; a plan approval binds the hash of
-- its payload. Approving makes it usable once: the transaction that claims the effect
-- consumes it, and judges its expiry at that moment.

CREATE TABLE durably_approvals (
    approval_id      TEXT PRIMARY KEY,
    run_id           TEXT NOT NULL REFERENCES durably_runs (run_id),
    step_id          TEXT NOT NULL,
    kind             TEXT NOT NULL CHECK (kind IN ('tool', 'plan')),
    name             TEXT NOT NULL,
    payload_json     TEXT NOT NULL,
    input_hash       TEXT NOT NULL,
    idempotency_key  TEXT,
    plan_version     INTEGER NOT NULL,
    status           TEXT NOT NULL CHECK (status IN ('requested', 'approved', 'rejected',
                       'expired', 'consumed', 'superseded')),
    requested_at     DOUBLE PRECISION NOT NULL,
    expires_at       DOUBLE PRECISION NOT NULL,
    decided_at       DOUBLE PRECISION,
    decided_by       TEXT,
    comment          TEXT,
    consumed_at      DOUBLE PRECISION
);

CREATE INDEX durably_approvals_run ON durably_approvals (run_id, step_id);
