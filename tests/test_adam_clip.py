"""Gradient clipping in a compressed step under Adam (hooks/optimizer/adam.py, "Gradient
clipping"): the norm a user's clip_grad_norm_ sees there is the exchanged gradients', which
carries the compression error; the binding takes the clip off the compressed steps (the
dense steps keep it)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import batch, small_net
from gradcomp.hooks.optimizer import FrozenVariance


def _binding_step(max_norm, back, small, unclip=True, split=False):
    """One compressed AdamW step of two 2-D weights (compressed) and a bias (not), after
    one dense step; what the exchange handed back is ``back`` (the weights, flat) and
    ``small`` (the bias). ``max_norm``: the user's clip (None: none); ``split``: the weights
    recorded as two buckets, in reverse order. Returns the parameters after the step."""
    torch.manual_seed(0)
    w, u, b = nn.Parameter(torch.randn(4, 8)), nn.Parameter(torch.randn(3, 8)), nn.Parameter(torch.randn(8))
    opt = torch.optim.AdamW([w, u, b], lr=1e-2)
    flag = [False]
    binding = FrozenVariance(opt, lambda p: p.dim() >= 2, lambda: flag[0],
                             {id(w): "w", id(u): "u", id(b): "b"}, unclip=unclip)
    for p in (w, u, b):
        p.grad = torch.ones_like(p)
    opt.step()  # dense: Adam's own step, v learned
    flag[0] = True
    bucket = torch.cat([back, small])
    spans = [SimpleNamespace(name="w", offset=0, numel=32),
             SimpleNamespace(name="u", offset=32, numel=24),
             SimpleNamespace(name="b", offset=56, numel=8)]
    if split:  # another layout: each weight its own bucket, the later one first
        binding.record(1, bucket[32:], [SimpleNamespace(name="u", offset=0, numel=24),
                                        SimpleNamespace(name="b", offset=24, numel=8)])
        binding.record(1, bucket[:32], spans[:1])
    else:
        binding.record(1, bucket, spans)
    w.grad, u.grad, b.grad = back[:32].view(4, 8).clone(), back[32:].view(3, 8).clone(), small.clone()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_([w, u, b], max_norm)
    opt.step()
    binding.close()
    return torch.cat([w.detach().reshape(-1), u.detach().reshape(-1), b.detach()])


def _grads():
    g = torch.Generator().manual_seed(1)
    return 3 * torch.randn(56, generator=g), 0.1 * torch.randn(8, generator=g)


def test_a_clip_of_a_compressed_step_is_taken_off():
    back, small = _grads()
    free = _binding_step(None, back, small)
    assert torch.allclose(_binding_step(1.0, back, small), free, rtol=0, atol=1e-6)
    # left on, the clip shrinks the step (what this guards against)
    assert not torch.allclose(_binding_step(1.0, back, small, unclip=False), free,
                              rtol=0, atol=1e-4)


def test_no_clip_changes_nothing_and_the_layout_does_not_matter():
    back, small = _grads()
    free = _binding_step(None, back, small, unclip=False)
    assert torch.equal(_binding_step(None, back, small), free)
    assert torch.equal(_binding_step(1e9, back, small), free)
    # the buckets' norms are summed in name order: another layout, the same bits
    assert torch.equal(_binding_step(1.0, back, small, split=True),
                       _binding_step(1.0, back, small))


def _clipped_job(rank, world, max_norm, steps=4, clip_from=0):
    """topk, two dense steps then compressed ones, AdamW with the first moment exchanged;
    the user clips at ``max_norm`` (None: no clip) from step ``clip_from`` on. Returns the
    parameters after the last step."""
    torch.manual_seed(0)
    net = small_net()
    model = DDP(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    gradcomp.register(model, "topk", optimizer=opt, dense_steps=2, min_numel=0, ratio=0.1)
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if max_norm is not None and step >= clip_from:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _clip_jobs(rank, world):
    free = _clipped_job(rank, world, None)
    late = _clipped_job(rank, world, 1e-3, clip_from=2)  # the compressed steps only
    every = _clipped_job(rank, world, 1e-3)
    gathered = [torch.zeros_like(every) for _ in range(world)]
    torch.distributed.all_gather(gathered, every)
    return {"free": free, "late": late, "every": every,
            "agree": all(torch.equal(t, gathered[0]) for t in gathered)}


def test_ddp_clip_holds_in_the_dense_steps_and_is_off_in_the_compressed_ones(spawn):
    for r in spawn(_clip_jobs, world=2):
        # a clip in the compressed steps only: the unclipped job's parameters, to rounding
        assert torch.allclose(r["late"], r["free"], rtol=0, atol=1e-6)
        # a clip from the first step: the dense steps' exact gradients are clipped
        assert not torch.allclose(r["every"], r["free"], rtol=0, atol=1e-4)
        assert r["agree"]


def _notice_and_keep_clip(rank, world):
    """topk (two dense steps, then compressed), AdamW, a clip at 1e-3 on every step, with
    and without keep_clip: the gradients' norm each compressed step of Adam steps on, and
    the notices this rank was given."""
    import warnings
    out = {}
    for keep in (False, True):
        torch.manual_seed(0)
        net = small_net()
        model = DDP(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        state = gradcomp.register(model, "topk", optimizer=opt, dense_steps=2, min_numel=0,
                                  ratio=0.1, keep_clip=keep)
        norms, step_group = [], state._state.adam._step_group

        def spy(group, params, *args, step_group=step_group, **kw):  # the frozen Adam step
            norms.append(float(torch.linalg.vector_norm(torch.stack(
                [p.grad.norm() for p in net.parameters()]))))
            return step_group(group, params, *args, **kw)
        state._state.adam._step_group = spy
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(5):
                x, y = batch(rank, step)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
                opt.step()
        out[keep] = (norms, [str(w.message) for w in seen if "clip" in str(w.message)])
        state.close()
    return out


def test_taking_the_clip_off_is_announced_once_and_keep_clip_keeps_it(spawn):
    r0, r1 = spawn(_notice_and_keep_clip, world=2)
    (off, notices), (kept, quiet) = r0[False], r0[True]
    assert len(notices) == 1 and "from optimizer step 2" in notices[0]
    assert "keep_clip=True" in notices[0]
    assert r1[False][1] == [] and quiet == [] and r1[True][1] == []  # rank 0 only, once
    assert len(off) == len(kept) == 3  # the compressed steps
    # kept: Adam steps on the user's clipped norm; taken off: on the exchanged gradients'
    assert all(abs(n - 1e-3) < 1e-6 for n in kept), kept
    assert all(n > 1e-2 for n in off), off
