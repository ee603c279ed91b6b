"""CIFAR ResNets (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016).

``resnet18``: the usual CIFAR ResNet-18 (11.2M parameters). ``resnet_small``: the same
blocks, narrower and shallower, for tests and laptop runs.
"""
from __future__ import annotations

import torch
from torch import nn


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


def build(name: str) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: allowed {', '.join(MODELS)}")
    return MODELS[name]()
