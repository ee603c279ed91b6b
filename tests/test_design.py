"""The shape of the library (issue 31), checked on its source: where collectives are
issued and what imports what. A unit test: it reads files, runs nothing."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "gradcomp"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_to_all", "all_to_all_single",
               "gather_object", "broadcast", "broadcast_object_list", "barrier", "reduce_scatter",
               "reduce_scatter_tensor", "all_gather_into_tensor", "gather", "scatter", "reduce",
               "send", "recv", "isend", "irecv", "monitored_barrier"}


def _calls(path: Path):
    """(line, name) of every call ``<alias of torch.distributed>.<collective>(...)``."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(
                a.name == "distributed" for a in node.names):
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in COLLECTIVES and ast.unparse(node.func.value) in aliases):
            yield node.lineno, node.func.attr


def test_only_comm_issues_collectives():
    """gradcomp/comm.py is the one caller of torch.distributed's collectives: the exchanges'
    (class Comm, ordered by the engine's tickets) and the control plane's (registration's
    agreement, the warm-up's statistics, the topology probe, checkpoints)."""
    found = {f"{p.relative_to(ROOT.parent)}:{line} {name}"
             for p in ROOT.rglob("*.py") if p.name != "comm.py" or p.parent != ROOT
             for line, name in _calls(p)}
    assert not found, f"collectives issued outside gradcomp/comm.py: {sorted(found)}"
    assert any(True for _ in _calls(ROOT / "comm.py"))  # the check sees calls where they are


@pytest.mark.parametrize("layer,below", [
    ("kernels", ()), ("compressors", ("kernels", "config", "comm")),
])
def test_lower_layers_import_nothing_above_them(layer, below):
    """kernels -> compressors -> memory / comm -> hooks: a lower layer never imports a higher
    one (the harness imports the library, never the reverse: test_library_alone.py)."""
    allowed = {layer, *below}
    bad = []
    for p in (ROOT / layer).rglob("*.py"):
        package = p.relative_to(ROOT).parent.parts  # where a relative import starts
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                target = (*base, *(node.module.split(".") if node.module else ()))
                if target and target[0] not in allowed:
                    bad.append(f"{p.name}: from {'.' * node.level}{node.module}")
    assert not bad, bad


# torch's internals the adapters must reach (FSDP2's reduce hooks, GradScaler's scale, a
# view's base, the job's store a load's ranks meet in): named one by one, so a new private
# read of our own objects fails the test
TORCH_PRIVATES = {"_get_fsdp_state", "_fsdp_param_groups", "_reduce_scatter_process_group",
                  "_reduce_scatter_comm", "_all_reduce_hook", "_orig_size", "_scale", "_base",
                  "_comm_hooks", "_execution_engine", "_get_default_store"}
# the one private read of our own objects outside a method: the public state's module reaching the
# hook state behind it (what gradcomp.hook is handed for a hook registered by hand)
OWN_MODULE_PRIVATE = ("gradcomp/hooks/public.py", "_state")


def test_no_module_reads_another_objects_private_attributes():
    """Every component of the state (hooks/warmup.py, delayed.py, local_steps.py, guard.py,
    telemetry.py, topology.py, the checkpoint's assembly, the state itself) is reached through
    its interface: no ``x._name`` where x is not ``self`` (or ``cls``) anywhere in the library,
    and no private name imported from another module."""
    bad = []
    for p in ROOT.rglob("*.py"):
        tree = ast.parse(p.read_text())
        where = p.relative_to(ROOT.parent)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in TORCH_PRIVATES
                    and ast.unparse(node.value) not in ("self", "cls", "torch")
                    and (str(where), node.attr) != OWN_MODULE_PRIVATE):
                bad.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom) and node.level:  # our own modules
                bad += [f"{where}:{node.lineno} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


# what register() returns and gradcomp.State() builds: the user's API, nothing else
PUBLIC_NAMES = {"config", "method", "step", "failed", "stats", "attach", "state_dict",
                 "load_state_dict", "stateful", "all_ranks", "flush", "close", "reduce",
                 "ordered", "trace"}


def _registered(rank, world):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomp
    net = torch.nn.Linear(4, 4)
    state = gradcomp.register(DDP(net), "onebit")
    try:
        return type(state).__qualname__, sorted(n for n in dir(state) if not n.startswith("_"))
    finally:
        state.close()


def test_the_public_state_exposes_the_users_names_only(spawn):
    """register() returns a State whose public names are the user's API (at most 15): the
    hook state behind it (the engine, the components, the adapters' entries) is private, and
    nothing can be added to it."""
    import gradcomp
    assert len(PUBLIC_NAMES) <= 15
    (kind, names), = spawn(_registered, 1, timeout=60)
    assert kind == "State" and set(names) == PUBLIC_NAMES, names
    s = gradcomp.State("onebit")
    try:
        assert isinstance(s, gradcomp.State)
        assert {n for n in dir(s) if not n.startswith("_")} == PUBLIC_NAMES
        for internal in ("memory", "engine", "rounds", "compressor", "submit", "begin"):
            assert not hasattr(s, internal), internal
        with pytest.raises(AttributeError):
            s.engine = None
    finally:
        s.close()


def test_no_class_body_assigns_another_modules_function():
    """A class's methods are its own: none is a function of another module assigned in the
    class body (``reduce = submitting.reduce``), which let every module take the whole state."""
    import importlib
    import inspect
    import pkgutil

    import gradcomp
    bad = []
    for info in pkgutil.walk_packages(gradcomp.__path__, "gradcomp."):
        if info.name.startswith("gradcomp.integrations."):
            continue  # (their frameworks need not be installed)
        mod = importlib.import_module(info.name)
        for cname, cls in vars(mod).items():
            if not inspect.isclass(cls) or cls.__module__ != mod.__name__:
                continue
            for key, value in vars(cls).items():
                fn = getattr(value, "__func__", value)
                if (inspect.isfunction(fn) and fn.__module__.startswith("gradcomp")
                        and fn.__module__ != cls.__module__):
                    bad.append(f"{mod.__name__}.{cname}.{key} = {fn.__module__}.{fn.__qualname__}")
    assert not bad, bad


def test_the_state_owns_components_not_mixins():
    """HookState derives from nothing; each component is an attribute of its own class,
    defined in its own module."""
    from gradcomp.hooks.state import HookState
    assert HookState.__bases__ == (object,)
    st = HookState("onebit")
    try:
        homes = {name: type(getattr(st, name)).__module__ for name in
                 ("memory", "guard", "warmup", "delay", "rounds", "telemetry", "hierarchy")}
    finally:
        st.close()
    assert len(set(homes.values())) == len(homes), homes
    assert "gradcomp.hooks.state" not in homes.values(), homes


def test_kernels_dispatch_in_one_place_without_an_import_loop():
    """Every step's implementation is looked up by ``gradcomp.kernels.implementation`` (the
    Triton modules are imported nowhere else in the library), and the Triton modules import
    only the reference and each other (the old triton_kernels -> lowrank -> kernels loop)."""
    bad = []
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT)
        package = rel.parent.parts
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join((*base, *(node.module.split(".") if node.module else ()),))
                names = {f"{target}.{a.name}" if target else a.name for a in node.names}
                if rel.parts[:2] == ("kernels", "triton"):
                    if not all(n.startswith(("kernels.triton", "kernels.reference")) for n in names):
                        bad.append(f"{rel}: {sorted(names)}")
                elif any(n.startswith("kernels.triton") for n in names) and rel != Path(
                        "kernels/__init__.py"):
                    bad.append(f"{rel}: {sorted(names)}")
    assert not bad, bad


# what only the optimizer binding (hooks/optimizer/) may do to a user's optimizer
OPTIMIZER_TOUCHES = {"param_groups", "register_step_pre_hook", "register_step_post_hook",
                     "register_state_dict_pre_hook", "register_load_state_dict_post_hook"}


def test_one_module_touches_the_users_optimizer():
    """The package hooks/optimizer/ alone reads an optimizer's groups or hooks its steps
    (DGC's momentum, local steps' rounds, the Adam binding, registration's checks)."""
    bad = [f"{p.relative_to(ROOT.parent)}:{node.lineno} .{node.attr}"
           for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[:2] != ("hooks", "optimizer")
           for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.Attribute) and node.attr in OPTIMIZER_TOUCHES]
    assert not bad, bad


def test_no_module_assigns_attributes_on_the_state():
    """The state is built once from its plan (hooks/plan.py): outside hooks/state.py no
    ``state.x = ...`` (nor on its flat comm), and each adapter's ``register`` is short (the
    validation, the plan and FSDP's hooks are functions of their own)."""
    bad = []
    for p in ROOT.rglob("*.py"):
        if p.name == "state.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and ast.unparse(t.value).split(".")[0] in (
                        "state", "st"):
                    bad.append(f"{p.relative_to(ROOT.parent)}:{node.lineno} {ast.unparse(t)}")
    assert not bad, bad
    for adapter in ("ddp", "fsdp"):
        tree = ast.parse((ROOT / "hooks" / f"{adapter}.py").read_text())
        (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                 and n.name == f"register_{adapter}"]
        assert fn.end_lineno - fn.lineno + 1 < 40, adapter


def test_no_function_is_over_sixty_lines():
    """Small functions: none in the library over 60 lines (docstring included)."""
    long = []
    for p in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{p.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({n})")
    assert not long, long


# what one exchange request carries (hooks/engine.py's Exchange): the bucket, its buffer and
# layout, the step, the parameters' tensors where the method reads them, the loss scale, the
# live parameters, a plain reduce run instead of the method, its future, delayed or not;
# the engine fills in the event and the round of the collective order
REQUEST_FIELDS = ["bucket", "buf", "slices", "step", "params", "scale", "live", "plain", "fut",
                  "delayed", "event", "rnd"]


def test_one_function_builds_the_exchange_request():
    """Every entry's exchange is built by hooks/submit.py's ``request`` (the only place an
    ``Exchange`` is constructed) and carries the fields above, nothing else."""
    import dataclasses

    from gradcomp.hooks.engine import Exchange
    assert [f.name for f in dataclasses.fields(Exchange)] == REQUEST_FIELDS
    built = []
    for p in ROOT.rglob("*.py"):
        tree = ast.parse(p.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                            and node.func.id == "Exchange"):
                        built.append(f"{p.relative_to(ROOT)}:{fn.name}")
    assert set(built) == {"hooks/submit.py:request"}, built


def test_hooks_compare_no_method_name():
    """What a method needs from the hooks is an attribute of its compressor class (its
    momentum binding, its measured accuracy, its FSDP refusals, its Adam exchange): no
    module of hooks/ compares a method's name with a string."""
    from gradcomp.compressors import METHODS
    bad = []
    for p in (ROOT / "hooks").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant)]
                if any(c.value in METHODS for c in consts if isinstance(c.value, str)):
                    bad.append(f"{p.name}:{node.lineno} {ast.unparse(node)}")
    assert not bad, bad


def _imports() -> dict:
    """Each gradcomp module (dotted, relative to gradcomp) -> the gradcomp modules it imports,
    at its top or inside a function (a lazy import is still an edge of the graph)."""
    modules = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, p in modules.items():
        package = name.split(".") if p.name == "__init__.py" else name.split(".")[:-1]
        package = [x for x in package if x]
        edges = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join((*base, *(node.module.split(".") if node.module else ())))
                for t in [target] + [f"{target}.{a.name}".strip(".") for a in node.names]:
                    if t in modules and t != name and not name.startswith(t + ".") and t:
                        edges.add(t)
        graph[name] = edges
    return graph


def test_no_import_cycle_in_the_library():
    """No module imports (at its top or lazily) a module that imports it back, directly or
    through others: each layer reads only what is below it."""
    graph, cycles = _imports(), []
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_module_inspects_the_call_stack():
    """What a function returns does not depend on who calls it (torch.distributed.checkpoint
    takes ``state.stateful()``, explicitly)."""
    bad = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
           if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "inspect" in
                  {a.name for a in n.names} | {getattr(n, "module", None)}
                  for n in ast.walk(ast.parse(p.read_text())))]
    assert not bad, bad


def test_class_names_are_unique_and_hooks_function_names_too():
    """A name says which thing it is: no two classes in the library share a name, and no two
    public functions of hooks/ do (the integrations' ``register`` for each framework aside)."""
    classes, functions = {}, {}
    for p in sorted(ROOT.rglob("*.py")):
        tree, rel = ast.parse(p.read_text()), str(p.relative_to(ROOT))
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                classes.setdefault(n.name, []).append(rel)
        if rel.startswith("hooks/"):
            for n in tree.body:
                if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"):
                    functions.setdefault(n.name, []).append(rel)
    twice = [(k, v) for names in (classes, functions) for k, v in names.items() if len(v) > 1]
    assert not twice, twice


def _entries(rank, world, spec):
    """One bucket, three steps, through each entry: DDP's hook (``entries.bucket``), the
    synchronous reduce (FSDP's, by hand), FSDP's queued slices, local steps' outer exchange."""
    import torch

    import gradcomp
    from gradcomp.hooks.delayed import flat_slices
    from gradcomp.hooks.state import HookState
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    named = list(net.named_parameters())
    slices = flat_slices(named)
    params = [p for _, p in named]
    name, cfg = gradcomp.build_config(spec, warmup="none", min_numel=0)
    entries = {
        "ddp": lambda st, x: st.entries.bucket(0, x, params, True).wait(),
        "reduce": lambda st, x: st.entries.reduce(x, slices, 0, params),
        "slices": lambda st, x: st.entries.slices(0, x, slices, params).wait(),
        "outer": lambda st, x: st.entries.outer(0, x, slices, params, True, True, False)[0].wait(),
    }
    out = {}
    for entry, go in entries.items():
        st = HookState(name, cfg, model=net)
        try:
            got = []
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + rank)
                x = torch.randn(slices[-1].offset + slices[-1].numel, generator=g)
                got.append(go(st, x.clone()).clone())
            out[entry] = (torch.stack(got), st.step, gradcomp.State(st).stats()["sent_bytes"])
        finally:
            st.close()
    return out


@pytest.mark.parametrize("spec", ["onebit", "topk:ratio=0.1"])
def test_every_entry_builds_one_request_and_gives_the_same_bits(spec, spawn):
    """DDP's bucket, the synchronous reduce, FSDP's queued slices and local steps' outer
    exchange build the same request (hooks/submit.py: ``request``) and run it the same way
    (``run``): the same bucket through each gives the same bits, steps and bytes, and it
    compressed."""
    for out in spawn(_entries, 2, args=(spec,), timeout=120):
        ref, steps, sent = out["ddp"]
        assert steps == 3 and 0 < sent < ref[0].numel() * 4 * 3  # it compressed
        for entry, (got, n, b) in out.items():
            assert got.equal(ref) and n == steps and b == sent, entry


# the options of local steps (config.py), read only by the component that runs them, the
# config (which answers the rest in its own terms: ``in_rounds``, ``steps_per_exchange``,
# ``synchronous_start``), the option rules and the two methods whose defaults set them
ROUND_OPTIONS = {"local_steps", "sync_steps", "local_delay", "fragments", "outer_lr",
                 "outer_momentum", "grow_every", "max_local_steps"}
ROUNDS_OWNERS = {"hooks/local_steps.py", "config.py", "rules.py", "compressors/diloco.py",
                 "compressors/sparseloco.py"}


def test_only_the_local_steps_component_reads_the_rounds_options():
    """Outside hooks/local_steps.py, the config and the rule table, no code reads a local
    steps option (an attribute, a keyword, a key): what the rest needs to know, it asks the
    config (``in_rounds``, ``steps_per_exchange``, ``synchronous_start``) or the component
    (``state.rounds``). Docstrings and comments may speak of them."""
    found = []
    for p in ROOT.rglob("*.py"):
        rel = str(p.relative_to(ROOT))
        if rel in ROUNDS_OWNERS:
            continue
        tree = ast.parse(p.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            word = (node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, ast.keyword)
                    else node.id if isinstance(node, ast.Name)
                    else node.value if (isinstance(node, ast.Constant) and id(node) not in docs
                                        and isinstance(node.value, str)) else None)
            if word in ROUND_OPTIONS:
                found.append(f"{rel}:{getattr(node, 'lineno', '?')} {word}")
    assert not found, found


# the modules whose functions take the whole hook state as a parameter: the session's own
# (public.py, state.py) and DDP's hook (torch passes it the registered state); every other
# part (the entries into the pipeline, the stages of an exchange, the checkpoint's format,
# checks and load, the optimizer's bindings) is given its collaborators
WHOLE_STATE_TAKERS = {"hooks/public.py", "hooks/state.py", "hooks/ddp.py"}


def test_no_other_module_takes_the_whole_state():
    """A component gets what it needs (the warm-up's window sum: drain, group, telemetry;
    the rounds' start check: the loads' group and the parameters), not the hook state: only
    the modules above still take it, and none is added."""
    found = set()
    for p in ROOT.rglob("*.py"):
        for fn in ast.walk(ast.parse(p.read_text())):
            if (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args
                    and fn.args.args[0].arg in ("state", "st", "hook_state")):
                found.add(str(p.relative_to(ROOT)))
    assert found <= WHOLE_STATE_TAKERS, sorted(found - WHOLE_STATE_TAKERS)
