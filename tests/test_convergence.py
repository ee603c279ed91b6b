"""Convergence on real CIFAR-10: every method reaches allreduce's accuracy; removing a
method's safeguard measurably does not.

Setup (chosen to fit the suite's budget of a few minutes on 2 CPU cores): 2 gloo ranks,
the 5085/1017-image CIFAR-10 subset in ../shared, random-crop + flip augmentation, the small
CIFAR ResNet (width 16, 78k parameters), batch 32 per rank, SGD + Nesterov momentum 0.9,
weight decay 5e-4, lr 0.1 with half an epoch of warm-up then cosine, EPOCHS epochs, seed 0
for every run. One run takes ~45 s here; the eight runs share one spawn.

DGC runs at ratio 0.01 with 100 warm-up steps; 1-bit SGD compresses every tensor
(min_numel=0) and sends its first 80 steps (a quarter of the run) uncompressed. Ablations:
sparsification at 99.9% without any of DGC's safeguards (top-k with error_feedback=false,
momentum left in the optimizer, no warm-up) against DGC at the same 99.9%; 1-bit SGD
without its warm-up against 1-bit with it.

What is asserted, and why it holds on any machine. CPU runs are deterministic on one
machine, not across machines: another machine's float rounding sends each run down another
trajectory, as another seed does. So every threshold below was set from three seeds
(bench/RESULTS.md, section 4, "convergence test spread"), and compares *test loss*, not
accuracy: on 1017 test images accuracy is binary per image and spreads by ~2-5 points
between seeds for the same method (1-bit with its warm-up: 44.6%, 39.8% against allreduce's
46.2%, 44.4% at seeds 1 and 2), while the test loss of a method relative to allreduce
spreads by a few hundredths:

  * a method at its test setting: test loss at most LOSS_TOLERANCE (0.10) above allreduce's;
    measured over seeds 0-2: dgc -0.04..0.00, terngrad -0.05..0.00, powersgd rank 4
    0.00..+0.03, onebit with warm-up +0.04..+0.07; the ablations below, which lose 4-8
    points of accuracy, are +0.06..+0.16 above allreduce;
  * an ablation: test loss at least ABLATION_GAP (0.03) above the safeguarded method's and
    above allreduce's; measured: top-k without DGC's safeguards +0.08..+0.12 over DGC at
    the same 99.9% (+0.06..+0.15 over allreduce), 1-bit without its warm-up +0.06..+0.09
    over 1-bit with it (+0.10..+0.16 over allreduce).
Accuracy is asserted only far from noise: every method learns (> 3x chance).
"""
import pytest

from gradcomp_bench.train import train

EPOCHS = 4
LOSS_TOLERANCE = 0.10
ABLATION_GAP = 0.03
CHANCE = 10.0

# warmup=none: these margins were measured without the adaptive warm-up (now the default)
METHODS = {
    "dgc": "dgc:ratio=0.01,warmup_steps=100,warmup=none",
    "terngrad": "terngrad:warmup=none",
    "powersgd": "powersgd:warmup=none",  # rank 4, its default
    "onebit": "onebit:min_numel=0,dense_steps=80",
}
ABLATIONS = {  # name: (ablated spec, spec with the safeguard, at the same compression)
    "sparse-without-safeguards": ("topk:ratio=0.001,error_feedback=false,warmup=none",
                                  "dgc:ratio=0.001,warmup_steps=200,warmup=none"),
    "onebit-without-warm-up": ("onebit:min_numel=0,warmup=none",
                               "onebit:min_numel=0,dense_steps=80"),
}


def _results(rank, world, specs):
    out = {}
    for s in specs:
        r = train(rank, world, dict(method=s, epochs=EPOCHS))
        out[s] = {"acc": 100 * r["test_acc"], "loss": r["test_loss"]}
    return out


@pytest.fixture(scope="module")
def res(cifar, spawn):
    specs = ["allreduce", *METHODS.values()]
    for a, b in ABLATIONS.values():
        specs += [s for s in (a, b) if s not in specs]
    got = spawn(_results, 2, args=(specs,), timeout=1800)[0]
    print("test accuracy %, test loss:",
          {s: (round(r["acc"], 2), round(r["loss"], 4)) for s, r in got.items()})  # -rP
    return got


def test_allreduce_learns(res):
    assert res["allreduce"]["acc"] > 3 * CHANCE


@pytest.mark.parametrize("name", list(METHODS))
def test_method_reaches_allreduce(res, name):
    got, ref = res[METHODS[name]], res["allreduce"]
    assert got["loss"] <= ref["loss"] + LOSS_TOLERANCE, \
        f"{name}: test loss {got['loss']:.3f} vs allreduce {ref['loss']:.3f}"
    assert got["acc"] > 3 * CHANCE


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_removing_the_safeguard_loses_accuracy(res, name):
    ablated, guarded = (res[s] for s in ABLATIONS[name])
    assert ablated["loss"] >= guarded["loss"] + ABLATION_GAP, \
        f"{name}: test loss {ablated['loss']:.3f} vs {guarded['loss']:.3f} with it"
    assert ablated["loss"] >= res["allreduce"]["loss"] + ABLATION_GAP


# ----------------------------------------------------------------- DGC under OneCycleLR
# The accuracy issue's recipe, shortened to fit the suite: ResNet-18 at width 16 (every
# convolution compressed), batch 64 per rank, torch's OneCycleLR created after register
# (it writes a momentum into every param group at every step), 3 epochs. DGC compresses
# from the first step (warmup=none) at its default ratio 0.001. With its momentum applied
# twice (the hook's and the scheduler's, before the hook read it from the optimizer) this
# run diverged to chance (10.5% at 12 epochs); measured at seed 0: allreduce 42.5% (test loss
# 1.53), dgc 39.5% (1.60).
ONECYCLE = ("allreduce", "dgc:warmup=none")


def _onecycle(rank, world):
    out = {}
    for s in ONECYCLE:
        r = train(rank, world, dict(method=s, model="resnet18_narrow", schedule="onecycle",
                                    batch=64, lr=0.05, epochs=3))
        out[s] = {"acc": 100 * r["test_acc"], "loss": r["test_loss"]}
    return out


def test_dgc_learns_under_onecycle_lr(cifar, spawn):
    got = spawn(_onecycle, 2, timeout=1800)[0]
    print("OneCycleLR, test accuracy %, test loss:", got)  # -rP
    ref, dgc = got["allreduce"], got["dgc:warmup=none"]
    assert dgc["acc"] > 2.5 * CHANCE, got
    assert dgc["loss"] <= ref["loss"] + 0.25, got
