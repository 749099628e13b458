"""Data sets for the experiments. Each factory returns a `DataBundle`; the trainer shards the
training set across ranks with a `DistributedSampler` and the test set by rank stride.
Nothing is downloaded at run time: the default data sets ship inside installed packages or
are generated from a seed, and CIFAR-10 and image folders are read from a local `root`."""

from __future__ import annotations

import importlib.util
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from gracecomm.validation import MissingDependencyError, check_range


class MissingDatasetError(MissingDependencyError):
    """A data set that is read from disk is not where its `root` option points."""


@dataclass
class DataBundle:
    """Train and test sets plus the task (`gracecomm.experiments.workloads.tasks`) that decides
    the loss and the metric: ``classification`` (accuracy), ``recommendation`` (hit rate @ K) or
    ``language_modelling`` (perplexity); `task_options` go to the task (e.g. ``{"k": 10}``)."""

    train: Dataset
    test: Dataset
    task: str = "classification"
    task_options: dict[str, Any] = field(default_factory=dict)


def digits(test_fraction: float = 0.2, seed: int = 0) -> DataBundle:
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), shipped inside the
    scikit-learn package. Pixels are scaled to [0, 1]; the split is seeded.

    The file is read where the package keeps it, the package found but not imported: the
    same arrays as ``sklearn.datasets.load_digits``, without the 0.8 s of one core that
    importing ``sklearn.datasets`` costs each process of a run."""
    spec = importlib.util.find_spec("sklearn")
    path = (Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
            if spec is not None and spec.submodule_search_locations else None)
    if path is None or not path.is_file():
        raise MissingDependencyError("data 'digits' needs scikit-learn's digits file "
                                     f"(sklearn/datasets/data/digits.csv.gz; found: {path}): "
                                     "pip install scikit-learn")
    raw = np.loadtxt(path, delimiter=",")  # 64 pixels (0-16), then the label, per row
    images = torch.tensor(raw[:, :-1].reshape(-1, 1, 8, 8) / 16.0, dtype=torch.float32)
    labels = torch.tensor(raw[:, -1], dtype=torch.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = int(round(test_fraction * len(labels)))
    test_idx, train_idx = torch.tensor(order[:n_test]), torch.tensor(order[n_test:])
    return DataBundle(train=TensorDataset(images[train_idx], labels[train_idx]),
                      test=TensorDataset(images[test_idx], labels[test_idx]))


def prototypes(num_classes: int = 10, channels: int = 3, size: int = 16, train_size: int = 4096,
               test_size: int = 1024, noise: float = 1.5, seed: int = 0) -> DataBundle:
    """Seeded synthetic images: each example is its class prototype (standard normal, one
    per class) plus `noise` times standard normal noise (this library's training data for
    LGC's checks; dense training exceeds 90% accuracy on it). Stands in for CIFAR-sized inputs
    without a download."""
    gen = torch.Generator().manual_seed(seed)
    protos = torch.randn(num_classes, channels, size, size, generator=gen)

    def draw(n: int) -> TensorDataset:
        labels = torch.randint(0, num_classes, (n,), generator=gen)
        images = protos[labels] + noise * torch.randn(n, channels, size, size, generator=gen)
        return TensorDataset(images, labels)

    return DataBundle(train=draw(train_size), test=draw(test_size))


def implicit_feedback(num_users: int = 2000, num_items: int = 1000, interactions: float = 20,
                      min_interactions: int = 5, factors: int = 8, taste: float = 2.0,
                      popularity: float = 0.8, negatives: int = 4, test_negatives: int = 99,
                      hit_rate_k: int = 10, seed: int = 0, chunk: int = 1024) -> DataBundle:
    """Seeded synthetic implicit feedback for the NCF recommender (no download).

    Generative model: users and items get `factors`-dimensional standard normal tastes; item
    ranks are a random permutation, giving a Zipf popularity prior -popularity * log(rank).
    User u interacts with n_u ~ min_interactions + Poisson(interactions - min_interactions)
    distinct items drawn without replacement (Gumbel top-k) with log-probability
    taste * <user_u, item_i> / sqrt(factors) - popularity * log(rank_i).

    Evaluation as in He et al. 2017 (Sec. 4.1): leave-one-out (one random interaction per
    user is held out) ranked against `test_negatives` distinct items the user never
    interacted with; the metric is the hit rate @ `hit_rate_k`. Training examples are the
    remaining interactions (label 1) plus `negatives` uniformly drawn non-interacted items
    per interaction (label 0), drawn once from the seed.

    Train items: ``((user, item) int64, label float)``; test items: ``((C, 2) candidate
    pairs, (C,) labels)`` with C = test_negatives + 1 and the held-out item first."""
    owner = "data 'implicit_feedback'"
    check_range(num_users, owner, "num_users", 1, integer=True)
    check_range(min_interactions, owner, "min_interactions", 2, integer=True)
    check_range(interactions, owner, "interactions", min_interactions)
    check_range(negatives, owner, "negatives", 0, integer=True)
    check_range(test_negatives, owner, "test_negatives", 1, integer=True)
    check_range(hit_rate_k, owner, "hit_rate_k", 1, test_negatives + 1, integer=True)
    check_range(num_items, owner, "num_items", 2 * min_interactions + test_negatives + 1,
                integer=True)
    gen = torch.Generator().manual_seed(seed)
    users = torch.randn(num_users, factors, generator=gen)
    items = torch.randn(num_items, factors, generator=gen)
    ranks = torch.randperm(num_items, generator=gen).double() + 1
    prior = (-popularity * ranks.log()).float()
    rate = torch.full((num_users,), float(interactions - min_interactions), dtype=torch.float64)
    counts = (torch.poisson(rate, generator=gen).long() + min_interactions).clamp(
        max=(num_items - test_negatives - 1) // 2)
    train_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    test_items, test_users = [], []
    for lo in range(0, num_users, chunk):
        u = torch.arange(lo, min(lo + chunk, num_users))
        n = counts[u]
        logits = taste * users[u] @ items.T / math.sqrt(factors) + prior
        gumbel = -torch.empty_like(logits).exponential_(generator=gen).log()
        chosen = (logits + gumbel).topk(int(n.max()), dim=1).indices
        keep = torch.arange(chosen.shape[1]) < n[:, None]
        seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(
            1, chosen, keep)
        held = (torch.rand(len(u), generator=gen) * n).long()
        test_items.append(chosen.gather(1, held[:, None]))
        test_users.append(u)
        keep.scatter_(1, held[:, None], False)
        rows, cols = keep.nonzero(as_tuple=True)
        pos_users, pos_items = u[rows], chosen[rows, cols]
        # distinct unseen items for the ranking test: top-k of uniform keys with seen masked
        keys = torch.rand(logits.shape, generator=gen).masked_fill_(seen, -1.0)
        test_items[-1] = torch.cat([test_items[-1], keys.topk(test_negatives, dim=1).indices], 1)
        neg_rows = rows.repeat_interleave(negatives)
        neg_items = _unseen(seen, neg_rows, gen)
        train_parts.append((torch.stack([torch.cat([pos_users, u[neg_rows]]),
                                         torch.cat([pos_items, neg_items])], dim=1),
                            torch.cat([torch.ones(len(rows)), torch.zeros(len(neg_rows))])))
    train_pairs = torch.cat([p for p, _ in train_parts])
    train_labels = torch.cat([y for _, y in train_parts])
    candidates = torch.cat(test_items)
    test_pairs = torch.stack([torch.cat(test_users)[:, None].expand_as(candidates), candidates], 2)
    test_labels = torch.zeros(candidates.shape)
    test_labels[:, 0] = 1.0
    return DataBundle(train=TensorDataset(train_pairs, train_labels),
                      test=TensorDataset(test_pairs, test_labels),
                      task="recommendation", task_options={"k": hit_rate_k})


def _unseen(seen: torch.Tensor, rows: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One uniform item per entry of `rows` that `seen[row]` does not mark (rejection
    sampling; every row has unseen items, so it ends)."""
    out = torch.randint(seen.shape[1], rows.shape, generator=gen)
    bad = seen[rows, out]
    while bool(bad.any()):
        out[bad] = torch.randint(seen.shape[1], (int(bad.sum()),), generator=gen)
        bad = seen[rows, out]
    return out


TOKEN = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")


def pydoc_text(vocab_size: int = 2000, seq_len: int = 35, test_fraction: float = 0.1) -> DataBundle:
    """Word-level language modelling on the Python documentation's help topics
    (``pydoc_data.topics``, the text `help("with")` shows; about 465 KB and 120k tokens on
    Python 3.11), which ships with the Python standard library, so nothing downloads. The
    text differs slightly between Python versions.

    Tokens are lower-cased words, numbers and single punctuation characters; the vocabulary
    is ``<unk>`` plus the `vocab_size` - 1 most frequent training tokens. The first
    1 - `test_fraction` of the token stream trains, the rest tests. Examples are
    non-overlapping windows of `seq_len` tokens with the next-token targets; the metric is
    the perplexity exp(mean cross-entropy per token)."""
    owner = "data 'pydoc_text'"
    check_range(vocab_size, owner, "vocab_size", 2, integer=True)
    check_range(seq_len, owner, "seq_len", 1, integer=True)
    check_range(test_fraction, owner, "test_fraction", 0.0, 1.0, low_open=True, high_open=True)
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # some distributions strip it from the standard library
        raise MissingDependencyError(f"{owner} needs the standard library's pydoc_data package, "
                                "which this Python installation lacks; install the full "
                                "standard library (e.g. apt-get install libpython3-stdlib)"
                                ) from err
    tokens = TOKEN.findall("\n".join(topics[key] for key in sorted(topics)).lower())
    split = int(len(tokens) * (1 - test_fraction))
    counts = Counter(tokens[:split])
    vocab = ["<unk>"] + sorted(counts, key=lambda t: (-counts[t], t))[: vocab_size - 1]
    index = {t: i for i, t in enumerate(vocab)}
    ids = torch.tensor([index.get(t, 0) for t in tokens], dtype=torch.int64)
    return DataBundle(train=_windows(ids[:split], seq_len), test=_windows(ids[split:], seq_len),
                      task="language_modelling")


def _windows(ids: torch.Tensor, seq_len: int) -> TensorDataset:
    """Non-overlapping (input, next-token target) windows of `seq_len` tokens."""
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise MissingDatasetError(f"a text of {len(ids)} tokens is too short for windows of "
                             f"seq_len={seq_len}")
    x = ids[: n * seq_len].view(n, seq_len)
    y = ids[1: n * seq_len + 1].view(n, seq_len)
    return TensorDataset(x, y)


def _torchvision(owner: str) -> Any:
    try:
        import torchvision
    except ImportError as err:
        raise MissingDependencyError(f"{owner} needs torchvision, which is not installed: "
                                "pip install torchvision") from err
    return torchvision


def _existing(path: Path, owner: str, hint: str) -> Path:
    if not path.is_dir():
        raise MissingDatasetError(f"{owner}: option 'root' points to {path.parent}, but "
                                  f"{path} does not exist; {hint}")
    return path


CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def cifar10(root: str = "data/cifar10", augment: bool = True, download: bool = False) -> DataBundle:
    """CIFAR-10 (Krizhevsky 2009) through torchvision, read from `root`/cifar-10-batches-py
    (the "python version" archive, unpacked). Training images get the usual random crop
    (padding 4) and horizontal flip when `augment`; both sets are normalised per channel.
    `download=true` lets torchvision fetch the archive into `root` (off by default)."""
    tv = _torchvision("data 'cifar10'")
    folder = Path(root).expanduser()
    if not download:
        _existing(folder / "cifar-10-batches-py", "data 'cifar10'",
                  "unpack https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz there, "
                  "point data.root at its parent, or set data.download=true")
    t = tv.transforms
    norm = [t.ToTensor(), t.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    train_tf = t.Compose(([t.RandomCrop(32, padding=4), t.RandomHorizontalFlip()]
                          if augment else []) + norm)
    return DataBundle(
        train=tv.datasets.CIFAR10(str(folder), train=True, transform=train_tf, download=download),
        test=tv.datasets.CIFAR10(str(folder), train=False, transform=t.Compose(norm),
                                 download=download))


def image_folder(root: str, image_size: int = 224, augment: bool = True) -> DataBundle:
    """An ImageNet-style folder through torchvision's `ImageFolder`: `root`/train/CLASS/*.jpg
    and `root`/val/CLASS/*.jpg (class = sub-folder, sorted). Training images get a random
    resized crop and flip when `augment`, test images a resize to 8/7 of `image_size` and a
    centre crop (the ImageNet protocol); both are normalised with ImageNet statistics. Set
    the model's `num_classes` to the number of class folders."""
    owner = "data 'image_folder'"
    tv = _torchvision(owner)
    folder = Path(root).expanduser()
    hint = "it needs train/ and val/ sub-folders with one folder of images per class"
    train_dir, val_dir = (_existing(folder / sub, owner, hint) for sub in ("train", "val"))
    t = tv.transforms
    norm = [t.ToTensor(), t.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    centre = [t.Resize(image_size * 8 // 7), t.CenterCrop(image_size)]
    train_tf = [t.RandomResizedCrop(image_size), t.RandomHorizontalFlip()] if augment else centre
    return DataBundle(train=tv.datasets.ImageFolder(str(train_dir), t.Compose(train_tf + norm)),
                      test=tv.datasets.ImageFolder(str(val_dir), t.Compose(centre + norm)))
