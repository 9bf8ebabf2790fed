import pytest
import torch

from onecard.prepare import quant


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_matches_compressed_tensors(bits):
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(0)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    q = torch.randint(lo, hi, (7, 256), generator=g).to(torch.int8)
    ours = quant.pack(q, bits)
    theirs = ct.pack_to_int32(q, bits)
    assert ours.dtype == torch.int32 and torch.equal(ours, theirs)
    assert torch.equal(quant.unpack(ours, bits, 256), q)
    assert torch.equal(ct.unpack_from_int32(ours, bits, torch.Size([7, 256])), q)


@pytest.mark.parametrize("bits,bound", [(8, 0.008), (4, 0.12)])
def test_roundtrip_error_vs_float64_reference(bits, bound):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 512, generator=g) * 0.02).to(torch.bfloat16)
    t, err = quant.quantize_tensor(w, bits)
    assert t["weight_packed"].shape == (64, 512 * bits // 32)
    assert t["weight_scale"].shape == (64, 4) and t["weight_scale"].dtype == torch.bfloat16
    assert t["weight_shape"].tolist() == [64, 512] and t["weight_shape"].dtype == torch.int64
    # float64 reference of the same math
    w64 = w.double().reshape(64, 4, 128)
    s = t["weight_scale"].double().unsqueeze(2)
    qmax = (1 << (bits - 1)) - 1
    ref = (torch.round(w64 / s).clamp(-qmax - 1, qmax) * s).reshape(64, 512)
    deq = quant.dequantize(t["weight_packed"], t["weight_scale"], bits, (64, 512))
    assert torch.allclose(deq.double(), ref, atol=1e-7)
    assert 0 < err < bound


def test_refuses_large_error_and_bad_input():
    w = torch.randn(4, 256)
    with pytest.raises(quant.QuantError, match="exceeds"):
        quant.quantize_tensor(w, 4, max_rel_error=quant.MAX_REL_ERROR)  # int4 never meets the 1 % default
    with pytest.raises(quant.QuantError, match="valid: 4, 8"):
        quant.quantize_tensor(w, 3)
    with pytest.raises(quant.QuantError, match="multiple of group size"):
        quant.quantize_tensor(torch.randn(4, 200), 8)


def test_zero_rows_are_safe():
    t, err = quant.quantize_tensor(torch.zeros(2, 128), 8)
    assert err == 0.0
    assert torch.count_nonzero(quant.dequantize(t["weight_packed"], t["weight_scale"], 8, (2, 128))) == 0
