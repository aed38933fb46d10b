"""The tool operation protocol: one effect driven through the ledger, phase by phase."""

from durably.effect.compensation import compensate, undoable
from durably.effect.protocol import Effect
from durably.effect.recording import classify

__all__ = ["Effect", "classify", "compensate", "undoable"]
