"""Deterministic token ids for a workload's requests, so vLLM's own prefix hashing sees the workload's sharing.

Streams
-------
A *stream* is one trajectory's growing context: the turns of a session plus the
reward-model requests scoring it (rows whose ``scores_session_id`` names it).
Every request of a stream reads a prefix of the stream's tokens: turn k+1's
prompt is turn k's prompt + output + tool tokens, and a scoring prompt is the
trajectory's final context + judge template. A request's prompt is
``stream[:prompt_tokens]`` and its output ``stream[prompt_tokens:prompt_tokens +
output_tokens]``, so a fake runner emitting those outputs makes the next turn's
prompt hit vLLM's cache exactly as in production.

Expansion rule
--------------
Order a stream's requests by prompt length. Position p of the stream belongs to
the first request whose prompt covers it (the one that *introduced* it); its
token is ``3 + mix(key(h) + j * golden)`` scaled into ``[0, vocab - 3)``, with
``h`` that request's hash of block ``p // block_size`` and ``j = p % block_size``. Positions past the
longest prompt (the last output, a scoring request's answer) take the stream's
own key and the absolute position. Ids 0-2 (pad, bos, eos) never occur.

This gives: GRPO siblings share their prompt's partial last block (its hash is
the prompt's, and their turn 0 introduces it); a later turn's full block over a
turn boundary starts with the earlier turn's tokens; equal hashes give equal
tokens; a differing hash at block k makes the 16-token blocks from there on
differ (a single token may coincide with chance 1/(vocab-3), 16 at once never).
A stream whose requests disagree on a full block is an inconsistent workload
and raises ``ValueError``.

Counting convention
-------------------
:func:`unlimited_cached_tokens` counts, per request, the prompt tokens an
unlimited vLLM prefix cache would hit: leading full vLLM blocks (16 tokens)
already *registered*, at most ``(prompt_tokens - 1) // 16`` blocks (vLLM always
computes the last prompt token). With ``include_outputs`` (vLLM's behaviour) a
finished request registers every full block of the ``prompt + output - 1``
tokens it computed (run one at a time in causal order, vLLM's scheduler hits
exactly this: tests/test_sim_tokens.py); without it only its prompt's full
blocks, which is :func:`data.stats.workload_stats`' prompt-chain rule at
16-token granularity:
in data.stats' replay order, the leading 16-token blocks a prompt shares with
earlier prompts number ``min(h * block_size, prompt_tokens) // 16`` for h
leading workload-block hits (tests/test_sim_tokens.py checks this on the
synthetic workload, Search-R1 and Mooncake). That holds for 16-token workload
blocks and for one-turn sessions; with larger blocks a next turn also shares the
16-token blocks inside its predecessor's partial last block, finer than the
workload's hashes say. The two conventions differ on later turns and on scoring
requests, which also hit the blocks of the previous output.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.hashing import VLLM_BLOCK_SIZE, splitmix64

VOCAB_SIZE = 32000
FIRST_ID = 3  # ids 0 (pad), 1 (bos) and 2 (eos) are never emitted

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT = np.uint64(0x5851F42D4C957F2D)
_RADIX = 0xD6E8FEB86659FD93  # odd: invertible modulo 2**64
_RADIX_INV = pow(_RADIX, -1, 1 << 64)
_CHUNK_TOKENS = 1 << 22  # bulk key computation generates at most about this many tokens at once


def _ids(keys: np.ndarray, index: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids in [FIRST_ID, vocab_size) of (mixed key, index) pairs."""
    with np.errstate(over="ignore"):
        mixed = splitmix64(keys + index.astype(np.uint64) * _GOLDEN) >> np.uint64(32)
        scaled = (mixed * np.uint64(vocab_size - FIRST_ID)) >> np.uint64(32)  # uniform in [0, vocab - 3)
    return scaled.astype(np.int32) + np.int32(FIRST_ID)


def _key(hashes: np.ndarray) -> np.ndarray:
    """Mixed uint64 keys of int64 block hashes (small Mooncake ids spread over 64 bits)."""
    return splitmix64(np.asarray(hashes, np.int64).view(np.uint64) ^ _SALT)


def prompt_token_ids(
    block_hashes: list[int] | np.ndarray, prompt_tokens: int, block_size: int, vocab_size: int = VOCAB_SIZE
) -> np.ndarray:
    """Prompt ids of a lone request (a stream of one): token j of block i derives from (block_hashes[i], j)."""
    p = np.arange(prompt_tokens)
    hashes = np.asarray(block_hashes, np.int64)
    if len(hashes) != -(-prompt_tokens // block_size):
        raise ValueError(f"{len(hashes)} hashes for {prompt_tokens} tokens of block size {block_size}")
    return _ids(_key(hashes)[p // block_size], p % block_size, vocab_size)


def block_keys(ids: np.ndarray, lengths: np.ndarray | None = None, block_size: int = VLLM_BLOCK_SIZE) -> np.ndarray:
    """Prefix-identity keys of the full blocks of one token sequence, or of concatenated ones with ``lengths``.

    Key b of a sequence identifies its tokens [0, (b+1)*block_size), like vLLM's
    chained block hashes: a prefix hash ``sum_c x_c R^(b-c)`` (mod 2**64) of the
    blocks' mixed contents ``x_c``, mixed with b. Sequences' keys are concatenated.
    """
    ids = np.asarray(ids)
    lengths = np.array([ids.size]) if lengths is None else np.asarray(lengths, np.int64)
    n_blocks = lengths // block_size
    total = int(n_blocks.sum())
    if total == 0:
        return np.empty(0, np.uint64)
    seq = np.repeat(np.arange(n_blocks.size), n_blocks)
    first_block = np.cumsum(n_blocks) - n_blocks
    b = np.arange(total) - first_block[seq]  # block index within its sequence
    starts = (np.cumsum(lengths) - lengths)[seq] + b * block_size
    tokens = ids[starts[:, None] + np.arange(block_size)].astype(np.uint64)
    with np.errstate(over="ignore"):
        column = np.random.default_rng(0x6B7670).integers(1, 1 << 63, size=block_size, dtype=np.uint64)
        content = splitmix64(tokens @ column)  # a random linear form of the block's tokens, mixed
        power = np.cumprod(np.full(total, _RADIX, np.uint64)) * np.uint64(_RADIX_INV)  # R^i, i = 0..total-1
        inverse = np.cumprod(np.full(total, _RADIX_INV, np.uint64)) * np.uint64(_RADIX)  # R^-i
        prefix = np.cumsum(content * inverse)
        before = np.where(first_block > 0, prefix[np.maximum(first_block - 1, 0)], np.uint64(0))[seq]
        return splitmix64((prefix - before) * power + (b.astype(np.uint64) + np.uint64(1)) * _GOLDEN)


class WorkloadTokens:
    """Token ids of every request of a validated WORKLOAD table, generated on demand from its hash chains.

    The table's block size is constant and its chains have one hash per block (:mod:`data.validate`); a stream
    whose requests disagree on a full block raises ``ValueError``.
    """

    def __init__(self, table: pa.Table, vocab_size: int = VOCAB_SIZE) -> None:
        self.table = table
        self.vocab_size = vocab_size
        n = table.num_rows
        self.block_size = table.column("block_size")[0].as_py() if n else VLLM_BLOCK_SIZE
        self.prompt = table.column("prompt_tokens").to_numpy().astype(np.int64)
        self.output = table.column("output_tokens").to_numpy().astype(np.int64)
        chains = table.column("block_hashes")
        lengths = pc.list_value_length(chains).fill_null(0).to_numpy().astype(np.int64)
        self._offsets = np.cumsum(lengths) - lengths
        # one spare slot at the end keeps gathers for positions past every prompt in bounds
        self._keys = np.append(_key(pc.list_flatten(chains).to_numpy()), np.uint64(0))
        stream_names = pc.coalesce(table.column("scores_session_id"), table.column("session_id"))
        encoded = pc.dictionary_encode(stream_names).combine_chunks()
        self.stream = encoded.indices.to_numpy().astype(np.int64)  # row -> stream code
        self.stream_names: list[str] = encoded.dictionary.to_pylist()
        self._stream_key = np.array(
            [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") for s in self.stream_names],
            np.uint64,
        )
        rows = np.arange(n)
        self._members = rows[np.lexsort((rows, self.prompt, self.stream))]  # by stream, then prompt length
        n_streams = len(self.stream_names)
        self._end = np.searchsorted(self.stream[self._members], np.arange(n_streams), side="right")
        self._first = self._end - np.bincount(self.stream, minlength=n_streams)  # stream -> its members' slice
        self.rank = np.empty(n, np.int64)  # a request's place in its stream by prompt length
        self.rank[self._members] = rows - self._first[self.stream[self._members]]
        self.stream_length = np.zeros(n_streams, np.int64)  # full length: longest prompt + output of a member
        np.maximum.at(self.stream_length, self.stream, self.prompt + self.output)
        self.stream_prompt = np.zeros(n_streams, np.int64)  # its longest prompt
        np.maximum.at(self.stream_prompt, self.stream, self.prompt)
        self._check_streams()

    def _check_streams(self) -> None:
        """Every request's full blocks must equal its stream's longest prompt's blocks at the same positions."""
        longest = self._members[self._end - 1][self.stream]  # per row: its stream's longest request
        n_full = self.prompt // self.block_size
        owner = np.repeat(np.arange(n_full.size), n_full)
        j = np.arange(int(n_full.sum())) - (np.cumsum(n_full) - n_full)[owner]
        differs = self._keys[self._offsets[owner] + j] != self._keys[self._offsets[longest[owner]] + j]
        if differs.any():
            at = int(np.argmax(differs))
            r = int(owner[at])
            raise ValueError(f"request {self.table.column('request_id')[r]} (stream "
                             f"{self.stream_names[self.stream[r]]}) is not a prefix of its stream's longest "
                             f"request: block {j[at]} differs")

    def prompt_ids(self, row: int) -> np.ndarray:
        """Prompt token ids of a request (int32)."""
        return self._ranges(self.stream[[row]], self.prompt[[row]], self.prompt[[row]] * 0)

    def output_ids(self, row: int) -> np.ndarray:
        """The output ids the fake runner emits for a request: the stream tokens after its prompt."""
        return self._ranges(self.stream[[row]], self.output[[row]], self.prompt[[row]])

    def stream_keys(self, streams: np.ndarray, block_size: int = VLLM_BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
        """(concatenated :func:`block_keys`, blocks per stream) of the full blocks inside each stream's longest prompt.

        Blocks past it hold tokens of the stream's own last output, which no prompt reads: they are unique to
        the stream. Keys are computed in chunks of about ``_CHUNK_TOKENS`` tokens to bound memory.
        """
        streams = np.asarray(streams, np.int64)
        lengths = self.stream_prompt[streams] // block_size * block_size
        chunk_end = np.flatnonzero(np.diff(np.cumsum(lengths) // _CHUNK_TOKENS, append=-1)) + 1
        keys = [block_keys(self._ranges(streams[lo:hi], lengths[lo:hi], lengths[lo:hi] * 0), lengths[lo:hi],
                           block_size) for lo, hi in zip(np.r_[0, chunk_end[:-1]], chunk_end)]
        return (np.concatenate(keys) if keys else np.empty(0, np.uint64)), lengths // block_size

    def blocks_needed(self, streams: np.ndarray, block_size: int = VLLM_BLOCK_SIZE) -> int:
        """Distinct blocks holding ``streams`` at once at full length (shared full blocks once)."""
        keys, in_prompts = self.stream_keys(streams, block_size)
        full = -(-self.stream_length[streams] // block_size)  # blocks of each stream, its partial tail included
        return int(np.unique(keys).size + (full - in_prompts).sum())  # blocks past the prompts are the stream's own

    def _ranges(self, streams: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Concatenated ids of stream positions [start, start + length) for each (stream, length, start)."""
        # Member pieces: range i meets member k of its stream on [P_(k-1), P_k); past the last, the extension.
        first = self._first[streams]
        n_slots = self._end[streams] - first + 1
        rng = np.repeat(np.arange(streams.size), n_slots)
        slot = np.arange(int(n_slots.sum())) - (np.cumsum(n_slots) - n_slots)[rng] + first[rng]
        extension = slot == self._end[streams][rng]
        member = self._members[np.minimum(slot, self._members.size - 1)]
        prev = self._members[np.maximum(slot - 1, 0)]
        lo = np.where(slot == first[rng], 0, self.prompt[prev])
        hi = np.where(extension, np.iinfo(np.int64).max, self.prompt[member])
        lo, hi = np.maximum(lo, starts[rng]), np.minimum(hi, (starts + lengths)[rng])
        keep = lo < hi
        rng, member, extension, lo, hi = rng[keep], member[keep], extension[keep], lo[keep], hi[keep]
        # Block pieces: a member piece splits at the workload's block boundaries; the extension stays whole.
        bs = self.block_size
        b0 = np.where(extension, 0, lo // bs)
        n_pieces = np.where(extension, 1, (hi - 1) // bs - b0 + 1)
        piece = np.repeat(np.arange(lo.size), n_pieces)
        block = np.arange(int(n_pieces.sum())) - (np.cumsum(n_pieces) - n_pieces)[piece] + b0[piece]
        ext = extension[piece]
        p_lo = np.where(ext, lo[piece], np.maximum(lo[piece], block * bs))
        p_hi = np.where(ext, hi[piece], np.minimum(hi[piece], (block + 1) * bs))
        key = np.where(ext, self._stream_key[streams[rng[piece]]],
                       self._keys[np.where(ext, self._keys.size - 1, self._offsets[member[piece]] + block)])
        j0 = np.where(ext, p_lo, p_lo - block * bs)  # index of the piece's first token: p % bs, or p past the prompts
        size = p_hi - p_lo
        out_start = np.cumsum(size) - size
        j = np.arange(int(size.sum())) - np.repeat(out_start - j0, size)
        return _ids(np.repeat(key, size), j, self.vocab_size)

    def causal_order(self) -> np.ndarray:
        """Rows in an order where each request follows what it builds on: by arrival if all known, else (step, rank)."""
        rows = np.arange(self.table.num_rows)
        arrival = self.table.column("arrival_s")
        if arrival.null_count == 0:
            return rows[np.lexsort((rows, arrival.to_numpy()))]
        return rows[np.lexsort((rows, self.rank, self.table.column("step").to_numpy()))]


def unlimited_cached_tokens(
    tokens: WorkloadTokens,
    *,
    include_outputs: bool = True,
    order: np.ndarray | None = None,
    partition: np.ndarray | None = None,
    block_size: int = VLLM_BLOCK_SIZE,
) -> np.ndarray:
    """Per row (table order), prompt tokens an unlimited vLLM prefix cache hits; see the module docstring.

    ``order``: replay order of rows (default :meth:`WorkloadTokens.causal_order`); rows left out are
    neither counted (0) nor registered. ``partition``: per row, the cache it uses (e.g. its replica).
    """
    order = tokens.causal_order() if order is None else np.asarray(order, np.int64)
    n = tokens.table.num_rows
    streams = np.unique(tokens.stream[order])
    keys, counts = tokens.stream_keys(streams, block_size)
    where, counts_of = np.zeros((2, len(tokens.stream_names)), np.int64)
    where[streams] = np.cumsum(counts) - counts  # stream -> its first key
    counts_of[streams] = counts
    prompt, output = tokens.prompt[order], tokens.output[order]
    n_query = prompt // block_size
    n_reg = np.maximum((prompt + output - 1) // block_size, n_query) if include_outputs else n_query
    n_reg = np.minimum(n_reg, counts_of[tokens.stream[order]])  # blocks past every prompt are never queried
    # References: each request's first n_reg stream blocks, in replay order; its first n_query are its prompt's.
    rank = np.repeat(np.arange(order.size), n_reg)
    position = np.arange(int(n_reg.sum())) - (np.cumsum(n_reg) - n_reg)[rank]
    ref = keys[where[tokens.stream[order]][rank] + position]
    if partition is not None:
        with np.errstate(over="ignore"):
            ref = splitmix64(ref + np.asarray(partition).astype(np.uint64)[order][rank] * _GOLDEN)
    _, first, inverse = np.unique(ref, return_index=True, return_inverse=True)  # first: earliest rank
    hit = rank[first][inverse.ravel()] < rank  # registered by an earlier request
    query = position < n_query[rank]
    first_miss = np.where(hit, n_query[rank], position)[query]
    leading = np.zeros(order.size, np.int64)
    nonempty = n_query > 0
    if nonempty.any():
        leading[nonempty] = np.minimum.reduceat(first_miss, (np.cumsum(n_query) - n_query)[nonempty])
    out = np.zeros(n, np.int64)
    out[order] = np.minimum(leading, np.maximum(prompt - 1, 0) // block_size) * block_size
    return out
