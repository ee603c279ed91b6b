"""1-bit SGD (Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014).

Each element is sent as its sign bit (packed 8 per byte); each chunk of ``chunk`` elements
also sends two fp32 reconstruction values, the mean of its non-negative and of its negative
elements. Quantization error is fed back into the next step.

Exchange: an error-compensated two-phase reduce (as in 1-bit Adam, Tang et al. 2021), so the
bytes each rank sends do not grow with the world size W. Each parameter is padded to whole
chunks and cut into W equal parts; rank j owns part j of every parameter (so ownership, and
with it the second error memory, never depends on the bucket layout):
  1. y = g + e1; quantize y; all-to-all: rank j receives every rank's part j.
                                                           (sends (W-1)/W * n/8 bytes)
  2. Rank j decodes and averages its parts, adds its own second error memory e2, quantizes
     again (e2 keeps that error) and allgathers them, with the values of the parameters
     below ``min_numel`` elements, which go dense.         (sends n/(8W) bytes to each peer)
  3. Every rank decodes all W parts: the average.
About n/4 bytes (+ scales) per rank per step against 8n(W-1)/W for a ring fp32 allreduce:
a 16x..32x saving at any W.

On the GPU each phase is one launch whatever the number of parameters (kernels.onebit_encode,
onebit_reencode, onebit_decode: three per bucket, the inf/NaN guard's besides): the kernels
read and write the bucket where it lies, chunk by chunk through a table of where each chunk
of the part layout starts in the bucket (``_slots``), and count a partly filled chunk's real
elements themselves. The CPU path copies the bucket into the part layout and back
(``_Parts``: runs, or indices) around the chunked kernels, and corrects the padded chunks'
scales after them (:func:`unpad`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import kernels
from ..config import MethodConfig, RESIDUAL, SERVER_RESIDUAL, check
from .base import MAX_RUNS, Compressor, Runs, dense_values, put_dense, register_method, scratch
from .wire import DENSE, Field, Message


SCALES = ("float32", "bfloat16")


@dataclass(frozen=True)
class OneBitConfig(MethodConfig):
    """chunk: elements sharing one pair of reconstruction values (a multiple of 8).
    scales: the reconstruction values on the wire, "float32" or "bfloat16" (half their bytes:
    at chunk 64, 1.5 bits a value instead of 2; each is rounded before the error memory is
    written, so the memory keeps that rounding too)."""

    chunk: int = 256
    scales: str = "float32"

    def validate(self):
        check(8 <= self.chunk <= 2**24 and self.chunk % 8 == 0, "chunk", self.chunk,
              "a positive multiple of 8, at most 2**24")
        check(self.scales in SCALES, "scales", self.scales, "float32 or bfloat16")


_BITS = Field("bits", torch.uint8, "part // 8", "each value's sign, one bit (bit b of byte j "
              "set: value 8j + b is non-negative)")
_SCALES = "per chunk, the mean of its non-negative values; then per chunk, the mean of its negative ones"
_NOTE = ("`part`: a rank's share of the bucket's compressed values (each parameter padded to "
         "whole chunks on every rank, and cut into one part per rank).")
_PHASE1 = "phase 1, an all-to-all: to each rank, its part of this rank's bucket"
_PHASE2 = "phase 2, an allgather: this rank's part, averaged over the ranks and quantized again"


def _messages(dtype: torch.dtype, tag: str = "") -> tuple[Message, Message]:
    scales = Field("scales", dtype, "2 * part // chunk", _SCALES)
    return (Message(_PHASE1 + tag, _BITS, scales, note=_NOTE),
            Message(_PHASE2 + tag, _BITS, scales, DENSE))


PART, OWNED = _messages(torch.float32)
PART16, OWNED16 = _messages(torch.bfloat16, " (`scales=\"bfloat16\"`)")


def compress(y: torch.Tensor, residual, chunk: int, pad=None, dtype=torch.float32):
    """kernels.onebit_compress, then :func:`unpad` where ``pad`` names padded chunks; the
    scales in ``dtype`` (bf16: rounded, and the residual moved to match: y - the rounded
    scale, element by element, as the decoder will see it)."""
    bits, scales = kernels.onebit_compress(y, residual, chunk)
    if pad is not None:
        unpad(bits, scales, residual, chunk, *pad)
    if dtype == torch.float32:
        return bits, scales
    rounded = scales.to(dtype)
    if residual is not None:  # y - rounded = (y - scale) + (scale - rounded), per sign
        d = scales - rounded.float()
        pos = kernels.unpack_bits(bits).view(-1, chunk)
        residual.view(-1, chunk).add_(torch.where(pos, d[0].unsqueeze(1), d[1].unsqueeze(1)))
    return bits, rounded


def unpad(bits, scales, residual, chunk: int, where: torch.Tensor, npad: torch.Tensor) -> None:
    """The chunks ``where`` (chunk indices) end in ``npad`` padding elements, zeros, which the
    kernels count among the non-negative ones: their mean of the non-negative elements
    (scales[0]) is taken again over the real ones only, psum / (npos - npad), and the
    residual of their real non-negative elements moved to match (y - hi: the kernel wrote
    y - hi_kernel). Without this a parameter's last, partly filled chunk came back with its
    positive values shrunk by how full the chunk was (1/256 for one element), negative ones
    exact. A few small ops per bucket, no host read."""
    pos = kernels.unpack_bits(bits.view(-1, chunk // 8)[where]).view(-1, chunk)
    npos = pos.sum(dim=1, dtype=torch.int32)  # >= npad: the padding's zeros are counted
    old = scales[0].index_select(0, where)
    new = old * npos / (npos - npad).clamp_min(1)  # psum / real ones; 0 where psum is 0
    scales[0].index_copy_(0, where, new)
    if residual is not None:  # y - old + (old - new) at the non-negative ones
        residual.view(-1, chunk).index_add_(0, where, pos * (old - new).unsqueeze(1))


def decode_sum(msgs: torch.Tensor, chunk: int, out: torch.Tensor, alpha: float,
               accumulate: bool = True, message: Message = PART) -> torch.Tensor:
    """out += alpha * sum of the decoded messages msgs (R, bytes) of out.numel() elements each
    (out = that, accumulate=False: out's values are not read)."""
    f = message.bind(part=out.numel(), chunk=chunk).unpack(msgs)
    return kernels.onebit_decompress(f["bits"].contiguous(),
                                     f["scales"].float().reshape(msgs.shape[0], 2, -1), chunk,
                                     out, alpha, accumulate)


@register_method
class OneBit(Compressor):
    Config = OneBitConfig
    name = "onebit"
    # with Adam/AdamW: 64-element chunks, their two scales in bf16 (1.5 bits per element),
    # the warm-up in int4 rows. On the GPT (the first moment exchanged, the clip off the
    # compressed steps; seeds 0-2): 2000 steps 1.5681 / 1.5567 / 1.5757 against allreduce's
    # 1.6083 / 1.6027 / 1.6227 at 16.6x fewer bytes over the run, 600 steps -2.0% at 13.6x
    # (bench/RESULTS.md, "Accuracy with AdamW"). Chunk 64 against 256: 1.6288 / 1.6312 (seed 0)
    adam_defaults = {"chunk": 64, "scales": "bfloat16", "dense_wire": "int4"}
    residual_slot = RESIDUAL
    # (Compressor.measured) AdamW: "freeze" measured at chunk 256 with the fp32 warm-up
    measured = {"sgd_points": -0.4, "adamw_gap_pct": {"freeze": 4.26, "momentum": -2.76}}
    description = "1-bit SGD: sign bits + 2 scales per chunk, error feedback, two-phase reduce"
    messages = (PART, OWNED, PART16, OWNED16)

    def exchange(self, x, ctx, big, dense):
        if kernels.backend("onebit_encode", x) == "triton":
            return self._exchange_slots(x, ctx, big, dense)
        cfg, W, r = self.config, ctx.comm.world_size, ctx.comm.rank
        chunk = cfg.chunk
        lay = _parts(tuple((p.offset, p.numel) for p in big), x.numel(), W, r, chunk, x.device)
        part, ef = lay.part, cfg.error_feedback
        half = cfg.scales == "bfloat16"
        dtype = torch.bfloat16 if half else torch.float32
        first, second = (PART16, OWNED16) if half else (PART, OWNED)
        y = lay.spread(x, "onebit.y")
        res = None
        if ef:  # the residual is rewritten whole (gather writes every element of the bucket)
            e_now, e_next = ctx.memory_next(RESIDUAL)
            res = lay.spread(e_now, "onebit.res")
        msg = self._encode_parts(y[:-1], None if res is None else res[:-1], W, part, chunk,
                                 lay.pad, first, dtype)
        if ef:
            lay.gather(res, out=e_next)
        got = ctx.comm.all_to_all(msg)  # (W, part_bytes): every rank's message for my part
        mine = scratch("onebit.mine", part, torch.float32, x.device)
        decode_sum(got, chunk, mine, 1.0 / W, accumulate=False, message=first)
        if lay.own_pad_slots is not None:  # decoded padding (the chunk's hi): back to 0
            mine.index_fill_(0, lay.own_pad_slots, 0.0)
        res2 = None
        if ef:  # the second memory holds, per parameter, what this rank owns (its part);
            # rewritten whole where own_back writes every element, else in place
            if lay.writes_all(x):
                e2, e2_next = ctx.memory_next(SERVER_RESIDUAL)
            else:
                e2 = e2_next = ctx.memory(SERVER_RESIDUAL)
            res2 = lay.own_part(e2, scratch("onebit.res2", part, torch.float32, x.device))
        bits2, scales2 = compress(mine, res2, chunk, lay.own_pad, dtype)
        d = dense_values(x, dense)
        owned = second.bind(part=part, chunk=chunk, n_dense=d.numel())
        msg2 = owned.pack(bits=bits2, scales=scales2, dense=d)
        if ef:
            lay.own_back(res2, e2_next)
        allmsg = owned.unpack(ctx.comm.allgather(msg2))  # (W, ...) each field
        # the W parts laid end to end are one message of W * part elements
        bits = allmsg["bits"].reshape(1, -1)
        scales = allmsg["scales"].float().reshape(W, 2, -1).transpose(0, 1).reshape(1, 2, -1)
        out = scratch("onebit.out", W * part + 1, torch.float32, x.device)
        out[-1:].zero_()  # the extra slot (the parameters sent dense); no host scalar
        kernels.onebit_decompress(bits, scales, chunk, out[:-1], accumulate=False)
        result = lay.gather(out, out=x)  # x is not read again: the result goes there
        put_dense(allmsg["dense"], dense, result)
        return result

    def _exchange_slots(self, x, ctx, big, dense):
        """The GPU's path: the same messages, each phase one launch that reads and writes the
        bucket where it lies (kernels.onebit_encode, _reencode, _decode), whatever the number
        of parameters; no copy of the bucket into the part layout and back. Both memories are
        rewritten whole (the second one 0 but where this rank owns): the guard copies
        neither."""
        cfg, W, r = self.config, ctx.comm.world_size, ctx.comm.rank
        chunk, ef = cfg.chunk, cfg.error_feedback
        plan = _slots(tuple((p.offset, p.numel) for p in big),
                      tuple((p.offset, p.numel) for p in dense), x.numel(), W, chunk, x.device)
        dtype = torch.bfloat16 if cfg.scales == "bfloat16" else torch.float32
        first, second = (PART16, OWNED16) if dtype == torch.bfloat16 else (PART, OWNED)
        one = first.bind(part=plan.part, chunk=chunk)
        two = second.bind(part=plan.part, chunk=chunk, n_dense=plan.n_dense)
        at, dense_at = one.spans["scales"][0], two.spans["dense"][0]
        msg = torch.empty(W, one.nbytes, dtype=torch.uint8, device=x.device)
        msg2 = torch.empty(1, two.nbytes, dtype=torch.uint8, device=x.device)
        e = e_next = e2 = e2_next = None
        if ef:
            e, e_next = ctx.memory_next(RESIDUAL)
            e2, e2_next = ctx.memory_next(SERVER_RESIDUAL)
        kernels.onebit_encode(x, e, e_next, e2_next, plan.starts, plan.reals, chunk, r, msg, at,
                              dtype, plan.rest, _dense_field(msg2, dense_at, plan.n_dense)[0])
        got = ctx.comm.all_to_all(msg)  # (W, bytes): every rank's message for my part
        own = slice(r * plan.cpr, (r + 1) * plan.cpr)
        kernels.onebit_reencode(got, e2, e2_next, plan.starts[own], plan.reals[own], chunk, msg2,
                                at, dtype)
        every = ctx.comm.allgather(msg2.view(-1))  # (W, bytes2)
        kernels.onebit_decode(every, plan.starts, plan.reals, chunk, at, dtype, plan.rest,
                              _dense_field(every, dense_at, plan.n_dense), x, ctx.verdict(x))
        return x

    @staticmethod
    def _encode_parts(y, res, W, part, chunk, pad=None, message=PART, dtype=torch.float32):
        """Quantize y (W * part) once; lay the message out as W rows, one per destination."""
        bits, scales = compress(y, res, chunk, pad, dtype)
        scales = scales.view(2, W, part // chunk).transpose(0, 1)
        return message.bind(part=part, chunk=chunk).pack(W, bits=bits, scales=scales)


@dataclass(frozen=True)
class _Parts:
    """Where each element of a bucket goes in the W parts (built once per layout).

    Each compressed parameter is padded to W * width elements, width a whole number of
    chunks, and cut into W parts of width: part j of every parameter, laid end to end, is row
    j of a (W, part) buffer. ``to_slot`` maps each element of the bucket to its place in that
    buffer seen flat; elements of parameters sent dense map to one extra slot at the end,
    which stays 0."""

    part: int
    slots: int             # W * part
    to_slot: torch.Tensor  # (n,) int64
    own_x: torch.Tensor    # this rank's part: bucket positions of its elements ...
    own_col: torch.Tensor  # ... and their columns in the part
    # the same moves as runs (one torch.cat each): bucket -> slots, slots -> bucket, bucket ->
    # this rank's part; None where they are too many (W x parameters) to beat the indices
    to_slots: Runs | None
    to_bucket: Runs | None
    own_in: Runs | None
    own_out: Runs | None   # this rank's part -> bucket (all n written: W <= 4 only)
    # a parameter's last chunk, where it does not fill it, ends in padding (see unpad):
    # (chunk indices, padding elements) in the (W, part) layout and in this rank's part,
    # and that padding's places in this rank's part; None where there is none
    pad: tuple | None = None
    own_pad: tuple | None = None
    own_pad_slots: torch.Tensor | None = None

    def runs(self, t: torch.Tensor) -> bool:
        """Whether the moves go by runs for tensors like t: on the CPU (a GPU's index kernels
        are fast, and a cat of many pieces is several launches there), where they are few."""
        return self.to_slots is not None and t.device.type == "cpu"

    def spread(self, src: torch.Tensor, key: str) -> torch.Tensor:
        """(W * part + 1,): src's elements in their slots, the padding and the extra slot 0;
        in the work buffer ``key`` (see :func:`scratch`)."""
        buf = scratch(key, self.slots + 1, torch.float32, src.device)
        if self.runs(src):
            self.to_slots(src, buf[:-1])
        else:
            buf.zero_().index_copy_(0, self.to_slot, src)
        buf[-1:].zero_()
        return buf

    def gather(self, buf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of :meth:`spread`: the bucket's elements of a (W * part + 1,) buffer (0 for
        the parameters sent dense)."""
        if not self.runs(buf):
            return torch.index_select(buf, 0, self.to_slot, out=out)
        if out is None:
            out = buf.new_empty(self.to_slot.numel())
        return self.to_bucket(buf, out)

    def own_part(self, e2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (part,) = this rank's columns of e2 (bucket layout), the padding 0."""
        if self.runs(e2):
            return self.own_in(e2, out)
        return out.zero_().index_copy_(0, self.own_col, e2.index_select(0, self.own_x))

    def writes_all(self, t: torch.Tensor) -> bool:
        """Whether :meth:`own_back` writes every element of a bucket like t."""
        return self.own_out is not None and self.runs(t)

    def own_back(self, part: torch.Tensor, e2: torch.Tensor) -> None:
        """e2 (bucket layout) at this rank's elements = part's columns. The other elements of
        e2 are 0 (never written: the second memory holds only what this rank owns), so one
        cat that writes them 0 again moves a run per parameter; it writes all n elements,
        which beats the n / W indexed ones up to W = 4 (11.2M elements: 11 against 51 ms at
        W = 2, 14 against 21 at 4, 13 against 11 at 8)."""
        if self.writes_all(e2):
            self.own_out(part, e2)
        else:
            e2.index_copy_(0, self.own_x, part.index_select(0, self.own_col))



@functools.lru_cache(maxsize=256)
def _parts(layout: tuple, n: int, W: int, rank: int, chunk: int, device) -> _Parts:
    """The part layout of the parameters ``layout`` ((offset, numel) pairs) of a bucket of n
    elements."""
    widths = [-(-numel // (W * chunk)) * chunk for _, numel in layout]
    part = sum(widths)
    to_slot = torch.full((n,), W * part, dtype=torch.int64)
    runs, own, own_x, own_col = [], [], [], []  # runs: (bucket start, slot start, length)
    pad, own_pad, own_pad_slots = [], [], []
    col = 0
    for (off, numel), width in zip(layout, widths):
        if numel % chunk:  # the chunk holding the last element: part k, its j-th of this one
            k, within = divmod(numel - 1, width)
            start = col + within // chunk * chunk  # the chunk's first column in the part
            real = numel - k * width - within // chunk * chunk
            pad.append(((k * part + start) // chunk, chunk - real))
            if k == rank:
                own_pad.append((start // chunk, chunk - real))
                own_pad_slots.append(torch.arange(start + real, start + chunk))
        i = torch.arange(numel, dtype=torch.int64)
        j = i // width
        to_slot[off : off + numel] = j * part + col + i - j * width
        for k in range(W) if len(layout) * W <= MAX_RUNS else ():  # part k: slots in row k
            lo, hi = min(numel, k * width), min(numel, (k + 1) * width)
            runs.append((off + lo, k * part + col, hi - lo))
        lo, hi = min(numel, rank * width), min(numel, (rank + 1) * width)
        own.append((off + lo, col, hi - lo))
        own_x.append(torch.arange(off + lo, off + hi))
        own_col.append(torch.arange(col, col + hi - lo))
        col += width
    moves = (None, None, None, None)
    if runs:
        moves = (Runs(runs, n, W * part), Runs([(s, b, k) for b, s, k in runs], W * part + 1, n),
                 Runs(own, n, part), Runs([(c, b, k) for b, c, k in own], part, n) if W <= 4 else None)
    def table(pairs):
        if not pairs:
            return None
        t = torch.tensor(pairs, dtype=torch.int64).T
        return t[0].to(device), t[1].to(torch.int32).to(device)

    return _Parts(part, W * part, to_slot.to(device), torch.cat(own_x).to(device),
                  torch.cat(own_col).to(device), *moves, pad=table(pad), own_pad=table(own_pad),
                  own_pad_slots=torch.cat(own_pad_slots).to(device) if own_pad_slots else None)


def _dense_field(msg: torch.Tensor, at: int, m: int) -> torch.Tensor:
    """The dense field of each row of msg (R, bytes): (R, m) fp32, a view."""
    if not m:
        return msg.new_empty(msg.shape[0], 0, dtype=torch.float32)
    return msg[:, at : at + 4 * m].view(torch.float32)


@dataclass(frozen=True)
class _Slots:
    """A bucket's slot chunks (the GPU's path, kernels/reference.py's onebit_encode): the
    part layout of :class:`_Parts` seen chunk by chunk, each chunk a run of the bucket.

    Chunk c = j * cpr + i is chunk i of part j (row j of the (W, part) layout): it holds the
    bucket's elements starts[c] .. starts[c] + reals[c] - 1, then padding. ``rest``: the
    elements of no compressed parameter, the dense parameters' first (in their order: the
    message's dense field), then those of no parameter at all (written 0)."""

    part: int
    cpr: int               # chunks per part
    starts: torch.Tensor   # (W * cpr,) int64
    reals: torch.Tensor    # (W * cpr,) int32
    rest: torch.Tensor     # (r,) int64
    n_dense: int


@functools.lru_cache(maxsize=256)
def _slots(layout: tuple, dense: tuple, n: int, W: int, chunk: int, device) -> _Slots:
    """The slot chunks of the compressed parameters ``layout`` and the dense ones ``dense``
    ((offset, numel) pairs) of a bucket of n elements (the same parts as :func:`_parts`)."""
    widths = [-(-numel // (W * chunk)) * chunk for _, numel in layout]
    part = sum(widths)
    cpr = part // chunk
    starts = torch.zeros(W * cpr, dtype=torch.int64)
    reals = torch.zeros(W * cpr, dtype=torch.int64)
    col = 0
    for (off, numel), width in zip(layout, widths):
        k = torch.arange(W).unsqueeze(1)
        first = k * width + torch.arange(width // chunk) * chunk  # (W, chunks): in the param
        where = k * cpr + col // chunk + torch.arange(width // chunk)
        starts[where] = off + first.clamp(max=numel)
        reals[where] = (numel - first).clamp(0, chunk)
        col += width
    covered = sorted(layout + dense)
    gaps, at = [], 0
    for off, numel in covered:
        if off > at:
            gaps.append(torch.arange(at, off))
        at = max(at, off + numel)
    if at < n:
        gaps.append(torch.arange(at, n))
    rest = [torch.arange(off, off + numel) for off, numel in dense] + gaps
    rest = torch.cat(rest) if rest else torch.zeros(0, dtype=torch.int64)
    return _Slots(part, cpr, starts.to(device), reals.to(torch.int32).to(device),
                  rest.to(torch.int64).to(device), sum(numel for _, numel in dense))
