"""Jobs written as a framework's user writes them, launched by tests/test_integrations.py
under torchrun (2 ranks, gloo, CPU):  python -m torch.distributed.run --nproc-per-node 2
tests/jobs/frameworks.py FRAMEWORK OUT_DIR.

For every case (a method and an optimizer) each job trains three times in the same
processes: straight through 2 epochs; 1 epoch, saved with the framework's own checkpoint;
resumed from it for the second epoch with a fresh gradcomp state. Each rank writes, per case,
the SHA-256 of its parameters after the straight and the resumed run, and whether gradcomp
compressed: the test asserts that ranks agree and that the resumed run equals the straight
one bit for bit. ``BUCKET_MB`` makes DDP cut the model into several buckets."""
import hashlib
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import gradcomp

EPOCH = 4  # optimizer steps per epoch (with accumulation 2: 8 micro-batches)
ACCUM = 2
BATCH = 8
# every method, compressing from the first step (min_numel below the layers' sizes); AdamW
# cases take 2 dense steps (Adam's variance is learned dense, then frozen)
CASES = [(m, "sgd", {"warmup": "none"}) for m in
         ("allreduce", "onebit", "topk", "dgc", "terngrad", "powersgd", "threshold")] + [
    (m, "adamw", {"dense_steps": 2}) for m in ("onebit", "topk", "terngrad", "powersgd")]
COMMON = {"min_numel": 64}
BUCKET_MB = 0.0004  # 419 bytes: each layer's weight and bias in a bucket of their own


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def data(n=EPOCH * ACCUM * BATCH * 2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4] * 3).argmax(1))


def optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=3e-3,
                             betas=(0.9, 0.95))


def digest(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def compressed(state) -> bool:
    """Whether the latest step went compressed (fewer bytes than the raw gradients)."""
    if state is None:
        return False
    s = state.stats()
    return bool(s["compressing"]) and s["sent_bytes"] < s["raw_bytes"]


def buckets(state) -> int:
    """How many DDP buckets the state exchanged."""
    return len(state._state.layouts) if state is not None else 0


def every_case(pair) -> dict:
    """Each case of CASES through ``pair(spec, kind, options, name)`` -> (the straight run's
    module, its gradcomp state, the resumed run's module)."""
    results = {}
    for spec, kind, options in CASES:
        straight, state, resumed = pair(spec, kind, {**COMMON, **options}, f"{spec}-{kind}")
        results[f"{spec}-{kind}"] = {"straight": digest(straight), "resumed": digest(resumed),
                                     "compressed": compressed(state), "buckets": buckets(state)}
    return results


# ----------------------------------------------------------------------------- Lightning
def lightning_job(out):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from gradcomp.integrations.lightning import GradcompCallback

    class Module(pl.LightningModule):
        def __init__(self, kind):
            super().__init__()
            self.net, self.kind = net(), kind

        def training_step(self, b, i):
            x, y = b
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return optimizer(self.kind, list(self.net.parameters()))

    def fit(spec, kind, options, epochs, save=None, resume=None):
        mod = Module(kind)
        cb = GradcompCallback(spec, **options)
        trainer = pl.Trainer(accelerator="cpu", devices=2,
                             strategy=DDPStrategy(bucket_cap_mb=BUCKET_MB), max_epochs=epochs,
                             accumulate_grad_batches=ACCUM, callbacks=[cb], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, use_distributed_sampler=True)
        loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=False)
        trainer.fit(mod, loader, ckpt_path=resume)
        if save:
            trainer.save_checkpoint(save)
        return mod, cb

    def pair(spec, kind, options, name):
        straight, cb = fit(spec, kind, options, 2)
        path = os.path.join(out, f"lightning-{name}.ckpt")
        fit(spec, kind, options, 1, save=path)
        return straight, cb.state, fit(spec, kind, options, 2, resume=path)[0]

    results = every_case(pair)
    # control: the same checkpoint without gradcomp's state resumes differently, with a warning
    ck = torch.load(os.path.join(out, "lightning-onebit-sgd.ckpt"), weights_only=False)
    ck["callbacks"] = {k: v for k, v in ck["callbacks"].items() if "Gradcomp" not in k}
    cold = os.path.join(out, "lightning-cold.ckpt")
    if dist.get_rank() == 0:
        torch.save(ck, cold)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, _ = fit("onebit", "sgd", {**COMMON, **CASES[1][2]}, 2, resume=cold)
    results["cold"] = {"digest": digest(resumed), "warned": any(
        "fresh state" in str(w.message) for w in caught)}
    return results


# ----------------------------------------------------------------------------- Accelerate
def accelerate_job(out):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from gradcomp.integrations.accelerate import register

    def train(spec, kind, options, epochs, save=None, resume=None):
        acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, kwargs_handlers=[
            DistributedDataParallelKwargs(bucket_cap_mb=BUCKET_MB)])
        model = net()
        opt = optimizer(kind, list(model.parameters()))
        loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=False)
        model, opt, loader = acc.prepare(model, opt, loader)
        state = register(acc, model, spec, optimizer=opt, **options)
        first = 0
        if resume:
            acc.load_state(resume)
            first = 1
        for _ in range(first, epochs):
            for x, y in loader:
                with acc.accumulate(model):
                    acc.backward(nn.functional.cross_entropy(model(x), y))
                    opt.step()
                    opt.zero_grad()
        if save:
            acc.save_state(save)
        return acc.unwrap_model(model), state

    def pair(spec, kind, options, name):
        straight, state = train(spec, kind, options, 2)
        path = os.path.join(out, f"accelerate-{name}")
        train(spec, kind, options, 1, save=path)
        return straight, state, train(spec, kind, options, 2, resume=path)[0]

    return every_case(pair)


# ----------------------------------------------------------------------------- HF Trainer
def hf_job(out):
    from transformers import Trainer, TrainingArguments

    from gradcomp.integrations.hf import register

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net()

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    ds = data()
    rows = [{"x": ds[i][0], "labels": ds[i][1]} for i in range(len(ds))]

    def train(spec, kind, options, folder, resume=None):
        model = Model()
        args = TrainingArguments(
            output_dir=folder, per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=ACCUM, num_train_epochs=2, save_strategy="epoch",
            report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True, seed=0,
            dataloader_num_workers=0, lr_scheduler_type="constant", ddp_bucket_cap_mb=BUCKET_MB)
        opt = optimizer(kind, list(model.parameters()))
        trainer = Trainer(model=model, args=args, train_dataset=rows, optimizers=(opt, None))
        cb = register(trainer, spec, **options)
        trainer.train(resume_from_checkpoint=resume)
        return model, cb.state

    def pair(spec, kind, options, name):
        folder = os.path.join(out, f"hf-{name}")
        straight, state = train(spec, kind, options, folder)
        first = os.path.join(folder, f"checkpoint-{EPOCH}")
        return straight, state, train(spec, kind, options, folder + "-resumed", resume=first)[0]

    results = every_case(pair)
    # control: the same checkpoint without gradcomp's state resumes differently, with a warning
    first = os.path.join(out, "hf-onebit-sgd", f"checkpoint-{EPOCH}")
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(first, "gradcomp.pt"))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, _ = train("onebit", "sgd", {**COMMON, **CASES[1][2]},
                           os.path.join(out, "hf-cold"), resume=first)
    results["cold"] = {"digest": digest(resumed), "warned": any(
        "fresh state" in str(w.message) for w in caught)}
    return results


JOBS = {"lightning": lightning_job, "accelerate": accelerate_job, "hf": hf_job}

if __name__ == "__main__":
    framework, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    results = JOBS[framework](out)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    with open(os.path.join(out, f"{framework}-rank{rank}.json"), "w") as f:
        json.dump(results, f)
