"""stats()'s run totals: bytes handed over and the compression ratio summed over every step
so far (the dense warm-up's included), and the step compression started at (None before
it), beside the latest step's figures."""
import pytest
import torch

from gradcomp.compressors import METHODS
from gradcomp.compressors.base import ParamSlice
from gradcomp import State

N = 4096
PARAMS = [ParamSlice("a", (1024,), 0, 1024), ParamSlice("b", (N - 1024,), 1024, N - 1024)]


def _run(method, steps, **options):
    """Each step's stats() after its exchange (one process: the collectives are no-ops)."""
    state = State(method, METHODS[method].config(min_numel=0, **options))
    assert state.stats()["compressing_since"] is None  # no step yet
    seen = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        state.reduce(torch.randn(N, generator=g), PARAMS)
        seen.append(state.stats())
    state.close()
    return seen


def _check_totals(seen):
    for i, s in enumerate(seen):
        sent = sum(t["sent_bytes"] for t in seen[: i + 1])
        raw = sum(t["raw_bytes"] for t in seen[: i + 1])
        assert (s["run_sent_bytes"], s["run_raw_bytes"]) == (sent, raw), i
        assert s["run_wire_bytes"] == pytest.approx(sum(t["wire_bytes"] for t in seen[: i + 1]))
        assert s["run_ratio"] == pytest.approx(raw / sent), i


@pytest.mark.parametrize("method", ["topk", "onebit"])
def test_compressed_from_the_first_step(method):
    seen = _run(method, 4, warmup="none")
    _check_totals(seen)
    assert [s["compressing_since"] for s in seen] == [0] * 4
    assert seen[-1]["run_raw_bytes"] == 4 * 4 * N
    # every step compressed alike: the run's ratio is the step's (> 8x here)
    assert seen[-1]["run_ratio"] == pytest.approx(seen[-1]["ratio"]) and seen[-1]["ratio"] > 8


@pytest.mark.parametrize("options, switch", [({"dense_steps": 3}, 3),
                                             ({"warmup_window": 2}, 4)])  # steady: r ~ 0 at 4
def test_across_the_switch(options, switch):
    seen = _run("onebit", 8, **options)
    _check_totals(seen)
    assert [s["compressing_since"] for s in seen] == [None] * switch + [switch] * (8 - switch)
    assert [s["compressing"] for s in seen] == [False] * switch + [True] * (8 - switch)
    dense, last = seen[switch - 1], seen[-1]
    assert dense["run_ratio"] < 1.0 + 1e-3  # fp32 dense steps (+ the flag and step check)
    # the run's ratio lies between the dense steps' ~1 and the compressed step's own
    assert 1.0 < last["run_ratio"] < last["ratio"]
    assert last["run_sent_bytes"] == sum(s["sent_bytes"] for s in seen)


def test_plain_allreduce_never_switches():
    seen = _run("allreduce", 2)
    _check_totals(seen)
    assert [s["compressing_since"] for s in seen] == [None, None]
    assert seen[-1]["run_ratio"] == 1.0


# ---------------------------------------------------------------- local steps, 2 ranks
H, S, STEPS = 3, 4, 13  # sync_steps, then three rounds of H inner steps


def _local_against_allreduce(rank, world):
    """Each step's stats() of plain ``allreduce`` and of sparseloco's local steps (S
    synchronous steps, then rounds of H), the same STEPS optimizer steps."""
    import gradcomp
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from conftest import batch, small_net
    out = {}
    for spec in ("allreduce", f"sparseloco:chunk=64,k=8,local_steps={H},sync_steps={S}"):
        model = DDP(small_net(), bucket_cap_mb=0.004)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = gradcomp.register(model, spec, optimizer=opt, min_numel=0)
        seen = []
        for step in range(STEPS):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            seen.append(state.stats())
        state.close()
        out[spec.partition(":")[0]] = seen
    return out


def test_local_steps_count_optimizer_steps_and_the_bytes_results_counts(spawn):
    """With local steps every count is in optimizer steps: ``step``, ``compressing_since``
    (where the rounds began, after sync_steps), ``run_raw_bytes`` (one gradient per optimizer
    step, not per round) and ``run_ratio``: an allreduce of every step's gradient over the
    wire bytes, the figure bench/RESULTS.md reports (allreduce's run wire / the method's)."""
    from conftest import small_net
    grad = 4 * sum(p.numel() for p in small_net().parameters())
    for r in spawn(_local_against_allreduce, 2):
        ar, loc = r["allreduce"], r["sparseloco"]
        assert [s["step"] for s in loc] == list(range(1, STEPS + 1))
        assert [s["rounds"] for s in loc] == [max(i + 1 - S, 0) // H for i in range(STEPS)]
        assert [s["compressing_since"] for s in loc] == [None] * S + [S] * (STEPS - S)
        assert loc[-1]["warmup_switch_step"] == S
        assert [s["run_raw_bytes"] for s in loc] == [grad * (i + 1) for i in range(STEPS)]
        assert ar[-1]["run_raw_bytes"] == loc[-1]["run_raw_bytes"] == STEPS * grad
        assert ar[-1]["run_ratio"] == pytest.approx(1.0)  # 2 ranks: the ring's 2(W-1)/W = 1
        last = loc[-1]
        assert last["run_raw_wire_bytes"] == STEPS * grad
        assert last["run_ratio"] == pytest.approx(ar[-1]["run_wire_bytes"] / last["run_wire_bytes"])
        # 4 dense fp32 synchronous steps in 13: the run saves less than 13/4, more than 2
        assert 2 < last["run_ratio"] < STEPS / S
