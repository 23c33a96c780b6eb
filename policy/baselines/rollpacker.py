"""Tail batching, after RollPacker.

**Idea and source.** RollPacker (NSDI'26, built on ROLL) attacks the long tail
of synchronous RL rollout steps. Each step launches more work than it trains on
(eta x P prompts x eta x R samples, eta = 1.25 in its artifact: 80 x 5 launched
for 64 x 4 kept) and keeps the first P x R completions, so a step ends when its
short responses are done instead of waiting for its longest one. Prompts that
were cut go to a long-prompt queue; once that queue holds P prompts they run
together as a dedicated *long round*, where long responses batch with each
other instead of stretching every step. It reports 2.03-2.56x end-to-end
training time vs veRL.

**Mechanism as implemented.** This is a *driver* baseline: the lever is the RL
step, not the engine's queue. The policy itself is FCFS (vLLM's own order, no
lever used, so the serving hook short-circuits); it carries
:attr:`TailBatchingPolicy.step_driver`, a :class:`TailBatchingSpec` that
switches :func:`simulator.simulation.run_simulation`'s synchronous-step driver
into tail-batching mode. With a fixed workload, each workload step is taken as
the *launched* (over-provisioned) prompts: a step of L prompt groups of G
samples each keeps

* P = ceil(L / eta) prompts, and per kept prompt R = ceil(G / eta) samples.

All L x G trajectories start together. A prompt is *complete* when R of its
samples have finished (verification included); its remaining samples are
aborted at once (the first R are kept). When P prompts are complete, the step
ends: every unfinished trajectory is aborted, and the prompts that were not
complete are *cut*, appended (in workload order) to the long-prompt queue, and
their trajectories that had already finished are dropped from the step. So a
normal step trains on exactly P x R trajectories (= L x G / eta^2 when both
divide).

After a step ends, if the queue holds at least ``long_round_prompts`` prompts
(default: P of the workload's first step), the next round is a long round: the
first ``long_round_prompts`` queued prompts are re-submitted from scratch (all
G samples of each, with new request ids ``<request_id>#long<k>``; prompt
blocks still cached hit the cache) and run to completion, without a cut, as a
new RL round numbered after the workload's last step. When the workload's
steps are exhausted, prompts left in the queue run in final long round(s) of
up to ``long_round_prompts`` prompts (``flush_at_end=False`` drops them
instead).

**Simplified.** RollPacker also re-balances parallelism and reward computation
between the rounds and streams training on the kept samples; here only the
rollout side is simulated. It decides per prompt from its samples' lengths;
here "cut" means "not complete when the quota was met", and a cut prompt's
earlier responses are discarded rather than reused. Over-provisioning is read
from the workload (it is the launched work), so P and R are derived, not set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policy.vllm_default import VllmDefaultPolicy


@dataclass(frozen=True)
class TailBatchingSpec:
    """What the simulator's RL driver needs to run tail batching (see the module docstring)."""

    eta: float = 1.25
    long_round_prompts: int | None = None
    flush_at_end: bool = True
    kind: str = "tail-batching"

    def __post_init__(self) -> None:
        if not (isinstance(self.eta, (int, float)) and math.isfinite(self.eta) and self.eta >= 1.0):
            raise ValueError(f"rollpacker: eta must be a number >= 1, got {self.eta!r}")
        if self.long_round_prompts is not None and (
                not isinstance(self.long_round_prompts, int) or self.long_round_prompts < 1):
            raise ValueError(f"rollpacker: long_round_prompts must be an integer >= 1, got {self.long_round_prompts!r}")

    def kept(self, launched: int) -> int:
        """Of ``launched`` prompts (or samples), how many are kept: ceil(launched / eta), at least 1."""
        return max(1, min(launched, math.ceil(launched / self.eta - 1e-9)))


class TailBatchingPolicy(VllmDefaultPolicy):
    """FCFS engine policy whose ``step_driver`` switches the simulated RL driver to tail batching."""

    name = "rollpacker"
    version = "1"

    def __init__(self, eta: float = 1.25, long_round_prompts: int | None = None, flush_at_end: bool = True) -> None:
        super().__init__(explicit=False)
        self.step_driver = TailBatchingSpec(eta=eta, long_round_prompts=long_round_prompts,
                                            flush_at_end=bool(flush_at_end))
        self.eta = self.step_driver.eta
