"""The hand-written method lists of the suite cover every registered method: a method added
to the registry (gradcomp.compressors.METHODS) fails here until the conformance tests run it
(conservation and relayout, degenerate settings, ratio one = allreduce: test_methods; resume
and refusals of bad checkpoints: test_checkpoint; the collective order: test_order; local
steps' rounds: test_local_steps; Adam: test_adam; mixed precision and inf/NaN:
test_precision; multi-rank equality: test_distributed). A method whose defaults take local
steps (sparseloco, diloco) runs in the per-step lists only as far as its rounds do: its codec's
conformance (conservation, layouts, lossless settings, message sizes) is test_loco's, its
rounds, resume and conservation on ranks test_local_steps's, HSDP test_hsdp_local's."""
import importlib

import pytest

from gradcomp.compressors import METHODS

STATELESS = {name for name, m in METHODS.items() if m.compressor.stateless}
LOCAL = {name for name, m in METHODS.items() if m.config().local_steps > 1}
LISTS = [("test_methods", "METHOD_SPECS", LOCAL), ("test_checkpoint", "METHODS", LOCAL),
         ("test_order", "SPECS", LOCAL), ("test_local_steps", "RESUME", set(METHODS) - LOCAL),
         ("test_adam", "SPECS", STATELESS | LOCAL), ("test_precision", "STATEFUL", STATELESS | LOCAL),
         ("test_distributed", "SPECS", STATELESS | LOCAL), ("test_loco", "LOCAL_METHODS", set(METHODS) - LOCAL)]


@pytest.mark.parametrize("module,name,exempt", LISTS)
def test_every_registered_method_is_in_the_list(module, name, exempt):
    specs = getattr(importlib.import_module(module), name)
    covered = {s.split(":")[0] for s in specs}
    missing = sorted(set(METHODS) - exempt - covered)
    assert not missing, f"{module}.{name} lacks {missing}"
    assert covered <= set(METHODS), sorted(covered - set(METHODS))
