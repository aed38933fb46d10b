-- The rows only a lease holder's commits write (the event log, the step ledger, the
-- checkpoints and the tool operations) no longer reference durably_runs by a foreign key.
-- PostgreSQL checks such a key by a query of its own that locks the run's row once more (a
-- row lock and its WAL record per row written): ~30 µs of the server's ~115 per step, and
-- 54 of its ~970 bytes of WAL; more per effect, whose two commits each write a checkpoint.
-- The key could never refuse a row: every statement that writes these tables fences the
-- run's row, or has read it, in its own transaction (a commit whose fence matched no row
-- is rolled back whole), and a run's row is never deleted. The keys also refused to delete
-- a run (every run has events); a trigger keeps that refusal, at no cost to a commit.
-- Signals and approvals keep their keys: a signal arrives from outside for a run id
-- someone typed.

ALTER TABLE durably_events DROP CONSTRAINT durably_events_run_id_fkey;
ALTER TABLE durably_steps DROP CONSTRAINT durably_steps_run_id_fkey;
ALTER TABLE durably_checkpoints DROP CONSTRAINT durably_checkpoints_run_id_fkey;
ALTER TABLE durably_tool_operations DROP CONSTRAINT durably_tool_operations_run_id_fkey;

CREATE FUNCTION durably_keep_runs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'run % cannot be deleted: durably keeps every run with its events, '
        'steps and checkpoints', OLD.run_id USING ERRCODE = 'restrict_violation';
END
$$;
CREATE TRIGGER durably_keep_runs BEFORE DELETE ON durably_runs
    FOR EACH ROW EXECUTE FUNCTION durably_keep_runs();
