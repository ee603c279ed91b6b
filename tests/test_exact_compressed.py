"""Every compressing method, compressed from its first step, on 2 gloo ranks over several DDP
buckets: (a) a job resumed from a checkpoint in fresh processes ends with the parameters of
the uninterrupted job, bit for bit (also with ``delay=1``, and with AdamW for onebit and
topk); (b) two bucket caps give the same parameters, bit for bit; (c) the steps were
compressed (the state's stats), so (a) and (b) are not the dense path's exactness.

Both rest on one rule (compressors/base.py): a parameter's result depends on that parameter
alone. The resumed job meets DDP's first-iteration layout (one bucket of every parameter)
at its first step, where the uninterrupted job runs on the rebuilt buckets (three at
``CAP``, two at ``OTHER_CAP``). The net has more than 2^17 elements so that the dispatcher
runs onebit's encoder on the compiled path for the large buckets and on the cpu path for the
small ones: the onebit cases run ``GRADCOMP_KERNELS=auto`` (the default outside the tests)
and check that both paths ran where a C++ compiler is present.

One spawn runs every case's uninterrupted job, the job at the other bucket cap and the
first half (saving its checkpoint); fresh processes then run the second halves."""
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import train_steps
from gradcomp.kernels import compiled

STEPS, CUT = 6, 3  # the checkpoint after CUT steps: every case is compressing by then
CAP, OTHER_CAP = 0.1, 0.3  # MB: 3 buckets (72634, 65792, 5376 elements) and 2 (138426, 5376)
H = 2  # the local-steps methods' round: the cut falls inside the second round
SGD = {"lr": 0.05, "momentum": 0.9}
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}

# (spec, optimizer, least ratio of raw to sent bytes on a compressed step); every spec runs
# warmup=none and min_numel=0 (every tensor compressed from the first step) unless it says
PER_STEP = {
    "allreduce": ("allreduce", 1.0),
    "onebit": ("onebit", 10.0),
    "topk": ("topk:ratio=0.05", 5.0),
    "dgc": ("dgc:ratio=0.01", 20.0),
    "threshold": ("threshold:max_ratio=0.05", 5.0),
    "terngrad": ("terngrad", 10.0),
    "powersgd": ("powersgd:rank=1", 20.0),
}
CASES = {}
for _name, (_spec, _ratio) in PER_STEP.items():
    CASES[_name] = (_spec, "sgd", _ratio)
    CASES[f"{_name}-delay1"] = (f"{_spec}{',' if ':' in _spec else ':'}delay=1", "sgd", _ratio)
# AdamW's second moment is learned on dense steps and frozen when compression starts
# (docs/adam.md): two dense steps, the checkpoint in the compressed phase
CASES["onebit-adamw"] = ("onebit:dense_steps=2", "adamw", 8.0)
CASES["topk-adamw"] = ("topk:ratio=0.05,dense_steps=2", "adamw", 4.0)
CASES["sparseloco"] = (f"sparseloco:chunk=512,k=16,local_steps={H}", "sgd", 20.0)
CASES["diloco"] = (f"diloco:bits=4,local_steps={H}", "sgd", 3.0)


def test_every_compressing_method_has_a_case():
    names = {m["name"] for m in gradcomp.methods()}
    assert names <= {spec.split(":")[0] for spec, _, _ in CASES.values()}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 272), nn.Tanh(), nn.Linear(272, 10))


def _job(case, cap):
    spec, opt_name, _ = CASES[case]
    # onebit's encoder on the path the dispatcher picks by bucket size; the rest as the suite
    os.environ["GRADCOMP_KERNELS"] = "auto" if case.startswith("onebit") else "cpu"
    net = _net()
    model = DDP(net, bucket_cap_mb=cap)
    opt = (torch.optim.SGD(net.parameters(), **SGD) if opt_name == "sgd"
           else torch.optim.AdamW(net.parameters(), **ADAMW))
    options = {"min_numel": 0}
    if "dense_steps" not in spec:
        options["warmup"] = "none"
    state = gradcomp.register(model, spec, optimizer=opt, **options)
    return net, model, opt, state


def _train(model, opt, state, rank, steps):
    """Train ``steps``; return per step (step, compressing, ratio, sent bytes) of its stats."""
    seen = []
    for step in steps:
        train_steps(model, opt, rank, [step])
        s = state.stats()
        seen.append((step, s["compressing"], s["ratio"], s["sent_bytes"]))
    return seen


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


def _count_paths():
    """Count the 1-bit encoder's calls by the path that ran them."""
    calls = {"compiled": 0, "other": 0}
    stats, fallback = compiled._run, compiled.cpu.onebit_compress

    def run(step, *args):
        calls["compiled"] += step == "stats"
        return stats(step, *args)

    def other(*args):
        calls["other"] += 1
        return fallback(*args)
    compiled._run, compiled.cpu.onebit_compress = run, other
    return calls


def _first(rank, world, path):
    calls = _count_paths()
    out = {}
    for case in CASES:
        job = _job(case, CAP)
        seen = _train(*job[1:], rank, range(STEPS))
        out[case] = {"full": _params(job[0]), "stats": seen}
        job[3].close()
        job = _job(case, OTHER_CAP)
        _train(*job[1:], rank, range(STEPS))
        out[case]["other_cap"] = _params(job[0])
        job[3].close()
        net, model, opt, state = _job(case, CAP)
        _train(model, opt, state, rank, range(CUT))
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                    "gradcomp": state.state_dict()}, f"{path}/{case}-{rank}.pt")
        state.close()
    out["paths"] = dict(calls)
    out["compiler"] = compiled.compiler_missing() is None
    return out


def _second(rank, world, path):
    out = {}
    for case in CASES:
        net, model, opt, state = _job(case, CAP)
        ck = torch.load(f"{path}/{case}-{rank}.pt")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["gradcomp"])
        seen = _train(model, opt, state, rank, range(CUT, STEPS))
        out[case] = {"params": _params(net), "stats": seen, "step": state.step}
        state.close()
    return out


@pytest.fixture(scope="module")
def runs(spawn, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("exact"))
    first = spawn(_first, 2, args=(path,), timeout=600)
    second = spawn(_second, 2, args=(path,), timeout=600)
    return first, second


def _differ(a, b):
    return [f"{i}: max diff {(x - y).abs().max():.3g}" for i, (x, y) in enumerate(zip(a, b))
            if not torch.equal(x, y)]


@pytest.mark.parametrize("case", list(CASES))
def test_resumes_bit_for_bit(case, runs):
    first, second = runs
    rounds = "local_steps" in CASES[case][0]  # the state counts rounds there
    for r in range(2):
        assert second[r][case]["step"] == (STEPS // H if rounds else STEPS)
        assert not _differ(first[r][case]["full"], second[r][case]["params"]), \
            f"{case}, rank {r}: parameters {_differ(first[r][case]['full'], second[r][case]['params'])}"


@pytest.mark.parametrize("case", list(CASES))
def test_bucket_layout_does_not_change_the_result(case, runs):
    first, _ = runs
    for r in range(2):
        assert not _differ(first[r][case]["full"], first[r][case]["other_cap"]), \
            f"{case}, rank {r}: {_differ(first[r][case]['full'], first[r][case]['other_cap'])}"
    if "delay" not in CASES[case][0]:  # delayed: each rank's own last gradient is in
        assert not _differ(first[0][case]["full"], first[1][case]["full"])  # one average


def _exchanged(case, step, start=0):
    """Whether the stats after ``step`` of a job that began at ``start`` show a compressed
    exchange: with ``delay=1`` they show the step before (one of this job's), with local
    steps the round that ended last, with AdamW the steps after the dense ones."""
    spec = CASES[case][0]
    first = {"delay=1": start + 1, "local_steps": H - 1, "dense_steps=2": 2}
    return step >= max([v for k, v in first.items() if k in spec], default=0)


@pytest.mark.parametrize("case", list(CASES))
def test_the_steps_were_compressed(case, runs):
    first, second = runs
    least = CASES[case][2]
    for seen, start in ((first[0][case]["stats"], 0), (second[0][case]["stats"], CUT)):
        seen = [s for s in seen if _exchanged(case, s[0], start)]
        assert seen and all(sent > 0 for *_, sent in seen), (case, seen)
        if case.startswith("allreduce"):  # the control: dense, nothing saved
            assert all(not on and ratio == 1.0 for _, on, ratio, _ in seen), (case, seen)
        else:
            assert all(on and ratio >= least for _, on, ratio, _ in seen), (case, seen)


def test_onebit_ran_on_both_encoder_paths(runs):
    """The layouts above put onebit's chunks through the compiled encoder (large buckets)
    and through the cpu one (small buckets, the parts of the second phase)."""
    first, _ = runs
    if not first[0]["compiler"]:
        pytest.skip(compiled.compiler_missing() or "no C++ compiler")
    assert first[0]["paths"]["compiled"] > 0 and first[0]["paths"]["other"] > 0, first[0]["paths"]
