"""Models used by the experiments. Each is built from `configs/model/*.yaml` through Hydra's
``_target_``; sizes come from the data set's config (channels, classes, users and items,
vocabulary). Each class names the `task` (see `gracecomm.experiments.workloads.tasks`) whose
batches it takes, so a model paired with the wrong data set is refused before any worker starts."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from gracecomm.validation import ConfigError


class SmallCNN(nn.Module):
    """The default model: two 3x3 convolutions, max-pooling and two linear layers
    (about 38k parameters on 8x8 digits)."""

    task: ClassVar[str] = "classification"

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

    task: ClassVar[str] = "classification"

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


class _BasicBlock(nn.Module):
    """ResNet basic block with the parameter-free shortcut ("option A": stride-2 subsampling
    and zero-padded channels) of He et al. 2016, Sec. 4.2."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.pad = planes - in_planes
        self.stride = stride

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1 and self.pad == 0:
            return x
        x = x[:, :, ::self.stride, ::self.stride]
        return nn.functional.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet20(nn.Module):
    """The CIFAR ResNet-20 of He et al. 2016 (Sec. 4.2: 6n+2 layers with n = 3, widths
    16/32/64), used throughout the compression papers: 269,722 parameters for 10 classes
    and 3 input channels; its 64->64 3x3 convolutions hold 36,864 weights each."""

    task: ClassVar[str] = "classification"

    def __init__(self, num_classes: int = 10, in_channels: int = 3, blocks: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        in_planes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks):
                layers.append(_BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(out.mean(dim=(2, 3)))


class ReferenceCNN(nn.Module):
    """This library's small reference network for LGC's tests and experiment: 3x3
    convolutions 3->32 and 32->64, max-pool, 3x3 convolutions 64->128 and 128->128, global
    average pooling and a 128->10 linear layer; 242,122 parameters, 896 in the first layer."""

    task: ClassVar[str] = "classification"

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
            nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(),
        )
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


class NCF(nn.Module):
    """Neural collaborative filtering, the NeuMF model of He et al. 2017 (Sec. 3.4): a GMF
    branch (element-wise product of `factors`-dimensional user and item embeddings) and an
    MLP branch (concatenated embeddings of size layers[0]/2 each through `layers`), fused by
    one linear layer into the logit of "user interacts with item".

    Input: (..., 2) int64 (user, item) pairs; output: (...) logits. The embedding tables get
    dense gradients (DDP needs them) whose rows are zero for users and items outside the
    batch: the inherently sparse gradients of the DeepReduce paper's NCF experiment."""

    task: ClassVar[str] = "recommendation"

    def __init__(self, num_users: int, num_items: int, factors: int = 8,
                 layers: tuple[int, ...] | list[int] = (64, 32, 16, 8)) -> None:
        super().__init__()
        if len(layers) < 1 or layers[0] % 2:
            raise ConfigError(f"model 'ncf': option 'layers' must start with an even width "
                             f"(split between user and item embeddings), got {list(layers)}")
        self.user_gmf = nn.Embedding(num_users, factors)
        self.item_gmf = nn.Embedding(num_items, factors)
        self.user_mlp = nn.Embedding(num_users, layers[0] // 2)
        self.item_mlp = nn.Embedding(num_items, layers[0] // 2)
        tower: list[nn.Module] = []
        for width, out in zip(layers[:-1], layers[1:]):
            tower += [nn.Linear(width, out), nn.ReLU()]
        self.mlp = nn.Sequential(*tower)
        self.predict = nn.Linear(factors + layers[-1], 1)
        for emb in (self.user_gmf, self.item_gmf, self.user_mlp, self.item_mlp):
            nn.init.normal_(emb.weight, std=0.01)  # as in the authors' code

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        users, items = pairs[..., 0], pairs[..., 1]
        gmf = self.user_gmf(users) * self.item_gmf(items)
        mlp = self.mlp(torch.cat([self.user_mlp(users), self.item_mlp(items)], dim=-1))
        return self.predict(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)


class LSTMLanguageModel(nn.Module):
    """Word-level LSTM language model (Zaremba et al. 2014, "small" configuration scaled
    down): embedding, `layers` LSTM layers with dropout between them, and a linear decoder
    whose weight is tied to the embedding when `tie_weights` (Press and Wolf 2017; needs
    embedding == hidden). Input: (batch, time) token ids; output: (batch, time, vocab)
    logits. Each batch starts from a zero state (examples are independent windows)."""

    task: ClassVar[str] = "language_modelling"

    def __init__(self, vocab_size: int, embedding: int = 128, hidden: int = 128,
                 layers: int = 1, dropout: float = 0.1, tie_weights: bool = True) -> None:
        super().__init__()
        if tie_weights and embedding != hidden:
            raise ConfigError(f"model 'lstm': option 'tie_weights' needs embedding == hidden, "
                             f"got embedding={embedding}, hidden={hidden}")
        self.embed = nn.Embedding(vocab_size, embedding)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embedding, hidden, layers, batch_first=True,
                            dropout=dropout if layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden, vocab_size)
        if tie_weights:
            self.decoder.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.drop(self.embed(tokens)))
        return self.decoder(self.drop(out))
