"""The local-steps methods' codecs in one process (world size 1: the collectives are the
identity): sparseloco's chunk-wise top-k with 1-bit values and group means under decayed error
feedback, diloco's int8 / 4-bit rows and its 1-3 bit signs and magnitude groups. Their
rounds, resume and conservation on two ranks: tests/test_local_steps.py; on a transformer
with AdamW: tests/test_convergence_gpt.py."""
import math

import pytest
import torch

import gradcomp
from gradcomp.compressors.diloco import dequantize, quantize
from gradcomp.compressors.rows import pack_signs, pack_uint, unpack_signs, unpack_uint
from conftest import SHAPES, layout, lay_out, state_for

NAMES = list(SHAPES)
# the methods whose defaults take local steps: every one has its codec tested here
# (tests/test_registry.py checks the list against the registry)
LOCAL_METHODS = ["sparseloco", "diloco"]


def _run(spec, steps=4, order=NAMES, seed=0):
    """(per step: (input, output) by parameter name, the state) for a one-process state."""
    state = state_for(spec)
    params = layout(order)
    g = torch.Generator().manual_seed(seed)
    seen = []
    for _ in range(steps):
        x = torch.randn(sum(p.numel for p in params), generator=g)
        out = state.reduce(x.clone(), params)
        seen.append({p.name: (x[p.offset:p.offset + p.numel].clone(),
                              out[p.offset:p.offset + p.numel].clone()) for p in params})
    return seen, state


def _residual(state, names):
    mem = state.state_dict()["memory"]["flat"]["residual"]
    return {n: mem[n].reshape(-1).double() for n in names}


def test_signs_pack_and_unpack():
    neg = torch.rand(3, 64, generator=torch.Generator().manual_seed(0)) < 0.5
    packed = pack_signs(neg)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(unpack_signs(packed), 1.0 - 2.0 * neg.float())


@pytest.mark.parametrize("bits", [1, 5, 8, 12, 15])
def test_places_pack_end_to_end_in_their_bits_and_unpack(bits):
    v = torch.randint(0, 2 ** bits, (3, 16), generator=torch.Generator().manual_seed(bits))
    packed = pack_uint(v, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16 * bits // 8)
    assert torch.equal(unpack_uint(packed, bits), v)
    # bit b of value i at bit i * bits + b of the row
    i, b = 5, bits - 1
    at = i * bits + b
    assert torch.equal((packed[:, at // 8].long() >> (at % 8)) & 1, (v[:, i] >> b) & 1)


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_quantize_to_the_nearest_level_of_their_own_scale(bits):
    m = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * torch.tensor(
        [1e-4, 1.0, 10.0, 0.0, 3.0]).unsqueeze(1)
    codes, scale = quantize(m, bits)
    assert codes.shape == (5, 32 * bits // 8)
    back = dequantize(codes, scale, bits)
    top = 2 ** (bits - 1) - 1
    assert torch.equal(scale, m.abs().amax(1) / top)
    assert (back - m).abs().le(scale.unsqueeze(1) / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[3], torch.zeros(32))  # an all-zero row stays zero
    # a row's largest value travels exactly (to its scale's rounding)
    torch.testing.assert_close(back.abs().amax(1), m.abs().amax(1))


def test_sparseloco_sends_k_per_row_each_its_group_mean_with_its_sign():
    seen, state = _run("sparseloco:chunk=64,k=16,levels=4,decay=1", steps=1)
    for name, (x, out) in seen[0].items():
        rows = x.split(64)
        got = out.split(64)
        for r, o in zip(rows, got):
            kept = min(16, r.numel())
            assert int((o != 0).sum()) == kept
            order = r.abs().argsort(descending=True)[:kept]
            assert torch.equal(o[order].sign(), r[order].sign())
            means = r[order].abs().split(4)  # groups of k / levels by rank
            for grp, idx in zip(means, order.split(4)):
                torch.testing.assert_close(o[idx].abs(), grp.mean().expand(len(idx)))
    assert state.stats()["ratio"] > 1


def test_sparseloco_lossless_settings_send_the_input_exactly():
    seen, _ = _run("sparseloco:chunk=64,k=64,levels=64,decay=1", steps=2)
    for step in seen:
        for name, (x, out) in step.items():
            torch.testing.assert_close(out, x, atol=0, rtol=0)


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_sparseloco_error_feedback_keeps_what_was_not_sent_with_its_decay(decay):
    """e_t = decay e_{t-1} + x_t - sent_t, per element."""
    seen, state = _run(f"sparseloco:chunk=64,k=8,levels=2,decay={decay}", steps=3)
    e = {n: torch.zeros(math.prod(s), dtype=torch.float64) for n, s in SHAPES.items()}
    for step in seen:
        for n, (x, out) in step.items():
            e[n] = decay * e[n] + x.double() - out.double()
    left = _residual(state, NAMES)
    for n in NAMES:
        torch.testing.assert_close(left[n], e[n], atol=1e-5, rtol=1e-5)
        assert left[n].abs().sum() > 0


@pytest.mark.parametrize("bits", [4, 3, 2, 1])
def test_diloco_error_feedback_conserves_in_one_process(bits):
    seen, state = _run(f"diloco:chunk=16,bits={bits}", steps=4)
    left = _residual(state, NAMES)
    for n in NAMES:
        sent = sum(s[n][1].double() for s in seen)
        total = sum(s[n][0].double() for s in seen)
        torch.testing.assert_close(sent + left[n], total, atol=1e-5, rtol=1e-5)
        assert left[n].abs().sum() > 0


@pytest.mark.parametrize("spec", ["sparseloco:chunk=64,k=8", "diloco:chunk=16,bits=4",
                                  "diloco:chunk=32", "diloco:chunk=64,bits=1",
                                  "diloco:chunk=64,bits=3"])
def test_a_parameters_result_does_not_depend_on_its_bucket_neighbours(spec):
    """Each parameter's inputs fixed by name; three layouts give bit-identical outputs."""
    g = torch.Generator().manual_seed(3)
    xs = [{n: torch.randn(math.prod(s), generator=g) for n, s in SHAPES.items()} for _ in range(3)]
    outs = []
    for order in (NAMES, NAMES[::-1], [NAMES[1], NAMES[0], NAMES[2]]):
        state, params = state_for(spec), layout(order)
        res = []
        for step in xs:
            x = torch.cat([step[p.name] for p in params])
            out = state.reduce(x, params)
            res.append({p.name: out[p.offset:p.offset + p.numel].clone() for p in params})
        outs.append(res)
    for other in outs[1:]:
        for s0, s1 in zip(outs[0], other):
            for n in NAMES:
                assert torch.equal(s0[n], s1[n]), (spec, n)


def test_diloco_one_bit_rows_are_signs_times_their_mean_magnitude():
    seen, _ = _run("diloco:chunk=64,bits=1", steps=1)
    for name, (x, out) in seen[0].items():
        for r, o in zip(x.split(64), out.split(64)):
            torch.testing.assert_close(o, r.sign() * r.abs().mean())


@pytest.mark.parametrize("bits", [2, 3])
def test_diloco_low_bit_rows_are_signs_times_their_magnitude_groups_means(bits):
    """Each value goes as its sign times one of its row's 2^(bits-1) magnitudes: the groups
    are intervals of |x| (a larger |x| never takes a smaller magnitude), each magnitude the
    mean |x| of its group; padding (the short last row) counts in no group."""
    seen, _ = _run(f"diloco:chunk=64,bits={bits}", steps=1)
    levels = 2 ** (bits - 1)
    for name, (x, out) in seen[0].items():
        for r, o in zip(x.split(64), out.split(64)):
            assert torch.equal(o.sign(), r.sign())
            mags = o.abs()
            assert len(mags.unique()) <= levels
            order = r.abs().argsort()
            assert (mags[order].diff() >= 0).all()
            for v in mags.unique():
                torch.testing.assert_close(v, r.abs()[mags == v].mean())


def test_more_bits_leave_less_error_on_gaussian_rows():
    m = torch.randn(32, 1024, generator=torch.Generator().manual_seed(2))
    err = []
    for bits in (1, 2, 3, 4):
        codes, scale = quantize(m, bits)
        assert codes.shape == (32, 1024 * bits // 8)
        err.append(float((dequantize(codes, scale, bits) - m).pow(2).mean()))
    # Lloyd-Max on a Gaussian: 0.363, 0.118, 0.035 of the variance; 4 bits' uniform 0.02
    assert err[0] > 0.3 and 0.1 < err[1] < 0.13 and 0.025 < err[2] < 0.04 and err[3] < err[2]


def test_message_sizes_are_as_documented():
    shapes = [("w", (300, 100)), ("b", (40,))]  # 30000 elements: rows of the chunk, one short
    params = lay_out(shapes)
    n = sum(p.numel for p in params)
    flag = 12  # the inf/NaN guard's flag beside each exchange: 3 fp32 (hooks/guard.py)
    name, cfg = gradcomp.build_config("sparseloco", warmup="none")
    st = gradcomp.State(name, cfg)
    st.reduce(torch.randn(n), params)
    rows, k = -(-30000 // cfg.chunk), cfg.k
    # per row: 12-bit places (chunk 4096), one sign bit each, an fp32 mean per group; the
    # bias, under min_numel (64), dense in fp32
    assert cfg.chunk == 4096 and cfg.min_numel == 64
    row = 12 * k // 8 + k // 8 + 4 * cfg.levels
    assert st.stats()["sent_bytes"] == rows * row + 4 * 40 + flag
    name, cfg = gradcomp.build_config("sparseloco:min_numel=0", warmup="none")
    st = gradcomp.State(name, cfg)
    st.reduce(torch.randn(n), params)
    # every parameter as rows: the bias one short row
    assert st.stats()["sent_bytes"] == (rows + 1) * row + flag
    name, cfg = gradcomp.build_config("diloco", warmup="none")
    st = gradcomp.State(name, cfg)
    st.reduce(torch.randn(n), params)
    rows = -(-30000 // cfg.chunk) + 1  # the bias is a row of its own (min_numel=0)
    # one allgather of the rows' sign and magnitude-group planes and 2^(bits-1) fp32 means
    assert cfg.bits == 3
    assert st.stats()["sent_bytes"] == rows * (cfg.chunk * 3 // 8 + 4 * 4) + flag
    name, cfg = gradcomp.build_config("diloco:bits=8", warmup="none")
    st = gradcomp.State(name, cfg)
    st.reduce(torch.randn(n), params)
    # two phases (all-to-all, allgather), each the rows' codes and an fp32 scale per row
    assert st.stats()["sent_bytes"] == 2 * rows * (cfg.chunk + 4) + flag


@pytest.mark.parametrize("spec, word", [("sparseloco:k=12", "k=12"),
                                        ("sparseloco:k=64,levels=3", "levels=3"),
                                        ("sparseloco:chunk=65536", "chunk=65536"),
                                        ("sparseloco:decay=0", "decay=0"),
                                        ("diloco:bits=5", "bits=5"),
                                        ("diloco:chunk=12", "chunk=12"),
                                        ("diloco:chunk=7", "chunk=7")])
def test_bad_options_are_named(spec, word):
    with pytest.raises(ValueError, match=word.replace("=", "=.?")):
        gradcomp.build_config(spec)


def test_the_named_methods_default_to_their_own_local_steps():
    for name in ("sparseloco", "diloco"):
        _, cfg = gradcomp.build_config(name)
        assert cfg.local_steps > 1 and cfg.warmup_rule == "none", name
