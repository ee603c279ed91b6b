"""Two gloo ranks on CPU, spawned by the tests: the hook against plain allreduce."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import batch, small_net, train_capturing, train_pair
from gradcomp_bench.launch import RankError


@pytest.mark.parametrize("spec, sgd, exact", [
    ("allreduce", {"lr": 0.1}, True),
    ("topk:ratio=1", {"lr": 0.1}, True),
    ("dgc:ratio=1,masking=false", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}, False),
    ("dgc:ratio=1,masking=false", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, False),
    ("powersgd:rank=64,min_compression_rate=0", {"lr": 0.1}, False),
])
def test_degenerate_settings_equal_allreduce(spec, sgd, exact, spawn):
    """Each degenerate setting runs its compressed path from the first step (no dense
    warm-up, which would be plain allreduce whatever the method) over several DDP buckets;
    the ``allreduce`` row is the harness's own control (plain allreduce on purpose)."""
    ref, got, stats = spawn(train_pair, 2, args=(spec, sgd, 5, None, True))[0]
    assert stats["compressing_since"] == (None if spec == "allreduce" else 0)
    for a, b in zip(ref, got):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


def test_compression_really_changes_the_update(spawn):
    # the same harness with a compressing setting must differ: the tests above can fail
    ref, got, stats = spawn(train_pair, 2, args=("topk:ratio=0.05", {"lr": 0.1}, 3, None,
                                                  True))[0]
    assert stats["compressing_since"] == 0 and stats["run_ratio"] > 1.5
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(ref, got))


def _conservation(rank, world, spec, steps):
    """Through DDP (buckets rebuilt after step 1): per parameter, return the local gradients'
    sum, the averaged results' sum and what is left in memory."""
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none")
    local, avg = train_capturing(rank, model, net, opt, steps)
    mem = state.state_dict()["memory"]["flat"]
    weights = {"residual": 1.0, "accumulation": 1.0, "server_residual": float(world)}
    left = {n: sum(w * mem[s][n].double() for s, w in weights.items() if s in mem)
            for n in local}
    return local, avg, left, state.stats()


SPECS = ["topk:ratio=0.05", "onebit:chunk=64", "onebit:chunk=64,scales=bfloat16",
         "terngrad:error_feedback=true", "powersgd:rank=1",
         "dgc:ratio=0.02", "threshold:max_ratio=0.05"]


@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_conserves_mass_through_ddp(spec, spawn):
    """sum_t average_t == mean over ranks of (sum_t local gradient - final memory)."""
    results = spawn(_conservation, 2, args=(spec, 6))
    (l0, a0, r0, s0), (l1, a1, r1, _) = results
    for n in l0:
        torch.testing.assert_close(a0[n], a1[n])  # every rank applies the same update
        expect = (l0[n] - r0[n] + l1[n] - r1[n]) / 2
        torch.testing.assert_close(a0[n], expect, atol=1e-4, rtol=1e-5)
    assert s0["step"] == 6 and 0 < s0["sent_bytes"] < s0["raw_bytes"]
    assert s0["compressing_since"] == 0 and s0["run_ratio"] > 1.5  # every step compressed


def _mismatch(rank, world, specs):
    model = DDP(small_net())
    try:
        gradcomp.register(model, specs[rank], min_numel=0, warmup="none")
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_with_different_methods_all_fail_at_registration(spawn):
    msgs = spawn(_mismatch, 2, args=(["topk:ratio=0.1", "onebit"],), timeout=120)
    assert all(m and "ranks registered different gradcomp methods" in m for m in msgs)
    assert "rank 1: onebit" in msgs[0]


def test_a_rank_with_bad_options_fails_everyone_without_hanging(spawn):
    msgs = spawn(_mismatch, 2, args=(["topk:ratio=0.1", "topk:ratio=7"],), timeout=120)
    assert "invalid ratio=7.0" in msgs[1]
    assert "different gradcomp methods" in msgs[0] and "invalid ratio=7.0" in msgs[0]


def _raise_in_rank(rank, world):
    if rank == 1:
        raise RuntimeError("boom")
    dist.barrier()


def test_launcher_reports_a_failing_rank_instead_of_hanging(spawn):
    with pytest.raises(RankError, match="boom"):
        spawn(_raise_in_rank, 2, timeout=60, pg_timeout=5)


def _raise_while_the_other_sleeps(rank, world):
    import time
    if rank == 1:
        raise RuntimeError("boom")
    time.sleep(600)  # stuck outside any collective: only the launcher can end it


def test_launcher_ends_a_run_soon_after_a_rank_fails_even_without_a_deadline(spawn):
    # timeout=None is what the convergence CLI runs under (a full run may take hours); a
    # launcher that waited for the survivor would sleep 600 s and report that it finished
    with pytest.raises(RankError, match="still running 12s after rank 1 failed") as exc:
        spawn(_raise_while_the_other_sleeps, 2, timeout=None, pg_timeout=2)
    assert "boom" in str(exc.value) and set(exc.value.errors) == {1}


def _dies_mid_training(rank, world, spec):
    import os
    import time
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none")
    t0 = since = None
    try:
        for step in range(50):
            if rank == 1 and step == 3:
                os._exit(17)  # a rank that dies without a word
            x, y = batch(rank, step)
            opt.zero_grad()
            t0 = time.monotonic()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            since = state.stats()["compressing_since"]
    except RuntimeError as exc:
        return ("raised", time.monotonic() - t0, str(exc)[:200], since)
    return ("finished", None, None, since)


@pytest.mark.parametrize("spec,world", [
    ("onebit", 2), ("powersgd:rank=1", 2), ("topk:ratio=0.1,delay=1", 2),
    ("onebit:local_steps=2", 2), ("topk:ratio=0.1,topology=hierarchical,local_size=2", 4)])
def test_a_dead_rank_makes_the_survivors_fail_not_hang(spec, world, spawn):
    got = spawn(_dies_mid_training, world, args=(spec,), timeout=120, pg_timeout=10,
                allow_fail=True)
    assert isinstance(got[1], RankError)
    for r in [0, *range(2, world)]:  # every survivor raised, soon, and its process ended
        status, waited, _, since = got[r]
        assert status == "raised" and waited < 60, (r, got[r])
        assert since == 0, (r, got[r])  # the job was in its compressed phase


ONEBIT_PARAMS = [("a", 257), ("b", 5000), ("c", 1027), ("d", 40), ("e", 2048)]


def _onebit_padding(rank, world, chunk, scales="float32"):
    """Each chunk's elements equal (one value per parameter and rank, positive or negative):
    1-bit is exact on them, so every rank must get the exact average, the last, partly
    filled chunk of each parameter included (its padding zeros once counted as positives)."""
    from gradcomp.compressors.base import ParamSlice
    params, off = [], 0
    for name, n in ONEBIT_PARAMS:
        params.append(ParamSlice(name, (n,), off, n))
        off += n
    sign = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])
    x = torch.cat([torch.full((n,), float(sign[i]) * (rank + 1) * (i + 1))
                   for i, (_, n) in enumerate(ONEBIT_PARAMS)])
    want = torch.cat([torch.full((n,), float(sign[i]) * (world + 1) / 2 * (i + 1))
                      for i, (_, n) in enumerate(ONEBIT_PARAMS)])
    out, ratios = {}, []
    for ef in (False, True):
        _, cfg = gradcomp.build_config(f"onebit:chunk={chunk},scales={scales}", min_numel=0,
                                       warmup="none", error_feedback=ef)
        state = gradcomp.State("onebit", cfg, group=dist.group.WORLD)
        out[ef] = state.reduce(x.clone(), params).clone()
        ratios.append(state.stats()["ratio"])  # 1 bit per element went, not the dense path
        state.close()
    return out, want, ratios


@pytest.mark.parametrize("world", [2, 3])
def test_onebit_is_exact_on_uniform_chunks_whatever_the_padding(world, spawn):
    for out, want, ratios in spawn(_onebit_padding, world, args=(64,), timeout=120):
        assert all(r > 1.5 for r in ratios), ratios
        for ef in (False, True):
            assert torch.equal(out[ef], want), (ef, (out[ef] - want).abs().argmax())


def test_onebit_bf16_scales_send_fewer_bytes_and_decode_the_same_values(spawn):
    """scales='bfloat16': the same exact averages where the values are bf16 numbers (the
    chunks of the test above), at 1.5 bits a value against 2 at chunk 64 (the messages'
    scales at half the bytes); that the error memory keeps the rounding: the mass test."""
    got = spawn(_onebit_padding, 2, args=(64, "bfloat16"), timeout=120)
    ref = spawn(_onebit_padding, 2, args=(64, "float32"), timeout=120)
    for (out, want, ratios), (_, _, r32) in zip(got, ref):
        for ef in (False, True):
            assert torch.equal(out[ef], want), (ef, (out[ef] - want).abs().argmax())
        for a, b in zip(ratios, r32):
            assert a / b == pytest.approx(2 / 1.5, rel=0.05), (ratios, r32)
