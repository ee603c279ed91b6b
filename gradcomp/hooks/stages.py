"""One bucket's exchange, in stages (:func:`exchange` runs them on a lane): the
topology's split (:func:`split`), then the method's stage (:func:`method`): the warm-up's
choice between the dense and the compressed exchange, Adam's transforms in and out, the
inf/NaN guard around the exchange, and the residual diagnostic."""
from __future__ import annotations

import time

import torch

from ..comm import Traffic
from . import optimizer as optimizer_binding
from .context import BucketCtx
from .telemetry import sq_norm


def exchange(state, lane, ex):
    """One bucket's exchange on ``lane`` (the state's engine runs it), as stages: unscale,
    the topology's split, the method (the warm-up's choice, Adam's transforms, the guard),
    rescale. ``ex.plain``: a reduce(x, ctx) run instead of the method's, without memory
    or guard (local_steps: an inner step's node average, the buffers' average)."""
    buf, step, scale = ex.buf, ex.step, ex.scale
    if ex.bucket == 0 and state.telemetry.logging:
        # the last step every exchange of which has finished by now
        last = step - 1 - state.config.delay
        state.telemetry.write(last, state.memory, state.warmup.compressing(last))
    traffic = Traffic()
    for c in lane.comms():
        c.traffic = traffic
    x = buf if buf.dtype == torch.float32 else buf.float()
    if scale is not None:  # memory holds unscaled values: the loss scale may change
        x = x / scale
    t0, c0 = time.perf_counter(), time.thread_time()
    ctx, run = split(state, lane, ex)
    if ex.plain is not None:
        out = run(x, ex.plain)
    elif state.compressor.stateless:
        out = run(x, state.compressor.reduce)
    else:
        out = method(state, ctx, lane, x, run)
    ctx.finish(True)  # unguarded paths' memory_next buffers (the guard finished its own)
    if scale is not None:
        out = out * scale
    if out is not buf:
        buf.copy_(out)
    if (ex.plain is None and state.adam is not None and not state.compressor.stateless
            and not state.warmup.dense(step) and not state.rounds.active):
        state.adam.record(step, buf, ex.slices, scale)  # for the clip (hooks/optimizer/adam.py)
    traffic.total_s += time.perf_counter() - t0
    traffic.total_cpu_s += time.thread_time() - c0
    state.telemetry.add(step, traffic, buf.numel() * buf.element_size(),
                        keep=step - state.config.delay - 4)
    return buf


def split(state, lane, ex):
    """(the bucket's context, ``run(y, method)``): the method over the whole bucket on the
    lane's comm (flat), or under a hierarchical topology on this rank's shard of the node's
    reduce-scatter, allgathered after."""
    params, tensors = ex.slices, ex.params
    if lane.inter is None:
        ctx = BucketCtx(state, lane.comm, ex.bucket, params, tensors, ex.buf.device, ex.step,
                        ex.live)
        ctx.grad_dtype = ex.buf.dtype
        return ctx, lambda y, method: method(y, ctx)
    shards = state.hierarchy.shards(params, lane.intra.rank, ex.buf.device)
    ctx = BucketCtx(state, lane.inter, ex.bucket, shards.mine, shards.pieces(tensors),
                    ex.buf.device, ex.step, shards.live(ex.live))
    ctx.grad_dtype = ex.buf.dtype
    L, real = lane.intra.world_size, shards.real

    def run(y, method):
        node = lane.intra.reduce_scatter(shards.gather(y)).div_(L)
        if real:  # the method sees this rank's pieces, not the shard's padding; ranks of one
            # local index hold the same pieces, so they agree on skipping
            node[:real] = method(node[:real], ctx)
        node[real:] = 0
        return shards.scatter(lane.intra.allgather(node).reshape(-1))
    return ctx, run


def method(state, ctx, lane, x, run):
    """A stateful method's exchange of x: dense in the warm-up (DGC's dense step still moves
    its velocity: guarded too; bf16, int8 or int4 on the wire with ``dense_wire``), else
    compressed, in Adam's terms where Adam is bound; inside the inf/NaN guard."""
    step, params = ctx.step, ctx.params
    dense = state.warmup.dense(step)
    # the residual diagnostic: compressed steps, flat topology (not measured per shard)
    slot = (state.compressor.residual_slot if ctx.details and state.config.error_feedback
            and not dense and lane.inter is None else None)
    if slot:
        names = [p.name for p in params]
        owed = sq_norm(x, params, state.memory.peek(slot, names))
    ctx.dense_wire = optimizer_binding.dense_wire(state) if dense else None
    fn = state.compressor.dense if dense else state.compressor.reduce
    x, back = (x, None) if dense or state.adam is None else _adam_in(state.adam, params, x)
    # a step's (or an outer round's) exchanges all over before the next one begins: its
    # flags read then
    out = state.guard.run(x, ctx, lane.comm, lambda y: run(y, fn), late=not state.config.delay)
    if back is not None:
        out = back(out)
    if slot and state.guard.skipped != step:
        kept = sq_norm(None, params, state.memory.peek(slot, names))
        state.telemetry.log_ratio(step, "residual_energy", kept, owed)
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
