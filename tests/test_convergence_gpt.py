"""AdamW on a transformer: the adam-aware default holds where Adam on compressed gradients
does not. A 0.1M-parameter GPT (gradcomp_bench.models.gpt_tiny) on the pycode character
corpus, 2 gloo ranks, AdamW (betas 0.9/0.95, decay 0.1 on matrices), warm-up + cosine,
clipping at 1, 300 steps, onebit at its defaults (the adaptive warm-up in int4 rows, then
Adam's second moment frozen and its first moment exchanged with 1-bit compression, chunks of
64 with bf16 scales: hooks/optimizer/) against allreduce and against the ablation
``adam=off``.

Margins from three seeds (validation loss, nats per character; seeds 0 / 1 / 2):
  allreduce                  2.2311 / 2.2352 / 2.2126
  onebit (default with AdamW: chunk=64, scales=bfloat16, dense_wire=int4)
                             2.2183 / 2.2383 / 2.2298   (-0.013 / +0.003 / +0.017 over allreduce)
  onebit, chunk=64 with fp32 scales and the warm-up in bf16 (the former default)
                             2.2344 / 2.2414 / 2.2193
  with the former default's scales and warm-up:
  onebit, adam=freeze        2.2385 / 2.2361 / 2.2482   (the gradient exchanged instead)
  onebit, chunk=256          2.2515 / 2.2478 / 2.2211   (the SGD default's chunk; with the warm-up
                                                          in fp32: 2.2515 / 2.2491 / 2.2229)
  onebit, adam=off           2.2714 / 2.2642 / 2.2867   (+0.053 / +0.026 / +0.057 over the default)
  terngrad (default)         2.2060 / 2.2160 / 2.1988   (-0.025 / -0.019 / -0.014 against allreduce)
The test takes seeds 0 and 1 and asks, on their mean, onebit within 0.03 of allreduce, the
ablation at least 0.01 above onebit, and terngrad within 0.02 of allreduce. (At 300 steps
on this model the two exchanges are within noise of each other; the 2000-step GPT separates
them: bench/RESULTS.md, "Accuracy with AdamW".)
"""
import functools

import pytest

from gradcomp_bench.bench import run_train
from gradcomp_bench.train import TrainConfig


@pytest.fixture(scope="module")
def corpus():
    from gradcomp_bench import data
    import os
    for p in data.text_dirs():
        if p.is_file():
            return str(p)
    if os.environ.get("GRADCOMP_REQUIRE_DATA") == "1":
        pytest.fail("GRADCOMP_REQUIRE_DATA=1 but no pycode corpus in any of: "
                    + ", ".join(map(str, data.text_dirs())))
    pytest.skip("needs ../shared/data/pycode/pycode.txt")


@functools.lru_cache(maxsize=None)  # allreduce's runs serve every test of the module
def _val(corpus, method, seed):
    cfg = TrainConfig(method=method, model="gpt_tiny", data=corpus, max_steps=300, batch=8,
                      seq_len=32, lr=3e-3, weight_decay=0.1, seed=seed)
    return run_train(2, cfg, timeout=300)[0]


def test_adamw_gpt_terngrad_and_onebit_hold_and_the_ablation_does_not(corpus):
    runs = {m: [_val(corpus, m, s) for s in (0, 1)]
            for m in ("allreduce", "onebit", "onebit:adam=off", "terngrad")}
    mean = {m: sum(r["val_loss"] for r in rs) / len(rs) for m, rs in runs.items()}
    assert mean["onebit"] - mean["allreduce"] < 0.03, mean
    assert mean["onebit:adam=off"] - mean["onebit"] > 0.01, mean
    assert mean["terngrad"] - mean["allreduce"] < 0.02, mean
    for r in runs["onebit"]:  # compressed after the adaptive warm-up
        assert r["stats"]["compressing"] and r["stats"]["warmup_switch_step"] >= 100


def test_hsdp_gpt_terngrad_holds(corpus):
    """The same recipe under HSDP (2 nodes x 2 ranks, fully_shard on a 2-D mesh; batch 4 per
    rank, the same 16 sequences per step): terngrad on the cross-node all-reduce of each shard
    within 0.02 of plain allreduce. Measured (seeds 0 / 1): allreduce 2.2372 / 2.2252,
    terngrad 2.2322 / 2.2110, onebit 2.2645 / 2.2406 (at its AdamW defaults)."""
    def val(method):
        cfg = TrainConfig(method=method, model="gpt_tiny", data=corpus, max_steps=300, batch=4,
                          seq_len=32, lr=3e-3, weight_decay=0.1, seed=0, parallel="hsdp",
                          ranks_per_node=2)
        return run_train(4, cfg, timeout=600)[0]
    base, tern = val("allreduce"), val("terngrad")
    assert tern["val_loss"] - base["val_loss"] < 0.02, (tern["val_loss"], base["val_loss"])
    assert tern["stats"]["compressing"] and tern["stats"]["ratio"] > 4, tern["stats"]


# The local-steps methods at their defaults on the same recipe (300 steps; seeds 0 / 1 / 2):
#   sparseloco  2.2787 / 2.2638 (seeds 0 / 1; +0.048 / +0.029 over allreduce); its rounds
#               sent 45x fewer bytes than their dense size (run_ratio), once every 4 steps
#               (every parameter of 64 elements or more in rows of 12-bit places: with
#               the biases and norms sent dense, 22x). Fewer bytes a round lose here (means
#               of seeds 0 and 1): 8 steps a round 2.3247, and with the outer step that
#               holds them on the 2000-step GPT (2.5) 2.3978; k = 64 2.3306; 6 steps with
#               k = 96 2.3429
#   diloco      2.2637 / 2.2521 / 2.2754  (+0.033 / +0.017 / +0.063): with AdamW its first 100
#               steps synchronous in int4 rows, then DiLoCo's outer step (0.7, Nesterov 0.9)
#               every 16 steps, 3 bits per value, each rank's Adam its own. Without the
#               synchronous start 2.4582 / 2.4162 (seeds 0 / 1), with 50 steps 2.2948 / 2.2963,
#               with 50 and Adam's second moment frozen after them 2.4065 / 2.4142; 8 steps a
#               round after 50: 2.3163 / 2.3017. (The former default, 200 synchronous steps
#               then rounds of 2 with the second moment frozen: 2.2246 / 2.2401 / 2.2230, at
#               5.5x fewer bytes where this one saves 20x.) Plain averaging every
#               4 steps loses 0.12 to 0.18 nats here, and sparseloco's top-k with error
#               feedback does better than it
# The test takes seeds 0 and 1 and asks, on their mean, sparseloco within 0.08 of allreduce
# with its rounds compressed at least 30x, and diloco within 0.03, at least 4x over the run.
HOLDS = {"sparseloco": (0.08, 30), "diloco": (0.03, 4)}


@pytest.mark.parametrize("method", sorted(HOLDS))
def test_adamw_gpt_local_steps_methods_hold_in_one_line(corpus, method):
    margin, least = HOLDS[method]
    base = [_val(corpus, "allreduce", s) for s in (0, 1)]
    got = [_val(corpus, method, s) for s in (0, 1)]
    mean = lambda rs: sum(r["val_loss"] for r in rs) / len(rs)  # noqa: E731
    assert mean(got) - mean(base) < margin, (mean(got), mean(base))
    for r in got:  # the rounds compressed from the first one (diloco: after its sync steps)
        assert r["stats"]["run_ratio"] > least and r["stats"]["compressing"], r["stats"]
