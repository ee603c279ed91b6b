"""Every method in one process (world size 1: collectives are the identity), as in the
PowerSGD authors' code: the algorithms are tested without spawning ranks."""
import math

import pytest
import torch

import gradcomp
from conftest import SHAPES, Scalars, lay_out, layout, state_for

# slots whose contents were not yet delivered, with the weight each counts towards the sum
SLOTS = {"residual": 1.0, "accumulation": 1.0, "server_residual": 1.0}
METHOD_SPECS = ["allreduce", "topk:ratio=0.05", "dgc:ratio=0.05", "onebit:chunk=64",
                "terngrad:error_feedback=true", "powersgd:rank=2",
                "terngrad:share_scalers=false,error_feedback=true", "powersgd:rank=1",
                "threshold:max_ratio=0.05", "threshold:adaptive=false,tau=0.5,max_ratio=0.05"]


def undelivered(state, names):
    mem = state.state_dict()["memory"]["flat"]
    return {n: sum(w * mem[s][n].double() for s, w in SLOTS.items() if s in mem) for n in names}


@pytest.mark.parametrize("spec", METHOD_SPECS)
def test_error_feedback_conserves_mass_across_relayouts(spec):
    """sum of everything sent + the final residual == sum of gradients, per parameter,
    even when the bucket layout changes (as after DDP's bucket rebuild)."""
    state = state_for(spec)
    names = list(SHAPES)
    g = torch.Generator().manual_seed(1)
    sent = {n: torch.zeros(math.prod(s), dtype=torch.float64) for n, s in SHAPES.items()}
    total = {n: torch.zeros_like(v) for n, v in sent.items()}
    for step in range(6):
        order = names if step % 3 else names[::-1]
        params = layout(order)
        x = torch.randn(sum(p.numel for p in params), generator=g)
        for p in params:
            total[p.name] += x[p.offset : p.offset + p.numel].double()
        out = state.reduce(x.clone(), params)
        for p in params:
            sent[p.name] += out[p.offset : p.offset + p.numel].double()
    left = undelivered(state, names)
    for n in names:
        torch.testing.assert_close(sent[n] + left[n], total[n], atol=1e-4, rtol=1e-5)
    # ... and most of it was delivered, not kept: a compressor that sends nothing and keeps
    # everything in memory conserves too, with cosine 0 (measured: 0.45 powersgd rank 1 to
    # 0.95 onebit; 1.0 allreduce)
    S, T = (torch.cat([d[n] for n in names]) for d in (sent, total))
    assert torch.nn.functional.cosine_similarity(S, T, dim=0) > 0.3


@pytest.mark.parametrize("spec", ["topk:ratio=1", "dgc:ratio=1", "allreduce"])
def test_ratio_one_is_the_identity(spec):
    state = state_for(spec)
    params = layout(list(SHAPES))
    for _ in range(3):
        x = torch.randn(sum(p.numel for p in params))
        assert torch.equal(state.reduce(x.clone(), params), x)


def test_powersgd_full_rank_reconstructs_the_gradient():
    state = state_for("powersgd:rank=64,min_compression_rate=0")
    params = layout(list(SHAPES))
    x = torch.randn(sum(p.numel for p in params))
    torch.testing.assert_close(state.reduce(x.clone(), params), x, atol=1e-4, rtol=1e-4)
    low = state_for("powersgd:rank=1,min_compression_rate=0").reduce(x.clone(), params)
    assert (low - x).norm() > 0.3 * x.norm()  # rank 1 really compresses


def test_stats_count_the_bytes_of_the_tensors_sent():
    params = layout(list(SHAPES))
    n = sum(p.numel for p in params)
    x = torch.randn(n)
    npad = sum(4 * math.ceil(p.numel / 4) for p in params)
    expect = {
        "allreduce": 4 * n,
        # values + int32 indices, k per parameter
        "topk:ratio=0.05": 8 * sum(math.ceil(0.05 * p.numel) for p in params),
        # 2 phases; each parameter starts a new chunk (world size 1: one part)
        "onebit:chunk=64": 2 * sum(math.ceil(p.numel / 64) * (8 + 8) for p in params),
        # scalers + five codes per byte over the parameters each padded to a multiple of 4
        # (unshared scalers: in the message, after the codes padded to a multiple of 4 bytes)
        "terngrad": 4 * len(params) + math.ceil(npad / 5),
        "terngrad:share_scalers=false": 4 * len(params) + 4 * math.ceil(math.ceil(npad / 5) / 4),
        "powersgd:rank=2": 4 * ((48 + 40) * 2 + (16 + 72) * 2 + 48),         # P + bias, then Q
    }
    for spec, nbytes in expect.items():
        if spec != "allreduce":
            nbytes += 12  # the "any rank non-finite?" flag and the step check beside each exchange
        st = state_for(spec)
        st.reduce(x.clone(), params)
        s = st.stats()
        assert s["sent_bytes"] == nbytes, spec
        assert s["raw_bytes"] == 4 * n and s["ratio"] == 4 * n / nbytes


def test_stats_codec_cpu_time_is_the_exchanging_threads():
    """codec_cpu_s: the CPU time the exchange took on its thread (time.thread_time), where
    codec_s is wall time: an exchange that waits 50 ms (here a sleep inside it, as a thread
    waits for a core shared with backward) counts the wait in codec_s, not in codec_cpu_s;
    codec_cpu_s is at most what this thread spent in the call."""
    import time
    params = lay_out([(f"w{i}", (256, 256)) for i in range(4)])
    x = torch.randn(sum(p.numel for p in params))
    st = state_for("topk:ratio=0.05")
    st.reduce(x.clone(), params)  # the first call warms caches
    run = st._state.guard.run

    def waiting(*a, **kw):
        time.sleep(0.05)
        return run(*a, **kw)

    st._state.guard.run = waiting
    c0 = time.thread_time()
    st.reduce(x.clone(), params)
    spent = time.thread_time() - c0
    s = st.stats()
    assert s["codec_s"] >= 0.05
    assert 0.0 < s["codec_cpu_s"] <= spent + 1e-3
    assert s["codec_cpu_s"] < s["codec_s"] - 0.04


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "onebit:chunk=64", "terngrad:error_feedback=true",
                                  "powersgd", "threshold:max_ratio=0.1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gradients_keep_fp32_memory(spec, dtype):
    state = state_for(spec)
    params = layout(list(SHAPES))
    x = torch.randn(sum(p.numel for p in params)).to(dtype)
    out = state.reduce(x.clone(), params)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # world size 1: the average is x itself, compressed (cosine measured 0.35 powersgd to
    # 0.8 onebit); zeros, or garbage of the right dtype, fail
    assert torch.nn.functional.cosine_similarity(out.float(), x.float(), dim=0) > 0.2
    mem = state.state_dict()["memory"]["flat"]["residual"]
    assert all(v.dtype == torch.float32 for v in mem.values())


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "terngrad", "powersgd", "dgc:ratio=0.05",
                                  "threshold:max_ratio=0.05"])
def test_same_seed_same_result(spec):
    params = layout(list(SHAPES))
    x = torch.randn(sum(p.numel for p in params))
    a, b = state_for(spec), state_for(spec)
    for _ in range(2):
        assert torch.equal(a.reduce(x.clone(), params), b.reduce(x.clone(), params))


def test_small_buckets_go_uncompressed():
    name, cfg = gradcomp.build_config("onebit", warmup="none")  # default min_numel
    st = gradcomp.State(name, cfg)
    params = layout(["fc.bias"])
    x = torch.randn(48)
    assert torch.equal(st.reduce(x.clone(), params), x)
    assert st.stats()["sent_bytes"] == 4 * 48 + 12  # + the non-finite flag and step check


def test_dgc_warmup_schedule_is_exponential():
    _, cfg = gradcomp.build_config("dgc", ratio=0.001, warmup_steps=4, warmup_ratio=0.25)
    got = [cfg.ratio_at(s) for s in range(6)]
    assert got[0] == 0.25 and got[4] == got[5] == 0.001
    assert all(math.isclose(got[i + 1] / got[i], (0.001 / 0.25) ** 0.25) for i in range(3))


def test_state_pickles_without_its_runtime():
    import pickle
    st = state_for("topk:ratio=0.1")
    params = layout(list(SHAPES))
    st.reduce(torch.randn(sum(p.numel for p in params)), params)
    st2 = pickle.loads(pickle.dumps(st))
    assert st2._state.group is None and st2.step == 1
    torch.testing.assert_close(st2.state_dict()["memory"], st.state_dict()["memory"])


@pytest.mark.parametrize("spec", ["onebit:chunk=64", "terngrad", "powersgd:rank=1", "topk:ratio=0.05",
                                  "threshold:max_ratio=0.05"])
def test_dense_steps_send_the_first_steps_uncompressed(spec):
    state = state_for(spec, dense_steps=2)
    params = layout(list(SHAPES))
    xs = [torch.randn(sum(p.numel for p in params)) for _ in range(3)]
    for x in xs[:2]:
        assert torch.equal(state.reduce(x.clone(), params), x)
        assert state._state.memory.names() == set()  # nothing compressed, nothing remembered
    assert not torch.equal(state.reduce(xs[2].clone(), params), xs[2])


def _run_logged(spec, details, grads, params):
    names = [p.name for p in params]
    st = state_for(spec)
    w = Scalars()
    st.attach(w, details=details)
    outs, want = [], []
    for g in grads:
        before = st._state.memory.peek("residual", names)
        owed = sum(float((g[p.offset : p.offset + p.numel] + (v if v is not None else 0)).double().square().sum())
                   for p, v in zip(params, before))
        outs.append(st.reduce(g.clone(), params).clone())
        after = st._state.memory.peek("residual", names)
        kept = sum(float(v.double().square().sum()) for v in after if v is not None)
        want.append(kept / owed)
    st.close()  # writes the last step's scalars
    return st, w.seen, outs, want


@pytest.mark.parametrize("spec, exact", [("topk:ratio=1", True), ("onebit:chunk=64", False),
                                         ("terngrad:error_feedback=true", False),
                                         ("topk:ratio=0.05", False), ("threshold:max_ratio=0.05", False)])
def test_residual_energy_is_what_the_residual_keeps(spec, exact):
    """With details, onebit/terngrad/topk/threshold log ||residual after||^2 / ||gradient + residual
    before||^2 per step (recomputed here from the memory around each step): 0 when the
    message carries everything; and turning details on changes no result and no memory."""
    params = layout(["fc.weight", "fc.bias", "conv.weight"])
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(params[-1].offset + params[-1].numel, generator=gen) for _ in range(4)]
    st, seen, outs, want = _run_logged(spec, True, grads, params)
    got = seen["gradcomp/residual_energy"]
    assert got == pytest.approx(want, rel=1e-6) and len(got) == 4
    # TernGrad's rounding error is about as large as its input: up to ~1.5 in energy
    assert all(v < 1e-12 for v in got) if exact else all(0.05 < v < 1.6 for v in got)
    plain, seen_off, outs_off, _ = _run_logged(spec, False, grads, params)
    assert "gradcomp/residual_energy" not in seen_off
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_off))
    on, off = st.state_dict()["memory"], plain.state_dict()["memory"]
    assert on["flat"].keys() == off["flat"].keys()
    for slot in on["flat"]:
        assert on["flat"][slot].keys() == off["flat"][slot].keys()
        assert all(torch.equal(on["flat"][slot][n], off["flat"][slot][n]) for n in on["flat"][slot])


def test_residual_energy_not_logged_for_powersgd_nor_skipped_steps():
    """PowerSGD's residual holds the rank's deviation from the average: it logs its own
    approx_error instead. A step with inf (skipped, index reused) logs nothing of its own."""
    params = layout(["fc.weight", "conv.weight"])
    n = params[-1].offset + params[-1].numel
    _, seen, _, _ = _run_logged("powersgd:rank=1", True, [torch.randn(n) for _ in range(3)], params)
    assert "gradcomp/residual_energy" not in seen and len(seen["gradcomp/approx_error"]) == 3
    st = state_for("terngrad:error_feedback=true")
    w = Scalars()
    st.attach(w, details=True)
    bad = torch.randn(n)
    bad[5] = float("inf")
    for g in (torch.randn(n), bad, torch.randn(n), torch.randn(n)):
        st.reduce(g, params)
    st.close()
    got = w.seen["gradcomp/residual_energy"]
    assert len(got) == 3 and all(math.isfinite(v) and v > 0 for v in got)  # steps 0, 1, 2


def test_terngrad_keeps_no_residual_by_default():
    """TernGrad's rounding error is as large as its input, so error feedback would not
    contract: by default (as in the paper) it sends the unbiased message and remembers
    nothing; error_feedback=true keeps the residual."""
    params = layout(list(SHAPES))
    x = torch.randn(sum(p.numel for p in params))
    plain, fed = state_for("terngrad"), state_for("terngrad:error_feedback=true")
    plain.reduce(x.clone(), params)
    fed.reduce(x.clone(), params)
    assert plain._state.memory.names() == set()
    assert fed._state.memory.names() == set(SHAPES)


def test_sparse_error_feedback_keeps_what_was_not_sent_bit_for_bit():
    """Sparse error feedback's update (top-k's and DGC's message encoder sparse_encode,
    reference and Triton): y less each sent value at its index, what rounding took kept, 0
    at the dense parameters (positions 4 and 5), and the padding slots (value 0 at index 0)
    change no bit, not even a -0.0 at index 0; with error feedback off (no y) it writes
    nothing."""
    x = torch.tensor([-0.0, 1.5, -2.25, 3.0, 7.0, 8.0])
    sent = torch.tensor([1.5, -2.0, 0.0, 0.0])  # -2.25 went as -2 (rounded): -0.25 stays
    idx = torch.tensor([1, 2, 0, 0])
    want = torch.tensor([-0.0, 0.0, -0.25, 3.0, 0.0, 0.0])
    from gradcomp.kernels import reference
    from gradcomp.kernels import triton as tk
    for mod in (reference, tk):
        for y in (x.clone(), None):
            before = x.clone()
            out = torch.empty(4, dtype=torch.int32), torch.empty(4), torch.empty(2)
            mod.sparse_encode(sent, sent, idx, y, x, torch.tensor([4, 5]), *out,
                              torch.empty(0, dtype=torch.uint8))
            if y is not None:
                assert torch.equal(y.view(torch.int32), want.view(torch.int32)), mod
            assert torch.equal(x.view(torch.int32), before.view(torch.int32)), mod
            assert torch.equal(out[0], idx.int()) and torch.equal(out[2], x[4:])


@pytest.mark.parametrize("n", [300, 257, 129])
def test_onebit_scales_of_a_partly_filled_chunk_count_its_real_elements(n):
    """A parameter's last chunk, partly filled, is padded with zeros: its two values must be
    the means of its real non-negative and negative elements, the padding not counted."""
    from gradcomp.compressors.base import ParamSlice
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[-1] = x[-1].abs() + 0.5  # a positive value in the last chunk, whatever the draw
    _, cfg = gradcomp.build_config("onebit:chunk=64", min_numel=0, warmup="none",
                                   error_feedback=False)
    state = gradcomp.State("onebit", cfg)
    out = state.reduce(x.clone(), [ParamSlice("w", (n,), 0, n)])
    state.close()
    for start in range(0, n, 64):
        c = x[start : start + 64].double()
        want = torch.where(c >= 0, c[c >= 0].mean(), c[c < 0].mean())
        torch.testing.assert_close(out[start : start + 64].double(), want, rtol=1e-6, atol=0)


def test_topk_start_ratio_falls_to_ratio_in_stages():
    _, cfg = gradcomp.build_config("topk", ratio=0.025, start_ratio=0.1, decay_steps=400)
    got = [cfg.ratio_at(s) for s in range(500)]
    assert got[0] == 0.1 and got[350] > 0.025 and set(got[400:]) == {0.025}
    assert all(a >= b for a, b in zip(got, got[1:]))
    assert len(set(got)) == 9  # two octaves in quarters: each stage's tables built once
    for opts in ({"ratio": 0.025}, {"ratio": 0.2, "start_ratio": 0.1, "decay_steps": 400}):
        _, off = gradcomp.build_config("topk", **opts)  # off; at or below ratio: off too
        assert {off.ratio_at(s) for s in range(500)} == {opts["ratio"]}


def test_topk_ratio_of_its_own_with_adam_runs_throughout():
    """A user's ratio above the Adam defaults' start_ratio is what runs, not a refusal."""
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(net.parameters())
    _, cfg = gradcomp.hooks.options.for_optimizer("topk", {"ratio": 0.2}, opt)
    assert cfg.start_ratio == 0.1 and {cfg.ratio_at(s) for s in range(500)} == {0.2}
    _, cfg = gradcomp.hooks.options.for_optimizer("topk", {}, opt)
    assert cfg.ratio_at(0) == 0.1 and cfg.ratio_at(400) == 0.025 and cfg.value_dtype == "bf16"


@pytest.mark.parametrize("opts, bad", [({"start_ratio": -0.1}, "start_ratio"),
                                        ({"start_ratio": 1.5}, "start_ratio"),
                                        ({"decay_steps": -1}, "decay_steps")])
def test_topk_start_ratio_refuses_bad_values(opts, bad):
    with pytest.raises(ValueError, match=bad):
        gradcomp.build_config("topk", **opts)


def test_topk_start_ratio_counts_compressed_steps_from_the_switch():
    """Two dense steps, then the message shrinks from start_ratio's k to ratio's over
    decay_steps compressed steps: the bytes on the wire follow ratio_at(step - switch)."""
    from gradcomp.kernels.segmented import budget
    state = state_for("topk:ratio=0.02,start_ratio=0.16,decay_steps=6", dense_steps=2)
    cfg = state.config
    params = layout(list(SHAPES))
    n = sum(p.numel for p in params)
    sent = []  # each step's bytes: 8 per kept value (fp32 value, int32 index) + 12
    for _ in range(10):
        state.reduce(torch.randn(n), params)
        sent.append(state.stats()["sent_bytes"])
    assert sent[0] == sent[1] == 4 * n + 12
    for step in range(2, 10):
        k = sum(budget(p.numel, cfg.ratio_at(step - 2), cfg.sample_ratio)[0] for p in params)
        assert sent[step] == 8 * k + 12, step
    assert sent[2] > sent[5] > sent[8] == sent[9]
    assert sent[2] > 7 * sent[9]  # 0.16 against 0.02 of every parameter


@pytest.mark.parametrize("spec,kernels", [("powersgd", "cpu"), ("powersgd", "triton"),
                                          ("onebit", "cpu"), ("topk:ratio=0.1", "cpu")])
def test_an_exchange_whose_last_collective_raises_leaves_the_memory_as_it_was(spec, kernels,
                                                                             monkeypatch):
    """A collective that raises inside a compressed exchange (its last one: PowerSGD's Q
    allreduce, after its GPU path wrote the Q's) raises to the caller and leaves every
    memory slot (residuals, PowerSGD's Q's) bit for bit as before the exchange."""
    from gradcomp.comm import Comm
    monkeypatch.setenv("GRADCOMP_KERNELS", kernels)
    st = state_for(spec)
    params = layout(["fc.weight", "fc.bias", "conv.weight"])
    n = sum(p.numel for p in params)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        st.reduce(torch.randn(n, generator=g), params)
    before = st.state_dict()["memory"]
    assert any(d for d in before["flat"].values()) or any(d for d in before["tensors"].values())
    calls = []
    names = ("allreduce", "allgather", "all_to_all", "reduce_scatter")
    originals = {k: getattr(Comm, k) for k in names}

    def counting(k, fail_at):
        def f(self, *a, **kw):
            calls.append(k)
            if len(calls) == fail_at:
                raise RuntimeError("the link went down")
            return originals[k](self, *a, **kw)
        return f
    for k in names:
        monkeypatch.setattr(Comm, k, counting(k, None))
    x = torch.randn(n, generator=g)
    st.reduce(x.clone(), params)  # counts this exchange's collectives (memory moves on)
    last = len(calls)
    assert last >= 1
    st2 = state_for(spec)  # the same two steps again, then the failing third
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        st2.reduce(torch.randn(n, generator=g), params)
    calls.clear()
    for k in names:
        monkeypatch.setattr(Comm, k, counting(k, last))
    with pytest.raises(RuntimeError, match="the link went down"):
        st2.reduce(x.clone(), params)
    after = st2.state_dict()["memory"]
    for part in ("flat", "tensors"):
        assert before[part].keys() == after[part].keys()
        for slot, d in before[part].items():
            for name, t in d.items():
                assert torch.equal(t, after[part][slot][name]), (part, slot, name)
