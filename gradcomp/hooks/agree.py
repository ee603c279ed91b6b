"""Registration is collective: every rank validates its own arguments, then the ranks compare
what they registered before anyone raises, so a rank whose options are bad (or differ) cannot
leave the others waiting in a collective. Shared by the DDP and FSDP adapters."""
from __future__ import annotations

import hashlib

from .. import comm
from . import optimizer as optimizer_binding
from .state import destroy_groups


def agree(group, ranks, build, discard):
    """Run ``build() -> (result, mine)`` (``mine``: a dict of what must be equal on every
    rank) on this rank, gather every rank's ``mine`` over ``group``, and raise on every rank
    if any rank's build raised TypeError/ValueError or any key differs; ``discard(result)``
    undoes a refused build. Returns (result, mine)."""
    error, result = None, None
    try:
        result, mine = build()
    except (TypeError, ValueError) as exc:
        error, mine = exc, {"error": f"{type(exc).__name__}: {exc}"}
    everyone = comm.all_gather_object(mine, group)
    if any("error" in d for d in everyone):
        discard(result)
    if error is not None:
        raise error
    failed = [(r, d["error"]) for r, d in zip(ranks, everyone) if "error" in d]
    if failed:
        raise ValueError(f"gradcomp.register refused on rank(s) {', '.join(str(r) for r, _ in failed)}"
                         f", so on every rank (ranks registered different gradcomp methods or "
                         f"options, or invalid ones): "
                         + "; ".join(f"rank {r}: {e}" for r, e in failed))
    differ = [k for k in mine if any(d.get(k) != mine[k] for d in everyone)]
    if differ:
        discard(result)

        def show(v):
            return v if isinstance(v, str) else repr(v)
        detail = "; ".join(f"{k}: " + ", ".join(f"rank {r}: {show(d.get(k))}"
                                                 for r, d in zip(ranks, everyone))
                           for k in differ[:4])
        raise ValueError(f"ranks registered different gradcomp methods, options, models or "
                         f"optimizers (every rank must register the same ones): {detail}")
    return result, mine


def check_log_dir(log_dir) -> None:
    """``log_dir=`` needs tensorboard (an optional extra): refused by name inside an adapter's
    ``build()``, so every rank refuses together and nothing is attached."""
    if log_dir is not None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"log_dir={log_dir!r} needs tensorboard ({exc}): pip install "
                             f"tensorboard, or log_dir=None") from None


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


def discard(state, groups) -> None:
    """A refused registration leaves nothing behind: its threads and process groups."""
    if state is not None:
        state.close()
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
        out.update(optimizer_binding.fingerprint(optimizer))
    return out
