"""CIFAR-10 in the dataset's own python layout (``cifar-10-batches-py``), read from disk only.

Any directory in that layout works: the 5085/1017-image subset in ``../shared/data`` or the
full 50000/10000 set. Nothing is ever downloaded.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]


def default_dirs() -> list[Path]:
    """Where to look when no directory is given: $GRADCOMP_CIFAR, then shared/ data beside
    the checkout and beside the current directory."""
    out = []
    if os.environ.get("GRADCOMP_CIFAR"):
        out.append(Path(os.environ["GRADCOMP_CIFAR"]))
    here = Path(__file__).resolve().parent.parent
    for base in (here.parent, Path.cwd().parent, Path.cwd()):
        out.append(base / "shared" / "data" / "cifar10-subset" / "cifar-10-batches-py")
    return out


def resolve(path: str | os.PathLike | None) -> Path | None:
    """The CIFAR directory to use: ``path`` (or its cifar-10-batches-py child) if given —
    a ValueError if it is not in the layout — else the first default that exists, else None."""
    if path is not None:
        p = Path(path)
        for cand in (p, p / "cifar-10-batches-py"):
            if (cand / "test_batch").is_file() and (cand / "data_batch_1").is_file():
                return cand
        raise ValueError(f"no CIFAR-10 python-layout data in {str(p)!r}: expected data_batch_1..5 "
                         f"and test_batch (the 'cifar-10-batches-py' directory)")
    for cand in default_dirs():
        if (cand / "test_batch").is_file():
            return cand
    return None


def _read(path: Path):
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    return torch.from_numpy(x.copy()), torch.tensor(d[b"labels"], dtype=torch.int64)


def load(path) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((train uint8 N,3,32,32, labels), (test ..., labels)) from a python-layout directory."""
    d = Path(path)
    parts = [_read(d / f) for f in TRAIN_FILES if (d / f).is_file()]
    train = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return train, _read(d / "test_batch")


def synthetic(n_train=2048, n_test=512, seed=0):
    """Random images with labels a fixed function of them (learnable), same shapes as CIFAR."""
    g = torch.Generator().manual_seed(seed)
    proto = torch.randint(0, 256, (10, 3, 32, 32), generator=g, dtype=torch.uint8)

    def make(n):
        y = torch.randint(0, 10, (n,), generator=g)
        noise = torch.randint(-60, 60, (n, 3, 32, 32), generator=g)
        return (proto[y].int() + noise).clamp(0, 255).to(torch.uint8), y
    return make(n_train), make(n_test)


def normalize(x: torch.Tensor) -> torch.Tensor:
    return (x.float().div_(255) - MEAN) / STD


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random crop (pad 4) and horizontal flip, as in the usual CIFAR recipe. x: uint8 batch."""
    n = x.shape[0]
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    dx = torch.randint(0, 9, (n,), generator=g)
    dy = torch.randint(0, 9, (n,), generator=g)
    out = _crop(padded, dy, dx)
    flip = torch.rand(n, generator=g) < 0.5
    out[flip] = out[flip].flip(3)
    return out


def _crop(padded, dy, dx):
    n = padded.shape[0]
    ar = torch.arange(32)
    rows = (dy.view(n, 1) + ar).view(n, 1, 32, 1).expand(n, 3, 32, 40)
    tmp = padded.gather(2, rows)
    cols = (dx.view(n, 1) + ar).view(n, 1, 1, 32).expand(n, 3, 32, 32)
    return tmp.gather(3, cols)


# --------------------------------------------------------------------------- text
VOCAB = 128  # characters: pycode.txt is ASCII (non-ASCII replaced by '?')


def text_dirs() -> list[Path]:
    """Where the character corpus is looked for: $GRADCOMP_TEXT, then shared/ data."""
    out = [Path(os.environ["GRADCOMP_TEXT"])] if os.environ.get("GRADCOMP_TEXT") else []
    here = Path(__file__).resolve().parent.parent
    for base in (here.parent, Path.cwd().parent, Path.cwd()):
        out.append(base / "shared" / "data" / "pycode" / "pycode.txt")
    return out


def load_text(path=None, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) uint8 character codes of the corpus: the last ``val_fraction`` of
    the file is validation. ``path``: a text file; None: the first of :func:`text_dirs`."""
    cands = [Path(path)] if path is not None else text_dirs()
    for p in cands:
        if p.is_file():
            raw = np.frombuffer(p.read_bytes(), dtype=np.uint8)
            codes = torch.from_numpy(np.minimum(raw, VOCAB - 1).copy())
            cut = int(len(codes) * (1 - val_fraction))
            return codes[:cut], codes[cut:]
    raise FileNotFoundError("no text corpus found (searched " + ", ".join(map(str, cands)) + ")")


def synthetic_text(n=200_000, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable random character stream (a fixed random bigram chain), for runs without
    the corpus: (train, validation)."""
    rng = np.random.default_rng(seed)
    nxt = rng.integers(0, VOCAB, (VOCAB, 4))
    choice = rng.integers(0, 4, n)
    out = np.empty(n, dtype=np.uint8)
    c = 0
    for i in range(n):  # a host loop over a short stream, once per run
        c = nxt[c, choice[i]]
        out[i] = c
    out = torch.from_numpy(out)
    cut = int(n * 0.9)
    return out[:cut], out[cut:]


def windows(codes: torch.Tensor, starts: torch.Tensor, length: int):
    """(inputs, targets) int64 (len(starts), length): next-character prediction windows."""
    idx = starts.unsqueeze(1) + torch.arange(length + 1)
    w = codes[idx].long()
    return w[:, :-1], w[:, 1:]
