"""Shared by the tests: the Triton interpreter for CPU tensors, and the CIFAR-10 subset.

The data-dependent tests (convergence, training, delay) take the ``cifar`` fixture: where
the data is missing they skip, unless ``GRADCOMP_REQUIRE_DATA=1`` (what ``.ci/run`` sets),
where they fail, so CI cannot stay green without the data it is meant to test on.
"""
import os

import pytest

# Triton kernels run on CPU tensors through the interpreter unless asked otherwise (set
# before any test module imports triton)
os.environ.setdefault("TRITON_INTERPRET", "1")
# the CPU steps run the pure-torch path, bit-identical to the reference, unless a test asks for
# another: the compiled path's compile (tens of seconds per process) would dominate hundreds
# of short multi-process tests; tests/test_compiled.py opts in
os.environ.setdefault("GRADCOMP_KERNELS", "cpu")


@pytest.fixture(scope="session")
def cifar():
    """The CIFAR-10 directory the tests train on."""
    from gradcomp import data
    found = data.resolve(None)
    if found is None:
        where = ", ".join(str(d) for d in data.default_dirs())
        if os.environ.get("GRADCOMP_REQUIRE_DATA") == "1":
            pytest.fail(f"GRADCOMP_REQUIRE_DATA=1 but no CIFAR-10 data in any of: {where}")
        pytest.skip(f"needs the CIFAR-10 subset (looked in: {where})")
    return found
