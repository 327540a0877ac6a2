"""ServedModelSpec.parse, default_model_specs (checkpoints when all are present), ModelRegistry, text
codecs, and the kernel backend in the fingerprint's numerics profile (load_served, the settings that
choose it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from model import (
    CacheFormatError,
    NumericsProfile,
    export_global,
    load_preset,
    model_fingerprint,
    prefill,
    state_from_global,
    weights_fingerprint,
)
from model.linear import Linear
from orchestrator.engine import (
    DEFAULT_SIBLINGS,
    ByteCodec,
    ModelRegistry,
    ServedModelSpec,
    build_node,
    choose_codec,
    default_model_specs,
    load_served,
)
from orchestrator.engine.served_models import pinned_alternates
from orchestrator.numerics_env import resolve_cpu_path
from orchestrator.settings import Settings, load_settings


def test_served_model_spec_parse() -> None:
    assert ServedModelSpec.parse("m", "checkpoint:/x/y").checkpoint == Path("/x/y")
    spec = ServedModelSpec.parse("m", "random:v41-tiny@7")
    assert (spec.config, spec.seed, spec.is_stand_in) == ("v41-tiny", 7, True)
    assert ServedModelSpec.parse("m", "random:/a/config.json").seed == 0
    for bad in ("v41-tiny", "random:", "random:v41-tiny@x", "weights:/x"):
        with pytest.raises(ValueError, match="m"):
            ServedModelSpec.parse("m", bad)


def test_default_model_specs_switch_to_shipped_checkpoints(tmp_path: Path) -> None:
    stand_ins = default_model_specs(tmp_path)
    assert list(stand_ins) == list(DEFAULT_SIBLINGS)
    assert all(s.is_stand_in for s in stand_ins.values())
    ckpts = [tmp_path / "checkpoints" / name for name in DEFAULT_SIBLINGS]
    for ckpt in ckpts:
        ckpt.mkdir(parents=True)
    (ckpts[0] / "config.json").write_text(json.dumps(load_preset("v41-tiny").to_dict()))
    # One sibling trained, the other not yet: never a mixed family (their vocabularies differ).
    assert default_model_specs(tmp_path) == stand_ins
    (ckpts[1] / "config.json").write_text(json.dumps(load_preset("v41-tiny").to_dict()))
    specs = default_model_specs(tmp_path)
    assert [s.checkpoint for s in specs.values()] == ckpts


def test_model_registry_loads_once_and_misses_unknown() -> None:
    reg = ModelRegistry.from_sources({"x": "random:v41-tiny@3"})
    assert reg.get("nope") is None
    served = reg.get("x")
    assert served is reg.get("x")
    assert len(served.fingerprint) == 32 and served.geometry.window == 32 and served.geometry.group == 2
    other = ModelRegistry.from_sources({"x": "random:v41-tiny@4"}).get("x")
    assert other.fingerprint != served.fingerprint


def test_choose_codec(tmp_path: Path) -> None:
    shipped = Path(__file__).resolve().parents[3] / "checkpoints" / "tokenizer" / "tokenizer.json"
    codec = choose_codec(512, [shipped])
    assert isinstance(codec, ByteCodec)
    assert codec.decode(codec.encode("héllo <key>")) == "héllo <key>"
    if shipped.is_file():
        bpe = choose_codec(1 << 16, [shipped])
        assert (
            bpe.name.startswith("bpe:")
            and bpe.decode(bpe.encode("def f(x): return x")) == "def f(x): return x"
        )
    with pytest.raises(ValueError, match="vocab_size=100"):
        choose_codec(100, [])


def test_load_served_fingerprint_names_the_kernel_backend() -> None:
    # Only fingerprinted, never run: the triton kernels need CUDA (or the interpreter) to run.
    spec = ServedModelSpec(name="x", config="v41-tiny", seed=3)
    on_torch = load_served(spec)
    on_triton = load_served(spec, kernel_backend="triton")
    assert (on_torch.model.kernel_backend, on_triton.model.kernel_backend) == ("torch", "triton")
    assert on_torch.fingerprint != on_triton.fingerprint
    with torch.inference_mode():
        pinned = resolve_cpu_path("auto")  # the suite's path (tests/conftest.py)
        numerics = NumericsProfile(cpu_path=pinned)
        assert on_torch.fingerprint == model_fingerprint(on_torch.model, numerics=numerics)
        assert on_triton.fingerprint == model_fingerprint(
            on_triton.model, numerics=NumericsProfile(kernel_backend="triton", cpu_path=pinned)
        )
    assert on_triton.numerics.label == (
        f"numerics.v1 device=cpu dtype=bf16 kernels=triton cpu={pinned} math=exact batching=invariant"
    )
    # Same weights either way: only the numerics label differs.
    same = weights_fingerprint(on_torch.model.state_dict())
    assert same == weights_fingerprint(on_triton.model.state_dict())
    reg = ModelRegistry.from_sources({"x": "random:v41-tiny@3"}, kernel_backend="triton")
    assert reg.kernel_backend == "triton" and reg.get("x").fingerprint == on_triton.fingerprint
    assert ModelRegistry.from_sources({"x": "random:v41-tiny@3"}).get("x").fingerprint == on_torch.fingerprint
    with pytest.raises(ValueError, match="cuda-graphs"):
        ModelRegistry.from_sources({"x": "random:v41-tiny@3"}, kernel_backend="cuda-graphs")
    with pytest.raises(ValueError, match="cuda-graphs"):
        load_served(spec, kernel_backend="cuda-graphs")


def test_build_node_serves_the_configured_kernel_backend(tmp_path: Path) -> None:
    assert Settings().model_kernel_backend == "torch"
    with pytest.raises(ValueError, match="model_kernel_backend='cuda-graphs'"):
        load_settings(environ={"KVRESUME_MODEL_KERNEL_BACKEND": "cuda-graphs"})
    settings = load_settings(
        environ={"KVRESUME_MODEL_KERNEL_BACKEND": "triton"},
        overrides={"data_dir": str(tmp_path), "metrics_enabled": False},
    )
    settings = dataclasses.replace(settings, served_models={"x": "random:v41-tiny@3"}, kv_chunk_tokens=32)
    node = build_node(settings)
    try:
        assert node.registry.kernel_backend == "triton"
        expected = load_served(ServedModelSpec(name="x", config="v41-tiny", seed=3), kernel_backend="triton")
        assert node.registry.get("x").fingerprint == expected.fingerprint
    finally:
        node.close()


def test_fast_linear_math_is_served_under_its_own_fingerprint() -> None:
    """`model_math = "fast"` (issue 16's fast profile): the served model's quantized linears run the
    folded-scale GEMM, the numerics label says math=fast, and its caches carry another fingerprint, so a
    cache of one math is refused by a model of the other (a miss, never a hit)."""
    spec = ServedModelSpec(name="x", config="v41-tiny", seed=3)
    exact, fast = load_served(spec), load_served(spec, linear_math="fast")
    linears = [m for m in fast.model.modules() if isinstance(m, Linear) and m.quantized]
    assert linears and all(m.math == "fast" for m in linears)
    assert fast.numerics.math == "fast" and "math=fast" in fast.numerics.label
    assert fast.fingerprint != exact.fingerprint
    with torch.inference_mode():
        state = prefill(fast.model, torch.arange(1, 33).view(1, 32)).state
        blob = export_global(state, 0, 32, fingerprint=fast.fingerprint)
        with pytest.raises(CacheFormatError, match="fingerprint"):
            state_from_global(exact.model, state.tokens, [blob], fingerprint=exact.fingerprint)
    reg = ModelRegistry.from_sources({"x": "random:v41-tiny@3"}, linear_math="fast")
    assert reg.linear_math == "fast" and reg.get("x").fingerprint == fast.fingerprint
    with pytest.raises(ValueError, match="linear_math"):
        load_served(spec, linear_math="folded")
    with pytest.raises(ValueError, match="model_math"):
        Settings(model_math="folded")


def test_released_weights_keep_the_fingerprint_and_load_again_on_demand() -> None:
    spec = ServedModelSpec(name="x", config="v41-tiny", seed=4)
    held = load_served(spec)
    released = load_served(spec, hold_weights=False)
    assert held.weights_held and not released.weights_held
    assert released.fingerprint == held.fingerprint and released.numerics == held.numerics
    assert released.pinned_alternates == pinned_alternates(held.model, held.numerics)
    assert all(p.device.type == "meta" for p in released.model.parameters())
    assert (released.vocab_size, released.geometry) == (held.vocab_size, held.geometry)
    assert held.weights() is held.model
    again = released.weights()
    assert again is released.weights()  # loaded once, then kept
    with torch.inference_mode():
        assert model_fingerprint(again, numerics=released.numerics) == held.fingerprint


def test_a_node_whose_models_compute_in_a_model_process_keeps_their_fingerprints_not_weights(
    tmp_path: Path,
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        metrics_enabled=False,
        served_models={"x": "random:v41-tiny@3"},
        kv_chunk_tokens=32,
        model_process="separate",
    )
    node = build_node(settings)
    try:
        served = node.registry.get("x")
        assert served is not None and not served.weights_held
        assert all(p.device.type == "meta" for p in served.model.parameters())
        # the model process computes under this very fingerprint (checked before the pass) and gives the
        # logits the weights give here
        out = node.engine.compute.prefill(served, [20, 21, 22, 23], None, prompt_end=4)
        held = load_served(ServedModelSpec(name="x", config="v41-tiny", seed=3))
        assert held.fingerprint == served.fingerprint
        with torch.inference_mode():
            want = prefill(held.model, torch.tensor([[20, 21, 22, 23]]), mode="ced", prompt_end=4)
        assert torch.equal(out.logits, want.logits)
    finally:
        node.close()


def test_load_served_probes_the_compiled_sparse_attention_before_serving() -> None:
    """The compiled sparse attention's first-use probe runs at load for the widths every pass takes (the
    window, the window plus the selection), not in the first turns served; a model whose weights live
    elsewhere (a service beside a model process) probes nothing."""
    from kernels.sparse_attn import cpu as sparse_cpu

    spec = ServedModelSpec(name="x", config="v41-tiny", seed=3)
    cfg = load_preset("v41-tiny")
    widths = {cfg.window_size, cfg.window_size + cfg.index_topk}
    assert all(w <= 64 for w in widths), "one block a width, so one probe each"
    sparse_cpu._takes_block.cache_clear()
    load_served(spec, hold_weights=False)
    assert sparse_cpu._takes_block.cache_info().currsize == 0
    load_served(spec)
    if sparse_cpu._library() is None:
        return  # no compiler: nothing to probe, the reference serves
    probed = sparse_cpu._takes_block.cache_info()
    assert probed.currsize == len(widths)
    for w in widths:  # answered from the cache: no probe left for a pass to pay
        sparse_cpu.takes(cfg.n_heads, cfg.head_dim, w)
    assert sparse_cpu._takes_block.cache_info().misses == probed.misses
