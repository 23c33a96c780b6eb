"""vLLM KV-cache events -> ``kv_events`` telemetry rows, and the hash convention.

Block hashes are ``bytes`` in vLLM v1 (sha256 digests by default). Telemetry
stores them as signed 64-bit integers (``data/schemas.py``). The conversion
is vLLM's own integer form (``maybe_convert_block_hash`` with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64 bits of the digest read
big-endian), reinterpreted as two's-complement signed. So a hash has the same
int64 whether it comes from a ``bytes`` event, an ``int`` event, or
``Request.block_hashes``, and it is deterministic across processes.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

_MASK = (1 << 64) - 1
_SIGN = 1 << 63


def hash_to_int64(h: Any) -> int:
    """A vLLM block hash (bytes, or vLLM's unsigned int form) as a signed int64."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        v = int.from_bytes(bytes(h[-8:]), "big")
    elif isinstance(h, int):
        v = h & _MASK
    else:  # BlockHashWithGroupId or anything else bytes-like
        v = int.from_bytes(bytes(h)[-8:], "big")
    return (v ^ _SIGN) - _SIGN  # two's complement: v - 2**64 when bit 63 is set


#: From this many ``bytes`` hashes on, :func:`hashes_to_int64` converts them in one numpy call.
_VECTOR_MIN = 8


def hashes_to_int64(hs: Iterable[Any]) -> list[int]:
    """:func:`hash_to_int64` of each hash (vLLM's int form converted inline; a list of equal-length ``bytes``
    digests, vLLM's default sha256 form, at once: the low 8 bytes of each read as big-endian int64)."""
    if type(hs) is not list:
        hs = list(hs)
    if len(hs) >= _VECTOR_MIN and type(hs[0]) is bytes:
        width = len(hs[0])
        if width and width % 8 == 0:
            try:  # bytes-like hashes only (an int raises)
                joined = b"".join(hs) if len(set(map(len, hs))) == 1 else None
            except TypeError:
                joined = None
            if joined is not None:
                import numpy as np

                words = width // 8  # each digest's last 8-byte word, big-endian signed
                return np.frombuffer(joined, dtype=">i8")[words - 1::words].tolist()
    return [((h & _MASK) ^ _SIGN) - _SIGN if type(h) is int else hash_to_int64(h) for h in hs]


def kv_event_hashes(events: Iterable[Any]) -> Iterator[tuple[str, list[int]]]:
    """``(kind, int64 block hashes)`` of vLLM ``KVCacheEvent`` objects, the kinds of :func:`kv_event_rows`."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    for ev in events:
        if isinstance(ev, BlockRemoved):
            yield "removed", hashes_to_int64(ev.block_hashes)
        elif isinstance(ev, BlockStored):
            yield "stored", hashes_to_int64(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            yield "cleared", []


def kv_event_rows(events: Iterable[Any], *, time_s: float, replica: int, engine_step: int) -> list[dict]:
    """Rows of the ``kv_events`` table for vLLM ``KVCacheEvent`` objects."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    rows: list[dict] = []
    for ev in events:
        parent: int | None = None
        num_tokens: int | None = None
        if isinstance(ev, BlockRemoved):  # the most frequent event
            kind = "removed"
            hashes = hashes_to_int64(ev.block_hashes)
            medium = ev.medium
        elif isinstance(ev, BlockStored):
            kind = "stored"
            hashes = hashes_to_int64(ev.block_hashes)
            if ev.parent_block_hash is not None:
                parent = hash_to_int64(ev.parent_block_hash)
            num_tokens = len(ev.token_ids) if ev.token_ids is not None else None
            medium = ev.medium
        elif isinstance(ev, AllBlocksCleared):
            kind = "cleared"
            hashes = []
            medium = None
        else:
            continue
        rows.append(
            {
                "time_s": time_s,
                "replica": replica,
                "engine_step": engine_step,
                "event": kind,
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "num_tokens": num_tokens,
                "medium": medium,
            }
        )
    return rows
