"""Minimal CPU engine around vLLM's real v1 scheduler (no model, no GPU).

* :func:`tiny_model_dir` writes a 2-layer ``LlamaForCausalLM`` ``config.json``
  (hidden size 64, no weights, no tokenizer) under a cache directory.
* :func:`make_vllm_config` builds a CPU ``VllmConfig`` on it.
* :func:`make_kv_cache_config` builds a ``KVCacheConfig`` with ``num_blocks``
  blocks of one full-attention group.
* :func:`make_scheduler` constructs a scheduler class (stock vLLM or the
  kvpilot hook) with exactly vLLM's constructor arguments.
* :func:`make_request` builds a ``vllm.v1.request.Request`` with block hashes.
* :class:`Engine` is one simulated replica's scheduler as :mod:`simulator.replica`
  steps it: ``add`` / ``schedule`` / ``update`` (with the fake runner's tokens) /
  ``abort``, timing the calls into vLLM.
* With ``offload_blocks`` > 0, :func:`make_vllm_config` turns on vLLM's native CPU KV offloading
  (``--kv-offloading-size``, backend ``native``: the ``OffloadingConnector``) sized to that many blocks;
  :func:`transfer_jobs` reads a step's transfer jobs from its scheduler output and :func:`connector_output`
  builds the worker side's report of finished ones (:mod:`simulator.offload` plays that worker).
* :func:`prompt_block_hashes` and :func:`vllm_block_hashes` give vLLM's block
  hashes of a request's prompt (what the routers see), :func:`vllm_envs_cached`
  reads vLLM's environment once for a run.

Tests and benchmarks that step a scheduler by hand use :mod:`simulator.fake_runner`.

Every call of the simulator into vLLM is in this module (its fake runner,
:mod:`simulator.runner`, only reads the progress of vLLM's requests, as a model
runner does). Importing this module silences the start-up warnings of vLLM and
torch that every simulator process printed and that say nothing about a
simulation (:data:`START_UP_NOISE`); it imports no vLLM itself, so it can do so
first.

The simulator (:mod:`simulator.replica`, :mod:`simulator.runner`) builds on this module; keep its functions stable.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

from serving_hook.events import hash_to_int64, hashes_to_int64

BLOCK_SIZE = 16
VOCAB_SIZE = 32000
MAX_MODEL_LEN = 16384
EOS_TOKEN_ID = 2  # the tiny model's eos id; workload token ids are never below 3

_NO_KERNELS = "Failed to import from vllm._C: ModuleNotFoundError(\"No module named 'vllm._C'\")"
_NO_AVX2_KERNELS = "Failed to import from vllm._C_AVX2: ModuleNotFoundError(\"No module named 'vllm._C_AVX2'\")"

#: Start-up warnings dropped, by logger: the start of each message. The simulated engine is a GPU one run on
#: the CPU without a model, so none of them applies:
#:
#: * vLLM's CPU platform advises 32-token blocks (the simulated engine keeps GPU vLLM's 16 on purpose, and the
#:   CPU runs no attention kernel; printed once per engine, it flooded every run) and resets the SSM cache
#:   dtype of a mamba backend the tiny Llama has none of, and wants triton-cpu for kernels it never runs;
#:   it (or, with no target device set, vLLM's generic platform) misses the CPU kernels (``vllm._C``), which
#:   nothing here calls. Only the missing module is dropped: any other failure to load them is still shown.
#: * torch, imported by vLLM, warns of deprecations inside its own modules, and of no CUDA runtime (none is used).
START_UP_NOISE: dict[str, tuple[str, ...]] = {
    "vllm.platforms.cpu": (
        "CPU backend prefers block_size",
        _NO_AVX2_KERNELS,
        "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'.",
        "Triton is not installed. triton-cpu is expected on x86 CPUs.",  # no kernel runs
        _NO_KERNELS,
    ),
    "vllm.platforms.interface": (_NO_KERNELS,),  # without VLLM_TARGET_DEVICE=cpu
    "vllm.config.vllm": ("Model Runner V2 requires Triton",),  # no model runner runs
    "torch._opaque_base": ("torch._opaque_base is deprecated",),
    "torch._library.opaque_object": ("register_opaque_type is deprecated", "typ='value' is deprecated"),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    # once per replica built with the CPU offload tier
    "vllm.distributed.kv_transfer.kv_connector.v1.base": ("Initializing KVConnectorBase_V1",),
    # the tier's cache policy is kvpilot's own (serving_hook.host_tier), loaded through vLLM's out-of-tree seam on
    # purpose: vLLM's note that the seam is experimental is for whoever chose it, once per process
    "vllm.v1.kv_offload.cpu.policies.factory": ("Loading out-of-tree cache policy",),
}

_TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    # Large, so that max_model_len can fit a workload's longest request (Mooncake prompts reach ~190k tokens).
    "max_position_embeddings": 1 << 21,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def cache_dir() -> Path:
    root = os.environ.get("KVPILOT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvpilot")
    return Path(root)


def tiny_model_dir(root: Optional[os.PathLike] = None) -> str:
    """Create (once) and return a folder holding only the tiny model's config.json."""
    d = Path(root) if root is not None else cache_dir() / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    cfg = d / "config.json"
    text = json.dumps(_TINY_CONFIG, indent=1, sort_keys=True)
    if not cfg.exists() or cfg.read_text() != text:
        tmp = d / f"config.json.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, cfg)
    return str(d)


class StartUpNoise(logging.Filter):
    """Drops one logger's records whose message starts with one of ``messages`` (see :data:`START_UP_NOISE`)."""

    def __init__(self, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.messages)


def _silence_start_up_noise() -> None:
    """Install the :class:`StartUpNoise` filters, once per process, before vLLM (and torch) are imported."""
    for name, messages in START_UP_NOISE.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, StartUpNoise) for f in log.filters):
            log.addFilter(StartUpNoise(messages))


_silence_start_up_noise()


def make_vllm_config(
    model_dir: Optional[str] = None,
    *,
    num_blocks: int = 1024,
    block_size: int = BLOCK_SIZE,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = MAX_MODEL_LEN,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    scheduler_cls: Any = None,
    enable_kv_cache_events: bool = False,
    policy: str = "fcfs",
    offload_blocks: int = 0,
    host_policy: bool = False,
):
    """A CPU ``VllmConfig`` for the tiny model (cheap after the first call).

    ``offload_blocks`` > 0: vLLM's native CPU offloading with room for that many blocks (vLLM sizes the tier
    in bytes; the tiny model's bytes per block convert it, so the tier holds exactly that many blocks).
    ``host_policy``: the tier's cache policy is kvpilot's (:mod:`serving_hook.host_tier`, loaded by vLLM from
    the connector's ``cache_policy_module_path``), else vLLM's LRU.
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    from serving_hook.offload import block_bytes

    model_dir = model_dir or tiny_model_dir()
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        generation_config="vllm",
        max_model_len=max_model_len,
        dtype="float32",
        seed=0,
    )
    sched_kwargs: dict[str, Any] = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        is_encoder_decoder=False,
        policy=policy,
    )
    if scheduler_cls is not None:
        sched_kwargs["scheduler_cls"] = scheduler_cls
    scheduler_config = SchedulerConfig(**sched_kwargs)
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
        kv_offloading_size=offload_blocks * block_bytes(make_kv_cache_config(1, block_size)) / 2**30
        if offload_blocks else None,
        kv_offloading_backend="native",
    )
    kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if enable_kv_cache_events else None
    transfer = None
    if offload_blocks and host_policy:
        from vllm.config import KVTransferConfig

        from serving_hook.host_tier import connector_extra_config

        transfer = KVTransferConfig(kv_connector_extra_config=connector_extra_config())
    cfg = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=kv_events,
        kv_transfer_config=transfer,
    )
    cfg.cache_config.num_gpu_blocks = num_blocks
    return cfg


_LAYERS = ("layer.0", "layer.1")


def _attention_spec(block_size: int):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=4, head_size=16, dtype=torch.float32)


def make_kv_cache_config(num_blocks: int, block_size: int = BLOCK_SIZE):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(_LAYERS), _attention_spec(block_size))],
    )


def make_scheduler(
    scheduler_cls: Any = None,
    *,
    num_blocks: int = 1024,
    block_size: int = BLOCK_SIZE,
    log_stats: bool = False,
    vllm_config: Any = None,
    **config_kwargs: Any,
):
    """Construct ``scheduler_cls`` (default: vLLM's ``Scheduler``) on a CPU config."""
    from vllm.v1.structured_output import StructuredOutputManager

    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls  # noqa: N813
    cfg = vllm_config or make_vllm_config(num_blocks=num_blocks, block_size=block_size, **config_kwargs)
    cfg.cache_config.num_gpu_blocks = num_blocks
    return scheduler_cls(
        vllm_config=cfg,
        kv_cache_config=make_kv_cache_config(num_blocks, block_size),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=block_size,
        log_stats=log_stats,
    )


_HASH_FN = None


def block_hasher(block_size: int = BLOCK_SIZE):
    """vLLM's per-request block hasher (sha256, as in vLLM's default)."""
    global _HASH_FN
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if _HASH_FN is None:
        _HASH_FN = get_hash_fn_by_name("sha256")
        init_none_hash(_HASH_FN)
    return get_request_block_hasher(block_size, _HASH_FN)


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    *,
    arrival_time: Optional[float] = None,
    extra_args: Optional[dict] = None,
    block_size: int = BLOCK_SIZE,
    priority: int = 0,
    stop_token_ids: Optional[Sequence[int]] = None,
    session_id: Optional[str] = None,
    kv_hints: Any = None,
    cache_salt: Optional[str] = None,
):
    """A vLLM request; it ends at ``max_tokens``, or earlier when it emits one of ``stop_token_ids``.

    ``session_id`` and ``kv_hints`` (a ``KvHintsEnvelope``) are vLLM's typed fields, as the OpenAI server and
    ``AsyncLLM.generate`` fill them; ``cache_salt`` (vLLM's): its blocks hash apart from unsalted or differently
    salted ones."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args=extra_args,
        stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sp,
        pooling_params=None,
        arrival_time=time.time() if arrival_time is None else arrival_time,
        block_hasher=block_hasher(block_size),
        priority=priority,
        session_id=session_id,
        kv_hints=kv_hints,
        cache_salt=cache_salt,
    )


def prompt_block_hashes(request: Any, n_blocks: int) -> list[int]:
    """The vLLM block hashes of a request's first ``n_blocks`` blocks, as signed int64 (the routers' hash space)."""
    return hashes_to_int64(request.block_hashes[:n_blocks])


def vllm_block_hashes(
    prompt_token_ids: Sequence[int],
    block_size: int = 16,
    hash_algo: str = "sha256",
    cache_salt: Optional[str] = None,
) -> list[int]:
    """vLLM's block hashes of a prompt's full blocks, as signed int64 (the ``KVAwareRouter`` contract).

    Chains vLLM's own ``hash_block_tokens`` from a ``NONE_HASH`` computed the
    way vLLM's ``init_none_hash`` does (``hash_algo`` of
    ``resolve_none_hash_seed``: ``PYTHONHASHSEED`` if set, else the fixed
    ``"vllm-none-hash"`` for the cryptographic algorithms), without setting
    vLLM's global. ``cache_salt`` goes into the first block's extra keys, as
    vLLM does for a request's ``cache_salt``. Covers plain text requests only:
    no LoRA, multimodal, prompt-embeds or speculative look-ahead keys (their
    hashes differ), and ``block_size`` must be vLLM's hash block size. The
    non-cryptographic ``xxhash`` algorithms without ``PYTHONHASHSEED`` use a
    random per-process seed in vLLM and are refused.
    """
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, resolve_none_hash_seed

    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    if hash_algo.startswith("xxhash") and os.getenv("PYTHONHASHSEED") is None:
        raise ValueError(f"{hash_algo} block hashes are seeded at random per process unless PYTHONHASHSEED is set")
    hash_fn = get_hash_fn_by_name(hash_algo)
    parent = hash_fn(resolve_none_hash_seed(hash_fn))
    tokens = [int(t) for t in prompt_token_ids]
    out: list[int] = []
    for b in range(len(tokens) // block_size):
        extra = (("cache_salt", cache_salt),) if b == 0 and cache_salt else None
        parent = hash_block_tokens(hash_fn, parent, tokens[b * block_size : (b + 1) * block_size], extra)
        out.append(hash_to_int64(parent))
    return out


@functools.cache
def _model_runner_output_cls() -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput


def model_runner_output(req_ids: list[str], sampled: list[list[int]], kv_connector_output: Any = None) -> Any:
    """vLLM's ``ModelRunnerOutput`` of one step: request ``req_ids[i]`` sampled the tokens ``sampled[i]``."""
    return _model_runner_output_cls()(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                      sampled_token_ids=sampled, kv_connector_output=kv_connector_output)


#: One transfer job of vLLM's offloading connector: (job id, request id, blocks, is_load, sync).
TransferJob = tuple[int, str, int, bool, bool]


def transfer_jobs(scheduler_output: Any) -> tuple[list[TransferJob], frozenset]:
    """The transfer jobs vLLM's ``OffloadingConnector`` scheduled this step (loads first), and the ids of the
    earlier jobs the worker must finish before this step's forward pass (``jobs_to_flush``)."""
    meta = scheduler_output.kv_connector_metadata
    if meta is None:
        return [], frozenset()
    jobs = [(jid, j.req_id, len(j.dst_spec.block_ids), True, bool(j.sync)) for jid, j in meta.load_jobs.items()]
    jobs += [(jid, j.req_id, len(j.src_spec.block_ids), False, False) for jid, j in meta.store_jobs.items()]
    return jobs, frozenset(meta.jobs_to_flush or ())


def connector_output(finished_loads: set[str], completed: list[tuple[int, bool, int, float]]) -> Any:
    """The worker side's ``KVConnectorOutput``: the requests whose asynchronous load finished, and the
    finished jobs as ``(job id, is_load, bytes, seconds)`` (None when there is nothing to report)."""
    if not completed:
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    meta = OffloadingWorkerMetadata()
    for jid, is_load, nbytes, seconds in completed:
        meta.mark_completed(jid)
        (meta.transfer_stats.load if is_load else meta.transfer_stats.store).record(nbytes, seconds)
    return KVConnectorOutput(finished_recving=finished_loads or None, kv_connector_worker_meta=meta)


class Engine:
    """One simulated replica's scheduler as the simulator steps it, and the wall time spent inside it.

    ``scheduler_s`` sums the calls into vLLM (``add_request``, ``schedule``, ``update_from_output``,
    ``finish_requests``), the kvpilot hook's work inside them included.
    """

    __slots__ = ("has_requests", "requests", "sched", "scheduler_s")

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.requests = sched.requests  # vLLM's dict: request id -> Request, whose progress the fake runner reads
        self.has_requests: Callable[[], bool] = sched.has_requests  # whether any request runs or waits
        self.scheduler_s = 0.0

    def add(self, request: Any) -> None:
        t0 = time.perf_counter()
        self.sched.add_request(request)
        self.scheduler_s += time.perf_counter() - t0

    def schedule(self) -> tuple[Any, dict[str, int]]:
        """One ``schedule()``: vLLM's scheduler output, and the tokens it scheduled per request id."""
        t0 = time.perf_counter()
        out = self.sched.schedule()
        self.scheduler_s += time.perf_counter() - t0
        return out, out.num_scheduled_tokens

    def update(self, scheduled: Any, req_ids: list[str], sampled: list[list[int]],
               kv_connector_output: Any = None) -> list[str]:
        """End the step ``scheduled`` with the tokens the runner sampled (and the offload worker's report); the
        ids of the requests it finished."""
        mro = model_runner_output(req_ids, sampled, kv_connector_output)
        t0 = time.perf_counter()
        outs = self.sched.update_from_output(scheduled, mro)
        self.scheduler_s += time.perf_counter() - t0
        return [o.request_id for eco in outs.values() for o in eco.outputs if o.finish_reason is not None]

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests (vLLM ``FINISHED_ABORTED``), one id at a time in the order given."""
        from vllm.v1.request import RequestStatus

        t0 = time.perf_counter()
        for rid in request_ids:
            self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.scheduler_s += time.perf_counter() - t0

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``reset_prefix_cache()`` (what RL frameworks call at weight sync; the CPU offload tier too, its
        KV is of the old weights as well); False if blocks are in use. ``reset_running_requests``: vLLM first
        preempts every running request (their KV freed, recomputed when rescheduled), as
        ``pause_generation(mode="keep", clear_cache=True)`` does."""
        t0 = time.perf_counter()
        kw = {"reset_running_requests": True} if reset_running_requests else {}
        ok = self.sched.reset_prefix_cache(reset_connector=self.sched.connector is not None, **kw)
        self.scheduler_s += time.perf_counter() - t0
        return bool(ok)

    def waiting(self) -> int:
        return len(self.sched.waiting)

    def load(self) -> int:
        """Running plus waiting requests."""
        return len(self.sched.running) + len(self.sched.waiting)


@contextlib.contextmanager
def vllm_envs_cached() -> Iterator[None]:
    """vLLM's environment variables read once, as vLLM's EngineCore does after start-up; restored afterwards.

    Unless cached, every ``vllm.envs.X`` read looks up ``os.environ`` (``maybe_convert_block_hash`` reads one
    per hashed block). The cache is lifted at the end, so that a later run in this process sees changes."""
    import vllm.envs as envs

    was_cached = hasattr(envs.__getattr__, "cache_clear")
    envs.enable_envs_cache()
    try:
        yield
    finally:
        if not was_cached:
            envs.disable_envs_cache()
