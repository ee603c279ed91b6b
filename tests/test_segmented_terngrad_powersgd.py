"""The segmented codec (issue 18) for TernGrad and PowerSGD: one bucket in a fixed number of
ops, every result still a function of its parameter alone.

Each method runs on a whole bucket through a small BucketContext of our own (world size 1,
or W mirrored ranks that all hold this rank's tensors) and is compared, parameter by
parameter and bit for bit, with a per-parameter reference written here from the reference
kernels: many tiny parameters, 1-3 element ones, one large one, and parameters below
``min_numel`` mixed in. A relayout between steps (other order, other buckets) must not
change a bit. The op count of a 160-tensor bucket is at most 1.5x that of a 16-tensor one.
"""
import math
import zlib

import pytest
import torch

from gradcomp_bench import bench_ops
from gradcomp.compressors.base import METHODS, ParamSlice
from gradcomp.compressors.powersgd import _init_q, bmm, orthonormalize
from gradcomp.compressors.terngrad import layer_stats
from gradcomp.hooks import build_config
from gradcomp.hooks.guard import Guard
from gradcomp.kernels import lowrank, reference as ref
from gradcomp.memory import ParamMemory
from conftest import lay_out


class MirrorComm:
    """W ranks that all hold this rank's tensors (W = 1: the identity)."""

    def __init__(self, W):
        self.world_size, self.rank = W, 0

    def allreduce(self, t, op="sum"):
        if op == "sum" and self.world_size > 1:
            t.mul_(self.world_size)
        return t

    def allgather(self, t):
        return t.unsqueeze(0).expand(self.world_size, *t.shape).contiguous()


class Ctx:
    """A BucketContext over a ParamMemory shared across steps and layouts."""

    def __init__(self, params, step, mem, W=1, bucket=0):
        self.comm, self.step, self.params, self.mem, self.bucket = MirrorComm(W), step, params, mem, bucket
        self.device, self.live, self.logging, self.details = torch.device("cpu"), None, False, False

    def memory(self, slot):
        return self.mem.flat(slot, self.bucket, [p.name for p in self.params],
                             [p.numel for p in self.params], self.device)

    def memory_next(self, slot):  # no double buffering: written in place
        m = self.memory(slot)
        return m, m

    def tensor(self, slot, name, init):
        return self.mem.tensor(slot, name, init)

    def seed(self, stream, name):
        return seed_of(self.step, name)

    def verdict(self, out):  # no guard here
        return None


def seed_of(step, name):
    return (step * 1_000_003 + zlib.crc32(name.encode()) * 7919) % 2**63




def by_name(out, params):
    return {p.name: out[p.offset : p.offset + p.numel].clone() for p in params}


def compressor(spec, **kw):
    name, cfg = build_config(spec, **kw)
    return METHODS[name].compressor(cfg)


# Many tiny parameters (1-7 elements), one large one, middling ones; with min_numel=6 the
# ones below 6 elements go dense. Sizes not multiples of 4 exercise the padding.
MIXED = ([(f"tiny{i}", (1 + i % 7,)) for i in range(40)] + [("huge", (70001,))]
         + [(f"mid{i}", (3 + i, 5 + 2 * i)) for i in range(12)] + [("one", (1, 1)), ("b", (3,))])


# --------------------------------------------------------------------------- TernGrad
def terngrad_reference(x, params, cfg, step, W, e=None):
    """TernGrad parameter by parameter with the reference kernels: each parameter padded to a
    multiple of 4 alone, its statistics alone (the CPU's path over one segment), its codes drawn with its seed as an int (one
    stream counted from its first element). Returns (average, new residuals by name)."""
    out, res = torch.empty_like(x), {}
    for p in params:
        v = x[p.offset : p.offset + p.numel]
        if p.size < cfg.min_numel:  # dense: as it is on the wire, the W rows summed in order, / W
            total = v.clone()
            for _ in range(W - 1):
                total += v
            out[p.offset : p.offset + p.numel] = total / W
            continue
        m = -(-p.numel // 4) * 4
        y = torch.zeros(m)
        y[: p.numel] = v
        if e is not None:
            y[: p.numel] += e[p.name]
        unclipped = y.clone()
        s = layer_stats(y, torch.tensor([m]), cfg.clip, sizes=[m])  # the CPU's path, one layer
        r = torch.zeros(m) if e is not None else None
        codes = ref.ternary_compress(y, r, s, torch.zeros(m, dtype=torch.long), seed_of(step, p.name))
        if e is not None:
            if cfg.clip:
                r.add_(unclipped).sub_(y)
            res[p.name] = r[: p.numel]
        acc = torch.zeros(m)
        ref.ternary_decompress(codes.expand(W, -1).contiguous(), s.expand(W, 1).contiguous(),
                               torch.zeros(m, dtype=torch.long), acc, 1.0 / W)
        out[p.offset : p.offset + p.numel] = acc[: p.numel]
    return out, res


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
@pytest.mark.parametrize("spec, W", [("terngrad", 1), ("terngrad:share_scalers=false", 2),
                                     ("terngrad:error_feedback=true,clip=0", 1),
                                     ("terngrad:error_feedback=true", 2)])
def test_terngrad_bucket_equals_per_parameter_reference(spec, W, backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("GRADCOMP_KERNELS", backend)
    method = compressor(spec, min_numel=6)
    cfg = method.config
    params = lay_out(MIXED)
    n = sum(p.numel for p in params)
    g = torch.Generator().manual_seed(3)
    mem = ParamMemory()
    e = {p.name: torch.zeros(p.numel) for p in params} if cfg.error_feedback else None
    for step in range(2):  # the second step starts from the first one's residual
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g)
        want, res = terngrad_reference(x, params, cfg, step, W, e)
        got = method.reduce(x.clone(), Ctx(params, step, mem, W))
        assert torch.equal(got, want)
        if e is not None:
            flat = mem.flat("residual", 0, [p.name for p in params], [p.numel for p in params], "cpu")
            for p in params:
                want_r = res.get(p.name, torch.zeros(p.numel))
                assert torch.equal(flat[p.offset : p.offset + p.numel], want_r), p.name
                e[p.name] = want_r.clone()


def test_terngrad_small_layers_go_exact_alone_or_beside_compressed_ones():
    """A layer under ``min_numel`` comes back the same whether its bucket holds compressed
    layers (the message's fp32 field) or only small ones (TernGrad's dense step in a
    compressed step): every rank's value as it is, averaged in fp32, bit for bit."""
    method = compressor("terngrad", min_numel=6)
    params = lay_out(MIXED)
    small = [p for p in params if p.numel < 6]
    alone = lay_out([(p.name, p.shape) for p in small])
    x = torch.randn(sum(p.numel for p in params), generator=torch.Generator().manual_seed(5))
    mixed = by_name(method.reduce(x.clone(), Ctx(params, 0, ParamMemory(), 2)), params)
    y = torch.cat([x[p.offset:p.offset + p.numel] for p in small])
    got = by_name(method.reduce(y.clone(), Ctx(alone, 0, ParamMemory(), 2)), alone)
    for p in small:
        v = x[p.offset:p.offset + p.numel]
        assert torch.equal(got[p.name], mixed[p.name]) and torch.equal(got[p.name], (v + v) / 2)
        assert torch.equal(got[p.name], v)  # sent as it is: not rounded


def test_terngrad_reference_above_is_not_blind():
    # the per-parameter reference tells the parameters' streams apart: one stream over the
    # whole bucket (the seed of the first parameter) gives other codes
    params = lay_out([("a", (64,)), ("b", (64,))])
    x = torch.randn(128, generator=torch.Generator().manual_seed(0))
    cfg = compressor("terngrad", min_numel=0).config
    want, _ = terngrad_reference(x, params, cfg, 0, 1)
    s = torch.stack([x[:64].abs().max(), x[64:].abs().max()])
    seg = torch.arange(128) // 64
    y = x.clone()
    layer_stats(y, torch.tensor([64, 64]), cfg.clip, seg, [64, 64])
    s = layer_stats(y.clone(), torch.tensor([64, 64]), 0)
    acc = torch.zeros(128)
    ref.ternary_decompress(ref.ternary_compress(y, None, s, seg, seed_of(0, "a")).unsqueeze(0),
                           s.unsqueeze(0), seg, acc)
    assert torch.equal(acc[:64], want[:64]) and not torch.equal(acc[64:], want[64:])


# --------------------------------------------------------------------------- relayout
RELAYOUT_SHAPES = ([(f"w{i}", (24, 20)) for i in range(6)] + [(f"v{i}", (10, 3, 3, 3)) for i in range(4)]
                   + [(f"bias{i}", (24,)) for i in range(5)] + [("odd", (13, 7))])


@pytest.mark.parametrize("spec", ["terngrad:min_numel=0", "terngrad:error_feedback=true,min_numel=32",
                                  "powersgd:rank=2,min_numel=0", "powersgd:rank=1,min_numel=100",
                                  "powersgd:rank=3,min_compression_rate=0,min_numel=0"])
def test_relayout_between_steps_changes_no_bit(spec):
    """Steps 0-3 in one bucket against step 0 in it, then steps 1-3 with the parameters
    shuffled into two buckets: every parameter's output identical at every step."""
    g = torch.Generator().manual_seed(7)
    grads = [{nm: torch.randn(math.prod(s), generator=g) for nm, s in RELAYOUT_SHAPES} for _ in range(4)]
    shuffled = [RELAYOUT_SHAPES[i] for i in torch.randperm(len(RELAYOUT_SHAPES), generator=g)]
    layouts = [[lay_out(RELAYOUT_SHAPES)], [lay_out(shuffled[:7]), lay_out(shuffled[7:])]]
    runs = []
    for relayout in (False, True):
        method, mem, got = compressor(spec), ParamMemory(), []
        for step in range(4):
            buckets = layouts[1 if relayout and step else 0]
            res = {}
            for b, params in enumerate(buckets):
                x = torch.cat([grads[step][p.name] for p in params])
                res.update(by_name(method.reduce(x, Ctx(params, step, mem, bucket=b)), params))
            got.append(res)
        runs.append(got)
    for a, b in zip(*runs):
        for nm in a:
            assert torch.equal(a[nm], b[nm]), nm


# --------------------------------------------------------------------------- PowerSGD
def powersgd_reference(x, params, method, W, mem):
    """PowerSGD matrix by matrix (a batch of one), dense parameters as a plain average."""
    cfg = method.config
    mats, dense = method.plan(params)
    if not mats:
        return x.clone()
    out = x.clone()
    for p, n, m, r in mats:
        M = x[p.offset : p.offset + p.numel].view(1, n, m).clone()
        Q = mem.tensor("q", p.name, lambda: _init_q(cfg.seed, p.name, m, r, "cpu"))
        P = bmm(M, Q.unsqueeze(0)).mul_(W) if W > 1 else bmm(M, Q.unsqueeze(0))
        P = orthonormalize(P.clone())
        Qn = bmm(M.transpose(1, 2), P)
        if W > 1:
            Qn.mul_(W)
        Q.copy_(Qn[0])
        out[p.offset : p.offset + p.numel] = bmm(P, Qn.transpose(1, 2)).div_(W).view(-1)
    for p in dense:
        v = x[p.offset : p.offset + p.numel]
        out[p.offset : p.offset + p.numel] = (v * W if W > 1 else v) / W
    return out


PSGD_SHAPES = ([(f"same{i}", (16, 12)) for i in range(9)] + [("tall", (65, 63)), ("r1", (128, 9)),
               ("conv", (8, 3, 3, 3)), ("bias", (16,)), ("small", (2, 2)), ("big", (300, 200))]
               + [(f"t{i}", (4 + i, 6)) for i in range(5)] + [("tall2", (65, 63))])


@pytest.mark.parametrize("spec, W", [("powersgd:rank=2,error_feedback=false", 1),
                                     ("powersgd:rank=1,error_feedback=false", 2),
                                     ("powersgd:rank=4,error_feedback=false,min_compression_rate=0", 1)])
def test_powersgd_batch_equals_matrix_by_matrix(spec, W):
    method, mem, mem_ref = compressor(spec, min_numel=10), ParamMemory(), ParamMemory()
    params = lay_out(PSGD_SHAPES)
    n = sum(p.numel for p in params)
    mats, _ = method.plan(params)
    assert len(mats) > len({(nn, m, r) for _, nn, m, r in mats})  # some batches of several
    g = torch.Generator().manual_seed(0)
    for step in range(3):  # warm starts: Q carried over
        x = torch.randn(n, generator=g)
        want = powersgd_reference(x, params, method, W, mem_ref)
        got = method.reduce(x.clone(), Ctx(params, step, mem, W))
        for p in params:
            span = slice(p.offset, p.offset + p.numel)
            assert torch.equal(got[span], want[span]), p.name
        for p, *_ in mats:
            assert torch.equal(mem.tensor("q", p.name, None), mem_ref.tensor("q", p.name, None))


def test_powersgd_close_to_the_per_matrix_qr_of_earlier_versions():
    # Householder QR (linalg.qr) and Gram-Schmidt span the same columns: the rank-r
    # approximation P Q^T agrees to float tolerance (their bits differ; see powersgd.py)
    g = torch.Generator().manual_seed(1)
    for n, m, r in [(65, 63, 2), (128, 1152, 1), (40, 30, 4)]:
        M = torch.randn(n, m, generator=g)
        Q0 = _init_q(0, "w", m, r, "cpu")
        P = M @ Q0
        P_qr = torch.linalg.qr(P)[0] if r > 1 else P / (P.norm() + 1e-12)
        old = P_qr @ (M.t() @ P_qr).t()
        P_gs = orthonormalize(P.clone().unsqueeze(0))
        new = bmm(P_gs, bmm(M.t().unsqueeze(0), P_gs).transpose(1, 2))[0]
        torch.testing.assert_close(new, old, rtol=1e-4, atol=1e-4)
        assert torch.allclose(P_gs[0].t() @ P_gs[0], torch.eye(r), atol=1e-5)


@pytest.mark.parametrize("n, m, r", [(65, 63, 2), (7, 9, 3), (128, 1152, 1), (3, 5, 2), (63, 33, 4),
                                     (3072, 20, 2), (2000, 30, 1), (1000, 12, 4)])
def test_a_matrix_result_does_not_depend_on_its_batch(n, m, r):
    """The same matrix alone, first, and at odd places among other companions: bmm and the
    batched Gram-Schmidt give it the same bits (batched linalg.qr does not, at 65 x 2)."""
    g = torch.Generator().manual_seed(n * m * r)
    M, Q = torch.randn(n, m, generator=g), torch.randn(m, r, generator=g)

    def run(B, at):
        Ms, Qs = torch.randn(B, n, m, generator=g), torch.randn(B, m, r, generator=g)
        Ms[at], Qs[at] = M, Q
        P = orthonormalize(bmm(Ms, Qs))
        Qn = bmm(Ms.transpose(1, 2), P)
        return P[at], Qn[at], bmm(P, Qn.transpose(1, 2))[at]

    alone = run(1, 0)
    for B, at in [(2, 0), (2, 1), (5, 3), (7, 6), (13, 5)]:
        for a, b in zip(alone, run(B, at)):
            assert torch.equal(a, b), (B, at)


def _low_rank(n, m, k, g):
    return torch.randn(n, k, generator=g) @ torch.randn(k, m, generator=g)


@pytest.mark.parametrize("n, m, r", [(48, 64, 8), (512, 512, 16), (64, 64, 4)])
def test_a_matrix_of_rank_below_r_comes_back_whole(n, m, r):
    """M of every rank k < r (a small batch's gradient, a rank-1 one): P's columns past k
    are rounding noise after one projection. P must still be orthonormal and P P^T M = M.
    With two Gram-Schmidt passes the noise columns lost orthogonality one after another:
    P^T P off by up to 1 and P P^T M off by 0.3-12x |M| at these shapes."""
    g = torch.Generator().manual_seed(n + m + r)
    Ms = torch.stack([_low_rank(n, m, k, g) for k in range(1, r)])
    Qs = torch.stack([_init_q(0, f"w{k}", m, r, "cpu") for k in range(1, r)])
    P = orthonormalize(bmm(Ms, Qs))
    for k, (Pk, Mk) in enumerate(zip(P, Ms), 1):
        assert torch.allclose(Pk.t() @ Pk, torch.eye(r), atol=1e-5), k
        back = Pk @ (Mk.t() @ Pk).t()
        assert (back - Mk).norm() <= 1e-4 * Mk.norm(), k


@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_the_table_path_rebuilds_a_matrix_of_rank_below_r(mode, monkeypatch):
    monkeypatch.setenv("GRADCOMP_KERNELS", mode)
    shapes, ranks = [(48, 64), (33, 129), (40, 30), (16, 12)], [1, 3, 7, 2]
    table, nx, npp, nq = _table(shapes, rank=8)
    g = torch.Generator().manual_seed(3)
    x, q = torch.zeros(nx), torch.randn(nq, generator=g)
    for (x_off, n, m, *_), k in zip(table.rows, ranks):
        x[x_off : x_off + n * m] = _low_rank(n, m, k, g).view(-1)
    p, q2, out = torch.zeros(npp), torch.zeros(nq), x.clone()
    lowrank.orthonormalize(lowrank.project(x, q, p, table), table)
    lowrank.expand(p, lowrank.back(x, p, q2, table), out, table, 1)
    for x_off, n, m, r, p_off, _ in table.rows:
        P = p[p_off : p_off + n * r].view(n, r)
        assert torch.allclose(P.t() @ P, torch.eye(r), atol=1e-5), (n, m)
        M = x[x_off : x_off + n * m]
        assert (out[x_off : x_off + n * m] - M).norm() <= 1e-4 * M.norm(), (n, m)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_matrix_that_was_zero_at_a_step_is_still_sent_after_it(backend, monkeypatch):
    """M = 0 at a step (an unused layer, a zero gradient) made P's columns and so Q's zero;
    P = M Q stayed zero for good and the matrix was never sent again (out = 0 every step).
    Full rank here: from the second step after it (the first restarts the power iteration
    from the fallback's directions), P Q^T must be M again."""
    monkeypatch.setenv("GRADCOMP_KERNELS", backend)
    params = lay_out([("w", (12, 6)), ("v", (10, 8))])
    c = compressor("powersgd:rank=8,min_compression_rate=0,error_feedback=false", min_numel=1)
    mem, g = ParamMemory(), torch.Generator().manual_seed(0)
    x = torch.randn(152, generator=g)
    x[:72] = 0  # w is zero at the first step
    c.reduce(x.clone(), Ctx(params, 0, mem))
    for step in (1, 2, 3):
        x = torch.randn(152, generator=g)
        out = c.reduce(x.clone(), Ctx(params, step, mem))
        assert out[:72].abs().max() > 0.1  # w is sent (before: zeros)
        torch.testing.assert_close(out[72:], x[72:], rtol=1e-4, atol=1e-5)
        if step > 1:
            torch.testing.assert_close(out, x, rtol=1e-4, atol=1e-5)


def test_both_paths_give_a_zero_p_the_same_fallback_directions(monkeypatch):
    table, _, npp, _ = _table([(48, 64), (300, 9), (16, 12)], rank=8)
    got = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("GRADCOMP_KERNELS", mode)
        got[mode] = lowrank.orthonormalize(torch.zeros(npp), table)
    torch.testing.assert_close(got["triton"], got["reference"], rtol=0, atol=1e-5)
    n, r = 48, 8  # and the CPU batch path, for the first matrix
    P = orthonormalize(torch.zeros(3, n, r))
    torch.testing.assert_close(P[1], got["reference"][: n * r].view(n, r), rtol=0, atol=1e-5)
    assert torch.allclose(P[1].t() @ P[1], torch.eye(r), atol=1e-5)


# PowerSGD's GPU path: every matrix of a bucket in one launch per step (kernels/lowrank.py),
# run here by the Triton interpreter. Distinct shapes, thin ones (r < rank), one row, one
# column block and many, dense parameters between the matrices.
TABLE_SHAPES = ([("a", (16, 12)), ("b", (65, 63)), ("thin", (128, 9)), ("wide", (7, 300)),
                 ("bias", (16,)), ("conv", (8, 3, 3, 3)), ("c", (40, 30)), ("d", (3, 70)),
                 ("row", (1, 80)), ("e", (16, 12)), ("f", (33, 129))])


def _table(shapes, rank=2):
    rows, xo, po, qo = [], 0, 0, 0
    for n, m in shapes:
        r = min(rank, n, m)
        rows.append((xo + 3, n, m, r, po, qo))  # 3 elements of gap before each matrix
        xo, po, qo = xo + 3 + n * m, po + n * r, qo + m * r
    return lowrank.matrix_table(rows, "cpu"), xo, po, qo


@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_powersgd_table_kernels_match_the_reference(rank, monkeypatch):
    table, nx, npp, nq = _table([s for _, s in TABLE_SHAPES if len(s) == 2], rank)
    g = torch.Generator().manual_seed(rank)
    x, q, p = torch.randn(nx, generator=g), torch.randn(nq, generator=g), torch.randn(npp, generator=g)
    out = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("GRADCOMP_KERNELS", mode)
        pm, qm, om = torch.zeros(npp), torch.zeros(nq), x.clone()
        lowrank.project(x, q, pm, table)
        po = lowrank.orthonormalize(p.clone(), table)
        lowrank.back(x, po, qm, table)
        lowrank.expand(po, q, om, table, 3)
        out[mode] = (pm, po, qm, om)
    for a, b in zip(out["reference"], out["triton"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    om = out["triton"][3]
    for x_off, n, m, *_ in table.rows:  # the gaps between matrices are left alone
        assert torch.equal(om[x_off - 3 : x_off], x[x_off - 3 : x_off])
        assert not torch.equal(om[x_off : x_off + n * m], x[x_off : x_off + n * m])
    po = out["triton"][1]
    for _, n, _m, r, p_off, _ in table.rows:
        P = po[p_off : p_off + n * r].view(n, r)
        assert torch.allclose(P.t() @ P, torch.eye(r), atol=1e-5)


def test_a_matrix_table_result_does_not_depend_on_its_companions(monkeypatch):
    monkeypatch.setenv("GRADCOMP_KERNELS", "triton")
    g = torch.Generator().manual_seed(5)
    M, Q = torch.randn(65 * 63, generator=g), torch.randn(63 * 2, generator=g)

    def run(before):
        shapes = [s for _, s in TABLE_SHAPES if len(s) == 2][:before] + [(65, 63)]
        table, nx, npp, nq = _table(shapes)
        x, q = torch.randn(nx, generator=g), torch.randn(nq, generator=g)
        x_off, n, m, r, p_off, q_off = table.rows[-1]
        x[x_off:], q[q_off:] = M, Q
        p, q2, out = torch.zeros(npp), torch.zeros(nq), x.clone()
        lowrank.orthonormalize(lowrank.project(x, q, p, table), table)
        lowrank.expand(p, lowrank.back(x, p, q2, table), out, table, 2)
        return p[p_off:], q2[q_off:], out[x_off:]

    alone = run(0)
    for before in (1, 4, 7):
        for a, b in zip(alone, run(before)):
            assert torch.equal(a, b), before


@pytest.mark.parametrize("spec, W", [("powersgd", 1), ("powersgd:min_compression_rate=0", 2),
                                     ("powersgd:rank=1,error_feedback=false", 2)])
def test_powersgd_table_path_matches_the_batched_path(spec, W, monkeypatch):
    params = lay_out(TABLE_SHAPES + PSGD_SHAPES)
    n = sum(p.numel for p in params)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g) for _ in range(3)]
    got = {}
    for mode in ("cpu", "triton"):
        monkeypatch.setenv("GRADCOMP_KERNELS", mode)
        method, mem = compressor(spec, min_numel=10), ParamMemory()
        outs = [method.reduce(x.clone(), Ctx(params, step, mem, W)) for step, x in enumerate(xs)]
        qs = {p.name: mem.tensor("q", p.name, None) for p, *_ in method.plan(params)[0]}
        got[mode] = outs, qs
    assert len(got["cpu"][1]) >= 8
    for a, b in zip(got["cpu"][0], got["triton"][0]):  # three steps: warm starts, the residual
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for name, q in got["cpu"][1].items():
        torch.testing.assert_close(got["triton"][1][name], q, rtol=1e-4, atol=1e-4)


class SwapCtx(Ctx):
    """A Ctx whose memory_next is the memory's: a second buffer, committed by finish()."""

    def __init__(self, *a):
        super().__init__(*a)
        self.next = {}

    def memory_next(self, slot):
        names, numels = [p.name for p in self.params], [p.numel for p in self.params]
        hit = self.next[slot] = self.mem.next_flat(slot, self.bucket, names, numels, self.device)
        return hit

    def finish(self):
        for slot, (_, nxt) in self.next.items():
            self.mem.commit(slot, self.bucket, nxt)


def _table_steps(method, x, ctx):
    """The table path as separate steps, as it ran before the residual's update, the dense
    tensors' gather and average and the Q's went into its kernels (the same kernels for the
    matrices): x += e, Q's gathered, P's, dense tensors gathered, orthonormal P's, Q's,
    copied back, the average into a copy of x, the dense average (a product by 1 / W: CUDA's
    div_ by a number), E = M - out, 0 at the dense tensors."""
    cfg, W = method.config, ctx.comm.world_size
    lay = method._layout(ctx.params, x.device)
    table = lowrank.matrix_table(lay.table(x.device, x.numel()).rows, x.device)  # matrices only
    if cfg.error_feedback:
        e_now, e = ctx.memory_next("residual")
        x.add_(e_now)
    qs = [ctx.tensor("q", p.name, lambda p=p, g=g: _init_q(cfg.seed, p.name, g.m, g.r, x.device))
          for g in lay.groups for p in g.params]
    q = torch.cat([v.view(-1) for v in qs])
    buf = x.new_empty(lay.p_total + lay.dense_numel)
    lowrank.project(x, q, buf, table)
    if lay.dense_idx is not None:
        torch.index_select(x, 0, lay.dense_idx, out=buf[lay.p_total :])
    ctx.comm.allreduce(buf)
    lowrank.orthonormalize(buf, table)
    lowrank.back(x, buf, q, table)
    ctx.comm.allreduce(q)
    torch._foreach_copy_([v.view(-1) for v in qs], q.split(lay.q_sizes))
    out = x.clone() if cfg.error_feedback else x
    lowrank.expand(buf, q, out, table, W)
    if lay.dense_idx is not None:
        out.index_copy_(0, lay.dense_idx, buf[lay.p_total :] * ref.reciprocal(W))
    if cfg.error_feedback:
        torch.sub(x, out, out=e)
        lay.zero_dense(e)
    return out


@pytest.mark.parametrize("spec, W", [("powersgd", 3), ("powersgd:rank=2,min_compression_rate=0", 2),
                                     ("powersgd:rank=1,error_feedback=false", 3)])
def test_powersgd_table_path_equals_its_steps_run_apart_bit_for_bit(spec, W, monkeypatch):
    """The table path's four launches (the residual, the dense tensors and the Q's inside
    the kernels) give the bits of its steps run one by one: the average, the residual and
    the Q's, over steps with a zero matrix, a relayout (the Q's gathered anew) and, without
    error feedback, elements of no parameter left alone."""
    monkeypatch.setenv("GRADCOMP_KERNELS", "triton")
    shapes = [("T" + n, s) for n, s in TABLE_SHAPES] + PSGD_SHAPES[:12]
    layouts = [lay_out(shapes), lay_out(shapes[::-1])]
    if "error_feedback=false" in spec:  # 3 elements of no parameter before each
        layouts.append([ParamSlice(p.name, p.shape, p.offset + 3 * (i + 1), p.numel)
                        for i, p in enumerate(layouts[0])])
    g = torch.Generator().manual_seed(W)
    got = {}
    for fused in (True, False):
        method, mem, outs = compressor(spec, min_numel=10), ParamMemory(), []
        g.manual_seed(W)
        for step in range(2 * len(layouts)):
            params = layouts[step // 2]
            x = torch.randn(params[-1].offset + params[-1].numel + 2, generator=g)
            if "error_feedback=false" not in spec:
                x = x[: sum(p.numel for p in params)]
            if step == 1:
                x[params[2].offset : params[2].offset + params[2].numel] = 0  # a zero matrix
            ctx = SwapCtx(params, step, mem, W)
            outs.append((method.reduce if fused else lambda x, ctx: _table_steps(
                method, x, ctx))(x.clone(), ctx).clone())
            ctx.finish()
        sd = mem.state_dict()
        got[fused] = outs, sd["flat"].get("residual", {}), sd["tensors"]["q"]
    assert len(got[True][2]) >= 6 and len(got[True][1]) == (0 if "=false" in spec else 23)
    for a, b in zip(got[True][0], got[False][0]):
        assert torch.equal(a, b)
    for mine, theirs in zip(got[True][1:], got[False][1:]):
        assert mine.keys() == theirs.keys()
        for name, v in theirs.items():
            assert torch.equal(mine[name], v), name


@pytest.mark.parametrize("W", [1, 3])
def test_powersgd_table_elements_match_the_reference_bit_for_bit(W, monkeypatch):
    """The elements outside the matrices (dense ones, ones of no parameter), the residual
    and its update: the kernels and the reference agree exactly there (sums and products
    of one rounding), and to float tolerance on the matrices."""
    shapes = [s for _, s in TABLE_SHAPES if len(s) == 2]
    table, nx, npp, nq = _table(shapes)
    rows = table.rows
    dense = [(0, 3), (rows[2][0] - 3, 2)]  # runs of the gaps sent whole, the rest in none
    rest = [(rows[2][0] - 1, 1)] + [(x_off - 3, 3) for x_off, *_ in rows[3:]] + [(nx, 5)]
    table = lowrank.matrix_table(rows, "cpu", dense, rest)
    D = table.dense
    g = torch.Generator().manual_seed(W)
    x, e = torch.randn(nx + 5, generator=g), torch.randn(nx + 5, generator=g)
    q, p = torch.randn(nq, generator=g), torch.randn(npp + D, generator=g)
    out = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("GRADCOMP_KERNELS", mode)
        pm, om, en = torch.zeros(npp + D), x.clone(), torch.full_like(x, 7.0)
        lowrank.project(x, q, pm, table, e)
        lowrank.expand(p, q, om, table, W, e, en)
        out[mode] = pm, om, en
    mats = torch.zeros(nx + 5, dtype=torch.bool)
    for x_off, n, m, *_ in rows:
        mats[x_off : x_off + n * m] = True
    for a, b in zip(out["reference"], out["triton"]):
        exact = ~mats if len(a) == nx + 5 else torch.arange(len(a)) >= npp
        assert torch.equal(a[exact], b[exact])
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    pm, om, en = out["triton"]
    idx = table.elems
    assert torch.equal(pm[npp:], x[idx[:D]] + e[idx[:D]])
    assert torch.equal(om[idx[:D]], p[npp:] * ref.reciprocal(W))
    assert torch.equal(om[idx[D:]], x[idx[D:]] + e[idx[D:]])
    assert (en[idx] == 0).all() and (en[~mats] == 0).sum() == len(idx)
    alone = ~mats  # the gap before the second matrix is in no list: left alone
    alone[idx] = False
    assert alone.sum() == 3 and torch.equal(om[alone], x[alone]) and (en[alone] == 7).all()
    torch.testing.assert_close(om[mats] + en[mats], x[mats] + e[mats])


@pytest.mark.parametrize("residual", [False, True])
def test_powersgd_expand_writes_the_guards_verdict_as_flag_fill_does(residual, monkeypatch):
    """expand with the guard's verdict on a table that covers the bucket: flag down, out and
    the next residual bit for bit those of expand alone; flag up, out NaN throughout; the
    other flag zeroed either way, on the kernels and the reference alike. A table that
    leaves elements out is refused (they would escape the NaN)."""
    shapes = [s for _, s in TABLE_SHAPES if len(s) == 2]
    table, nx, npp, nq = _table(shapes)
    rows = table.rows
    gaps, at = [], 0
    for x_off, n, m, *_ in rows:
        if x_off > at:
            gaps.append((at, x_off - at))
        at = x_off + n * m
    gaps.append((at, 5))
    full = lowrank.matrix_table(rows, "cpu", gaps[:1], gaps[1:])
    assert full.covered == nx + 5 and table.covered < nx
    g = torch.Generator().manual_seed(4)
    x, e = torch.randn(nx + 5, generator=g), torch.randn(nx + 5, generator=g)
    q, p = torch.randn(nq, generator=g), torch.randn(npp + full.dense, generator=g)
    res = (e, torch.full_like(x, 7.0)) if residual else (None, None)
    for mode in ("reference", "triton"):
        monkeypatch.setenv("GRADCOMP_KERNELS", mode)
        want = lowrank.expand(p, q, x.clone(), full, 2, res[0],
                              None if res[1] is None else res[1].clone())
        for up in (0.0, 1.0):
            flag, clear = torch.tensor([up, 5.0, -5.0]), torch.tensor([1.0, 2.0, -2.0])
            en = None if res[1] is None else res[1].clone()
            got = lowrank.expand(p, q, x.clone(), full, 2, res[0], en, verdict=(flag, clear))
            assert clear.tolist() == [0.0, 2.0, -2.0] and flag.tolist() == [up, 5.0, -5.0]
            if up:
                assert got.isnan().all(), mode
            else:
                assert torch.equal(got, want), mode
            if residual:
                want_en = res[1].clone()
                lowrank.expand(p, q, x.clone(), full, 2, e, want_en)
                assert torch.equal(en, want_en), mode
        with pytest.raises(ValueError, match="covers out"):
            lowrank.expand(p, q, x.clone(), table, 2, verdict=(flag, clear))


def _distinct(count):
    # count matrices of count distinct shapes (a CNN's or a transformer's bucket)
    return bench_ops.buckets([(f"w{i}", (64 + i, 72 + 2 * (i % 7))) for i in range(count)],
                             2**40)[0]


@pytest.mark.parametrize("spec", ["powersgd", "powersgd:rank=1,error_feedback=false"])
def test_powersgd_launches_do_not_grow_with_the_distinct_shapes(spec, monkeypatch):
    monkeypatch.setattr(Guard, "run", lambda self, x, ctx, flat, run, late=False: run(x))
    few, many = (bench_ops.count(spec, _distinct(c), launches=True) for c in (4, 60))
    batched = bench_ops.count(spec, _distinct(60), kernels=True)  # the CPU path: per shape
    assert many == few and many <= 30 and batched > 4 * many, (few, many, batched)


# --------------------------------------------------------------------------- op counts
def _layout(count, total=2**20):
    # 2^20 elements: 160 matrices of 102 x 64, above min_numel (at 2^16 they were not, and
    # went dense: the count compared nothing)
    return bench_ops.buckets(bench_ops.even_shapes(total, count), 2**40)[0]


@pytest.mark.parametrize("spec", ["terngrad", "terngrad:error_feedback=true,share_scalers=false"])
def test_terngrad_op_count_does_not_grow_with_the_tensor_count(spec):
    few, many = bench_ops.count(spec, _layout(16)), bench_ops.count(spec, _layout(160))
    assert many <= 1.5 * few and many > 2, (few, many)


@pytest.mark.parametrize("spec", ["powersgd", "powersgd:rank=1,error_feedback=false"])
def test_powersgd_op_count_does_not_grow_with_the_tensor_count(spec, monkeypatch):
    # the compressor's own ops: the inf/NaN guard's snapshot clones each parameter's Q (one op
    # per parameter, in hooks/guard.py and memory.py), which is not the codec's
    monkeypatch.setattr(Guard, "run", lambda self, x, ctx, flat, run, late=False: run(x))
    # (the default rank 4 runs 10 more ops per column in Gram-Schmidt than rank 2: 86 ops at
    # 1M elements, 58 of them doing work, the GPU's launches)
    few, many = (bench_ops.count(spec, _layout(c)) for c in (16, 160))
    work = bench_ops.count(spec, _layout(16), kernels=True)
    assert many <= 1.5 * few and work <= 60, (few, many, work)
    assert many > 2  # compressed, not the dense fallback of matrices too small for the rank


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_powersgd_approx_error_is_measured_on_the_matrices_not_their_approximation(backend,
                                                                                   monkeypatch):
    # without error feedback the output overwrites the input; the logged error must still
    # compare each M with its rank-r approximation (a random 40 x 30 at rank 1 misses most)
    monkeypatch.setenv("GRADCOMP_KERNELS", backend)
    params = lay_out([("w", (40, 30)), ("v", (30, 40))])
    x = torch.randn(2400, generator=torch.Generator().manual_seed(0))
    ctx = Ctx(params, 0, ParamMemory())
    logged = {}
    ctx.details, ctx.log = True, lambda tag, v: logged.setdefault(tag, float(v))
    compressor("powersgd:rank=1,error_feedback=false", min_numel=10).reduce(x, ctx)
    assert 0.5 < logged["approx_error"] < 1.0


@pytest.mark.parametrize("spec, W", [("powersgd", 1), ("powersgd:rank=2", 2),
                                     ("powersgd:rank=1,error_feedback=false", 3),
                                     ("powersgd:min_compression_rate=0", 2)])
def test_powersgd_by_runs_equals_the_batched_path_bit_for_bit(spec, W, monkeypatch):
    """The CPU path by runs (the bucket gathered into its groups' order, the result written
    into x) against the batched path by indices it replaces: the same outputs, residuals and
    Q's, bit for bit, over steps; a bucket its parameters do not cover takes the batched
    path."""
    from gradcomp.compressors import powersgd
    params = lay_out(PSGD_SHAPES + [("b1", (7,)), ("w1", (16, 12))])  # same-shape groups apart
    n = sum(p.numel for p in params)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, generator=g) for _ in range(3)]
    calls = {"runs": 0}
    real = powersgd.PowerSGD._reduce_runs

    def counted(self, *a):
        calls["runs"] += 1
        return real(self, *a)

    monkeypatch.setattr(powersgd.PowerSGD, "_reduce_runs", counted)
    got = {}
    for mode in ("runs", "index"):
        if mode == "index":
            monkeypatch.setattr(powersgd._LowRankLayout, "moves", lambda self, n: None)
        method, mem = compressor(spec, min_numel=10), ParamMemory()
        outs = [method.reduce(x.clone(), Ctx(params, step, mem, W)).clone()
                for step, x in enumerate(xs)]
        mats = method.plan(params)[0]
        got[mode] = (outs, {p.name: mem.tensor("q", p.name, None).clone() for p, *_ in mats},
                     [v.clone() for v in mem.peek("residual", [p.name for p in params])
                      if v is not None])
    assert calls["runs"] == 3
    (oa, qa, ea), (ob, qb, eb) = got["runs"], got["index"]
    for a, b in zip(oa, ob):
        assert torch.equal(a, b)
    assert qa.keys() == qb.keys() and all(torch.equal(qa[k], qb[k]) for k in qa)
    assert len(ea) == len(eb) and all(torch.equal(a, b) for a, b in zip(ea, eb))
    assert ("error_feedback=false" in spec) == (not ea)


def test_powersgd_bucket_with_a_gap_takes_the_batched_path(monkeypatch):
    from gradcomp.compressors import powersgd
    params = lay_out([("w", (16, 12)), ("v", (16, 12))])
    n = sum(p.numel for p in params) + 5  # 5 elements of no parameter at the end
    monkeypatch.setattr(powersgd.PowerSGD, "_reduce_runs", lambda *a: pytest.fail("by runs"))
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    out = compressor("powersgd:rank=1,error_feedback=false", min_numel=10).reduce(
        x.clone(), Ctx(params, 0, ParamMemory()))
    assert torch.equal(out[-5:], x[-5:])  # what belongs to no parameter is passed through


@pytest.mark.parametrize("clip", [2.5, 0.0])
def test_terngrad_stats_by_segments_match_the_element_path(clip):
    """layer_stats' CPU path (clamps and inf-norms over the segments' views, sums by numpy's
    reduceat) against its per-element path (a bound per element, a clamp between tensors,
    segment reductions), with zeros of both signs, a segment of zeros (bound 0), one of
    equal values (sigma 0), outliers, and segments whose squares underflow (1e-30) or
    overflow (3e30), which take the exact fallback. Without clipping: the scales and y bit
    for bit. With it: the scales and clipped y within float32 roundings of that path's (its
    sums add in another order), sigma within 1e-6 of float64's, the same NaNs (the
    overflowing segment's sigma is inf - inf on both paths), and the same result on a
    second call (deterministic)."""
    sizes = [8, 4, 12, 64, 4, 1028, 16, 8]  # the last two: squares under- and overflow
    g = torch.Generator().manual_seed(4)
    y = torch.randn(sum(sizes), generator=g)
    y[::5] = 0.0
    y[2::7] = -0.0
    y[8:12] = 0.0
    y[12:24] = -1.5
    y[30] = 40.0
    y[1100] = -1e4
    y[-24:-8] *= 1e-30
    y[-8:] *= 3e30
    lengths = torch.tensor(sizes)
    seg = torch.repeat_interleave(torch.arange(len(sizes)), lengths)
    a, b, c = y.clone(), y.clone(), y.clone()
    sa = layer_stats(a, lengths, clip, seg)
    sb = layer_stats(b, lengths, clip, seg, sizes)
    assert torch.equal(sb.view(torch.int32), layer_stats(c, lengths, clip, seg, sizes)
                       .view(torch.int32)) and torch.equal(b.isnan(), c.isnan())
    if not clip:
        assert torch.equal(sa.view(torch.int32), sb.view(torch.int32))
        nz = a != 0
        assert torch.equal(a[nz].view(torch.int32), b[nz].view(torch.int32))
        return
    torch.testing.assert_close(sb, sa, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0, equal_nan=True)
    assert not torch.equal(a, y)  # the outliers were clipped
    y64 = [t.double() for t in y.split(sizes)]
    top = torch.stack([t.abs().max() for t in y64])
    sigma = torch.stack([t.std(unbiased=False) for t in y64])
    assert not sb[:-1].isnan().any() and sb[-1].isnan()
    # (the 1e-30 segment's squares underflow in float32: sigma 0 on both paths)
    torch.testing.assert_close(sb[:6].double(), top.minimum(clip * sigma)[:6], rtol=1e-6, atol=0)
    assert sb[1] == 0 and sb[2] == 0  # zeros, equal values (sigma 0): clipped to zeros


def test_terngrad_segment_sums_by_numpy_are_closer_than_torchs():
    """_segment_sums (numpy's pairwise reduceat) against float64 sums over 3 segments of up
    to 2M elements: within 1e-6 of each sum's scale, where a one-at-a-time float32 sum
    (torch.segment_reduce on the CPU) drifts further; an empty segment sums to 0."""
    from gradcomp.compressors.terngrad import _segment_sums
    sizes = [2_000_000, 4, 300_000]
    y = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(6)) + 0.25
    want = torch.stack([t.double().sum() for t in y.split(sizes)])
    scale = torch.stack([t.double().abs().sum() for t in y.split(sizes)])
    got = _segment_sums(y, sizes)
    assert got.dtype == torch.float32 and got.shape == (3,)
    assert ((got.double() - want).abs() / scale).max() < 1e-6
    seq = torch.segment_reduce(y, "sum", lengths=torch.tensor(sizes))
    assert ((seq.double() - want).abs() / scale).max() > ((got.double() - want).abs() / scale).max()
    assert torch.equal(_segment_sums(y[:8], [4, 0, 4]), torch.stack([y[:4].sum(), torch.tensor(0.0),
                                                                      y[4:8].sum()]))


@pytest.mark.parametrize("clip", [2.5, 0.0])
def test_terngrad_stats_by_norms_the_gpus_path_matches_the_element_path(clip):
    """layer_stats' GPU path (multi-tensor norms over the segments' views; run here on CPU
    tensors): without clipping the scales are the segments' max |y| bit for bit; with it,
    scales and clipped y within float32 roundings of the element path's, and sigma within
    1e-5 of a float64 reference also where a segment's mean is 5 sigmas from 0 (the sum taken
    as 2 * sum(max(y, 0)) - sum |y|), and 0 for a segment of equal values. (Far larger means
    lose sigma on both paths alike: it is the mean square minus the squared mean.)"""
    from gradcomp.compressors.terngrad import _stats_by_norms
    sizes = [8, 12, 4096, 1028, 16, 300]
    g = torch.Generator().manual_seed(5)
    y = torch.randn(sum(sizes), generator=g)
    y[8:20] = -1.5                                        # sigma 0: clipped to zeros
    y[20:4116] = 0.5 + 0.1 * y[20:4116]                  # mean 5 sigmas from 0
    y[4200] = 40.0                                        # an outlier
    y[-300:] = -3.0 + y[-300:]                            # a negative mean
    lengths = torch.tensor(sizes)
    seg = torch.repeat_interleave(torch.arange(len(sizes)), lengths).to(torch.int32)
    a, b = y.clone(), y.clone()
    sa = layer_stats(a, lengths, clip, seg.long())
    sb = _stats_by_norms(b, lengths, clip, seg, sizes)
    if not clip:
        assert torch.equal(sa, sb) and torch.equal(a, b)
        return
    torch.testing.assert_close(sb, sa, rtol=1e-5, atol=0)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    y64 = [t.double() for t in y.split(sizes)]
    sigma = torch.stack([t.std(unbiased=False) for t in y64])
    bound = torch.stack([t.abs().max() for t in y64]).minimum(clip * sigma)
    torch.testing.assert_close(sb.double(), bound, rtol=1e-5, atol=0)
    assert sb[1] == 0  # equal values: sigma 0, the segment clipped to zeros
    assert torch.equal(b[8:20], torch.zeros(12)) and b[4200] < 40


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
def test_powersgd_average_by_a_scaled_q_is_the_divided_product(W):
    """Where W is a power of two the product P (Q / W)^T replaces (P Q^T) / W: the same
    bits (every product and sum scaled exactly); other W still divide."""
    from gradcomp.compressors.powersgd import _averaged, bmm
    g = torch.Generator().manual_seed(W)
    P, Q = torch.randn(3, 50, 4, generator=g), torch.randn(3, 70, 4, generator=g) * 1e-3
    Qs, scaled = _averaged(Q, W)
    assert scaled == (W & (W - 1) == 0)
    got = bmm(P, Qs.transpose(1, 2))
    if not scaled:
        got = got.div_(W)
    want = bmm(P, Q.transpose(1, 2)).div_(W)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _tiny_layers(rank, world):
    """Plain DDP beside terngrad with every tensor under ``min_numel``, compressed steps
    from the first (warmup none): the parameters after 4 SGD steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomp
    from conftest import small_net, train_steps
    out = []
    for spec in (None, "terngrad"):
        net = small_net()
        model = DDP(net, bucket_cap_mb=0.004)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if spec:
            state = gradcomp.register(model, spec, optimizer=opt, min_numel=10**6,
                                      warmup="none")
        train_steps(model, opt, rank, range(4))
        out.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    return out, state.stats()["compressing"]


def test_terngrad_with_every_tensor_under_min_numel_is_plain_ddp(spawn):
    """``min_numel``: a tensor below it is sent as it is; with every tensor below it,
    TernGrad's compressed steps are DDP's, bit for bit (2 ranks)."""
    for (ddp, tern), compressing in spawn(_tiny_layers, 2):
        assert compressing and torch.equal(ddp, tern)
