"""Top-k's and DGC's message kernels (kernels/triton/sparse.py, run by the interpreter in
blocks of 64) against the reference bit for bit: the message's bytes (indices, values in
fp32, fp16 or bf16, the pad before the dense values, the dense values), error feedback's
update, and the decoded sum with the dense values' sums in rank order."""
import pytest
import torch

from gradcomp.compressors.topk import SPARSE
from gradcomp.kernels import reference as ref
from gradcomp.kernels import triton as tk


def _message(lay, k, size):
    msg = torch.full((lay.nbytes,), 0xAB, dtype=torch.uint8)
    f = lay.unpack(msg)
    a, b = lay.spans["values"][0], lay.spans["dense"][0]
    return msg, f, msg[a + k * size : b]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("has_res", [True, False])
@pytest.mark.parametrize("W", [1, 3])
def test_encode_and_decode_equal_the_reference(dtype, has_res, W, monkeypatch):
    monkeypatch.setattr(tk.common, "BLOCK", 64)
    g = torch.Generator().manual_seed(W + 7 * has_res)
    n = 1000
    for k, D in ((151, 0), (151, 70), (0, 9)):
        idx = torch.randperm(600, generator=g)[:k]
        y = torch.randn(n, generator=g) * 1e3
        vals = y[idx].clone()
        vals[::7] = 0.0  # padding slots: value 0 at index 0
        idx[::7] = 0
        wire = vals.to(dtype)
        vals = wire.float()
        x = torch.randn(n, generator=g)
        x[650:655] = -0.0
        dense = torch.arange(640, 640 + D)
        lay = SPARSE.bind(k=k, dtype=dtype, n_dense=D)
        got = {}
        for name, mod in (("ref", ref), ("triton", tk)):
            msg, f, pad = _message(lay, k, wire.element_size())
            res = y.clone() if has_res else None
            mod.sparse_encode(wire, vals, idx, res, x, dense, f["indices"], f["values"],
                              f["dense"], pad)
            got[name] = msg, res
        assert torch.equal(got["ref"][0], got["triton"][0])
        assert not has_res or torch.equal(got["ref"][1], got["triton"][1])
        rows = got["ref"][0].repeat(W, 1)
        for w in range(1, W):  # other ranks' messages
            m, f, pad = _message(lay, k, wire.element_size())
            ref.sparse_encode(torch.randn(k, generator=g).to(dtype), vals, torch.randperm(
                600, generator=g)[:k], None, torch.randn(n, generator=g), dense, f["indices"],
                f["values"], f["dense"], pad)
            rows[w] = m
        va, da = lay.spans["values"][0], lay.spans["dense"][0]
        a = ref.sparse_decode(rows, k, va, dtype, da, torch.zeros(n), dense)
        b = tk.sparse_decode(rows, k, va, dtype, da, torch.zeros(n), dense)
        if W == 1:
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-3)  # atomics in any order
        assert torch.equal(a[dense].view(torch.int32), b[dense].view(torch.int32))
