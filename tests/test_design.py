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
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module:
                top = node.module.split(".")[0]
                if top not in allowed:
                    bad.append(f"{p.name}: from {'.' * node.level}{node.module}")
    assert not bad, bad
