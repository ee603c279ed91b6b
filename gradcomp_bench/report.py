"""Tables, PNG line plots (drawn with Pillow, which tensorboard already brings) and
TensorBoard scalars for the benchmark CLI."""
from __future__ import annotations

import math

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
          (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


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
                             for i, (s, w) in enumerate(zip(c, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def line_plot(path, series: dict[str, list[tuple[float, float]]], title: str, xlabel: str,
              ylabel: str, logx: bool = False, markers: dict | None = None, size=(900, 560)):
    """Write a PNG with one polyline per series; ``markers`` adds measured points."""
    from PIL import Image, ImageDraw

    W, H = size
    left, right, top, bottom = 80, 230, 40, 60
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    pts = [p for s in series.values() for p in s] + [p for s in (markers or {}).values() for p in s]
    if not pts:
        img.save(path)
        return
    fx = (lambda v: math.log10(v)) if logx else (lambda v: v)
    xs = [fx(p[0]) for p in pts]
    ys = [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = 0.0, max(ys) * 1.05 or 1.0
    x1 = x1 if x1 > x0 else x0 + 1

    def px(x, y):
        return (left + (fx(x) - x0) / (x1 - x0) * (W - left - right),
                H - bottom - (y - y0) / (y1 - y0) * (H - top - bottom))

    d.rectangle([left, top, W - right, H - bottom], outline="black")
    for i in range(6):
        yv = y0 + (y1 - y0) * i / 5
        _, yy = px(10 ** x0 if logx else x0, yv)
        d.line([left - 4, yy, left, yy], fill="black")
        d.text((5, yy - 6), f"{yv:.3g}", fill="black")
    ticks = range(math.floor(x0), math.ceil(x1) + 1) if logx else [x0 + (x1 - x0) * i / 5 for i in range(6)]
    for t in ticks:
        xv = 10 ** t if logx else t
        if not (x0 - 1e-9 <= fx(xv) <= x1 + 1e-9):
            continue
        xx, _ = px(xv, y0)
        d.line([xx, H - bottom, xx, H - bottom + 4], fill="black")
        d.text((xx - 14, H - bottom + 8), _si(xv), fill="black")
    d.text((W // 2 - 60, H - 25), xlabel, fill="black")
    d.text((5, 10), f"{title}   ({ylabel})", fill="black")
    for i, (name, s) in enumerate(series.items()):
        c = COLORS[i % len(COLORS)]
        if len(s) > 1:
            d.line([px(*p) for p in sorted(s)], fill=c, width=2)
        for p in (markers or {}).get(name, []):
            x, y = px(*p)
            d.ellipse([x - 4, y - 4, x + 4, y + 4], outline=c, width=2)
        d.line([W - right + 10, top + 10 + 18 * i, W - right + 30, top + 10 + 18 * i], fill=c, width=3)
        d.text((W - right + 35, top + 4 + 18 * i), name[:30], fill="black")
    img.save(path)


def _si(v: float) -> str:
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= f:
            return f"{v / f:.3g}{unit}"
    return f"{v:.3g}"


def timeline(path, rows: list[dict], size=(1000, 0)):
    """One lane per method: backward (grey) and each bucket exchange (coloured), in ms."""
    from PIL import Image, ImageDraw

    lane, left, top = 46, 170, 40
    W, H = size[0], top + lane * len(rows) + 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    tmax = max(max([r["backward"][1]] + [e for _, _, e in r["exchanges"]]) for r in rows) or 1.0
    sx = (W - left - 30) / tmax
    d.text((10, 10), "one backward per method: dark grey = computing gradients, light grey = "
           "waiting for the last exchanges, colour = each bucket's exchange (comm thread)",
           fill="black")
    for i, r in enumerate(rows):
        y = top + i * lane
        d.text((10, y + 12), r["method"][:24], fill="black")
        b0, b1 = r["backward"]
        d.rectangle([left + b0 * sx, y + 4, left + b1 * sx, y + 16], fill=(225, 225, 225))
        d.rectangle([left + b0 * sx, y + 4, left + r["backward_ops_end"] * sx, y + 16],
                    fill=(150, 150, 150))
        for j, (_, s, e) in enumerate(r["exchanges"]):
            c = COLORS[j % len(COLORS)]
            d.rectangle([left + s * sx, y + 20, left + max(e, s + 0.2) * sx, y + 34], fill=c)
    for k in range(6):
        t = tmax * k / 5
        x = left + t * sx
        d.line([x, H - 45, x, H - 40], fill="black")
        d.text((x - 10, H - 36), f"{t:.0f} ms", fill="black")
    img.save(path)


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
