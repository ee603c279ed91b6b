"""Triton kernels for the quantize and select steps (CUDA tensors), one module per method:
``onebit.py``, ``terngrad.py``, ``topk.py`` (top-k and DGC's selection), ``sparse.py`` (their
message), ``powersgd.py``, ``threshold.py``, ``guard.py`` (the inf/NaN guard's copy); ``common.py`` holds what they
share.

Every function here has the signature and semantics of the function of the same name in
:mod:`gradcomp.kernels.reference` (PowerSGD's: :mod:`gradcomp.kernels.lowrank`;
segment_candidates: the "cumsum" way of :mod:`gradcomp.kernels.segmented`; segment_sample,
segment_kth, segment_take: its ``thresholds``, ``kth_largest``, ``_take_largest``), which is
the specification; the tests compare them. :mod:`gradcomp.kernels` imports this module
lazily, for CUDA tensors only, so the package imports without Triton. Under
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (that is how the tests run
without a GPU).

Passes over memory (n elements, fp32 x):
  * onebit_compress: one kernel, one read of x and the residual, one write of the residual,
    the packed signs and the per-chunk scales. Chunks longer than ``BLOCK`` elements take a
    second sweep over the chunk (the first one only sums), which for a chunk of tens of KiB
    is served from L2.
  * onebit_decompress / ternary_decompress: one kernel that decodes all W messages and adds
    them into ``out``: out is read and written once, each message read once.
  * onebit_encode / onebit_reencode / onebit_decode (1-bit SGD's exchange on the GPU, one
    kernel per phase for a whole bucket): the bucket and its memories read and written where
    they lie, chunk by chunk through the slot chunks' table, the message's fields written in
    place; the dense parameters' copy and average ride in the first and last kernels.
  * ternary_compress: one kernel (2-bit codes, four per byte, residual in place).
  * ternary_stats / ternary_encode / ternary_decode (TernGrad's bucket path): the statistics
    in two launches, a program per 64K-element chunk reading it once from where it lies,
    then one per segment over its chunks' sums; the codes, five a byte in
    base 3, read from where each segment lies (clamped to its bound) and written into the
    message with the dense values (gathered by programs of the same launch); the W messages
    decoded into the bucket's own layout (each element written once, the dense values' sum
    over ranks divided by W, the guard's verdict too): one launch each.
  * select_topk: two short kernels over x (per-block counts; then an in-order compaction at
    each block's exclusive offset, found with a cumsum over the tiny count vector), then an
    exact ``torch.topk`` over the ``capacity`` candidates. Blocks past ``capacity`` stop
    after reading one offset. No host synchronization.
  * scatter_add: one kernel of atomic adds.
  * segment_candidates (the segmented top-k's candidate step, kernels/segmented.py): a
    count over x (which also zeroes the slots), one program's scan of the tiny per-block
    counts, a compaction: two reads of x, three launches.
  * segment_sample / segment_kth / segment_take (the segmented top-k's ranking on the GPU):
    the sample gathered in one launch; a segmented radix select of three passes, each a
    histogram launch over the ranked values whose programs find the digits so far of their
    entities from the earlier passes' histograms, then one program per entity that reads
    its bins (a zero fill before); the take of each parameter's k largest slots, in order:
    one program per parameter walking its slots, or (a parameter wider than SERIAL_BLOCKS
    blocks) a count per block, one program's scan, a placement over all slots.
    segment_thresholds and segment_select (segmented.py's Triton way) chain them with the
    zero fills done by the sample's and the candidates' count launches, the thresholds'
    gather in the select's last launch, and the take's t and r found by the take itself:
    5 launches for the thresholds, 7 (a wide parameter: 9) for the candidates and the take.
  * finite_copy (the inf/NaN guard, guard.py): one kernel, one read of x and one write of
    it with NaN and +-inf put to 0 (into a copy, or in place), the flag set where any was
    seen and the step written beside it; flag_fill: one kernel that writes NaN over a bucket
    whose flag is up (nothing read of it) and zeroes the bucket's other flag.
  * sparse_encode / sparse_decode (sparse.py): top-k's and DGC's message, its fields
    written (and error feedback's update, the dense values zeroed) in one launch, every
    rank's values and dense values added in one.
  * threshold_sample / threshold_tau / threshold_encode / threshold_decode: threshold
    quantization's sampled magnitudes and their sort keys, per-parameter tau (and each
    segment's threshold, from the sorted sample), its codes and residual, and the decode of
    the W messages (atomic adds); each one launch over a bucket.
  * powersgd_project / _back / _expand / _orthonormalize: PowerSGD's matrix steps over a
    table of matrices of any shapes, one launch each (kernels/lowrank.py; float tolerance,
    not bit-identity, against its reference: a product's summation order is the kernel's).

Randomness. ``ternary_compress`` draws ``tl.rand4x`` (Philox4x32-10): element j of a stream
takes word j % 4 of Philox at counter j // 4 (one Philox per four elements: on the CPU it is
most of the encoder's time), key = the seed and j = i, or with per-segment seeds key =
seeds[k] and j = i - starts[k] for an element i of segment k. The reference computes the same
stream in pure torch (:func:`gradcomp.kernels.reference.ternary_uniforms`), so the kernel and
the reference agree bit for bit and a CPU run and a GPU run with the same seeds draw the
same numbers.

Inputs: ``x`` may be fp32, fp16 or bf16 (loaded and upcast to fp32 in the kernel); the
residual, scales and accumulators are fp32. Flat inputs must be contiguous (``ValueError``
otherwise): a silent ``.contiguous()`` would copy a whole bucket.
"""
from __future__ import annotations

from . import common, guard, onebit, powersgd, sparse, terngrad, threshold, topk  # noqa: F401
from .guard import finite_copy, flag_fill  # noqa: F401
from .onebit import (  # noqa: F401
    onebit_compress, onebit_decode, onebit_decompress, onebit_encode, onebit_reencode,
)
from .powersgd import (  # noqa: F401
    powersgd_back, powersgd_expand, powersgd_orthonormalize, powersgd_project,
)
from .sparse import sparse_decode, sparse_encode  # noqa: F401
from .terngrad import (  # noqa: F401
    ternary_compress, ternary_decode, ternary_decompress, ternary_encode, ternary_stats,
)
from .threshold import (  # noqa: F401
    threshold_decode, threshold_encode, threshold_sample, threshold_tau,
)
from .topk import (  # noqa: F401
    scatter_add, segment_candidates, segment_kth, segment_kth_at, segment_sample, segment_select,
    segment_take, segment_thresholds, select_topk,
)
