"""export_global / export_windows and their imports: exact byte counts, full hit exact, replay quality,
and rejection of truncated, corrupted or foreign blobs."""

from __future__ import annotations

import pytest
import torch

from model import (
    HEADER_BYTES,
    CacheFormatError,
    Transformer,
    cache_format,
    decode,
    export_global,
    export_windows,
    import_global,
    import_global_chunks,
    import_windows,
    init_random,
    kv_bytes,
    load_preset,
    model_fingerprint,
    prefill,
    state_from_global,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # small ops on a shared 2-core machine run much faster without OpenMP oversubscription
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return init_random(Transformer(load_preset("v41-tiny")), seed=0).eval()


@pytest.fixture(scope="module")
def fp(model: Transformer) -> bytes:
    return model_fingerprint(model)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_export_global_length_is_the_byte_formula(model: Transformer, fp: bytes) -> None:
    state = prefill(model, _tokens(131, 1), mode="ced").state
    per_token = kv_bytes(model.cfg).global_bytes_per_token
    assert per_token == 212
    for start, end in [(0, 64), (64, 128), (0, 2)]:
        assert len(export_global(state, start, end, fingerprint=fp)) == HEADER_BYTES + (end - start) * 212
    # a tail chunk ending inside an open ratio-2 group carries that group's ratio-1 entry only
    assert len(export_global(state, 128, 131, fingerprint=fp)) == HEADER_BYTES + 106 * (1 + 1 + 3)


@torch.inference_mode()
def test_state_from_global_accepts_a_tail_shorter_than_a_group(model: Transformer, fp: bytes) -> None:
    # [64, 65) holds a ratio-1 entry but no ratio-2 entry of the encoder sources: importing it must work
    tokens = _tokens(65, 5)
    state = prefill(model, tokens, mode="ced").state
    blobs = [export_global(state, 0, 64, fingerprint=fp), export_global(state, 64, 65, fingerprint=fp)]
    rebuilt = state_from_global(model, tokens, blobs, fingerprint=fp)
    assert rebuilt.n_tokens == 65
    for layer, src in state.sources.items():
        assert torch.equal(rebuilt.sources[layer].kv_packed, src.kv_packed), layer
        assert torch.equal(rebuilt.sources[layer].index_packed, src.index_packed), layer


@torch.inference_mode()
def test_export_keeps_stored_codes(model: Transformer, fp: bytes) -> None:
    state = prefill(model, _tokens(40, 2), mode="ced").state
    blob = export_global(state, 0, 40, fingerprint=fp)
    src = state.sources[2]
    first_entry = bytes(src.kv_packed[0, 0].tolist() + src.kv_scales[0, 0].tolist())
    assert blob[HEADER_BYTES : HEADER_BYTES + len(first_entry)] == first_entry


@torch.inference_mode()
@pytest.mark.parametrize("n_new", [3, 45], ids=["fewer-than-W", "more-than-W"])
def test_full_hit_through_export_import_is_exact(model: Transformer, fp: bytes, n_new: int) -> None:
    toks = _tokens(101 + 4 + n_new, 3)
    first = prefill(model, toks[:, :101], mode="ced")
    state, logits = first.state, first.logits
    for _ in range(4):
        state_tokens = logits.argmax(-1)
        logits = decode(model, state_tokens, state).logits
    history = state.tokens.clone()
    p = history.size(1)
    # odd P: the open ratio-2 group travels in the windows entry
    assert p % 2 == 1
    chunks = [export_global(state, 0, 64, fingerprint=fp), export_global(state, 64, p, fingerprint=fp)]
    pool = export_windows(model, state, fingerprint=fp)
    restored = state_from_global(model, history, chunks, fingerprint=fp)
    import_windows(model, restored, pool, fingerprint=fp)
    new = _tokens(n_new, 4)
    uninterrupted = prefill(model, new, state, mode="ced")
    hit = prefill(model, new, restored, mode="ced")
    assert hit.stats.start == p  # no replay
    assert torch.equal(hit.logits, uninterrupted.logits)
    nxt = hit.logits.argmax(-1)
    assert torch.equal(decode(model, nxt, restored).logits, decode(model, nxt, uninterrupted.state).logits)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.float(), -1)
    q = torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@torch.inference_mode()
def test_global_only_replay_beats_empty_windows_and_is_exact_for_short_prompts(
    model: Transformer, fp: bytes
) -> None:
    toks = _tokens(200, 5)
    kl_replay, kl_empty = [], []
    for p in (64, 97, 150):
        n = p + 6
        cold = prefill(model, toks[:, :n], mode="ced", all_logits=True).logits
        stored = prefill(model, toks[:, :p], mode="ced").state
        chunks = [export_global(stored, 0, p, fingerprint=fp)]
        replay = prefill(
            model,
            toks[:, p:n],
            state_from_global(model, toks[:, :p], chunks, fingerprint=fp),
            mode="ced",
            all_logits=True,
        )
        assert replay.stats.start == max(0, p - 32) // 2 * 2
        # no replay: the suffix reads no window before P (what losing the pool costs without replay)
        empty_state = state_from_global(model, toks[:, :p], chunks, fingerprint=fp)
        empty = model.run(
            toks[:, p:n],
            empty_state,
            start=p,
            enc_floor=p,
            dec_from=max(p, n - 32),
            dec_floor=max(p, n - 32),
            all_logits=True,
        )
        kl_replay.append(_kl(cold[:, -6:], replay.logits[:, -6:]))
        kl_empty.append(_kl(cold[:, -6:], empty.logits[:, -6:]))
    assert sum(kl_replay) < sum(kl_empty), (kl_replay, kl_empty)
    print(f"KL(cold||replay) {kl_replay}  KL(cold||empty windows) {kl_empty}")
    short = prefill(model, toks[:, :20], mode="ced").state
    restored = state_from_global(
        model, toks[:, :20], [export_global(short, 0, 20, fingerprint=fp)], fingerprint=fp
    )
    assert torch.equal(
        prefill(model, toks[:, 20:23], restored, mode="ced").logits,
        prefill(model, toks[:, :23], mode="ced").logits,
    )


@torch.inference_mode()
def test_corrupt_or_foreign_blobs_are_rejected(model: Transformer, fp: bytes) -> None:
    state = prefill(model, _tokens(64, 6), mode="ced").state
    blob = export_global(state, 0, 64, fingerprint=fp)
    pool = export_windows(model, state, fingerprint=fp)
    toks = state.tokens
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 100] ^= 0x10
    bad = {
        "truncated": blob[:-1],
        "header only": blob[: HEADER_BYTES - 3],
        "bit flip": bytes(flipped),
        "other fingerprint": export_global(state, 0, 64, fingerprint=bytes(32)),
        "windows blob": pool,
    }
    for name, b in bad.items():
        with pytest.raises(CacheFormatError):
            state_from_global(model, toks, [b], fingerprint=fp)
        assert name
    with pytest.raises(CacheFormatError, match="end at position"):
        state_from_global(model, toks, [export_global(state, 0, 32, fingerprint=fp)], fingerprint=fp)
    restored = state_from_global(model, toks, [blob], fingerprint=fp)
    with pytest.raises(CacheFormatError):
        import_windows(model, restored, pool[:-5], fingerprint=fp)
    other = prefill(model, _tokens(10, 7), mode="ced").state
    with pytest.raises(CacheFormatError, match="position"):
        import_windows(model, restored, export_windows(model, other, fingerprint=fp), fingerprint=fp)


@torch.inference_mode()
def test_a_windows_payload_of_another_size_is_refused_naming_both_and_leaves_the_state(
    model: Transformer, fp: bytes
) -> None:
    state = prefill(model, _tokens(37, 9), mode="ced").state
    pool = export_windows(model, state, fingerprint=fp)
    payload = pool[HEADER_BYTES:]
    restored = state_from_global(model, state.tokens, [export_global(state, 0, 37, fingerprint=fp)],
                                 fingerprint=fp)  # fmt: skip
    before = ([w.clone() for w in restored.windows], list(restored.window_from), restored.enc_from)
    # well-formed blobs (header, checksum) whose payload is a byte longer or shorter than this model's
    for wrong in (payload + b"\0", payload[:-1]):
        blob = cache_format._pack(cache_format.WINDOWS_MAGIC, fp, 37, 0, wrong)
        with pytest.raises(CacheFormatError, match=f"{len(wrong)} bytes, its windows take {len(payload)}"):
            import_windows(model, restored, blob, fingerprint=fp)
    assert all(torch.equal(a, b) for a, b in zip(before[0], restored.windows, strict=True))
    assert (before[1], before[2]) == (restored.window_from, restored.enc_from)


def test_payload_fields_are_views_where_aligned_and_copies_elsewhere() -> None:
    values = torch.arange(12, dtype=torch.float32)
    for lead in (0, 1, 3, 4):
        raw = torch.frombuffer(bytearray(b"\x7f" * lead + values.numpy().tobytes()), dtype=torch.uint8)
        got = cache_format._field(raw, lead, 48, torch.float32, (3, 4))
        assert torch.equal(got, values.reshape(3, 4)), lead
        # a view shares the payload's memory; a misaligned field is a copy of its own
        assert (got.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()) == (lead % 4 == 0)


def _same_sources(a, b) -> bool:
    fields = ("kv", "index_k", "kv_packed", "kv_scales", "index_packed", "index_scales")
    return sorted(a.sources) == sorted(b.sources) and all(
        torch.equal(getattr(a.sources[i], f).view(torch.uint8), getattr(b.sources[i], f).view(torch.uint8))
        and getattr(a.sources[i], f).shape == getattr(b.sources[i], f).shape
        for i in a.sources
        for f in fields
    )


@torch.inference_mode()
def test_import_global_chunks_equals_chunk_by_chunk_import(model: Transformer, fp: bytes) -> None:
    state = prefill(model, _tokens(301, 7), mode="ced").state
    # chunk starts are multiples of every ratio; a two-token chunk, and a tail ending inside a group
    cuts = [0, 64, 66, 192, 194, 256, 301]
    blobs = [export_global(state, a, b, fingerprint=fp) for a, b in zip(cuts, cuts[1:], strict=False)]
    slow, fast = model.new_state(1), model.new_state(1)
    for blob in blobs:
        import_global(slow, blob, fingerprint=fp)
    done = import_global_chunks(fast, blobs, fingerprint=fp)
    assert (done.end, done.imported, done.failure) == (301, len(blobs), None)
    assert _same_sources(slow, fast)


@torch.inference_mode()
def test_import_global_chunks_keeps_the_chunks_before_a_refused_one(model: Transformer, fp: bytes) -> None:
    state = prefill(model, _tokens(200, 8), mode="ced").state
    blobs = [export_global(state, a, a + 50, fingerprint=fp) for a in (0, 50, 100, 150)]
    corrupt = bytearray(blobs[2])
    corrupt[-1] ^= 0xFF
    blobs[2] = bytes(corrupt)
    slow, fast = model.new_state(1), model.new_state(1)
    for blob in blobs[:2]:
        import_global(slow, blob, fingerprint=fp)
    with pytest.raises(CacheFormatError) as refused:
        import_global(slow.clone(), blobs[2], fingerprint=fp)
    done = import_global_chunks(fast, blobs, fingerprint=fp)
    assert (done.end, done.imported, done.failure) == (100, 2, str(refused.value))
    assert _same_sources(slow, fast)
    # a gap is refused the same way, with nothing appended
    empty = model.new_state(1)
    gap = import_global_chunks(empty, blobs[1:2], fingerprint=fp)
    assert (gap.end, gap.imported) == (None, 0) and "chunk starts at 50" in gap.failure
    assert all(src.n_entries == 0 for src in empty.sources.values())
