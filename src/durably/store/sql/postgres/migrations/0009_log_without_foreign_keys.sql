-- The event log and the step ledger no longer reference durably_runs by a foreign key.
-- Every commit writes to them, and PostgreSQL checks such a key by a query of its own that
-- locks the run's row again (a row lock, and its WAL record, per commit): ~30 µs of the
-- server's ~115 per step, and 54 of its ~970 bytes of WAL. The key could never refuse a
-- row: each statement that writes these tables fences, or has read in its transaction,
-- the run's row, and a run's row is never deleted. A run's other rows (operations,
-- checkpoints, signals, approvals) keep their keys: they are written far less often.

ALTER TABLE durably_events DROP CONSTRAINT durably_events_run_id_fkey;
ALTER TABLE durably_steps DROP CONSTRAINT durably_steps_run_id_fkey;
