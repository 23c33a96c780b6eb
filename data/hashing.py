"""Deterministic 64-bit mixing shared by the workload generator and the simulator's token expansion; vLLM's KV
block size."""

from __future__ import annotations

import numpy as np

#: Tokens per KV block in the vLLM engines kvpilot drives (the simulator's, and the hit arithmetic of replays).
VLLM_BLOCK_SIZE = 16


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (a bijection with good avalanche)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
