"""On-disk value of one chunk: header, opaque payload, sha256 checksum. Knows nothing of what the
payload means (model/ owns that format) nor of where the value is kept.

Layout (little-endian):
    magic "KVRC" | format_version u16 | header_len u16 |
    address 32s | tenant_tag 16s | start u64 | n_tokens u32 | created_at f64 | floor_until f64 |
    ceiling_at f64 | payload_len u64 | fingerprint_len u16 | fingerprint utf-8 |
    payload | sha256(everything before)
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import StrEnum

from storage.chunk_key import ADDRESS_BYTES, TAG_BYTES

MAGIC = b"KVRC"
FORMAT_VERSION = 1
CHECKSUM_BYTES = 32
_PREFIX = struct.Struct("<4sHH")
_FIXED = struct.Struct(f"<{ADDRESS_BYTES}s{TAG_BYTES}sQIdddQH")


@dataclass(frozen=True, kw_only=True)
class ChunkHeader:
    """What a stored value says about itself; every field is checked against the request on read.

    Times are seconds since the epoch on the store's clock; token range is [start, start + n_tokens).
    """

    address: bytes
    tenant_tag: bytes
    model_fingerprint: str
    start: int
    n_tokens: int
    created_at: float
    floor_until: float
    ceiling_at: float
    payload_len: int

    @property
    def header_len(self) -> int:
        return _PREFIX.size + _FIXED.size + len(self.model_fingerprint.encode())


class ChunkDefect(StrEnum):
    """Why stored bytes are not served. Each one is a miss, never data."""

    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    ADDRESS_MISMATCH = "address_mismatch"
    TENANT_MISMATCH = "tenant_mismatch"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"


def encode_chunk(header: ChunkHeader, payload: bytes) -> bytes:
    """Header, payload and checksum as one value; len = header_len + len(payload) + 32."""
    if header.payload_len != len(payload):
        raise ValueError(f"header payload_len {header.payload_len} != payload length {len(payload)}")
    fp = header.model_fingerprint.encode()
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, header.header_len) + _FIXED.pack(
        header.address,
        header.tenant_tag,
        header.start,
        header.n_tokens,
        header.created_at,
        header.floor_until,
        header.ceiling_at,
        header.payload_len,
        len(fp),
    )
    digest = hashlib.sha256(head)
    digest.update(fp)
    digest.update(payload)
    return b"".join((head, fp, payload, digest.digest()))


def decode_chunk(
    value: bytes,
    *,
    address: bytes,
    tenant_tag: bytes,
    model_fingerprint: str,
) -> tuple[ChunkHeader, memoryview] | ChunkDefect:
    """Parse and verify a stored value against the address it was read from and who asks.

    Returns:
        (header, payload view) when every check passes, else the first defect found.
    """
    view = memoryview(value)
    if len(view) < _PREFIX.size + _FIXED.size + CHECKSUM_BYTES:
        return ChunkDefect.TRUNCATED
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        return ChunkDefect.BAD_MAGIC
    if version != FORMAT_VERSION:
        return ChunkDefect.BAD_VERSION
    fields = _FIXED.unpack_from(view, _PREFIX.size)
    payload_len, fp_len = fields[7], fields[8]
    if header_len != _PREFIX.size + _FIXED.size + fp_len:
        return ChunkDefect.TRUNCATED
    if len(view) != header_len + payload_len + CHECKSUM_BYTES:
        return ChunkDefect.TRUNCATED
    body_end = header_len + payload_len
    if hashlib.sha256(view[:body_end]).digest() != view[body_end:]:
        return ChunkDefect.CHECKSUM_MISMATCH
    header = ChunkHeader(
        address=fields[0],
        tenant_tag=fields[1],
        start=fields[2],
        n_tokens=fields[3],
        created_at=fields[4],
        floor_until=fields[5],
        ceiling_at=fields[6],
        payload_len=payload_len,
        model_fingerprint=bytes(view[_PREFIX.size + _FIXED.size : header_len]).decode("utf-8", "replace"),
    )
    if header.address != address:
        return ChunkDefect.ADDRESS_MISMATCH
    if header.tenant_tag != tenant_tag:
        return ChunkDefect.TENANT_MISMATCH
    if header.model_fingerprint != model_fingerprint:
        return ChunkDefect.FINGERPRINT_MISMATCH
    return header, view[header_len:body_end]
