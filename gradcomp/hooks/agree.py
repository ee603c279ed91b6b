"""Registration is collective: every rank validates its own arguments, then the ranks compare
what they registered before anyone raises, so a rank whose options are bad (or differ) cannot
leave the others waiting in a collective. Shared by the DDP and FSDP adapters."""
from __future__ import annotations

import contextlib
import hashlib
import os

import torch.distributed as dist

from .. import comm
from . import optimizer as optimizer_binding
from ..config import MAX_QUOTED, clip, quote


REGISTER = ("gradcomp.register", "ranks registered different gradcomp methods or options, or "
            "invalid ones", "ranks registered different gradcomp methods, options, models or "
            "optimizers (every rank must register the same ones)",
            "a rank did not call it, or left the job")


def agree(group, ranks, build, discard, what=REGISTER):
    """Run ``build() -> (result, mine)`` (``mine``: a dict of what must be equal on every
    rank) on this rank, gather every rank's ``mine`` over ``group``, and raise on every rank
    if any rank's build raised or any key differs; ``discard(result)`` undoes a refused
    build. Returns (result, mine). A rank whose build raised raises its own error; the others
    a ValueError quoting it. ``what``: (the call, why every rank refuses, what differing
    values mean, what a failed agreement means), for the messages."""
    call, why, differ_means, lost = what
    error, result = None, None
    try:
        result, mine = build()
    except Exception as exc:  # noqa: BLE001  (any kind: the rank must still join the others)
        error, mine = exc, {"error": clip(f"{type(exc).__name__}: {exc}")}
    try:
        everyone = comm.all_gather_object(mine, group)
    except RuntimeError as exc:  # the group's timeout, or a rank gone
        discard(result)
        raise RuntimeError(f"{call} is collective (every rank of its group calls it), and the "
                           f"ranks' agreement failed: {lost} ({clip(str(exc), 200)})") from None
    if any("error" in d for d in everyone):
        discard(result)
    if error is not None:
        if type(error) in (TypeError, ValueError) and len(str(error)) > 2 * MAX_QUOTED:
            raise type(error)(clip(str(error), 2 * MAX_QUOTED)) from None
        raise error
    failed = [(r, d["error"]) for r, d in zip(ranks, everyone) if "error" in d]
    if failed:
        raise ValueError(f"{call} refused on rank(s) {_ranks([r for r, _ in failed])}, so on "
                         f"every rank ({why}): {_grouped(failed)}")
    differ = [k for k in mine if any(d.get(k) != mine[k] for d in everyone)]
    if differ:
        discard(result)

        def show(v):
            return clip(v if isinstance(v, str) else repr(v), 300)
        detail = "; ".join(f"{k}: " + _grouped([(r, show(d.get(k))) for r, d in
                                                zip(ranks, everyone)], sep=", ")
                           for k in differ[:4])
        raise ValueError(f"{differ_means}: {detail}")
    return result, mine


def _ranks(ranks: list, limit: int = 16) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def _grouped(pairs: list, limit: int = 3, sep: str = "; ") -> str:
    """Each distinct text of (rank, text) pairs once, with the ranks that gave it (at most
    ``limit`` texts): bounded whatever the number of ranks."""
    by_text: dict[str, list] = {}
    for r, e in pairs:
        by_text.setdefault(e, []).append(r)
    parts = [f"rank {_ranks(rs)}: {e}" for e, rs in list(by_text.items())[:limit]]
    if len(by_text) > limit:
        parts.append(f"and {len(by_text) - limit} other(s)")
    return sep.join(parts)


def check_log_dir(log_dir, writes: bool = True) -> None:
    """``log_dir=`` needs tensorboard (an optional extra) and, on a rank that ``writes``, a
    directory it can write: refused by name inside an adapter's ``build()``, so every rank
    refuses together and nothing is attached."""
    if log_dir is None:
        return
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"log_dir={quote(log_dir)}: allowed a directory path (str or "
                        f"os.PathLike) or None")
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"log_dir={quote(log_dir)} needs tensorboard ({exc}): pip install "
                         f"tensorboard, or log_dir=None") from None
    if writes:
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"log_dir={quote(log_dir)}: cannot create it ({exc.strerror}); "
                             f"allowed a directory this rank can write, or log_dir=None") from None
        if not os.access(log_dir, os.W_OK | os.X_OK):
            raise ValueError(f"log_dir={quote(log_dir)}: not writable by this rank; allowed a "
                             f"directory this rank can write, or log_dir=None")


def trainable(module) -> tuple[dict, dict]:
    """The parameters a state serves: {id(p): name} and {name: numel} of the module's
    trainable ones (a sharded parameter's global numel); non-float ones refused by name."""
    names, numels = {}, {}
    for pname, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if not p.dtype.is_floating_point:
            raise TypeError(f"parameter {pname!r} has dtype {p.dtype}: gradients must be float "
                            f"(float32, float16 or bfloat16)")
        names[id(p)] = pname
        numels[pname] = p.numel()
    return names, numels


class Groups:
    """The process groups one registration creates: every rank creates the same ones in the
    same order (collective), and they are destroyed together if registration fails."""

    def __init__(self, backend):
        self.backend, self.made = backend, []

    def new(self, members):
        g = dist.new_group(ranks=members, backend=self.backend)
        self.made.append(g)
        return g

    def destroy_from(self, first: int) -> None:
        """Destroy the groups created from the ``first``-th on (a probe's, not kept)."""
        unused = self.made[first:]
        del self.made[first:]
        destroy_groups(unused)

    @contextlib.contextmanager
    def undone_on_error(self):
        """Destroy every group made so far if the block raises."""
        try:
            yield
        except BaseException:
            destroy_groups(self.made)
            raise


def discard(groups) -> None:
    """A refused registration leaves nothing behind: its process groups."""
    destroy_groups(groups)


def fingerprint(module, optimizer, scaler) -> dict:
    """What must be the same on every rank besides the options: the model's trainable
    parameters (names, shapes, dtypes: a digest; a sharded parameter's global shape) and the
    optimizer's class and the hyperparameters of its groups."""
    h = hashlib.sha256()
    for n, p in module.named_parameters():
        if p.requires_grad:
            h.update(f"{n}|{tuple(p.shape)}|{p.dtype};".encode())
    out = {"parameters (names, shapes, dtypes)": h.hexdigest()[:16],
           "scaler": scaler is not None}
    if optimizer is not None:
        out.update(optimizer_binding.settings(optimizer))
    return out


def destroy_groups(groups) -> None:
    """Destroy the process groups register created (a refusal, or the state's close())."""
    for g in groups:
        if isinstance(g, dist.ProcessGroup) and dist.is_initialized():
            try:
                dist.destroy_process_group(g)
            except (RuntimeError, ValueError, KeyError):
                pass  # already gone with the default group
    if isinstance(groups, list):  # a registration's list: not destroyed twice
        groups.clear()
