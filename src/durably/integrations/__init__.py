"""Agent frameworks inside durably workflows; each module needs its framework's extra."""
