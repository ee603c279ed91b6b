"""DDP features a real job uses: gradient accumulation with no_sync(), static_graph=True and
find_unused_parameters=True. Each compares gradcomp (degenerate setting, so exactly equal)
against plain DDP from the same init, over several buckets, and checks the step counter
counts optimizer steps. ``topk:ratio=1`` runs its compressed path from the first step (a
dense warm-up would be plain allreduce whatever the method); ``allreduce`` is plain
allreduce on purpose (the hook's own plumbing through each mode)."""
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import batch


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(20, 32)
        self.b = nn.Linear(32, 10)
        self.unused_sometimes = nn.Linear(32, 10)

    def forward(self, x, step):
        h = torch.relu(self.a(x))
        return self.b(h) + (self.unused_sometimes(h) if step % 2 else 0)


def _run(rank, world, spec, mode, steps):
    out = []
    for use in (None, spec):
        net = Branchy()
        kw = {"find_unused_parameters": True} if mode == "unused" else {}
        if mode == "static":
            kw["static_graph"] = True
        model = DDP(net, bucket_cap_mb=0.002, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = gradcomp.register(model, use, optimizer=opt, min_numel=0, warmup="none") if use else None
        for step in range(steps):
            opt.zero_grad()
            if mode == "accumulate":
                for micro in range(2):
                    x, y = batch(rank, 10 * step + micro)
                    with model.no_sync():
                        nn.functional.cross_entropy(model(x, 1), y).backward()
            x, y = batch(rank, step)
            s = step if mode == "unused" else 1
            nn.functional.cross_entropy(model(x, s), y).backward()
            opt.step()
        out.append(([p.detach().clone() for p in net.parameters()], state.step if state else steps,
                    state.stats()["compressing_since"] if state else None))
    return out


@pytest.mark.parametrize("mode", ["accumulate", "static", "unused"])
@pytest.mark.parametrize("spec", ["allreduce", "topk:ratio=1"])
def test_ddp_modes_match_plain_ddp(spec, mode, spawn):
    (ref, _, _), (got, counted, since) = spawn(_run, 2, args=(spec, mode, 4))[0]
    assert counted == 4  # optimizer steps, not backward calls
    assert since == (None if spec == "allreduce" else 0)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def _logged(rank, world, log_dir, spec="dgc:ratio=0.1,warmup_steps=3", details=False):
    net = Branchy()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none",
                              log_dir=log_dir, log_details=details)
    for step in range(5):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x, 1), y).backward()
        opt.step()
    attached = state._state.telemetry.writer is not None
    state.close()  # writes the last step's scalars
    return attached


def test_tensorboard_scalars_on_rank_zero(tmp_path, spawn):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    attached = spawn(_logged, 2, args=(str(tmp_path),))
    assert attached == [True, False]  # rank 0 only
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"gradcomp/compression_ratio", "gradcomp/wire_bytes", "gradcomp/accumulation_norm",
            "gradcomp/velocity_norm", "gradcomp/sparsity", "gradcomp/threshold"} <= tags
    assert all(e.value > 0 for e in acc.Scalars("gradcomp/threshold"))
    sparsity = [e.value for e in acc.Scalars("gradcomp/sparsity")]
    assert len(sparsity) == 5 and sparsity == sorted(sparsity)  # warm-up: sparsity rises
    ratio = acc.Scalars("gradcomp/compression_ratio")[-1].value
    assert 3 < ratio < 6  # ratio 0.1 sends value + index: 5x


def test_powersgd_approximation_error_is_logged_when_asked(tmp_path, spawn):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for details, sub in ((True, "on"), (False, "off")):
        spawn(_logged, 2, args=(str(tmp_path / sub), "powersgd:rank=1", details))
    on, off = EventAccumulator(str(tmp_path / "on")), EventAccumulator(str(tmp_path / "off"))
    on.Reload()
    off.Reload()
    errs = [e.value for e in on.Scalars("gradcomp/approx_error")]
    assert len(errs) == 5 and all(0 < v < 1 for v in errs)  # rank 1 of a real gradient
    assert "gradcomp/approx_error" not in off.Tags()["scalars"]
    assert "gradcomp/residual_norm" in off.Tags()["scalars"]
