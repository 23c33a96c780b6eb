"""Summary statistics of a WORKLOAD table: structure, token percentiles per domain, prefix sharing.

Prefix sharing is measured as ``unlimited_cache_hit_fraction``: the fraction of
block references an unlimited prefix cache would hit. Requests are replayed in
order; a request's block i is a hit only if blocks 0..i were all registered by
earlier requests, and a request registers all its blocks after being counted.
Order: when every request has an ``arrival_s``, by arrival then table order;
otherwise (RL workloads released per step) by step, then turn, then table order,
so every turn k+1 comes after its turn k and a step's turn-0 batch comes first.
With chain hashes (equal hash = equal prefix) the order only matters for traces
whose hashes are not chains; then the leading-run rule decides.

``unlimited_cache_hit_fraction_with_outputs`` is the same count (same replay
order, same denominator: all block references) under vLLM's semantics, where a
request's generated output is cached too: after being counted, a request also
registers the blocks of its *stream* (a session's turns plus the requests
scoring it, which read ever longer prefixes of one context) that lie wholly
inside the first ``prompt_tokens + output_tokens - 1`` tokens it computed (vLLM
never computes the last sampled token). Those blocks' hashes come from the
stream's longest prompt, whose chain covers them. So a later turn, or a
scoring request, also hits the previous turn's output blocks. On single-turn
workloads without scoring the two fractions are equal.

Keys: ``requests``, ``steps``, ``groups``, ``sessions`` (distinct counts),
``turns`` (mean turns per session), ``max_turns``, ``block_references``,
``unique_blocks``, ``unlimited_cache_hit_fraction``,
``unlimited_cache_hit_fraction_with_outputs``,
``unlimited_cache_hit_fraction_within_steps`` (the same with the cache emptied at
every RL step, as weight sync does: what a simulation at unlimited KV can reach),
``first_block_shared_fraction`` (requests whose first block an earlier request
registered) and ``domains`` (per domain: ``requests``, ``sessions``, ``groups``,
and p50/p90/p99 of ``prompt_tokens`` and ``output_tokens``; for a multi-turn
domain also of its sessions' ``turns``, ``last_turn_context_tokens`` (prompt +
output of each session's last turn) and ``tool_latency_s``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.io import source_of

PERCENTILES = (50, 90, 99)


def workload_stats(table: pa.Table) -> dict[str, Any]:
    """Counts, per-domain token percentiles and unlimited-cache prefix hits of a workload."""
    turns_per_session = pc.value_counts(table.column("session_id")).field("counts").to_numpy()
    hits, refs, first_shared = _prefix_hits(table)
    n = table.num_rows
    return {
        "requests": n,
        "steps": _distinct(table, "step"),
        "groups": _distinct(table, "group_id"),
        "sessions": _distinct(table, "session_id"),
        "turns": float(turns_per_session.mean()) if n else 0.0,
        "max_turns": int(turns_per_session.max()) if n else 0,
        "block_references": refs,
        "unique_blocks": len(pc.unique(pc.list_flatten(table.column("block_hashes")))),
        "unlimited_cache_hit_fraction": hits / refs if refs else 0.0,
        "unlimited_cache_hit_fraction_with_outputs": _prefix_hits_with_outputs(table) / refs if refs else 0.0,
        "unlimited_cache_hit_fraction_within_steps": _hits_within_steps(table) / refs if refs else 0.0,
        "first_block_shared_fraction": first_shared / n if n else 0.0,
        "domains": {str(d): _domain_stats(table.filter(pc.equal(table.column("domain"), d)))
                    for d in sorted(pc.unique(table.column("domain")).to_pylist())},
        "source": source_of(table),
    }


def _distinct(table: pa.Table, column: str) -> int:
    """Number of distinct values of a column."""
    return len(pc.unique(table.column(column)))


def _percentiles(values: np.ndarray) -> dict[str, float]:
    """p50/p90/p99 of an array (empty: zeros)."""
    if values.size == 0:
        return {f"p{q}": 0.0 for q in PERCENTILES}
    return {f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(values, PERCENTILES))}


def _domain_stats(table: pa.Table) -> dict[str, Any]:
    """Request and session counts and token percentiles of one domain; a multi-turn domain's sessions too."""
    out = {
        "requests": table.num_rows,
        "sessions": _distinct(table, "session_id"),
        "groups": _distinct(table, "group_id"),
        "prompt_tokens": _percentiles(table.column("prompt_tokens").to_numpy()),
        "output_tokens": _percentiles(table.column("output_tokens").to_numpy()),
    }
    latency = table.column("tool_latency_s").drop_null().to_numpy()
    if latency.size:
        turns = pc.value_counts(table.column("session_id")).field("counts").to_numpy()
        last = pc.equal(table.column("finish_reason"), "tool_call")
        ends = table.filter(pc.invert(last))
        context = ends.column("prompt_tokens").to_numpy().astype(np.int64) + ends.column("output_tokens").to_numpy()
        out.update(turns=_percentiles(turns), last_turn_context_tokens=_percentiles(context),
                   tool_latency_s=_percentiles(latency))
    return out


def _replay_order(table: pa.Table) -> np.ndarray:
    """Row indices in replay order: by arrival when all are known, else by (step, turn, row)."""
    rows = np.arange(table.num_rows)
    arrival = table.column("arrival_s")
    if arrival.null_count == 0:
        return rows[np.lexsort((rows, arrival.to_numpy()))]
    step = table.column("step").to_numpy()
    turn = table.column("turn").to_numpy()
    return rows[np.lexsort((rows, turn, step))]


def _prefix_hits(table: pa.Table) -> tuple[int, int, int]:
    """(hit block references, all block references, requests whose first block was a hit) for an unlimited cache."""
    ordered = table.column("block_hashes").take(pa.array(_replay_order(table))).combine_chunks()
    lengths = pc.list_value_length(ordered).fill_null(0).to_numpy()
    hashes = pc.list_flatten(ordered).to_numpy()
    total = int(hashes.size)
    if total == 0:
        return 0, 0, 0
    owner = np.repeat(np.arange(lengths.size), lengths)  # request (in replay order) of each reference
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    seen = owner[first][inverse] < owner  # registered by an earlier request
    starts = np.cumsum(lengths) - lengths
    position = np.arange(total) - starts[owner]
    # Leading run of hits = position of the first miss in the request (its length if none).
    first_miss = np.where(seen, lengths[owner], position)
    nonempty = lengths > 0
    leading = np.minimum.reduceat(first_miss, starts[nonempty])
    return int(leading.sum()), total, int((leading > 0).sum())


def _hits_within_steps(table: pa.Table) -> int:
    """:func:`_prefix_hits_with_outputs` with the cache emptied at every RL step (weight sync)."""
    step = table.column("step")
    return sum(_prefix_hits_with_outputs(table.filter(pc.equal(step, s))) for s in pc.unique(step).to_pylist())


def _prefix_hits_with_outputs(table: pa.Table) -> int:
    """Hit block references of an unlimited cache that also holds each request's computed output blocks."""
    n = table.num_rows
    if n == 0:
        return 0
    order = _replay_order(table)
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    chains = table.column("block_hashes").combine_chunks()
    lengths = pc.list_value_length(chains).fill_null(0).to_numpy().astype(np.int64)
    flat = pc.list_flatten(chains).to_numpy()
    if flat.size == 0:
        return 0
    offsets = np.cumsum(lengths) - lengths
    size = int(table.column("block_size")[0].as_py())
    prompt = table.column("prompt_tokens").to_numpy().astype(np.int64)
    output = table.column("output_tokens").to_numpy().astype(np.int64)
    stream = pc.dictionary_encode(
        pc.coalesce(table.column("scores_session_id"), table.column("session_id"))
    ).combine_chunks().indices.to_numpy().astype(np.int64)
    by_length = np.lexsort((prompt, stream))  # per stream, its longest prompt last
    last = np.flatnonzero(np.diff(stream[by_length], append=-1) != 0)
    longest = np.empty(stream.max() + 1, np.int64)
    longest[stream[by_length[last]]] = by_length[last]
    owner_row = longest[stream]  # per row: its stream's longest request, whose chain covers the stream
    # Extra registrations of row r: the longest chain's blocks j with lo <= j < hi, full in both r's computed
    # tokens and that chain's prompt (r's own chain already registers its blocks below lo).
    lo = prompt // size
    hi = np.minimum(np.maximum(prompt + output - 1, 0) // size, prompt[owner_row] // size)
    extra = np.maximum(hi - lo, 0)
    extra_row = np.repeat(np.arange(n), extra)
    j = np.arange(int(extra.sum())) - (np.cumsum(extra) - extra)[extra_row] + lo[extra_row]
    extra_hash = flat[offsets[owner_row[extra_row]] + j]
    query_row = np.repeat(np.arange(n), lengths)
    hashes = np.concatenate([flat, extra_hash])
    ranks = np.concatenate([rank[query_row], rank[extra_row]])
    unique, inverse = np.unique(hashes, return_inverse=True)
    first_rank = np.full(unique.size, np.iinfo(np.int64).max)
    np.minimum.at(first_rank, inverse.ravel(), ranks)
    seen = first_rank[inverse[: flat.size]] < rank[query_row]
    # Leading run of hits per request (its length if all hit), as in _prefix_hits.
    position = np.arange(flat.size) - offsets[query_row]
    first_miss = np.where(seen, lengths[query_row], position)
    nonempty = lengths > 0
    leading = np.minimum.reduceat(first_miss, offsets[nonempty])
    return int(leading.sum())


def render_stats(stats: dict[str, Any]) -> str:
    """Plain-text report of :func:`workload_stats` output."""
    lines = [
        f"requests {stats['requests']}  steps {stats['steps']}  groups {stats['groups']}  "
        f"sessions {stats['sessions']}  turns/session {stats['turns']:.2f} (max {stats['max_turns']})",
        f"block references {stats['block_references']}  unique blocks {stats['unique_blocks']}  "
        f"unlimited-cache hit fraction {stats['unlimited_cache_hit_fraction']:.3f} "
        f"({stats['unlimited_cache_hit_fraction_with_outputs']:.3f} with outputs cached, "
        f"{stats['unlimited_cache_hit_fraction_within_steps']:.3f} within RL steps)  "
        f"first block shared {stats['first_block_shared_fraction']:.3f}",
    ]
    header = ["domain", "requests", "sessions", "groups"] + [
        f"{kind}_p{q}" for kind in ("prompt", "output") for q in PERCENTILES
    ]
    body = [
        [name, str(d["requests"]), str(d["sessions"]), str(d["groups"])]
        + [f"{d[f'{kind}_tokens'][f'p{q}']:.0f}" for kind in ("prompt", "output") for q in PERCENTILES]
        for name, d in stats["domains"].items()
    ]
    lines += _columns(header, body)
    agents = {name: d for name, d in stats["domains"].items() if "turns" in d}
    if agents:
        keys = (("turns", "turns", "{:.0f}"), ("context_last", "last_turn_context_tokens", "{:.0f}"),
                ("tool_s", "tool_latency_s", "{:.2f}"), ("output", "output_tokens", "{:.0f}"))
        header = ["multi-turn"] + [f"{label}_p{q}" for label, _, _ in keys for q in (50, 99)]
        body = [[name] + [fmt.format(d[key][f"p{q}"]) for _, key, fmt in keys for q in (50, 99)]
                for name, d in agents.items()]
        lines += _columns(header, body)
    src = stats.get("source")
    if src:
        lines.append(f"made by {_describe(src)}")
    return "\n".join(lines)


def _describe(source: dict[str, Any]) -> str:
    """One line of a workload's provenance (:data:`data.io.SOURCE_KEY`)."""
    if "parts" in source:
        return "; ".join(_describe(p) if p else "(unknown)" for p in source["parts"])
    what = str(source.get("generator", "an unknown generator"))
    if isinstance(source.get("config"), dict):
        cfg = source["config"]
        return f"{what}, seed {cfg.get('seed')}, {cfg.get('steps')} step(s) x {cfg.get('prompts_per_step')} prompts"
    if "format" in source:
        return f"{what} --format {source['format']} from {', '.join(map(str, source.get('files', [])))}"
    return what


def _columns(header: list[str], body: list[list[str]]) -> list[str]:
    """A right-aligned text table (first column left-aligned)."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in [header, *body]]
