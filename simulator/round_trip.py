"""The client's round trip: seconds from an engine finishing a request to the client's next request of that
trajectory (the response's way back, the client's own work, the next request's way in), added to every follow-up.

One value, or draws from a measured distribution: the quantiles ``kvpilot calibrate --workload`` records in a fitted
preset (:attr:`simulator.fitted_cost.FittedCost.round_trip_quantiles_s`). Each run draws from its own seeded
generator, so a run is deterministic.
"""

from __future__ import annotations

import random

import numpy as np

__all__ = ["RoundTrip"]


class RoundTrip:
    """Draws of the round trip: ``quantiles`` evenly spaced over [0, 1] (one value: that value every time)."""

    def __init__(self, quantiles: tuple[float, ...] = (0.0,), seed: int = 0) -> None:
        if not quantiles or any(not v >= 0 for v in quantiles) or list(quantiles) != sorted(quantiles):
            raise ValueError(f"round-trip quantiles must be non-decreasing numbers >= 0, got {quantiles!r}")
        self.quantiles = tuple(float(v) for v in quantiles)
        self._levels = np.linspace(0.0, 1.0, len(self.quantiles))
        self._rng = random.Random(seed)

    def __bool__(self) -> bool:
        """False where every follow-up comes at once (the simulator then takes no detour)."""
        return self.quantiles[-1] > 0

    @property
    def median_s(self) -> float:
        return float(np.interp(0.5, self._levels, self.quantiles))

    def draw(self) -> float:
        """One follow-up's round trip, in seconds."""
        if len(self.quantiles) == 1:
            return self.quantiles[0]
        return float(np.interp(self._rng.random(), self._levels, self.quantiles))
