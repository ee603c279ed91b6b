"""examples/ run as their docstrings say (torchrun, 2 CPU ranks, a few steps): each ends
with its ranks' parameters equal, and the multi-node command joins two "nodes" (two torchrun
launchers on this machine)."""
import os
import subprocess
import time

import pytest

from conftest import ROOT, free_port, torchrun

EX = os.path.join(ROOT, "examples")


@pytest.mark.parametrize("script,args,nproc,needs", [
    ("ddp.py", ["--method", "onebit", "--steps", "6"], 2, None),
    ("fsdp2.py", ["--method", "terngrad", "--steps", "4", "--ranks-per-node", "2"], 4, None),
    ("lightning_ddp.py", ["--method", "topk", "--steps", "6"], 2, "lightning"),
    ("accelerate_ddp.py", ["--method", "dgc", "--steps", "6", "--save", "{tmp}/acc"], 2,
     "accelerate"),
    ("hf_trainer.py", ["--method", "terngrad", "--steps", "6", "--out", "{tmp}/hf"], 2,
     "transformers"),
])
def test_example_runs_and_its_ranks_agree(script, args, nproc, needs, tmp_path):
    if needs:
        pytest.importorskip(needs)
    run = torchrun(os.path.join(EX, script), *(a.format(tmp=tmp_path) for a in args),
                   nproc=nproc, timeout=300)
    assert "ranks agree: True" in run.stdout, run.stdout[-2000:]
    if script == "accelerate_ddp.py":  # gradcomp's state is among accelerate's files
        assert (tmp_path / "acc" / "custom_checkpoint_0.pkl").is_file()
    if script == "hf_trainer.py":
        assert (tmp_path / "hf" / "checkpoint-6" / "gradcomp.pt").is_file()


def test_multinode_command_joins_two_nodes(tmp_path):
    port = free_port()
    env = {**os.environ, "NNODES": "2", "MASTER": f"127.0.0.1:{port}", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    cmd = ["bash", os.path.join(EX, "multinode.sh"), "--method", "onebit", "--steps", "4"]
    # each node writes to a file, not a pipe: a pipe read only after the other node's end
    # can fill (64 KB of launcher logs) and block that node before torchrun's exit barrier,
    # which node 0 (the store's host) then waits on
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    files = [open(f, "w") for f in logs]
    nodes = [subprocess.Popen(cmd, env={**env, "NODE_RANK": str(i)}, cwd=ROOT,
                              stdout=files[i], stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)]
    deadline = time.monotonic() + 240
    try:
        for p in nodes:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # reported below with both nodes' logs
    finally:
        for p, f in zip(nodes, files):
            p.kill()
            p.wait()
            f.close()
    outs = [f.read_text() for f in logs]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-2000:] for o in outs)
    assert "ranks agree: True" in outs[0], outs[0][-2000:]
