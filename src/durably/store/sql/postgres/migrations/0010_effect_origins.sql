-- A fork's copy of a call the source run made (or copied in turn) names the operation that
-- made the effect: every run holding a record of one effect undoes it under one key, so it
-- is undone once, whichever run goes first. NULL: the run made the effect itself.

ALTER TABLE durably_tool_operations ADD COLUMN origin_key TEXT;
