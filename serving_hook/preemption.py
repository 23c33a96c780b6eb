"""Preemption lever: which running request loses its KV when blocks run out.

How it reaches vLLM (line numbers: ``vllm/v1/core/sched/scheduler.py`` of vllm 0.33.0): vLLM picks the
victim inline when ``allocate_slots`` (L914) fails for a running request: ``self.running[-1]`` (L938),
then ``self.running.pop()`` (L970) and ``_preempt_request`` (L1799). The hook wraps the instance's
``kv_cache_manager.allocate_slots`` (the scheduler's ``_kvp_allocate_slots``): when it returns ``None``
for a RUNNING request (the only case that leads to preemption), the hook first releases retention pins
(pressure release, then retries: :mod:`serving_hook.retention`), and if that is not enough asks the
policy for a victim among ``running[i:]`` (:meth:`PreemptionLever.choose_victim`; ``i`` = the request
being allocated; requests before it are already scheduled this step and vLLM's FCFS path cannot undo
that) and moves it to the end of ``self.running`` so vLLM's own ``pop()`` takes it. Each further
preemption in the same step asks again. Nothing else in vLLM's loop changes.
"""

from __future__ import annotations

from typing import Any

from policy.interface import PreemptionDecision
from serving_hook.lever import Lever


class PreemptionLever(Lever):
    """Moves the policy's victim to the end of vLLM's running list, where vLLM's ``pop()`` takes it."""

    def choose_victim(self, request: Any) -> None:
        """vLLM is about to preempt for ``request``: let the policy choose the victim among ``running[i:]``."""
        running = self.sched.running
        try:
            i = running.index(request)
        except ValueError:
            return
        pool = running[i:]
        if len(pool) <= 1:
            return  # vLLM preempts the request itself: there is no other choice
        now = self.sched.kvpilot_clock()
        cands = self.tr.offer(pool, now, self.policy.lazy_candidates)
        dec = self.guard.decide("preempt", self.policy.preempt, PreemptionDecision, cands, self.tr.state(now))
        if dec is None:
            return
        victim = None
        idx = -1
        if dec.victim is not None:
            for j, r in enumerate(pool):
                if r.request_id == dec.victim:
                    victim, idx = r, j
                    break
        if self.rows.log_decisions:
            chosen = idx if victim is not None else len(pool) - 1
            self.rows.request_decision("preempt", now, cands, dec.predictions, chosen, dec.propensity)
        if victim is None or victim is running[-1]:
            return
        running.remove(victim)
        running.append(victim)
        self.stats.policy_victims += 1
