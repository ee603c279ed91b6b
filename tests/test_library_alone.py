"""The library installs and works with torch and numpy alone: ``pip install gradcomp``.

A fresh interpreter refuses to import Triton, matplotlib, tqdm, TensorBoard, Pillow, the
training frameworks of gradcomp.integrations (Lightning, Accelerate, transformers) and the
benchmark harness, then imports gradcomp, registers every method on a one-rank gloo DDP
model and takes a training step with each.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
BLOCKED = ("triton", "matplotlib", "tqdm", "tensorboard", "PIL", "gradcomp_bench", "lightning",
           "pytorch_lightning", "accelerate", "transformers")

SCRIPT = textwrap.dedent("""
    import importlib.machinery, json, os, sys, tempfile
    BLOCKED = set(sys.argv[1].split(","))

    class Blind:
        # one of sys.meta_path's finders (sys.path's, an editable install's), blind to the
        # blocked packages: they look not installed, to imports and to find_spec probes alike
        def __init__(self, finder):
            self.finder = finder

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED or not hasattr(self.finder, "find_spec"):
                return None
            return self.finder.find_spec(name, path, target)

        def __getattr__(self, attr):
            return getattr(self.finder, attr)

    sys.meta_path = [Blind(f) for f in sys.meta_path]
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import gradcomp

    try:
        import gradcomp_bench  # noqa: F401
        blocker_works = False
    except ImportError:
        blocker_works = True
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method="file://" + tempfile.mktemp(prefix="gradcomp-alone-"))
    out = {"blocker_works": blocker_works, "methods": {}}
    for name in sorted(gradcomp.METHODS):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = gradcomp.register(model, name, optimizer=opt, min_numel=0, warmup="none")
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        before = [p.detach().clone() for p in net.parameters()]
        for _ in range(state.config.local_steps):  # one round: a local-steps method sends then
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        state.flush() if hasattr(state, "flush") else None
        stats = state.stats()
        out["methods"][name] = {
            "sent_bytes": stats["sent_bytes"], "raw_bytes": stats["raw_bytes"],
            "moved": any(not torch.equal(a, p) for a, p in zip(before, net.parameters())),
            "finite": all(bool(p.isfinite().all()) for p in net.parameters())}
        state.close()
    dist.destroy_process_group()
    out["loaded"] = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    print("RESULT " + json.dumps(out))
""")


def test_library_registers_and_trains_with_torch_and_numpy_alone():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for var in ("TRITON_INTERPRET", "GRADCOMP_KERNELS"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(BLOCKED)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["blocker_works"], "the import blocker let gradcomp_bench through"
    assert out["loaded"] == []
    import gradcomp
    assert set(out["methods"]) == set(gradcomp.METHODS)
    for name, m in out["methods"].items():
        assert m["sent_bytes"] > 0, name    # the hook ran and exchanged something
        assert m["moved"] and m["finite"], (name, m)
        if name != "allreduce":
            assert m["sent_bytes"] < m["raw_bytes"], (name, m)   # and it compressed


def test_library_never_imports_the_harness():
    # imports go one way: the harness imports the library, never the reverse
    lib = ROOT / "gradcomp"
    offenders = [str(p.relative_to(ROOT)) for p in lib.rglob("*.py")
                 if "gradcomp_bench" in p.read_text()]
    assert offenders == []
