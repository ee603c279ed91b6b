"""Launches per bucket on the GPU's path, counted without a GPU: every per-step method's
compressed exchange of one bucket launches at most ``BUDGET`` kernels besides its
collectives, at a ResNet-18 bucket, a GPT-2 small bucket and 1M elements cut into 160
tensors (the count must not grow with the tensor count).

The count (:func:`gradcomp_bench.bench_ops.gpu_launches`) runs the exchange on CPU tensors
that say they are on cuda:0, so the library takes every GPU branch; each Triton launch
counts one (not run), each torch op that does work one, each host/device copy one;
views and allocations launch nothing and the collectives are not counted. Real parameter
shapes (nothing downloaded): the same buckets DDP cuts at 25 MB."""
import pytest

pytest.importorskip("triton")

from gradcomp_bench import bench_ops  # noqa: E402

BUDGET = 8

# the bucket with the most tensors of each model: ResNet-18's second (49 tensors, 6.3M
# elements), GPT-2 small's first (11 tensors, the last block and the final norm, 5.3M)
LAYOUTS = {
    "resnet18": lambda: bench_ops.buckets(bench_ops.resnet18_shapes())[1],
    "gpt2-small": lambda: bench_ops.buckets(bench_ops.gpt2_small_shapes())[0],
    "160 tensors": lambda: bench_ops.buckets(bench_ops.even_shapes(2**20, 160), 2**40)[0],
}

# launches today where a method is not yet within the budget (the xfails are strict: a
# method that gets within it fails here until its entry goes)
OVER = {
    "topk": {"resnet18": 23, "gpt2-small": 23, "160 tensors": 21},
    "dgc": {"resnet18": 21, "gpt2-small": 21, "160 tensors": 21},
    "threshold": {"resnet18": 21, "gpt2-small": 21, "160 tensors": 19},
}
METHODS = ("allreduce", "onebit", "terngrad", "topk", "dgc", "threshold", "powersgd")


def _cases():
    for spec in METHODS:
        for layout in LAYOUTS:
            now = OVER.get(spec, {}).get(layout)
            marks = (pytest.mark.xfail(strict=True, raises=AssertionError,
                                       reason=f"{now} launches today")
                     if now is not None else ())
            yield pytest.param(spec, layout, marks=marks, id=f"{spec}-{layout}")


@pytest.fixture(scope="module")
def layouts():
    return {k: make() for k, make in LAYOUTS.items()}


@pytest.mark.parametrize("spec,layout", list(_cases()))
def test_a_bucket_exchange_launches_within_the_budget(spec, layout, layouts):
    got = bench_ops.gpu_launches(spec, layouts[layout])
    assert "host read" not in got  # a wait on a GPU
    total = sum(got.values())
    assert total <= BUDGET, f"{spec} at {layout}: {total} launches {dict(got)}"


def test_the_count_sees_every_launch_and_no_collective(layouts):
    """A wrong count would pass the budget: the count must see the GPU branch's Triton
    kernels and torch ops, its host copies, and leave the collectives out."""
    layout = layouts["160 tensors"]
    plain = bench_ops.gpu_launches("allreduce", layout)
    assert dict(plain) == {"aten.div_.Tensor": 1}  # the average; the allreduce itself not
    onebit = bench_ops.gpu_launches("onebit", layout)
    for step in ("encode", "reencode", "decode"):
        assert onebit[f"triton _onebit_{step}_kernel"] == 1
    assert onebit["device to host copy"] == 1  # the inf/NaN guard's flag, read a step late
    # the GPU branch (the statistics' kernel), not the CPU's (max of squares, numpy sums)
    tern = bench_ops.gpu_launches("terngrad", layout)
    assert tern["triton _ternary_stats_kernel"] == 1 and "aten._foreach_max.default" not in tern


def test_the_count_leaves_the_process_as_it_was(layouts):
    import torch
    bench_ops.gpu_launches("topk", layouts["160 tensors"])
    t = torch.zeros(3)
    assert t.device.type == "cpu" and not t.is_cuda
    assert "device" not in vars(torch.Tensor) and "is_cuda" not in vars(torch.Tensor)
