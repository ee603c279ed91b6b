"""The FSDP2 adapter: ``gradcomp.register(model, method, optimizer=opt)`` on a model sharded
with ``torch.distributed.fsdp.fully_shard``. Beside the DDP adapter (ddp.py), it reuses the
hook state's exchange (``entries.reduce``: the method, its per-parameter memory, the
inf/NaN guard, the adaptive warm-up, the Adam binding, stats and checkpoints) and changes only
where a gradient enters and leaves it.

Each ``fully_shard`` call makes one FSDP parameter group, whose gradients FSDP reduces as one
flat buffer (a "bucket" here), laid out per parameter: each parameter cut along dim 0 into as
many chunks as the shard group has ranks (``torch.chunk``), each chunk padded to the first's
size; the reduce-scatter input holds rank 0's chunk of every parameter, then rank 1's, ...

* **FSDP** (a 1-D mesh): FSDP's reduce-scatter is replaced
  (``FSDPModule.set_custom_reduce_scatter``). Each rank gathers its whole contribution per
  parameter (the real elements, no padding), the method averages it over the ranks exactly as
  under DDP (error feedback on the rank's full contribution, kept per parameter), and the rank
  keeps its own chunk. The wire carries the method's message of the whole gradient (its
  allgather or allreduce), not a 1/W share of it: against FSDP's dense reduce-scatter the
  bytes fall by the method's ratio divided by W (W ranks in the shard group). It is the setting for a few ranks on a slow link; across
  many ranks and nodes use HSDP, where the full ratio applies to the slow link.
* **HSDP** (a 2-D mesh ``(replicate, shard)``: shard inside a node, replicate across nodes):
  the reduce-scatter inside the node stays FSDP's own (dense, the fast link); the all-reduce of
  each shard across replicas (the slow link) is the method's: FSDP's native all-reduce runs on
  a group of one rank (a no-op) and the shard is averaged across its replicas from
  ``FSDPModule.set_all_reduce_hook``, in place, with error feedback per shard. Each rank's
  piece of a parameter is kept as ``name#s/S`` (shard s of S), as under DDP's hierarchical
  topology; the warm-up's statistics and its switch are the whole mesh's.
  With ``local_steps=H`` (``sparseloco``, ``diloco``; INTELLECT-1's DiLoCo over FSDP2) the
  inner steps keep the node's average (the hook returns at once: nothing crosses nodes) and
  every H steps each rank's pieces go through the method as one outer bucket across their
  replicas (hooks/local_steps.py): each rank keeps the global point of its own rows.

Exchanges are issued in FSDP's reduce step, in FSDP's module order, which is the same on
every rank, and run on the state's first lane (its thread; on a GPU its stream) while
backward goes on (``_Adapter.later``); an autograd callback at the end of backward waits for
them and puts each result where FSDP views the gradient (``_overlaps``: where FSDP would add,
cast or copy the reduced gradient instead, the exchange runs at once). Every parameter goes
through every step (``set_reduce_scatter_unused_params(True)``: a parameter without a
gradient sends zeros, as DDP's ``find_unused_parameters``), so a bucket's layout never changes.
Refused with a message (gradcomp/rules.py, the option rules): ``delay``, ``local_steps`` on
a 1-D mesh, ``local_delay``, ``topology=hierarchical`` (HSDP is the hierarchy), ``scaler``
(use bf16 mixed precision), ``adam='precondition'``/``'momentum'`` (``'auto'`` runs
``'freeze'``: a rank holds only its shard of Adam's moments); the method's own: ``dgc`` with
weight decay on a 1-D mesh (it reads parameter values a rank does not hold), a parameter
sharded on a dim other than 0, several FSDP parameter groups in one ``fully_shard``.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist

from ..compressors.base import METHODS, ParamSlice
from .. import rules
from . import optimizer as optimizer_binding
from .options import for_optimizer, is_auto
from .. import comm
from .agree import Groups, agree, check_log_dir, discard, fingerprint, trainable
from .checkpoint import load_group
from .guard import check_steps, step_flag
from .local_steps import check_outer_optimizer, outer_pieces, synchronous
from .plan import Plan, Sharding
from .public import State
from .state import HookState
from .topology import SEP


def is_fsdp(model) -> bool:
    """Whether ``model`` was sharded with ``fully_shard`` (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover (torch without FSDP2)
        return False
    return isinstance(model, FSDPModule)


_REGISTERED = weakref.WeakSet()  # the models a state is registered on, until its close()


def _units(model):
    """(module, its FSDP parameter group) for every ``fully_shard``-ed module, in module
    order (the order is the same on every rank)."""
    from torch.distributed.fsdp import FSDPModule
    out, seen = [], set()
    for mname, mod in model.named_modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        if id(state) in seen:  # fully_shard([a, b]): the modules share one state and group
            continue
        seen.add(id(state))
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before 2.12: one group per state, or none
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        if len(groups) > 1:
            raise ValueError(f"module {mname or '<root>'!r} has {len(groups)} FSDP parameter "
                             f"groups (a per-parameter mesh, shard_placement_fn): allowed one "
                             f"mesh per fully_shard call")
        if groups:
            out.append((mname, mod, groups[0]))
    return out


class _UnitLayout:
    """One FSDP parameter group's place in the flat reduce-scatter input / output (module doc):
    the parameters that take gradients (FSDP leaves frozen ones out), each at ``o`` in every
    rank's block of ``block`` elements, ``n`` padded, ``N`` whole, ``m`` of them this rank's.

    ``full``: the parameters whole, real elements only, end to end (the 1-D mesh's exchange);
    ``piece``: this rank's rows of each as a ParamSlice of the packed real elements (HSDP's).
    Layout moves are views and one ``cat`` / one ``_foreach_copy_``: no index tensors."""

    def __init__(self, group, names: dict[int, str], W: int, me: int, hsdp: bool):
        self.W, self.me, self.hsdp = W, me, hsdp
        self.spans, full, piece = [], [], []  # spans: (o, n, N, m, offset in full)
        o, f, q = 0, 0, 0  # offset in one rank's block, in full, in the packed piece
        for fp in group.fsdp_params:
            if not fp.sharded_param.requires_grad:
                continue  # not in FSDP's reduce-scatter
            name = names.get(id(fp.sharded_param))
            if name is None:
                raise ValueError("an FSDP parameter is not a parameter of the registered "
                                 "model: register the root module fully_shard returned")
            dim = fp.fsdp_placement.dim if hasattr(fp, "fsdp_placement") else 0
            if dim != 0:
                raise ValueError(f"parameter {name!r} is sharded on dim {dim}: allowed Shard(0) "
                                 f"(fully_shard's default)")
            N = fp._orig_size.numel()
            n = fp.padded_sharded_param_size.numel()  # one rank's padded chunk
            m = fp.sharded_size.numel()               # this rank's real elements
            full.append(ParamSlice(name, tuple(fp._orig_size), f, N))
            if m:
                piece.append(ParamSlice(f"{name}{SEP}{me}/{W}", tuple(fp.sharded_size), q, m, N))
            self.spans.append((o, n, N, m, f))
            o, f, q = o + n, f + N, q + m
        self.block, self.full, self.piece = o, full, piece
        self.padded = q != o  # some of this rank's block is padding

    def check(self, numel: int, per_rank: bool) -> None:
        want = self.block if per_rank else self.block * self.W
        if numel != want:  # (the forward's check, _check_frozen, names it before this)
            raise RuntimeError(f"gradcomp: FSDP reduced {numel} elements where the registered "
                               f"layout has {want}: parameters were frozen or unfrozen after "
                               f"gradcomp.register, or (torch before 2.12, which leaves them out "
                               f"of the reduce-scatter) a parameter took no gradient this step")

    def gather(self, inp: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter input (W blocks) -> each parameter whole, end to end."""
        rows = inp.reshape(self.W, self.block)
        return torch.cat([rows[:, o : o + n].reshape(-1)[:N] for o, n, N, _, _ in self.spans])

    def mine(self, buf: torch.Tensor, whole: bool):
        """This rank's real elements of each parameter in ``buf``: (its block's views, the
        matching views of ``buf``) where ``buf`` is the whole layout (``whole``) or the packed
        pieces."""
        out, src, q = [], [], 0
        for o, n, N, m, f in self.spans:
            if m:
                out.append((o, m))
                src.append(buf[f + self.me * n : f + self.me * n + m] if whole else buf[q : q + m])
                q += m
        return out, src


class _Adapter:
    """The per-module entry points FSDP calls: the reduce-scatter (1-D mesh) or the
    all-reduce hook (HSDP), each numbering its calls within one backward as the state's
    buckets (bucket 0 begins a step, on every rank at the same unit)."""

    def __init__(self, state: HookState, hsdp: bool):
        self.state, self.hsdp = state, hsdp
        self.calls = 0  # exchanges of this backward so far (reset by the root's forward)
        self.pending: list = []  # (future, what puts its result in FSDP's buffer)

    def begin_forward(self, *_):
        self.calls = 0
        if self.pending:  # a backward that stopped before its end: its exchanges waited for
            self.finish()

    def later(self, fut, put) -> None:
        """An exchange runs on the state's lane while backward goes on; ``put(average)``
        writes its result where FSDP keeps the gradient, at the end of this backward (an
        autograd callback, before anything reads the gradients)."""
        if not self.pending:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            except RuntimeError:  # not inside a backward pass: nothing to overlap with
                put(fut.wait())
                return
        self.pending.append((fut, put))

    def finish(self) -> None:
        """Backward is over: wait for its exchanges in their order and put their results."""
        pending, self.pending = self.pending, []
        for fut, put in pending:
            put(fut.wait())

    def bucket(self) -> int:
        b, self.calls = self.calls, self.calls + 1
        return b

    def full(self, lay: _UnitLayout, group, output, input, op):
        """The 1-D mesh: this rank's chunk of the method's average of the whole gradient.
        Overlapped where FSDP only views the output (:func:`_overlaps`): FSDP divides the
        output by its post-divide factor right away, so the result is put in divided."""
        lay.check(input.numel(), per_rank=False)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise RuntimeError(f"gradcomp's FSDP reduce-scatter got op {op}: allowed AVG or SUM "
                               f"(leave set_gradient_divide_factor unset)")
        out = output.reshape(-1)
        # FSDP asked for a sum (fp16 reduce dtype: it divides): the average times W
        times = lay.W if op == dist.ReduceOp.SUM else 1

        def put(avg, post=1.0):
            avg = avg * (times / post) if times != post else avg
            out.zero_()
            spans, src = lay.mine(avg.to(out.dtype), whole=True)
            if spans:
                torch._foreach_copy_([out[o : o + m] for o, m in spans], src)

        x, b = lay.gather(input), self.bucket()
        if not _overlaps(group, out):
            return put(self.state.entries.reduce(x, lay.full, b))
        post = _post_factor(group, out)
        self.later(self.state.entries.slices(b, x, lay.full), lambda avg: put(avg, post))

    def shard(self, lay: _UnitLayout, group, out: torch.Tensor, params):
        """HSDP: the node's sum of this rank's shard -> the job's average over replicas (in
        place; FSDP then divides by the node's size: set_force_sum_reduction_for_comms)."""
        if group.gradient_divide_factor is not None:
            raise RuntimeError("gradcomp under HSDP: set_gradient_divide_factor is not "
                               "supported (the cross-node exchange averages); leave it unset")
        out = out.reshape(-1)
        lay.check(out.numel(), per_rank=True)
        if self.state.rounds.active:  # an inner step: the node's average, nothing across nodes
            self.state.telemetry.hand(out.numel() * out.element_size())
            if self.state.rounds.syncing and lay.piece:  # ... but in the first sync_steps
                self._synchronous(lay, group, out)
            return
        b = self.bucket()
        if not lay.piece:  # no rows of this unit here (nor on this shard's replicas): the
            step = self.state.begin(b)  # step still begins at bucket 0 on every rank, and
            if not self.state.compressor.stateless:  # the flag goes round the whole mesh
                flag = step_flag(torch.zeros(1, device=out.device), step)
                comm.all_reduce_now(flag, "max", self.state.stats_group)
                check_steps(flag.tolist())
            return
        # FSDP hands over the node's sum over its pre-divide factor and divides by ``post``
        # afterwards: the method sees (and its memory keeps) the node's average, as under DDP
        post = _post_factor(group, out)
        if _overlaps(group, out):  # FSDP divides now: the average is put in as it is
            spans, _ = lay.mine(out, whole=False)
            x = torch.cat([out[o : o + m] for o, m in spans]) if lay.padded else out.clone()
            if post != 1:
                x.div_(post)

            def put(avg):
                torch._foreach_copy_([out[o : o + m] for o, m in spans],
                                     lay.mine(avg, whole=False)[1])
            return self.later(self.state.entries.slices(b, x, lay.piece, params()), put)
        if not lay.padded:
            x = out if post == 1 else out.div_(post)
            self.state.entries.reduce(x, lay.piece, b, params())
            if post != 1:
                out.mul_(post)
            return
        self._rows(lay, out, post, lambda x: self.state.entries.reduce(x, lay.piece, b, params()))

    def _synchronous(self, lay: _UnitLayout, group, out: torch.Tensor) -> None:
        """One of the first ``sync_steps`` of local steps: this rank's rows of the node's
        average averaged over their replicas, dense (``dense_wire``), on the caller's
        thread."""
        st = self.state
        b, wire = self.bucket(), optimizer_binding.dense_wire(st.config, st.adam is not None)
        self._rows(lay, out, _post_factor(group, out), lambda x: self.state.entries.reduce(
            x, lay.piece, b, plain=synchronous(wire)))

    @staticmethod
    def _rows(lay: _UnitLayout, out: torch.Tensor, post: float, reduce) -> None:
        """This rank's rows of ``out`` (padded: cut out of it) through ``reduce`` (x -> their
        average over the replicas), FSDP's ``post`` divide taken off before and put back
        after, written back into ``out``."""
        spans, _ = lay.mine(out, whole=False)
        x = torch.cat([out[o : o + m] for o, m in spans])
        if post != 1:
            x.div_(post)
        x = reduce(x)
        if post != 1:
            x = x * post
        torch._foreach_copy_([out[o : o + m] for o, m in spans], lay.mine(x, whole=False)[1])


def _post_factor(group, out) -> float:
    """What FSDP divides the reduce-scatter's (1-D) or all-reduce's (HSDP) output by (its own
    rule, for this reduce dtype)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
    _, post, _, _ = _get_gradient_divide_factors(
        group._reduce_scatter_process_group,
        getattr(group.mesh_info, "replicate_process_group", None), out.dtype,
        out.device.type, group.gradient_divide_factor, group.force_sum_reduction_for_comms)
    return 1.0 if post is None else float(post)


def _overlaps(group, out) -> bool:
    """Whether the exchange may run beside the rest of backward: FSDP only views its output as
    the parameters' gradients (no cast to another dtype, no gradient to add to, no copy to the
    CPU), so the result can be put there when backward ends. Otherwise it runs at once."""
    return all(fp.sharded_param.grad is None and fp.sharded_param.dtype == out.dtype
               and not getattr(fp, "offload_to_cpu", False) for fp in group.fsdp_params)


def _reduce_scatter(adapter, lay, fsdp_group):
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class GradcompReduceScatter(ReduceScatter):
        """FSDP's reduce-scatter through gradcomp (hooks/fsdp.py)."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            adapter.full(lay, fsdp_group, output_tensor, input_tensor, op)
            return None

    return GradcompReduceScatter()


def check_model(model):
    """(units, mesh info, HSDP?, every rank of the mesh) of a ``fully_shard``-ed model;
    ValueError naming what the adapter does not take."""
    units = _units(model)
    if not units:
        raise ValueError("the model is an FSDPModule with no parameters to shard")
    info = units[0][2].mesh_info
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
    if not isinstance(info, FSDPMeshInfo):
        raise ValueError(f"gradcomp needs a sharded model (fully_shard with a 1-D or 2-D mesh), "
                         f"got mesh {type(info).__name__}")
    mesh = info.mesh
    for mname, _, g in units:
        if g.mesh_info.mesh != mesh:
            raise ValueError(f"module {mname or '<root>'!r} is sharded on another mesh than the "
                             f"root's: allowed one mesh for the whole model")
    everyone = sorted(mesh.mesh.reshape(-1).tolist())
    if everyone != list(range(dist.get_world_size())):
        raise ValueError(f"the model's FSDP mesh holds ranks {everyone[:8]}{'...' if len(everyone) > 8 else ''}"
                         f" of a world of {dist.get_world_size()}: allowed a mesh over every "
                         f"rank (FSDP or HSDP alone; not combined with tensor or pipeline "
                         f"parallelism)")
    return units, info, isinstance(info, HSDPMeshInfo), everyone


def register_fsdp(model, method: str, *, optimizer=None, scaler=None, log_dir=None,
             log_all_ranks=False, log_details=False, outer_optimizer=None,
             **options) -> HookState:
    """``gradcomp.register`` for a ``fully_shard``-ed model (see the module doc): validate
    and agree, the process groups, the state built once from its plan (hooks/plan.py), FSDP's
    hooks, then the optimizer."""
    units, info, hsdp, everyone = check_model(model)  # (register checked it on every rank)
    groups = Groups(dist.get_backend(info.shard_process_group))
    world = groups.new(everyone)  # registration's agreement; HSDP: the warm-up's statistics
    group = _exchange_group(info, hsdp, groups)
    writes = log_all_ranks or dist.get_rank(world) == 0
    (name, config, names, numels, layouts, pieces), _ = agree(
        world, everyone, lambda: _validate(model, units, info, hsdp, method, optimizer, scaler,
                                           writes, log_dir, options, outer_optimizer),
        lambda _: discard(groups.made))
    with groups.undone_on_error():
        plan = Plan(sharding=Sharding.HSDP if hsdp else Sharding.FSDP,
                    stats_group=world if hsdp else None,
                    load_group=load_group(everyone, groups.made))
        # FSDP's own all-reduce under HSDP goes on a group of one (every rank creates every
        # one-rank group, in the same order)
        alone = ([groups.new([r]) for r in everyone][everyone.index(dist.get_rank())]
                 if hsdp else None)
        state = HookState(name, config, group=group, param_names=names, param_numels=numels,
                              plan=dataclasses.replace(plan, owned_groups=tuple(groups.made)))
    _install(model, state, units, layouts, alone)
    state.bind_optimizer(optimizer, module=model, bucket_bytes=_ONE_OUTER_BUCKET,
                         pieces=pieces, warn=dist.get_rank(world) == 0, stacklevel=5,
                         outer_optimizer=outer_optimizer)
    if log_dir is not None and writes:
        from torch.utils.tensorboard import SummaryWriter
        State(state).attach(SummaryWriter(log_dir), details=log_details)
    _REGISTERED.add(model)  # last: a registration that raised leaves no mark
    state.on_close(lambda: _REGISTERED.discard(model))
    return state


def _exchange_group(info, hsdp: bool, groups):
    """The exchange's group: the whole mesh (1-D: the agreement's group, made first), or
    this shard's replicas across nodes (HSDP; every rank creates every group, in order)."""
    if not hsdp:
        return groups.made[0]
    grid = info.mesh.mesh.reshape(-1, info.shard_mesh_size)
    replicas = [groups.new(grid[:, s].tolist()) for s in range(grid.shape[1])]
    return replicas[info.shard_mesh_rank]


def _validate(model, units, info, hsdp, method, optimizer, scaler, writes, log_dir, options,
              outer_optimizer=None):
    """Registration's checks on this rank (agree() compares the result on every rank):
    (name, config, parameter names, numels, each unit's layout, HSDP's outer pieces)."""
    if is_auto(method):
        raise ValueError("method='auto' under FSDP/HSDP: not supported (its probe times "
                         "DDP's exchange); name a method, e.g. 'terngrad' with AdamW")
    check_log_dir(log_dir, writes)  # before anything is attached
    if model in _REGISTERED:
        raise ValueError("this FSDP model is registered already: call state.close() on "
                         "its state first (one gradcomp state per model; closing an "
                         "older one puts FSDP's own collectives back)")
    name, config = for_optimizer(method, options, optimizer)
    optimizer_binding.check_method(name, config, optimizer)
    rules.check(config, rules.Job.given(rules.HSDP if hsdp else rules.FSDP, optimizer, scaler,
                                        outer_optimizer))
    why = None if hsdp else METHODS[name].compressor.sharded_refusal(
        config, optimizer_binding.has_weight_decay(optimizer))
    if why:  # the method's own, on a 1-D mesh
        raise ValueError(why)
    check_outer_optimizer(outer_optimizer)
    names, numels = trainable(model)
    W, me = info.shard_mesh_size, info.shard_mesh_rank
    layouts = [_UnitLayout(g, names, W, me, hsdp) for _, _, g in units]
    if hsdp:  # the memory holds this rank's pieces: their sizes are what a checkpoint holds
        numels.update({s.name: s.numel for lay in layouts for s in lay.piece})
    held = [(names[id(fp.sharded_param)], fp.sharded_param.to_local())  # its row blocks
            for _, _, g in units for fp in g.fsdp_params
            if fp.sharded_param.requires_grad and fp.sharded_size.numel()]
    pieces = outer_pieces(config, held, me, W)
    return (name, config, names, numels, layouts, pieces), {
        "method": name, **config.to_dict(), "mesh": list(info.mesh.mesh.shape),
        **fingerprint(model, optimizer, scaler)}


def _install(model, state, units, layouts, alone) -> None:
    """FSDP's hooks (each undone at ``state.close()``): the step's start and the frozen-
    parameter check before each forward, every parameter in every reduction, and the
    exchange: the all-reduce hook on a group of one (HSDP) or the reduce-scatter (1-D)."""
    adapter = _Adapter(state, alone is not None)
    handle = model.register_forward_pre_hook(adapter.begin_forward)
    state.on_close(handle.remove)
    # before FSDP's own pre-forward (prepend): raised there, FSDP has not started the step
    flags = [(g, [fp.sharded_param.requires_grad for fp in g.fsdp_params]) for _, _, g in units]
    check = model.register_forward_pre_hook(lambda *_: _check_frozen(flags, model),
                                            prepend=True)
    state.on_close(check.remove)
    for _, mod, g in units:  # every parameter in every reduce-scatter: a fixed layout
        if not hasattr(g, "reduce_scatter_unused_params"):
            continue  # torch before 2.12: every parameter must take a gradient (Layout.check)
        old = g.reduce_scatter_unused_params
        g.reduce_scatter_unused_params = True
        state.on_close(lambda g=g, old=old: setattr(g, "reduce_scatter_unused_params", old))
    for (_, mod, g), lay in zip(units, layouts):
        if alone is None:
            old = g._reduce_scatter_comm
            mod.set_custom_reduce_scatter(_reduce_scatter(adapter, lay, g))
            state.on_close(lambda g=g, old=old: setattr(g, "_reduce_scatter_comm", old))
        else:
            _install_hsdp(state.on_close, adapter, mod, g, lay, alone)


def _install_hsdp(on_close, adapter, mod, g, lay, alone) -> None:
    """HSDP: FSDP's own all-reduce on a group of one (a no-op), as a sum (FSDP divides by the
    node's size after the hook); ours runs from the hook. ``on_close(undo)``: undone at the
    state's close."""
    old = (g.mesh_info.replicate_process_group, g.force_sum_reduction_for_comms,
           g._all_reduce_hook)
    g.mesh_info.replicate_process_group = alone
    g.force_sum_reduction_for_comms = True
    tensors = [fp.sharded_param for fp in g.fsdp_params
               if fp.sharded_param.requires_grad and fp.sharded_size.numel()]

    def params():  # this rank's shards (dgc's weight decay reads them)
        return [t.to_local() for t in tensors]
    mod.set_all_reduce_hook(lambda out: adapter.shard(lay, g, out, params))

    def undo():
        g.mesh_info.replicate_process_group, g.force_sum_reduction_for_comms, \
            g._all_reduce_hook = old
    on_close(undo)


# under HSDP the rounds send one outer bucket of every piece a rank holds: the same number
# of exchanges on every rank of the mesh, whose inf/NaN flag goes round all of them
_ONE_OUTER_BUCKET = 2**62


def _check_frozen(flags, model) -> None:
    """Each forward, before FSDP's: the parameters that take gradients are the ones the layout
    was built for (a flag walk per step). Raised here, FSDP's step has not begun: close the
    state and register again, and training goes on."""
    for g, was in flags:
        now = [fp.sharded_param.requires_grad for fp in g.fsdp_params]
        if now == was or not any(now):  # a unit frozen whole: FSDP reduces nothing of it
            continue
        for fp, before in zip(g.fsdp_params, was):
            if fp.sharded_param.requires_grad != before:
                name = next((n for n, p in model.named_parameters()
                             if p is fp.sharded_param), "?")
                raise RuntimeError(
                    f"gradcomp: parameter {name!r} was {'' if before else 'un'}frozen "
                    f"(requires_grad={fp.sharded_param.requires_grad}) after gradcomp.register: "
                    f"its layout of FSDP's reduce-scatter is fixed at registration; call "
                    f"state.close(), then gradcomp.register(model, ...) again")


