"""Print, as JSON, the signatures of the vLLM internals ``serving_hook`` overrides or calls (run in one venv).

``tests/test_vllm_surface.py`` runs it under vLLM 0.33 (the project's venv) and 0.32 CPU (``.venv-engine``) and
compares: the hook supports a vLLM only where every entry is present and the same.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys

#: (module, qualified name) of every vLLM callable the hook overrides or calls, and classes it reads.
SURFACE = [
    ("vllm.v1.core.sched.scheduler", "Scheduler.__init__"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.add_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._preempt_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._free_blocks"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._free_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.reset_prefix_cache"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.shutdown"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.get_num_unfinished_requests"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.finish_requests"),
    ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
    ("vllm.v1.core.sched.request_queue", "FCFSRequestQueue"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots"),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.get_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool.get_new_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool._maybe_evict_cached_block"),
    ("vllm.v1.core.block_pool", "BlockPool._remove_cached_block_hashes"),
    ("vllm.v1.core.block_pool", "BlockPool.reset_prefix_cache"),
    ("vllm.v1.core.block_pool", "BlockPool.touch"),
    ("vllm.v1.core.block_pool", "BlockPool.free_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool.get_usage"),
    ("vllm.v1.core.kv_cache_utils", "get_block_hash"),
    ("vllm.v1.request", "Request.__init__"),
    ("vllm.v1.request", "RequestStatus"),
    ("vllm.config.scheduler", "SchedulerConfig.get_scheduler_cls"),
    ("vllm.distributed.kv_events", "AllBlocksCleared"),
]
#: Fields the hook reads of vLLM's KV event records (other fields may come and go).
FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
}


def describe(module: str, qualname: str) -> str:
    """A callable's signature; a class's public members (an enum's names); ``missing: ...`` when absent."""
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        return f"missing: {type(e).__name__}"
    if inspect.isclass(obj):
        members = getattr(obj, "__members__", None)
        if members is not None:
            return "enum: " + ",".join(members)
        return "class"
    try:
        # a default's repr may hold its address: not part of the signature
        return re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "callable"


def fields(module: str, name: str, wanted: tuple[str, ...]) -> str:
    """Which of ``wanted`` a record class of ``module`` declares."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        return f"missing: {type(e).__name__}"
    declared = set(getattr(cls, "__struct_fields__", ()) or getattr(cls, "__dataclass_fields__", ()))
    return "fields: " + ",".join(f if f in declared else f"missing {f}" for f in wanted)


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm

    surface = {f"{m}:{q}": describe(m, q) for m, q in SURFACE}
    surface.update({f"vllm.distributed.kv_events:{n}": fields("vllm.distributed.kv_events", n, f)
                    for n, f in FIELDS.items()})
    json.dump({"version": vllm.__version__, "surface": surface}, sys.stdout)


if __name__ == "__main__":
    main()
