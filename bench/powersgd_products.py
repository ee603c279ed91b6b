"""PowerSGD's two projections on the CPU, as the method computes them and in the operand
layouts BLAS runs faster, and whether each layout's result for one matrix depends on its
place in the batch (what bit-exact resume after a bucket relayout needs: it must not).

    PYTHONPATH=. python bench/powersgd_products.py --threads 1

Prints milliseconds per product over 4 x 512 x 4608 matrices at rank 4 (ResNet-18's
largest shape), then, per shape, the (batch size, place) pairs whose result differs from
the same matrix's in a batch of two at place 0.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradcomp.compressors.powersgd import bmm

FORMS = {
    # name: (M Q, M^T P) as functions of (M (B, n, m), Q (B, m, r), P (B, n, r))
    "as the method computes them": (
        lambda M, Q, P: bmm(M, Q),
        lambda M, Q, P: bmm(M.transpose(1, 2), P)),
    "transposed operands": (
        lambda M, Q, P: bmm(M, Q.transpose(1, 2).contiguous().transpose(1, 2)),
        lambda M, Q, P: bmm(P.transpose(1, 2), M).transpose(1, 2)),
}


def ms(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    M, Q, P = torch.randn(4, 512, 4608, generator=g), torch.randn(4, 4608, 4, generator=g), \
        torch.randn(4, 512, 4, generator=g)
    print(f"torch {torch.__version__}, threads {a.threads}, 4 x 512 x 4608, rank 4")
    print("| layout | M Q ms | M^T P ms |")
    print("|---|---|---|")
    for name, (mq, mtp) in FORMS.items():
        print(f"| {name} | {ms(lambda: mq(M, Q, P), a.repeats):.1f} | "
              f"{ms(lambda: mtp(M, Q, P), a.repeats):.1f} |")
    print("\nplaces whose result differs from a batch of two at place 0 (batch size, place):")
    for n, m, r in [(10, 27, 2), (65, 63, 2), (10, 27, 3), (63, 33, 4), (3072, 20, 2)]:
        one = [torch.randn(s, generator=g) for s in ((n, m), (m, r), (n, r))]
        for name, fns in FORMS.items():
            ref, bad = None, []
            for B in (2, 1, 3, 4, 5, 8):
                for at in range(B):
                    batch = [torch.randn(B, *t.shape, generator=g) for t in one]
                    for t, v in zip(batch, one):
                        t[at] = v
                    got = [f(*batch)[at] for f in fns]
                    if ref is None:
                        ref = got
                    elif not all(torch.equal(x, y) for x, y in zip(got, ref)):
                        bad.append((B, at))
            print(f"  {n} x {m}, r {r}, {name}: {bad if bad else 'none'}")


if __name__ == "__main__":
    main()
