"""What an App can run: its workflows, steps and tools by name (and tools' compensations)."""

from __future__ import annotations

import inspect
from typing import Any, Literal, overload

from durably.definitions import StepDef, ToolDef, WorkflowDef, check_name
from durably.errors import ConfigurationError
from durably.reconcile import Operation


class Registry:
    """The definitions registered through ``@app.workflow/step/tool``, found by name."""

    def __init__(self) -> None:
        self._workflows: dict[str, WorkflowDef] = {}
        self._steps: dict[str, StepDef] = {}
        self._tools: dict[str, ToolDef] = {}
        self._compensations: dict[str, ToolDef] = {}

    def add_workflow(self, definition: WorkflowDef) -> None:
        check_name("workflow", definition.name, self._workflows)
        self._workflows[definition.name] = definition

    def add_step(self, definition: StepDef) -> None:
        check_name("step", definition.name, {**self._steps, **self._tools})
        self._steps[definition.name] = definition

    def add_tool(self, definition: ToolDef) -> None:
        check_name("tool", definition.name, {**self._steps, **self._tools})
        self._tools[definition.name] = definition

    def workflow_def(self, name: str) -> WorkflowDef:
        try:
            return self._workflows[name]
        except KeyError:
            raise ConfigurationError(
                f"no workflow named {name!r} is registered in this app (known: "
                f"{sorted(self._workflows)})"
            ) from None

    @overload
    def tool_def(self, name: str) -> ToolDef: ...
    @overload
    def tool_def(self, name: str, *, missing_ok: Literal[True]) -> ToolDef | None: ...
    def tool_def(self, name: str, *, missing_ok: bool = False) -> ToolDef | None:
        tool = self._tools.get(name)
        if tool is None and not missing_ok:
            raise ConfigurationError(f"no tool named {name!r} is registered")
        return tool

    def compensation_def(self, tool: ToolDef) -> ToolDef:
        """The compensation of ``tool``, itself an effect recorded in the ledger."""
        if tool.name not in self._compensations:
            undo = tool.compensate
            assert undo is not None

            def compensate(operation: dict[str, Any]) -> Any:
                return undo(Operation(**operation))

            self._compensations[tool.name] = ToolDef(
                name=f"{tool.name}.compensate",
                fn=compensate,
                version=tool.version,
                retry=tool.retry,
                signature=inspect.signature(compensate),
                idempotent=tool.idempotent,
                classify=tool.classify,
            )
        return self._compensations[tool.name]

    @property
    def tool_names(self) -> list[str]:
        """The registered tools' names."""
        return sorted(self._tools)

    @property
    def versions(self) -> list[str]:
        """The registered workflows as ``"<name>|<version>"``: what this code can run."""
        return sorted(
            f"{w.name}|{version}"
            for w in self._workflows.values()
            for version in (w.version, *w.migrates_from)
        )
