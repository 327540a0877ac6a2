"""encode_chunk / decode_chunk: every stored byte is covered; each defect is named, never data."""

from __future__ import annotations

import os
import random

import pytest

from storage.chunk_format import ChunkDefect, ChunkHeader, decode_chunk, encode_chunk

ADDR = bytes(range(32))
TAG = bytes(range(16))


def _header(payload: bytes, fp: str = "fp") -> ChunkHeader:
    return ChunkHeader(
        address=ADDR,
        tenant_tag=TAG,
        model_fingerprint=fp,
        start=256,
        n_tokens=256,
        created_at=1.5,
        floor_until=2.5,
        ceiling_at=3.5,
        payload_len=len(payload),
    )


def test_decode_chunk_roundtrip() -> None:
    payload = os.urandom(1000)
    value = encode_chunk(_header(payload, "ünïcode-fp"), payload)
    assert len(value) == _header(payload, "ünïcode-fp").header_len + 1000 + 32
    header, got = decode_chunk(value, address=ADDR, tenant_tag=TAG, model_fingerprint="ünïcode-fp")
    assert bytes(got) == payload and header == _header(payload, "ünïcode-fp")


def test_decode_chunk_every_flipped_byte_is_a_defect() -> None:
    payload = os.urandom(64)
    value = encode_chunk(_header(payload), payload)
    rng = random.Random(0)
    for pos in range(len(value)):
        bad = bytearray(value)
        bad[pos] ^= 1 << rng.randrange(8)
        got = decode_chunk(bytes(bad), address=ADDR, tenant_tag=TAG, model_fingerprint="fp")
        assert isinstance(got, ChunkDefect), f"flip at byte {pos} was served"


@pytest.mark.parametrize("cut", [0, 1, 10, 60, -33, -1])
def test_decode_chunk_truncated(cut: int) -> None:
    payload = os.urandom(64)
    value = encode_chunk(_header(payload), payload)
    got = decode_chunk(value[:cut], address=ADDR, tenant_tag=TAG, model_fingerprint="fp")
    assert got in (ChunkDefect.TRUNCATED, ChunkDefect.CHECKSUM_MISMATCH)


def test_decode_chunk_wrong_address_tenant_fingerprint() -> None:
    payload = os.urandom(64)
    value = encode_chunk(_header(payload), payload)
    other = bytes(32)
    assert (
        decode_chunk(value, address=other, tenant_tag=TAG, model_fingerprint="fp")
        == ChunkDefect.ADDRESS_MISMATCH
    )
    assert (
        decode_chunk(value, address=ADDR, tenant_tag=bytes(16), model_fingerprint="fp")
        == ChunkDefect.TENANT_MISMATCH
    )
    assert (
        decode_chunk(value, address=ADDR, tenant_tag=TAG, model_fingerprint="fp2")
        == ChunkDefect.FINGERPRINT_MISMATCH
    )
    assert (
        decode_chunk(b"XXXX" + value[4:], address=ADDR, tenant_tag=TAG, model_fingerprint="fp")
        == ChunkDefect.BAD_MAGIC
    )


def test_encode_chunk_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError, match="payload_len"):
        encode_chunk(_header(b"abc"), b"abcd")
