"""Model calls as a record: asked once, replayed on recovery, shown with their input, answer,
usage and latency, charged to the budget on every execution, and linked to the effects their
answers asked for."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import durably
from durably import RunStatus
from tests.conftest import fetch_sql

MakeApp = Callable[..., durably.App]


def chat_answer(text: str, tokens: tuple[int, int], tool_calls: list[str]) -> dict[str, Any]:
    """An answer shaped as Chat Completions gives it."""
    return {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [
                        {"id": i, "type": "function", "function": {"name": "refund"}}
                        for i in tool_calls
                    ],
                }
            }
        ],
        "usage": {"prompt_tokens": tokens[0], "completion_tokens": tokens[1]},
    }


def test_a_model_call_is_recorded_once_and_its_tool_calls_name_their_effects(
    make_app: MakeApp, database_url: str
) -> None:
    app = make_app()
    asked = Counter[str]()
    refunded = Counter[str]()

    @app.model("gpt-test", profile="support-v3")
    def plan(messages: list[dict[str, str]]) -> dict[str, Any]:
        asked[messages[-1]["content"]] += 1
        return chat_answer("refunding", (120, 30), ["call_a", "call_b"])

    @app.tool(idempotent=True)
    def refund(order: str) -> str:
        refunded[order] += 1
        return f"refunded {order}"

    @app.workflow()
    async def agent(order: str) -> Any:
        answer = await plan([{"role": "user", "content": f"refund {order}"}])
        ids = [c["id"] for c in answer["choices"][0]["message"]["tool_calls"]]
        done = [await refund.with_step_id(i)(f"{order}-{i}") for i in ids]
        approved = await durably.wait_for_event("checked")
        return [*done, approved]

    run = app.run(agent, "o1")
    assert run.status is RunStatus.WAITING_EXTERNAL
    app.send_event(run.run_id, "checked", "ok")
    assert app.worker().run(until_idle=True) == 1  # replays the model call, asks nothing
    assert app.get_run(run.run_id).status is RunStatus.COMPLETED
    assert asked == Counter({"refund o1": 1})
    assert refunded == Counter({"o1-call_a": 1, "o1-call_b": 1})

    doc = app.describe(run.run_id)
    [call] = doc["model_calls"]
    assert call["model_call_id"].startswith("mc_")
    assert call["step_id"] == "plan#1"
    assert (call["model"], call["model_profile"]) == ("gpt-test", "support-v3")
    assert call["input"] == {"messages": [{"role": "user", "content": "refund o1"}]}
    assert call["output"] == chat_answer("refunding", (120, 30), ["call_a", "call_b"])
    assert call["usage"] == {"input_tokens": 120, "output_tokens": 30, "total_tokens": 150}
    assert call["latency_ms"] >= 0
    assert call["tool_call_ids"] == ["call_a", "call_b"]
    steps = {s["step_id"]: s for s in doc["steps"]}
    assert call["input_hash"] == steps["plan#1"]["input_hash"]
    assert {e["step_id"]: e["model_call_id"] for e in doc["effects"]} == {
        "call_a": call["model_call_id"],
        "call_b": call["model_call_id"],
    }
    # The event log names the call too: it is the audit record.
    [payload] = [e.payload for e in app.events(run.run_id) if e.type == "step_succeeded"]
    assert payload["model_call_id"] == call["model_call_id"]
    # What the database holds, not only what it reports.
    [(stored,)] = fetch_sql(
        database_url, "SELECT model_call_json FROM durably_steps WHERE step_id = 'plan#1'"
    )
    assert '"model":"gpt-test"' in stored


def test_recorded_usage_is_charged_again_on_replay(make_app: MakeApp) -> None:
    """The budget is charged from the record: a run resumed after its first call still
    counts that call's tokens, and pauses on the second although each fits alone."""
    app = make_app()
    asked = Counter[int]()

    @app.model("gpt-test")
    def think(turn: int) -> dict[str, Any]:
        asked[turn] += 1
        return {"text": f"turn {turn}", "usage": {"total_tokens": 60}}

    @app.workflow(budget=durably.Budget(max_tokens=100))
    async def agent() -> str:
        await think(1)
        await durably.wait_for_event("next")
        await think(2)
        return "done"

    run = app.run(agent)
    assert run.status is RunStatus.WAITING_EXTERNAL
    app.send_event(run.run_id, "next", None)
    app.worker().run(until_idle=True)
    paused = app.get_run(run.run_id)
    assert paused.status is RunStatus.PAUSED
    assert paused.status_reason == "budget_exceeded"
    assert asked == Counter({1: 1, 2: 1})  # the second call was made and recorded, once
    assert [c["step_id"] for c in app.describe(run.run_id)["model_calls"]] == [
        "think#1",
        "think#2",
    ]
    assert app.checkpoints(run.run_id)[0]["budget_snapshot"]["tokens"] == 120


def test_call_model_hashes_the_canonical_input_and_keeps_it(make_app: MakeApp) -> None:
    """A framework stamps new ids on every execution: the canonical form leaves them out,
    so two executions of one history have one input hash, and that form is what is kept."""
    app = make_app()
    stamps = itertools.count()

    def respond(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return {"text": "hi", "usage": {"input_tokens": 5, "output_tokens": 1}}

    def canonical(messages: list[dict[str, Any]]) -> Any:
        return [m["content"] for m in messages]

    @app.workflow()
    async def agent() -> Any:
        messages = [{"id": f"msg_{next(stamps)}", "content": "hello"}]
        return await app.call_model("fake#1|x", respond, messages, canonical=canonical, profile="p")

    first = app.run(agent)
    second = app.run(agent)
    assert first.status is second.status is RunStatus.COMPLETED
    calls = [app.describe(r.run_id)["model_calls"][0] for r in (first, second)]
    assert calls[0]["input_hash"] == calls[1]["input_hash"]
    assert calls[0]["input"] == {"canonical": ["hello"]}
    assert calls[0]["name"] == "model:fake_1_x"  # '#' and '|' delimit step ids and keys
    assert calls[0]["model"] == "fake#1|x"
    assert calls[0]["usage"] == {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}
    assert calls[0]["model_call_id"] != calls[1]["model_call_id"]


def test_an_input_over_the_limit_keeps_its_size_and_a_broken_reader_loses_nothing(
    make_app: MakeApp,
) -> None:
    app = make_app(max_payload_bytes=2_000)

    def broken(answer: Any) -> dict[str, float]:
        raise KeyError("usage")

    @app.model("gpt-test", usage=broken)
    def summarize(text: str) -> str:
        return text[:10]

    @app.workflow()
    async def agent() -> str:
        return await summarize("x" * 5_000)

    run = app.run(agent)
    assert run.status is RunStatus.COMPLETED
    [call] = app.describe(run.run_id)["model_calls"]
    assert call["input"] is None
    assert call["input_bytes"] > 5_000
    assert call["output"] == "x" * 10
    assert call["usage"] == {}


def test_a_bad_model_name_is_refused_and_a_broken_usage_answer_loses_nothing(
    make_app: MakeApp,
) -> None:
    app = make_app()
    for bad in ("", "gpt\x1b[2J", None, 42):
        with pytest.raises(durably.InvalidInput):
            app.model(bad)  # type: ignore[arg-type]
    with pytest.raises(durably.InvalidInput):
        app.model("gpt-test", profile="v1\n")
    asked = Counter[int]()

    @app.model("gpt-test", usage=lambda answer: ["not", "a", "mapping"])  # type: ignore[arg-type,return-value]
    def think(turn: int) -> dict[str, Any]:
        asked[turn] += 1
        return {"text": "ok"}

    @app.workflow()
    async def agent() -> Any:
        first = await think(1)
        await durably.wait_for_event("go")
        return first

    run = app.run(agent)
    assert run.status is RunStatus.WAITING_EXTERNAL, run.error
    app.send_event(run.run_id, "go", None)
    app.worker().run(until_idle=True)
    assert app.get_run(run.run_id).result == {"text": "ok"}
    assert asked == Counter({1: 1})  # recorded although its usage could not be read
    assert app.describe(run.run_id)["model_calls"][0]["usage"] == {}
