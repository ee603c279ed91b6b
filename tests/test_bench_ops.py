"""The op-count benchmark (gradcomp-bench kernels --ops): layouts as DDP buckets them and a
count that sees every aten op of an exchange."""
import math

from gradcomp_bench import bench_ops


def test_buckets_cut_reversed_parameters_at_the_cap():
    shapes = [(f"p{i}", (1000,)) for i in range(10)]
    bs = bench_ops.buckets(shapes, cap_bytes=4 * 2500)
    assert [len(b) for b in bs] == [2, 2, 2, 2, 2]
    assert [p.name for b in bs for p in b] == [f"p{i}" for i in reversed(range(10))]
    assert all(p.offset == 1000 * j for b in bs for j, p in enumerate(b))


def test_gpt2_small_has_its_124m_parameters():
    total = sum(math.prod(s) for _, s in bench_ops.gpt2_small_shapes())
    assert total == 124_439_808
    assert len(bench_ops.gpt2_small_shapes()) == 2 + 12 * 12 + 2


def test_the_count_sees_the_codec():
    layout = bench_ops.buckets(bench_ops.even_shapes(2**16, 4), 2**40)[0]
    plain, topk = bench_ops.count("allreduce", layout), bench_ops.count("topk:min_numel=0", layout)
    assert 0 < plain < topk  # a plain average is a few ops; top-k selects, packs, scatters
