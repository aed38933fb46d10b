-- Snapshot of the PostgreSQL schema after every migration (tests/test_migrations.py keeps it true).

CREATE TABLE durably_schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL);


-- Statuses and kinds are domains, not CHECKs on their tables (migration 0008 says why).
CREATE DOMAIN durably_run_status AS TEXT CHECK (VALUE IN ('queued', 'running',
    'waiting_approval', 'waiting_external', 'paused', 'reconciling', 'completed', 'failed',
    'cancelled'));
CREATE DOMAIN durably_step_kind AS TEXT CHECK (VALUE IN ('step', 'tool'));
CREATE DOMAIN durably_step_status AS TEXT CHECK (VALUE IN ('pending', 'ready',
    'intent_recorded', 'executing', 'succeeded', 'failed', 'unknown', 'reconciling',
    'waiting_approval', 'cancelled'));
CREATE DOMAIN durably_operation_status AS TEXT CHECK (VALUE IN ('intent_recorded',
    'executing', 'succeeded', 'failed', 'unknown', 'reconciling', 'compensated'));
CREATE DOMAIN durably_approval_kind AS TEXT CHECK (VALUE IN ('tool', 'plan'));
CREATE DOMAIN durably_approval_status AS TEXT CHECK (VALUE IN ('requested', 'approved',
    'rejected', 'expired', 'consumed', 'superseded'));


CREATE TABLE durably_runs (
    run_id            TEXT PRIMARY KEY,
    tenant_id         TEXT NOT NULL,
    workflow          TEXT NOT NULL,
    workflow_version  TEXT NOT NULL,
    plan_version      INTEGER NOT NULL DEFAULT 1,
    status            durably_run_status NOT NULL,
    status_reason     TEXT,
    input_json        TEXT NOT NULL,
    input_hash        TEXT NOT NULL,
    result_json       TEXT,
    error_json        TEXT,
    waiting_for_json  TEXT,
    lease_owner       TEXT,
    lease_until       DOUBLE PRECISION,
    lease_epoch       BIGINT NOT NULL DEFAULT 0,
    state_version     BIGINT NOT NULL DEFAULT 0,
    last_sequence     BIGINT NOT NULL DEFAULT 0,
    available_at      DOUBLE PRECISION NOT NULL,
    created_at        DOUBLE PRECISION NOT NULL,
    updated_at        DOUBLE PRECISION NOT NULL,
    cancel_requested  SMALLINT NOT NULL DEFAULT 0,
    key_scheme        SMALLINT NOT NULL DEFAULT 1,
    pause_requested   TEXT
);

-- Claims scan only runnable runs; a partial index keeps finished runs out of it.
CREATE INDEX durably_runs_runnable ON durably_runs (available_at, created_at)
    WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval');
CREATE INDEX durably_runs_created ON durably_runs (created_at);

-- A run is never deleted (migration 0009 says why a trigger, not the foreign keys, says so).
CREATE FUNCTION durably_keep_runs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'run % cannot be deleted: durably keeps every run with its events, '
        'steps and checkpoints', OLD.run_id USING ERRCODE = 'restrict_violation';
END
$$;
CREATE TRIGGER durably_keep_runs BEFORE DELETE ON durably_runs
    FOR EACH ROW EXECUTE FUNCTION durably_keep_runs();

-- No foreign key to durably_runs on the rows only commits write (migration 0009 says why).
CREATE TABLE durably_steps (
    run_id            TEXT NOT NULL,
    step_id           TEXT NOT NULL,
    position          INTEGER NOT NULL,
    kind              durably_step_kind NOT NULL,
    name              TEXT NOT NULL,
    status            durably_step_status NOT NULL,
    input_hash        TEXT NOT NULL,
    output_json       TEXT,
    error_json        TEXT,
    idempotency_key   TEXT,
    attempts          INTEGER NOT NULL DEFAULT 0,
    settled_sequence  BIGINT,
    created_at        DOUBLE PRECISION NOT NULL,
    updated_at        DOUBLE PRECISION NOT NULL,
    model_call_json   TEXT,
    PRIMARY KEY (run_id, step_id)
);

CREATE TABLE durably_tool_operations (
    tenant_id              TEXT NOT NULL,
    idempotency_key        TEXT NOT NULL,
    run_id                 TEXT NOT NULL,
    step_id                TEXT NOT NULL,
    plan_version           INTEGER NOT NULL,
    tool_name              TEXT NOT NULL,
    tool_version           TEXT NOT NULL,
    input_hash             TEXT NOT NULL,
    arguments_json         TEXT NOT NULL,
    status                 durably_operation_status NOT NULL,
    result_json            TEXT,
    error_json             TEXT,
    failure_category       TEXT,
    external_operation_id  TEXT,
    attempt                INTEGER NOT NULL DEFAULT 0,
    lease_owner            TEXT,
    lease_until            DOUBLE PRECISION,
    lease_epoch            BIGINT,
    row_version            BIGINT NOT NULL DEFAULT 0,
    created_at             DOUBLE PRECISION NOT NULL,
    updated_at             DOUBLE PRECISION NOT NULL,
    origin_key             TEXT,
    PRIMARY KEY (tenant_id, idempotency_key)
);

-- The event log is also the transactional outbox (see the SQLite schema for why).
CREATE TABLE durably_events (
    run_id        TEXT NOT NULL,
    sequence      BIGINT NOT NULL,
    type          TEXT NOT NULL,
    step_id       TEXT,
    payload_json  TEXT NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run_id, sequence)
);

CREATE TABLE durably_checkpoints (
    run_id               TEXT NOT NULL,
    state_version        BIGINT NOT NULL,
    last_event_sequence  BIGINT NOT NULL,
    schema_version       INTEGER NOT NULL,
    payload_json         TEXT NOT NULL,
    checksum             TEXT NOT NULL,
    created_at           DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run_id, state_version)
);

CREATE TABLE durably_inbox (
    consumer      TEXT NOT NULL,
    event_id      TEXT NOT NULL,
    received_at   DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (consumer, event_id)
);

CREATE TABLE durably_signals (
    run_id        TEXT NOT NULL REFERENCES durably_runs (run_id),
    event_id      TEXT NOT NULL,
    name          TEXT NOT NULL,
    payload_json  TEXT NOT NULL,
    received_at   DOUBLE PRECISION NOT NULL,
    consumed_by   TEXT,
    PRIMARY KEY (run_id, event_id)
);
CREATE TABLE durably_approvals (
    approval_id      TEXT PRIMARY KEY,
    run_id           TEXT NOT NULL REFERENCES durably_runs (run_id),
    step_id          TEXT NOT NULL,
    kind             durably_approval_kind NOT NULL,
    name             TEXT NOT NULL,
    payload_json     TEXT NOT NULL,
    input_hash       TEXT NOT NULL,
    idempotency_key  TEXT,
    plan_version     INTEGER NOT NULL,
    status           durably_approval_status NOT NULL,
    requested_at     DOUBLE PRECISION NOT NULL,
    expires_at       DOUBLE PRECISION NOT NULL,
    decided_at       DOUBLE PRECISION,
    decided_by       TEXT,
    comment          TEXT,
    consumed_at      DOUBLE PRECISION
);

CREATE INDEX durably_approvals_run ON durably_approvals (run_id, step_id);

CREATE INDEX durably_events_paused ON durably_events (run_id) WHERE type = 'run_paused';

CREATE INDEX durably_events_reconciled ON durably_events (run_id)
    WHERE type = 'effect_reconciled';
