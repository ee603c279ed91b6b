"""Adam/AdamW with compressed gradients: the second moment frozen at the switch to
compression (hooks/optimizer/adam.py, after 1-bit Adam). One process: the binding against a
reference written out from its formula; several ranks: registered on DDP, ranks agree and v
stays frozen; the refusals. The one-process tests drive the binding (FrozenVariance) alone,
the switch to compression set by the test: no hook runs, so no warm-up decides it; the
DDP jobs run the hook and assert the step it compressed from."""
import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import batch, small_net
from gradcomp.hooks.optimizer import FROZEN_KEY, FrozenVariance

DENSE, COMPRESSED = 3, 4


def _grads(step):
    """The gradient of parameter p at ``step``: fixed by the step and p's size alone."""
    return lambda p: torch.randn(p.shape, generator=torch.Generator().manual_seed(
        step * 100_003 + p.numel()))


def _opt(kind, net):
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1, "lr": 2e-3},
              {"params": rest, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    if kind == "adam_l2":
        return torch.optim.Adam(groups, lr=1e-3, betas=(0.8, 0.99))
    if kind == "amsgrad":
        return torch.optim.AdamW(groups, lr=1e-3, amsgrad=True)
    return torch.optim.AdamW(groups, lr=1e-3, maximize=True)


def _run(kind, steps, bind=True, net=None, opt=None, start=0, lr_at=None, closure=None,
         store=None):
    """``closure``: None (gradients set, then step()), "kw" or "positional" (gradients set
    inside ``step(closure)``, as Lightning's automatic optimization does: after the
    optimizer's pre-hooks, the previous step's gradients still in place before it)."""
    net = net or small_net()
    opt = opt or _opt(kind, net)
    flag = [False]
    binding = (FrozenVariance(opt, lambda p: p.dim() >= 2, lambda: flag[0], store=store)
               if bind else None)
    for step in range(start, steps):
        make = _grads(step)

        def fill(make=make, step=step):
            flag[0] = step >= DENSE
            for p in net.parameters():
                p.grad = make(p)
            return torch.tensor(float(step))
        if lr_at is not None:  # a scheduler's doing, between steps
            opt.param_groups[0]["lr"] = lr_at(step)
        if closure is None:
            fill()
            opt.step()
        else:
            for p in net.parameters():  # stale gradients the pre-hook must not use
                p.grad = torch.full_like(p, 1e3)
            loss = opt.step(fill) if closure == "positional" else opt.step(closure=fill)
            assert float(loss) == step  # the closure's loss is step()'s
    return net, opt, binding


@pytest.mark.parametrize("kind", ["adamw", "adam_l2", "amsgrad", "maximize"])
def test_frozen_variance_is_adam_with_v_held(kind):
    """Dense steps: the optimizer's own. Compressed steps: m moves, v is the one of the last
    dense step with that step's bias correction, the step counter goes on; the vectors (not
    compressed) keep the optimizer's own update bit for bit. The binding alone, switched at
    DENSE by the test (no hook, no warm-up)."""
    lr_at = lambda s: 2e-3 * (1 + s) / 8  # noqa: E731
    net, opt, _ = _run(kind, DENSE, lr_at=lr_at)
    snap = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
            for p in net.parameters()}
    want = {p: p.detach().clone() for p in net.parameters()}
    plain_net, plain_opt, _ = _run(kind, DENSE + COMPRESSED, bind=False, lr_at=lr_at)
    _, _, binding = _run(kind, DENSE + COMPRESSED, net=net, opt=opt, start=DENSE, lr_at=lr_at)
    for (name, p), q in zip(net.named_parameters(), plain_net.parameters()):
        if p.dim() < 2:
            assert torch.equal(p, q), name
            continue
        g = opt.param_groups[0]
        b1, b2 = g["betas"]
        s = snap[p]
        m, w = s["exp_avg"].double(), want[p].double()
        vkey = "max_exp_avg_sq" if g["amsgrad"] else "exp_avg_sq"
        v = s[vkey].double() / (1 - b2 ** DENSE)
        for step in range(DENSE, DENSE + COMPRESSED):
            lr = lr_at(step)
            grad = _grads(step)(p).double()
            grad = -grad if g["maximize"] else grad
            if kind == "adam_l2":
                grad = grad + g["weight_decay"] * w
            else:
                w = w * (1 - lr * g["weight_decay"])
            m = b1 * m + (1 - b1) * grad
            t = step + 1
            w = w - lr / (1 - b1 ** t) * m / (v.sqrt() + g["eps"])
        torch.testing.assert_close(p.double(), w, rtol=1e-5, atol=1e-7)
        assert torch.equal(opt.state[p][vkey], s[vkey]), "v moved after the switch"
        torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=1e-5, atol=1e-6)
        assert int(opt.state[p]["step"]) == DENSE + COMPRESSED
        assert binding.frozen_step(p) == DENSE
        assert FROZEN_KEY not in opt.state[p]  # no key of ours in the optimizer's state
        assert not torch.equal(p, q)  # the frozen update is not the optimizer's own


@pytest.mark.parametrize("closure", ["kw", "positional"])
def test_step_with_a_closure_is_the_step_without(closure):
    """step(closure): the backward runs inside step(), after the pre-hooks (Lightning's
    automatic optimization); the frozen step must read the closure's gradients, not the
    ones in place before it: bit for bit the run without a closure. The binding alone,
    switched at DENSE by the test (no hook, no warm-up)."""
    plain, plain_opt, _ = _run("adamw", DENSE + COMPRESSED)
    net, opt, _ = _run("adamw", DENSE + COMPRESSED, closure=closure)
    for p, q in zip(plain.parameters(), net.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[q]["exp_avg_sq"], plain_opt.state[p]["exp_avg_sq"])


def test_gradients_handed_back_after_step():
    net, opt, _ = _run("adamw", DENSE + 1)
    for p in net.parameters():
        assert p.grad is not None and torch.equal(p.grad, _grads(DENSE)(p))


@pytest.mark.parametrize("legacy", [False, True])
def test_resume_is_bit_exact_with_the_frozen_step_in_the_bindings_store(legacy):
    """The frozen step travels in the binding's store (the state's memory: gradcomp's
    checkpoint), all loading with weights_only. ``legacy``: an optimizer checkpoint written before,
    whose frozen step is in the optimizer's state: read from there, then removed. The binding
    alone, switched at DENSE by the test (no hook, no warm-up; the hook's resume under DDP:
    test_adamw_resume_in_fresh_processes_is_bit_exact)."""
    from gradcomp.memory import ParamMemory
    straight, _, _ = _run("adamw", DENSE + COMPRESSED)
    net, opt, binding = _run("adamw", DENSE + 1)
    osd = opt.state_dict()
    if legacy:
        for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
            if p.dim() >= 2:
                osd["state"][i][FROZEN_KEY] = binding.frozen_step(p)
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": osd,
                "gradcomp": ParamMemory().state_dict() if legacy else binding.store.state_dict()},
               buf)
    binding.close()
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    net2 = small_net()
    net2.load_state_dict(ck["model"])
    opt2 = _opt("adamw", net2)
    opt2.load_state_dict(ck["opt"])
    store = ParamMemory()
    store.load_state_dict(ck["gradcomp"])
    _run("adamw", DENSE + COMPRESSED, net=net2, opt=opt2, start=DENSE + 1, store=store)
    for p, q in zip(straight.parameters(), net2.parameters()):
        assert torch.equal(p, q)
        assert FROZEN_KEY not in opt2.state[q]


def test_v_still_zero_at_the_switch_learns_on_as_adams_own():
    """An embedding's rows that no gradient reached during the warm-up have v = 0 when v
    freezes: they go on learning v as Adam does (v = beta2 v + (1 - beta2) g^2), so their
    first step is Adam's size, not m / eps; every other element's v stays frozen."""
    torch.manual_seed(0)
    emb = nn.Parameter(torch.randn(8, 4))
    opt = torch.optim.AdamW([emb], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    flag = [False]
    binding = FrozenVariance(opt, lambda p: True, lambda: flag[0])
    seen = torch.zeros(8, 1)
    seen[:5] = 1  # rows 5..7: tokens the warm-up never saw
    for step in range(DENSE + COMPRESSED):
        flag[0] = step >= DENSE
        emb.grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)) * (
            seen if step < DENSE else 1)
        if step == DENSE:
            v0, w0 = opt.state[emb]["exp_avg_sq"].clone(), emb.detach().clone()
            m0 = opt.state[emb]["exp_avg"].clone()
        opt.step()
    v = opt.state[emb]["exp_avg_sq"]
    assert torch.equal(v[:5], v0[:5]), "v moved where it was learned"
    want = torch.zeros(3, 4, dtype=torch.float64)
    m, w = m0[5:].double(), w0[5:].double()
    assert torch.equal(m, torch.zeros_like(m)) and torch.equal(v0[5:], torch.zeros(3, 4))
    for step in range(DENSE, DENSE + COMPRESSED):
        g = (torch.randn(8, 4, generator=torch.Generator().manual_seed(step)))[5:].double()
        want = 0.99 * want + 0.01 * g * g
        m = 0.9 * m + 0.1 * g
        w = w - 1e-2 / (1 - 0.9 ** (step + 1)) * m / ((want / (1 - 0.99 ** DENSE)).sqrt() + 1e-8)
    torch.testing.assert_close(v[5:].double(), want, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(emb[5:].detach().double(), w, rtol=1e-5, atol=1e-7)
    assert (emb[5:] - w0[5:]).abs().max() < 0.1  # Adam-sized steps (with v frozen at 0: ~1e5)
    binding.close()


@pytest.mark.parametrize("overflow", [False, True])
def test_fused_adamw_under_gradscaler_steps_as_the_unfused_one(overflow):
    """GradScaler.step() leaves a fused optimizer's gradients scaled and calls its step even
    after an overflow (the fused kernel reads ``grad_scale`` and ``found_inf``): the frozen
    step must unscale them and skip the step as the kernel does. The binding alone, switched
    at DENSE by the test (no hook, no warm-up)."""
    runs = []
    for fused in (False, True):
        net = small_net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(torch.ones(()))  # what a backward's scaler.scale(loss) does first
        flag = [False]
        binding = FrozenVariance(opt, lambda p: p.dim() >= 2, lambda: flag[0])
        for step in range(DENSE + COMPRESSED):
            flag[0] = step >= DENSE
            make = _grads(step)
            for p in net.parameters():
                p.grad = make(p) * scaler.get_scale()
            if overflow and step == DENSE + 1:
                next(net.parameters()).grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        binding.close()
        runs.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*runs):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_the_groups_are_read_live_after_the_optimizer_reloads():
    """optimizer.load_state_dict() replaces the param groups' dicts (a resumed job whose
    scheduler moves beta1): the momentum exchange reads the loaded groups, not the ones
    there when it was bound."""
    from conftest import lay_out
    net, opt, _ = _run("adamw", DENSE, bind=False)
    named = dict(net.named_parameters())
    names = {id(p): n for n, p in named.items()}
    binding = FrozenVariance(opt, lambda p: p.dim() >= 2, lambda: True, names, momentum=True)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g["betas"] = (0.7, 0.95)
    opt.load_state_dict(sd)
    slices = lay_out([(n, tuple(p.shape)) for n, p in named.items()])
    a, b = binding.momentum(slices, torch.device("cpu"))
    for sl in slices:
        p = named[sl.name]
        if p.dim() >= 2:
            torch.testing.assert_close(a[sl.offset : sl.offset + sl.numel],
                                       torch.full((sl.numel,), 0.3))
            torch.testing.assert_close(b[sl.offset : sl.offset + sl.numel],
                                       0.7 * opt.state[p]["exp_avg"].reshape(-1))
    binding.close()


def test_decoupled_weight_decay_is_each_groups_own():
    """Adam with one group ``decoupled_weight_decay=True`` and one L2 group: each group's
    frozen step is the one it would get alone. The binding alone, switched at DENSE by the
    test (no hook, no warm-up)."""
    def job(groups_of):
        torch.manual_seed(0)
        ws = [nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(6, 5))]
        opts = [torch.optim.Adam(g(ws), lr=1e-2) for g in groups_of]
        flag = [False]
        binds = [FrozenVariance(o, lambda p: True, lambda: flag[0]) for o in opts]
        for step in range(DENSE + COMPRESSED):
            flag[0] = step >= DENSE
            for i, w in enumerate(ws):
                w.grad = torch.randn(6, 5, generator=torch.Generator().manual_seed(step * 7 + i))
            for o in opts:
                o.step()
        for b in binds:
            b.close()
        return ws
    both = job([lambda ws: [{"params": [ws[0]], "weight_decay": 0.1, "decoupled_weight_decay": True},
                            {"params": [ws[1]], "weight_decay": 0.1}]])
    alone = job([lambda ws: [{"params": [ws[0]], "weight_decay": 0.1, "decoupled_weight_decay": True}],
                 lambda ws: [{"params": [ws[1]], "weight_decay": 0.1}]])
    for a, b in zip(both, alone):
        assert torch.equal(a, b)


def _ddp_adamw(rank, world, spec, steps, options):
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=1000, **options)
    seen = {}
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step == options.get("dense_steps", 0) - 1:
            seen = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in net.named_parameters()}
    since = state.stats()["compressing_since"]
    state.close()
    # where v was still 0 at the switch it learns on (as Adam's own): a coarse warm-up wire
    # (terngrad's int4 with AdamW) leaves some; frozen means held everywhere else
    frozen = {n: torch.equal(opt.state[p]["exp_avg_sq"][seen[n] > 0], seen[n][seen[n] > 0])
              for n, p in net.named_parameters()}
    return ([p.detach().clone() for p in net.parameters()], frozen, dict(net.named_parameters()),
            since)


SPECS = ["onebit", "topk:ratio=0.1", "powersgd:rank=2", "terngrad", "threshold", "dgc:ratio=0.1",
         "onebit:adam=freeze"]


def _ddp_adamw_all(rank, world, specs, steps, options):
    return [_ddp_adamw(rank, world, spec, steps, options) for spec in specs]


def test_ddp_adamw_ranks_agree_and_v_frozen_for_compressed_parameters(spawn):
    outs = spawn(_ddp_adamw_all, 2, args=(SPECS, 6, {"dense_steps": 2}), timeout=240)
    for spec, r0, r1 in zip(SPECS, *outs):
        assert r0[3] == r1[3] == 2, spec  # compressed after the 2 dense steps
        for a, b in zip(r0[0], r1[0]):
            assert torch.equal(a, b), spec
            assert torch.isfinite(a).all(), spec
        params = r0[2]
        for name, frozen in r0[1].items():
            compressed = params[name].numel() >= 1000 and (not spec.startswith("powersgd")
                                                            or params[name].dim() >= 2)
            assert frozen == compressed, (spec, name)


def _moment_identity(rank, world, specs, kind="adamw"):
    """Per compressed step and parameter, the largest |avg_i(beta1 m + (1 - beta1) g_i +
    e_i - e_i') - m_new| over ranks' local gradients g_i and residuals before/after (e, e';
    onebit's second compression adds its owners' server residuals),
    against the size of the residual term; and the mode each spec ran in."""
    import torch.distributed as dist
    out = []
    for spec in specs:
        net = small_net()
        model = DDP(net, bucket_cap_mb=0.004)
        groups = [{"params": [p for p in net.parameters() if p.dim() >= 2], "betas": (0.8, 0.95)},
                  {"params": [p for p in net.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        if kind in ("adamw", "cycled"):
            opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        else:  # Adam's L2 decay enters m (g + wd w); maximize flips g
            opt = torch.optim.Adam(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                                   maximize=kind == "maximize")
        state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, dense_steps=2)
        named = dict(net.named_parameters())
        group = {n: g for g in opt.param_groups for n, p in named.items()
                 if any(p is q for q in g["params"])}
        beta = {n: g["betas"][0] for n, g in group.items()}
        l2 = {n: 0.0 if kind in ("adamw", "cycled") else g["weight_decay"]
              for n, g in group.items()}
        sign = -1.0 if kind == "maximize" else 1.0
        worst, term = 0.0, 0.0
        for step in range(6):
            if kind == "cycled":  # what OneCycleLR's cycle_momentum does to Adam's beta1
                for g in opt.param_groups:
                    g["betas"] = (0.95 - 0.02 * step, g["betas"][1])
                beta = {n: g["betas"][0] for n, g in group.items()}
            x, y = batch(rank, step)
            local = torch.autograd.grad(nn.functional.cross_entropy(net(x), y), list(named.values()))
            before = {n: opt.state[p]["exp_avg"].clone() for n, p in named.items() if p in opt.state}
            w = {n: p.detach().clone() for n, p in named.items()}
            memory = state._state.memory
            e0, s0 = ([None if e is None else e.clone() for e in memory.peek(slot, list(named))]
                      for slot in ("residual", "server_residual"))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            e1, s1 = (memory.peek(slot, list(named)) for slot in ("residual", "server_residual"))
            if step < 2:
                continue
            for (n, p), g, a, b, c, d in zip(named.items(), local, e0, e1, s0, s1):
                if b is None:
                    continue
                owed = (a if a is not None else torch.zeros_like(b)).reshape(p.shape) - b.reshape(p.shape)
                if d is not None:  # onebit's second compression: each rank owns a part of it
                    owed += world * ((c if c is not None else torch.zeros_like(d)) - d).reshape(p.shape)
                mine = beta[n] * before[n] + (1 - beta[n]) * (sign * g + l2[n] * w[n]) + owed
                dist.all_reduce(mine)
                worst = max(worst, float((mine / world - opt.state[p]["exp_avg"]).abs().max()))
                term = max(term, float(owed.abs().max()))
        out.append((worst, term, state._state.adam_mode))
        state.close()
    return out


def test_momentum_mode_exchanges_adams_first_moment_with_error_feedback(spawn):
    """adam='momentum' (what 'auto' runs for error-feedback methods): each rank compresses
    beta1 m + (1 - beta1) g_i plus its residual, and the average is every rank's m: the
    identity avg(beta1 m + (1 - beta1) g_i + e_i - e_i') = m_new holds to float rounding,
    per-group betas included. Compressing the gradient instead ('freeze') breaks it by the
    residual term (so the check can fail)."""
    specs = ["onebit:chunk=16", "topk:ratio=0.2", "onebit:chunk=16,adam=freeze", "terngrad"]
    out = spawn(_moment_identity, 2, args=(specs,), timeout=240)
    _check_identity(out)


@pytest.mark.parametrize("kind", ["adam_l2", "maximize", "cycled"])
def test_momentum_exchange_with_adams_l2_decay_maximize_and_a_beta1_schedule(kind, spawn):
    """Adam's L2 weight decay goes into m (beta1 m + (1 - beta1) (g + wd w)), maximize
    negates g, and a scheduler may move beta1 every step (OneCycleLR's cycle_momentum): the
    exchanged moment is the one Adam's step builds from them."""
    specs = ["onebit:chunk=16", "topk:ratio=0.2", "onebit:chunk=16,adam=freeze", "terngrad"]
    _check_identity(spawn(_moment_identity, 2, args=(specs, kind), timeout=240))


def _check_identity(out):
    for rank in out:
        (w1, t1, m1), (w2, t2, m2), (w3, t3, m3), (_, _, m4) = rank
        assert (m1, m2, m3, m4) == ("momentum", "momentum", "freeze", "freeze")
        assert t1 > 1e-3 and t2 > 1e-3 and t3 > 1e-3  # residuals that matter
        assert w1 < 1e-5 and w2 < 1e-5, (w1, w2)
        assert w3 > 1e-2 * t3, (w3, t3)


def test_adam_off_leaves_the_optimizer_alone(spawn):
    out = spawn(_ddp_adamw, 2, args=("onebit", 5, {"dense_steps": 2, "adam": "off"}),
                timeout=120)
    assert out[0][3] == 2  # compressed steps after the 2 dense ones
    assert not any(out[0][1].values())  # every v moved on


def _register(rank, world, cases):
    out = []
    for spec, opt_kind, options in cases:
        net = small_net()
        model = DDP(net)
        params = net.parameters()
        opt = {"sgd": lambda: torch.optim.SGD(params, lr=0.1),
               "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
               "capturable": lambda: torch.optim.AdamW(params, lr=1e-3, capturable=True)
               }[opt_kind]()
        try:
            gradcomp.register(model, spec, optimizer=opt, **options).close()
        except (TypeError, ValueError) as exc:
            out.append((type(exc).__name__, str(exc)))
        else:
            out.append(None)
    return out


REFUSALS = [
    ("onebit", "adamw", {"warmup": "none"}, "dense warm-up steps"),
    ("topk", "adamw", {"dense_steps": 0}, "dense warm-up steps"),
    ("onebit", "sgd", {"adam": "freeze"}, "needs optimizer=torch.optim.Adam"),
    ("topk", "adamw", {"adam": "precondition", "local_steps": 4}, "local_steps=4"),
    ("onebit", "capturable", {}, "capturable=True"),
    ("onebit", "adamw", {"adam": "yes"}, "invalid adam='yes'"),
    ("dgc", "adamw", {"momentum": 0.9}, "use 'topk'"),
    ("onebit", "adamw", {"adam": "momentum", "delay": 1}, "0 with adam='momentum'"),
    ("onebit", "sgd", {"adam": "momentum"}, "needs optimizer=torch.optim.Adam"),
]
ACCEPTED = [("onebit", "adamw", {"warmup": "none", "adam": "off"}), ("dgc", "adamw", {}),
            ("topk", "adamw", {"local_steps": 4}), ("onebit", "sgd", {})]


def test_refusals_name_the_problem_on_every_rank_and_the_rest_register(spawn):
    cases = [c[:3] for c in REFUSALS] + ACCEPTED
    out = spawn(_register, 2, args=(cases,), timeout=120)
    for rank_out in out:
        for (spec, opt, options, match), r in zip(REFUSALS, rank_out):
            assert r is not None and r[0] in ("TypeError", "ValueError") and match in r[1], \
                (spec, opt, options, r)
        assert rank_out[len(REFUSALS):] == [None] * len(ACCEPTED)


def test_is_adam_sees_through_framework_wrappers():
    from gradcomp.hooks.optimizer import is_adam

    class Wrapped:  # Accelerate's AcceleratedOptimizer keeps the torch optimizer here
        def __init__(self, opt):
            self.optimizer = opt
    class Subclass(torch.optim.Optimizer):  # ... and is an Optimizer subclass itself
        def __init__(self, opt):
            self.optimizer = opt
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))])
    assert is_adam(Wrapped(opt)) and is_adam(opt) and is_adam(Subclass(opt)) and is_adam(Wrapped(Subclass(opt)))
    assert not is_adam(Wrapped(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)))


def test_precondition_scale_is_the_frozen_adam_denominator():
    """s = 1 / (sqrt(v / (1 - beta2**k)) + eps) at each compressed parameter's place in the
    bucket, 1 elsewhere (gaps, uncompressed parameters), k the Adam step v froze at."""
    from conftest import lay_out
    net, opt, _ = _run("adamw", DENSE)
    named = dict(net.named_parameters())
    names = {id(p): n for n, p in named.items()}
    binding = FrozenVariance(opt, lambda p: p.dim() >= 2, lambda: True, names,
                             precondition=True)
    slices = lay_out([(n, tuple(p.shape)) for n, p in named.items()])
    s = binding.scale(slices, torch.device("cpu"))
    g = opt.param_groups[0]
    for sl in slices:
        got = s[sl.offset : sl.offset + sl.numel]
        p = named[sl.name]
        if p.dim() < 2:
            assert torch.equal(got, torch.ones_like(got))
            continue
        v = opt.state[p]["exp_avg_sq"].reshape(-1) / (1 - g["betas"][1] ** DENSE)
        torch.testing.assert_close(got, 1 / (v.sqrt() + g["eps"]))
    assert binding.scale(slices, torch.device("cpu")) is s  # cached: v no longer moves
    binding.close()
    off = FrozenVariance(opt, lambda p: p.dim() >= 2, lambda: True, names)
    assert off.scale(slices, torch.device("cpu")) is None


# --------------------------------------------------------------------------- resume under DDP
K = 4
RESUME = ["onebit:chunk=64,dense_steps=2", "topk:ratio=0.05,dense_steps=6",
          "powersgd:rank=1,dense_steps=2", "dgc:ratio=0.05,dense_steps=1,delay=1"]


def _job(spec):
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    groups = [{"params": [p for p in net.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in net.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    return net, model, opt, sched, state


def _train(model, opt, sched, rank, steps):
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()


def _resume_phase(rank, world, phase, path):
    out = []
    for i, spec in enumerate(RESUME):
        net, model, opt, sched, state = _job(spec)
        if phase == "straight":
            _train(model, opt, sched, rank, range(2 * K))
        elif phase == "first":
            _train(model, opt, sched, rank, range(K))
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "gradcomp": state.state_dict()},
                       f"{path}/{i}_rank{rank}.pt")
        else:
            ck = torch.load(f"{path}/{i}_rank{rank}.pt", weights_only=True)
            net.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            state.load_state_dict(ck["gradcomp"])
            _train(model, opt, sched, rank, range(K, 2 * K))
        out.append(([p.detach().clone() for p in net.parameters()],
                    state.stats()["compressing_since"]))
        state.close()
    return out


def test_adamw_resume_in_fresh_processes_is_bit_exact(spawn, tmp_path):
    """Checkpoint before the switch (topk: frozen in the resumed job) and after it (the
    frozen step travels in the optimizer's state), a scheduler, param groups, delay; both
    jobs compressed from their spec's dense_steps on."""
    straight = spawn(_resume_phase, 2, args=("straight", str(tmp_path)), timeout=240)
    spawn(_resume_phase, 2, args=("first", str(tmp_path)), timeout=240)
    resumed = spawn(_resume_phase, 2, args=("second", str(tmp_path)), timeout=240)
    for rank in range(2):
        for spec, (a, sa), (b, sb) in zip(RESUME, straight[rank], resumed[rank]):
            switch = int(spec.split("dense_steps=")[1].split(",")[0])
            assert sa == sb == switch, (spec, sa, sb)
            for p, q in zip(a, b):
                assert torch.equal(p, q), spec



def _warnings(rank, world):
    import warnings
    out = {}
    for spec in ["powersgd", "powersgd:rank=2", "terngrad", "powersgd"]:
        model = DDP(nn.Linear(8, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            state = gradcomp.register(model, spec, optimizer=opt)
        state.close()
        out.setdefault(spec, []).append([str(w.message) for w in seen
                                         if "gradcomp:" in str(w.message)])
    return out


def test_a_method_measured_not_to_hold_with_adamw_warns_once_naming_one_that_did(spawn):
    r0, r1 = spawn(_warnings, 2, timeout=90)
    first, again = r0["powersgd"]
    assert len(first) == 1 and "powersgd at its defaults with AdamW" in first[0]
    assert "'terngrad'" in first[0] and "docs/adam.md" in first[0] and "RESULTS" not in first[0]
    assert again == []  # once per process
    assert r0["powersgd:rank=2"] == [[]] and r0["terngrad"] == [[]]  # not what was measured
    assert all(w == [] for ws in r1.values() for w in ws)  # rank 0 only


def _adamw_warning(method, options, sharded, monkeypatch):
    """warn_measured's messages for ``method`` with AdamW as register() builds its config
    (one process; ``sharded``: what the FSDP adapter sets)."""
    import warnings
    from gradcomp.hooks import optimizer as binding
    from gradcomp.hooks.options import for_optimizer
    monkeypatch.setattr(binding, "_warned", set())
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(4))], lr=1e-3)
    from gradcomp.hooks.plan import Plan, Sharding
    state = gradcomp.State(*for_optimizer(method, options, opt),
                                   plan=Plan(sharding=Sharding(sharded)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        st = state._state
        binding.warn_measured(st.method, st.config, st.adam_mode, opt)
    state.close()
    return [str(w.message) for w in seen if "gradcomp:" in str(w.message)]


@pytest.mark.parametrize("method, options, sharded, mode", [
    ("onebit", {}, "FSDP", "freeze"),              # FSDP exchanges the gradient
    ("onebit", {"delay": 1}, "", "freeze"),        # so does delay
    ("onebit", {"adam": "freeze"}, "", "freeze"),
    ("threshold", {}, "", "momentum"),             # DDP: the first moment
])
def test_the_adamw_warning_quotes_a_gap_and_a_held_list_of_one_exchange(
        method, options, sharded, mode, monkeypatch):
    """The gap quoted and the methods said to have held come from the same exchange's
    measurements: onebit's 4.26% exchanging the gradient is not followed by onebit, which
    held only exchanging the first moment, in the list of those that held."""
    import re
    from gradcomp.hooks.optimizer import HOLDS_PCT, adam_gap
    (msg,) = _adamw_warning(method, options, sharded, monkeypatch)
    gap = float(re.search(r"ended ([\d.]+)% above", msg).group(1))
    said_mode, listed = re.search(r"held within [\d.]+% there(?: with adam='(\w+)')?: (.*?), "
                                  r"e\.g\.", msg).groups()
    names = re.findall(r"'(\w+)'", listed)
    assert gap == pytest.approx(adam_gap(method, mode)) and gap > HOLDS_PCT
    assert names and method not in names
    assert f"(adam={mode!r})" in msg and said_mode == mode
    assert all(adam_gap(m, mode) <= HOLDS_PCT for m in names)
    assert names == (["terngrad"] if mode == "freeze" else ["onebit", "topk"])
    assert "docs/adam.md" in msg and "RESULTS" not in msg


def test_onebit_with_adamw_under_ddp_held_and_does_not_warn(monkeypatch):
    assert _adamw_warning("onebit", {}, "", monkeypatch) == []


def _exchange_units(rank, world):
    """Save past the switch with adam='freeze' (gradient residuals), load into jobs that
    exchange the gradient or the first moment; the same with the key removed (a checkpoint
    of a gradcomp before 'momentum', whose adam='auto' ran 'freeze')."""
    def job(spec):
        net = small_net()
        model = DDP(net, bucket_cap_mb=0.004)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        return net, model, opt, gradcomp.register(model, spec, optimizer=opt, min_numel=0,
                                                  dense_steps=1)
    net, model, opt, state = job("onebit:adam=freeze")
    for step in range(3):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    sd = state.state_dict()
    since = state.stats()["compressing_since"]
    state.close()
    legacy = {k: v for k, v in sd.items() if k not in ("exchanges", "digest")}
    legacy["config"] = {**legacy["config"], "adam": "auto"}
    out = []
    for ck in (sd, legacy):
        for spec in ("onebit", "onebit:adam=freeze"):
            _, _, _, st = job(spec)
            try:
                st.load_state_dict(ck)
                out.append(None)
            except ValueError as exc:
                out.append(str(exc))
            st.close()
    return sd["exchanges"], out, since, bool(sd["memory"]["flat"].get("residual"))


def test_residuals_load_only_into_the_exchange_they_came_from(spawn):
    for units, (auto, freeze, legacy_auto, legacy_freeze), since, residuals in spawn(
            _exchange_units, 2):
        assert since == 1 and residuals  # saved after compressed steps, residuals in it
        assert units == "gradient"
        for msg in (auto, legacy_auto):  # auto runs 'momentum' for onebit
            assert msg and "residuals are of the gradient" in msg and "adam='freeze'" in msg
        assert freeze is None and legacy_freeze is None


def _bf16_average(rank, world):
    import torch.distributed as dist
    from gradcomp.comm import Comm
    from gradcomp.compressors.base import dense_bf16
    out = []
    for n in (1, 7, 1000):  # parts of one element, uneven parts
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank * 10 + n)) * 10 ** rank
        every = [torch.empty(n) for _ in range(world)]
        dist.all_gather(every, x)
        want = sum(e.bfloat16().float() for e in every).div(world).bfloat16().float()
        out.append((dense_bf16(x, Comm(dist.group.WORLD)), want))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_warm_up_average_rounds_twice_and_sums_in_fp32(world, spawn):
    """dense_bf16: every rank's value rounded to bf16 once, summed in fp32, the average rounded
    once; all ranks get the same values (ranks of different magnitudes: no bf16 sum). The
    dense warm-up's own average, on purpose."""
    outs = spawn(_bf16_average, world)
    for rank_out in outs:
        for (got, want), (ref, _) in zip(rank_out, outs[0]):
            assert torch.equal(got, want) and torch.equal(got, ref)


def _warmup_bytes(rank, world, wire, opt_kind):
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = (torch.optim.AdamW(net.parameters(), lr=1e-3) if opt_kind == "adamw"
           else torch.optim.SGD(net.parameters(), lr=0.1))
    state = gradcomp.register(model, "onebit", optimizer=opt, min_numel=0, dense_steps=3,
                              dense_wire=wire)
    sent, grads = [], []
    for step in range(3):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
        sent.append(state.stats()["wire_bytes"])
    state.close()
    return sent, grads


def test_adams_warm_up_goes_bf16_by_default_at_half_the_bytes(spawn):
    """dense_wire='auto': bf16 with AdamW (half the fp32 allreduce's bytes, gradients within
    bf16 rounding of fp32's), fp32 with SGD; 'float32' and 'bfloat16' as asked. The dense
    warm-up's own wire, so every step is dense on purpose."""
    (auto, g16), _ = spawn(_warmup_bytes, 2, args=("auto", "adamw"))
    (f32, g32), _ = spawn(_warmup_bytes, 2, args=("float32", "adamw"))
    (sgd, _), _ = spawn(_warmup_bytes, 2, args=("auto", "sgd"))
    (sgd16, _), _ = spawn(_warmup_bytes, 2, args=("bfloat16", "sgd"))
    (i8, g8), _ = spawn(_warmup_bytes, 2, args=("int8", "adamw"))
    (i4, g4), _ = spawn(_warmup_bytes, 2, args=("int4", "adamw"))
    assert f32[-1] == sgd[-1] and auto[-1] == sgd16[-1]
    assert auto[-1] * 2 == pytest.approx(f32[-1], rel=0.01)  # (odd buckets pad one element)
    # int8: a byte per value, a 4-byte scale per row of 256 and each parameter's last row
    # padded (small_net's are small: most of the bytes here are padding)
    assert i4[-1] < i8[-1] < auto[-1]
    for a, b in zip(g8[0], g32[0]):
        assert not torch.equal(a, b)
        assert (a - b).abs().max() <= 2 / 127 * b.abs().max() + 1e-12
    for a, b, c in zip(g4[0], g32[0], g8[0]):  # 7 levels each side of 0: coarser than int8
        assert (a - b).abs().max() <= 2 / 7 * b.abs().max() + 1e-12
        assert (a - b).abs().max() >= (c - b).abs().max()
    for a, b in zip(g16[0], g32[0]):  # the first step's gradients: same parameters
        assert not torch.equal(a, b)
        # each rank's value rounded once (relative 2**-9), the average once: an average of
        # values that nearly cancel is off by up to 2**-8 of the inputs' size
        assert (a - b).abs().max() <= 2 ** -7 * b.abs().max()


def _int8_average(rank, world):
    import torch.distributed as dist
    from gradcomp.comm import Comm
    from gradcomp.compressors.base import ParamSlice
    from gradcomp.compressors.rows import dense_rows
    g = torch.Generator().manual_seed(rank)
    # three parameters: one under a row, one of several rows and a ragged end, one of 3 rows
    sizes = (5, 700, 768)
    x = torch.randn(sum(sizes), generator=g) * torch.tensor([1.0, 100.0, 0.01]).repeat_interleave(
        torch.tensor(sizes))
    params, off = [], 0
    for i, n in enumerate(sizes):
        params.append(ParamSlice(f"p{i}", (n,), off, n))
        off += n
    every = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(every, x)
    comm = Comm(dist.group.WORLD)
    whole = dense_rows(x, params, comm)
    # the same parameters laid out in another order: each parameter's result its own
    perm = [params[2], params[0], params[1]]
    y = torch.cat([x[p.offset:p.offset + p.numel] for p in perm])
    moved, off = [], 0
    for p in perm:
        moved.append(ParamSlice(p.name, p.shape, off, p.numel))
        off += p.numel
    other = dense_rows(y, moved, comm)
    back = torch.cat([other[m.offset:m.offset + m.numel] for m in
                      sorted(moved, key=lambda m: m.name)])
    return whole, back, torch.stack(every).mean(0), torch.stack(every).abs().amax(0)


@pytest.mark.parametrize("world", [2, 3])
def test_int8_warm_up_average_is_per_parameter_within_its_rows_rounding(world, spawn):
    """dense_rows (dense_wire='int8'): the same values on every rank, within two roundings
    of each row's scale (1/127 of its largest magnitude, each rank's and the average's) of
    the exact average, parameters of magnitudes 10^4 apart each exact to its own scale, and a
    parameter's result independent of its neighbours in the bucket."""
    outs = spawn(_int8_average, world)
    for whole, back, exact, peak in outs:
        assert torch.equal(whole, outs[0][0]) and torch.equal(back, whole)
        for lo, hi in ((0, 5), (5, 705), (705, 1473)):
            # each rank's rounding at most half its row's step, the average's as much again
            err = (whole[lo:hi] - exact[lo:hi]).abs().max()
            assert 0 < err <= peak[lo:hi].max() / 127


def test_a_local_steps_method_that_did_not_hold_warns_naming_one_that_did(monkeypatch):
    """A local-steps method at its defaults with AdamW whose row did not hold (diloco, given
    here): the gap of its local-steps row, and the local-steps methods that held
    (sparseloco, given here)."""
    from gradcomp.compressors import METHODS
    from gradcomp.hooks.optimizer import LOCAL, adam_gap
    monkeypatch.setattr(METHODS["sparseloco"].compressor, "measured",
                        {"adamw_gap_pct": {LOCAL: 0.5}})
    monkeypatch.setattr(METHODS["diloco"].compressor, "measured",
                        {"adamw_gap_pct": {LOCAL: 1.5}})
    (msg,) = _adamw_warning("diloco", {}, "", monkeypatch)
    assert f"ended {adam_gap('diloco', LOCAL):.2f}% above" in msg
    assert "(local steps)" in msg and "there with local steps: 'sparseloco'" in msg
    assert "adam=" not in msg
    # the same method with other settings is not what was measured: no warning
    assert _adamw_warning("diloco", {"local_steps": 3}, "", monkeypatch) == []


def _unseen_optimizer(rank, world):
    """register() without optimizer=: what the first step()s of AdamW, SGD, AdamW with
    adam='off', and an AdamW of another model raise (None: nothing), and whether the
    global hook is gone after close()."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks as hooks
    out = {}
    for name, make, options in (
            ("adamw", torch.optim.AdamW, {}), ("sgd", torch.optim.SGD, {}),
            ("off", torch.optim.AdamW, {"adam": "off"})):
        net = small_net()
        model = DDP(net)
        opt = make(net.parameters(), lr=1e-3)
        other = torch.optim.AdamW(nn.Linear(3, 3).parameters())
        state = gradcomp.register(model, "onebit", min_numel=0, **options)
        other.step()  # not the model's: not looked at
        got = []
        for step in range(2):  # the first step refused, then nothing more
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            try:
                opt.step()
                got.append(None)
            except ValueError as exc:
                got.append(str(exc))
        state.close()
        out[name] = (got, len(hooks))  # the global hook removed at close()
    return out


def test_adamw_registered_without_optimizer_is_refused_at_its_first_step(spawn):
    """gradcomp cannot see an optimizer it was not given: the first step of an AdamW that
    steps the model's parameters raises on every rank, naming the fix; SGD, adam='off' and
    another model's AdamW go on."""
    for r in spawn(_unseen_optimizer, 2, timeout=120):
        (refused, then), left = r["adamw"]
        assert "registered without optimizer=" in refused and "AdamW" in refused
        assert "gradcomp.register(model, 'onebit', optimizer=opt)" in refused
        assert then is None and left == 0
        assert r["sgd"] == ([None, None], 0)
        assert r["off"] == ([None, None], 0)
