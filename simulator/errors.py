"""The simulator's one error: a bad configuration or workload, found before anything runs, or a stalled run."""

from __future__ import annotations

__all__ = ["SimulationError"]


class SimulationError(ValueError):
    """A bad simulation configuration or workload (raised before simulating) or a stalled run."""
