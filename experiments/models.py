"""Models used by the experiments. Each is built from `configs/model/*.yaml` through Hydra's
``_target_``; sizes come from the data set's config (channels, classes)."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """The default model: two 3x3 convolutions, max-pooling and two linear layers
    (about 38k parameters on 8x8 digits)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8,
                 width: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = 2 * width * (image_size // 2) ** 2
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(),
                                        nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """A multi-layer perceptron on flattened inputs."""

    def __init__(self, in_features: int = 64, num_classes: int = 10,
                 hidden: tuple[int, ...] | list[int] = (128,)) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
