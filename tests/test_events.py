"""Block hashes as telemetry int64s: the bytes and int forms agree, and the sign is two's complement."""

from __future__ import annotations

import pytest

from serving_hook.events import hash_to_int64, hashes_to_int64


@pytest.mark.parametrize("v", [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF, 0xFEDCBA9876543210])
def test_bytes_and_int_forms_give_the_same_signed_int64(v: int) -> None:
    expected = v - 2**64 if v >= 2**63 else v
    digest = bytes(range(24)) + v.to_bytes(8, "big")  # a sha256-sized digest whose low 64 bits are v
    assert hash_to_int64(v) == hash_to_int64(digest) == hash_to_int64(bytearray(digest)) == expected
    assert hashes_to_int64([v, digest, v | (1 << 70)]) == [expected, expected, expected]
    assert -(2**63) <= expected < 2**63


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100])
def test_a_list_of_digests_converts_like_one_at_a_time(n: int) -> None:
    """Lists of sha256 digests (converted at once from 8 on) agree with :func:`hash_to_int64`, as do mixed or
    uneven lists and iterators (converted one by one)."""
    import hashlib

    digests = [hashlib.sha256(str(i).encode()).digest() for i in range(n)]
    edge = [(2**63).to_bytes(8, "big") * 4, (2**64 - 1).to_bytes(32, "big"), bytes(32)]
    for hs in (digests, digests + edge, edge + digests, digests + [5, -1], digests + [b"\x01" * 12]):
        expected = [hash_to_int64(h) for h in hs]
        got = hashes_to_int64(hs)
        assert got == expected and all(type(x) is int for x in got)
        assert hashes_to_int64(iter(hs)) == expected
    assert hashes_to_int64([]) == []
