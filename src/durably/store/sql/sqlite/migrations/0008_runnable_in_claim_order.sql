-- A claim takes the oldest due runs (ORDER BY available_at, created_at LIMIT n). On an index
-- by (status, available_at) it read every runnable run and sorted them all, so each claim
-- cost as much as the backlog (3 ms with 5,000 queued runs). In claim order, partial like
-- PostgreSQL's, the claim walks the due runs and stops at its batch.

DROP INDEX durably_runs_runnable;

CREATE INDEX durably_runs_runnable ON durably_runs (available_at, created_at)
    WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval');
