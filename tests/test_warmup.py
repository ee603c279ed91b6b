"""The adaptive warm-up (hooks/warmup.py): dense until the window gradient norm settles,
then compressed for good; identical on every rank; ``dense_steps`` overrides it; the
schedule shows in stats() and TensorBoard; bad options are refused."""
import math

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp.compressors import METHODS
from gradcomp.compressors.base import ParamSlice
from gradcomp import State
from gradcomp_bench.launch import spawn

N = 4096
PARAMS = [ParamSlice("a", (1024,), 0, 1024), ParamSlice("b", (N - 1024,), 1024, N - 1024)]
WINDOW = 5


def _state(method="onebit", group=None, **options):
    return State(method, METHODS[method].config(min_numel=0, **options), group=group)


def _grad(rank, step, level):
    """A gradient of norm ``level`` (up to the noise of a fixed random direction)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(N, generator=g)
    return x * (level / x.norm())


def _levels(rank, step):
    # rank 0 alone is steady from the start (it alone would switch at the end of window 1);
    # rank 1's norm grows tenfold for two windows, then stays: the job's RMS norm moves
    # by more than half until window 2, and settles in window 3
    if rank == 0:
        return 1.0
    return [1.0, 10.0, 100.0, 100.0, 100.0, 100.0, 100.0][min(step // WINDOW, 6)]


def _expected_switch(world, threshold=0.5):
    """The rule written out: window norms over all ranks, first r < threshold."""
    prev = None
    for k in range(7):
        steps = range(k * WINDOW, (k + 1) * WINDOW)
        sq = [_grad(r, s, _levels(r, s)).double().square().sum()
              for r in range(world) for s in steps]
        norm = math.sqrt(float(sum(sq)) / len(sq))
        if prev is not None and abs(norm - prev) / prev < threshold:
            return (k + 1) * WINDOW
        prev = norm
    return None


def _run_synthetic(rank, world, steps):
    state = _state(group=dist.group.WORLD, warmup_window=WINDOW)
    out = []
    for step in range(steps):
        x = _grad(rank, step, _levels(rank, step))
        state.reduce(x.clone(), PARAMS)
        s = state.stats()
        out.append((s["compressing"], s["sent_bytes"], s["warmup_switch_step"]))
    state.close()
    return out


def test_switch_at_the_expected_window_boundary_identically_on_two_ranks():
    expect = _expected_switch(2)
    assert expect == 4 * WINDOW  # the schedule above: r = 6.1, 8.9, then 0.0
    runs = spawn(_run_synthetic, 2, args=(6 * WINDOW,), timeout=120, pg_timeout=30)
    assert runs[0] == runs[1]
    for step, (compressing, sent, switch) in enumerate(runs[0]):
        assert compressing == (step >= expect), step
        assert switch == (expect if step >= expect else None), step
        # dense: fp32 + the inf/NaN flag and step check; a window boundary adds its float64 per step
        window = 8 * WINDOW if 0 < step <= expect and step % WINDOW == 0 else 0
        assert sent == (4 * N + 12 + window if step < expect else sent), step
    assert runs[0][-1][1] < N  # compressed: ~1 bit per element


def test_ranks_agree_where_their_own_gradients_would_not():
    # rank 0 by itself would switch after window 1: a rule on local norms hangs or differs
    alone = _state(warmup_window=WINDOW)
    for step in range(3 * WINDOW):
        alone.reduce(_grad(0, step, _levels(0, step)), PARAMS)
    assert alone.stats()["warmup_switch_step"] == 2 * WINDOW
    runs = spawn(_run_synthetic, 2, args=(5 * WINDOW,), timeout=120, pg_timeout=30)
    assert [r[2] for r in runs[0]] == [r[2] for r in runs[1]]
    assert runs[0][-1][2] == 4 * WINDOW


def _sent(state, levels):
    out = []
    for step, level in enumerate(levels):
        state.reduce(_grad(0, step, level), PARAMS)
        out.append(state.stats()["sent_bytes"])
    return out


def test_dense_steps_overrides_the_adaptive_rule():
    steady = [1.0] * 12
    # adaptive, window 2: a steady norm switches at the end of the second window
    assert _state(warmup_window=2).stats()["warmup_switch_step"] is None
    adaptive = _sent(_state(warmup_window=2), steady)
    assert [b == 4 * N + 12 for b in adaptive] == [True] * 4 + [False] * 8
    # dense_steps=N: exactly N dense steps, the rule is not consulted
    for n in (0, 3, 7):
        s = _state(warmup_window=2, dense_steps=n)
        assert s.stats()["warmup_switch_step"] == n
        assert [b == 4 * N + 12 for b in _sent(s, steady)] == [i < n for i in range(12)]
    # warmup=none: compressed from the first step
    s = _state(warmup="none")
    assert s.stats()["warmup_switch_step"] == 0
    assert all(b < N for b in _sent(s, steady))
    # a norm that never settles stays dense; warmup_max_steps caps it
    growing = [4.0 ** k for k in range(12)]
    assert all(b == 4 * N + 12 for b in _sent(_state(warmup_window=1), growing))
    capped = _sent(_state(warmup_window=1, warmup_max_steps=5), growing)
    assert [b == 4 * N + 12 for b in capped] == [i < 5 for i in range(12)]


def test_plain_allreduce_has_no_warm_up():
    s = _state("allreduce")
    _sent(s, [1.0] * 3)
    st = s.stats()
    assert (st["compressing"], st["warmup_switch_step"], st["warmup_norm_change"]) == (False, None, None)


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, key, value, step):
        self.scalars.setdefault(key, {})[step] = value


def test_stats_and_tensorboard_record_the_switch():
    s = _state(warmup_window=3)
    w = _Writer()
    s.attach(w)
    levels = [1.0] * 3 + [8.0] * 3 + [9.0] * 6  # r = 7.0 at step 6, then 0.125 at step 9
    seen = []
    for step, level in enumerate(levels):
        s.reduce(_grad(0, step, level), PARAMS)
        seen.append((s.stats()["compressing"], s.stats()["warmup_norm_change"]))
    s.close()
    assert [c for c, _ in seen] == [False] * 9 + [True] * 3
    assert seen[5][1] is None and seen[6][1] == pytest.approx(7.0, rel=1e-3)
    assert seen[9][1] == pytest.approx(0.125, rel=1e-3)
    assert s.stats()["warmup_switch_step"] == 9
    assert w.scalars["gradcomp/compressing"] == {i: float(i >= 9) for i in range(12)}
    assert w.scalars["gradcomp/warmup_norm_change"] == {6: pytest.approx(7.0, rel=1e-3),
                                                  9: pytest.approx(0.125, rel=1e-3)}
    assert set(w.scalars["gradcomp/warmup_grad_norm"]) == {3, 6, 9}


def test_non_finite_steps_are_left_out_of_the_window():
    s = _state(warmup_window=2)
    levels = [1.0, 1.0, 1.0, float("inf"), 1.0, 1.0]
    for step, level in enumerate(levels):
        x = _grad(0, step, 1.0)
        if math.isinf(level):
            x[7] = float("inf")
        s.reduce(x, PARAMS)
    # the inf step (guard: skipped, its index reused) left nothing in the window
    assert s.stats()["warmup_switch_step"] == 4
    assert s.stats()["warmup_norm_change"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("options, match", [
    ({"warmup": "accordion"}, r"invalid warmup='accordion': allowed auto .* adaptive .* or none"),
    ({"warmup_window": 0}, r"invalid warmup_window=0: allowed an integer >= 1"),
    ({"warmup_threshold": 0}, r"invalid warmup_threshold=0.0: allowed a finite number > 0"),
    ({"warmup_threshold": float("nan")}, r"invalid warmup_threshold=nan"),
    ({"warmup_threshold": -0.5}, r"invalid warmup_threshold=-0.5"),
    ({"warmup_max_steps": -1}, r"invalid warmup_max_steps=-1: allowed an integer >= 0"),
    ({"dense_steps": -2}, r"invalid dense_steps=-2: allowed an integer >= 0, or None"),
])
def test_bad_warmup_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        gradcomp.build_config("onebit", **options)


def test_warmup_options_parse_from_a_spec_string():
    _, cfg = gradcomp.build_config("topk:warmup=none,warmup_window=20,warmup_threshold=0.3,"
                                   "dense_steps=none")
    assert (cfg.warmup, cfg.warmup_window, cfg.warmup_threshold, cfg.dense_steps) == (
        "none", 20, 0.3, None)
    _, cfg = gradcomp.build_config("topk")
    assert (cfg.warmup, cfg.warmup_window, cfg.warmup_threshold, cfg.warmup_max_steps,
            cfg.dense_steps, cfg.warmup_rule) == ("auto", 50, 0.5, 0, None, "adaptive")
    _, cfg = gradcomp.build_config("topk:local_steps=4")
    assert (cfg.warmup, cfg.warmup_rule) == ("auto", "none")
    _, cfg = gradcomp.build_config("topk:local_steps=4,warmup=adaptive")
    assert cfg.warmup_rule == "adaptive"
    with pytest.raises(TypeError, match=r"invalid warmup_window=2.5: expected int"):
        gradcomp.build_config("topk", warmup_window=2.5)


def _local_rounds(rank, world, spec, steps):
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from conftest import batch, small_net
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0)
    out = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        s = state.stats()
        out.append((state.step, s["warmup_switch_step"]))
    state.close()
    return out, torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_local_steps_count_outer_rounds():
    # H = 3 inner steps per round; window 1, eta 100: the switch at outer round 2 (the round
    # at inner step 9), reported in optimizer steps (2 rounds x 3 = step 6), the same on both
    # ranks, which end with the same parameters
    runs = spawn(_local_rounds, 2, args=("topk:ratio=0.1,local_steps=3,warmup=adaptive,"
                                         "warmup_window=1,warmup_threshold=100", 12),
                 timeout=180, pg_timeout=30)
    (a, pa), (b, pb) = runs
    assert a == b and torch.equal(pa, pb)
    assert [r for r, _ in a] == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert [s for _, s in a] == [None] * 8 + [6] * 4


def test_local_steps_compress_from_the_first_round_by_default():
    # warmup="auto" under local_steps: no adaptive rule (a run has too few rounds for its
    # windows: it would never leave dense), the first round already compressed
    (a, pa), (b, pb) = spawn(_local_rounds, 2, args=("topk:ratio=0.1,local_steps=3", 9),
                             timeout=180, pg_timeout=30)
    assert a == b and torch.equal(pa, pb)
    assert [s for _, s in a] == [0] * 9
