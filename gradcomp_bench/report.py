"""Text tables and TensorBoard scalars for the benchmark CLI (figures: :mod:`.plots`)."""
from __future__ import annotations

import math


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """cols: (key, header, format). Missing values print as '-'."""
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        line = []
        for key, _, fmt in cols:
            v = r.get(key)
            line.append("-" if v is None or (isinstance(v, float) and math.isnan(v))
                        else format(v, fmt) if fmt else str(v))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    out = []
    for j, c in enumerate(cells):
        out.append("  ".join(s.rjust(w) if j and i else s.ljust(w)
                             for i, (s, w) in enumerate(zip(c, widths))).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


class Scalars:
    """TensorBoard scalars, or nothing when no directory is given (costs nothing when off)."""

    def __init__(self, log_dir):
        self.w = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.w = SummaryWriter(log_dir)

    def add(self, tag, value, step):
        if self.w is not None and value is not None:
            self.w.add_scalar(tag, float(value), step)

    def close(self):
        if self.w is not None:
            self.w.close()
