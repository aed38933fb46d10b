-- Snapshot of the SQLite schema after every migration (tests/test_migrations.py keeps it true).

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
    requested_at     REAL NOT NULL,
    expires_at       REAL NOT NULL,
    decided_at       REAL,
    decided_by       TEXT,
    comment          TEXT,
    consumed_at      REAL
) WITHOUT ROWID;

CREATE TABLE durably_checkpoints (
    run_id               TEXT NOT NULL REFERENCES durably_runs (run_id),
    state_version        INTEGER NOT NULL,
    last_event_sequence  INTEGER NOT NULL,
    schema_version       INTEGER NOT NULL,
    payload_json         TEXT NOT NULL,
    checksum             TEXT NOT NULL,
    created_at           REAL NOT NULL,
    PRIMARY KEY (run_id, state_version)
) WITHOUT ROWID;

CREATE TABLE durably_events (
    run_id        TEXT NOT NULL REFERENCES durably_runs (run_id),
    sequence      INTEGER NOT NULL,
    type          TEXT NOT NULL,
    step_id       TEXT,
    payload_json  TEXT NOT NULL,
    created_at    REAL NOT NULL,
    PRIMARY KEY (run_id, sequence)
) WITHOUT ROWID;

CREATE TABLE durably_inbox (
    consumer      TEXT NOT NULL,
    event_id      TEXT NOT NULL,
    received_at   REAL NOT NULL,
    PRIMARY KEY (consumer, event_id)
) WITHOUT ROWID;

CREATE TABLE durably_runs (
    run_id            TEXT PRIMARY KEY,
    tenant_id         TEXT NOT NULL,
    workflow          TEXT NOT NULL,
    workflow_version  TEXT NOT NULL,
    plan_version      INTEGER NOT NULL DEFAULT 1,
    status            TEXT NOT NULL CHECK (status IN ('queued', 'running', 'waiting_approval',
                        'waiting_external', 'paused', 'reconciling', 'completed', 'failed',
                        'cancelled')),
    status_reason     TEXT,
    input_json        TEXT NOT NULL,
    input_hash        TEXT NOT NULL,
    result_json       TEXT,
    error_json        TEXT,
    waiting_for_json  TEXT,
    lease_owner       TEXT,
    lease_until       REAL,
    lease_epoch       INTEGER NOT NULL DEFAULT 0,
    state_version     INTEGER NOT NULL DEFAULT 0,
    last_sequence     INTEGER NOT NULL DEFAULT 0,
    available_at      REAL NOT NULL,
    created_at        REAL NOT NULL,
    updated_at        REAL NOT NULL
, cancel_requested INTEGER NOT NULL DEFAULT 0, key_scheme INTEGER NOT NULL DEFAULT 1, pause_requested TEXT) WITHOUT ROWID;

CREATE TABLE durably_schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL);

CREATE TABLE durably_signals (
    run_id        TEXT NOT NULL REFERENCES durably_runs (run_id),
    event_id      TEXT NOT NULL,
    name          TEXT NOT NULL,
    payload_json  TEXT NOT NULL,
    received_at   REAL NOT NULL,
    consumed_by   TEXT,
    PRIMARY KEY (run_id, event_id)
) WITHOUT ROWID;

CREATE TABLE durably_steps (
    run_id            TEXT NOT NULL REFERENCES durably_runs (run_id),
    step_id           TEXT NOT NULL,
    position          INTEGER NOT NULL,
    kind              TEXT NOT NULL CHECK (kind IN ('step', 'tool')),
    name              TEXT NOT NULL,
    status            TEXT NOT NULL CHECK (status IN ('pending', 'ready', 'intent_recorded',
                        'executing', 'succeeded', 'failed', 'unknown', 'reconciling',
                        'waiting_approval', 'cancelled')),
    input_hash        TEXT NOT NULL,
    output_json       TEXT,
    error_json        TEXT,
    idempotency_key   TEXT,
    attempts          INTEGER NOT NULL DEFAULT 0,
    settled_sequence  INTEGER,
    created_at        REAL NOT NULL,
    updated_at        REAL NOT NULL, model_call_json TEXT,
    PRIMARY KEY (run_id, step_id)
) WITHOUT ROWID;

CREATE TABLE durably_tool_operations (
    tenant_id              TEXT NOT NULL,
    idempotency_key        TEXT NOT NULL,
    run_id                 TEXT NOT NULL REFERENCES durably_runs (run_id),
    step_id                TEXT NOT NULL,
    plan_version           INTEGER NOT NULL,
    tool_name              TEXT NOT NULL,
    tool_version           TEXT NOT NULL,
    input_hash             TEXT NOT NULL,
    arguments_json         TEXT NOT NULL,
    status                 TEXT NOT NULL CHECK (status IN ('intent_recorded', 'executing',
                             'succeeded', 'failed', 'unknown', 'reconciling', 'compensated')),
    result_json            TEXT,
    error_json             TEXT,
    failure_category       TEXT,
    external_operation_id  TEXT,
    attempt                INTEGER NOT NULL DEFAULT 0,
    lease_owner            TEXT,
    lease_until            REAL,
    lease_epoch            INTEGER,
    row_version            INTEGER NOT NULL DEFAULT 0,
    created_at             REAL NOT NULL,
    updated_at             REAL NOT NULL,
    origin_key             TEXT,
    PRIMARY KEY (tenant_id, idempotency_key)
) WITHOUT ROWID;

CREATE INDEX durably_approvals_run ON durably_approvals (run_id, step_id);

CREATE INDEX durably_events_paused ON durably_events (run_id) WHERE type = 'run_paused';

CREATE INDEX durably_events_reconciled ON durably_events (run_id)
    WHERE type = 'effect_reconciled';

CREATE INDEX durably_runs_created ON durably_runs (created_at);

CREATE INDEX durably_runs_runnable ON durably_runs (available_at, created_at)
    WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval');

-- A run is never deleted, whatever the connection's foreign key setting (migration 0009).
CREATE TRIGGER durably_keep_runs BEFORE DELETE ON durably_runs
BEGIN
    SELECT RAISE(ABORT, 'a run cannot be deleted: durably keeps every run with its events, steps and checkpoints');
END;
