"""Run a function on N local ranks (gloo on CPU), with a free port and a hard deadline.

Used by the tests and the benchmark CLI. A rank that raises, dies or overruns the deadline
makes ``spawn`` raise in the parent; the other ranks are killed, so nothing hangs.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank failed; ``errors`` maps rank -> its traceback text."""

    def __init__(self, msg, errors=None):
        super().__init__(msg)
        self.errors = errors or {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, addr, port, outdir, args, pg_timeout, threads, env):
    os.environ.update(env)
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        from .hooks.state import _close_all
        _close_all()  # communication threads stop before their process groups go
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (reported to the parent)
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def spawn(fn, world: int = 2, args: tuple = (), timeout: float = 300, pg_timeout: float = 60,
          addr: str = "127.0.0.1", threads: int | None = None, env: dict | None = None,
          allow_fail: bool = False):
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return their results in rank order.

    With ``allow_fail`` a failed rank gives a RankError in its slot instead of raising."""
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_entry, daemon=True,
                             args=(fn, r, world, addr, port, d, args, pg_timeout, threads, env or {}))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {}
        for r in range(world):
            path = os.path.join(d, f"rank{r}.err")
            if os.path.exists(path):
                errors[r] = open(path).read()
            elif procs[r].exitcode != 0 and r not in hung:
                if os.path.exists(os.path.join(d, f"rank{r}.pt")):
                    # the rank finished and saved its result, then died tearing down (seen
                    # once in ~50 runs: gloo aborting at exit); the result stands, loudly
                    warnings.warn(f"rank {r} exited with code {procs[r].exitcode} after "
                                  f"saving its result", RuntimeWarning)
                else:
                    errors[r] = f"rank {r} exited with code {procs[r].exitcode}"
        if hung and not allow_fail:
            raise RankError(f"ranks {hung} still running after {timeout}s; killed", errors)
        if errors and not allow_fail:
            text = "\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items()))
            raise RankError(text, errors)
        out = []
        for r in range(world):
            path = os.path.join(d, f"rank{r}.pt")
            if os.path.exists(path):
                out.append(torch.load(path, weights_only=False))
            else:
                out.append(RankError(errors.get(r, f"rank {r} hung"), errors))
        return out
