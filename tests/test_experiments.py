"""Models, data sets and tasks of the experiments: every model/data pair takes a step on 2
ranks, the data sets follow their protocols, tasks compute their metrics by hand, and bad
pairings fail before any worker starts."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from gracecomm import register_comm_hook
from gracecomm.config import instantiate
from gracecomm.experiments.training.config import build_grace, validate
from gracecomm.experiments.training.worker import evaluate
from gracecomm.experiments.workloads import data as datasets
from gracecomm.experiments.workloads.tasks import (
    Classification,
    LanguageModelling,
    Recommendation,
    make_task,
)
from gracecomm.validation import ConfigError, MissingDependencyError
from tests.helpers import CONFIG_DIR, compose_train, run_ranks

SMALL_FEEDBACK = ("data.num_users=120", "data.num_items=300", "data.interactions=8")
PAIRS = [
    ("cnn", "digits", ()),
    ("mlp", "digits", ()),
    ("resnet20", "prototypes", ("data.train_size=32", "data.test_size=16")),
    ("reference_cnn", "prototypes", ("data.train_size=32", "data.test_size=16")),
    ("ncf", "implicit_feedback", SMALL_FEEDBACK),
    ("lstm", "pydoc_text", ()),
]


def step_every_pair(rank, world_size):
    for model_name, data_name, extra in PAIRS:
        cfg = compose_train(f"model={model_name}", f"data={data_name}", "compressor=topk",
                            "compressor.ratio=0.1", *extra)
        data = instantiate(cfg.data)
        task = make_task(data.task, data.task_options)
        torch.manual_seed(0)
        model = instantiate(cfg.model)
        net = DistributedDataParallel(model)
        grace = build_grace(cfg)
        register_comm_hook(net, grace)
        sampler = DistributedSampler(data.train, world_size, rank)
        x, y = next(iter(DataLoader(data.train, batch_size=8, sampler=sampler)))
        task.loss(net(x), y).backward()
        stats = grace.metrics.pop()
        assert 0 < stats["wire_bytes"] < stats["dense_bytes"], model_name
        assert stats["coll_allgather_calls"] >= 2, model_name
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        copies = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(copies, flat)
        assert torch.equal(copies[0], copies[1]), f"{model_name}: ranks disagree"
        if model_name == "ncf":  # inherently sparse: rows outside both ranks' batches are 0
            touched = model.user_gmf.weight.grad.abs().sum(1).count_nonzero()
            assert 0 < touched <= 8 * world_size
        torch.optim.SGD(model.parameters(), lr=0.01).step()
        result = evaluate(model, data.test, task, rank, world_size, torch.device("cpu"), 64)
        assert set(result) == {"test_loss", task.metric} and math.isfinite(result[task.metric])


@pytest.mark.slow
def test_every_model_and_data_set_takes_a_step_on_two_ranks():
    run_ranks(step_every_pair, 2, timeout_s=240)


# -- data sets -------------------------------------------------------------------------------

def feedback(**kw):
    return datasets.implicit_feedback(num_users=60, num_items=200, interactions=10, **kw)


def test_implicit_feedback_is_seeded():
    a, b, c = feedback(seed=1), feedback(seed=1), feedback(seed=2)
    assert all(torch.equal(u, v) for u, v in zip(a.train.tensors + a.test.tensors,
                                                 b.train.tensors + b.test.tensors))
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0])


def test_implicit_feedback_leave_one_out_protocol():
    bundle = feedback(negatives=3, test_negatives=49)
    pairs, labels = bundle.train.tensors
    cand, cand_labels = bundle.test.tensors
    assert bundle.task == "recommendation" and bundle.task_options == {"k": 10}
    assert cand.shape == (60, 50, 2)
    assert torch.equal(cand[:, :, 0], torch.arange(60)[:, None].expand(60, 50))
    assert torch.equal(cand_labels[:, 0], torch.ones(60)) and cand_labels[:, 1:].sum() == 0
    assert int((labels == 0).sum()) == 3 * int((labels == 1).sum())
    positives = {(int(u), int(i)) for u, i in pairs[labels == 1]}
    for user in range(60):
        items = cand[user, :, 1].tolist()
        assert len(set(items)) == 50, "test candidates must be distinct"
        assert (user, items[0]) not in positives, "the held-out item is not trained on"
        assert not any((user, i) in positives for i in items[1:]), "negatives are unseen"
    negatives = {(int(u), int(i)) for u, i in pairs[labels == 0]}
    held_out = {(u, int(cand[u, 0, 1])) for u in range(60)}
    assert not negatives & (positives | held_out)


def top_decile_share(bundle):
    pairs, labels = bundle.train.tensors
    counts = torch.bincount(pairs[labels == 1, 1], minlength=200).sort(descending=True).values
    return float(counts[:20].sum() / counts.sum())


def test_implicit_feedback_popularity_skew():
    assert top_decile_share(feedback(popularity=1.0)) > 1.5 * top_decile_share(
        feedback(popularity=0.0))


def test_pydoc_text_windows_and_vocabulary():
    bundle = datasets.pydoc_text(vocab_size=500, seq_len=20)
    x, y = bundle.train.tensors
    assert bundle.task == "language_modelling" and x.shape[1] == 20 and len(x) > 1000
    assert torch.equal(x[1:, 0], y[:-1, -1]), "targets are the next tokens"
    assert int(x.max()) < 500 and int(bundle.test.tensors[0].max()) < 500


def test_cifar10_and_image_folder_never_download(tmp_path):
    try:
        import torchvision  # noqa: F401
        expected = str(tmp_path / "none")
    except ImportError:
        expected = "pip install torchvision"
    for make in (datasets.cifar10, datasets.image_folder):
        with pytest.raises(MissingDependencyError) as err:
            make(root=str(tmp_path / "none"))
        assert expected in str(err.value)
    assert not any(tmp_path.iterdir()), "nothing may be created or downloaded"


def test_image_folder_with_torchvision(tmp_path):
    pytest.importorskip("torchvision")
    from PIL import Image

    for split in ("train", "val"):
        for label in ("cat", "dog"):
            (tmp_path / split / label).mkdir(parents=True)
            Image.new("RGB", (40, 30), (200 if label == "cat" else 20, 0, 0)).save(
                tmp_path / split / label / "0.png")
    bundle = datasets.image_folder(str(tmp_path), image_size=32)
    x, y = bundle.train[0]
    assert x.shape == (3, 32, 32) and y in (0, 1) and len(bundle.test) == 2


# -- tasks -----------------------------------------------------------------------------------

class Fixed(torch.nn.Module):
    """Returns preset scores, whatever the input."""

    def __init__(self, scores):
        super().__init__()
        self.scores = scores

    def forward(self, x):
        return self.scores


def test_hit_rate_by_hand_with_ties_against_the_model():
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3],    # positive first: rank 0
                           [0.5, 0.5, 0.1, 0.0],    # tie: one candidate as high -> rank 1
                           [0.1, 0.2, 0.3, 0.4]])   # positive last in score: rank 3
    labels = torch.zeros(3, 4)
    labels[:, 0] = 1
    sums = Recommendation(k=2).eval_sums(Fixed(scores), None, labels)
    assert sums[2:] == [2, 3]
    assert Recommendation(k=2).finish([1.0, 1.0, 2.0, 3.0])["test_hr@2"] == pytest.approx(2 / 3)


def test_perplexity_and_accuracy_by_hand():
    lm = LanguageModelling()
    assert lm.finish([2.0 * 10, 10, 0, 10])["test_ppl"] == pytest.approx(math.exp(2.0))
    assert not lm.higher_is_better
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    sums = Classification().eval_sums(Fixed(logits), None, torch.tensor([0, 1, 1]))
    assert sums[2:] == [2, 3]


def test_unknown_task():
    with pytest.raises(ConfigError, match="task 'ranking' is unknown; tasks are classification"):
        make_task("ranking")


# -- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (("model=ncf",), "the model takes recommendation batches but the data set is for "
                     "classification; models for classification: cnn, mlp"),
    (("data=pydoc_text",), "models for language_modelling: lstm"),
    (("model=resnet20",), "the model cannot take the data set's examples"),
    (("model=lstm", "data=pydoc_text", "model.vocab_size=50"),
     "option 'model.vocab_size' is 50 but 'data.vocab_size' is 2000"),
    (("trainer.optimizer=lamb",), "option 'optimizer' must be one of 'sgd', 'adam'"),
    (("+experiment=sparse_model", "experiment.scale=huge"),
     "option 'scale' must be one of 'small', 'paper'; got 'huge'"),
])
def test_mismatches_fail_before_workers_start(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_train(*overrides))
    assert message in str(err.value)


def test_experiment_scale_selects_a_preset():
    small = compose_train("+experiment=sparse_model")
    paper = compose_train("+experiment=sparse_model", "experiment.scale=paper")
    assert (small.data.num_users, small.trainer.world_size) == (2000, 2)
    assert ((paper.data.num_users, paper.model.num_users, paper.trainer.world_size)
            == (138493, 138493, 4))


@pytest.mark.parametrize("method", sorted(p.stem for p in (CONFIG_DIR / "method").glob("*.yaml")))
def test_method_presets_build(method):
    grace = build_grace(compose_train(f"+method={method}"))
    expected = {"dense": ("NoneCompressor", "allreduce"), "fp16": ("FP16", "allreduce"),
                "nonzeros": ("Threshold", "allgather"), "topk10": ("TopK", "allgather")}
    if method in expected:
        parts = (type(grace.compressor).__name__, grace.communicator.registry_name)
        assert parts == expected[method]


def test_digits_are_scikit_learns_without_importing_it():
    """The digits file read directly gives `load_digits`'s images (scaled) and labels, in
    the split's seeded order."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    order = torch.tensor(np.random.default_rng(3).permutation(len(raw.target)))
    images, labels = datasets.digits(test_fraction=0.0, seed=3).train.tensors
    assert torch.equal(images, torch.tensor(raw.images / 16.0, dtype=torch.float32)
                       .unsqueeze(1)[order])
    assert torch.equal(labels, torch.tensor(raw.target)[order])
