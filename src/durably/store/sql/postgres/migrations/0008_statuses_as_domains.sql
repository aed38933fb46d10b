-- Every status and kind column takes its values from a domain instead of a CHECK on its
-- table: the same values, refused the same way. Why: PostgreSQL reads a table's CHECK
-- expressions back from the catalog and plans them again at every INSERT or UPDATE of the
-- table, whatever columns the statement sets. That was almost half the server's time of a
-- step's commit (~45 µs of ~110), whose fence updates the run's row without touching its
-- status. A domain's check is read once per connection, and runs only where a statement
-- writes the column. The domains get their checks only once the columns are theirs (NOT
-- VALID, then VALIDATE): a column moved to a domain that has a check would make PostgreSQL
-- rewrite its whole table under an exclusive lock; this way it reads each table once, and
-- rebuilds only the claim's partial index (runnable runs), whose predicate names a status.

CREATE DOMAIN durably_run_status AS TEXT;
CREATE DOMAIN durably_step_kind AS TEXT;
CREATE DOMAIN durably_step_status AS TEXT;
CREATE DOMAIN durably_operation_status AS TEXT;
CREATE DOMAIN durably_approval_kind AS TEXT;
CREATE DOMAIN durably_approval_status AS TEXT;

ALTER TABLE durably_runs DROP CONSTRAINT durably_runs_status_check,
    ALTER COLUMN status TYPE durably_run_status;
ALTER TABLE durably_steps DROP CONSTRAINT durably_steps_kind_check,
    DROP CONSTRAINT durably_steps_status_check,
    ALTER COLUMN kind TYPE durably_step_kind,
    ALTER COLUMN status TYPE durably_step_status;
ALTER TABLE durably_tool_operations DROP CONSTRAINT durably_tool_operations_status_check,
    ALTER COLUMN status TYPE durably_operation_status;
ALTER TABLE durably_approvals DROP CONSTRAINT durably_approvals_kind_check,
    DROP CONSTRAINT durably_approvals_status_check,
    ALTER COLUMN kind TYPE durably_approval_kind,
    ALTER COLUMN status TYPE durably_approval_status;

ALTER DOMAIN durably_run_status ADD CONSTRAINT durably_run_status_check
    CHECK (VALUE IN ('queued', 'running', 'waiting_approval', 'waiting_external', 'paused',
        'reconciling', 'completed', 'failed', 'cancelled')) NOT VALID;
ALTER DOMAIN durably_step_kind ADD CONSTRAINT durably_step_kind_check
    CHECK (VALUE IN ('step', 'tool')) NOT VALID;
ALTER DOMAIN durably_step_status ADD CONSTRAINT durably_step_status_check
    CHECK (VALUE IN ('pending', 'ready', 'intent_recorded', 'executing', 'succeeded',
        'failed', 'unknown', 'reconciling', 'waiting_approval', 'cancelled')) NOT VALID;
ALTER DOMAIN durably_operation_status ADD CONSTRAINT durably_operation_status_check
    CHECK (VALUE IN ('intent_recorded', 'executing', 'succeeded', 'failed', 'unknown',
        'reconciling', 'compensated')) NOT VALID;
ALTER DOMAIN durably_approval_kind ADD CONSTRAINT durably_approval_kind_check
    CHECK (VALUE IN ('tool', 'plan')) NOT VALID;
ALTER DOMAIN durably_approval_status ADD CONSTRAINT durably_approval_status_check
    CHECK (VALUE IN ('requested', 'approved', 'rejected', 'expired', 'consumed',
        'superseded')) NOT VALID;

ALTER DOMAIN durably_run_status VALIDATE CONSTRAINT durably_run_status_check;
ALTER DOMAIN durably_step_kind VALIDATE CONSTRAINT durably_step_kind_check;
ALTER DOMAIN durably_step_status VALIDATE CONSTRAINT durably_step_status_check;
ALTER DOMAIN durably_operation_status VALIDATE CONSTRAINT durably_operation_status_check;
ALTER DOMAIN durably_approval_kind VALIDATE CONSTRAINT durably_approval_kind_check;
ALTER DOMAIN durably_approval_status VALIDATE CONSTRAINT durably_approval_status_check;
