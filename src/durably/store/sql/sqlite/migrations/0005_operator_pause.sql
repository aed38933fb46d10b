-- An operator's pause request, as the JSON the paused run's error shows ({type, message, by,
-- reason}); NULL when none. A run held by a worker pauses at its next call boundary, and an
-- operator-paused run stays paused until the request is withdrawn (unpause).

ALTER TABLE durably_runs ADD COLUMN pause_requested TEXT;
