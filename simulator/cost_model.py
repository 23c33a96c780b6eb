"""Step cost model: the seconds one engine step takes on a GPU, from what it scheduled.

The simulator drives vLLM's real scheduler on the CPU; this module turns each
scheduled step into simulated wall time. It is a roofline model, pure float
arithmetic, cheap enough to run every step. Absolute times are approximate:
compare policies by ratios from the same cost model, never by lone numbers.

Inputs of :meth:`CostModel.step_time` (all counts of tokens):

* ``prefill_tokens`` P: new prompt tokens computed this step (all chunks);
* ``prefill_context_tokens`` A_p: attention pairs of those tokens, the sum over
  prefill query tokens of the keys each attends to. A chunk of ``n`` new tokens
  after ``c`` cached/computed tokens contributes ``n*c + n*(n+1)/2``
  (:func:`prefill_attention_pairs`);
* ``decode_seqs`` S: sequences decoding one token each;
* ``decode_context_tokens`` A_d: sum of the KV lengths those sequences read
  (each one's context, the token being decoded included).

Formulas (L layers, D hidden size, Q = query heads x head dim (= D for Qwen2.5),
K = KV heads x head dim, N non-embedding parameters, V vocabulary, b = 2 bytes
per bf16 element)::

    linear_flops = 2*N*(P + S) + 2*D*V*S     # GEMMs of every token; logits of decode tokens
    attn_flops   = 4*L*Q*(A_p + A_d)         # QK^T and PV: 2 FLOPs per multiply-add each
    weight_bytes = (N + D*V) * b             # layers and lm_head, streamed once per step
    kv_bytes     = 2*L*K*b * A_d             # K and V of every decode context token

    F = peak_flops * compute_efficiency      # achievable compute
    B = hbm_bandwidth * bandwidth_efficiency # achievable bandwidth

    step_time = overhead
              + max(linear_flops / F, weight_bytes / B)   # GEMM kernels
              + max(attn_flops / F,   kv_bytes / B)       # attention kernels

An empty step (P = S = 0) runs no forward pass and costs 0.

:meth:`CostModel.strided_step_time` prices one simulator step that stands for
several consecutive engine iterations (the simulator's decode stride): the first
iteration runs the step's prefill and its first decode batch, each later one a
decode batch only, and each is a :meth:`~CostModel.step_time` of its own (its
overhead and weight reads included)::

    strided = step_time(P, A_p, S_1, A_d1) + sum_{j >= 2} step_time(0, 0, S_j, A_dj)

Why max within, sum across: a GEMM kernel streams the weights while it computes,
so its time is the larger of its compute and memory times (roofline); the
attention kernels run after the GEMMs of the same layer and overlap little with
them, so the two families add. A pure decode step then reduces to
``(weight_bytes + kv_bytes) / B`` while small, as the usual decode estimate
says, and a large prefill to ``flops / F``. Prefill attention reads of cached
KV are left out of the memory term: FlashAttention tiles them across query
blocks, so a prefill chunk is compute-bound. The embedding lookup (a gather)
and the logits of the last token of a prefill are left out of the FLOPs.

Constants and their sources:

* H200 SXM: 989 TFLOP/s dense BF16 (1,979 with sparsity), 4.8 TB/s HBM3e,
  141 GB (NVIDIA H200 datasheet); nvidia-smi reports 143,771 MiB total, used
  here for memory sizing.
* H100 SXM: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB (NVIDIA H100
  datasheet); nvidia-smi reports 81,559 MiB.
* Host link (the CPU offload tier's transfers, :meth:`CostModel.host_transfer_s`): both GPUs reach host
  memory over PCIe Gen5 x16, 128 GB/s bidirectional, so 64 GB/s per direction (H100 and H200 datasheets);
  ``host_link_efficiency`` 0.8 (assumed: pinned-memory copies measure about 50-55 GB/s on Gen5 x16), so a
  block of Qwen2.5-7B (16 tokens x 56 KiB) loads in about 18 us.
* compute_efficiency 0.6: assumed model FLOPs utilisation of prefill and
  batched-decode GEMMs in vLLM (large BF16 GEMMs reach ~60-70% of peak on
  Hopper; attention and small batches less).
* bandwidth_efficiency 0.8: assumed fraction of peak HBM bandwidth that decode
  GEMV/attention kernels sustain (STREAM-like copies reach ~90%).
* step_overhead_s 4 ms: assumed fixed per-step cost (scheduler, input
  preparation, sampling, CUDA-graph launch) of a vLLM v1 engine step.
* reserved_bytes 4 GiB: assumed activation peak plus non-torch memory (CUDA
  graphs, workspace) that vLLM's memory profiling subtracts before sizing the
  KV cache.
* Models, from the Hugging Face config.json and model cards of Qwen/Qwen2.5-7B
  (28 layers, hidden 3584, 28 query / 4 KV heads, head dim 128, vocab 152,064,
  7.61B parameters, 6.53B non-embedding) and Qwen/Qwen2.5-32B (64 layers,
  hidden 5120, 40 query / 8 KV heads, head dim 128, vocab 152,064, 32.5B
  parameters, 31.0B non-embedding); BF16 weights and KV cache. The card's
  "non-embedding" count excludes both the input embedding and the (untied)
  lm_head, so the lm_head is added back as ``hidden * vocab``.

Presets are ``<GPU>-<model>``: ``H200-7B``, ``H200-32B``, ``H100-7B``, ``H100-32B``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GPU", "ModelSpec", "CostModel", "IterationPricing", "GPUS", "MODELS", "PRESETS", "prefill_attention_pairs"]


@dataclass(frozen=True)
class GPU:
    """Peak figures of one accelerator."""

    name: str
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: int  # total device memory as CUDA reports it
    host_link_bandwidth: float = 64e9  # bytes/s per direction between host memory and the GPU


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a dense decoder-only transformer, enough for FLOPs and bytes."""

    name: str
    layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    params: float  # all parameters, for weight memory
    non_embedding_params: float  # without input embedding and lm_head
    bytes_per_param: int = 2  # bf16 weights
    kv_bytes_per_elem: int = 2  # bf16 KV cache


GPUS: dict[str, GPU] = {
    "H200": GPU("H200", peak_flops=989e12, hbm_bandwidth=4.8e12, memory_bytes=143_771 * 2**20),
    "H100": GPU("H100", peak_flops=989e12, hbm_bandwidth=3.35e12, memory_bytes=81_559 * 2**20),
}

MODELS: dict[str, ModelSpec] = {
    "7B": ModelSpec(
        "Qwen2.5-7B", layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
        vocab_size=152_064, params=7.61e9, non_embedding_params=6.53e9,
    ),
    "32B": ModelSpec(
        "Qwen2.5-32B", layers=64, hidden_size=5120, num_heads=40, num_kv_heads=8, head_dim=128,
        vocab_size=152_064, params=32.5e9, non_embedding_params=31.0e9,
    ),
}

PRESETS: tuple[str, ...] = tuple(f"{g}-{m}" for g in GPUS for m in MODELS)


def prefill_attention_pairs(new_tokens: int, context_tokens: int) -> int:
    """Causal attention pairs of a prefill chunk of ``new_tokens`` after ``context_tokens`` known ones."""
    return new_tokens * context_tokens + new_tokens * (new_tokens + 1) // 2


class IterationPricing:
    """A simulator step that stands for several engine iterations, priced from a model's ``step_time``."""

    def step_time(self, prefill_tokens: int, prefill_context_tokens: int, decode_seqs: int,
                  decode_context_tokens: int) -> float:
        """Seconds of one engine iteration: the model's own."""
        raise NotImplementedError

    def strided_step_time(
        self,
        prefill_tokens: int,
        prefill_context_tokens: int,
        decode_seqs: Sequence[int],
        decode_context_tokens: Sequence[int],
    ) -> float:
        """Seconds of consecutive iterations: the prefill once, then iteration j decodes ``decode_seqs[j]``.

        ``decode_seqs[j]`` sequences reading ``decode_context_tokens[j]`` KV tokens in all decode in
        iteration j; the first iteration also runs the prefill (see the module docstring). Iterations
        without work cost nothing.
        """
        if len(decode_seqs) != len(decode_context_tokens):
            raise ValueError("decode_seqs and decode_context_tokens must have one entry per iteration")
        if not len(decode_seqs):
            return self.step_time(prefill_tokens, prefill_context_tokens, 0, 0)
        total = self.step_time(prefill_tokens, prefill_context_tokens, decode_seqs[0], decode_context_tokens[0])
        for seqs, ctx in zip(decode_seqs[1:], decode_context_tokens[1:]):
            if seqs:
                total += self.step_time(0, 0, seqs, ctx)
        return total


@dataclass
class CostModel(IterationPricing):
    """Roofline step-time model of one model replica on one GPU (see the module docstring)."""

    gpu: GPU
    model: ModelSpec
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.004
    reserved_bytes: int = 4 * 2**30
    host_link_efficiency: float = 0.8
    # Per-step constants, precomputed so that step_time is a handful of float operations.
    _flops: float = field(init=False, repr=False)
    _bandwidth: float = field(init=False, repr=False)
    _token_flops: float = field(init=False, repr=False)
    _logit_flops: float = field(init=False, repr=False)
    _pair_flops: float = field(init=False, repr=False)
    _weight_s: float = field(init=False, repr=False)
    _kv_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.compute_efficiency <= 1 or not 0 < self.bandwidth_efficiency <= 1:
            raise ValueError("compute_efficiency and bandwidth_efficiency must be in (0, 1]")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")
        if not 0 < self.host_link_efficiency <= 1:
            raise ValueError("host_link_efficiency must be in (0, 1]")
        m = self.model
        lm_head = m.hidden_size * m.vocab_size
        self._flops = self.gpu.peak_flops * self.compute_efficiency
        self._bandwidth = self.gpu.hbm_bandwidth * self.bandwidth_efficiency
        self._token_flops = 2.0 * m.non_embedding_params
        self._logit_flops = 2.0 * lm_head
        self._pair_flops = 4.0 * m.layers * m.num_heads * m.head_dim
        self._weight_s = (m.non_embedding_params + lm_head) * m.bytes_per_param / self._bandwidth
        self._kv_bytes = 2 * m.layers * m.num_kv_heads * m.head_dim * m.kv_bytes_per_elem

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> CostModel:
        """The cost model named ``<GPU>-<model>`` (e.g. ``H200-7B``); ``overrides`` set efficiencies etc."""
        gpu, _, model = name.partition("-")
        if gpu not in GPUS or model not in MODELS:
            raise ValueError(f"unknown cost-model preset {name!r}; known presets: {', '.join(PRESETS)}")
        return cls(GPUS[gpu], MODELS[model], **overrides)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return self._kv_bytes

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV-cache block of ``block_size`` tokens."""
        return block_size * self.kv_bytes_per_token

    def max_kv_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9) -> int:
        """KV blocks that fit, vLLM-style: utilisation x memory - weights - reserve, over block bytes."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        m = self.model
        weights = m.params * m.bytes_per_param
        free = gpu_memory_utilization * self.gpu.memory_bytes - weights - self.reserved_bytes
        if free < self.kv_block_bytes(block_size):
            raise ValueError(
                f"{m.name} does not leave room for a KV block on {self.gpu.name} "
                f"at gpu_memory_utilization={gpu_memory_utilization}"
            )
        return int(free // self.kv_block_bytes(block_size))

    @property
    def host_link_bytes_per_s(self) -> float:
        """Achievable bytes/s between host memory and the GPU, one direction."""
        return self.gpu.host_link_bandwidth * self.host_link_efficiency

    def host_transfer_s(self, num_bytes: int | float) -> float:
        """Seconds to move ``num_bytes`` of KV between host memory and the GPU, one direction."""
        return num_bytes / self.host_link_bytes_per_s

    @property
    def weight_read_s(self) -> float:
        """Seconds to stream the weights once: the memory floor of every step's GEMMs."""
        return self._weight_s

    def linear_s(self, tokens: int | float, decode_tokens: int | float) -> float:
        """Compute seconds of the GEMMs of ``tokens`` tokens, ``decode_tokens`` of them with logits."""
        return (self._token_flops * tokens + self._logit_flops * decode_tokens) / self._flops

    def attention_s(self, pairs: int | float) -> float:
        """Compute seconds of ``pairs`` attention query-key pairs."""
        return self._pair_flops * pairs / self._flops

    def kv_read_s(self, context_tokens: int | float) -> float:
        """Seconds to read ``context_tokens`` tokens of K and V."""
        return self._kv_bytes * context_tokens / self._bandwidth

    def decode_context_s(self, context_tokens: int | float) -> float:
        """Seconds of decode attention over ``context_tokens`` tokens: its compute or its KV read (roofline)."""
        return max(self.attention_s(context_tokens), self.kv_read_s(context_tokens))

    @property
    def host_tier(self) -> bool:
        """A GPU preset can hold a CPU offload tier (over its host link)."""
        return True

    def step_time(
        self,
        prefill_tokens: int,
        prefill_context_tokens: int,
        decode_seqs: int,
        decode_context_tokens: int,
    ) -> float:
        """Seconds of one engine step (0.0 for an empty step)."""
        if min(prefill_tokens, prefill_context_tokens, decode_seqs, decode_context_tokens) < 0:
            raise ValueError("step_time arguments must be >= 0")
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        gemm_flops = self._token_flops * (prefill_tokens + decode_seqs) + self._logit_flops * decode_seqs
        linear_s = gemm_flops / self._flops
        attn_s = self._pair_flops * (prefill_context_tokens + decode_context_tokens) / self._flops
        kv_s = self._kv_bytes * decode_context_tokens / self._bandwidth
        return self.step_overhead_s + max(linear_s, self._weight_s) + max(attn_s, kv_s)
