"""The CPU offload tier as a baseline: vLLM's native KV offloading, alone and under Continuum and KVFlow.

**Idea and source.** vLLM 0.33's native offloading (``--kv-offloading-size``, backend ``native``: the
``OffloadingConnector`` with its CPU manager) writes every full block a request computes to host memory
as it is computed, keeps those blocks in an LRU of the given size, and loads a returning prefix back over
PCIe instead of recomputing it. LMCache and the papers below use the same tier.

**Mechanism as implemented.** These policies set :attr:`policy.interface.Policy.uses_offload`: the
simulator builds their engines with vLLM's real connector (scheduler side) and prices its transfers
(:mod:`simulator.offload`); serving runs them with ``--kv-offloading-size``. Otherwise they decide as
their namesakes do:

* ``vllm-offload``: vLLM's defaults everywhere (LRU on the GPU, LRU on the CPU): vLLM as shipped with
  offloading on;
* ``continuum-offload``: Continuum's TTL pins (:mod:`policy.baselines.continuum`); a paused session it
  does not pin, or whose pin ends, comes back from the tier instead of being recomputed;
* ``kvflow-offload``: KVFlow's next-use eviction (:mod:`policy.baselines.kvflow`) with the CPU tier that
  its paper pairs it with.
* ``oracle-offload``: the hindsight oracle (:mod:`policy.baselines.oracle`: true lengths for admission,
  Belady on the GPU, pins for known returns) deciding the tier too: Belady's next use orders the tier's
  evictions, and a store whose owner returns later than everything the full tier holds is skipped
  (``Policy.evict_host`` through :mod:`serving_hook.host_tier`). The upper reference for the tier's lever. What
  it cannot do through vLLM's seam: decline a store while the tier has room, or drop a session's host copy
  before room is needed (see :mod:`serving_hook.host_tier`).

**Simplified.** KVFlow prefetches a prefix from CPU ahead of its next use; vLLM's connector loads it when
its request is admitted (asynchronously: only that request waits). Continuum's own system keeps its pins
on the GPU and uses no tier; the tier is added to show what each lever adds to it.
"""

from __future__ import annotations

from policy.baselines.continuum import ToolPauseTTLPolicy
from policy.baselines.kvflow import NextUseEvictionPolicy
from policy.baselines.oracle import HindsightOraclePolicy
from policy.interface import Policy


class VllmOffloadPolicy(Policy):
    """vLLM's defaults with its native CPU offload tier."""

    name = "vllm-offload"
    version = "1"
    uses_offload = True


class ContinuumOffloadPolicy(ToolPauseTTLPolicy):
    """Continuum's TTL pins, over the CPU offload tier."""

    name = "continuum-offload"
    uses_offload = True


class NextUseOffloadPolicy(NextUseEvictionPolicy):
    """KVFlow's next-use eviction, over the CPU offload tier."""

    name = "kvflow-offload"
    uses_offload = True


class HindsightOracleOffloadPolicy(HindsightOraclePolicy):
    """The hindsight oracle over both tiers: Belady on the GPU and on the CPU offload tier (with bypass)."""

    name = "oracle-offload"
    uses_offload = True
    uses_host_eviction = True
