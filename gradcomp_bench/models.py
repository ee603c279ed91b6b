"""CIFAR ResNets (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016).

``resnet18``: the usual CIFAR ResNet-18 (11.2M parameters). ``resnet_small``: the same
blocks, narrower and shallower, for tests and laptop runs.
"""
from __future__ import annotations

import torch
from torch import nn

from .model_names import DESCRIPTIONS


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, cin = [], widths[0]
        for i, (w, b) in enumerate(zip(widths, blocks)):
            for j in range(b):
                layers.append(Block(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet18(classes=10):
    return ResNet(classes=classes)


def resnet18_narrow(classes=10, width=16):
    """ResNet-18's 21 weight tensors at 1/4 of its width: every convolution above gradcomp's
    default ``min_numel`` (compression reaches nearly every weight), CPU-feasible."""
    return ResNet(widths=(width, 2 * width, 4 * width, 8 * width), classes=classes)


def resnet_small(classes=10, width=16):
    return ResNet(widths=(width, 2 * width, 4 * width), blocks=(1, 1, 1), classes=classes)


MODELS = {"resnet18": resnet18, "resnet18_narrow": resnet18_narrow, "resnet_small": resnet_small}


def describe(name: str) -> str:
    """A model in a few words, for ``--model``'s help and the benchmarks' headers."""
    return DESCRIPTIONS.get(name, name)


def build(name: str) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: allowed {', '.join(MODELS)}")
    return MODELS[name]()


# --------------------------------------------------------------------------- transformers
class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class GPTBlock(nn.Module):
    """Pre-norm transformer block (GPT-2's layout)."""

    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style causal language model (Radford et al., "Language Models are Unsupervised
    Multitask Learners", 2019): token + learned position embeddings, pre-norm blocks, a
    final LayerNorm and an untied output head. ``forward(idx) -> logits (B, T, vocab)``."""

    def __init__(self, vocab=128, d=128, layers=4, heads=4, context=128):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[GPTBlock(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / (2 * layers) ** 0.5)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def gpt():
    """0.8M parameters: 4 layers, width 128, 4 heads, 128 characters of context (CPU-sized)."""
    return GPT()


def gpt_tiny():
    """0.1M parameters (2 layers, width 64, 32 characters of context): the suite's
    convergence test, seconds per run on a CPU."""
    return GPT(d=64, layers=2, heads=4, context=32)


def gpt2_small():
    """GPT-2 small's shapes (124M parameters in 148 tensors, a 50257 x 768 embedding): for
    bytes and op counts, too large to train on a CPU."""
    return GPT(vocab=50257, d=768, layers=12, heads=12, context=1024)


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW param groups by the usual convention: weight decay on the weight matrices of
    linear layers, none on biases, norms and embeddings."""
    decay, keep = [], []
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            (decay if isinstance(mod, nn.Linear) and name == "weight" else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": keep, "weight_decay": 0.0}]


MODELS.update({"gpt": gpt, "gpt_tiny": gpt_tiny, "gpt2_small": gpt2_small})
LANGUAGE_MODELS = ("gpt", "gpt_tiny", "gpt2_small")
