"""Content-addressed reuse for one turn: the longest stored prefix of the turn's prompt among the tenant's
chunks (their keys are chained hashes of fingerprint, tenant salt and tokens, so any session's committed
chunks of the same tokens are found), and the tenant's pool windows of the longest pooled history the
prompt starts with (`WindowPool.find_prefix`), verified down to a state a full hit continues exactly.

Knows nothing of plans: the planner chooses among what this finds. What counts is what `read_prefix`
serves (verified chunks that a committed turn's registry row names) and pool entries whose envelope
names this fingerprint and the digest of exactly that prefix; the prompt's last token is always left to
compute, since the turn samples from its logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from model import CacheFormatError
from orchestrator.db import RetainedKeys
from orchestrator.engine.decoded_states import DecodedSources, DecodedStates
from orchestrator.engine.global_kv import StoredPrefix, encoded_ids, read_prefix
from orchestrator.engine.model_compute import ModelCompute, clone_with_windows
from orchestrator.engine.payload_digests import PayloadDigests
from orchestrator.engine.pool_entry import chunks_digest_of, unpack_pool_entry
from orchestrator.engine.served_models import ServedModel
from orchestrator.planner import PooledPrefix, PoolState
from storage import GlobalKVStore, PoolMiss, PrefixMatch, WindowPool, history_digest, token_bytes

__all__ = ["ContentReuse", "find_reuse", "lookup_result"]


@dataclass(kw_only=True)
class ContentReuse:
    """What a turn may resume from, found by content.

    Attributes:
        prefix: the longest usable stored prefix of the prompt without its last token.
        pool: this session's own pool entry as the planner's reason texts describe it.
        pooled: verified windows of a prompt prefix (None when none fits).
        pooled_prefix: the stored prefix of exactly [0, pooled.n_tokens) (`prefix` itself when it ends
            there; its state is not the full-hit state, which is a copy with the windows imported).
        full_hit_state: the state a full hit continues from (None without `pooled`).
        source_session: the session whose turn end pooled the windows.
    """

    prefix: StoredPrefix
    pool: PoolState
    pooled: PooledPrefix | None = None
    pooled_prefix: StoredPrefix | None = None
    full_hit_state: Any | None = None
    source_session: str | None = None


def lookup_result(prefix: StoredPrefix, history_len: int) -> str:
    """The cache-lookup metric's result of a turn: `hit` when the whole history is stored (and maybe
    more of the prompt, found by content), `partial`, `miss`, or `corrupt` (a chunk failed its checks)."""
    if prefix.lookup_result == "corrupt":
        return "corrupt"
    if prefix.n_tokens == 0:
        return "miss"
    return "hit" if prefix.n_tokens >= history_len else "partial"


def _own_entry(
    pool: WindowPool,
    tenant: str,
    session_id: str,
    served: ServedModel,
    history: Sequence[int],
    last_model: str | None,
) -> PoolState:
    """This session's pool entry as the reason texts see it, when no verified full hit continues its history
    (an entry that continues it but failed to import reads as absent: a plan never promises windows that are
    not there)."""
    got = pool.get(tenant, session_id)
    if isinstance(got, PoolMiss):
        return PoolState.absent()
    entry = unpack_pool_entry(got)
    if entry is None:
        return PoolState.absent()
    if entry.fingerprint != served.fingerprint:
        # Written by another model (the previous one on a switch) or by older weights of this one.
        other = last_model if last_model not in (None, served.name) else f"{served.name} (other weights)"
        return PoolState(model=other, windows_end=entry.n_tokens)
    if entry.n_tokens == len(history):
        return PoolState.absent()
    return PoolState(model=served.name, windows_end=entry.n_tokens)


def find_reuse(
    store: GlobalKVStore,
    pool: WindowPool,
    registry: Callable[[], Session],
    compute: ModelCompute,
    *,
    tenant: str,
    session_id: str,
    served: ServedModel,
    history: Sequence[int],
    new_tokens: Sequence[int],
    last_model: str | None,
    decoded: DecodedStates | None = None,
    digests: PayloadDigests | None = None,
    retained: RetainedKeys | None = None,
    kept_state_skips_reads: bool = True,
    history_ids: bytes | None = None,
) -> ContentReuse:
    """Find the stored prefix and pooled windows a turn of `session_id` may resume from.

    Args:
        registry: makes a read session of the registry (see `read_prefix`: opened after store calls).
        history, new_tokens: the session's history and this turn's tokens (> 0 of them).
        decoded: decoded global KV kept beside pool entries: the one kept with the pooled windows found
            fills the state instead of an import when the stored chunks are exactly its bytes.
        digests: payload digests kept by verified checksum (`read_prefix`).
        retained: the registry's retention check (`read_prefix`; default: through `registry`).
        kept_state_skips_reads: when the pooled windows found are this session's own and their kept
            decoded state fills the prefix, prove the chunks without reading them
            (`read_prefix(payloads_optional=True)`: the turn end exports its new chunks from the state
            and needs no stored payload). False reads every chunk (the twin).
        history_ids: `token_bytes(history)`, when the caller holds them (the turn rows' blobs as read).

    Raises:
        ValueError: `history_ids` that are not 4 bytes a token of `history`.
    """
    prompt = list(history) + list(new_tokens)
    probe = prompt[:-1]
    # the prompt's ids as the store and the digests take them, encoded once for every lookup below
    prompt_ids = encoded_ids(history, history_ids) + token_bytes(new_tokens)
    probe_ids = prompt_ids[: 4 * len(probe)]
    match = pool.find_prefix(tenant, served.fingerprint_hex, probe_ids) if probe else None
    memo = None
    if decoded is not None and match is not None:
        memo = decoded.get(tenant, match.session, fingerprint=served.fingerprint, pool_value=match.value)
    prefix = read_prefix(
        store,
        registry,
        tenant=tenant,
        served=served,
        history=probe,
        compute=compute,
        decoded=memo,
        digests=digests,
        retained=retained,
        payloads_optional=kept_state_skips_reads and match is not None and match.session == session_id,
        history_ids=probe_ids,
    )
    reuse = ContentReuse(prefix=prefix, pool=PoolState.absent())
    if match is not None:
        reuse = _verified(
            store,
            registry,
            compute,
            reuse,
            match,
            tenant,
            served,
            prompt,
            prompt_ids,
            memo,
            digests,
            retained,
        )
        if decoded is not None:
            exact = reuse.pooled_prefix
            decoded.record(hit=exact is not None and exact.decoded)
    if reuse.pooled is not None:
        reuse.pooled = dataclasses.replace(reuse.pooled, own=reuse.source_session == session_id)
    if reuse.pooled is not None and reuse.pooled.own and reuse.pooled.n_tokens == len(history):
        reuse.pool = PoolState(model=served.name, windows_end=len(history))
    elif history:
        reuse.pool = _own_entry(pool, tenant, session_id, served, history, last_model)
    return reuse


def _verified(
    store: GlobalKVStore,
    registry: Callable[[], Session],
    compute: ModelCompute,
    reuse: ContentReuse,
    match: PrefixMatch,
    tenant: str,
    served: ServedModel,
    prompt: list[int],
    prompt_ids: bytes,
    memo: DecodedSources | None = None,
    digests: PayloadDigests | None = None,
    retained: RetainedKeys | None = None,
) -> ContentReuse:
    """`reuse` with the pooled windows of `match` (the pool's lookup by content) when they continue a
    prompt prefix exactly: envelope (fingerprint, length, history digest: the lookup's digest of the
    prompt's prefix when the envelope names the length it matched), the stored global KV of exactly that
    prefix with the very bytes the windows were computed over (chunks digest), a clean import.
    `prompt_ids`: `token_bytes(prompt)`."""
    entry = unpack_pool_entry(match.value)
    if entry is None or not 0 < entry.n_tokens < len(prompt):
        return reuse
    n = entry.n_tokens
    digest = match.digest if match.n_tokens == n else history_digest(prompt_ids[: 4 * n])
    if entry.continues(served.fingerprint, prompt[:n], digest=digest) is not None:
        return reuse
    prefix = reuse.prefix
    if prefix.n_tokens < n:
        # the chunks of [0, n) are not all stored and verified (the longest lookup would have found them)
        return reuse
    if prefix.n_tokens == n:
        exact = prefix
        assert prefix.state is not None
    else:
        # the longest prefix runs past n through a full chunk: read exactly [0, n) (the source's tail)
        exact = read_prefix(
            store,
            registry,
            tenant=tenant,
            served=served,
            history=prompt[:n],
            compute=compute,
            decoded=memo,
            digests=digests,
            retained=retained,
            history_ids=prompt_ids[: 4 * n],
        )
        if exact.n_tokens != n or exact.state is None:
            return reuse
    if chunks_digest_of(exact.ranges, exact.payload_hashes()) != entry.chunks:
        # The stored bytes of this prefix are not the ones the windows were computed over (a chunk of the
        # same tokens kept another writer's bytes, or was deleted and written anew): not provably exact.
        return reuse
    try:
        # the prefix state stays as it is (a global-only replay starts from it)
        state = clone_with_windows(compute, served, exact.state, entry.windows)
    except CacheFormatError:
        return reuse
    return dataclasses.replace(
        reuse,
        pooled=PooledPrefix(model=served.name, n_tokens=n),
        pooled_prefix=exact,
        full_hit_state=state,
        source_session=match.session,
    )
