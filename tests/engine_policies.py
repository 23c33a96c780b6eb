"""Scheduler classes for the real-server tests: ``--scheduler-cls tests.engine_policies.<Name>`` (the server runs
with the repository on its ``PYTHONPATH``). Each is the kvpilot hook with one test policy; the hook's
configuration (telemetry, ``KVPILOT_MAX_HOLD_S``) still comes from the environment."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from policy.interface import AdmissionDecision, CandidateRequest, EngineState, Policy
from serving_hook import KVPilotScheduler, with_policy


class HoldOrRaise(Policy):
    """Admission by session id: raises while any waiting request's session starts with ``raise`` (the hook must
    fall back to vLLM's order, count it and serve on), and holds back every request whose session starts with
    ``hold`` (only the hook's starvation bound, ``KVPILOT_MAX_HOLD_S``, lets it in)."""

    name = "test-hold-or-raise"
    version = "1"
    uses_admission = True

    def admit(self, waiting: Sequence[CandidateRequest], state: EngineState) -> Optional[AdmissionDecision]:
        sessions = [(c.request_id, c.meta.session_id or "") for c in waiting]
        if any(s.startswith("raise") for _, s in sessions):
            raise RuntimeError("test policy failure")
        return AdmissionDecision(hold={rid for rid, s in sessions if s.startswith("hold")})


HoldOrRaiseScheduler = with_policy(KVPilotScheduler, HoldOrRaise, name="HoldOrRaiseScheduler")
