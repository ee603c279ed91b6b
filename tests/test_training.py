"""A short real training run (2 ranks, CIFAR-10 subset, small ResNet) with every method
lowers the loss, compressed from the first step (the default warm-up would keep these steps
dense). One spawn runs all methods in turn to pay process start-up once."""

from gradcomp_bench.train import train

METHODS = ["allreduce", "topk:ratio=0.01", "dgc:ratio=0.01", "onebit", "terngrad", "powersgd:rank=2"]
STEPS = 24


def _params():
    from gradcomp_bench import models
    return list(models.build("resnet_small").parameters())


def _run_all(rank, world, methods):
    return {m: train(rank, world, dict(method=m, max_steps=STEPS, epochs=0, eval=False,
                                       options={} if m == "allreduce" else {"warmup": "none"}))
            for m in methods}


def test_every_method_lowers_the_loss(cifar, spawn):
    runs = spawn(_run_all, 2, args=(METHODS,), timeout=600)[0]
    for m, r in runs.items():
        ls = r["losses"]
        first, last = sum(ls[:6]) / 6, sum(ls[-6:]) / 6
        assert last < first - 0.1, f"{m}: loss {first:.3f} -> {last:.3f}"
        if m != "allreduce":
            assert r["stats"]["compressing_since"] == 0 and r["stats"]["run_ratio"] > 1.5, m
        # the rig's split of each step: its parts add up to the step; the tail (after the
        # last gradient was handed to the hook) is part of backward, which waits for it
        assert len(r["phases"]) == STEPS
        for ph, step in zip(r["phases"], r["step_times"]):
            assert abs(ph["forward_s"] + ph["backward_s"] + ph["rest_s"] - step) < 1e-6
            assert 0 <= ph["tail_s"] <= ph["backward_s"] and ph["forward_s"] > 0
        # DDP's buckets as it built them: together, every gradient's fp32 bytes
        assert sum(r["bucket_bytes"]) == 4 * sum(p.numel() for p in _params())
