"""Runnable example agents and the small external service their tools call."""
