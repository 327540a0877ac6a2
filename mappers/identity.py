"""The exact identity mapper between two configs of identical KV geometry (sibling checkpoints of one
shape, or one model under two names). Knows nothing of weights: it pairs kv sources by their order.
"""

from __future__ import annotations

from mappers.artifact import GateSpec, KVMapper, LayerMap, ModelRef, PartMap
from mappers.geometry import sources_of
from model import ModelConfig

# An identity map is exact by construction (codes are copied when the RoPE tables agree), so it is not
# gated on measured figures; a caller who wants it measured evaluates it like any other mapper.
_UNGATED = GateSpec(min_attn_cosine=None, max_next_token_kl=None, min_index_recall=None, min_retention=None)


def identity_mapper(
    sender_cfg: ModelConfig,
    receiver_cfg: ModelConfig,
    *,
    sender_name: str = "sender",
    receiver_name: str = "receiver",
    sender_fingerprint: bytes | None = None,
    receiver_fingerprint: bytes | None = None,
) -> KVMapper:
    """The identity map: receiver kv source i reads sender kv source i unchanged.

    When both configs also share the compressed-layer RoPE parameters, `apply_mapper` copies the stored
    FP4/MXFP4 codes and scales bit for bit; otherwise it strips the sender's rotation, applies the
    receiver's and re-quantizes.

    Args:
        sender_fingerprint, receiver_fingerprint: 32-byte `model.model_fingerprint` values binding the
            mapper to two checkpoints, or None to bind it to the configs only.

    Raises:
        ValueError: the kv-source count, a ratio or a width differs (named).
    """
    s_src, r_src = sources_of(sender_cfg), sources_of(receiver_cfg)
    if len(s_src) != len(r_src):
        raise ValueError(
            f"identity needs as many kv sources: sender {[s.layer for s in s_src]}, "
            f"receiver {[r.layer for r in r_src]}"
        )
    layers = []
    for s, r in zip(s_src, r_src, strict=True):
        for what in ("ratio", "head_dim", "index_head_dim"):
            if getattr(s, what) != getattr(r, what):
                raise ValueError(
                    f"identity needs equal {what}: sender layer {s.layer} has {getattr(s, what)}, "
                    f"receiver layer {r.layer} has {getattr(r, what)}"
                )
        part = PartMap(kind="identity", sender_layers=(s.layer,))
        layers.append(LayerMap(receiver_layer=r.layer, ratio=r.ratio, kv=part, index=part))
    return KVMapper(
        sender=ModelRef(name=sender_name, fingerprint=_hex(sender_fingerprint), config=sender_cfg),
        receiver=ModelRef(name=receiver_name, fingerprint=_hex(receiver_fingerprint), config=receiver_cfg),
        layers=tuple(layers),
        gate=_UNGATED,
        passed_gate=True,
    )


def _hex(fingerprint: bytes | None) -> str | None:
    if fingerprint is None:
        return None
    if len(fingerprint) != 32:
        raise ValueError(f"a model fingerprint is 32 bytes, got {len(fingerprint)}")
    return fingerprint.hex()
