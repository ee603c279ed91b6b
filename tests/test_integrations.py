"""The integrations (gradcomp/integrations/) in the jobs their users write, with the real
packages: Lightning's Trainer, Accelerate, the HF Trainer, each launched by torchrun on 2
CPU ranks (tests/jobs/frameworks.py). Every method, with SGD and with AdamW param groups,
gradient accumulation 2, several DDP buckets: ranks bit-identical, compressing, and a run
resumed from the framework's own checkpoint equal to the straight run bit for bit; resuming
from a checkpoint without gradcomp's state warns and diverges (the control that the state is
what makes it exact). Plus what a single process and bad options get."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "frameworks.py"
sys.path.insert(0, str(JOB.parent))
import frameworks  # noqa: E402
from conftest import torchrun  # noqa: E402


@pytest.mark.parametrize("framework", ["lightning", "accelerate", "hf"])
def test_every_method_trains_ranks_equal_and_resumes_bit_exact(framework, tmp_path):
    pytest.importorskip({"hf": "transformers"}.get(framework, framework))
    torchrun(JOB, framework, tmp_path)
    ranks = [json.loads((tmp_path / f"{framework}-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1], "ranks ended with different parameters"
    res = ranks[0]
    cases = [f"{m}-{k}" for m, k, _ in frameworks.CASES]
    assert sorted(k for k in res if k != "cold") == sorted(cases)
    for case in cases:
        assert res[case]["straight"] == res[case]["resumed"], f"{case}: resume not exact"
        assert res[case]["compressed"] == (not case.startswith("allreduce")), case
        assert res[case]["buckets"] >= 3, case  # bucket indices the state exchanged
    # each method trains differently (compression is applied, not bypassed)
    assert len({res[c]["straight"] for c in cases}) == len(cases)
    if "cold" in res:
        assert res["cold"]["warned"], "resuming without gradcomp's state did not warn"
        assert res["cold"]["digest"] != res["onebit-sgd"]["straight"]


def test_import_gradcomp_imports_no_framework_until_asked():
    code = ("import sys, gradcomp; bad = [m for m in ('lightning', 'pytorch_lightning', "
            "'accelerate', 'transformers', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad; cb = gradcomp.lightning.GradcompCallback; "
            "assert 'lightning' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_bad_options_are_refused_when_the_callback_is_made():
    pytest.importorskip("lightning")
    from gradcomp.integrations.lightning import GradcompCallback
    with pytest.raises(ValueError, match="unknown method 'onebits'"):
        GradcompCallback("onebits")
    with pytest.raises(ValueError, match="unknown option.s. ratioo: allowed adam"):
        GradcompCallback("topk", ratioo=0.1)
    with pytest.raises(ValueError, match="optimizer_index=-1"):
        GradcompCallback("topk", optimizer_index=-1)


def test_a_single_process_warns_and_trains_plain():
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from gradcomp.integrations.lightning import GradcompCallback

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = frameworks.net()

        def training_step(self, b, i):
            return torch.nn.functional.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = GradcompCallback("onebit")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[cb],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    loader = torch.utils.data.DataLoader(frameworks.data(), batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(M(), loader)
    assert cb.state is None
    assert any("not distributed" in str(w.message) for w in caught)
