"""The compiled CPU bf16 linear (kernels/bf16_gemm) against its slow twin, torch's own F.linear: every
output's bits, on fresh random inputs of the model's widths and the edges of the C code's order (one tail
step, whole 64-wide chunks, chunks plus a tail, N not a multiple of the block's 8 or 16 outputs,
wide-range values, sums that cancel so that their order shows in nearly every output, subnormal products
that tell a fused multiply-add from a plain one, NaN and infinities); and that the first-use probe refuses
another order."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import bf16_linear, pack_bf16_weight
from kernels.bf16_gemm import bf16_linear_takes_compiled_path, cpu
from model.linear import Linear

pytestmark = pytest.mark.skipif(
    not cpu.usable(), reason="not torch's AVX2 kernels with oneDNN off, or no C compiler: F.linear alone"
)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def _wide(g: torch.Generator, *shape: int, low: int = -8, high: int = 8) -> torch.Tensor:
    exponent = torch.randint(low, high + 1, shape, generator=g).float()
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return (sign * torch.exp2(exponent) * (1 + torch.rand(shape, generator=g))).bfloat16()


@pytest.mark.parametrize("k", [16, 32, 48, 64, 96, 128, 144, 192, 1024])
def test_compiled_linear_equals_torch_bit_for_bit(k: int) -> None:
    seed = random.SystemRandom().randrange(2**31)  # fresh inputs every run; the seed is in the message
    g = torch.Generator().manual_seed(seed)
    for m, n in [(2, 1), (3, 7), (4, 9), (6, 33), (7, 8), (64, 96), (257, 129)]:
        for x, w in [
            (torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()),
            (_wide(g, m, k), _wide(g, n, k)),
            cpu.cancelling(g, m, n, k),
        ]:
            assert bf16_linear_takes_compiled_path(x, w)
            got = cpu.linear_packed(x, pack_bf16_weight(w), n)
            assert got is not None
            assert torch.equal(_bits(got), _bits(F.linear(x, w))), (seed, k, m, n)


def test_the_probe_refuses_another_order_of_the_sums(monkeypatch) -> None:
    """Sums in another order (exact in fp64, rounded once; or each output a plain fp32 chain) must fail the
    probe: on wide-range values alone they matched torch in all but 0-1 of 2211 outputs a shape."""

    def exact(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return (x.double() @ w.double().T).bfloat16()

    def chain(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        acc = torch.zeros(x.size(0), n)
        for i in range(x.size(1)):
            acc = acc + x[:, i : i + 1].float() * w[:, i].float()
        return acc.bfloat16()

    monkeypatch.setattr(cpu, "pack_weight", lambda w: w)  # the fakes take the weight as it is
    for other in (exact, chain):
        monkeypatch.setattr(cpu, "linear_packed", other)
        assert not cpu._probe.__wrapped__()
    monkeypatch.undo()
    assert cpu._probe.__wrapped__()


def test_the_packed_weight_has_one_vector_register_of_outputs_per_block() -> None:
    """16 outputs a block where the build targets AVX-512F (one 512-bit register), 8 elsewhere (one AVX2
    register): the library says which, and `pack_bf16_weight` packs to match (zeros past N)."""
    from kernels.native import cpu_flags

    per = cpu.outputs_per_block()
    assert per == (16 if "avx512f" in cpu_flags() else 8)
    w = torch.randn(19, 32).bfloat16()
    packed = pack_bf16_weight(w)
    assert packed.shape == (-(-19 // per), 32, per)
    assert torch.equal(packed.transpose(1, 2).reshape(-1, 32)[:19], w.float())
    assert not packed.transpose(1, 2).reshape(-1, 32)[19:].any()


def test_tiny_products_and_non_finite_values_keep_every_bit() -> None:
    """Products below fp32's normal range are rounded once inside a fused multiply-add and once more by a
    plain multiply, so they pin the fusing; a NaN anywhere makes the canonical quiet NaN, infinities of
    both signs a NaN, one infinity an infinity."""
    g = torch.Generator().manual_seed(11)
    x, w = _wide(g, 40, 96, low=-70, high=-60), _wide(g, 24, 96, low=-70, high=-60)
    want = F.linear(x, w)
    assert (want != 0).any()
    assert torch.equal(_bits(bf16_linear(x, w)), _bits(want))
    x, w = torch.randn(6, 64, generator=g).bfloat16(), torch.randn(9, 64, generator=g).bfloat16()
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2, 5], x[2, 6] = float("inf"), float("-inf")
    w[4, 6] = 0.0
    want = F.linear(x, w)
    got = bf16_linear(x, w)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(_bits(got[finite]), _bits(want[finite]))


def test_bf16_linear_keeps_torch_where_it_is_not_covered() -> None:
    """One row (ATen's gemv), a K that is not a multiple of 16 (ATen's unmeasured scalar tail), fp32
    inputs and leading batch dims: the result is F.linear's every time, compiled or not."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(33, 96, generator=g).bfloat16()
    one = torch.randn(1, 96, generator=g).bfloat16()
    assert not bf16_linear_takes_compiled_path(one, w)
    assert torch.equal(bf16_linear(one, w), F.linear(one, w))
    odd = torch.randn(5, 40, generator=g).bfloat16()
    w40 = torch.randn(8, 40, generator=g).bfloat16()
    assert not bf16_linear_takes_compiled_path(odd, w40)
    assert torch.equal(bf16_linear(odd, w40), F.linear(odd, w40))
    batched = torch.randn(2, 3, 5, 96, generator=g).bfloat16()
    assert bf16_linear_takes_compiled_path(batched, w)
    assert torch.equal(_bits(bf16_linear(batched, w)), _bits(F.linear(batched, w)))


def test_a_bf16_linear_module_repacks_when_its_weight_changes() -> None:
    """The module keeps its packed weight until the weight changes in place (load_state_dict copies into
    it): the product after the change is the new weight's."""
    g = torch.Generator().manual_seed(5)
    layer = Linear(64, 40, "bf16")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 64, generator=g).bfloat16())
    x = torch.randn(7, 64, generator=g).bfloat16()
    with torch.no_grad():
        assert torch.equal(_bits(layer(x)), _bits(F.linear(x, layer.weight)))
        layer.weight.copy_(torch.randn(40, 64, generator=g).bfloat16())
        assert torch.equal(_bits(layer(x)), _bits(F.linear(x, layer.weight)))


def test_a_product_autograd_records_stays_torch_and_gets_its_gradients() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 64, generator=g).bfloat16()
    w = torch.randn(10, 64, generator=g).bfloat16().requires_grad_()
    assert not bf16_linear_takes_compiled_path(x, w)
    bf16_linear(x, w).float().sum().backward()
    assert w.grad is not None and torch.equal(w.grad, F.linear(x, w).new_ones(6, 10).t().mm(x).to(w.grad))
    with torch.no_grad():
        assert bf16_linear_takes_compiled_path(x, w)
