"""Messages on the wire, each declared once: a method names its message's fields in order
(name, dtype, length as an expression of the exchange's sizes, meaning), and both its encoder
(:meth:`Layout.pack`) and its decoder (:meth:`Layout.unpack`) go by that declaration, so the
two cannot drift apart. Fields lie end to end as bytes; each starts on a multiple of its own
element size (zero bytes are put before it where the field before ends short), so a decoder
reads every field as a view. docs/wire.md shows every method's messages, generated from these
declarations (``python -m gradcomp.compressors.wire``; ``tests/test_wire.py`` checks it)."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

import torch

DTYPES = {torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
          torch.int64: "int64", torch.float16: "float16", torch.bfloat16: "bfloat16",
          torch.float32: "float32"}


@dataclass(frozen=True)
class Field:
    """One field: ``count`` elements of ``dtype``; ``count`` is an expression of the sizes
    the message is bound with (``"rows * levels"``); ``dtype`` None: the bound size ``dtype``
    (a field whose type is an option, e.g. top-k's 2-byte values)."""
    name: str
    dtype: torch.dtype | None
    count: str
    meaning: str


# what most messages end or begin with: the parameters under ``min_numel``, sent exactly
DENSE = Field("dense", torch.float32, "n_dense", "the parameters sent whole (`min_numel`), end "
              "to end")


class Message:
    """A message's declaration: its fields in order. :meth:`bind` gives its :class:`Layout`
    for one exchange's sizes."""

    def __init__(self, title: str, *fields: Field, note: str = ""):
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"message {title!r}: field names repeat: {names}")
        self.title, self.fields, self.note = title, fields, note

    def bind(self, **sizes) -> Layout:
        return Layout(self, sizes)


class Layout:
    """A message bound to one exchange's sizes: each field's byte offset, element count and
    dtype; ``nbytes`` in all."""

    def __init__(self, message: Message, sizes: dict):
        self.message, self.spans = message, {}
        at = 0
        for f in message.fields:
            dtype = f.dtype if f.dtype is not None else sizes["dtype"]
            n = int(eval(f.count, {"__builtins__": {}}, sizes))  # the declaration's own text
            size = torch.empty((), dtype=dtype).element_size()
            at += -at % size
            self.spans[f.name] = (at, n, dtype)
            at += n * size
        self.nbytes = at

    def pack(self, rows: int | None = None, **values: torch.Tensor) -> torch.Tensor:
        """The message (uint8, ``nbytes``): each field's tensor, of the declared dtype and
        element count, flattened, in the declared order (zero bytes before a field where its
        alignment asks). ``rows``: that many messages at once, one per row of each tensor
        ((rows, nbytes): e.g. an all-to-all's, one for each rank)."""
        lead = () if rows is None else (rows,)
        if set(values) != set(self.spans):
            raise ValueError(f"message {self.message.title!r}: got fields {sorted(values)}, "
                             f"declared {list(self.spans)}")
        parts, at = [], 0
        for name, (a, n, dtype) in self.spans.items():
            v = values[name]
            if v.dtype != dtype or v.numel() != n * (rows or 1):
                raise ValueError(f"message {self.message.title!r}, field {name!r}: got "
                                 f"{v.numel()} x {v.dtype}, declared {n} x {dtype}"
                                 + (f" in each of {rows} rows" if rows else ""))
            if a > at:
                parts.append(v.new_zeros(*lead, a - at, dtype=torch.uint8))
            b = v.reshape(*lead, n).contiguous().view(torch.uint8)
            parts.append(b)
            at = a + b.shape[-1]
        return torch.cat(parts, -1)

    def unpack(self, got: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field of the messages ``got`` ((W, nbytes) uint8: every rank's, in rank order,
        or (nbytes,)) as a contiguous (W, count) (or (count,)) of its dtype, what the kernels
        take: a view of one message, a copy of that field alone from several."""
        if got.shape[-1] != self.nbytes:
            raise ValueError(f"message {self.message.title!r}: {got.shape[-1]} bytes, "
                             f"expected {self.nbytes}")
        out = {}
        for name, (a, n, dtype) in self.spans.items():
            size = torch.empty((), dtype=dtype).element_size()
            v = got[..., a : a + n * size]
            if not n:  # (an empty slice keeps the rows' stride: no view of it)
                out[name] = got.new_empty(*got.shape[:-1], 0, dtype=dtype)
                continue
            if got.dim() > 1 and got.stride(-2) % size:  # flat (a copy unless one row)
                v = v.reshape(-1).view(dtype).view(*got.shape[:-1], n)
            out[name] = v.view(dtype).contiguous()
        return out


def render(methods) -> str:
    """docs/wire.md: every method's messages, field by field (``methods``: the compressor
    classes, each with its ``messages``)."""
    intro = ("Every method's messages, field by field, as the methods declare them "
           "(`gradcomp/compressors/wire.py`); encoder and decoder both go by the declaration. "
           "Fields lie end to end; a field starts on a multiple of its element size (zero "
           "bytes before it where needed). Lengths are in elements, in the method's own "
           "terms. An all-gathered message reaches every rank as one row per rank, in rank "
           "order. A dense step (the warm-up, a bucket under `min_numel`) is an fp32 "
           "allreduce of the bucket, or with `dense_wire` bf16 halves (or int8 or int4 rows of 256 "
           "with an fp32 scale each, as DiLoCo's) by an all-to-all and an "
           "allgather (TernGrad's compressed steps: bf16 values by allgather, as its message's). Each message also carries the inf/NaN guard's flag (3 float32: "
           "non-finite, the step, minus the step), all-reduced (max) beside the first "
           "collective. Generated from the declarations: `python -c \"from "
           "gradcomp.compressors import wire; wire.main()\"`.")
    out = ["# Messages on the wire", "", *textwrap.wrap(intro, 96), ""]
    for cls in methods:
        msgs = cls.messages
        out += [f"## `{cls.name}`", ""]
        if not msgs:
            out += ["The bucket as it is, by one allreduce (a sum).", ""]
            continue
        for m in msgs:
            out += [f"### {m.title}", "", "| field | dtype | elements | bytes | meaning |",
                    "|---|---|---|---|---|"]
            for f in m.fields:
                if f.dtype is None:
                    dtype, size = "`dtype`", "2 or 4"
                else:
                    dtype, size = DTYPES[f.dtype], torch.empty((), dtype=f.dtype).element_size()
                out.append(f"| `{f.name}` | {dtype} | `{f.count}` | {size} each | {f.meaning} |")
            out.append("")
            if m.note:
                out += [*textwrap.wrap(m.note, 96), ""]
    return "\n".join(out)


def docs() -> str:
    """docs/wire.md as the registered methods declare it."""
    from . import METHODS
    return render([METHODS[n].compressor for n in sorted(METHODS)])


def main(path: str = "docs/wire.md") -> None:
    with open(path, "w") as f:
        f.write(docs())
    print(f"{path}: written")
