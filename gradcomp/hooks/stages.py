"""One bucket's exchange, in stages (:meth:`Stages.exchange` runs them on a lane): the
topology's split (:meth:`Stages.split`), then the method's stage (:meth:`Stages.method`):
the warm-up's choice between the dense and the compressed exchange, Adam's transforms in and
out, the inf/NaN guard around the exchange, and the residual diagnostic."""
from __future__ import annotations

import time

import torch

from ..comm import Traffic
from .context import BucketCtx
from .optimizer import dense_wire
from .telemetry import sq_norm


class Stages:
    """The stages of one bucket's exchange, built by the hook state with the components they
    use: the config, the compressor, the memory, the telemetry, the warm-up, the guard, the
    rounds (local steps), the hierarchy, and ``adam()``, the Adam binding or None (it is
    bound after the state is built). :meth:`exchange` runs them on a lane."""

    def __init__(self, *, config, compressor, memory, telemetry, warmup, guard, rounds,
                 hierarchy, adam):
        self.config, self.compressor, self.memory = config, compressor, memory
        self.telemetry, self.warmup, self.guard = telemetry, warmup, guard
        self.rounds, self.hierarchy, self._adam = rounds, hierarchy, adam

    def exchange(self, lane, ex):
        """One bucket's exchange on ``lane`` (the state's engine runs it), as stages:
        unscale, the topology's split, the method (the warm-up's choice, Adam's transforms,
        the guard), rescale. ``ex.plain``: a reduce(x, ctx) run instead of the method's,
        without memory or guard (local_steps: an inner step's node average, the buffers'
        average)."""
        buf, step, scale = ex.buf, ex.step, ex.scale
        if ex.bucket == 0 and self.telemetry.logging:
            # the last step every exchange of which has finished by now
            last = step - 1 - self.config.delay
            self.telemetry.write(last, self.memory, self.warmup.compressing(last))
        traffic = Traffic()
        for c in lane.comms():
            c.traffic = traffic
        x = buf if buf.dtype == torch.float32 else buf.float()
        if scale is not None:  # memory holds unscaled values: the loss scale may change
            x = x / scale
        t0, c0 = time.perf_counter(), time.thread_time()
        ctx, run = self.split(lane, ex)
        adam = self._adam()
        if ex.plain is not None:
            out = run(x, ex.plain)
        elif self.compressor.stateless:
            out = run(x, self.compressor.reduce)
        else:
            out = self.method(ctx, lane, x, run, adam)
        ctx.finish(True)  # unguarded paths' memory_next buffers (the guard finished its own)
        if scale is not None:
            out = out * scale
        if out is not buf:
            buf.copy_(out)
        if (ex.plain is None and adam is not None and not self.compressor.stateless
                and not self.warmup.dense(step) and not self.rounds.active):
            adam.record(step, buf, ex.slices, scale)  # for the clip (hooks/optimizer/adam.py)
        traffic.total_s += time.perf_counter() - t0
        traffic.total_cpu_s += time.thread_time() - c0
        self.telemetry.add(step, traffic, buf.numel() * buf.element_size(),
                           keep=step - self.config.delay - 4)
        return buf

    def split(self, lane, ex):
        """(the bucket's context, ``run(y, method)``): the method over the whole bucket on
        the lane's comm (flat), or under a hierarchical topology on this rank's shard of the
        node's reduce-scatter, allgathered after."""
        params, tensors = ex.slices, ex.params
        if lane.inter is None:
            ctx = BucketCtx(self, lane.comm, ex.bucket, params, tensors, ex.buf.device,
                            ex.step, ex.live)
            ctx.grad_dtype = ex.buf.dtype
            return ctx, lambda y, method: method(y, ctx)
        shards = self.hierarchy.shards(params, lane.intra.rank, ex.buf.device)
        ctx = BucketCtx(self, lane.inter, ex.bucket, shards.mine, shards.pieces(tensors),
                        ex.buf.device, ex.step, shards.live(ex.live))
        ctx.grad_dtype = ex.buf.dtype
        L, real = lane.intra.world_size, shards.real

        def run(y, method):
            node = lane.intra.reduce_scatter(shards.gather(y)).div_(L)
            if real:  # the method sees this rank's pieces, not the shard's padding; ranks of
                # one local index hold the same pieces, so they agree on skipping
                node[:real] = method(node[:real], ctx)
            node[real:] = 0
            return shards.scatter(lane.intra.allgather(node).reshape(-1))
        return ctx, run

    def method(self, ctx, lane, x, run, adam):
        """A stateful method's exchange of x: dense in the warm-up (DGC's dense step still
        moves its velocity: guarded too; bf16, int8 or int4 on the wire with
        ``dense_wire``), else compressed, in Adam's terms where Adam is bound (``adam``);
        inside the inf/NaN guard."""
        step, params, comp = ctx.step, ctx.params, self.compressor
        dense = self.warmup.dense(step)
        # the residual diagnostic: compressed steps, flat topology (not measured per shard)
        slot = (comp.residual_slot if ctx.details and self.config.error_feedback
                and not dense and lane.inter is None else None)
        if slot:
            names = [p.name for p in params]
            owed = sq_norm(x, params, self.memory.peek(slot, names))
        ctx.dense_wire = dense_wire(self.config, adam is not None) if dense else None
        fn = comp.dense if dense else comp.reduce
        x, back = (x, None) if dense or adam is None else _adam_in(adam, params, x)
        # a step's (or an outer round's) exchanges all over before the next one begins: its
        # flags read then
        out = self.guard.run(x, ctx, lane.comm, lambda y: run(y, fn), late=not self.config.delay)
        if back is not None:
            out = back(out)
        if slot and self.guard.skipped != step:
            kept = sq_norm(None, params, self.memory.peek(slot, names))
            self.telemetry.log_ratio(step, "residual_energy", kept, owed)
        return out


def _adam_in(adam, params, x):
    """Adam's transforms (hooks/optimizer/adam.py): the next first moment a g + b where the
    moment is exchanged, the update's own scale g / sqrt(v) where it preconditions; returns
    (what the method exchanges, what turns its average back)."""
    pre = adam.scale(params, x.device)
    mom = adam.momentum(params, x.device)
    if mom is not None:
        x = torch.addcmul(mom[1], x, mom[0])
    if pre is not None:
        x = x * pre

    def back(out):
        if pre is not None:
            out = out / pre
        if mom is not None:
            out = (out - mom[1]).div_(mom[0])
        return out
    return x, back
