"""Local steps with a compressed outer step, ``local_steps=H``: DiLoCo (Douillard et al.,
"DiLoCo: Distributed Low-Communication Training of Language Models", 2023, arXiv:2311.08105),
overlapped as in Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping
communication", 2025, arXiv:2501.18512), with any method's compressor and error feedback on
the pseudo-gradient (SparseLoCo, 2025: top-k + error feedback).

With H > 1 the DDP hook hands each rank's own gradient back (under a hierarchical topology:
the node's average) and the optimizer steps locally ("inner steps"). An optimizer step
post-hook, installed by ``register``, counts steps; at the end of every round of H steps,
per parameter, in fp32 (G: the global point, identical on every rank; m: outer momentum;
lr = ``outer_lr``, mu = ``outer_momentum``):

  1. D = R - theta, this rank's pseudo-gradient (R: the parameters at the round's start,
     G itself for fp32 parameters, G rounded to a half-precision parameter's dtype);
  2. A = the method's average of D over ranks: flat buckets (DDP's bucket cap) go through
     the lanes in the global collective order, with the method's error feedback and the
     inf/NaN guard, like DDP's buckets;
  3. m = mu m + A;  G = G - lr (A + mu m)   (torch's SGD with nesterov=True, dampening 0,
     applied to the gradient A; its first step takes m = A, as here from m = 0);
  4. theta = G; floating-point buffers (BatchNorm statistics) = their plain average.
Every rank ends the round with the same parameters (bit for bit). The inner optimizer's
state (momentum, Adam moments) stays each rank's own, as in DiLoCo.

``local_delay=1`` (Streaming DiLoCo's overlap, a whole round late): at the end of round t
the exchange of D_t starts and round t+1's inner steps run while it is in flight. At the end
of round t+1 its average arrives; with P = R - theta this rank's progress in round t+1 (R:
where round t+1 started on this rank):

  G = G - lr (A_t + mu m)  (step 3, one round late);   theta = G - P;   then D_{t+1} = P is
  sent and R = theta.

So the rank's own contribution of round t in theta is replaced by the outer update, and its
progress since carries on (as delayed gradient averaging does with gradients). Streaming
DiLoCo overlaps tau < H inner steps and then mixes theta = alpha theta + (1 - alpha) G; here
tau = H, and nothing of the progress made since is thrown away or mixed: only the part of
theta the exchange replaces changes. G follows exactly the trajectory of local_delay=0 fed
with the same averages, identical on every rank; the ranks' parameters differ from G by
their latest round's progress only. Buffers: b = A_b + (b - b_t), the rank's own value at
the end of round t replaced by the average. At the end of
training call ``state.flush()`` at a round's end: it waits for the exchange in flight and
applies it (no ``optimizer.step()`` after it); every rank then holds G.

``sync_steps=S`` (Post-local SGD, Lin et al., "Don't Use Large Mini-Batches, Use Local SGD",
ICLR 2020): the first S optimizer steps are synchronous (the hook hands back the average of
every rank's gradient, ``dense_wire`` on the wire: int8/int4 rows, bf16 or fp32) and the
first round starts after them, from the parameters every rank then holds. With Adam/AdamW
(``adam`` "auto" or "freeze") the second moment those steps learned from averaged gradients
is then frozen for the inner steps (hooks/optimizer/adam.py's :class:`FrozenVariance`, as 0/1
Adam, Lu et al., ICLR 2023, freezes it): each rank's inner step is then linear in its
gradients, so the average of the ranks' steps is as long as DDP's step on the averaged
gradient (with each rank's own second moment, estimated from a W-times smaller batch, it is
shorter: what ``outer_lr`` > 1 made up for). The user's clip comes off those inner steps
(hooks/unclip.py): it sees this rank's own gradient, not the average.

Options ``dense_steps``, warm-ups and random streams count outer rounds (``state.step``);
the adaptive warm-up (hooks/warmup.py) measures the pseudo-gradients D.
The method is not bound to the optimizer: the inner steps are the optimizer's own, with its
momentum and weight decay (DGC then sparsifies the pseudo-gradient with its warm-up,
clipping and accumulation, and no momentum correction: the outer Nesterov momentum is the
momentum of the outer loop). Refused: ``delay`` (nothing to delay on inner steps;
``local_delay`` is the overlap) and a GradScaler (a rank that skips a step would fall out of
step with the others' rounds).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..compressors.base import dense_average
from ..config import MAX_LOCAL_STEPS
from .delayed import flat_slices
from .optimizer.steps import learning_rates, set_learning_rates
from .schema import bad, check_int, check_names, check_tensor
from .topology import SEP

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


class _Round:
    """An outer exchange in flight: its step, the outer buckets it carries and each one's
    future (the average of D), the buffers' future and this rank's buffers when sent."""

    def __init__(self, step, buckets, futures, buffers_future=None, buffers_sent=None,
                 length=None):
        self.step, self.buckets, self.futures = step, list(buckets), futures
        self.buffers_future, self.buffers_sent = buffers_future, buffers_sent
        self.length = length  # the round's steps (its outer learning rate's scale)

    def __getstate__(self):  # waited for: futures do not pickle
        return {"step": self.step, "buckets": self.buckets, "averages": self.averages(),
                "buffers_avg": self.buffers(), "buffers_sent": self.buffers_sent,
                "length": self.length}

    def __setstate__(self, d):
        self.__dict__.update(_Round.done(d["step"], d["buckets"], d["averages"],
                                         d["buffers_avg"], d["buffers_sent"],
                                         d["length"]).__dict__)

    def averages(self) -> list[torch.Tensor]:
        return [f.wait() for f in self.futures]

    def buffers(self):
        return self.buffers_future.wait() if self.buffers_future is not None else None

    @classmethod
    def done(cls, step, buckets, averages, buffers_avg, buffers_sent, length) -> "_Round":
        def ready(t):
            f = torch.futures.Future()
            f.set_result(t)
            return f
        return cls(step, buckets, [ready(a) for a in averages],
                   ready(buffers_avg) if buffers_avg is not None else None, buffers_sent,
                   length)


def node_average(x: torch.Tensor, ctx) -> torch.Tensor:
    """Between nodes, nothing: under a hierarchical topology an inner step averages inside
    the node only (the node's reduce-scatter, this, the node's allgather)."""
    return x


def synchronous(wire: str):
    """One of the first ``sync_steps``: the gradient's average over every rank (under a
    hierarchical topology over the nodes, of the node's average), ``wire`` on the wire."""
    def average(x: torch.Tensor, ctx) -> torch.Tensor:
        return dense_average(x, ctx, wire)
    return average


def round_lengths(config) -> list[tuple[int, int]]:
    """The rounds' lengths as (first step, length) pieces, steps counted from the first
    round's start: a round that starts at step p (of rounds) is ``local_steps`` * 2^(p //
    ``grow_every``) long, at most ``max_local_steps`` (``grow_every`` 0: one piece, every
    round ``local_steps`` long). Each piece starts where a round starts."""
    H0, N = config.local_steps, config.grow_every
    cap = config.max_local_steps or MAX_LOCAL_STEPS
    pieces = [(0, H0)]
    p, L = 0, H0
    while N and H0 > 1 and L < cap:
        p += -(-((p // N + 1) * N - p) // L) * L  # the first round start at the next growth
        grown = min(H0 << min(p // N, MAX_LOCAL_STEPS.bit_length()), cap)
        if grown > L:
            pieces.append((p, grown))
            L = grown
    return pieces


def fragment_of(numels: list[int], fragments: int) -> list[int]:
    """Each parameter's fragment: ``fragments`` groups of consecutive parameters (module
    order) of about equal size, a parameter going where its middle element falls."""
    total = sum(numels)
    out, acc = [], 0
    for n in numels:
        out.append(min(fragments - 1, (2 * acc + n) * fragments // (2 * max(total, 1))))
        acc += n
    return out


def check_fragments(config, numels: list[int]) -> list[int]:
    """Each parameter's fragment (``numels``: the parameters the rounds lay out, in order);
    ValueError where a fragment would hold none."""
    F = config.fragments
    where = fragment_of(numels, F)
    empty = sorted(set(range(F)) - set(where))
    if empty and config.local_steps > 1:
        raise ValueError(f"fragments={F}: the model's {len(numels)} parameters leave "
                         f"fragment(s) {empty} empty (fragments are whole parameters of "
                         f"about equal size); allowed at most {len(set(where))} here")
    return where


def outer_pieces(config, held, me: int, W: int) -> list | None:
    """HSDP: what the rounds average on this rank (shard ``me`` of ``W``), from ``held``,
    (name, local tensor) of each row block it holds: the same, named as the memory keeps
    them (``name#me/W``), the fragments checked against them; None without local steps.
    ValueError where it holds none."""
    if not config.in_rounds:
        return None
    pieces = [(f"{name}{SEP}{me}/{W}", t) for name, t in held]
    if not pieces:
        raise ValueError(f"local_steps={config.local_steps} under HSDP: shard {me} of {W} holds "
                         f"no rows of any parameter (more ranks per node than rows); allowed "
                         f"fewer ranks per node, or local_steps=1")
    check_fragments(config, [t.numel() for _, t in pieces])
    return pieces


def default_outer(config):
    """The outer optimizer's factory from ``outer_lr`` and ``outer_momentum``: torch's SGD
    with Nesterov momentum (DiLoCo's), on the global point G with the average as gradient."""
    mu = config.outer_momentum

    def make(params):
        return torch.optim.SGD(params, lr=config.outer_lr, momentum=mu, nesterov=mu > 0,
                               foreach=False)
    return make


def check_outer_optimizer(factory) -> None:
    """``outer_optimizer=``: a callable that builds a torch optimizer over a list of tensors
    (TypeError or ValueError naming what is wrong; with local_steps=1 gradcomp/rules.py
    refuses it)."""
    if factory is None:
        return
    if isinstance(factory, torch.optim.Optimizer) or not callable(factory):
        raise TypeError(f"outer_optimizer={factory!r}: allowed a callable that builds the "
                        f"optimizer from a list of tensors, e.g. lambda params: "
                        f"torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)")
    probe = factory([torch.zeros(2)])
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(f"outer_optimizer built {type(probe).__name__}: allowed a callable "
                        f"returning a torch.optim.Optimizer")


class LocalSteps:
    """A component of the state: local steps and the outer step (see the module doc). Its
    exchanges go through the state's ``send`` (given at ``bind``), in the global order.

    The outer step is a torch optimizer (``outer_optimizer``, a factory; by default SGD with
    Nesterov momentum from ``outer_lr`` and ``outer_momentum``) over G, one flat fp32
    tensor per outer bucket, whose gradient is the round's average A. With ``fragments=N``
    the outer buckets are cut per fragment and fragment f ends its rounds at step
    (f + 1) H / N of each round; everything else is per bucket."""

    def __init__(self, config):
        self.config = config
        self._inner = 0                      # optimizer steps taken (inner steps)
        self.start: list | None = None       # per outer bucket: G, fp32 flat
        self._anchor: list | None = None     # per outer bucket: R, where this round's D starts
        self._outer_saved: dict | None = None  # the outer optimizer's state while it is unbuilt
        self._rounds: dict[int, _Round] = {}   # local_delay=1: per fragment, the exchange in flight
        self._runtime()

    def _runtime(self) -> None:
        """The runtime part (not pickled): the model's tensors, the optimizer's hooks."""
        self._outer_buckets: list = []       # [(slices, parameter tensors)]
        self._fragments: list = []           # per fragment: its outer buckets' indices
        self._outer_buffers: list = []       # [(name, buffer)] floating-point buffers
        self._hooks: list = []
        self._send = None
        self._factory = default_outer(self.config)
        self._opt = None                     # the outer optimizer, built over ``start``
        self._lrs: list = []                 # its param groups' learning rates as built
        self._lengths = round_lengths(self.config)

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_outer_saved"] = self._outer_state()
        for k in ("_outer_buckets", "_fragments", "_outer_buffers", "_hooks", "_send",
                  "_factory", "_opt", "_lrs", "_lengths"):
            del d[k]
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._runtime()

    @property
    def active(self) -> bool:
        """Whether the state syncs every ``local_steps`` > 1 steps."""
        return self.config.local_steps > 1

    @property
    def inner(self) -> int:
        """Optimizer steps taken so far (inner steps and synchronous ones)."""
        return self._inner

    def optimizer_step_of(self, exchange: int) -> int:
        """The optimizer step at which outer exchange ``exchange`` (counted from 0 as the
        state counts its steps: a round's N fragments are N exchanges) begins."""
        r = exchange // self.config.fragments
        for (p, L), (end, _) in zip(self._lengths, self._lengths[1:] + [(None, None)]):
            if end is None or r < (end - p) // L:
                return self.config.sync_steps + p + r * L
            r -= (end - p) // L

    def edge(self) -> tuple[int, bool]:
        """(the length of the round in progress, or of the next one at an edge; whether every
        rank now holds the same model with local_delay=0: during ``sync_steps``, and at a
        round's end without fragments; with fragments > 1 never after the first round, as
        each fragment ends its rounds at its own step)."""
        n = self._inner - self.config.sync_steps
        if n <= 0:
            return self.round_at(0)[1], True
        p, H = self.round_at(n - 1)
        at = (n - p) % H == 0
        return (self.round_at(n)[1] if at else H), at and self.config.fragments == 1

    def round_at(self, n: int) -> tuple[int, int]:
        """(where its piece of :func:`round_lengths` starts, its length) of the round that
        step ``n`` of rounds (from 0) belongs to."""
        return next((p, L) for p, L in reversed(self._lengths) if p <= n)

    @property
    def syncing(self) -> bool:
        """Whether the step about to run is one of the first ``sync_steps``: synchronous,
        its gradient averaged over every rank, no round running."""
        return self._inner < self.config.sync_steps

    @property
    def bound(self) -> bool:
        """Whether an optimizer's steps run the rounds (``bind``)."""
        return bool(self._hooks)

    def check_bound(self) -> None:
        """An inner step's gradient arrived: the rounds must have an optimizer to end in."""
        if not self.bound:
            raise RuntimeError(f"local_steps={self.config.local_steps}: no optimizer to run "
                               f"the outer step from; register with gradcomp.register"
                               f"(model, ..., optimizer=opt), which binds the rounds to the "
                               f"optimizer's step (a state registered by hand has none)")

    def bind(self, params, buffers, bucket_bytes: int | None, send, outer_optimizer=None) -> None:
        """Lay the outer buckets out: ``params``, (name, tensor) pairs in module order (under
        HSDP each rank's own rows of each parameter, named as its memory is), in
        ``fragments`` groups, each cut at ``bucket_bytes`` of fp32; ``buffers``: (name,
        buffer) pairs averaged every round. ``send(bucket, x, slices, tensors, first, last,
        plain)`` queues one exchange and returns (its future, its step): the method's
        (``plain`` False) or the plain average. ``outer_optimizer``: the outer step's
        factory (None: :func:`default_outer`). The optimizer's steps then call
        :meth:`inner_pre` and :meth:`inner_post` (hooks/optimizer/ installs them: ``hook``)."""
        params = list(params)
        F = self.config.fragments
        where = check_fragments(self.config, [p.numel() for _, p in params])
        cap = bucket_bytes or DEFAULT_BUCKET_BYTES
        buckets, self._fragments = [], []
        for f in range(F):
            first = len(buckets)
            cur, size = [], 0
            for (name, p), g in zip(params, where):
                if g != f:
                    continue
                if cur and size + 4 * p.numel() > cap:
                    buckets.append(cur)
                    cur, size = [], 0
                cur.append((name, p))
                size += 4 * p.numel()
            if cur:
                buckets.append(cur)
            self._fragments.append(list(range(first, len(buckets))))
        self._outer_buckets = [(flat_slices(b), [p for _, p in b]) for b in buckets]
        self._outer_buffers = [(n, b) for n, b in buffers if b.dtype.is_floating_point]
        self._send = send
        if outer_optimizer is not None:
            self._factory = outer_optimizer

    def hook(self, handles: list) -> None:
        """The optimizer's step hooks that run the rounds (removed at close)."""
        self._hooks = list(handles)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ rounds
    def _flat_params(self, tensors) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float() for t in tensors])

    def _flat_bucket(self, b: int) -> torch.Tensor:
        return self._flat_params(self._outer_buckets[b][1])

    def inner_pre(self, optimizer, args, kwargs) -> None:
        # G is taken at the first step, not at registration: a model loaded after register()
        # (from a checkpoint, or pretrained weights) starts the first round
        if self.start is None:
            self._start_here()

    def _start_here(self) -> None:
        """G = the parameters as they now are (every rank's the same): a first round starts."""
        self.start = [self._flat_bucket(b) for b in range(len(self._outer_buckets))]
        self._opt = None  # (built over G at the first outer step)
        self._reanchor(range(len(self.start)))

    def _shared_anchor(self) -> bool:
        """Whether R is G itself: local_delay=0 and fp32 parameters (which hold G exactly)."""
        return not self.config.local_delay and all(
            t.dtype == torch.float32 for _, ts in self._outer_buckets for t in ts)

    def _reanchor(self, buckets) -> None:
        """R = the parameters of ``buckets`` as they now are, where their next D is measured
        from. Not G for half-precision parameters: they hold G rounded, and that rounding is
        no progress (measured from G it would pull G towards its rounded value every round)."""
        if self._shared_anchor():
            self._anchor = self.start
            return
        if self._anchor is None or self._anchor is self.start:
            self._anchor = list(self.start)
        for b in buckets:
            self._anchor[b] = self._flat_bucket(b)

    def inner_post(self, optimizer, args, kwargs) -> None:
        self._inner += 1
        S = self.config.sync_steps
        if self._inner <= S:
            if self._inner == S:  # the first round starts where every rank now stands
                with torch.no_grad():
                    self._start_here()
            return
        n, F = self._inner - S, self.config.fragments
        p, H = self.round_at(n - 1)
        t = (n - p) % H
        for f in range(F):
            if t == (f + 1) * H // F % H:
                with torch.no_grad():
                    self._fragment_end(f, H)

    def _fragment_end(self, f: int, length: int) -> None:
        """Fragment ``f``'s round ends: send its D, apply its outer step (now, or the one in
        flight with local_delay=1), and measure its next D from here."""
        bs = self._fragments[f]
        deltas = [self._anchor[b] - self._flat_bucket(b) for b in bs]
        with_buffers = f == len(self._fragments) - 1
        if not self.config.local_delay:
            self._outer_apply(self._outer_send(bs, deltas, with_buffers, length), None)
        else:
            pending = self._rounds.pop(f, None)
            if pending is not None:
                self._outer_apply(pending, deltas)
            self._rounds[f] = self._outer_send(bs, deltas, with_buffers, length)
        self._reanchor(bs)

    def _outer_send(self, bs, deltas, with_buffers: bool, length: int) -> _Round:
        """Queue each of buckets ``bs``' exchange of ``deltas`` (and, ``with_buffers``, the
        buffers' plain average) in the global order; returns the round in flight (of
        ``length`` steps)."""
        buffers = None
        if with_buffers and self._outer_buffers:
            buffers = torch.cat([b.detach().reshape(-1).float() for _, b in self._outer_buffers])
        futures, bfut, step = [], None, None
        for i, (b, d) in enumerate(zip(bs, deltas)):
            slices, tensors = self._outer_buckets[b]
            fut, s = self._send(b, d, slices, tensors, i == 0,
                                i == len(bs) - 1 and buffers is None, False)
            futures.append(fut)
            step = s if step is None else step
        if buffers is not None:
            slices = flat_slices((f"buffer:{name}", t) for name, t in self._outer_buffers)
            bfut, s = self._send(len(self._outer_buckets), buffers.clone(), slices, None,
                                 not bs, True, True)
            step = s if step is None else step
        return _Round(step, bs, futures, bfut, buffers, length)

    def _optimizer(self) -> torch.optim.Optimizer:
        """The outer optimizer over G (built at its first step, its saved state loaded)."""
        if self._opt is None:
            self._opt = self._factory(self.start)
            self._lrs = learning_rates(self._opt)
            if self._outer_saved is not None:
                self._opt.load_state_dict(self._unname_outer(
                    self._outer_saved, self._opt.state_dict()["param_groups"]))
            self._outer_saved = None
        return self._opt

    def _outer_apply(self, rnd: _Round, progress) -> None:
        """The outer step with the round's averages A as G's gradient (the outer optimizer's
        step; by default G = G - lr (A + mu m)); parameters = G (local_delay=0) or
        G - ``progress`` (local_delay=1: this rank's progress since)."""
        avgs = rnd.averages()
        opt = self._optimizer()
        if len(self._lengths) > 1:  # growing rounds: lr * sqrt(H / local_steps)
            scale = (rnd.length / self.config.local_steps) ** 0.5
            set_learning_rates(opt, [lr * scale for lr in self._lrs])
        for b, a in zip(rnd.buckets, avgs):
            self.start[b].grad = a
        opt.step()
        for i, b in enumerate(rnd.buckets):
            self.start[b].grad = None
            g = self.start[b]
            self._copy_into(self._outer_buckets[b][1], g if progress is None else g - progress[i])
        avg = rnd.buffers()
        if avg is not None:
            if rnd.buffers_sent is not None and self.config.local_delay:
                now = torch.cat([t.detach().reshape(-1).float() for _, t in self._outer_buffers])
                avg = avg + (now - rnd.buffers_sent)
            self._copy_into([t for _, t in self._outer_buffers], avg)

    @staticmethod
    def _copy_into(tensors, flat) -> None:
        off = 0
        for t in tensors:
            t.detach().copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()

    def drain(self, before: int | None = None) -> None:
        """Wait for the outer exchanges in flight (local_delay=1) of steps before ``before``
        (None: any)."""
        for rnd in self._rounds.values():
            if before is None or rnd.step < before:
                rnd.averages()
                rnd.buffers()

    def flush(self) -> None:
        """With ``local_delay=1``: wait for the outer exchanges in flight and apply them to the
        parameters (and buffers) now; called at a round's end, every rank then holds the
        global point. No ``optimizer.step()`` is needed after it."""
        for f in sorted(self._rounds):
            rnd = self._rounds.pop(f)
            with torch.no_grad():
                progress = [self._anchor[b] - self._flat_bucket(b) for b in rnd.buckets]
                self._outer_apply(rnd, progress)
                self._reanchor(rnd.buckets)

    # ------------------------------------------------------------------ checkpoints
    def digest(self) -> list | None:
        """Per parameter the rounds lay out, (sum, sum of squares) of this rank's values in
        float64, on the host (one read: at a save, a load, the first step): what
        hooks/checkpoint.py compares to tell one rank's model from another's."""
        ts = [t.detach() for _, tensors in self._outer_buckets for t in tensors]
        if not ts:
            return None
        return torch.stack([torch.stack([t.double().sum(), t.double().square().sum()])
                            for t in ts]).cpu().tolist()

    def _named(self, flats, buckets=None) -> dict | None:
        """Per parameter name, its part of ``flats`` (one flat tensor per bucket of
        ``buckets``, every outer bucket where None)."""
        if flats is None:
            return None
        buckets = range(len(self._outer_buckets)) if buckets is None else buckets
        return {s.name: f[s.offset : s.offset + s.numel].clone()
                for b, f in zip(buckets, flats) for s in self._outer_buckets[b][0]}

    def _flats(self, named, buckets=None) -> list | None:
        if named is None:
            return None
        buckets = range(len(self._outer_buckets)) if buckets is None else buckets
        missing = [s.name for b in buckets for s in self._outer_buckets[b][0]
                   if s.name not in named]
        if missing:
            raise ValueError(f"checkpoint's local_steps state lacks parameters "
                             f"{', '.join(missing[:5])}")
        return [torch.cat([named[s.name].reshape(-1).float() for s in self._outer_buckets[b][0]])
                for b in buckets]

    def _outer_state(self) -> dict | None:
        """The outer optimizer's state per parameter name: {"state": {key: {name: value}},
        "groups": its param groups' settings}; a tensor laid out as G is cut per parameter,
        any other value (a step count) repeated for each of the bucket's parameters."""
        if self._opt is None:
            return self._outer_saved
        sd = self._opt.state_dict()
        state: dict = {}
        for b, entries in sd["state"].items():
            slices, g = self._outer_buckets[b][0], self.start[b]
            for key, v in entries.items():
                named = state.setdefault(key, {})
                for s in slices:
                    named[s.name] = (v[s.offset : s.offset + s.numel].clone()
                                     if torch.is_tensor(v) and v.shape == g.shape else v)
        return {"state": state,
                "groups": [{k: v for k, v in g.items() if k != "params"}
                           for g in sd["param_groups"]]}

    def _unname_outer(self, saved: dict, groups: list) -> dict:
        """:meth:`_outer_state`'s inverse for this layout: the state_dict of an optimizer
        whose param groups are ``groups`` (the saved groups' settings put over them)."""
        state: dict = {}
        for key, named in saved["state"].items():
            for b, (slices, _) in enumerate(self._outer_buckets):
                if not all(s.name in named for s in slices):
                    continue
                v = named[slices[0].name]
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == slices[0].numel:
                    v = torch.cat([named[s.name].reshape(-1) for s in slices])
                state.setdefault(b, {})[key] = v
        for g, settings in zip(groups, saved["groups"] or ()):
            g.update({k: v for k, v in settings.items() if k != "params"})
        return {"state": state, "param_groups": groups}

    def state_dict(self) -> dict | None:
        """The rounds' state: inner steps taken, G, this round's start, the outer optimizer's
        state, and the exchanges in flight (waited for: their averages and buffers sent)."""
        if not self.active:
            return None
        rounds = {f: {"step": r.step, "averages": self._named(r.averages(), r.buckets),
                      "buffers_average": r.buffers(), "buffers_sent": r.buffers_sent,
                      "length": r.length}
                  for f, r in self._rounds.items()}
        return {"inner_steps": self._inner, "start": self._named(self.start),
                "anchor": self._named(self._anchor), "outer": self._outer_state(),
                "rounds": rounds}

    def load_state_dict(self, sd: dict | None) -> None:
        if not self.active:
            return
        if sd is None:
            raise ValueError("checkpoint has no local_steps state (saved with local_steps=1)")
        self._inner = sd["inner_steps"]
        self.start = self._flats(sd["start"])
        self._anchor = self.start if self._shared_anchor() else self._flats(sd["anchor"])
        self._opt, self._outer_saved = None, _outer_of(sd)
        self._rounds = {}
        for f, r in _rounds_of(sd).items():
            bs = self._fragments[f]
            self._rounds[f] = _Round.done(r["step"], bs, self._flats(r["averages"], bs),
                                          r["buffers_average"], r["buffers_sent"],
                                          r.get("length", self.config.local_steps))

    def check_same_start(self, group, numels: dict) -> None:
        """Local steps, at the first step of a first round that no checkpoint started: every
        rank's model is the same (the rounds' global point is taken from it, on each rank), else
        every rank raises naming the ranks that differ (``group``: the loads' group; ``numels``:
        the state's parameters, HSDP's pieces compared within their shard). A job resumed inside
        a round without gradcomp's state would otherwise run on with each rank's own point for
        good."""
        if group is None or not dist.is_initialized() or self.start is not None:
            return
        # under HSDP a rank's rounds hold its shard's rows: compared with that shard's replicas
        shard = tuple(n for n in numels if SEP in n)
        everyone = comm.all_gather_object((shard, self.digest()), group)
        ranks = dist.get_process_group_ranks(group)
        first = {}
        for r, (k, d) in zip(ranks, everyone):
            first.setdefault(k, (r, d))
        differ = [r for r, (k, d) in zip(ranks, everyone)
                  if d is not None and first[k][1] is not None and not same_model(d, first[k][1])]
        if differ:
            ref = first[everyone[ranks.index(differ[0])][0]][0]
            raise ValueError(f"gradcomp: the ranks' models differ at the first step of local steps "
                             f"(rank(s) {', '.join(map(str, differ))} from rank {ref}'s): each "
                             f"rank's rounds would start from its own point and never meet. A job "
                             f"resumed inside a round must load every rank's own gradcomp state "
                             f"(state.load_state_dict(...) on every rank) with its own model: "
                             f"{SAVE_EACH_MODEL}")

def _outer_of(sd: dict) -> dict | None:
    """The outer optimizer's saved state; a checkpoint of the hand-written outer step keeps
    its Nesterov momentum under "momentum" (torch's SGD calls it momentum_buffer)."""
    if "outer" in sd:
        return sd["outer"]
    if sd.get("momentum") is None:
        return None
    return {"state": {"momentum_buffer": sd["momentum"]}, "groups": None}


def _rounds_of(sd: dict) -> dict:
    """Per fragment, the exchange in flight; a checkpoint without fragments keeps its one
    exchange under "round" (format 2). Its keys are checked by :func:`check_local_state`."""
    if "rounds" in sd:
        return sd["rounds"]
    return {} if sd.get("round") is None else {0: sd["round"]}


# options a checkpoint may lack (written before they existed) whose default is not what the
# run that wrote it did: its rounds never grew (hooks/checkpoint.py compares with these)
ABSENT = {"grow_every": 0}

SAVE_EACH_MODEL = ("under local_steps the ranks' models differ inside a round (each took "
                   "its own inner steps), so each rank saves and loads its own model beside "
                   "its own state_dict(), model first; or save at a round's end with "
                   "local_delay=0, where every rank holds the same model (docs/checkpoints.md)")


def same_model(a, b) -> bool:
    """Two digests of :meth:`LocalSteps.digest` equal up to the rounding of a sum taken on
    other hardware."""
    def close(x, y):
        sq = max(abs(x[1]), abs(y[1]))
        return abs(x[1] - y[1]) <= 1e-9 * sq and abs(x[0] - y[0]) <= 1e-6 * sq ** 0.5
    return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))


def check_local_state(loc, config, numels: dict, param_names: tuple) -> None:
    """A checkpoint's local-steps part (what :meth:`LocalSteps.state_dict` writes), checked
    before anything is loaded: per parameter, the round's start, anchor
    and the outer optimizer's state ("momentum" in format 2), and per fragment the outer
    exchange in flight ("round" in format 2)."""
    if loc is None:
        raise ValueError("checkpoint has no local_steps state (saved with local_steps=1)")
    if not isinstance(loc, dict):
        raise bad("local", type(loc).__name__, "a dict (local_steps' rounds)")
    check_int("local inner_steps", loc.get("inner_steps"))
    # what the rounds lay out: every trainable parameter, under HSDP this rank's rows of each
    names = [n for n in numels if SEP in n] or list(param_names)

    def named(what, d, whole=True):  # (a fragment's exchange: its own parameters)
        if d is None:
            return
        check_names(what, d)
        lacking = [n for n in names if n not in d] if whole else []
        if lacking:
            raise ValueError(f"checkpoint's local_steps state lacks parameters "
                             f"{', '.join(lacking[:5])}")
        for n, t in d.items():
            check_tensor(f"{what} of {n!r}", t, numels.get(n))
    for key in ("start", "anchor", "momentum"):
        named(f"local {key}", loc.get(key))
    outer = loc.get("outer")
    if outer is not None:
        if not (isinstance(outer, dict) and isinstance(outer.get("state"), dict)
                and isinstance(outer.get("groups"), list)):
            raise bad("local outer", type(outer).__name__, "None or a dict with state (per "
                                                           "key, values by parameter name) "
                                                           "and groups (a list)")
        for key, d in outer["state"].items():
            check_names(f"local outer {key}", d)
    rounds = _rounds_of(loc)
    if not isinstance(rounds, dict):
        raise bad("local rounds", type(rounds).__name__, "a dict: fragment -> its exchange")
    F = config.fragments
    for f, rnd in rounds.items():
        if type(f) is not int or not 0 <= f < F:
            raise bad("local rounds' fragment", f, f"an integer in [0, fragments={F})")
        if not isinstance(rnd, dict) or not all(k in rnd for k in (
                "step", "averages", "buffers_average", "buffers_sent")):
            raise bad("local round", rnd, "a dict with step, averages, buffers_average, "
                                           "buffers_sent")
        check_int("local round step", rnd["step"])
        if rnd.get("length") is not None:
            check_int("local round length", rnd["length"], 1, MAX_LOCAL_STEPS)
        named("local round averages", rnd["averages"], whole=F == 1)
        for key in ("buffers_average", "buffers_sent"):
            if rnd[key] is not None:
                check_tensor(f"local round {key}", rnd[key])
