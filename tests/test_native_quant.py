"""The block-quantized products (``fbs.native.quant``, ``csrc/quant.h``) against float64 references.

Oracles: the activation quantization against its PyTorch definition (q = round-half-even(x * 127 / max|x|) per
32-value block, exact), and each product against the float64 product of those quantized activations with the
dequantized weight, for every weight kind and every instruction-set path the CPU has (VNNI, AVX2 forced), on shapes
with tails that are not multiples of a tile or a block. A second check says the activation quantization is what
moves the result away from fp32: the error against fp32 activations is orders of magnitude above the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_native
from fbs.native import quant

SHAPES = [(1, 576, 576), (3, 1000, 1536), (8, 4099, 576), (2, 30, 70), (13, 49, 1000), (5, 17, 33), (1, 9, 8960),
          (16, 48, 96), (77, 33, 100), (133, 70, 600)]  # >= 16 rows: a prompt's path (q4 on VNNI: many rows a tile)


@pytest.fixture(params=["avx512-vnni", "avx2"])
def quant_isa(request, monkeypatch):
    need = "avx512_vnni" if request.param == "avx512-vnni" else "avx2"
    require_native(need)
    if request.param == "avx2":
        monkeypatch.setenv("FBS_NATIVE_ISA", "avx2")
    assert quant.isa() == request.param
    return request.param


def weights(kind: str, n: int, k: int, g: torch.Generator):
    """(packed, scales, dequantized fp64 (N, K)) of a random weight of ``kind``; q8_0 includes -128."""
    w = torch.randn(n, k, generator=g)
    kb = -(-k // quant.BLOCK)
    wb = torch.nn.functional.pad(w, (0, kb * quant.BLOCK - k)).view(n, kb, quant.BLOCK)
    if kind == "i8":
        s = w.abs().amax(1) / 127
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        return quant.pack("i8", q), quant.channel_scales(s), q.double() * s.double()[:, None]
    if kind == "q8_0":
        d = (wb.abs().amax(-1) / 127).half()
        q = torch.round(wb / d.float().clamp_min(1e-12)[..., None]).clamp(-128, 127).to(torch.int8)
        q[0, 0, 0] = -128
        deq = (q.double() * d.double()[..., None]).view(n, -1)[:, :k]
        return quant.pack("q8_0", q.view(n, -1)[:, :k], d), None, deq
    mn, mx = wb.amin(-1), wb.amax(-1)
    d, m = ((mx - mn) / 15).half(), mn.half()
    q = torch.round((wb - m.float()[..., None]) / d.float().clamp_min(1e-12)[..., None]).clamp(0, 15).to(torch.uint8)
    deq = (q.double() * d.double()[..., None] + m.double()[..., None]).view(n, -1)[:, :k]
    return quant.pack("q4_1", q.view(n, -1)[:, :k], d, m), None, deq


def test_activation_quantization_is_its_definition():
    require_native("avx2")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 1000, generator=g) * torch.rand(1, 1000, generator=g) * 5
    x[2, 64:96] = 0  # an all-zero block: scale 0, codes 0
    q, d, ds, c = quant._module().quant_activations(x)
    rq, rd = quant.activations(x)
    assert torch.equal(q, rq) and torch.equal(d, rd)
    assert q.abs().max() == 127 and torch.all(q[2, 64:96] == 0) and d[2, 2] == 0
    sums = q.view(7, -1, quant.BLOCK).sum(-1).float()
    torch.testing.assert_close(ds, d * sums, rtol=1e-6, atol=0)
    torch.testing.assert_close(c, 128 * (d.double() * sums.double()).sum(-1).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(quant.KINDS))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_products_equal_the_float64_reference(quant_isa, kind, m, n, k, one_thread):
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    packed, scales, deq = weights(kind, n, k, g)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 3
    y = quant.linear(x, packed, kind, n, scales)
    ref = quant.reference(x, deq)
    scale = ref.abs().max()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert (y.double() - ref).abs().max() <= 5e-6 * scale
    # fp32 activations give a clearly different product: the reference's quantization is the one the kernel did
    exact = x.double() @ deq.T
    assert (exact - ref).abs().max() > 1e-3 * scale


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [2, 4, 5, 8, 13, 141])
def test_several_rows_get_their_one_row_products(quant_isa, threads, rows):
    """Several rows' products (a batch or a verified draft: 2-13 rows; a prompt: 141 rows, split across threads) give
    each row exactly the bits of its one-row product, the decode step's: batching, verification and the block
    prefill (fbs.engine.prefill) rely on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(11)
        for kind in ("q4_1", "q8_0"):
            packed, scales, _ = weights(kind, 50, 1000, g)
            x = torch.randn(rows, 1000, generator=g) * torch.rand(1, 1000, generator=g) * 3
            y = quant.linear(x, packed, kind, 50, scales)
            one = torch.cat([quant.linear(x[i:i + 1], packed, kind, 50, scales) for i in range(rows)])
            assert torch.equal(y, one), kind
    finally:
        torch.set_num_threads(before)


def test_strided_rows_and_batched_shape(quant_isa):
    g = torch.Generator().manual_seed(5)
    packed, scales, deq = weights("q4_1", 40, 96, g)
    big = torch.randn(2, 3, 200, generator=g)
    x = big[..., 10:106]  # rows with a stride, not contiguous
    y = quant.linear(x, packed, "q4_1", 40)
    assert y.shape == (2, 3, 40)
    ref = quant.reference(x.reshape(-1, 96), deq).view(2, 3, 40)
    assert (y.double() - ref).abs().max() <= 5e-6 * ref.abs().max()


def test_bad_input_is_refused():
    require_native("avx2")
    g = torch.Generator().manual_seed(1)
    packed, scales, _ = weights("i8", 32, 64, g)
    with pytest.raises(RuntimeError, match="packed size"):
        quant.linear(torch.randn(1, 96), packed, "i8", 32, scales)
    with pytest.raises(RuntimeError, match="per-channel weights need"):
        quant.linear(torch.randn(1, 64), packed, "i8", 32, None)
    with pytest.raises(ValueError, match="weight kind must be one of"):
        quant.pack("q5", torch.zeros(4, 32, dtype=torch.int8))
    with pytest.raises(ValueError, match="q4_1 needs uint8"):
        quant.pack("q4_1", torch.zeros(4, 32, dtype=torch.int8))
