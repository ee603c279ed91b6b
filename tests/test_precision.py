"""Mixed precision and bad gradients: half-precision models, a GradScaler whose scale changes,
and steps whose gradients hold inf/NaN."""
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import SHAPES, batch, layout, small_net, state_for

STATEFUL = ["topk:ratio=0.05", "dgc:ratio=0.05,momentum=0.9,warmup_steps=4", "onebit:chunk=64",
            "terngrad:error_feedback=true", "powersgd:rank=1", "threshold:max_ratio=0.05"]


def _memory(state):
    return state.state_dict()["memory"]


@pytest.mark.parametrize("spec", STATEFUL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_step_propagates_and_leaves_memory_alone(spec, bad):
    """The result is NaN throughout the bucket (the guard's flag is read a step late, so the
    result cannot wait for it); the memory and the step counter are as if the step never
    happened, so the next step equals that of a state that never saw it."""
    params = layout(list(SHAPES))
    n = sum(p.numel for p in params)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g) for _ in range(4)]
    hit, clean = state_for(spec), state_for(spec)
    for x in xs[:2]:
        hit.reduce(x.clone(), params)
        clean.reduce(x.clone(), params)
    before = _memory(hit)
    assert before["flat"] and hit.stats()["compressing_since"] == 0  # compressed steps
    poisoned = xs[2].clone()
    poisoned[[5, 700, n - 1]] = bad
    out = hit.reduce(poisoned.clone(), params)
    assert torch.isnan(out).all()
    torch.testing.assert_close(_memory(hit), before, rtol=0, atol=0)
    for x in xs[2:]:
        assert torch.equal(hit.reduce(x.clone(), params), clean.reduce(x.clone(), params))
    assert hit.step == clean.step


@pytest.mark.parametrize("spec", ["onebit:chunk=64", "powersgd:rank=1"])
def test_a_non_finite_step_on_the_gpu_kernels_leaves_later_steps_alone(spec, monkeypatch):
    """The same on the Triton kernels (the GPU's path), whose guard flags live on the
    device, two per bucket, each zeroed by the other's exchange: a step after the skipped
    one, and the one after that, is not taken for a skipped step."""
    monkeypatch.setenv("GRADCOMP_KERNELS", "triton")
    test_a_non_finite_step_propagates_and_leaves_memory_alone(spec, float("nan"))


def test_memory_restore_after_whole_bucket_and_relayout_snapshots():
    """The guard's snapshot copies a bucket's flat buffer whole; restore puts every
    parameter back, also when the bucket's layout changed in between, and zeroes a slot
    created after the snapshot."""
    from gradcomp.memory import ParamMemory
    m = ParamMemory()
    buf = m.flat("r", 0, ["a", "b"], [3, 2], "cpu")
    buf.copy_(torch.arange(5.0))
    q = m.tensor("q", "a", lambda: torch.ones(2))
    snap = m.snapshot(["a", "b"], 0)
    assert set(snap["whole"]) == {"r"} and not snap["flat"]  # one copy, not one per name
    buf.mul_(-1)
    q.mul_(5)
    m.flat("v", 0, ["a", "b"], [3, 2], "cpu").fill_(7)
    m.restore(snap, ["a", "b"])
    assert torch.equal(m.flat("r", 0, ["a", "b"], [3, 2], "cpu"), torch.arange(5.0))
    assert torch.equal(m.flat("v", 0, ["a", "b"], [3, 2], "cpu"), torch.zeros(5))
    assert torch.equal(q, torch.ones(2))
    snap = m.snapshot(["a", "b"], 0)
    buf.mul_(-1)
    m.flat("r", 0, ["b", "a"], [2, 3], "cpu")  # DDP moved them: a new buffer, values kept
    m.restore(snap, ["a", "b"])
    assert torch.equal(m.flat("r", 0, ["b", "a"], [2, 3], "cpu"),
                       torch.tensor([3.0, 4.0, 0.0, 1.0, 2.0]))


def test_memory_snapshot_copies_are_reused_after_release_and_stay_exact():
    """A released snapshot's CPU copy is the next snapshot's (no fresh bucket-sized buffer
    each exchange); a snapshot in use is never handed out twice, and a restore from a reused
    copy puts back the values of ITS moment, not an earlier one."""
    from gradcomp.memory import ParamMemory
    m = ParamMemory()
    buf = m.flat("r", 0, ["a", "b"], [3, 2], "cpu")
    buf.copy_(torch.arange(5.0))
    first = m.snapshot(["a", "b"], 0)
    copy = first["whole"]["r"][1]
    m.release(first)
    assert not first["whole"]  # released: no longer usable for a restore
    buf.add_(10)  # a good step changed the memory
    snap = m.snapshot(["a", "b"], 0)
    assert snap["whole"]["r"][1] is copy  # the spare, reused
    other = m.snapshot(["a", "b"], 0)  # while snap is held: a copy of its own
    assert other["whole"]["r"][1] is not copy
    buf.mul_(-1)  # the bad step's changes
    m.restore(snap, ["a", "b"])
    m.release(snap)
    assert torch.equal(buf, torch.arange(5.0) + 10)
    again = m.snapshot(["a", "b"], 1)  # another bucket: not this one's spare
    assert again["whole"] == {} or again["whole"]["r"][1] is not copy


def test_memory_next_swaps_two_buffers_and_discard_keeps_the_current():
    """next_flat hands out a second buffer; commit makes it the slot's (every parameter's
    view, state_dict, the next flat()) and keeps the old one as the next next_flat's, so
    two buffers alternate with no copy; discard leaves the slot as it was."""
    from gradcomp.memory import ParamMemory
    m = ParamMemory()
    cur = m.flat("r", 0, ["a", "b"], [3, 2], "cpu")
    cur.copy_(torch.arange(5.0))
    now, nxt = m.next_flat("r", 0, ["a", "b"], [3, 2], "cpu")
    assert now is cur and nxt.data_ptr() != cur.data_ptr()
    nxt.copy_(torch.arange(5.0) * 10)
    m.commit("r", 0, nxt)
    assert m.flat("r", 0, ["a", "b"], [3, 2], "cpu") is nxt
    sd = m.state_dict()["flat"]["r"]
    assert torch.equal(sd["a"], torch.tensor([0.0, 10, 20])) and torch.equal(sd["b"], torch.tensor([30.0, 40]))
    now, again = m.next_flat("r", 0, ["a", "b"], [3, 2], "cpu")
    assert now is nxt and again is cur  # the swapped-out buffer, reused
    again.fill_(-1)
    m.discard("r", 0, again)
    assert torch.equal(m.flat("r", 0, ["a", "b"], [3, 2], "cpu"), torch.arange(5.0) * 10)
    m.flat("r", 0, ["b", "a"], [2, 3], "cpu")  # DDP moved them: values kept per parameter
    assert torch.equal(m.state_dict()["flat"]["r"]["a"], torch.tensor([0.0, 10, 20]))


@pytest.mark.parametrize("spec", STATEFUL)
def test_the_guard_copies_no_slot_an_exchange_rewrites_whole(spec, monkeypatch):
    """The guard's snapshot copies a flat slot only when the exchange asks to write it in
    place (ctx.memory): the slots rewritten whole (ctx.memory_next: every method's residual,
    DGC's velocity and accumulation) are not copied, and the result is the same as with
    every slot written in place (the state a fresh process reloads computes the same)."""
    from gradcomp.memory import ParamMemory
    params = layout(list(SHAPES))
    n = sum(p.numel for p in params)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, generator=g) for _ in range(3)]
    copied = []
    real = ParamMemory._cover
    monkeypatch.setattr(ParamMemory, "_cover",
                        lambda self, snap, s: (copied.append(s), real(self, snap, s))[1])
    swapped, inplace = state_for(spec), state_for(spec)
    inplace._state.memory.next_flat = lambda slot, bucket, names, numels, device: (
        (lambda b: (b, b))(inplace._state.memory.flat(slot, bucket, names, numels, device)))
    inplace._state.memory.commit = inplace._state.memory.discard = lambda *a: None
    for x in xs:
        assert torch.equal(swapped.reduce(x.clone(), params), inplace.reduce(x.clone(), params))
    torch.testing.assert_close(_memory(swapped), _memory(inplace), rtol=0, atol=0)
    rewritten = {"residual", "velocity", "accumulation"}
    assert not rewritten & set(copied), copied
    assert _memory(swapped)["flat"]  # there is memory, and it moved
    assert swapped.stats()["compressing_since"] == inplace.stats()["compressing_since"] == 0


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "onebit:chunk=64", "powersgd:rank=1"])
def test_an_exchange_that_raises_leaves_the_memory_as_it_was(spec):
    """A failure inside the exchange (here its last collective) drops the new buffers: the
    memory is that of before the step, not half of a step."""
    params = layout(list(SHAPES))
    n = sum(p.numel for p in params)
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(n, generator=g) for _ in range(3)]
    state = state_for(spec)
    for x in xs[:2]:
        state.reduce(x.clone(), params)
    before = _memory(state)
    assert before["flat"] and state.stats()["compressing_since"] == 0
    comm = state._state.flat_comm
    for op in ("allgather", "allreduce"):
        def boom(*a, **k):
            raise RuntimeError("link down")
        setattr(comm, op, boom)
    with pytest.raises(RuntimeError, match="link down"):
        state.reduce(xs[2].clone(), params)
    torch.testing.assert_close(_memory(state), before, rtol=0, atol=0)


def _scaled_run(rank, world, spec, mode, steps=8, bad_step=3, adamw=False, one=False):
    """mode: 'scaler' (GradScaler passed to register, inf on rank 0 at bad_step),
    'plain' (no scaling; bad_step left out), 'unregistered' (GradScaler not passed).
    ``adamw``: AdamW with two dense steps (Adam needs them) instead of SGD momentum.
    ``one``: the inf in one layer's gradient only (one bucket), not in the loss (all)."""
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    if adamw:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        warm = {"dense_steps": 2}
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        warm = {"warmup": "none"}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2,
                                  enabled=mode != "plain")
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, **warm,
                              scaler=scaler if mode == "scaler" else None)
    scales = []
    for step in range(steps):
        if step == bad_step and mode != "scaler":
            continue
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        hook = None
        if step == bad_step and rank == 0:
            if one:
                hook = net[0].weight.register_hook(lambda g: g * float("inf"))
            else:
                loss = loss * float("inf")
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale() if scaler.is_enabled() else 1.0)
    return [p.detach().clone() for p in net.parameters()], scales, state.step, state.stats()


def _compressed(stats, since=0):
    """The run compressed from step ``since`` on, its latest step too."""
    return stats["compressing_since"] == since and stats["ratio"] > 1.5


# + an overflow during DGC's uncompressed warm-up, whose velocity moves (guarded too)
@pytest.mark.parametrize("spec", STATEFUL + ["dgc:ratio=0.05,momentum=0.9,dense_steps=5"])
def test_grad_scaler_with_changing_scale_and_an_overflow_matches_unscaled_training(spec, spawn):
    """Loss scaling by powers of two is exact in fp32, so a job with a GradScaler whose scale
    grows every 2 steps and backs off after an overflow on ONE rank must end bit-identical to
    the same job trained without scaling and without that step. Not passing the scaler to
    register() keeps scaled values in the memory: that run must differ. Compressed from the
    first step (DGC's dense_steps=5 case: from step 5, its overflow at step 3 dense)."""
    (scaled, scales, step_a, stats_a), _ = spawn(_scaled_run, 2, args=(spec, "scaler"))
    (plain, _, step_b, stats_b), _ = spawn(_scaled_run, 2, args=(spec, "plain"))
    assert len(set(scales)) >= 3  # the scale really changed, up and down
    assert step_a == step_b == 7
    since = 5 if "dense_steps=5" in spec else 0
    assert _compressed(stats_a, since) and _compressed(stats_b, since), (stats_a, stats_b)
    for a, b in zip(scaled, plain):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max():.3g}"
    (wrong, _, _, _), _ = spawn(_scaled_run, 2, args=(spec, "unregistered", 8, 99))
    (plain8, _, _, _), _ = spawn(_scaled_run, 2, args=(spec, "plain", 8, 99))
    assert any(not torch.equal(a, b) for a, b in zip(wrong, plain8))


@pytest.mark.parametrize("spec", ["onebit", "powersgd:rank=1", "dgc:ratio=0.05,momentum=0.9"])
def test_an_overflow_in_one_bucket_leaves_no_trace_in_the_others(spec, spawn):
    """The inf in one layer's gradient only: its bucket is flagged, the others are finite
    and their exchanges ran. The GradScaler skips the step, so every bucket's memory must be
    as before it (each bucket's own guard put back only its own)."""
    (scaled, _, _, stats), _ = spawn(_scaled_run, 2, args=(spec, "scaler", 8, 3, False, True))
    (plain, _, _, _), _ = spawn(_scaled_run, 2, args=(spec, "plain", 8, 3))
    assert _compressed(stats), stats
    for a, b in zip(scaled, plain):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("spec", ["onebit", "topk:ratio=0.2"])
def test_grad_scaler_with_adamw_momentum_exchange_matches_unscaled_training(spec, spawn):
    """The same with AdamW, where these methods exchange Adam's first moment (adam='auto'
    runs 'momentum'): the moment is built from the unscaled gradient and the result scaled
    back, so a changing scale and a skipped step change nothing."""
    (scaled, scales, _, stats), _ = spawn(_scaled_run, 2, args=(spec, "scaler", 8, 3, True))
    (plain, _, _, _), _ = spawn(_scaled_run, 2, args=(spec, "plain", 8, 3, True))
    assert len(set(scales)) >= 3
    assert _compressed(stats, since=2), stats  # the overflow at step 3: compressed
    for a, b in zip(scaled, plain):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max():.3g}"


def test_scaler_with_delay_is_refused_at_registration(spawn):
    msgs = spawn(_register_scaler_delay, 2)
    assert all("scaler= with delay=1" in m for m in msgs)


def _register_scaler_delay(rank, world):
    model = DDP(small_net())
    try:
        gradcomp.register(model, "onebit", delay=1, scaler=torch.amp.GradScaler("cpu"))
    except ValueError as exc:
        return str(exc)
    return ""


def _half_run(rank, world, spec, dtype, autocast):
    net = small_net()
    if not autocast:
        net = net.to(dtype)
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none")
    losses = []
    for step in range(10):
        x, y = batch(rank, step % 2)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x.to(dtype) if not autocast else x), y)
        loss.float().backward()
        opt.step()
        losses.append(float(loss))
    mem = state.state_dict()["memory"]["flat"]
    return ([p.detach().float() for p in net.parameters()], losses,
            {v.dtype for d in mem.values() for v in d.values()}, state.stats())


@pytest.mark.parametrize("spec", STATEFUL)
@pytest.mark.parametrize("dtype, autocast", [(torch.bfloat16, False), (torch.float16, False),
                                             (torch.bfloat16, True)])
def test_half_precision_training_works_with_fp32_memory(spec, dtype, autocast, spawn):
    (p0, l0, m0, stats), (p1, _, _, _) = spawn(_half_run, 2, args=(spec, dtype, autocast))
    assert _compressed(stats), stats  # every step
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))  # ranks stay in step
    assert all(torch.isfinite(a).all() for a in p0)
    assert m0 == {torch.float32}
    assert sum(l0[-2:]) < sum(l0[:2])  # it learns (the same two batches, repeated)


def _two_rank_bad(rank, world, spec):
    import torch.distributed as dist
    name, cfg = gradcomp.build_config(spec, min_numel=0, warmup="none")
    st = gradcomp.State(name, cfg, group=dist.new_group([0, 1]))
    params = layout(list(SHAPES))
    n = sum(p.numel for p in params)
    g = torch.Generator().manual_seed(rank)
    st.reduce(torch.randn(n, generator=g), params)
    before = _memory(st)
    x = torch.randn(n, generator=g)
    if rank == 0:
        x[[3, 500]] = float("nan")
    else:
        x[[500, 900]] = float("inf")
        x[1000] = -float("inf")
    out = st.reduce(x.clone(), params)
    return out, before, _memory(st), st.stats()["compressing_since"]


@pytest.mark.parametrize("spec", STATEFUL)
def test_non_finite_on_some_ranks_reaches_every_rank(spec, spawn):
    """inf/NaN on each rank at its own places: every rank's result is NaN throughout the
    bucket, and every rank's memory is as before the step (read through state_dict, which
    settles the step)."""
    got = spawn(_two_rank_bad, 2, args=(spec,))
    for out, before, after, since in got:
        assert before["flat"] and since == 0  # a compressed step, then the bad one
        assert torch.isnan(out).all()
        torch.testing.assert_close(after, before, rtol=0, atol=0)
