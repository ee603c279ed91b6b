"""The hand-written method lists of the suite cover every registered method: a method added
to the registry (gradcomp.compressors.METHODS) fails here until the conformance tests run it
(conservation and relayout, degenerate settings, ratio one = allreduce: test_methods; resume
and refusals of bad checkpoints: test_checkpoint; the collective order: test_order; local
steps' rounds: test_local_steps; Adam: test_adam; mixed precision and inf/NaN:
test_precision; multi-rank equality: test_distributed)."""
import importlib

import pytest

from gradcomp.compressors import METHODS

STATELESS = {name for name, m in METHODS.items() if m.compressor.stateless}
LISTS = [("test_methods", "METHOD_SPECS", set()), ("test_checkpoint", "METHODS", set()),
         ("test_order", "SPECS", set()), ("test_local_steps", "SPECS", set()),
         ("test_adam", "SPECS", STATELESS), ("test_precision", "STATEFUL", STATELESS),
         ("test_distributed", "SPECS", STATELESS)]


@pytest.mark.parametrize("module,name,exempt", LISTS)
def test_every_registered_method_is_in_the_list(module, name, exempt):
    specs = getattr(importlib.import_module(module), name)
    covered = {s.split(":")[0] for s in specs}
    missing = sorted(set(METHODS) - exempt - covered)
    assert not missing, f"{module}.{name} lacks {missing}"
    assert covered <= set(METHODS), sorted(covered - set(METHODS))
