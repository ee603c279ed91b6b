"""local_steps=H (DiLoCo / Streaming DiLoCo / SparseLoCo): inner steps without exchange, an
outer SGD-Nesterov step on the method's average of the pseudo-gradients every H steps.
Two gloo ranks on CPU, the tiny net of test_distributed: one spawn runs every 2-rank job of
the module (``runs``), the resume test spawns fresh processes, the hierarchy four ranks."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp_bench.launch import spawn
from conftest import batch, small_net
from conftest import train_pair as _train_pair

H = 3
LR = 0.05


class _BNNet(nn.Module):
    """small_net with a BatchNorm: floating-point buffers the rounds must average."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                  nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


def _job(spec, net_fn=small_net, sgd=None, **kw):
    net = net_fn()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), **(sgd or {"lr": LR, "momentum": 0.9}))
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none", **kw)
    return net, model, opt, state


def _step(model, opt, rank, step):
    x, y = batch(rank, step)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


# ---------------------------------------------------------------- equivalences
TODAY = ("allreduce:local_steps=1,outer_lr=1,outer_momentum=0",
         "allreduce:outer_lr=0.3,outer_momentum=0.5")


def test_local_steps_1_is_todays_path_bit_for_bit(runs):
    # outer options are inert at H=1: plain DDP SGD exactly, whatever they are
    for spec in TODAY:
        ref, got = runs[0]["today"][spec]
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), spec


def _averaging_by_hand(rank, world, spec, steps):
    """The spec's job, and beside it the same local SGD without DDP whose parameters are
    averaged by hand (all_reduce / W) every H steps."""
    net, model, opt, state = _job(spec, sgd={"lr": LR})
    ref = small_net()
    ropt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(steps):
        _step(model, opt, rank, step)
        x, y = batch(rank, step)
        ropt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ropt.step()
        if (step + 1) % H == 0:
            with torch.no_grad():
                for p in ref.parameters():
                    dist.all_reduce(p)
                    p.div_(world)
    return _flat(net), _flat(ref), state.step


AVERAGING = (f"allreduce:local_steps={H},outer_lr=1,outer_momentum=0", 2 * H + 1)


def test_outer_lr_1_without_momentum_is_parameter_averaging_every_H_steps(runs):
    # two rounds and an inner step
    (a0, r0, n0), (a1, r1, _) = (r["averaging"] for r in runs)
    assert n0 == 2  # two outer exchanges
    torch.testing.assert_close(a0, r0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a1, r1, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(a0, a1)  # the last inner step is local


def _round_beside(model, opt, local, lopt, rank, r):
    """Round r's H inner steps: the job's, and the same steps on ``local`` by hand."""
    for i in range(H):
        _step(model, opt, rank, r * H + i)
        x, y = batch(rank, r * H + i)
        lopt.zero_grad()
        nn.functional.cross_entropy(local(x), y).backward()
        lopt.step()


def _nesterov_by_hand(rank, world, spec, lr, mu, rounds):
    """The outer rule against torch's own SGD(nesterov=True) applied to the averaged
    pseudo-gradient, from an allreduce job (every average exact up to rounding)."""
    net, model, opt, state = _job(spec, sgd={"lr": LR})
    ref = small_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=mu, nesterov=True)
    local = small_net()  # the inner steps of this rank from the reference's round start
    lopt = torch.optim.SGD(local.parameters(), lr=LR)
    for r in range(rounds):
        _round_beside(model, opt, local, lopt, rank, r)
        with torch.no_grad():
            for p, q in zip(ref.parameters(), local.parameters()):
                d = p - q
                dist.all_reduce(d)
                p.grad = d / world
        ref_opt.step()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), local.parameters()):
                q.copy_(p)
    return _flat(net), _flat(ref)


NESTEROV = (f"allreduce:local_steps={H},outer_lr=0.7,outer_momentum=0.9", 0.7, 0.9, 3)


def test_outer_step_is_torch_sgd_nesterov_on_the_average(runs):
    got, ref = runs[0]["nesterov"]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


# growing rounds: local_steps=2, doubled at each 4 steps of rounds, at most 8: rounds start
# at steps 0, 2, 4, 8 and last 2, 2, 4, 8 (a round is as long as where it starts says)
GROWING = "allreduce:local_steps=2,grow_every=4,max_local_steps=8,outer_lr=0.7,outer_momentum=0.9"
GROWN = [2, 2, 4, 8]


def _growing_by_hand(rank, world):
    """Rounds of GROWN steps, the outer lr of a round of L steps 0.7 sqrt(L / 2), against
    torch's SGD(nesterov=True) on the averaged pseudo-gradient at that lr; and the steps at
    which the state sent."""
    net, model, opt, state = _job(GROWING, sgd={"lr": LR})
    ref = small_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    local = small_net()
    lopt = torch.optim.SGD(local.parameters(), lr=LR)
    step, sent, edges = 0, [], []
    for L in GROWN:
        for _ in range(L):
            before = state.step
            _step(model, opt, rank, step)
            x, y = batch(rank, step)
            lopt.zero_grad()
            nn.functional.cross_entropy(local(x), y).backward()
            lopt.step()
            step += 1
            if state.step > before:
                sent.append(step)
            st = state.stats()
            edges.append((st["at_round_edge"], st["round_length"]))
        with torch.no_grad():
            for p, q in zip(ref.parameters(), local.parameters()):
                d = p - q
                dist.all_reduce(d)
                p.grad = d / world
        ref_opt.param_groups[0]["lr"] = 0.7 * (L / 2) ** 0.5
        ref_opt.step()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), local.parameters()):
                q.copy_(p)
    return _flat(net), _flat(ref), sent, edges


def test_growing_rounds_double_where_they_start_with_the_outer_lr_scaled(runs):
    for r in runs:
        got, ref, sent, edges = r["growing"]
        assert sent == [2, 4, 8, 16]  # the round ends
        # stats(): at a round's edge after steps 2, 4, 8, 16; the round in progress (at an
        # edge: the next one) 2, 2, 4, 8 steps long
        assert [s + 1 for s, (at, _) in enumerate(edges) if at] == sent
        assert [L for _, L in edges] == [2, 2, 2, 4, 4, 4, 4, 8] + [8] * 8
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert not torch.equal(runs[0]["growing"][0], runs[0]["nesterov"][0])


def test_round_lengths_follow_the_documented_rule():
    from gradcomp.hooks.local_steps import round_lengths
    for opts in ({"grow_every": 500, "max_local_steps": 16},
                 {"grow_every": 3, "max_local_steps": 64},
                 {"local_steps": 6, "grow_every": 100, "max_local_steps": 16},
                 {"grow_every": 7}, {"grow_every": 0, "max_local_steps": 16},
                 {"local_steps": 32, "grow_every": 10, "max_local_steps": 16}):
        c = gradcomp.build_config("sparseloco", **opts)[1]
        pieces, p = round_lengths(c), 0
        H0, N, cap = c.local_steps, c.grow_every, c.max_local_steps or 100_000
        for _ in range(400):  # every round start from the rule itself
            L = H0 if not N else min(H0 * 2 ** min(p // N, 40), max(cap, H0))
            piece = [q for q in pieces if q[0] <= p][-1]
            assert piece[1] == L and (p - piece[0]) % L == 0, (opts, p)
            p += L
        assert all(a[1] < b[1] for a, b in zip(pieces, pieces[1:]))
    # where an exchange begins: rounds of 2, 2, 4, 8, 8 (and with 2 fragments, two a round)
    from gradcomp.hooks.local_steps import LocalSteps
    c = gradcomp.build_config("allreduce", local_steps=2, grow_every=4, max_local_steps=8)[1]
    assert [LocalSteps(c).optimizer_step_of(e) for e in range(6)] == [0, 2, 4, 8, 16, 24]
    c = gradcomp.build_config("allreduce", local_steps=2, grow_every=4, max_local_steps=8,
                              fragments=2, sync_steps=5)[1]
    assert [LocalSteps(c).optimizer_step_of(e) for e in range(6)] == [5, 5, 7, 7, 9, 9]


def _growing_resume(rank, world, path):
    """Growing rounds with local_delay=1, 12 steps (rounds at 0, 2, 6, 10: the round in flight
    at step 7 is 4 steps long, so its outer lr is scaled), uninterrupted and resumed in fresh
    objects from steps 3 and 7."""
    spec = "sparseloco:chunk=64,k=8,local_steps=2,grow_every=2,max_local_steps=4,local_delay=1"
    net, model, opt, state = _job(spec, net_fn=_BNNet, lanes=1)
    for step in range(12):
        if step in (3, 7):
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                        "gradcomp": state.state_dict()}, f"{path}/grow{step}-rank{rank}.pt")
        _step(model, opt, rank, step)
    whole, resumed = _flat(net), {}
    for cut in (3, 7):
        net, model, opt, state = _job(spec, net_fn=_BNNet, lanes=1)
        ck = torch.load(f"{path}/grow{cut}-rank{rank}.pt")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["gradcomp"])
        for step in range(cut, 12):
            _step(model, opt, rank, step)
        resumed[cut] = _flat(net)
    state.flush()  # (the exchange in flight counted in stats() once it is over)
    return whole, resumed, state.stats()


def test_growing_rounds_resume_bit_exact_with_a_grown_round_in_flight(runs):
    for r in runs:
        whole, resumed, stats = r["growing_resume"]
        assert stats["compressing"] and 0 < stats["run_sent_bytes"] < stats["run_raw_bytes"]
        for cut, got in resumed.items():
            assert torch.equal(got, whole), cut


def _late_by_hand(rank, world, spec, lr, mu, rounds):
    """local_delay=1's rule written out on whole-model vectors (see hooks/local_steps.py): at a
    round's end P = R - theta; the previous round's average A arrives: m = mu m + A,
    G = G - lr (A + mu m), theta = G - P; P is sent; R = theta. flush() applies the last."""
    from torch.nn.utils import parameters_to_vector as p2v, vector_to_parameters as v2p
    net, model, opt, state = _job(spec, sgd={"lr": LR})
    local = small_net()
    lopt = torch.optim.SGD(local.parameters(), lr=LR)
    G = p2v(local.parameters()).detach().clone()
    R, m, pending, got, ref = G.clone(), torch.zeros_like(G), None, [], []
    for r in range(rounds):
        _round_beside(model, opt, local, lopt, rank, r)
        with torch.no_grad():
            P = R - p2v(local.parameters())
            if pending is not None:
                m = mu * m + pending
                G = G - lr * (pending + mu * m)
                v2p(G - P, local.parameters())
            pending = P.clone()
            dist.all_reduce(pending)
            pending /= world
            R = p2v(local.parameters()).clone()
        got.append(_flat(net))
        ref.append(p2v(local.parameters()).detach().clone())
    state.flush()
    m = mu * m + pending
    G = G - lr * (pending + mu * m)
    return got + [_flat(net)], ref + [G]


LATE = (f"allreduce:local_steps={H},local_delay=1,outer_lr=0.7,outer_momentum=0.9", 0.7, 0.9, 3)


def test_local_delay_1_is_the_documented_rule(runs):
    got, ref = runs[1]["late"]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- rounds
SPECS = ["allreduce", "topk:ratio=0.1", "onebit:chunk=64", "powersgd:rank=1", "dgc:ratio=0.1",
         "terngrad", "threshold:max_ratio=0.05", "dgc:ratio=1,masking=false"]
# (sparseloco and diloco run here in RESUME and CONSERVE, at their rounds)


def _trajectories(rank, world, specs, steps):
    out = {}
    for spec in specs:
        net, model, opt, state = _job(spec, net_fn=_BNNet)
        traj, bufs, glob = [], [], []
        for step in range(steps):
            _step(model, opt, rank, step)
            traj.append(_flat(net))
            bufs.append(net.body[1].running_mean.clone())
            start = state._state.rounds.start
            glob.append(torch.cat(start).clone() if start else None)
        flushed = None
        if state.config.local_delay:
            state.flush()
            flushed = (_flat(net), net.body[1].running_mean.clone())
        out[spec] = (traj, bufs, glob, flushed, state.step)
    return out


ROUNDS = [f"{s}:local_steps={H}" if ":" not in s else f"{s},local_steps={H}" for s in SPECS]
DELAYED = [f"allreduce:local_steps={H},local_delay=1",
           f"topk:ratio=0.1,local_steps={H},local_delay=1", f"allreduce:local_steps={H}"]


def test_ranks_are_identical_after_every_round_and_differ_inside_it(runs):
    specs, steps = ROUNDS, 2 * H + 1
    r0, r1 = (r["rounds"] for r in runs)
    for spec in specs:
        (t0, b0, _, _, n), (t1, b1, _, _, _) = r0[spec], r1[spec]
        assert n == 2, spec
        for s in range(steps):
            if (s + 1) % H == 0:
                assert torch.equal(t0[s], t1[s]), (spec, s)
                assert torch.equal(b0[s], b1[s]), (spec, s)  # BatchNorm statistics averaged
            else:
                assert not torch.allclose(t0[s], t1[s]), (spec, s)
                assert not torch.allclose(b0[s], b1[s]), (spec, s)
    # methods really differ from each other (each went through its own compressor)
    ends = [r0[s][0][-1] for s in specs]
    assert all(not torch.equal(ends[0], e) for e in ends[1:-1])
    # dgc sending everything is allreduce: the inner steps kept the optimizer's momentum
    # (dgc is not bound to it) and the outer step got the plain average
    torch.testing.assert_close(ends[-1], ends[0], atol=1e-6, rtol=1e-5)


def test_local_delay_applies_each_round_one_round_late(runs):
    specs = DELAYED
    steps = 3 * H  # ends at a round's end; flush() then applies the last exchange
    r0, r1 = (r["delayed"] for r in runs)
    for spec in specs[:2]:
        (t0, _, g0, f0, n), (t1, _, g1, f1, _) = r0[spec], r1[spec]
        assert n == 3, spec
        # the ranks never hold the same parameters before flush (their last round's own
        # progress is not averaged yet), but the global point is the same on every rank
        assert all(not torch.allclose(a, b) for a, b in zip(t0, t1)), spec
        for s in range(steps):
            assert torch.equal(g0[s], g1[s]), (spec, s)
        assert not torch.equal(g0[2 * H - 2], g0[2 * H - 1]), spec  # moved at round 2's end
        assert torch.equal(g0[0], g0[2 * H - 2]), spec               # ... not before
        assert torch.equal(f0[0], f1[0]) and torch.equal(f0[1], f1[1]), spec  # after flush
    # allreduce: local_delay=1 is the same outer trajectory, one round late: after flush its
    # global point is close to local_delay=0's after the same rounds, not equal
    late, sync = r0[specs[0]][3][0], r0[specs[2]][0][-1]
    assert not torch.equal(late, sync)


def _bf16(rank, world):
    """A bf16 model: two rounds of training, then a round of inner steps at lr 0."""
    net = small_net().to(torch.bfloat16)
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = gradcomp.register(model, f"allreduce:local_steps={H},outer_momentum=0",
                              optimizer=opt, min_numel=0, warmup="none")
    traj, glob = [], []
    for step in range(3 * H):
        if step == 2 * H:
            opt.param_groups[0]["lr"] = 0.0
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.bfloat16()), y).backward()
        opt.step()
        traj.append(_flat(net))
        glob.append(torch.cat(state._state.rounds.start).clone())
    return traj, glob, _flat(net).dtype


def test_a_bf16_model_keeps_its_global_point_in_fp32(runs):
    """G is fp32 and the ranks agree after each round; a round without progress leaves G
    where it was (the parameters' bf16 rounding of G is not a pseudo-gradient)."""
    (t0, g0, pd), (t1, g1, _) = (r["bf16"] for r in runs)
    assert pd == torch.bfloat16 and g0[-1].dtype == torch.float32
    assert not torch.equal(g0[-1], g0[-1].bfloat16().float())  # G is not bf16-representable
    for s in range(3 * H):
        assert torch.equal(g0[s], g1[s]), s
        if s < 2 * H:  # (the third round does not move)
            assert torch.equal(t0[s], t1[s]) == ((s + 1) % H == 0), s
    assert not torch.equal(g0[H - 1], g0[2 * H - 1])
    assert torch.equal(g0[2 * H - 1], g0[3 * H - 1])


# ---------------------------------------------------------------- error feedback
def _conservation(rank, world, spec, rounds):
    """Per rank: sum over rounds of the true pseudo-gradient D (captured by an optimizer
    post-hook registered before gradcomp's, so it sees the round's end before the outer
    step), the global point's total move, and the residual left."""
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    start = [_flat(net).double()]
    total = torch.zeros_like(start[0])
    count = [0]

    def capture(optimizer, args, kwargs):
        count[0] += 1
        if count[0] % H == 0:
            now = _flat(net).double()
            total.add_(start[0] - now)

    opt.register_step_post_hook(capture)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none")
    g0 = _flat(net).double()
    for step in range(rounds * H):
        _step(model, opt, rank, step)
        if (step + 1) % H == 0:
            start[0] = _flat(net).double()
    mem = state.state_dict()["memory"]["flat"]
    weights = {"residual": 1.0, "server_residual": float(world)}
    names = [n for n, _ in net.named_parameters()]
    left = torch.cat([sum(w * mem[s][n].double() for s, w in weights.items() if s in mem)
                      for n in names])
    return total, g0 - _flat(net).double(), left


# (diloco's second rounding, of the average, is not fed back: tests/test_loco.py checks its
# first in one process)
CONSERVE = ["topk:ratio=0.05", "onebit:chunk=64", "sparseloco:chunk=64,k=8,decay=1"]


@pytest.mark.parametrize("spec", CONSERVE)
def test_error_feedback_conserves_the_pseudo_gradients(spec, runs):
    """With outer_lr=1 and no momentum the global point moves by the sum of the averages:
    sum_t A_t == mean over ranks of (sum_t D_t - final residual)."""
    (d0, moved0, e0), (d1, moved1, e1) = (r["conserve"][spec] for r in runs)
    assert torch.equal(moved0, moved1)
    assert e0.abs().sum() > 0 and e1.abs().sum() > 0  # compression dropped something
    torch.testing.assert_close(moved0, (d0 - e0 + d1 - e1) / 2, atol=1e-6, rtol=1e-5)
    # and without the residual the balance does not hold
    assert not torch.allclose(moved0, (d0 + d1) / 2, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- resume
K = 4  # mid-round (H=3): inner step 1 of round 2, with local_delay=1 an exchange in flight
RESUME = [f"topk:ratio=0.05,local_steps={H}", f"topk:ratio=0.05,local_steps={H},local_delay=1",
          f"powersgd:rank=1,local_steps={H},local_delay=1",
          f"diloco:chunk=16,bits=4,local_steps={H}", f"diloco:chunk=16,bits=3,local_steps={H}",
          f"sparseloco:chunk=64,k=8,local_steps={H}",
          f"sparseloco:chunk=64,k=8,local_steps={H},local_delay=1"]
EDGE = 2 * H  # the named methods resume at a round's edge too


def _cuts():
    """(spec, the step the checkpoint is taken at): every spec mid-round, the named methods
    at a round's edge too."""
    return [(s, K) for s in RESUME] + [(s, EDGE) for s in RESUME if s.startswith(("diloco", "sparse"))]


def _resume(rank, world, path):
    out = {}
    for i, (spec, cut) in enumerate(_cuts()):
        net, model, opt, state = _job(spec, net_fn=_BNNet, lanes=1)
        for step in range(2 * K):
            _step(model, opt, rank, step)
        out[spec, cut] = [_flat(net), net.body[1].running_mean.clone(), state.stats()]
        net, model, opt, state = _job(spec, net_fn=_BNNet, lanes=1)
        for step in range(cut):
            _step(model, opt, rank, step)
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                    "gradcomp": state.state_dict()}, f"{path}/{i}-rank{rank}.pt")
    return out


def _resume_second_half(rank, world, path):
    out = {}
    for i, (spec, cut) in enumerate(_cuts()):
        net, model, opt, state = _job(spec, net_fn=_BNNet, lanes=1)
        ck = torch.load(f"{path}/{i}-rank{rank}.pt")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["gradcomp"])
        for step in range(cut, 2 * K):
            _step(model, opt, rank, step)
        out[spec, cut] = [_flat(net), net.body[1].running_mean.clone(), state.step]
    return out


def test_resume_mid_round_and_at_its_edge_in_fresh_processes_is_bit_exact(runs):
    # the uninterrupted jobs and the first halves ran in ``runs``'s processes
    ref = runs[0]["resume"]
    got = spawn(_resume_second_half, 2, args=(runs[0]["path"],))[0]
    for key in _cuts():
        assert got[key][2] == 2 * K // H, key
        assert torch.equal(ref[key][0], got[key][0]), key
        assert torch.equal(ref[key][1], got[key][1]), key
        assert ref[key][2]["compressing"], key


# ---------------------------------------------------------------- sync_steps
S = 4  # synchronous steps before the rounds (sync_steps)


def _adamw_job(spec, rank):
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    decay = [p for p in net.parameters() if p.dim() > 1]
    rest = [p for p in net.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=0.01)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0) if spec else None
    return net, model, opt, state


def _sync_steps(rank, world, path):
    """AdamW: plain DDP beside ``allreduce`` local steps after S synchronous fp32 steps, with
    the parameters and Adam's second moment after every step; then the same job resumed from
    checkpoints mid-sync, at the switch and mid-round, in fresh objects."""
    spec = f"allreduce:local_steps={H},sync_steps={S},dense_wire=float32,outer_lr=1,outer_momentum=0"
    steps = S + 2 * H + 1
    out = {}
    for name, sp in (("ddp", None), ("sync", spec)):
        net, model, opt, state = _adamw_job(sp, rank)
        traj, vs = [], []
        for step in range(steps):
            _step(model, opt, rank, step)
            traj.append(_flat(net))
            vs.append(torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1).clone()
                                 for p in net.parameters()]))
        out[name] = (traj, vs, state.step if state else None)
    # resume across the switch: each cut saved, then loaded into fresh objects
    wire = f"diloco:chunk=16,bits=4,local_steps={H},sync_steps={S},dense_wire=int4"
    net, model, opt, state = _adamw_job(wire, rank)
    saved = {}
    for step in range(steps):
        if step in (S - 1, S, S + 1):
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                        "gradcomp": state.state_dict()}, f"{path}/sync{step}-rank{rank}.pt")
        _step(model, opt, rank, step)
    whole = _flat(net)
    resumed = {}
    for cut in (S - 1, S, S + 1):
        net, model, opt, state = _adamw_job(wire, rank)
        ck = torch.load(f"{path}/sync{cut}-rank{rank}.pt")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["gradcomp"])
        for step in range(cut, steps):
            _step(model, opt, rank, step)
        resumed[cut] = _flat(net)
    out["resume"] = (whole, resumed, state.stats())
    return out


def test_sync_steps_are_ddp_then_the_rounds_run_with_adams_second_moment_frozen(runs):
    """The first S steps are DDP's (fp32 on the wire: to float rounding), every rank alike;
    then rounds of H local steps, the ranks apart inside a round and equal at its end, and
    Adam's second moment as the synchronous steps left it."""
    r0, r1 = (r["sync"] for r in runs)
    (ddp, vd, _), (got, vg, n) = r0["ddp"], r0["sync"]
    other = r1["sync"][0]
    assert n == 2  # two rounds after the synchronous steps
    for s in range(S):
        torch.testing.assert_close(got[s], ddp[s], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(vg[s], vd[s], atol=1e-9, rtol=1e-5)
        assert torch.equal(got[s], other[s]), s
    assert not torch.equal(vg[S - 2], vg[S - 1])  # v learns in the synchronous steps ...
    for s in range(S, len(got)):
        assert torch.equal(vg[s], vg[S - 1]), s   # ... and stays as they left it
        if (s + 1 - S) % H == 0:
            assert torch.equal(got[s], other[s]), s
        else:
            assert not torch.allclose(got[s], other[s]), s
    assert not torch.allclose(got[-1], ddp[-1], atol=1e-4)


def _clipped_after_sync(rank, world):
    """AdamW diloco with sync_steps: the parameters after 3 rounds with no clip, a clip at
    0.01 (biting on every step) from the first inner step on, and one from step 0."""
    out = []
    for clip_from in (None, S, 0):
        net, model, opt, state = _adamw_job(f"diloco:local_steps={H},sync_steps={S},chunk=16,adam=freeze",
                                            rank)
        for step in range(S + 3 * H):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if clip_from is not None and step >= clip_from:
                assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01) > 0.2
            opt.step()
        out.append(_flat(net))
    return out


def test_the_clip_is_taken_off_the_inner_steps_with_adams_second_moment_frozen(runs):
    """With v frozen an inner step is linear in this rank's own gradient, and a clip of that
    gradient (larger than the average DDP clips) would shorten it: taken off, as the Adam
    binding does in compressed steps. The synchronous steps, DDP's, keep it."""
    for r in runs:
        free, inner, every = r["clip_after_sync"]
        torch.testing.assert_close(inner, free, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(every, free, atol=1e-4)


def test_sync_steps_resume_bit_exact_before_at_and_after_the_switch(runs):
    for r in runs:
        whole, resumed, stats = r["sync"]["resume"]
        assert stats["compressing"] and (stats["step"], stats["rounds"]) == (S + 2 * H + 1, 2)
        for cut, flat in resumed.items():
            assert torch.equal(flat, whole), cut


# ---------------------------------------------------------------- bad input
def test_bad_options_are_named():
    for opts, match in [({"local_steps": 0}, "invalid local_steps=0: allowed an integer >= 1"),
                        ({"outer_lr": 0.0}, "invalid outer_lr=0.0: allowed a number > 0"),
                        ({"outer_lr": -1}, "invalid outer_lr=-1.0"),
                        ({"outer_momentum": 1.0}, "invalid outer_momentum=1.0"),
                        ({"local_steps": 4, "local_delay": 2}, "invalid local_delay=2"),
                        ({"local_delay": 1}, "0 unless local_steps > 1"),
                        ({"local_steps": 4, "delay": 1}, "invalid delay=1: allowed 0 with local_steps=4"),
                        ({"local_steps": 4, "sync_steps": -1}, "invalid sync_steps=-1"),
                        ({"local_steps": 4, "grow_every": -1}, "invalid grow_every=-1: allowed "
                                                               "an integer >= 0"),
                        ({"local_steps": 4, "max_local_steps": -2}, "invalid max_local_steps=-2"),
                        ({"local_steps": 4, "adam": "momentum"},
                         "invalid adam='momentum': allowed auto, freeze or off with local_steps=4"),
                        ({"local_steps": 4, "adam": "freeze"},
                         "invalid adam='freeze': allowed auto or off with local_steps=4 and "
                         "sync_steps=0")]:
        with pytest.raises(ValueError, match=match):
            gradcomp.build_config("topk", **opts)
    # inert every step: diloco's AdamW defaults set it, and diloco:local_steps=1 stays valid
    assert gradcomp.build_config("diloco", local_steps=1, sync_steps=200)[1].sync_steps == 200
    with pytest.raises(TypeError, match="invalid local_steps=1.5"):
        gradcomp.build_config("topk", local_steps=1.5)
    assert gradcomp.parse_spec("topk:local_steps=8,outer_lr=0.5")[1] == {"local_steps": 8,
                                                                        "outer_lr": 0.5}


def test_a_state_hooked_without_register_refuses_to_train_locally_forever():
    w = torch.zeros(3, requires_grad=True)
    st = gradcomp.State(*gradcomp.build_config("topk:local_steps=2"),
                                param_names={id(w): "w"}, param_numels={"w": 3})
    with pytest.raises(RuntimeError, match="local_steps=2: no optimizer to run the outer step"):
        st._state.entries.bucket(0, torch.zeros(3), [w])


def _refusals(rank, world):
    out = []
    cases = [("topk:local_steps=0", {}), ("topk:outer_lr=0", {}),
             ("topk:local_steps=4", {"optimizer": None}),
             ("topk:local_steps=4", {"scaler": torch.amp.GradScaler("cpu")}),
             ("topk:local_steps=4,delay=1", {})]
    for spec, kw in cases:
        model = DDP(small_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        kw = {"optimizer": opt, **kw}
        try:
            gradcomp.register(model, spec, **kw)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
        assert not getattr(opt, "_gradcomp_local_hooks", None)  # nothing attached on a refusal
    return out


def test_bad_input_raises_at_registration_on_every_rank(runs):
    for msgs in (r["refusals"] for r in runs):
        assert "invalid local_steps=0" in msgs[0]
        assert "invalid outer_lr=0.0" in msgs[1]
        assert "needs register(..., optimizer=opt)" in msgs[2]
        assert "scaler= with local_steps=4" in msgs[3]
        assert "invalid delay=1" in msgs[4]


# ---------------------------------------------------------------- topology, order
def _hierarchical(rank, world):
    net, model, opt, state = _job("topk:ratio=0.1,local_steps=2,topology=hierarchical,local_size=2",
                                  sgd={"lr": LR}, lanes=2)
    traj = []
    for step in range(5):
        _step(model, opt, rank, step)
        traj.append(_flat(net))
    return traj, state.stats()


def test_hierarchical_inner_steps_average_inside_the_node_only():
    """2 nodes x 2 ranks: inner steps apply the node's average (the node's ranks agree, the
    nodes do not), every round's end makes all four agree; nothing crossed between nodes
    but the outer exchange."""
    out = spawn(_hierarchical, 4)
    t = [o[0] for o in out]
    for s in range(5):
        assert torch.equal(t[0][s], t[1][s]) and torch.equal(t[2][s], t[3][s]), s
        if s % 2 == 1:
            assert torch.equal(t[0][s], t[2][s]), s
        else:
            assert not torch.allclose(t[0][s], t[2][s]), s
    stats = out[0][1]
    assert (stats["step"], stats["rounds"]) == (5, 2)
    assert 0 < stats["inter_node_wire_bytes"] < stats["raw_wire_bytes"]


def _sequences(rank, world, specs):
    from conftest import record_collectives as _record_collectives
    log = _record_collectives(rank)
    out = {}
    for spec in specs:
        net, model, opt, state = _job(spec, net_fn=_BNNet, lanes=4)
        state.ordered = True  # NCCL's global order (gloo's default skips it)
        start = len(log)
        for step in range(2 * H + 1):
            _step(model, opt, rank, step)
        state._state.drain()
        out[spec] = log[start:]
        state.close()
    return out


ORDER = [f"powersgd:rank=1,local_steps={H}", f"onebit:chunk=64,local_steps={H},local_delay=1"]


def test_every_rank_issues_the_same_global_sequence(runs):
    r0, r1 = (r["order"] for r in runs)
    for spec in ORDER:
        assert len(r0[spec]) > 4 and r0[spec] == r1[spec], spec


def _everything(rank, world, path):
    """Every 2-rank job of the module, in one spawn (the collective recorder goes last: it
    wraps torch.distributed for the rest of the process)."""
    return {
        "today": {spec: _train_pair(rank, world, spec, {"lr": 0.1}, 4) for spec in TODAY},
        "averaging": _averaging_by_hand(rank, world, *AVERAGING),
        "nesterov": _nesterov_by_hand(rank, world, *NESTEROV),
        "late": _late_by_hand(rank, world, *LATE),
        "growing": _growing_by_hand(rank, world),
        "growing_resume": _growing_resume(rank, world, path),
        "rounds": _trajectories(rank, world, ROUNDS, 2 * H + 1),
        "delayed": _trajectories(rank, world, DELAYED, 3 * H),
        "conserve": {spec: _conservation(rank, world,
                                         f"{spec},local_steps={H},outer_lr=1,outer_momentum=0", 3)
                     for spec in CONSERVE},
        "refusals": _refusals(rank, world),
        "bf16": _bf16(rank, world),
        "resume": _resume(rank, world, path), "path": path,
        "sync": _sync_steps(rank, world, path),
        "clip_after_sync": _clipped_after_sync(rank, world),
        "order": _sequences(rank, world, ORDER),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn(_everything, 2, args=(str(tmp_path_factory.mktemp("local_steps")),))
