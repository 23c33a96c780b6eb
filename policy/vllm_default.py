"""vLLM's own behaviour, as a kvpilot policy.

FCFS admission (vLLM's waiting order, nothing held back), tail-of-running
preemption (the last request in vLLM's running list) and LRU eviction (no block
is protected or demoted).

By default the policy declares that it uses no lever, so the serving hook
short-circuits and vLLM runs untouched (the zero-cost path). With
``explicit=True`` it declares every lever and answers each question explicitly
with vLLM's choice; the hook then goes through its full decision path. Both
must schedule exactly like stock vLLM (``tests/test_hook_identity.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from policy.interface import (
    AdmissionDecision,
    CachedPrefix,
    CandidateRequest,
    EngineState,
    Policy,
    PreemptionDecision,
    RetentionDecision,
)


class VllmDefaultPolicy(Policy):
    name = "vllm-default"
    version = "1"

    def __init__(self, explicit: bool = False) -> None:
        self.explicit = bool(explicit)
        if self.explicit:
            self.uses_admission = True
            self.uses_preemption = True
            self.uses_retention = True
            self.uses_events = True

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        # FCFS: keep the queue's order (vLLM puts preempted requests back in front).
        return AdmissionDecision(order=[c.request_id for c in waiting])

    def preempt(self, running: Sequence[CandidateRequest], state: EngineState) -> Optional[PreemptionDecision]:
        return PreemptionDecision(victim=running[-1].request_id if running else None)

    def retain(self, prefixes: Sequence[CachedPrefix], state: EngineState) -> Optional[RetentionDecision]:
        return RetentionDecision()  # LRU: keep everything as vLLM left it
