"""The field's scheduling ideas as policies on kvpilot's decision interface.

Each baseline is named after its idea and source ("shortest predicted job
first, after vLLM-LTR"), with the mechanism and what was simplified in its
module docstring. Names map to ``module:factory`` and are imported on first use,
so serving with one policy never imports the others.
"""

from __future__ import annotations

BASELINES: dict[str, str] = {
    "vllm-priority": "policy.baselines.priority:VllmPriorityPolicy",
    "sjf-predicted": "policy.baselines.sjf:ShortestPredictedFirstPolicy",
    "sortedrl": "policy.baselines.sortedrl:SortedRLPolicy",
    "rollpacker": "policy.baselines.rollpacker:TailBatchingPolicy",
    "heddle": "policy.baselines.heddle:ProgressivePriorityPolicy",
    "rolloutpipe": "policy.baselines.rolloutpipe:FrontierGroupPolicy",
    "seer": "policy.baselines.seer:LongestGroupFirstPolicy",
    "continuum": "policy.baselines.continuum:ToolPauseTTLPolicy",
    "infercept": "policy.baselines.infercept:InterceptWastePolicy",
    "infercept-offload": "policy.baselines.infercept:InterceptWasteOffloadPolicy",
    "working-set": "policy.baselines.working_set:WorkingSetAdmissionPolicy",
    "working-set-offload": "policy.baselines.working_set:WorkingSetOffloadPolicy",
    "kvflow": "policy.baselines.kvflow:NextUseEvictionPolicy",
    "marconi": "policy.baselines.marconi:FlopsAwareEvictionPolicy",
    "lrb": "policy.baselines.lrb:SampledNextUseEvictionPolicy",
    "oracle": "policy.baselines.oracle:HindsightOraclePolicy",
    "vllm-offload": "policy.baselines.offload_tier:VllmOffloadPolicy",
    "continuum-offload": "policy.baselines.offload_tier:ContinuumOffloadPolicy",
    "kvflow-offload": "policy.baselines.offload_tier:NextUseOffloadPolicy",
    "oracle-offload": "policy.baselines.offload_tier:HindsightOracleOffloadPolicy",
    "version-aware": "policy.baselines.version_aware:VersionAwareEvictionPolicy",
}
