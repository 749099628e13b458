"""Data sets for the experiments. Each factory returns a `DataBundle`; the trainer shards the
training set across ranks with a `DistributedSampler` and the test set by rank stride.
Nothing is downloaded at run time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


@dataclass
class DataBundle:
    train: Dataset
    test: Dataset
    task: str = "classification"  # decides the loss and the metric (accuracy)


def digits(test_fraction: float = 0.2, seed: int = 0) -> DataBundle:
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), shipped inside the
    scikit-learn package. Pixels are scaled to [0, 1]; the split is seeded."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    images = torch.tensor(raw.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(raw.target, dtype=torch.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = int(round(test_fraction * len(labels)))
    test_idx, train_idx = torch.tensor(order[:n_test]), torch.tensor(order[n_test:])
    return DataBundle(train=TensorDataset(images[train_idx], labels[train_idx]),
                      test=TensorDataset(images[test_idx], labels[test_idx]))


def prototypes(num_classes: int = 10, channels: int = 3, size: int = 16, train_size: int = 4096,
               test_size: int = 1024, noise: float = 1.5, seed: int = 0) -> DataBundle:
    """Seeded synthetic images: each example is its class prototype (standard normal, one
    per class) plus `noise` times standard normal noise (the LGC specification's training
    data set; dense training exceeds 90% accuracy on it). Stands in for CIFAR-sized inputs
    without a download."""
    gen = torch.Generator().manual_seed(seed)
    protos = torch.randn(num_classes, channels, size, size, generator=gen)

    def draw(n: int) -> TensorDataset:
        labels = torch.randint(0, num_classes, (n,), generator=gen)
        images = protos[labels] + noise * torch.randn(n, channels, size, size, generator=gen)
        return TensorDataset(images, labels)

    return DataBundle(train=draw(train_size), test=draw(test_size))
