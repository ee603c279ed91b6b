"""What the rank-deficiency-safe Gram-Schmidt costs PowerSGD on the CPU: one rank-4 bucket
exchange (world size 1) with the previous orthonormalization (two passes, ``+ 1e-12``,
copied below) and with the current one, interleaved in one process, median of 20.

    PYTHONPATH=. python bench/powersgd_orthonormalize_cost.py
"""
import time, torch
import gradcomp.compressors.powersgd as ps
from gradcomp import State
from gradcomp.hooks import build_config
from gradcomp_bench import bench_ops

def old(P):
    for i in range(P.shape[2]):
        col = P[:, :, i:i+1]
        if i:
            done = P[:, :, :i]; dt = done.transpose(1, 2)
            for _ in range(2):
                col.sub_(torch.bmm(done, torch.bmm(dt, col)))
        col.div_(torch.bmm(col.transpose(1, 2), col).sqrt_().add_(1e-12))
    return P

new = ps.orthonormalize
torch.set_num_threads(2)
for key, layouts in (("resnet18", bench_ops.buckets(bench_ops.resnet18_shapes())),
                     ("1M/160", [bench_ops.buckets(bench_ops.even_shapes(2**20, 160), 2**40)[0]])):
    res = {"old": [], "new": []}
    name, cfg = build_config("powersgd", warmup="none")
    xs = [torch.randn(sum(p.numel for p in b)) for b in layouts]
    states = {w: State(name, cfg) for w in res}
    for rep in range(25):
        for which, fn in (("old", old), ("new", new)):
            ps.orthonormalize = fn
            t0 = time.perf_counter()
            for b, x in zip(layouts, xs):
                states[which].reduce(x.clone(), b)
            if rep >= 5:
                res[which].append(time.perf_counter() - t0)
    med = {w: sorted(v)[len(v) // 2] * 1e3 for w, v in res.items()}
    print(f"{key}: old {med['old']:.2f} ms, new {med['new']:.2f} ms, ratio {med['new'] / med['old']:.3f}")
