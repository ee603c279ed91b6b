"""Work buffers reused across exchanges on the CPU (``scratch``: gradcomp/kernels/work.py,
re-exported by compressors/base.py): no result aliases one, and exchanges on several threads
at once do not share one; results written into the bucket itself."""
import threading

import pytest
import torch

from gradcomp.compressors.base import METHODS, scratch
from conftest import lay_out, state_for

SHAPES = [("w", (96, 64)), ("b", (96,)), ("c", (32, 16, 3, 3)), ("v", (7,))]


def test_scratch_is_per_thread_and_key_and_grows():
    a = scratch("t.a", 10, torch.float32, "cpu")
    assert scratch("t.a", 8, torch.float32, "cpu").data_ptr() == a.data_ptr()
    assert scratch("t.b", 10, torch.float32, "cpu").data_ptr() != a.data_ptr()
    assert scratch("t.a", 10, torch.int32, "cpu").data_ptr() != a.data_ptr()
    big = scratch("t.a", 1000, torch.float32, "cpu")
    assert big.numel() == 1000 and scratch("t.a", 10, torch.float32, "cpu").data_ptr() == big.data_ptr()
    other = []
    t = threading.Thread(target=lambda: other.append(scratch("t.a", 10, torch.float32, "cpu")))
    t.start()
    t.join()
    assert other[0].data_ptr() != big.data_ptr()


def _grads(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(3)]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_result_outlives_the_next_exchange(method):
    layout = lay_out(SHAPES)
    n = sum(p.numel for p in layout)
    state = state_for(method)
    xs = _grads(0, n)
    first = state.reduce(xs[0].clone(), layout)
    kept = first.clone()
    state.reduce(xs[1].clone(), layout)
    assert torch.equal(first, kept)


@pytest.mark.parametrize("method", ["onebit", "terngrad:error_feedback=true", "topk", "powersgd"])
def test_exchanges_on_two_threads_at_once_equal_one_at_a_time(method):
    """Two states, buckets of different sizes, each on its own thread, many steps at once:
    every result as when run alone."""
    layouts = [lay_out(SHAPES), lay_out(SHAPES[:2] + [("d", (5000,))])]

    def run(i, out):
        state = state_for(method)
        n = sum(p.numel for p in layouts[i])
        out.extend(state.reduce(x.clone(), layouts[i]) for x in _grads(i, n) * 4)

    alone = [[], []]
    for i in range(2):
        run(i, alone[i])
    together = [[], []]
    threads = [threading.Thread(target=run, args=(i, together[i])) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert len(together[i]) == 12
        for a, b in zip(alone[i], together[i]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["onebit", "terngrad", "terngrad:error_feedback=true",
                                    "topk", "dgc:ratio=0.1", "threshold", "powersgd"])
def test_the_result_is_written_into_the_bucket_itself(method):
    """On the CPU every compressing method writes its average into the bucket it was given
    (the compressor returns its input): no fresh bucket-sized result, whose first write pays
    a page fault per 4 KB, and no copy of it back into the bucket. (Its values are checked
    against the references elsewhere; here a second state fed copies agrees step by step.)"""
    layout = lay_out(SHAPES)
    n = sum(p.numel for p in layout)
    state, twin = state_for(method), state_for(method)
    real, seen = state._state.compressor.reduce, []

    def spy(x, ctx):
        out = real(x, ctx)
        seen.append(out is x or out.data_ptr() == x.data_ptr())
        return out

    state._state.compressor.reduce = spy
    for x in _grads(3, n):
        got = state.reduce(x.clone(), layout)
        assert torch.equal(got, twin.reduce(x.clone(), layout))
    assert seen == [True] * 3, method
