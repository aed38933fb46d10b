-- A run is never deleted: its events, steps and checkpoints refer to it, and a new run of
-- its id would meet them. The foreign keys refuse the delete only on a connection that
-- enables them (durably's own do, a sqlite3 shell does not); this trigger refuses it on
-- every connection, as PostgreSQL's does.

CREATE TRIGGER durably_keep_runs BEFORE DELETE ON durably_runs
BEGIN
    SELECT RAISE(ABORT, 'a run cannot be deleted: durably keeps every run with its events, steps and checkpoints');
END;
