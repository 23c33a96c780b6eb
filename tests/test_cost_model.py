"""Step cost model: hand-computed step times, monotonicity, presets and sizing."""

from __future__ import annotations

import pytest

from simulator.cost_model import CostModel, prefill_attention_pairs

# H200-7B constants, restated from the module docstring (NVIDIA datasheet, Qwen2.5-7B card).
PEAK_FLOPS = 989e12
HBM_BW = 4.8e12
MFU = 0.6
BW_EFF = 0.8
OVERHEAD = 0.004
LAYERS, HIDDEN, KV_HEADS, HEAD_DIM, VOCAB = 28, 3584, 4, 128, 152_064
NON_EMB = 6.53e9

F = PEAK_FLOPS * MFU
B = HBM_BW * BW_EFF
WEIGHT_S = (NON_EMB + HIDDEN * VOCAB) * 2 / B
KV_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # K and V, bf16: 57,344 bytes


@pytest.fixture(scope="module")
def h200_7b() -> CostModel:
    return CostModel.preset("H200-7B")


def test_kv_sizes(h200_7b: CostModel) -> None:
    assert h200_7b.kv_bytes_per_token == KV_PER_TOKEN == 57_344
    assert h200_7b.kv_block_bytes(16) == 16 * 57_344
    assert CostModel.preset("H200-32B").kv_bytes_per_token == 2 * 64 * 8 * 128 * 2


def test_pure_decode_step(h200_7b: CostModel) -> None:
    seqs, ctx = 64, 64 * 2048
    gemm_compute = (2 * NON_EMB * seqs + 2 * HIDDEN * VOCAB * seqs) / F  # ~1.5 ms < weights ~3.7 ms
    attn_compute = 4 * LAYERS * HIDDEN * ctx / F
    kv_read = KV_PER_TOKEN * ctx / B
    expected = OVERHEAD + max(gemm_compute, WEIGHT_S) + max(attn_compute, kv_read)
    assert gemm_compute < WEIGHT_S and attn_compute < kv_read  # memory-bound: (weights + KV) / B
    assert expected == pytest.approx(OVERHEAD + (14.1498e9 + 7.5162e9) / 3.84e12, rel=1e-4)
    assert h200_7b.step_time(0, 0, seqs, ctx) == pytest.approx(expected, rel=1e-9)


def test_pure_prefill_step(h200_7b: CostModel) -> None:
    n = 8192  # one fresh 8k-token prompt: each token attends to itself and every earlier token
    pairs = n * (n + 1) // 2
    assert prefill_attention_pairs(n, 0) == pairs == 33_558_528
    gemm = 2 * NON_EMB * n / F
    attn = 4 * LAYERS * HIDDEN * pairs / F
    expected = OVERHEAD + max(gemm, WEIGHT_S) + attn  # no decode KV read
    assert expected == pytest.approx(0.004 + 0.18029 + 0.02270, rel=1e-3)
    assert h200_7b.step_time(n, pairs, 0, 0) == pytest.approx(expected, rel=1e-9)


def test_mixed_step(h200_7b: CostModel) -> None:
    # A 2,048-token chunk after 1,024 cached tokens, plus 128 decodes of 1,500 tokens of context.
    chunk, cached, seqs = 2048, 1024, 128
    pairs = chunk * cached + chunk * (chunk + 1) // 2
    assert prefill_attention_pairs(chunk, cached) == pairs == 4_195_328
    ctx = seqs * 1500
    gemm = (2 * NON_EMB * (chunk + seqs) + 2 * HIDDEN * VOCAB * seqs) / F
    attn = 4 * LAYERS * HIDDEN * (pairs + ctx) / F
    kv_read = KV_PER_TOKEN * ctx / B
    expected = OVERHEAD + max(gemm, WEIGHT_S) + max(attn, kv_read)
    assert gemm > WEIGHT_S  # 2,176 tokens: GEMMs compute-bound
    assert h200_7b.step_time(chunk, pairs, seqs, ctx) == pytest.approx(expected, rel=1e-9)


def test_empty_step_costs_nothing(h200_7b: CostModel) -> None:
    assert h200_7b.step_time(0, 0, 0, 0) == 0.0


def test_more_work_takes_longer(h200_7b: CostModel) -> None:
    prefill = [h200_7b.step_time(n, prefill_attention_pairs(n, 0), 0, 0) for n in (256, 1024, 4096, 16384)]
    assert prefill == sorted(prefill) and len(set(prefill)) == len(prefill)
    decode_ctx = [h200_7b.step_time(0, 0, 128, 128 * c) for c in (256, 1024, 4096, 16384)]
    assert decode_ctx == sorted(decode_ctx) and len(set(decode_ctx)) == len(decode_ctx)
    decode_seqs = [h200_7b.step_time(0, 0, s, s * 1024) for s in (1, 16, 256, 1024)]
    assert decode_seqs == sorted(decode_seqs) and len(set(decode_seqs)) == len(decode_seqs)
    base = h200_7b.step_time(512, prefill_attention_pairs(512, 0), 64, 64 * 1024)
    assert h200_7b.step_time(1024, prefill_attention_pairs(1024, 0), 64, 64 * 1024) > base
    assert h200_7b.step_time(512, prefill_attention_pairs(512, 0), 64, 64 * 4096) > base
    decode = h200_7b.step_time(0, 0, 64, 64 * 1024)
    assert CostModel.preset("H200-32B").step_time(0, 0, 64, 64 * 1024) > decode
    assert CostModel.preset("H100-7B").step_time(0, 0, 64, 64 * 1024) > decode


def test_decode_step_is_plausible(h200_7b: CostModel) -> None:
    # 256 sequences x 1k context of a 7B model on one H200: measured vLLM ITLs are tens of ms.
    t = h200_7b.step_time(0, 0, 256, 256 * 1024)
    assert 0.010 <= t <= 0.040


def test_unknown_preset_lists_known() -> None:
    with pytest.raises(ValueError, match=r"unknown cost-model preset 'B200-7B'.*H200-7B.*H200-32B"):
        CostModel.preset("B200-7B")
    with pytest.raises(ValueError, match="H100-7B"):
        CostModel.preset("H200")


def test_preset_overrides() -> None:
    pairs = prefill_attention_pairs(8192, 0)
    slow = CostModel.preset("H200-7B", compute_efficiency=0.3)
    assert slow.step_time(8192, pairs, 0, 0) > CostModel.preset("H200-7B").step_time(8192, pairs, 0, 0)
    with pytest.raises(ValueError):
        CostModel.preset("H200-7B", bandwidth_efficiency=1.5)


def test_max_kv_blocks(h200_7b: CostModel) -> None:
    free = 0.9 * 143_771 * 2**20 - 7.61e9 * 2 - 4 * 2**30
    assert h200_7b.max_kv_blocks(16, 0.9) == int(free // (16 * KV_PER_TOKEN))
    assert 1.8e6 < h200_7b.max_kv_blocks(16, 0.9) * 16 < 2.2e6  # ~2M tokens of KV on an H200
    assert h200_7b.max_kv_blocks(16, 0.5) < h200_7b.max_kv_blocks(16, 0.9)
    with pytest.raises(ValueError, match="does not leave room"):
        CostModel.preset("H100-32B").max_kv_blocks(16, 0.5)


def test_step_time_rejects_negative(h200_7b: CostModel) -> None:
    with pytest.raises(ValueError):
        h200_7b.step_time(-1, 0, 0, 0)
