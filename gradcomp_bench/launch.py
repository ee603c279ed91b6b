"""Run a function on N local ranks (gloo on CPU), with a free port and bounded waits.

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
from multiprocessing.connection import wait as _wait_any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank failed; ``errors`` maps rank -> its traceback text."""

    def __init__(self, msg, errors=None):
        super().__init__(msg)
        self.errors = errors or {}


def failures(errors: dict) -> str:
    """The ranks' error texts, one block per rank, in rank order."""
    return "\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items()))


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
        from gradcomp.hooks.state import _close_all
        _close_all()  # communication threads stop before their process groups go
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (reported to the parent)
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def _wait(procs, outdir: str, timeout: float | None, grace: float):
    """Wait until every process has exited, ``timeout`` seconds have passed (None: no limit),
    or ``grace`` seconds after the first one failed (the others then had their collectives'
    timeout to fail too; one still running is stuck outside a collective). A rank that saved
    its result before a bad exit did not fail. Returns the rank that failed first, or None."""
    start = time.monotonic()
    failed_at, first = None, None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if timeout is not None and now - start >= timeout:
            break
        if first is None:
            bad = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                   and not os.path.exists(os.path.join(outdir, f"rank{r}.pt"))]
            if bad:
                failed_at, first = now, bad[0]
        if failed_at is not None and now - failed_at >= grace:
            break
        _wait_any([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
    return first


def spawn(fn, world: int = 2, args: tuple = (), timeout: float | None = 300, pg_timeout: float = 60,
          addr: str = "127.0.0.1", threads: int | None = None, env: dict | None = None,
          allow_fail: bool = False):
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return their results in rank order.

    ``timeout`` bounds the whole run (None: no limit, for long training jobs). Either way a
    rank that fails ends the run: the others get ``pg_timeout`` (their collectives' timeout)
    plus 10 s to finish or fail, then are killed. With ``allow_fail`` a failed rank gives a
    RankError in its slot instead of raising."""
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_entry, daemon=True,
                             args=(fn, r, world, addr, port, d, args, pg_timeout, threads, env or {}))
                 for r in range(world)]
        for p in procs:
            p.start()
        first_failed = _wait(procs, d, timeout, grace=pg_timeout + 10)
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
            why = (f"{pg_timeout + 10:g}s after rank {first_failed} failed" if first_failed is not None
                   else f"after {timeout}s")
            raise RankError(f"ranks {hung} still running {why}; killed\n" + failures(errors), errors)
        if errors and not allow_fail:
            raise RankError(failures(errors), errors)
        out = []
        for r in range(world):
            path = os.path.join(d, f"rank{r}.pt")
            if os.path.exists(path):
                out.append(torch.load(path, weights_only=False))
            else:
                out.append(RankError(errors.get(r, f"rank {r} hung"), errors))
        return out
