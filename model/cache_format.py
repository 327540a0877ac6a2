"""Versioned byte format of cache state: global KV chunks and the encoder window pool entry.

Knows nothing of storage keys or policy; it turns a `ModelState`'s stored forms into bytes and back,
never re-quantizing (codes and scales are copied as stored). Layout (little-endian):

header (96 B): magic (4: b"KVRG" global, b"KVRW" windows), version u16, reserved u16, fingerprint (32 B),
    a u64, b u64 (global: start, end positions; windows: n_tokens, 0), payload length u64,
    sha256(payload) truncated to 16 B.
global payload: for each kv source in layer order, for each entry j in [start // m, end // m):
    main codes (D/2 B) | main E4M3 scales (D/16 B) | index codes (D_I/2 B) | index E8M0 scales (D_I/32 B).
    Its length is exactly (end - start) * Σ_s (9/16 D + 17/32 D_I) / m_s when start and end are multiples
    of every ratio (V41_SPEC §10.2: 212 B/token for v41-tiny, 890 for the released model).
windows payload: for each encoder layer: window_from u64 | FP8 codes (W*D B) | UE8M0 scales (W*D/32 B);
    for each encoder kv source with ratio > 1: carry kv and carry score (2 * m*D fp32);
    then enc_from u64 | encoder-output lanes (W*hc*dim bf16) | pending pre-mix (W*hc fp32).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import math
import struct
from dataclasses import dataclass

import torch

from kernels import dequantize_fp4_e4m3, dequantize_fp8_ue8m0, dequantize_mxfp4
from model.checkpoint import weights_fingerprint
from model.errors import CacheFormatError
from model.numerics import NumericsProfile
from model.state import ModelState, SourceCache
from model.transformer import Transformer

CACHE_FORMAT_VERSION = 1
GLOBAL_MAGIC = b"KVRG"
WINDOWS_MAGIC = b"KVRW"
_HEADER = struct.Struct("<4sHH32sQQQ16s")
HEADER_BYTES = _HEADER.size


def model_fingerprint(model: Transformer, numerics: NumericsProfile | None = None) -> bytes:
    """32-byte digest of the config, the weights, the cache format version and the numerics profile.

    Args:
        numerics: the arithmetic the caches are computed with (default: the portable CPU profile of the
            torch kernels); caches from another profile are misses.
    """
    numerics = numerics if numerics is not None else NumericsProfile()
    h = hashlib.sha256(b"kvresume.model_fingerprint.v1\0")
    h.update(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
    h.update(weights_fingerprint(model.state_dict()).encode())
    h.update(f"\0format={CACHE_FORMAT_VERSION}\0{numerics.label}".encode())
    return h.digest()


def _pack(magic: bytes, fingerprint: bytes, a: int, b: int, payload: bytes) -> bytes:
    if len(fingerprint) != 32:
        raise ValueError(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
    digest = hashlib.sha256(payload).digest()[:16]
    return _HEADER.pack(magic, CACHE_FORMAT_VERSION, 0, fingerprint, a, b, len(payload), digest) + payload


def _unpack(blob: bytes, magic: bytes, fingerprint: bytes) -> tuple[int, int, memoryview]:
    if len(blob) < HEADER_BYTES:
        raise CacheFormatError(f"cache blob truncated: {len(blob)} bytes, header needs {HEADER_BYTES}")
    got_magic, version, _, fp, a, b, length, digest = _HEADER.unpack_from(blob)
    if got_magic != magic:
        raise CacheFormatError(f"cache blob magic {got_magic!r}, expected {magic!r}")
    if version != CACHE_FORMAT_VERSION:
        raise CacheFormatError(f"cache format version {version}, this model reads {CACHE_FORMAT_VERSION}")
    if fp != fingerprint:
        raise CacheFormatError("cache blob was written by another model fingerprint")
    payload = memoryview(blob)[HEADER_BYTES:]
    if len(payload) != length:
        raise CacheFormatError(f"cache payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest()[:16] != digest:
        raise CacheFormatError("cache payload checksum mismatch")
    return a, b, payload


def _bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as raw bytes, in row-major order."""
    if t.device.type == "cpu" and t.is_contiguous():
        # one copy straight from its memory (data_ptr: where its first element lies): the same bytes as
        # the chain below, without its five dispatched ops, each of which lets go of the GIL (a model
        # process's turn-end export, which runs beside a forward pass, made about 12 such calls a turn)
        n = t.numel() * t.element_size()
        return ctypes.string_at(t.data_ptr(), n) if n else b""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _row_bytes(t: torch.Tensor, row: int) -> bytes:
    """`_bytes(t[row])`: of a batch-1 tensor, its own bytes (row 0 is all of it), without the view."""
    return _bytes(t) if row == 0 and t.size(0) == 1 else _bytes(t[row])


def _take(payload: memoryview, offset: int, n: int, dtype: torch.dtype, shape: tuple[int, ...]):
    if n == 0:
        # A chunk shorter than a source's group holds no entry of it; frombuffer rejects empty buffers.
        return torch.empty(shape, dtype=dtype), offset
    raw = torch.frombuffer(bytearray(payload[offset : offset + n]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape), offset + n


def _field(raw: torch.Tensor, offset: int, n: int, dtype: torch.dtype, shape: tuple[int, ...]):
    """Bytes [offset, offset + n) of `raw` (uint8) as `dtype` in `shape`: a view where the offset is a
    multiple of the dtype's size (what `view(dtype)` of an offset slice needs), else a copy."""
    part = raw[offset : offset + n]
    if offset % dtype.itemsize:
        part = part.clone()
    return part.view(dtype).reshape(shape)


def export_global(state: ModelState, start: int, end: int, *, fingerprint: bytes, row: int = 0) -> bytes:
    """Global KV of positions [start, end) of batch row `row`, as stored (no re-quantization).

    Entries of source m are [start // m, end // m); a chunk that ends inside an open group leaves that
    group to the next chunk.

    Raises:
        ValueError: a range outside [0, n_tokens] or start not a multiple of every ratio.
    """
    if not 0 <= start <= end <= state.n_tokens:
        raise ValueError(f"range [{start}, {end}) must lie in [0, n_tokens={state.n_tokens}]")
    parts = []
    for layer in sorted(state.sources):
        src = state.sources[layer]
        if start % src.ratio:
            raise ValueError(f"start {start} is not a multiple of layer {layer}'s ratio {src.ratio}")
        sl = slice(start // src.ratio, end // src.ratio)
        fields = [src.kv_packed, src.kv_scales, src.index_packed, src.index_scales]
        entry = torch.cat([f[row, sl] for f in fields], dim=-1)  # [n, D/2 + D/16 + D_I/2 + D_I/32] uint8
        parts.append(_bytes(entry))
    return _pack(GLOBAL_MAGIC, fingerprint, start, end, b"".join(parts))


def import_global(state: ModelState, blob: bytes, *, fingerprint: bytes) -> int:
    """Append a global chunk to a batch-1 state whose global KV ends exactly at the chunk's start.

    Concatenates the state's whole global KV once per call: many chunks go through
    `import_global_chunks` (linear time, bitwise equal; this is its slow twin). Only global KV changes
    (tokens, windows and carries are the caller's: see `state_from_global`).

    Returns:
        the chunk's end position.

    Raises:
        CacheFormatError: corrupt, foreign or non-contiguous chunk.
    """
    start, end, payload = _unpack(blob, GLOBAL_MAGIC, fingerprint)
    offset = 0
    updates = {}
    for layer in sorted(state.sources):
        src = state.sources[layer]
        m = src.ratio
        if start % m or src.n_entries != start // m:
            raise CacheFormatError(
                f"chunk starts at {start} but layer {layer} holds {src.n_entries} entries of ratio {m}"
            )
        n = end // m - start // m
        d2, d16 = src.kv_packed.size(-1), src.kv_scales.size(-1)
        i2, i32 = src.index_packed.size(-1), src.index_scales.size(-1)
        width = d2 + d16 + i2 + i32
        if offset + n * width > len(payload):
            raise CacheFormatError(f"chunk payload too short for layer {layer}")
        entry, offset = _take(payload, offset, n * width, torch.uint8, (1, n, width))
        entry = entry.to(src.kv.device)
        kv_p, kv_s, ix_p, ix_s = entry.split([d2, d16, i2, i32], dim=-1)
        kv_e4m3 = kv_s.contiguous().view(torch.float8_e4m3fn)
        kv = dequantize_fp4_e4m3(kv_p.contiguous(), kv_e4m3, torch.bfloat16)
        ix = dequantize_mxfp4(ix_p.contiguous(), ix_s.contiguous(), torch.bfloat16)
        updates[layer] = SourceCache(
            ratio=m,
            kv=torch.cat([src.kv, kv], 1),
            index_k=torch.cat([src.index_k, ix], 1),
            kv_packed=torch.cat([src.kv_packed, kv_p], 1),
            kv_scales=torch.cat([src.kv_scales, kv_s], 1),
            index_packed=torch.cat([src.index_packed, ix_p], 1),
            index_scales=torch.cat([src.index_scales, ix_s], 1),
            carry_kv=src.carry_kv,
            carry_score=src.carry_score,
        )
    if offset != len(payload):
        raise CacheFormatError(f"chunk payload has {len(payload) - offset} trailing bytes")
    state.sources.update(updates)
    return end


@dataclass(frozen=True, kw_only=True)
class ChunkImport:
    """What `import_global_chunks` appended.

    Attributes:
        end: the end position of the last chunk appended (None when none was).
        imported: how many of the chunks, from the first, were appended.
        failure: why chunk number `imported` was refused (what `import_global` would raise for it), or
            None when every chunk was appended.
        ends: the end position of each appended chunk, in order (each starts where the one before ends).
    """

    end: int | None
    imported: int
    failure: str | None = None
    ends: tuple[int, ...] = ()


def _entry_width(src: SourceCache) -> tuple[int, int, int, int]:
    """Bytes of one stored entry's fields: main codes, main scales, index codes, index scales."""
    fields = (src.kv_packed, src.kv_scales, src.index_packed, src.index_scales)
    return tuple(f.size(-1) for f in fields)  # type: ignore[return-value]


def _chunk_slices(
    layout: list[tuple[int, int, int]], entries: dict[int, int], blob: bytes, fingerprint: bytes
) -> tuple[int, dict[int, memoryview]]:
    """Validate one chunk against the entries each source holds so far (the checks of `import_global`).

    Args:
        layout: (layer, ratio, entry bytes) of every source in layer order, computed once per import
            (per chunk it cost a fifth of a 64K-token import).

    Returns:
        the chunk's end position and, per source, its entry bytes ([n, width] row-major).

    Raises:
        CacheFormatError: corrupt, foreign or non-contiguous chunk.
    """
    start, end, payload = _unpack(blob, GLOBAL_MAGIC, fingerprint)
    if end < start:
        raise CacheFormatError(f"chunk ends at {end}, before its start {start}")
    offset = 0
    slices = {}
    for layer, m, width in layout:
        if start % m or entries[layer] != start // m:
            raise CacheFormatError(
                f"chunk starts at {start} but layer {layer} holds {entries[layer]} entries of ratio {m}"
            )
        size = (end // m - start // m) * width
        if offset + size > len(payload):
            raise CacheFormatError(f"chunk payload too short for layer {layer}")
        slices[layer] = payload[offset : offset + size]
        offset += size
    if offset != len(payload):
        raise CacheFormatError(f"chunk payload has {len(payload) - offset} trailing bytes")
    return end, slices


def import_global_chunks(state: ModelState, blobs: list[bytes], *, fingerprint: bytes) -> ChunkImport:
    """Append consecutive global chunks to a batch-1 state in time linear in their bytes.

    The fast twin of calling `import_global` on each chunk in turn (which concatenates the whole history
    once per chunk): every chunk is validated first, each source's entry bytes are gathered into one
    buffer, dequantized once and concatenated once. The state ends up bitwise equal to the chunk-by-chunk
    import of the same accepted chunks (tested); the first chunk `import_global` would refuse ends the
    import, and the chunks before it are kept.

    Args:
        blobs: chunks in position order, the first starting where the state's global KV ends.

    Returns:
        ChunkImport: the new end, the number of chunks appended, and why the next one was refused.
    """
    sources = state.sources
    entries = {layer: src.n_entries for layer, src in sources.items()}
    parts: dict[int, list[memoryview]] = {layer: [] for layer in sources}
    layout = [(layer, sources[layer].ratio, sum(_entry_width(sources[layer]))) for layer in sorted(sources)]
    end, imported, failure, ends = None, 0, None, []
    for blob in blobs:
        try:
            chunk_end, slices = _chunk_slices(layout, entries, blob, fingerprint)
        except CacheFormatError as exc:
            failure = str(exc)
            break
        for layer, m, _ in layout:
            parts[layer].append(slices[layer])
            entries[layer] = chunk_end // m
        end, imported = chunk_end, imported + 1
        ends.append(chunk_end)
    if imported == 0:
        return ChunkImport(end=end, imported=0, failure=failure)
    updates = {}
    for layer in sorted(sources):
        src = sources[layer]
        widths = _entry_width(src)
        n = entries[layer] - src.n_entries
        if n == 0:
            continue
        # one copy of the entry bytes into a buffer torch can own; frombuffer then shares it
        buffer = bytearray(n * sum(widths))
        view, pos = memoryview(buffer), 0
        for piece in parts[layer]:
            view[pos : pos + len(piece)] = piece
            pos += len(piece)
        entry = torch.frombuffer(buffer, dtype=torch.uint8).view(1, n, sum(widths)).to(src.kv.device)
        kv_p, kv_s, ix_p, ix_s = (t.contiguous() for t in entry.split(list(widths), dim=-1))
        kv = dequantize_fp4_e4m3(kv_p, kv_s.view(torch.float8_e4m3fn), torch.bfloat16)
        ix = dequantize_mxfp4(ix_p, ix_s, torch.bfloat16)

        def append(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return new if old.size(1) == 0 else torch.cat([old, new], 1)

        updates[layer] = dataclasses.replace(
            src,
            kv=append(src.kv, kv),
            index_k=append(src.index_k, ix),
            kv_packed=append(src.kv_packed, kv_p),
            kv_scales=append(src.kv_scales, kv_s),
            index_packed=append(src.index_packed, ix_p),
            index_scales=append(src.index_scales, ix_s),
        )
    sources.update(updates)
    return ChunkImport(end=end, imported=imported, failure=failure, ends=tuple(ends))


def state_from_global(
    model: Transformer, tokens: torch.Tensor, blobs: list[bytes], *, fingerprint: bytes
) -> ModelState:
    """A batch-1 state holding the global KV of `tokens` from consecutive chunks, windows absent.

    The next `prefill` then replays the encoder over the last W stored tokens (bounded replay).

    Args:
        tokens: [1, P] int64 token history the chunks were computed from.

    Raises:
        CacheFormatError: a corrupt or foreign chunk, a gap, or chunks that do not end at P.
    """
    state = model.new_state(1, device=tokens.device)
    done = import_global_chunks(state, blobs, fingerprint=fingerprint)
    if done.failure is not None:
        raise CacheFormatError(done.failure)
    end = done.end or 0
    if end != tokens.size(1):
        raise CacheFormatError(f"chunks end at position {end} but the history has {tokens.size(1)} tokens")
    state.tokens = tokens.clone()
    layers = range(model.cfg.n_layers)
    state.drop_windows(layers)
    state.drop_encoder_rows()
    return state


def _encoder_layers(model: Transformer) -> range:
    return range(model.split if model.split is not None else model.cfg.n_layers)


def export_windows(model: Transformer, state: ModelState, *, fingerprint: bytes, row: int = 0) -> bytes:
    """The encoder pool entry of batch row `row`: encoder window rings (FP8 codes and scales as stored),
    open-group carries of encoder kv sources, and the encoder-output rows of the last W positions."""
    parts = []
    encoder = _encoder_layers(model)
    for i in encoder:
        parts.append(struct.pack("<Q", state.window_from[i]))
        parts.append(_row_bytes(state.window_codes[i], row) + _row_bytes(state.window_scales[i], row))
    for layer in sorted(state.sources):
        src = state.sources[layer]
        if layer in encoder and src.carry_kv is not None and src.carry_score is not None:
            parts.append(_row_bytes(src.carry_kv, row) + _row_bytes(src.carry_score, row))
    assert state.enc_lanes is not None and state.enc_pre is not None
    parts.append(struct.pack("<Q", state.enc_from))
    parts.append(_row_bytes(state.enc_lanes, row) + _row_bytes(state.enc_pre, row))
    return _pack(WINDOWS_MAGIC, fingerprint, state.n_tokens, 0, b"".join(parts))


def import_windows(model: Transformer, state: ModelState, blob: bytes, *, fingerprint: bytes) -> None:
    """Restore the encoder pool entry into a batch-1 state at the same position (after `state_from_global`).

    A full hit runs this once a turn, so the payload is copied once and every field is a view of that copy
    (where its offset suits its dtype; else a copy of its own), and the encoder layers' rings are
    dequantized in one call (elementwise: the same values as one call per layer). The fields share that
    one allocation, which only this state holds.

    Raises:
        CacheFormatError: corrupt or foreign blob, or a pool entry for another position.
    """
    n_tokens, _, payload = _unpack(blob, WINDOWS_MAGIC, fingerprint)
    if n_tokens != state.n_tokens:
        raise CacheFormatError(f"window entry is for position {n_tokens}, the state is at {state.n_tokens}")
    cfg = model.cfg
    w, d, dev = cfg.window_size, cfg.head_dim, state.device
    hc, dim = cfg.hc_mult, cfg.dim
    layers = _encoder_layers(model)
    carried = [
        layer
        for layer in sorted(state.sources)
        if layer in layers and state.sources[layer].carry_kv is not None
    ]
    # the layout `export_windows` writes, checked whole before anything is read
    ring = 8 + w * d + w * d // 32
    carry_bytes = [8 * math.prod(state.sources[layer].carry_kv.shape[1:]) for layer in carried]
    size = len(layers) * ring + sum(carry_bytes) + 8 + 2 * w * hc * dim + 4 * w * hc
    if len(payload) != size:
        raise CacheFormatError(
            f"window entry payload does not fit this model: {len(payload)} bytes, its windows take {size}"
        )
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    offset = 0
    codes, scales = [], []
    for i in layers:
        (state.window_from[i],) = struct.unpack_from("<Q", payload, offset)
        codes.append(_field(raw, offset + 8, w * d, torch.float8_e4m3fn, (1, w, d)))
        scales.append(_field(raw, offset + 8 + w * d, w * d // 32, torch.uint8, (1, w, d // 32)))
        offset += ring
    if codes:
        rings = dequantize_fp8_ue8m0(torch.cat(codes), torch.cat(scales), torch.bfloat16).to(dev)
        for j, i in enumerate(layers):
            state.window_codes[i], state.window_scales[i] = codes[j].to(dev), scales[j].to(dev)
            state.windows[i] = rings[j : j + 1]
    for layer, n in zip(carried, carry_bytes, strict=True):
        src = state.sources[layer]
        shape = (1, *src.carry_kv.shape[1:])
        kv = _field(raw, offset, n // 2, torch.float32, shape)
        score = _field(raw, offset + n // 2, n // 2, torch.float32, shape)
        state.sources[layer] = dataclasses.replace(src, carry_kv=kv.to(dev), carry_score=score.to(dev))
        offset += n
    (state.enc_from,) = struct.unpack_from("<Q", payload, offset)
    lanes = _field(raw, offset + 8, 2 * w * hc * dim, torch.bfloat16, (1, w, hc, dim))
    pre = _field(raw, offset + 8 + 2 * w * hc * dim, 4 * w * hc, torch.float32, (1, w, hc))
    state.enc_lanes, state.enc_pre = lanes.to(dev), pre.to(dev)
