-- A model call's record, on the step that made it (JSON; NULL for other steps): its
-- model_call_id, model and profile, the input it was given (what its input hash covers),
-- token usage, latency and the tool call ids its answer asked for. The answer itself is
-- the step's output_json.

ALTER TABLE durably_steps ADD COLUMN model_call_json TEXT;
