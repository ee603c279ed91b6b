"""How a bucket reaches a lane: :class:`Entries`, built by the hook state with what it uses.
Every entry (a DDP bucket, delayed or not, FSDP's reduce and its overlapped slices, local
steps' outer exchange) builds its exchange with :meth:`Entries.request` (the step counter,
the warm-up's observation, the loss scale and Adam's transform, the live parameters: each
written once, applied in that order) and runs it with :meth:`Entries.run` (inline on the
caller's thread, or queued on its lane). A DDP bucket goes one of three ways, chosen at the
state's construction from its config (:meth:`Entries.bucket` names the bucket's
parameters, then calls it):

  Inner     ``local_steps`` > 1: an inner step (this rank's gradient, or its node's average
            under a hierarchical topology); the rounds' outer exchange goes through
            :meth:`Entries.outer` from hooks/local_steps.py
  Now       the exchange on its lane; DDP waits for its future
  Late      ``delay=D``: a copy exchanged in the background, the local gradient applied now
            plus the correction (average - local) of step t - D (hooks/delayed.py)
"""
from __future__ import annotations

import time

import torch

from . import optimizer as optimizer_binding
from .delayed import flat_slices
from .engine import Exchange, future
from .topology import base_name
from .local_steps import node_average, synchronous


class Entries:
    """The ways into the exchange pipeline, built by the hook state with the parts they use:
    the config, the compressor, the warm-up, the telemetry, the rounds (local steps), delayed
    averaging, the hierarchy, the engine and the stages it runs; ``names``: the parameters'
    names by id; ``begin(bucket)``: the step counter (the state's); ``step()``: the step in
    flight; ``scaler()`` and ``adam()``: the GradScaler and the Adam binding, or None (bound
    after the state is built); ``drain(before)``: wait for the exchanges in flight."""

    def __init__(self, *, config, compressor, warmup, telemetry, rounds, delay, hierarchy,
                 engine, stages, names, begin, step, scaler, adam, drain):
        self.config, self.compressor, self.warmup = config, compressor, warmup
        self.telemetry, self.rounds, self.delay = telemetry, rounds, delay
        self.hierarchy, self.engine, self.stages, self.names = hierarchy, engine, stages, names
        self._begin, self._step, self._scaler, self._adam = begin, step, scaler, adam
        self.drain = drain
        self.way = choose(config)(self)  # how a DDP bucket reaches a lane

    @property
    def adam(self):
        return self._adam()

    def bucket(self, bucket: int, buf: torch.Tensor, params, last: bool = True
               ) -> torch.futures.Future:
        """Queue one DDP bucket's exchange; the returned future completes with the average.
        ``last``: DDP's last bucket of this backward pass (it closes the round of the
        collective order). One of three ways, fixed by the config (``way``): an inner step
        of local steps, an exchange the step waits for, delayed averaging."""
        names = names_of(self.names, params)
        return self.way(bucket, buf, flat_slices(zip(names, params)), params, names, last)

    def request(self, bucket: int, buf: torch.Tensor, slices, *, params=None, names=None,
                gradient: bool = True, starts: bool = False, plain=None,
                step: int | None = None, fut=None) -> Exchange:
        """The one exchange request, for every entry. ``slices``: the bucket's ParamSlices;
        ``params``: the parameters' tensors, where the method reads them; ``names``: the
        parameters' names (default: the slices', a piece's its parameter's). The step
        counter (``begin``: ``starts`` or bucket 0 opens a step; the previous step's inf/NaN
        flag is read there), the warm-up's observation, and for a ``gradient`` (not local
        steps' pseudo-gradient) the loss scale it carries and Adam's transform, built while
        the optimizer is idle. ``plain``: a reduce(x, ctx) run instead of the method (a
        buffers' or an inner step's average) at ``step`` (default: the step in flight):
        nothing counted, observed or scaled."""
        slices = list(slices)
        if plain is not None:
            return Exchange(bucket, buf, slices, self._step() if step is None else step,
                            params=params, plain=plain, fut=fut)
        step = self._begin(0 if starts else bucket)
        scale = optimizer_binding.loss_scale(self._scaler()) if gradient else None
        self.warmup.observe(step, buf, slices, scale)
        adam = self.adam
        if gradient and adam is not None and not self.warmup.dense(step):
            adam.scale(slices, buf.device)  # built here, while the optimizer is idle
        if gradient and self.engine.trace is not None:
            now = time.perf_counter()
            self.engine.trace.append(("submit", bucket, now, now))
        live = self.compressor.live(names if names is not None
                                    else [base_name(s.name) for s in slices])
        return Exchange(bucket, buf, slices, step, params=params, scale=scale, live=live,
                        fut=fut)

    def run(self, ex: Exchange, *, inline: bool = False, last: bool = True, lane=None):
        """Run a request: ``inline`` on the caller's thread (returns the average, in the
        bucket's dtype), or queued on its lane (``lane``, default the bucket's; ``last``: the
        last bucket of its round of the collective order), its future returned."""
        if inline:
            return self.stages.exchange(lane or self.engine.lanes[0], ex)
        if ex.fut is None:
            ex.fut = future(ex.buf)
        self.engine.enqueue(lane or self.engine.lane(ex.bucket), ex, last)
        return ex.fut

    # the other ways in: FSDP's (a bucket laid out by FSDP, synchronous or on the first
    # lane), local steps' outer exchanges

    def reduce(self, x: torch.Tensor, params, bucket: int = 0, param_tensors=None,
               plain=None) -> torch.Tensor:
        """Synchronously reduce one flat bucket (any float dtype); returns the average in
        x's dtype: the DDP hook's request, run on the caller's thread. ``plain``: a
        reduce(x, ctx) run instead of the method (an inner step's average under HSDP)."""
        return self.run(self.request(bucket, x, params, params=param_tensors, plain=plain),
                        inline=True)

    def slices(self, bucket: int, buf: torch.Tensor, slices, tensors=None
               ) -> torch.futures.Future:
        """Queue the exchange of a bucket laid out by ``slices`` (ParamSlices; ``tensors``:
        the parameters, where the method reads them) on the first lane, each its own round
        of the collective order; the future completes with the average, in ``buf``. What
        :meth:`reduce` does on the caller's thread, done on the lane's (the FSDP adapter's
        overlapped exchanges, which FSDP refuses delay and local steps for)."""
        try:
            ex = self.request(bucket, buf, slices, params=tensors)
        except Exception as exc:  # noqa: BLE001  (the caller's wait raises it)
            return self.engine.failed(buf, exc)
        return self.run(ex, lane=self.engine.lanes[0])

    def outer(self, bucket, x, slices, tensors, first, last, plain):
        """Local steps' outer exchange of one bucket (hooks/local_steps.py) in the global
        order: the method's, ``first`` of its exchange starting a step of its own (a
        fragment's buckets do not start at bucket 0), or ``plain``: the buffers' plain
        average. Returns (its future, its step)."""
        ex = self.request(bucket, x, slices, params=tensors, names=[s.name for s in slices],
                          gradient=False, starts=first,
                          plain=self.compressor.dense if plain else None,
                          step=max(self._step() - 1, 0) if plain else None)
        return self.run(ex, last=last), ex.step


def names_of(names: dict, params) -> list[str]:
    """The names of a DDP bucket's parameters (``names``: by id)."""
    out = []
    for p in params:
        name = names.get(id(p))
        if name is None:
            raise RuntimeError(
                "a bucket holds a parameter the state does not know: build the state with "
                "the model it serves, gradcomp.State(method, config, model=net), or use "
                "gradcomp.register(ddp_model, method, optimizer=opt)")
        out.append(name)
    return out


class Way:
    """A way onto a lane: called with (bucket, buf, slices, params, names, last), returns
    the bucket's future."""

    def __init__(self, entries: Entries):
        self.entries = entries
        self.layouts: dict[int, tuple] = {}  # bucket -> its parameters' names, as last seen


class Inner(Way):
    """An inner step of local steps: this rank's gradient, or a hierarchy's node's."""

    def __call__(self, bucket, buf, slices, params, names, last):
        en = self.entries
        en.rounds.check_bound()
        en.telemetry.hand(buf.numel() * buf.element_size())
        fut = future(buf)
        sync, step, adam = en.rounds.syncing, en.rounds.inner, en.adam
        if not sync and adam is not None:  # the norms of what goes back, for the clip
            fut.add_done_callback(lambda f: adam.record(step, f.value(), slices))
        if not en.hierarchy.local_size and not sync:
            fut.set_result(buf)
            return fut
        plain = (synchronous(optimizer_binding.dense_wire(en.config, adam is not None))
                 if sync else node_average)
        return en.run(en.request(bucket, buf, slices, plain=plain, fut=fut), last=last)


class Now(Way):
    """The exchange on its lane; DDP waits for its future."""

    def __call__(self, bucket, buf, slices, params, names, last):
        en = self.entries
        try:
            ex = en.request(bucket, buf, slices, params=list(params), names=names)
        except Exception as exc:  # noqa: BLE001  (handed to DDP, as a lane's error is)
            return en.engine.failed(buf, exc)
        return self.send(ex, names, last)

    def send(self, ex: Exchange, names, last: bool):
        self.layouts[ex.bucket] = tuple(names)  # DDP's buckets, as seen
        return self.entries.run(ex, last=last)


class Late(Now):
    """Delayed averaging: exchange a copy in the background, apply the local gradient now
    plus the correction (average - local) of step - D. The copy, and the parameters where
    the method reads them (DGC's weight decay), are taken now: the optimizer updates the
    parameters while the exchange runs."""

    def send(self, ex: Exchange, names, last: bool):
        en, buf, step, params = self.entries, ex.buf, ex.step, ex.params
        layout = tuple(names)
        if self.layouts.get(ex.bucket) != layout and len(en.engine.lanes) > 1:
            # DDP moved parameters between buckets (its rebuild): a parameter's previous
            # exchange may sit on another lane and must finish before its next one starts
            # (without delay every exchange of the previous step has finished already). Only
            # earlier steps': this step's may wait for this very bucket's turn.
            en.drain(before=step)
        self.layouts[ex.bucket] = layout
        if en.compressor.reads_params(ex.live):
            ex.params = [p.detach().clone() for p in params]
        ex.buf, ex.delayed, ex.scale = buf.clone(), True, None
        ex.fut = future(buf)
        en.run(ex, last=last)
        # (the job's wait orders after the lane's stream)
        en.delay.add(step, ex.slices, ex.fut, zip(names, params))
        corr = en.delay.take(step - en.config.delay, ex.slices, buf)
        if corr is not None:
            buf.add_(corr)
        fut = future(buf)
        fut.set_result(buf)
        return fut


def choose(config):
    """The way a state with ``config`` submits its buckets."""
    if config.in_rounds:
        return Inner
    return Late if config.delay else Now
