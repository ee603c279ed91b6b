"""A user's gradient clip taken off a step whose gradients are not the ones DDP would clip.

A language-model loop clips between backward and ``step()``
(``torch.nn.utils.clip_grad_norm_``); under DDP the clip sees the exact average of the
ranks' gradients. Two steps hand the optimizer something else, and both step Adam with its
second moment frozen, so the step is linear in what the clip rescaled:

* a compressed step under Adam (hooks/optimizer/adam.py, "Gradient clipping"): the exchanged
  gradients, whose norm carries the compression error;
* an inner step of ``local_steps`` after ``sync_steps`` (hooks/local_steps.py): this rank's
  own gradient (or its node's average), whose norm carries the noise of a W-times smaller
  batch, so the clip bites where DDP's would not and shortens the step.

:class:`Unclip` takes the clip off such a step: the exchange records, for each parameter it
hands back, the norm of what it handed back (on the device, one list append); the step's
pre-hook reads the coefficient c the clip applied (the norm of those parameters' gradients
now over the recorded one, the records summed in name order: the same bits for any bucket
layout) and, where c < 1, multiplies every gradient by 1 / c. Any other uniform rescaling
of the gradients between backward and the step is taken off the same way. No host read, no
collective. Not under FSDP/HSDP (a rank's gradients are its shard: the clip's norm is a
collective the hook does not see).

The first step the clip comes off is announced once (rank 0, a UserWarning); the option
``keep_clip=True`` keeps the user's clip on every step (no :class:`Unclip` is made).

Inner steps whose Adam keeps its own second moment (no ``sync_steps``) keep the clip: there
Adam's normalisation absorbs most of a uniform rescale: taking it off measured as noise,
not a gain (docs/adam.md, "The probes behind the design").
"""
from __future__ import annotations

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP's optimizer state), a tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def by_device(ts) -> list[list[torch.Tensor]]:
    """``ts`` grouped by device (foreach ops take one device at a time)."""
    out: dict = {}
    for t in ts:
        out.setdefault(t.device, []).append(t)
    return list(out.values())


def announce(step) -> None:
    """Once per binding, on rank 0, at the first step the clip comes off: say so, and how to
    keep it (nothing can tell from the host, without a device read, whether the user
    clips: the notice goes out either way)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    import warnings
    warnings.warn(
        f"gradcomp: from optimizer step {step} on, a gradient clip applied between backward "
        f"and step() (clip_grad_norm_) is taken off the steps Adam takes on compressed (or, "
        f"with local steps, each rank's own) gradients: their norm is not the norm of DDP's "
        f"average, and a clip of it was measured to cost accuracy (docs/adam.md, 'Gradient "
        f"clipping'); the dense steps keep it. Register with keep_clip=True to keep it.",
        UserWarning, stacklevel=2)


class Unclip:
    """One step's records of what the exchanges handed back, and the rescale that takes a
    clip off that step. ``params``: name -> parameter, those whose handed-back norm is
    recorded; ``stepped()``: every parameter the optimizer steps (those not recorded are
    rescaled alike; hooks/optimizer/ gives it, the one package that reads the optimizer)."""

    def __init__(self, params: dict[str, torch.Tensor], stepped):
        self.stepped = stepped
        self.params = params
        self._ids = {id(p) for p in params.values()}
        self._norms: list = []   # this step's (parameter names, norms of what went back)
        self._step = None
        self._orders: dict = {}  # the names' order of a step's records -> name order
        self._announced = False

    def record(self, step: int, back: torch.Tensor, slices, scale=None) -> None:
        """What an exchange of step ``step`` handed back: ``back`` (the bucket as the
        gradients get it; ``scale``: the loss scale it carries) over ``slices``; the norms
        of the known parameters' spans are kept on the device. Run on an exchange's
        thread: one list append. A new step drops the records of one the optimizer
        skipped."""
        mine = [s for s in slices if s.name in self.params]
        if not mine:
            return
        norms = torch.stack(torch._foreach_norm(
            [back[s.offset : s.offset + s.numel] for s in mine], 2, dtype=torch.float32))
        if scale is not None:
            norms = norms / scale.to(norms.device, torch.float32)
        if self._step != step:
            self._norms, self._step = [], step
        self._norms.append((tuple(s.name for s in mine), norms))

    def forget(self) -> None:
        self._norms, self._step = [], None

    @torch.no_grad()
    def apply(self, grad_scale=None) -> None:
        """Take the clip off the step about to be taken (from its pre-hook); ``grad_scale``:
        the loss scale a fused optimizer's gradients still carry."""
        records, step = self._norms, self._step
        self.forget()
        if not records:
            return
        if not self._announced:
            self._announced = True
            announce(step)
        names = tuple(n for r in records for n in r[0])
        hit = self._orders.get(names)
        if hit is None:  # once per layout: the records in name order
            order = sorted(range(len(names)), key=names.__getitem__)
            hit = self._orders[names] = (torch.tensor(order), [self.params[names[i]] for i in order])
            if len(self._orders) > 16:
                self._orders = {names: hit}
        order, mine = hit
        if any(p.grad is None for p in mine):
            return
        back = torch.cat([r[1] for r in records])
        back_sq = back[order.to(back.device)].double().square().sum()
        now_sq = torch.stack(torch._foreach_norm([local(p.grad) for p in mine], 2,
                                                 dtype=torch.float32)).double().square().sum()
        if grad_scale is not None:
            now_sq = now_sq / grad_scale.to(now_sq.device).double().square()
        c = (now_sq / back_sq.clamp_min(1e-300)).sqrt()  # the coefficient the clip applied
        k = torch.where((c < 1 - 1e-4) & (c > 0), c.reciprocal(), torch.ones_like(c)).float()
        others = [p for p in self.stepped() if p.grad is not None and id(p) not in self._ids]
        for grads in by_device([p.grad for p in mine + others]):
            torch._foreach_mul_(grads, k.to(grads[0].device))
