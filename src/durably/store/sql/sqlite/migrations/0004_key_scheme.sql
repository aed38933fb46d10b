-- Idempotency keys of runs started from now on encode their parts unambiguously (scheme 2:
-- a JSON array); runs already recorded keep scheme 1 (parts joined with '|') so that every
-- call they replay derives the key it was sent with.

ALTER TABLE durably_runs ADD COLUMN key_scheme INTEGER NOT NULL DEFAULT 1;
