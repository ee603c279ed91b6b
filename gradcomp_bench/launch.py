"""Run a function on N local ranks (gloo on CPU), with a free port and bounded waits: the one
launcher of the tests and the benchmarks.

Ranks are ``torch.multiprocessing`` processes, or with ``link`` (a :class:`.netlink.Link`)
processes started inside the link's network namespaces, one namespace per node. A rank that
raises, dies or overruns the deadline makes ``spawn`` raise in the parent; the other ranks
are killed, so nothing hangs.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import subprocess
import sys
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


def _entry(fn, rank, world, addr, port, outdir, args, pg_timeout, threads, env, parent=None):
    """One rank: join the gloo group, run ``fn``, save its result (or the traceback).
    ``parent``: (pid, environment) of the caller at spawn time, for a rank forked by the fork
    server, whose environment and standard output are the server's (from its start): the
    rank takes the caller's environment and writes where the caller's stdout and stderr go
    now (under pytest, the running test's capture), as a spawned rank would."""
    if parent is not None:
        pid, base_env = parent
        os.environ.clear()
        os.environ.update(base_env)
        for fd in (1, 2):
            try:  # Linux: the caller's open file, pipe or terminal, appended to
                target = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
            except OSError:
                continue
            sys.stdout.flush() if fd == 1 else sys.stderr.flush()
            os.dup2(target, fd)
            os.close(target)
    os.environ.update(env)
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    try:  # teardown: the result is saved and stands whatever happens here
        from gradcomp.hooks.state import _close_all
        _close_all()  # communication threads stop before their process groups go
        # no rank tears its connections down while a peer still finishes its last
        # collective (gloo aborts the peer when a connection closes under it); a peer that
        # failed breaks the barrier instead, which is its own error to report
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        os._exit(0)


_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "gradcomp", "gradcomp_bench.launch"]
# variables read when a process starts or imports torch (allocator, OpenMP/MKL threads,
# torch's debug and log levels, Python's own): a forked rank would keep the fork server's.
# Not TORCHINDUCTOR_* (torch.compile sets its cache directory in the caller's environment,
# and the ranks import Inductor themselves, after taking the caller's environment)
_AT_START = ("OMP_", "KMP_", "MKL_", "GOMP_", "MALLOC_", "LD_", "PYTHON", "TORCH_", "TRITON_",
             "CUDA_")
_server_env: dict | None = None  # what the fork server started with (read at start)


def _start_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_AT_START)}


def _context(envs):
    """Where the ranks come from: a fork server that imported torch and gradcomp once (a rank
    then starts in a fraction of a second, not the seconds of a fresh interpreter importing
    torch), or fresh interpreters (``spawn``): with ``GRADCOMP_SPAWN=spawn``, and for a call
    whose ranks' start-time variables (:data:`_AT_START`: the caller's environment with each
    rank's ``env``) differ from those the server started with."""
    global _server_env
    how = os.environ.get("GRADCOMP_SPAWN", "forkserver")
    if how not in ("forkserver", "spawn"):
        raise ValueError(f"GRADCOMP_SPAWN={how!r}: expected 'forkserver' or 'spawn'")
    if how == "forkserver":
        # a server not yet started starts with this call, with the caller's environment
        server = _start_env(os.environ) if _server_env is None else _server_env
        if all(_start_env({**os.environ, **e}) == server for e in envs):
            _server_env = server
        else:
            how = "spawn"
    ctx = mp.get_context(how)
    if how == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _link_main(job_path: str, rank: int) -> None:
    """Entry of one rank inside a link's namespace (``python -m gradcomp_bench.launch``)."""
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    sys.path[:] = job["sys_path"]  # as multiprocessing's spawn does: fn unpickles by name
    fn, args = pickle.loads(job["call"])
    env = dict(job["env"][rank])
    env.setdefault("GLOO_SOCKET_IFNAME", _ifname(job["node_addrs"][rank]))
    _entry(fn, rank, job["world"], job["addr"], job["port"], job["outdir"], args,
           job["pg_timeout"], job["threads"], env)


def _ifname(addr: str) -> str:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == addr:
            return parts[1].split("@")[0]
    raise RuntimeError(f"no interface holds {addr} in this namespace")


class _LinkRank:
    """A rank started in a namespace, seen through multiprocessing.Process's interface."""

    def __init__(self, argv, log_path):
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)

    def is_alive(self):
        return self.p.poll() is None

    @property
    def exitcode(self):
        return self.p.poll()

    def kill(self):
        self.p.kill()

    def join(self):
        self.p.wait()


def _start_in_link(fn, world, args, link, per_node, d, port, pg_timeout, threads, envs):
    job = os.path.join(d, "job.pkl")
    with open(job, "wb") as f:
        pickle.dump({"call": pickle.dumps((fn, args)), "sys_path": list(sys.path),
                     "world": world, "addr": link.addrs[0], "port": port, "outdir": d,
                     "pg_timeout": pg_timeout, "threads": threads, "env": envs,
                     "node_addrs": [link.addrs[r // per_node] for r in range(world)]}, f)
    return [_LinkRank(link.prefix(r // per_node) + [sys.executable, "-m", __name__, job, str(r)],
                      os.path.join(d, f"rank{r}.log"))
            for r in range(world)]


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
        alive = [p for p in procs if p.is_alive()]
        if all(hasattr(p, "sentinel") for p in alive):
            _wait_any([p.sentinel for p in alive], timeout=1.0)
        else:
            time.sleep(0.2)
    return first


def spawn(fn, world: int = 2, args: tuple = (), timeout: float | None = 300, pg_timeout: float = 60,
          addr: str = "127.0.0.1", threads: int | None = None, env: dict | None = None,
          allow_fail: bool = False, link=None, per_node: int = 1):
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return their results in rank order.

    ``timeout`` bounds the whole run (None: no limit, for long training jobs). Either way a
    rank that fails ends the run: the others get ``pg_timeout`` (their collectives' timeout)
    plus 10 s to finish or fail, then are killed. With ``allow_fail`` a failed rank gives a
    RankError in its slot instead of raising.

    ``link``: an open :class:`.netlink.Link`; rank r runs in node r // ``per_node``'s
    namespace and the ranks meet at the first node's address (``fn`` and ``args`` must
    pickle, ``fn`` by name, as for multiprocessing's spawn). ``per_node`` > 1 also sets
    torchrun's LOCAL_WORLD_SIZE and LOCAL_RANK, so a method's topology=auto goes
    hierarchical."""
    if per_node < 1 or world % per_node:
        raise ValueError(f"per_node={per_node}: expected an integer >= 1 dividing world={world}")
    if link is not None and link.n != world // per_node:
        raise ValueError(f"the link joins {link.n} nodes; world={world} with per_node={per_node} "
                         f"needs {world // per_node}")
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    envs = [dict(env or {}) for _ in range(world)]
    if per_node > 1:
        for r, e in enumerate(envs):
            e.update(LOCAL_WORLD_SIZE=str(per_node), LOCAL_RANK=str(r % per_node))
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        if link is None:
            ctx = _context(envs)
            parent = (os.getpid(), dict(os.environ)) if ctx.get_start_method() == "forkserver" else None
            procs = [ctx.Process(target=_entry, daemon=True,
                                 args=(fn, r, world, addr, port, d, args, pg_timeout, threads, envs[r],
                                       parent))
                     for r in range(world)]
            for p in procs:
                p.start()
        else:
            procs = _start_in_link(fn, world, args, link, per_node, d, port, pg_timeout, threads, envs)
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
                    errors[r] = f"rank {r} exited with code {procs[r].exitcode}" + _log_tail(procs[r])
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


def _log_tail(proc, chars: int = 3000) -> str:
    """The end of a namespace rank's stderr (a crash that left no traceback file)."""
    path = getattr(proc, "log_path", None)
    if path is None or not os.path.exists(path):
        return ""
    with open(path) as f:
        return ":\n" + f.read()[-chars:]


if __name__ == "__main__":
    _link_main(sys.argv[1], int(sys.argv[2]))
