"""Threshold quantization (Strom 2015): error feedback conserves every gradient on 2 ranks
whose taus differ, degenerate settings equal exact results, the message has the documented
fixed size, a parameter's result does not depend on its bucket, bad options are refused.
Resume, inf/NaN and mixed precision: test_checkpoint.py, test_precision.py (-k threshold)."""
import math

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp.compressors.base import ParamSlice
from conftest import SHAPES, Scalars, layout, state_for

NAMES = list(SHAPES)
ADAPTIVE = "threshold:max_ratio=0.05"
FIXED = "threshold:adaptive=false,tau=0.5,max_ratio=0.05"  # N(0,1) input: the cap binds


def _numel(params):
    return params[-1].offset + params[-1].numel


def _two_ranks(rank, world, specs, steps):
    got = {}
    for spec in specs:
        name, cfg = gradcomp.build_config(spec, min_numel=0, warmup="none")
        st = gradcomp.State(name, cfg, group=dist.group.WORLD)
        g = torch.Generator().manual_seed(10 + rank)
        total = {n: torch.zeros(math.prod(s), dtype=torch.float64) for n, s in SHAPES.items()}
        sent = {n: torch.zeros_like(v) for n, v in total.items()}
        outs = []
        for step in range(steps):
            params = layout(NAMES if step % 2 else NAMES[::-1])  # a relayout as well
            x = torch.randn(_numel(params), generator=g)
            out = st.reduce(x.clone(), params)
            outs.append(out)
            for p in params:
                total[p.name] += x[p.offset : p.offset + p.numel].double()
                sent[p.name] += out[p.offset : p.offset + p.numel].double()
        mem = st.state_dict()["memory"]
        got[spec] = (outs, total, sent, mem["flat"]["residual"], mem["flat"].get("tau", {}),
                     st.stats())
    return got


def test_two_ranks_conserve_every_gradient_with_their_own_taus(spawn):
    """W x sum of the averages + every rank's residual == sum of every rank's gradients, per
    parameter. The adaptive taus differ between ranks: decoding a message with the
    receiver's tau instead of its sender's breaks the sum."""
    ranks = spawn(_two_ranks, 2, args=([ADAPTIVE, FIXED], 5))
    for spec in (ADAPTIVE, FIXED):
        got = [r[spec] for r in ranks]
        for r in got:  # every step compressed
            assert r[5]["compressing_since"] == 0 and r[5]["run_ratio"] > 1.5, spec
        for a, b in zip(got[0][0], got[1][0]):
            assert torch.equal(a, b)  # every rank gets the same average
        for n in NAMES:
            inputs = sum(r[1][n] for r in got)
            kept = sum(r[3][n].double() for r in got)
            torch.testing.assert_close(2 * got[0][2][n] + kept, inputs, atol=1e-4, rtol=1e-5)
        if spec == ADAPTIVE:
            taus = [r[4] for r in got]
            assert set(taus[0]) == set(NAMES)
            assert all(not torch.equal(taus[0][n], taus[1][n]) for n in NAMES)


def _y_steps(spec, steps=3):
    """Run ``spec`` (world 1) and yield (y = gradient + residual before, output, residual)."""
    st = state_for(spec)
    params = layout(NAMES)
    e = torch.zeros(_numel(params))
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(_numel(params), generator=g)
        y = x + e
        out = st.reduce(x.clone(), params)
        e = torch.cat(st._state.memory.peek("residual", NAMES))  # NAMES is the bucket's order
        yield y, out, e.clone()


def test_max_ratio_one_and_a_tiny_tau_send_every_element_as_plus_minus_tau():
    tau = torch.tensor(1e-3)
    for y, out, e in _y_steps("threshold:adaptive=false,tau=1e-3,max_ratio=1"):
        want = torch.where(y.abs() > tau, torch.sign(y) * tau, 0.0)
        assert (want != 0).float().mean() > 0.99
        assert torch.equal(out, want)
        assert torch.equal(e, y - want)


def test_a_huge_tau_sends_nothing_and_keeps_everything():
    for y, out, e in _y_steps("threshold:adaptive=false,tau=1e30"):
        assert torch.equal(out, torch.zeros_like(y))
        assert torch.equal(e, y)


def test_min_numel_above_every_tensor_is_plain_allreduce():
    params = layout(NAMES)
    x = torch.randn(_numel(params))
    name, cfg = gradcomp.build_config("threshold", min_numel=10**6, warmup="none")
    st = gradcomp.State(name, cfg)
    assert torch.equal(st.reduce(x.clone(), params), x)
    assert st._state.memory.names() == set()
    # only the bias (48 elements) below min_numel: it rides in the message, exactly
    name, cfg = gradcomp.build_config("threshold:max_ratio=0.05", min_numel=100, warmup="none")
    st = gradcomp.State(name, cfg)
    out = st.reduce(x.clone(), params)
    b = params[1]
    assert b.name == "fc.bias"
    assert torch.equal(out[b.offset : b.offset + b.numel], x[b.offset : b.offset + b.numel])
    assert not torch.equal(out, x)
    assert torch.equal(st._state.memory.peek("residual", ["fc.bias"])[0], torch.zeros(48))


def test_error_feedback_brings_the_outputs_close_to_the_inputs():
    """Gradients with a common direction plus noise: the sum of the outputs over the steps is
    within 25% of the sum of the inputs (sending nothing: 100%); one step is not."""
    params = layout(NAMES)
    n = _numel(params)
    g = torch.Generator().manual_seed(4)
    direction = torch.randn(n, generator=g)
    st = state_for("threshold:max_ratio=0.1")
    sent, total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    errs = []
    for _ in range(40):
        x = direction + torch.randn(n, generator=g)
        sent += st.reduce(x.clone(), params).double()
        total += x.double()
        errs.append(float((sent - total).norm() / total.norm()))
    assert errs[0] > 0.8  # one step of a 10% cap sends little of it
    assert errs[-1] < 0.25, errs


@pytest.mark.parametrize("spec", [ADAPTIVE, FIXED, "threshold:max_ratio=1,quantile=0.5"])
def test_stats_count_the_fixed_size_message(spec):
    """4 bytes per code slot (cap of them per compressed parameter), 4 per tau, 4 per dense
    element (+12: the non-finite flag and the step check); the same every step, however many elements passed."""
    params = layout(NAMES)
    name, cfg = gradcomp.build_config(spec, min_numel=100, warmup="none")  # fc.bias goes dense
    st = gradcomp.State(name, cfg)
    big = [p for p in params if p.numel >= 100]
    caps = sum(math.ceil(cfg.max_ratio * p.numel) for p in big)
    want = 4 * caps + 4 * len(big) + 4 * 48 + 12
    for scale in (1.0, 1e-6, 1e6):
        st.reduce(scale * torch.randn(_numel(params)), params)
        assert st.stats()["sent_bytes"] == want
    assert st.stats()["raw_bytes"] == 4 * _numel(params)


def test_adaptive_tau_sends_about_half_the_cap_and_logs_it():
    n = 20000
    params = [ParamSlice("w", (n,), 0, n)]
    st = state_for("threshold:max_ratio=0.02")  # cap 400, about 200 pass
    w = Scalars()
    st.attach(w)
    g = torch.Generator().manual_seed(5)
    counts = []
    for step in range(4):
        out = st.reduce(torch.randn(n, generator=g) * 10.0**-step, params)  # scale changes
        counts.append(int((out != 0).sum()))
    st.close()
    assert 100 <= counts[0] <= 300 and all(c <= 400 for c in counts), counts
    assert w.seen["gradcomp/sent_fraction"] == pytest.approx([c / n for c in counts])
    assert len(w.seen["gradcomp/threshold"]) == 4
    assert set(st.state_dict()["memory"]["flat"]["tau"]) == {"w"}


def test_a_parameter_result_does_not_depend_on_its_bucket():
    """All parameters in one bucket, or each alone: the same result, step after step."""
    params = layout(NAMES)
    one = state_for(ADAPTIVE)
    alone = state_for(ADAPTIVE)
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        x = torch.randn(_numel(params), generator=g)
        out = one.reduce(x.clone(), params)
        for b, p in enumerate(params):
            part = x[p.offset : p.offset + p.numel].clone()
            got = alone.reduce(part, [ParamSlice(p.name, p.shape, 0, p.numel)], bucket=b)
            assert torch.equal(got, out[p.offset : p.offset + p.numel]), p.name
    for st in (one, alone):  # compressed, every step
        assert st.stats()["compressing_since"] == 0 and st.stats()["run_ratio"] > 1.5


@pytest.mark.parametrize("kwargs, match", [
    ({"max_ratio": 0}, r"invalid max_ratio=0.0: allowed a number in \(0, 1\]"),
    ({"max_ratio": 1.5}, r"invalid max_ratio=1.5"),
    ({"adaptive": False, "tau": 0}, r"invalid tau=0.0: allowed a finite number > 0"),
    ({"adaptive": False, "tau": -1.0}, r"invalid tau=-1.0"),
    ({"adaptive": False, "tau": float("inf")}, r"invalid tau=inf"),
    ({"tau": 0.1}, r"invalid tau=0.1: allowed only with adaptive=false"),
    ({"adaptive": False}, r"invalid adaptive=False: allowed false only with a fixed tau"),
    ({"quantile": 1.0}, r"invalid quantile=1.0: allowed a number in \(0, 1\)"),
    ({"quantile": 0}, r"invalid quantile=0.0"),
    ({"ema": 1.0}, r"invalid ema=1.0: allowed a number in \[0, 1\)"),
    ({"sample_ratio": 0.0}, r"invalid sample_ratio=0.0"),
])
def test_bad_options_raise_value_error_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradcomp.build_config("threshold", **kwargs)


def test_spec_string_options_are_typed():
    name, cfg = gradcomp.build_config("threshold:adaptive=false,tau=1,max_ratio=0.1")
    assert (name, cfg.adaptive, cfg.tau, cfg.max_ratio) == ("threshold", False, 1.0, 0.1)
    assert isinstance(cfg.tau, float)
    assert gradcomp.build_config("threshold", quantile=0.9)[1].quantile == 0.9


@pytest.mark.parametrize("spec", [ADAPTIVE, "threshold:max_ratio=0.3,ema=0.2",
                                  "threshold:adaptive=false,tau=0.5"])
def test_the_gpu_path_equals_the_cpu_path(spec, monkeypatch):
    """The Triton kernels (tau, encode, decode, candidates; run by the interpreter, in blocks
    of 256) give the CPU path's bits: outputs, residuals and taus, step after step."""
    from gradcomp.kernels.triton import common
    monkeypatch.setattr(common, "BLOCK", 256)
    params = layout(NAMES)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(_numel(params), generator=g) * (1 + step) for step in range(4)]
    xs[2][:50] = 0.0  # zeros: a sample with few non-zero magnitudes
    got = {}
    for mode in ("cpu", "triton"):
        monkeypatch.setenv("GRADCOMP_KERNELS", mode)
        st = state_for(spec)
        outs = [st.reduce(x.clone(), params) for x in xs]
        got[mode] = outs, st.state_dict()["memory"]["flat"]
    for a, b in zip(got["cpu"][0], got["triton"][0]):
        assert torch.equal(a, b)
    assert (got["cpu"][0][-1] != 0).sum() > 20  # something was sent
    cpu, gpu = got["cpu"][1], got["triton"][1]
    assert cpu.keys() == gpu.keys() and "residual" in cpu
    for slot in cpu:
        for name in cpu[slot]:
            assert torch.equal(cpu[slot][name], gpu[slot][name]), (slot, name)


# (ema 0 and 0.5: lerp's weight 1 and 0.5 round alike with or without a fused multiply-add,
# which torch's CPU lerp uses and the interpreter does not)
@pytest.mark.parametrize("adaptive,ema", [(True, 0.5), (True, 0.0), (False, 0.5)])
def test_sample_and_tau_kernels_equal_the_reference(adaptive, ema, monkeypatch):
    """threshold_sample and threshold_tau (Triton, run by the interpreter in blocks of 64)
    give the reference's bits: y, keys, magnitudes, sent taus, thresholds and the tau memory;
    a bucket with gaps, a parameter of zeros, one mostly zeros, ties, taus not yet set."""
    from gradcomp.compressors import threshold as T
    from gradcomp.kernels import reference as ref
    from gradcomp.kernels import segmented
    from gradcomp.kernels import triton as tk
    monkeypatch.setattr(tk.common, "BLOCK", 64)
    cfg = gradcomp.build_config("threshold", max_ratio=0.05, ema=ema, min_numel=8,
                                **({} if adaptive else {"adaptive": False, "tau": 0.5}))[1]
    sizes = [3000, 5, 700, 1200, 4, 9000, 64]
    lay, at = [], 2
    for s in sizes:
        lay.append((at, s, s))
        at += s + 3
    n = at + 1
    tb = T._tables(tuple(lay), n, cfg, torch.device("cpu"))
    pl = tb.plan
    g = torch.Generator().manual_seed(3)
    for trial in range(3):
        y = torch.randn(n, generator=g)
        y[lay[2][0]:lay[2][0] + 700] = 0.0  # a parameter of zeros
        y[lay[3][0]:lay[3][0] + 1190] = 0.0  # ... and one of few non-zeros
        if trial == 2:
            y = torch.round(y * 2)  # ties
        shifts = torch.tensor([segmented.shift(trial * 31 + p, lay[i][1])
                               for p, i in enumerate(tb.big)])
        args = (pl.sample_base, pl.sample_of, shifts, pl.sample_n, pl.sample_off,
                pl.sample_key, pl.tail)
        want_k, want_m = ref.threshold_sample(y, None, None, *args)
        got_k, got_m = tk.threshold_sample(y, None, None, *args)
        assert torch.equal(got_k, want_k) and torch.equal(got_m.view(torch.int32),
                                                          want_m.view(torch.int32))
        # with error feedback: y = x + e written whole, the sample taken of it
        e = torch.randn(n, generator=g)
        x = y - e
        y1, y2 = torch.full((n,), 5.0), torch.full((n,), 5.0)
        want_k, want_m = ref.threshold_sample(x, e, y1, *args)
        got_k, got_m = tk.threshold_sample(x, e, y2, *args)
        assert torch.equal(y1, y2) and torch.equal(got_k, want_k)
        assert torch.equal(got_m.view(torch.int32), want_m.view(torch.int32))
        # y written over e itself (a context without a second buffer): the sample still
        # reads e as it was
        e_over = e.clone()
        got_k, got_m = tk.threshold_sample(x, e_over, e_over, *args)
        assert torch.equal(e_over, y1) and torch.equal(got_k, want_k)
        assert torch.equal(got_m.view(torch.int32), want_m.view(torch.int32))
        keys, order = torch.sort(want_k)
        taus = torch.zeros(len(lay)) if trial == 0 else torch.rand(len(lay), generator=g)
        taus[1] = 0.0
        mem = {}
        for name, fn in (("ref", ref.threshold_tau), ("triton", tk.threshold_tau)):
            mem[name] = taus.clone() if adaptive else None
            mem[name] = (*fn(keys, order, want_m, tb.zero_key, tb.est_start, tb.est_end,
                             mem[name], tb.where, pl.seg_thr, tb.seg_param, pl.param_seg,
                             cfg.tau, cfg.ema), mem[name])
        (ws, wt, wm), (gs, gt, gm) = mem["ref"], mem["triton"]
        assert torch.equal(gs, ws) and torch.equal(gt.nan_to_num(-1), wt.nan_to_num(-1))
        assert wm is None or torch.equal(gm, wm)


@pytest.mark.parametrize("has_res", [True, False])
@pytest.mark.parametrize("W", [1, 3])
def test_encode_and_decode_kernels_equal_the_reference(has_res, W, monkeypatch):
    """threshold_encode and threshold_decode (Triton, the interpreter, blocks of 64) give the
    reference's bits: the message (codes, dense values), the residual, and the decoded sum
    with the dense values' sums in rank order (-0.0 kept); unused slots, no dense values."""
    from gradcomp.kernels import reference as ref
    from gradcomp.kernels import triton as tk
    monkeypatch.setattr(tk.common, "BLOCK", 64)
    g = torch.Generator().manual_seed(W)
    n, K, P = 900, 150, 3
    for D in (0, 70):
        idx = torch.randperm(600, generator=g)[:K]
        vals = torch.randn(K, generator=g)
        vals[::7] = 0.0  # unused slots
        idx[::7] = 0
        owner = torch.arange(K) * P // K
        x = torch.randn(n, generator=g)
        x[650:655] = -0.0
        dense = torch.arange(640, 640 + D)
        res = torch.randn(n, generator=g)
        want, got = torch.zeros(K + P + D, dtype=torch.int32), torch.full((K + P + D,), 7,
                                                                           dtype=torch.int32)
        want[K:K + P] = got[K:K + P] = torch.rand(P, generator=g).view(torch.int32)
        tau = want[K:K + P].view(torch.float32)
        r1, r2 = (res.clone(), res.clone()) if has_res else (None, None)
        ref.threshold_encode(vals, idx, owner, tau, r1, x, dense, want)
        tk.threshold_encode(vals, idx, owner, got[K:K + P].view(torch.float32), r2, x, dense, got)
        assert torch.equal(got, want) and (not has_res or torch.equal(r1, r2))
        rows = torch.stack([want] * W)
        for w in range(1, W):  # other ranks' codes: other places, the same slots' owners
            rows[w, :K] = (torch.randperm(600, generator=g)[:K] + 1).to(torch.int32)
            rows[w, :K:5] *= -1
        rows[:, K + P:] = torch.randn(W, D, generator=g).view(torch.int32)
        rows[:, K + P:K + P + 5] = torch.tensor(-0.0).view(torch.int32)
        a = ref.threshold_decode(rows, K, P, owner, torch.zeros(n), dense)
        b = tk.threshold_decode(rows, K, P, owner, torch.zeros(n), dense)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)) or W > 1
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # W > 1: atomics in any order
        assert torch.equal(a[dense].view(torch.int32), b[dense].view(torch.int32))
