"""Convergence on real CIFAR-10: every method reaches allreduce's accuracy; removing a
method's safeguard measurably does not.

Setup (chosen to fit the suite's budget of a few minutes on 2 CPU cores): 2 gloo ranks,
the 5085/1017-image CIFAR-10 subset in ../shared, random-crop + flip augmentation, the small
CIFAR ResNet (width 16, 78k parameters), batch 32 per rank, SGD + Nesterov momentum 0.9,
weight decay 5e-4, lr 0.1 with half an epoch of warm-up then cosine, EPOCHS epochs, seed 0
for every run. One run takes ~45 s here; the eight runs share one spawn.

Tolerance: TOLERANCE points of test accuracy below allreduce. On 1017 test images one image
is 0.1 point and the binomial standard error at ~45% accuracy is ~1.6 points; runs of the
same method with different seeds spread by about that much, so 3 points is ~2 standard
errors of one comparison: a real loss of accuracy fails it, seed noise does not.

DGC runs at ratio 0.01 with 100 warm-up steps; 1-bit SGD compresses every tensor
(min_numel=0: with the default, most of this small model's tensors would go uncompressed)
and sends its first 80 steps (a quarter of the run) uncompressed, as 1-bit Adam warms up.

Ablations (each: removing the safeguard loses more than TOLERANCE against both the
safeguarded method and allreduce):
  * sparsification at 99.9% (ratio 0.001) without any of DGC's safeguards (no accumulation
    of what was not sent, no momentum correction, no warm-up: top-k with
    error_feedback=false, momentum left in the optimizer), against DGC at the same 99.9%;
  * 1-bit SGD without its warm-up, against 1-bit with it.
Measured here and not asserted (within noise at this budget; bench/RESULTS.md): 1-bit
without error feedback ends about where 1-bit with it does (39.1% against 38.6%, both
without warm-up): in a run this short the warm-up matters, error feedback does not.
"""
import pytest

from gradcomp import data
from gradcomp.launch import spawn
from gradcomp.train import train

EPOCHS = 4
TOLERANCE = 3.0
CHANCE = 10.0

# Measured at this budget on 2 CPU cores (allreduce 43.8%; bench/RESULTS.md, section 4):
#   dgc 44.9, terngrad 45.4 (with error feedback: 44.8), powersgd rank 4 43.4 (rank 2: 43.8),
#   onebit with warm-up 42.3;
#   ablations: top-k at 0.001 without safeguards 39.9 (DGC at 0.001: 45.3), onebit without
#   warm-up 38.6.
METHODS = {
    "dgc": "dgc:ratio=0.01,warmup_steps=100",
    "terngrad": "terngrad",
    "powersgd": "powersgd:rank=4",
    "onebit": "onebit:min_numel=0,dense_steps=80",
}
ABLATIONS = {  # name: (ablated spec, spec with the safeguard, at the same compression)
    "sparse-without-safeguards": ("topk:ratio=0.001,error_feedback=false",
                                  "dgc:ratio=0.001,warmup_steps=200"),
    "onebit-without-warm-up": ("onebit:min_numel=0", "onebit:min_numel=0,dense_steps=80"),
}


def _accuracies(rank, world, specs):
    return {s: 100 * train(rank, world, dict(method=s, epochs=EPOCHS))["test_acc"] for s in specs}


@pytest.fixture(scope="module")
def acc():
    if data.resolve(None) is None:
        pytest.skip("needs ../shared CIFAR-10 data")
    specs = ["allreduce", *METHODS.values()]
    for a, b in ABLATIONS.values():
        specs += [s for s in (a, b) if s not in specs]
    got = spawn(_accuracies, 2, args=(specs,), timeout=1800)[0]
    print("test accuracy %:", {s: round(a, 2) for s, a in got.items()})  # shown with -rP
    return got


def test_allreduce_learns(acc):
    assert acc["allreduce"] > 3 * CHANCE


@pytest.mark.parametrize("name", list(METHODS))
def test_method_reaches_allreduce_accuracy(acc, name):
    got, ref = acc[METHODS[name]], acc["allreduce"]
    assert got >= ref - TOLERANCE, f"{name}: {got:.1f}% vs allreduce {ref:.1f}%"
    assert got > 3 * CHANCE


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_removing_the_safeguard_loses_accuracy(acc, name):
    ablated, guarded = (acc[s] for s in ABLATIONS[name])
    assert ablated < guarded - TOLERANCE, f"{name}: {ablated:.1f}% vs {guarded:.1f}% with it"
    assert ablated < acc["allreduce"] - TOLERANCE
