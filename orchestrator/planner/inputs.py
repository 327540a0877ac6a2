"""The planner's inputs: small frozen views of the session, the stored cache, the pool and the mappers.

Knows nothing of SQL, storage or the model: callers build these views (cache validity checks that need
bytes, such as checksums, tenant, purge, retention and fingerprint, happen below, in the store lookup
that produces `CacheInventory`; the planner enforces the positional and model rules).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelGeometry", "SessionView", "CacheInventory", "PoolState", "PooledPrefix", "MapperInfo"]


@dataclass(frozen=True, kw_only=True)
class ModelGeometry:
    """The receiving model's replay geometry, as plain ints from its config.

    Attributes:
        window: W, the sliding-window length (encoder windows and the decoder replay span).
        group: compression-group alignment (the lcm of the compression ratios); an encoder replay starts
            at a multiple of it so the compressor state is rebuilt from a group boundary.
    """

    window: int
    group: int

    def __post_init__(self) -> None:
        if self.window <= 0 or self.group <= 0:
            raise ValueError(f"window={self.window} and group={self.group} must be positive")


@dataclass(frozen=True, kw_only=True)
class SessionView:
    """The session as the planner sees it before the turn.

    Attributes:
        history_len: N, tokens already in the history (inputs and outputs of finished turns).
        new_tokens: M, tokens this turn appends (> 0).
        last_model: the model of the last finished turn; None when the session has none.
    """

    session_id: str
    tenant_id: str
    history_len: int
    new_tokens: int
    last_model: str | None

    def __post_init__(self) -> None:
        if self.history_len < 0:
            raise ValueError(f"history_len={self.history_len} must be >= 0")
        if self.new_tokens <= 0:
            raise ValueError(f"new_tokens={self.new_tokens}: a turn must append at least one token")
        if self.history_len > 0 and not self.last_model:
            raise ValueError(
                f"session {self.session_id} has {self.history_len} history tokens but no last model"
            )

    @property
    def prompt_len(self) -> int:
        return self.history_len + self.new_tokens


@dataclass(frozen=True, kw_only=True)
class CacheInventory:
    """What the store holds, verified, for one model and this turn's prompt (history + new tokens).

    The tenant's chunks are found by content (chained hashes of the tokens), so the prefix may extend past
    the history into the new tokens, and a new session's prompt may have one; it always leaves at least
    the prompt's last token to compute (the logits the turn samples from).

    Attributes:
        model: the model whose global KV this is.
        valid_prefix: length of the longest prefix [0, valid_prefix) of the prompt whose stored chunks
            all passed their checks (checksum, tenant, named by a committed turn's registry row, within
            retention, same fingerprint).
        miss_reason: why valid_prefix is shorter than the history (None when it covers it all).
        own_prefix: how much of valid_prefix this session's own registry links cover (None: all of it);
            the rest was found by content (written by other sessions of the tenant).
    """

    model: str
    valid_prefix: int
    miss_reason: str | None = None
    own_prefix: int | None = None

    def __post_init__(self) -> None:
        if self.valid_prefix < 0:
            raise ValueError(f"valid_prefix={self.valid_prefix} must be >= 0")
        if self.own_prefix is not None and not 0 <= self.own_prefix:
            raise ValueError(f"own_prefix={self.own_prefix} must be >= 0")

    @property
    def by_content(self) -> bool:
        """True when part of the prefix lies past what this session's own links cover."""
        return self.own_prefix is not None and self.valid_prefix > self.own_prefix

    @classmethod
    def empty(cls, model: str, reason: str) -> CacheInventory:
        return cls(model=model, valid_prefix=0, miss_reason=reason)


@dataclass(frozen=True, kw_only=True)
class PoolState:
    """The session's entry in the RAM window pool, if any.

    Attributes:
        model: model whose windows the entry holds (None: no entry, e.g. expired or evicted).
        windows_end: the history position the windows continue from (valid only if == history_len).
    """

    model: str | None = None
    windows_end: int = 0

    @classmethod
    def absent(cls) -> PoolState:
        return cls()


@dataclass(frozen=True, kw_only=True)
class PooledPrefix:
    """Pool windows that continue a prefix [0, n_tokens) of the prompt exactly, found by content.

    The caller has verified everything a full hit needs: the entry's envelope names this model's
    fingerprint, the length and the digest of prompt[:n_tokens]; the stored global KV of exactly that
    prefix was read and verified; the windows imported cleanly onto it.

    Attributes:
        model: the model whose windows these are.
        n_tokens: where the windows continue from (0 < n_tokens < prompt length).
        own: the entry is this session's own (else another session of the tenant pooled it).
    """

    model: str
    n_tokens: int
    own: bool = False

    def __post_init__(self) -> None:
        if self.n_tokens <= 0:
            raise ValueError(f"pooled prefix n_tokens={self.n_tokens} must be positive")


@dataclass(frozen=True, kw_only=True)
class MapperInfo:
    """A registered mapper; only one with `passed_gate` may be used, the highest `score` first."""

    mapper_id: str
    sender_model: str
    receiver_model: str
    passed_gate: bool
    score: float = 0.0
    # measured task retention (mapped / receiver's own answers) when its evaluation recorded one; the
    # plan's reason quotes it
    retention: float | None = None
