-- Every statement of the PostgreSQL store, by name: store/queries.py loads them,
-- store/plans.py orders them. The store's clock is the server's: extract(epoch FROM now()),
-- the transaction's start. Lists are bound as arrays. The claimable statuses are
-- store.base.CLAIMABLE, written out so the planner can use the partial index
-- durably_runs_runnable (tests/store checks them).

-- name: clock
-- The store's clock, as every statement of the transaction sees it.
SELECT extract(epoch FROM now()) AS now;

-- name: insert_run
-- A new queued run, or no row if the run id is taken.
INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, status, input_json,
    input_hash, key_scheme, last_sequence, state_version, available_at, created_at, updated_at)
VALUES (%(run_id)s, %(tenant)s, %(workflow)s, %(workflow_version)s, 'queued', %(input_json)s,
    %(input_hash)s, %(key_scheme)s, 1, 1, extract(epoch FROM now()), extract(epoch FROM now()),
    extract(epoch FROM now()))
ON CONFLICT (run_id) DO NOTHING
RETURNING *;

-- name: start_run
-- A new run already leased to its creator, with its run_started event and its receipt
-- checkpoint (sealed at state version 1, before the lease): insert_run, their inserts and
-- claim_run as one statement. The row as claim_run returns it; none if the run id is taken.
WITH run AS (
    INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, status,
        input_json, input_hash, key_scheme, last_sequence, state_version, lease_owner,
        lease_until, lease_epoch, available_at, created_at, updated_at)
    VALUES (%(run_id)s, %(tenant)s, %(workflow)s, %(workflow_version)s, 'running',
        %(input_json)s, %(input_hash)s, %(key_scheme)s, 1, 2, %(owner)s,
        extract(epoch FROM now()) + %(ttl)s, 1, extract(epoch FROM now()) + %(ttl)s,
        extract(epoch FROM now()), extract(epoch FROM now()))
    ON CONFLICT (run_id) DO NOTHING
    RETURNING *
), event AS (
    INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at)
    SELECT run_id, 1, 'run_started', NULL, %(event_json)s, extract(epoch FROM now())
    FROM run
), receipt AS (
    INSERT INTO durably_checkpoints (run_id, state_version, last_event_sequence,
        schema_version, payload_json, checksum, created_at)
    SELECT run_id, 1, 1, %(schema_version)s, %(checkpoint_json)s, %(checksum)s,
        extract(epoch FROM now())
    FROM run WHERE %(receipt)s
)
SELECT run.*, 'queued' AS old_status, NULL::text AS old_owner,
    NULL::double precision AS old_until
FROM run;

-- name: get_run
-- One run.
SELECT * FROM durably_runs WHERE run_id = %(run_id)s;

-- name: list_runs
-- Runs, newest first, optionally of one status and one workflow.
SELECT * FROM durably_runs
WHERE (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s)
ORDER BY created_at DESC, run_id LIMIT %(limit)s;

-- name: lease_to_creator
-- A run just created in this transaction, held for its creator, who executes it (a
-- what-if): no worker claims it while the lease lasts, and the creator's claim_run takes it
-- as the queued run it still is, not as one recovered from a dead holder.
UPDATE durably_runs SET lease_owner = %(owner)s,
    lease_until = extract(epoch FROM now()) + %(ttl)s, lease_epoch = lease_epoch + 1,
    state_version = state_version + 1,
    available_at = extract(epoch FROM now()) + %(ttl)s, updated_at = extract(epoch FROM now())
WHERE run_id = %(run_id)s
RETURNING *;

-- name: claim_run
-- Lease this run if due and not held by another; the row with its lease as it was before.
-- A run its claimer holds already is due whatever its available_at (see claim_batch).
WITH candidate AS (
    SELECT run_id, status AS old_status, lease_owner AS old_owner, lease_until AS old_until
    FROM durably_runs
    WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval')
      AND run_id = %(run_id)s
      AND (available_at <= extract(epoch FROM now())
           AND (lease_owner IS NULL OR lease_until < extract(epoch FROM now()))
           OR lease_owner = %(owner)s)
    FOR UPDATE SKIP LOCKED)
UPDATE durably_runs r SET lease_owner = %(owner)s,
    lease_until = extract(epoch FROM now()) + %(ttl)s, lease_epoch = r.lease_epoch + 1,
    state_version = r.state_version + 1, status = 'running',
    available_at = extract(epoch FROM now()) + %(ttl)s, updated_at = extract(epoch FROM now())
FROM candidate c WHERE r.run_id = c.run_id
RETURNING r.*, c.old_status, c.old_owner, c.old_until;

-- name: claim_in_index_order
-- Sent just before claim_batch: the planner walks durably_runs_runnable in claim order and
-- stops at the batch. Its estimate of how many runs are due comes from the table's
-- statistics; after a burst of new runs, until autovacuum analyzes the table, it would read
-- every due run and sort them all, so that each claim cost as much as the backlog.
SET LOCAL enable_sort = off;

-- name: claim_done_in_index_order
-- Sent just after claim_batch: the rest of the claim's transaction (the journals' reads,
-- which do need sorts) is planned as usual again.
SET LOCAL enable_sort = on;

-- name: claim_batch
-- Lease up to %(limit)s of the oldest due, unheld runs of these workflows at once (a worker's
-- free slots), passing over rows being claimed: no run goes to two claimers. A leased run
-- is due again when its lease runs out, and every heartbeat moves that on: a held run stays
-- out of the claims' walk of durably_runs_runnable, which costs the batch, not the runs held.
WITH candidate AS (
    SELECT run_id, status AS old_status, lease_owner AS old_owner, lease_until AS old_until
    FROM durably_runs
    WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval')
      AND available_at <= extract(epoch FROM now())
      AND workflow || '|' || workflow_version = ANY(%(workflows)s)
      AND (lease_owner IS NULL OR lease_until < extract(epoch FROM now()))
    ORDER BY available_at, created_at LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED)
UPDATE durably_runs r SET lease_owner = %(owner)s,
    lease_until = extract(epoch FROM now()) + %(ttl)s, lease_epoch = r.lease_epoch + 1,
    state_version = r.state_version + 1, status = 'running',
    available_at = extract(epoch FROM now()) + %(ttl)s, updated_at = extract(epoch FROM now())
FROM candidate c WHERE r.run_id = c.run_id
RETURNING r.*, c.old_status, c.old_owner, c.old_until;

-- name: next_sequence
-- Make room for one event (a recovery's) after a claim.
UPDATE durably_runs SET last_sequence = last_sequence + 1 WHERE run_id = %(run_id)s;

-- name: live_owners
-- Who holds a lease that has not run out (owners.dead judges which of them are gone).
SELECT DISTINCT lease_owner FROM durably_runs
WHERE status IN ('running', 'reconciling') AND lease_until > extract(epoch FROM now());

-- name: expire_run_leases
-- End now the leases of owners whose process is gone, so their runs can be claimed at once.
UPDATE durably_runs SET lease_until = extract(epoch FROM now()),
    available_at = least(available_at, extract(epoch FROM now()))
WHERE lease_owner = ANY(%(owners)s) AND lease_until > extract(epoch FROM now());

-- name: expire_operation_leases
-- The same for the tool operations they held (an operation holds its run's lease): the send
-- window of each ends now, and reconciliation's grace counts from there.
UPDATE durably_tool_operations SET lease_until = extract(epoch FROM now())
WHERE lease_owner = ANY(%(owners)s) AND lease_until > extract(epoch FROM now());

-- name: heartbeat
-- Extend the lease if it is still this holder's, and when the run is due again with it
-- (see claim_batch); no row if it was lost. A commit extends the lease alone, which keeps
-- its update HOT, and no write shortens it (see fence_lease): between two heartbeats
-- available_at <= lease_until, so a run whose lease ran out is due.
UPDATE durably_runs SET lease_until = greatest(lease_until, extract(epoch FROM now()) + %(ttl)s),
    available_at = extract(epoch FROM now()) + %(ttl)s
WHERE run_id = %(run_id)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
RETURNING lease_until;

-- name: fence_lease
-- A lease holder's fence: no row unless it holds the run; renews the lease. Not when the run
-- is due again (see the heartbeat): this is every commit's, and leaves the runnable index
-- as it is. Never shorter: a round of several runs' commits is one transaction, whose now()
-- is its start, and a fence late in it (behind another run's row lock) may apply after a
-- heartbeat that started later.
UPDATE durably_runs SET last_sequence = last_sequence + %(events)s,
    state_version = state_version + 1,
    lease_until = greatest(lease_until, extract(epoch FROM now()) + %(ttl)s),
    updated_at = extract(epoch FROM now())
WHERE run_id = %(run_id)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
RETURNING last_sequence, state_version, lease_until, cancel_requested,
    pause_requested;

-- name: fence_release
-- The fence of a commit that lets go of the run: no row unless its holder commits. The run
-- is due at once, unless what the commit writes says when (a retry, a wait's timer).
UPDATE durably_runs SET last_sequence = last_sequence + %(events)s,
    state_version = state_version + 1, lease_until = NULL, lease_owner = NULL,
    available_at = extract(epoch FROM now()), updated_at = extract(epoch FROM now())
WHERE run_id = %(run_id)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
RETURNING last_sequence, state_version, lease_until, cancel_requested,
    pause_requested;

-- name: fence_expect
-- The fence of an operator's commit: no row unless the run is unchanged and unheld. A
-- holder whose lease ran out loses it here: stalled, it must not write over this commit.
UPDATE durably_runs SET last_sequence = last_sequence + %(events)s,
    state_version = state_version + 1, updated_at = extract(epoch FROM now()),
    lease_owner = NULL
WHERE run_id = %(run_id)s AND state_version = %(state_version)s
  AND (lease_owner IS NULL OR lease_until < extract(epoch FROM now()))
RETURNING last_sequence, state_version, lease_until, cancel_requested,
    pause_requested;

-- name: insert_operation
-- A new tool operation; changes no row if its key is taken (another writer recorded it).
INSERT INTO durably_tool_operations (tenant_id, idempotency_key, run_id, step_id,
    plan_version, tool_name, tool_version, input_hash, arguments_json, status, result_json,
    error_json, failure_category, external_operation_id, attempt, lease_owner, lease_until,
    lease_epoch, row_version, created_at, updated_at, origin_key)
VALUES (%(tenant)s, %(idempotency_key)s, %(run_id)s, %(step_id)s, %(plan_version)s,
    %(tool)s, %(tool_version)s, %(input_hash)s, %(arguments_json)s, %(status)s,
    %(result_json)s, %(error_json)s, %(failure_category)s, %(external_operation_id)s,
    %(attempt)s, %(lease_owner)s,
    CASE WHEN %(held)s THEN extract(epoch FROM now()) + %(ttl)s ELSE %(send_deadline)s END,
    %(lease_epoch)s, 1, extract(epoch FROM now()), extract(epoch FROM now()),
    %(origin_key)s)
ON CONFLICT DO NOTHING;

-- name: update_operation
-- A tool operation's next state, if its row is still the version read.
UPDATE durably_tool_operations SET status = %(status)s, result_json = %(result_json)s,
    error_json = %(error_json)s, failure_category = %(failure_category)s,
    external_operation_id = coalesce(%(external_operation_id)s, external_operation_id),
    attempt = %(attempt)s, lease_owner = %(lease_owner)s,
    lease_until = CASE WHEN %(held)s THEN extract(epoch FROM now()) + %(ttl)s
        ELSE %(send_deadline)s END,
    lease_epoch = %(lease_epoch)s, updated_at = extract(epoch FROM now()),
    row_version = row_version + 1
WHERE tenant_id = %(tenant)s AND idempotency_key = %(idempotency_key)s
  AND row_version = %(expect_row_version)s;

-- name: use_approval
-- Consume an approval bound to exactly this call, if approved and unexpired.
UPDATE durably_approvals SET status = 'consumed', consumed_at = extract(epoch FROM now())
WHERE approval_id = %(approval_id)s AND run_id = %(run_id)s AND status = 'approved'
  AND expires_at > extract(epoch FROM now()) AND input_hash = %(input_hash)s
  AND idempotency_key IS NOT DISTINCT FROM %(idempotency_key)s
  AND plan_version = %(plan_version)s;

-- name: consume_signal
-- The wait at step_id takes this signal, if nobody took it yet.
UPDATE durably_signals SET consumed_by = %(step_id)s
WHERE run_id = %(run_id)s AND event_id = %(event_id)s AND consumed_by IS NULL;

-- name: update_run
-- The run's new status and what goes with it.
UPDATE durably_runs SET status = %(status)s, status_reason = %(status_reason)s,
    result_json = coalesce(%(result_json)s, result_json), error_json = %(error_json)s,
    waiting_for_json = %(waiting_for_json)s,
    available_at = coalesce(%(available_at)s, available_at)
WHERE run_id = %(run_id)s;

-- name: pause_if_requested
-- A run about to wait is paused instead if an operator asked meanwhile (a cancel goes first).
UPDATE durably_runs SET status = 'paused', status_reason = 'operator_pause',
    error_json = pause_requested
WHERE run_id = %(run_id)s AND pause_requested IS NOT NULL AND cancel_requested = 0;

-- name: requeue_if_cancelled
-- A run about to wait stays due if a cancel was requested meanwhile.
UPDATE durably_runs SET status = 'queued', available_at = extract(epoch FROM now())
WHERE run_id = %(run_id)s AND cancel_requested > 0;

-- name: set_plan_version
-- The run's new plan version (durably.replan()).
UPDATE durably_runs SET plan_version = %(plan_version)s WHERE run_id = %(run_id)s;

-- name: wake_on_signal
-- A run about to wait for events of this name is due now if one is already there.
UPDATE durably_runs SET status = 'queued', available_at = extract(epoch FROM now())
WHERE run_id = %(run_id)s AND EXISTS (SELECT 1 FROM durably_signals
    WHERE run_id = %(run_id)s AND name = %(name)s AND consumed_by IS NULL);

-- name: wake_on_approval
-- A run about to wait for an approval requested earlier is due now if it was decided
-- meanwhile (its decision found the run still executing, so it could not make it due).
UPDATE durably_runs SET status = 'queued', available_at = extract(epoch FROM now())
WHERE run_id = %(run_id)s AND status = 'waiting_approval' AND EXISTS (SELECT 1
    FROM durably_approvals WHERE approval_id = %(approval_id)s AND status <> 'requested');

-- name: supersede_approval
-- An earlier request of the same call is void: expired if it ran out, else superseded.
UPDATE durably_approvals SET status = CASE WHEN expires_at <= extract(epoch FROM now())
    THEN 'expired' ELSE 'superseded' END
WHERE approval_id = %(approval_id)s AND status IN ('requested', 'approved');

-- name: insert_approval
-- A new approval request.
INSERT INTO durably_approvals (approval_id, run_id, step_id, kind, name, payload_json,
    input_hash, idempotency_key, plan_version, status, requested_at, expires_at)
VALUES (%(approval_id)s, %(run_id)s, %(step_id)s, %(kind)s, %(name)s, %(payload_json)s,
    %(input_hash)s, %(idempotency_key)s, %(plan_version)s, 'requested',
    extract(epoch FROM now()), %(expires_at)s);

-- name: insert_event
-- One event of the run's log (also the outbox), at a sequence its fence reserved.
INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at)
VALUES (%(run_id)s, %(sequence)s, %(type)s, %(step_id)s, %(payload_json)s,
    extract(epoch FROM now()));

-- name: insert_event_fenced
-- insert_event in a commit sent as one round: nothing unless the fence, earlier in the same
-- transaction, held; its sequence counted back from the last_sequence the fence left.
INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at)
SELECT run_id, last_sequence - %(back)s, %(type)s, %(step_id)s, %(payload_json)s, extract(epoch FROM now())
FROM durably_runs WHERE run_id = %(run_id)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s;

-- name: upsert_step_fenced
-- upsert_step in a commit sent as one round (see insert_event_fenced); settled at the
-- sequence of the commit's last event.
INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, input_hash,
    output_json, error_json, idempotency_key, attempts, settled_sequence, created_at,
    updated_at, model_call_json)
SELECT run_id, %(step_id)s, %(position)s, %(kind)s, %(name)s, %(status)s, %(input_hash)s, %(output_json)s,
    %(error_json)s, %(idempotency_key)s, %(attempts)s, CASE WHEN %(settle)s THEN last_sequence END,
    extract(epoch FROM now()), extract(epoch FROM now()), %(model_call_json)s
FROM durably_runs WHERE run_id = %(run_id)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
ON CONFLICT (run_id, step_id) DO UPDATE SET status = excluded.status,
    output_json = excluded.output_json, error_json = excluded.error_json,
    attempts = excluded.attempts, model_call_json = excluded.model_call_json,
    settled_sequence = coalesce(excluded.settled_sequence, durably_steps.settled_sequence),
    updated_at = excluded.updated_at;

-- name: commit_step
-- A step's commit as one statement (the fence, its one event and the step's new row): the
-- writes select from the fence's RETURNING, so none applies unless the lease holds. No row:
-- lost. A plain insert, not an upsert: its writer knows the step has no row yet
-- (StepWrite.new_row), and PostgreSQL writes an upsert's row speculatively, then confirms it.
WITH fence AS (
    UPDATE durably_runs SET last_sequence = last_sequence + 1,
        state_version = state_version + 1,
        lease_until = greatest(lease_until, extract(epoch FROM now()) + %(ttl)s),
        updated_at = extract(epoch FROM now())
    WHERE run_id = %(run_id)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
    RETURNING run_id, last_sequence, state_version, lease_until, cancel_requested,
        pause_requested
), event AS (
    INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at)
    SELECT run_id, last_sequence, %(type)s, %(event_step_id)s, %(payload_json)s,
        extract(epoch FROM now())
    FROM fence
), step AS (
    INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, input_hash,
        output_json, error_json, idempotency_key, attempts, settled_sequence, created_at,
        updated_at, model_call_json)
    SELECT run_id, %(step_id)s, %(position)s, %(kind)s, %(name)s, %(status)s, %(input_hash)s,
        %(output_json)s, %(error_json)s, %(idempotency_key)s, %(attempts)s,
        CASE WHEN %(settle)s THEN last_sequence END, extract(epoch FROM now()),
        extract(epoch FROM now()), %(model_call_json)s
    FROM fence
)
SELECT last_sequence, state_version, lease_until, cancel_requested, pause_requested FROM fence;

-- name: commit_at
-- A commit at the state its lease holder knows, as one statement: its one event, and any of
-- the step row, the operation's insert or update, the run's new status, a checkpoint sealed
-- at the state after %(at_state_version)s and %(at_sequence)s, the lease renewed or released.
-- No row, and nothing written, unless the lease holds, the run is still at that state and
-- the operation's row is as expected: then the full commit tells which. The run's row is
-- locked first, so it cannot move between that check and the fence. The prune cannot see
-- the checkpoint this statement inserts: it keeps %(keep)s older ones besides.
WITH held AS (
    SELECT run_id FROM durably_runs
    WHERE run_id = %(run_id)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
      AND state_version = %(at_state_version)s AND last_sequence = %(at_sequence)s
    FOR UPDATE
), inserted AS (
    INSERT INTO durably_tool_operations (tenant_id, idempotency_key, run_id, step_id,
        plan_version, tool_name, tool_version, input_hash, arguments_json, status, result_json,
        error_json, failure_category, external_operation_id, attempt, lease_owner, lease_until,
        lease_epoch, row_version, created_at, updated_at)
    SELECT %(op_tenant)s, %(op_idempotency_key)s, run_id, %(op_step_id)s, %(op_plan_version)s,
        %(op_tool)s, %(op_tool_version)s, %(op_input_hash)s, %(op_arguments_json)s,
        %(op_status)s, %(op_result_json)s, %(op_error_json)s, %(op_failure_category)s,
        %(op_external_operation_id)s, %(op_attempt)s, %(op_lease_owner)s,
        CASE WHEN %(op_held)s::boolean THEN extract(epoch FROM now()) + %(op_ttl)s
            ELSE %(op_send_deadline)s END,
        %(op_lease_epoch)s, 1, extract(epoch FROM now()), extract(epoch FROM now())
    FROM held WHERE %(op)s::text = 'insert'
    ON CONFLICT DO NOTHING
    RETURNING 1
), updated AS (
    UPDATE durably_tool_operations SET status = %(op_status)s,
        result_json = %(op_result_json)s, error_json = %(op_error_json)s,
        failure_category = %(op_failure_category)s,
        external_operation_id = coalesce(%(op_external_operation_id)s, external_operation_id),
        attempt = %(op_attempt)s, lease_owner = %(op_lease_owner)s,
        lease_until = CASE WHEN %(op_held)s::boolean THEN extract(epoch FROM now()) + %(op_ttl)s
            ELSE %(op_send_deadline)s END,
        lease_epoch = %(op_lease_epoch)s, updated_at = extract(epoch FROM now()),
        row_version = row_version + 1
    WHERE %(op)s::text = 'update' AND tenant_id = %(op_tenant)s
      AND idempotency_key = %(op_idempotency_key)s
      AND row_version = %(op_expect_row_version)s AND EXISTS (SELECT FROM held)
    RETURNING 1
), fence AS (
    UPDATE durably_runs SET last_sequence = last_sequence + 1,
        state_version = state_version + 1,
        lease_until = CASE WHEN %(release)s THEN NULL
            ELSE greatest(lease_until, extract(epoch FROM now()) + %(ttl)s) END,
        lease_owner = CASE WHEN %(release)s THEN NULL ELSE lease_owner END,
        updated_at = extract(epoch FROM now()),
        status = coalesce(%(run_status)s, status),
        status_reason = CASE WHEN %(run_status)s::text IS NULL THEN status_reason
            ELSE %(run_status_reason)s END,
        result_json = coalesce(%(run_result_json)s, result_json),
        error_json = CASE WHEN %(run_status)s::text IS NULL THEN error_json
            ELSE %(run_error_json)s END,
        waiting_for_json = CASE WHEN %(run_status)s::text IS NULL THEN waiting_for_json
            ELSE %(run_waiting_for_json)s END,
        available_at = coalesce(%(run_available_at)s,
            CASE WHEN %(release)s THEN extract(epoch FROM now()) ELSE available_at END)
    WHERE run_id IN (SELECT run_id FROM held)
      AND (%(op)s::text IS NULL OR EXISTS (SELECT FROM inserted) OR EXISTS (SELECT FROM updated))
    RETURNING run_id, last_sequence, state_version, lease_until, cancel_requested,
        pause_requested
), event AS (
    INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at)
    SELECT run_id, last_sequence, %(type)s, %(event_step_id)s, %(payload_json)s,
        extract(epoch FROM now())
    FROM fence
), step AS (
    INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, input_hash,
        output_json, error_json, idempotency_key, attempts, settled_sequence, created_at,
        updated_at, model_call_json)
    SELECT run_id, %(step_step_id)s, %(step_position)s, %(step_kind)s, %(step_name)s,
        %(step_status)s, %(step_input_hash)s, %(step_output_json)s, %(step_error_json)s,
        %(step_idempotency_key)s, %(step_attempts)s,
        CASE WHEN %(step_settle)s::boolean THEN last_sequence END, extract(epoch FROM now()),
        extract(epoch FROM now()), %(step_model_call_json)s
    FROM fence WHERE %(step_step_id)s::text IS NOT NULL
    ON CONFLICT (run_id, step_id) DO UPDATE SET status = excluded.status,
        output_json = excluded.output_json, error_json = excluded.error_json,
        attempts = excluded.attempts, model_call_json = excluded.model_call_json,
        settled_sequence = coalesce(excluded.settled_sequence, durably_steps.settled_sequence),
        updated_at = excluded.updated_at
), checkpoint AS (
    INSERT INTO durably_checkpoints (run_id, state_version, last_event_sequence,
        schema_version, payload_json, checksum, created_at)
    SELECT run_id, state_version, last_sequence, %(schema_version)s,
        %(checkpoint_json)s, %(checksum)s, extract(epoch FROM now())
    FROM fence WHERE %(checkpoint_json)s::text IS NOT NULL
), pruned AS (
    DELETE FROM durably_checkpoints WHERE %(prune)s::boolean AND run_id IN (SELECT run_id FROM fence)
      AND state_version < (SELECT min(state_version) FROM (SELECT state_version
        FROM durably_checkpoints WHERE run_id = %(run_id)s
        ORDER BY state_version DESC LIMIT %(keep)s) AS kept)
)
SELECT last_sequence, state_version, lease_until, cancel_requested, pause_requested FROM fence;

-- name: upsert_step
-- A step-ledger row; settled_sequence, once set, stays.
INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, input_hash,
    output_json, error_json, idempotency_key, attempts, settled_sequence, created_at,
    updated_at, model_call_json)
VALUES (%(run_id)s, %(step_id)s, %(position)s, %(kind)s, %(name)s, %(status)s,
    %(input_hash)s, %(output_json)s, %(error_json)s, %(idempotency_key)s, %(attempts)s,
    %(settled_sequence)s, extract(epoch FROM now()), extract(epoch FROM now()),
    %(model_call_json)s)
ON CONFLICT (run_id, step_id) DO UPDATE SET status = excluded.status,
    output_json = excluded.output_json, error_json = excluded.error_json,
    attempts = excluded.attempts, model_call_json = excluded.model_call_json,
    settled_sequence = coalesce(excluded.settled_sequence, durably_steps.settled_sequence),
    updated_at = excluded.updated_at;

-- name: insert_checkpoint
-- The run's state as of this commit.
INSERT INTO durably_checkpoints (run_id, state_version, last_event_sequence, schema_version,
    payload_json, checksum, created_at)
VALUES (%(run_id)s, %(state_version)s, %(last_event_sequence)s, %(schema_version)s,
    %(payload_json)s, %(checksum)s, extract(epoch FROM now()));

-- name: prune_checkpoints
-- All but the run's newest %(keep)s checkpoints (the event log keeps the history).
DELETE FROM durably_checkpoints WHERE run_id = %(run_id)s AND state_version < (
    SELECT min(state_version) FROM (SELECT state_version FROM durably_checkpoints
    WHERE run_id = %(run_id)s ORDER BY state_version DESC LIMIT %(keep)s) AS kept);

-- name: lock_run
-- What an operator's write checks first; the lock serialises it with the run's commits.
SELECT status, waiting_for_json, last_sequence FROM durably_runs WHERE run_id = %(run_id)s
FOR UPDATE;

-- name: insert_signal
-- An event sent to an existing, unfinished run, once per event id.
INSERT INTO durably_signals (run_id, event_id, name, payload_json, received_at)
SELECT run_id, %(event_id)s, %(name)s, %(payload_json)s, extract(epoch FROM now())
FROM durably_runs
WHERE run_id = %(run_id)s AND status NOT IN ('completed', 'failed', 'cancelled')
ON CONFLICT (run_id, event_id) DO NOTHING;

-- name: signal_known
-- Whether an event was delivered under this id already (by this statement's round or before).
SELECT 1 FROM durably_signals WHERE run_id = %(run_id)s AND event_id = %(event_id)s;

-- name: bump_run
-- Make room for an operator's event; the run is queued and due now if due.
UPDATE durably_runs SET last_sequence = last_sequence + 1, state_version = state_version + 1,
    updated_at = extract(epoch FROM now()),
    status = CASE WHEN %(due)s THEN 'queued' ELSE status END,
    available_at = CASE WHEN %(due)s THEN extract(epoch FROM now()) ELSE available_at END
WHERE run_id = %(run_id)s;

-- name: approvals
-- The run's approvals (or the one named), oldest first.
SELECT * FROM durably_approvals
WHERE run_id = %(run_id)s AND (%(approval_id)s::text IS NULL OR approval_id = %(approval_id)s)
ORDER BY requested_at;

-- name: decide_approval
-- Record a decision (or the expiry found instead).
UPDATE durably_approvals SET status = %(status)s, decided_at = extract(epoch FROM now()),
    decided_by = %(by)s, comment = %(comment)s
WHERE approval_id = %(approval_id)s
RETURNING *;

-- name: request_cancel
-- Flag a cancel; a waiting or paused run is queued, and due now unless someone holds it.
-- Compensations asked for once stay asked for (2 outranks 1).
UPDATE durably_runs SET cancel_requested = GREATEST(cancel_requested, %(cancel)s), state_version = state_version + 1,
    updated_at = extract(epoch FROM now()),
    status = CASE WHEN status IN ('waiting_external', 'waiting_approval', 'paused')
        THEN 'queued' ELSE status END,
    available_at = CASE WHEN lease_owner IS NULL OR lease_until < extract(epoch FROM now())
        THEN extract(epoch FROM now()) ELSE available_at END
WHERE run_id = %(run_id)s
RETURNING *;

-- name: lock_run_record
-- The run, locked against its own commits until this transaction ends.
SELECT * FROM durably_runs WHERE run_id = %(run_id)s
FOR UPDATE;

-- name: request_pause
-- An operator's pause request (JSON); :at_once pauses the run now, keeping what it waits for.
UPDATE durably_runs SET pause_requested = %(request)s, last_sequence = last_sequence + 1,
    state_version = state_version + 1, updated_at = extract(epoch FROM now()),
    status = CASE WHEN %(at_once)s THEN 'paused' ELSE status END,
    status_reason = CASE WHEN %(at_once)s THEN 'operator_pause' ELSE status_reason END,
    error_json = CASE WHEN %(at_once)s THEN %(request)s ELSE error_json END
WHERE run_id = %(run_id)s
RETURNING *;

-- name: withdraw_pause
-- The operator's pause is withdrawn; with :resume the operator-paused run is queued, due now.
UPDATE durably_runs SET pause_requested = NULL, last_sequence = last_sequence + 1,
    state_version = state_version + 1, updated_at = extract(epoch FROM now()),
    status = CASE WHEN %(resume)s THEN 'queued' ELSE status END,
    status_reason = CASE WHEN %(resume)s THEN NULL ELSE status_reason END,
    error_json = CASE WHEN %(resume)s THEN NULL ELSE error_json END,
    waiting_for_json = CASE WHEN %(resume)s THEN NULL ELSE waiting_for_json END,
    available_at = CASE WHEN %(resume)s THEN extract(epoch FROM now()) ELSE available_at END
WHERE run_id = %(run_id)s
RETURNING *;

-- name: steps
-- The run's step ledger, sorted into call order by the caller (as on SQLite).
SELECT * FROM durably_steps WHERE run_id = %(run_id)s;

-- name: operations
-- The run's tool operations, found through its steps' idempotency keys.
SELECT o.* FROM durably_steps s
JOIN durably_runs r ON r.run_id = s.run_id
JOIN durably_tool_operations o
  ON o.tenant_id = r.tenant_id AND o.idempotency_key = s.idempotency_key
WHERE s.run_id = %(run_id)s;

-- name: operation
-- One tool operation by its key, whichever run recorded it.
SELECT * FROM durably_tool_operations
WHERE tenant_id = %(tenant)s AND idempotency_key = %(key)s;

-- name: latest_checkpoints
-- The run's newest checkpoints.
SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = %(run_id)s
ORDER BY state_version DESC LIMIT %(limit)s;

-- name: checkpoints
-- All of the run's checkpoints, newest first.
SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = %(run_id)s
ORDER BY state_version DESC;

-- name: pending_signals
-- Events sent to the run and not consumed yet, in arrival order.
SELECT * FROM durably_signals WHERE run_id = %(run_id)s AND consumed_by IS NULL
ORDER BY received_at, event_id;

-- name: events
-- The run's events after a sequence.
SELECT * FROM durably_events WHERE run_id = %(run_id)s AND sequence > %(after)s
ORDER BY sequence;

-- name: events_after_checkpoint
-- The run's events after its newest checkpoint (all, without one): they verify the results
-- settled since.
SELECT * FROM durably_events WHERE run_id = %(run_id)s AND sequence > coalesce((
    SELECT last_event_sequence FROM durably_checkpoints WHERE run_id = %(run_id)s
    ORDER BY state_version DESC LIMIT 1), 0)
ORDER BY sequence;

-- name: next_wakeup
-- When the next claimable run of these workflows is due, with the server's clock: the first
-- in durably_runs_runnable's order, a walk that stops there, however many runs wait. A
-- held run is due when its lease runs out (see claim_batch), which a heartbeat keeps ahead;
-- one a worker of an older version holds is due since its claim: passed over.
SELECT available_at AS due, extract(epoch FROM now()) AS now
FROM durably_runs
WHERE status IN ('queued', 'running', 'reconciling', 'waiting_external', 'waiting_approval')
  AND workflow || '|' || workflow_version = ANY(%(workflows)s)
  AND (available_at > extract(epoch FROM now()) OR lease_owner IS NULL
       OR lease_until < extract(epoch FROM now()))
ORDER BY available_at, created_at LIMIT 1;

-- name: ledger_figures
-- The ledger's figures for metrics, one row per figure (and label): effects an operator must
-- settle per tool and since when, duplicates reconciliations found per tool, forks paused
-- because their replay mode blocked an effect, approvals that ran out.
SELECT 'unresolved' AS figure, tool_name AS label, count(*) AS n, min(updated_at) AS since
FROM durably_tool_operations
WHERE status IN ('unknown', 'reconciling')
   OR (status = 'executing' AND lease_until < extract(epoch FROM now()))
GROUP BY tool_name
UNION ALL
SELECT 'duplicates', payload_json::jsonb ->> 'tool',
    sum((payload_json::jsonb ->> 'duplicates')::bigint), NULL
FROM durably_events
WHERE type = 'effect_reconciled' AND (payload_json::jsonb ->> 'duplicates')::bigint > 0
GROUP BY 2
UNION ALL
SELECT 'replays_blocked', NULL, count(*), NULL FROM durably_events
WHERE type = 'run_paused' AND payload_json::jsonb ->> 'reason' = 'replay_blocked'
UNION ALL
SELECT 'approvals_expired', NULL, count(*), NULL FROM durably_approvals
WHERE status = 'expired';

-- name: undelivered
-- Events a consumer has not acknowledged, but those of the skipped runs.
SELECT * FROM durably_events e
WHERE NOT EXISTS (SELECT 1 FROM durably_inbox i
    WHERE i.consumer = %(consumer)s AND i.event_id = e.run_id || ':' || e.sequence)
  AND NOT (e.run_id = ANY(%(skip_runs)s))
ORDER BY e.created_at, e.run_id, e.sequence LIMIT %(limit)s;

-- name: acknowledge
-- A consumer processed an event (changes no row if it already had).
INSERT INTO durably_inbox (consumer, event_id, received_at)
VALUES (%(consumer)s, %(event_id)s, extract(epoch FROM now()))
ON CONFLICT (consumer, event_id) DO NOTHING;

-- name: notify
-- Wake the workers asleep on LISTEN (delivered at COMMIT).
NOTIFY durably_runnable;

-- name: bound_lock_waits
-- A new pooled connection waits %(lock_timeout)s at most for a row lock (another session's
-- open transaction), unless the URL set lock_timeout: then an outage, as SQLite's busy timeout.
SELECT set_config('lock_timeout', %(lock_timeout)s, false) WHERE current_setting('lock_timeout') = '0';

-- name: listen
-- Sleep on runs becoming claimable.
LISTEN durably_runnable;

-- name: migrations_table
-- Whether the migrations table exists.
SELECT to_regclass('durably_schema_migrations') IS NOT NULL;

-- name: migrations_table_committed
-- Whether the migrations table exists, read from the catalog's rows as of this statement:
-- to_regclass reads a cache that, after the wait for the migration lock, may not have seen
-- another migrator's commit yet. The schema by its name as it is (a regnamespace cast would
-- parse it again: "Agents" would become agents).
SELECT EXISTS (SELECT FROM pg_catalog.pg_class
    WHERE relname = 'durably_schema_migrations' AND relnamespace =
        (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = current_schema()));

-- name: schema_version
-- The newest migration applied.
SELECT max(version) FROM durably_schema_migrations;

-- name: migration_lock
-- Concurrent migrators queue here until the transaction ends.
SELECT pg_advisory_xact_lock(%(lock)s);

-- name: create_migrations_table
-- Where applied migrations are recorded.
CREATE TABLE IF NOT EXISTS durably_schema_migrations (version INTEGER PRIMARY KEY,
    name TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL);

-- name: migration_applied
-- A row if this migration was applied.
SELECT 1 FROM durably_schema_migrations WHERE version = %(version)s;

-- name: record_migration
-- This migration is applied.
INSERT INTO durably_schema_migrations (version, name, applied_at)
VALUES (%(version)s, %(name)s, extract(epoch FROM now()));
