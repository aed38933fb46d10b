-- Every statement of the SQLite store, by name: store/queries.py loads them, store/plans.py
-- orders them. :now is the store's clock, bound by the store once per transaction.
-- SQLite's RETURNING shows only the new row, so a claim reads the run as it was
-- (claim_run, claim_batch) and then leases it (take_lease). Lists are bound as JSON.
-- The claimable statuses are store.base.CLAIMABLE (tests/store checks it).

-- name: clock
-- The store's clock, as every statement of the transaction sees it.
SELECT :now AS now;

-- name: insert_run
-- A new queued run, or no row if the run id is taken.
INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, status, input_json,
    input_hash, key_scheme, last_sequence, state_version, available_at, created_at, updated_at)
VALUES (:run_id, :tenant, :workflow, :workflow_version, 'queued', :input_json, :input_hash,
    :key_scheme, 1, 1, :now, :now, :now)
ON CONFLICT (run_id) DO NOTHING
RETURNING *;

-- name: start_run
-- A new run already leased to its creator, as take_lease leaves a claimed run (its receipt
-- is sealed at state version 1, before the lease); no row if the run id is taken. Its
-- run_started event and receipt follow in the same transaction.
INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, status, input_json,
    input_hash, key_scheme, last_sequence, state_version, lease_owner, lease_until,
    lease_epoch, available_at, created_at, updated_at)
VALUES (:run_id, :tenant, :workflow, :workflow_version, 'running', :input_json, :input_hash,
    :key_scheme, 1, 2, :owner, :now + :ttl, 1, :now + :ttl, :now, :now)
ON CONFLICT (run_id) DO NOTHING
RETURNING *;

-- name: get_run
-- One run.
SELECT * FROM durably_runs WHERE run_id = :run_id;

-- name: list_runs
-- Runs, newest first, optionally of one status and one workflow.
SELECT * FROM durably_runs
WHERE (:status IS NULL OR status = :status) AND (:workflow IS NULL OR workflow = :workflow)
ORDER BY created_at DESC, run_id LIMIT :limit;

-- name: claim_run
-- This run as it is before a claim, if due and not held by another; take_lease follows.
-- A run its claimer holds already is due whatever its available_at (see take_lease).
SELECT run_id, status AS old_status, lease_owner AS old_owner, lease_until AS old_until
FROM durably_runs
WHERE run_id = :run_id
  AND status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval')
  AND (available_at <= :now AND (lease_owner IS NULL OR lease_until < :now)
       OR lease_owner = :owner);

-- name: claim_batch
-- Up to :limit of the oldest due, unheld runs of these workflows (JSON), as they are; a
-- take_lease for each follows in the same transaction.
SELECT run_id, status AS old_status, lease_owner AS old_owner, lease_until AS old_until
FROM durably_runs
WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval')
  AND available_at <= :now
  AND (lease_owner IS NULL OR lease_until < :now)
  AND workflow || '|' || workflow_version IN (SELECT value FROM json_each(:workflows))
ORDER BY available_at, created_at LIMIT :limit;

-- name: take_lease
-- Lease a run picked by claim_run or claim_batch: a new epoch, running. It is due again
-- when this lease runs out, and every heartbeat moves that on: a held run stays out of
-- the claims' walk of durably_runs_runnable, which costs the batch, not the runs held.
UPDATE durably_runs SET lease_owner = :owner, lease_until = :now + :ttl,
    lease_epoch = lease_epoch + 1, state_version = state_version + 1, status = 'running',
    available_at = :now + :ttl, updated_at = :now
WHERE run_id = :run_id
RETURNING *;

-- name: lease_to_creator
-- A run just created in this transaction, held for its creator, who executes it (a
-- what-if): no worker claims it while the lease lasts, and the creator's claim_run takes it
-- as the queued run it still is, not as one recovered from a dead holder.
UPDATE durably_runs SET lease_owner = :owner, lease_until = :now + :ttl,
    lease_epoch = lease_epoch + 1, state_version = state_version + 1,
    available_at = :now + :ttl, updated_at = :now
WHERE run_id = :run_id
RETURNING *;

-- name: next_sequence
-- Make room for one event (a recovery's) after a claim.
UPDATE durably_runs SET last_sequence = last_sequence + 1 WHERE run_id = :run_id;

-- name: live_owners
-- Who holds a lease that has not run out (owners.dead judges which of them are gone). The
-- runnable statuses, spelled as durably_runs_runnable's, let SQLite read that index only.
SELECT DISTINCT lease_owner FROM durably_runs
WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval')
  AND status IN ('running', 'reconciling') AND lease_until > :now;

-- name: expire_run_leases
-- End now the leases of owners whose process is gone, so their runs can be claimed at once.
UPDATE durably_runs SET lease_until = :now, available_at = min(available_at, :now)
WHERE lease_owner IN (SELECT value FROM json_each(:owners)) AND lease_until > :now;

-- name: expire_operation_leases
-- The same for the tool operations they held (an operation holds its run's lease): the send
-- window of each ends now, and reconciliation's grace counts from there.
UPDATE durably_tool_operations SET lease_until = :now
WHERE lease_owner IN (SELECT value FROM json_each(:owners)) AND lease_until > :now;

-- name: heartbeat
-- Extend the lease if it is still this holder's, and when the run is due again with it
-- (see take_lease); no row if it was lost. A commit extends the lease alone, and no write
-- shortens it (the clock may be set back): between two heartbeats available_at <=
-- lease_until, so a run whose lease ran out is due.
UPDATE durably_runs SET lease_until = max(lease_until, :now + :ttl), available_at = :now + :ttl
WHERE run_id = :run_id AND lease_owner = :owner AND lease_epoch = :epoch
RETURNING lease_until;

-- name: fence_lease
-- A lease holder's fence: no row unless it holds the run; renews the lease. Not when the run
-- is due again (see the heartbeat): this is every commit's, and leaves the runnable index
-- as it is.
UPDATE durably_runs SET last_sequence = last_sequence + :events,
    state_version = state_version + 1,
    lease_until = max(lease_until, :now + :ttl),
    updated_at = :now
WHERE run_id = :run_id AND lease_owner = :owner AND lease_epoch = :epoch
RETURNING last_sequence, state_version, lease_until, cancel_requested,
    pause_requested;

-- name: fence_release
-- The fence of a commit that lets go of the run: no row unless its holder commits. The run
-- is due at once, unless what the commit writes says when (a retry, a wait's timer).
UPDATE durably_runs SET last_sequence = last_sequence + :events,
    state_version = state_version + 1, lease_until = NULL, lease_owner = NULL,
    available_at = :now, updated_at = :now
WHERE run_id = :run_id AND lease_owner = :owner AND lease_epoch = :epoch
RETURNING last_sequence, state_version, lease_until, cancel_requested,
    pause_requested;

-- name: fence_expect
-- The fence of an operator's commit: no row unless the run is unchanged and unheld. A
-- holder whose lease ran out loses it here: stalled, it must not write over this commit.
UPDATE durably_runs SET last_sequence = last_sequence + :events,
    state_version = state_version + 1, updated_at = :now, lease_owner = NULL
WHERE run_id = :run_id AND state_version = :state_version
  AND (lease_owner IS NULL OR lease_until < :now)
RETURNING last_sequence, state_version, lease_until, cancel_requested,
    pause_requested;

-- name: insert_operation
-- A new tool operation; changes no row if its key is taken (another writer recorded it).
INSERT INTO durably_tool_operations (tenant_id, idempotency_key, run_id, step_id,
    plan_version, tool_name, tool_version, input_hash, arguments_json, status, result_json,
    error_json, failure_category, external_operation_id, attempt, lease_owner, lease_until,
    lease_epoch, row_version, created_at, updated_at, origin_key)
VALUES (:tenant, :idempotency_key, :run_id, :step_id, :plan_version, :tool, :tool_version,
    :input_hash, :arguments_json, :status, :result_json, :error_json, :failure_category,
    :external_operation_id, :attempt, :lease_owner,
    CASE WHEN :held THEN :now + :ttl ELSE :send_deadline END, :lease_epoch, 1, :now, :now,
    :origin_key)
ON CONFLICT DO NOTHING;

-- name: update_operation
-- A tool operation's next state, if its row is still the version read.
UPDATE durably_tool_operations SET status = :status, result_json = :result_json,
    error_json = :error_json, failure_category = :failure_category,
    external_operation_id = coalesce(:external_operation_id, external_operation_id),
    attempt = :attempt, lease_owner = :lease_owner,
    lease_until = CASE WHEN :held THEN :now + :ttl ELSE :send_deadline END,
    lease_epoch = :lease_epoch, updated_at = :now, row_version = row_version + 1
WHERE tenant_id = :tenant AND idempotency_key = :idempotency_key
  AND row_version = :expect_row_version;

-- name: use_approval
-- Consume an approval bound to exactly this call, if approved and unexpired.
UPDATE durably_approvals SET status = 'consumed', consumed_at = :now
WHERE approval_id = :approval_id AND run_id = :run_id AND status = 'approved'
  AND expires_at > :now AND input_hash = :input_hash
  AND idempotency_key IS :idempotency_key AND plan_version = :plan_version;

-- name: consume_signal
-- The wait at step_id takes this signal, if nobody took it yet.
UPDATE durably_signals SET consumed_by = :step_id
WHERE run_id = :run_id AND event_id = :event_id AND consumed_by IS NULL;

-- name: update_run
-- The run's new status and what goes with it.
UPDATE durably_runs SET status = :status, status_reason = :status_reason,
    result_json = coalesce(:result_json, result_json), error_json = :error_json,
    waiting_for_json = :waiting_for_json, available_at = coalesce(:available_at, available_at)
WHERE run_id = :run_id;

-- name: pause_if_requested
-- A run about to wait is paused instead if an operator asked meanwhile (a cancel goes first).
UPDATE durably_runs SET status = 'paused', status_reason = 'operator_pause',
    error_json = pause_requested
WHERE run_id = :run_id AND pause_requested IS NOT NULL AND cancel_requested = 0;

-- name: requeue_if_cancelled
-- A run about to wait stays due if a cancel was requested meanwhile.
UPDATE durably_runs SET status = 'queued', available_at = :now
WHERE run_id = :run_id AND cancel_requested > 0;

-- name: set_plan_version
-- The run's new plan version (durably.replan()).
UPDATE durably_runs SET plan_version = :plan_version WHERE run_id = :run_id;

-- name: wake_on_signal
-- A run about to wait for events of this name is due now if one is already there.
UPDATE durably_runs SET status = 'queued', available_at = :now
WHERE run_id = :run_id AND EXISTS (SELECT 1 FROM durably_signals
    WHERE run_id = :run_id AND name = :name AND consumed_by IS NULL);

-- name: wake_on_approval
-- A run about to wait for an approval requested earlier is due now if it was decided
-- meanwhile (its decision found the run still executing, so it could not make it due).
UPDATE durably_runs SET status = 'queued', available_at = :now
WHERE run_id = :run_id AND status = 'waiting_approval' AND EXISTS (SELECT 1
    FROM durably_approvals WHERE approval_id = :approval_id AND status <> 'requested');

-- name: supersede_approval
-- An earlier request of the same call is void: expired if it ran out, else superseded.
UPDATE durably_approvals
SET status = CASE WHEN expires_at <= :now THEN 'expired' ELSE 'superseded' END
WHERE approval_id = :approval_id AND status IN ('requested', 'approved');

-- name: insert_approval
-- A new approval request.
INSERT INTO durably_approvals (approval_id, run_id, step_id, kind, name, payload_json,
    input_hash, idempotency_key, plan_version, status, requested_at, expires_at)
VALUES (:approval_id, :run_id, :step_id, :kind, :name, :payload_json, :input_hash,
    :idempotency_key, :plan_version, 'requested', :now, :expires_at);

-- name: insert_event
-- One event of the run's log (also the outbox), at a sequence its fence reserved.
INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at)
VALUES (:run_id, :sequence, :type, :step_id, :payload_json, :now);

-- name: insert_event_fenced
-- insert_event in a commit sent as one round: nothing unless the fence, earlier in the same
-- transaction, held; its sequence counted back from the last_sequence the fence left.
INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at)
SELECT run_id, last_sequence - :back, :type, :step_id, :payload_json, :now
FROM durably_runs WHERE run_id = :run_id AND lease_owner = :owner AND lease_epoch = :epoch;

-- name: upsert_step_fenced
-- upsert_step in a commit sent as one round (see insert_event_fenced); settled at the
-- sequence of the commit's last event.
INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, input_hash,
    output_json, error_json, idempotency_key, attempts, settled_sequence, created_at,
    updated_at, model_call_json)
SELECT run_id, :step_id, :position, :kind, :name, :status, :input_hash, :output_json,
    :error_json, :idempotency_key, :attempts, CASE WHEN :settle THEN last_sequence END,
    :now, :now, :model_call_json
FROM durably_runs WHERE run_id = :run_id AND lease_owner = :owner AND lease_epoch = :epoch
ON CONFLICT (run_id, step_id) DO UPDATE SET status = excluded.status,
    output_json = excluded.output_json, error_json = excluded.error_json,
    attempts = excluded.attempts, model_call_json = excluded.model_call_json,
    settled_sequence = coalesce(excluded.settled_sequence, settled_sequence),
    updated_at = excluded.updated_at;

-- name: upsert_step
-- A step-ledger row; settled_sequence, once set, stays.
INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, input_hash,
    output_json, error_json, idempotency_key, attempts, settled_sequence, created_at,
    updated_at, model_call_json)
VALUES (:run_id, :step_id, :position, :kind, :name, :status, :input_hash, :output_json,
    :error_json, :idempotency_key, :attempts, :settled_sequence, :now, :now, :model_call_json)
ON CONFLICT (run_id, step_id) DO UPDATE SET status = excluded.status,
    output_json = excluded.output_json, error_json = excluded.error_json,
    attempts = excluded.attempts, model_call_json = excluded.model_call_json,
    settled_sequence = coalesce(excluded.settled_sequence, settled_sequence),
    updated_at = excluded.updated_at;

-- name: insert_checkpoint
-- The run's state as of this commit.
INSERT INTO durably_checkpoints (run_id, state_version, last_event_sequence, schema_version,
    payload_json, checksum, created_at)
VALUES (:run_id, :state_version, :last_event_sequence, :schema_version, :payload_json,
    :checksum, :now);

-- name: prune_checkpoints
-- All but the run's newest :keep checkpoints (the event log keeps the history).
DELETE FROM durably_checkpoints WHERE run_id = :run_id AND state_version < (
    SELECT min(state_version) FROM (SELECT state_version FROM durably_checkpoints
    WHERE run_id = :run_id ORDER BY state_version DESC LIMIT :keep) AS kept);

-- name: lock_run
-- What an operator's write checks first (SQLite's write lock is already held).
SELECT status, waiting_for_json, last_sequence FROM durably_runs WHERE run_id = :run_id;

-- name: insert_signal
-- An event sent to an existing, unfinished run, once per event id.
INSERT INTO durably_signals (run_id, event_id, name, payload_json, received_at)
SELECT run_id, :event_id, :name, :payload_json, :now FROM durably_runs
WHERE run_id = :run_id AND status NOT IN ('completed', 'failed', 'cancelled')
ON CONFLICT (run_id, event_id) DO NOTHING;

-- name: signal_known
-- Whether an event was delivered under this id already (by this statement's round or before).
SELECT 1 FROM durably_signals WHERE run_id = :run_id AND event_id = :event_id;

-- name: bump_run
-- Make room for an operator's event; the run is queued and due now if :due.
UPDATE durably_runs SET last_sequence = last_sequence + 1, state_version = state_version + 1,
    updated_at = :now, status = CASE WHEN :due THEN 'queued' ELSE status END,
    available_at = CASE WHEN :due THEN :now ELSE available_at END
WHERE run_id = :run_id;

-- name: approvals
-- The run's approvals (or the one named), oldest first.
SELECT * FROM durably_approvals
WHERE run_id = :run_id AND (:approval_id IS NULL OR approval_id = :approval_id)
ORDER BY requested_at;

-- name: decide_approval
-- Record a decision (or the expiry found instead).
UPDATE durably_approvals SET status = :status, decided_at = :now, decided_by = :by,
    comment = :comment
WHERE approval_id = :approval_id
RETURNING *;

-- name: request_cancel
-- Flag a cancel; a waiting or paused run is queued, and due now unless someone holds it.
-- Compensations asked for once stay asked for (2 outranks 1).
UPDATE durably_runs SET cancel_requested = MAX(cancel_requested, :cancel), state_version = state_version + 1,
    updated_at = :now,
    status = CASE WHEN status IN ('waiting_external', 'waiting_approval', 'paused')
        THEN 'queued' ELSE status END,
    available_at = CASE WHEN lease_owner IS NULL OR lease_until < :now
        THEN :now ELSE available_at END
WHERE run_id = :run_id
RETURNING *;

-- name: lock_run_record
-- The run (SQLite's write lock is already held).
SELECT * FROM durably_runs WHERE run_id = :run_id;

-- name: request_pause
-- An operator's pause request (JSON); :at_once pauses the run now, keeping what it waits for.
UPDATE durably_runs SET pause_requested = :request, last_sequence = last_sequence + 1,
    state_version = state_version + 1, updated_at = :now,
    status = CASE WHEN :at_once THEN 'paused' ELSE status END,
    status_reason = CASE WHEN :at_once THEN 'operator_pause' ELSE status_reason END,
    error_json = CASE WHEN :at_once THEN :request ELSE error_json END
WHERE run_id = :run_id
RETURNING *;

-- name: withdraw_pause
-- The operator's pause is withdrawn; with :resume the operator-paused run is queued, due now.
UPDATE durably_runs SET pause_requested = NULL, last_sequence = last_sequence + 1,
    state_version = state_version + 1, updated_at = :now,
    status = CASE WHEN :resume THEN 'queued' ELSE status END,
    status_reason = CASE WHEN :resume THEN NULL ELSE status_reason END,
    error_json = CASE WHEN :resume THEN NULL ELSE error_json END,
    waiting_for_json = CASE WHEN :resume THEN NULL ELSE waiting_for_json END,
    available_at = CASE WHEN :resume THEN :now ELSE available_at END
WHERE run_id = :run_id
RETURNING *;

-- name: steps
-- The run's step ledger, sorted into call order by the caller: no index holds that order,
-- and SQLite would sort the rows, results and all, in memory (temp_store=MEMORY).
SELECT * FROM durably_steps WHERE run_id = :run_id;

-- name: operations
-- The run's tool operations, found through its steps' idempotency keys.
SELECT o.* FROM durably_steps s
JOIN durably_runs r ON r.run_id = s.run_id
JOIN durably_tool_operations o
  ON o.tenant_id = r.tenant_id AND o.idempotency_key = s.idempotency_key
WHERE s.run_id = :run_id;

-- name: operation
-- One tool operation by its key, whichever run recorded it.
SELECT * FROM durably_tool_operations WHERE tenant_id = :tenant AND idempotency_key = :key;

-- name: latest_checkpoints
-- The run's newest checkpoints.
SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = :run_id
ORDER BY state_version DESC LIMIT :limit;

-- name: checkpoints
-- All of the run's checkpoints, newest first.
SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = :run_id
ORDER BY state_version DESC;

-- name: pending_signals
-- Events sent to the run and not consumed yet, in arrival order.
SELECT * FROM durably_signals WHERE run_id = :run_id AND consumed_by IS NULL
ORDER BY received_at, event_id;

-- name: events
-- The run's events after a sequence.
SELECT * FROM durably_events WHERE run_id = :run_id AND sequence > :after ORDER BY sequence;

-- name: events_after_checkpoint
-- The run's events after its newest checkpoint (all, without one): they verify the results
-- settled since.
SELECT * FROM durably_events WHERE run_id = :run_id AND sequence > coalesce((
    SELECT last_event_sequence FROM durably_checkpoints WHERE run_id = :run_id
    ORDER BY state_version DESC LIMIT 1), 0)
ORDER BY sequence;

-- name: next_wakeup
-- When the next claimable run of these workflows (a JSON list) is due, by the store's clock:
-- the first in durably_runs_runnable's order, a walk that stops there, however many runs
-- wait. A held run is due when its lease runs out (see take_lease), which a heartbeat keeps
-- ahead; one a worker of an older version holds is due since its claim: passed over.
SELECT available_at AS due, :now AS now
FROM durably_runs
WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval')
  AND workflow || '|' || workflow_version IN (SELECT value FROM json_each(:workflows))
  AND (available_at > :now OR lease_owner IS NULL OR lease_until < :now)
ORDER BY available_at, created_at LIMIT 1;

-- name: ledger_figures
-- The ledger's figures for metrics, one row per figure (and label): effects an operator must
-- settle per tool and since when, duplicates reconciliations found per tool, forks paused
-- because their replay mode blocked an effect, approvals that ran out.
SELECT 'unresolved' AS figure, tool_name AS label, count(*) AS n, min(updated_at) AS since
FROM durably_tool_operations
WHERE status IN ('unknown', 'reconciling') OR (status = 'executing' AND lease_until < :now)
GROUP BY tool_name
UNION ALL
SELECT 'duplicates', json_extract(payload_json, '$.tool'),
    sum(json_extract(payload_json, '$.duplicates')), NULL
FROM durably_events
WHERE type = 'effect_reconciled' AND json_extract(payload_json, '$.duplicates') > 0
GROUP BY 2
UNION ALL
SELECT 'replays_blocked', NULL, count(*), NULL FROM durably_events
WHERE type = 'run_paused' AND json_extract(payload_json, '$.reason') = 'replay_blocked'
UNION ALL
SELECT 'approvals_expired', NULL, count(*), NULL FROM durably_approvals
WHERE status = 'expired';

-- name: undelivered
-- Events a consumer has not acknowledged, but those of the skipped runs (a JSON list).
SELECT * FROM durably_events e
WHERE NOT EXISTS (SELECT 1 FROM durably_inbox i
    WHERE i.consumer = :consumer AND i.event_id = e.run_id || ':' || e.sequence)
  AND e.run_id NOT IN (SELECT value FROM json_each(:skip_runs))
ORDER BY e.created_at, e.run_id, e.sequence LIMIT :limit;

-- name: acknowledge
-- A consumer processed an event (changes no row if it already had).
INSERT INTO durably_inbox (consumer, event_id, received_at) VALUES (:consumer, :event_id, :now)
ON CONFLICT (consumer, event_id) DO NOTHING;

-- name: migrations_table
-- A row if the migrations table exists.
SELECT 1 FROM sqlite_master WHERE name = 'durably_schema_migrations';

-- name: schema_version
-- The newest migration applied.
SELECT max(version) FROM durably_schema_migrations;

-- name: create_migrations_table
-- Where applied migrations are recorded.
CREATE TABLE IF NOT EXISTS durably_schema_migrations (version INTEGER PRIMARY KEY,
    name TEXT NOT NULL, applied_at REAL NOT NULL);

-- name: migration_applied
-- A row if this migration was applied.
SELECT 1 FROM durably_schema_migrations WHERE version = :version;

-- name: record_migration
-- This migration is applied.
INSERT INTO durably_schema_migrations (version, name, applied_at) VALUES (:version, :name, :now);
