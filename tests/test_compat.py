"""Unknown options name the allowed ones in every registry, and GRACE's parameter
dictionary builds the same pipeline as this library's names."""

import pytest
import torch

import gracecomm
from gracecomm import registry
from gracecomm.compat import COMPRESSORS, MEMORIES, accepted_keys, grace_from_params
from gracecomm.validation import ConfigError


@pytest.mark.parametrize(("kind", "name", "options", "message"), [
    ("compressor", "topk", {"compress_ratio": 0.1},
     "compressor 'topk': unknown option 'compress_ratio'. Options: ratio"),
    ("compressor", "sidco", {"ratoi": 0.1}, "Did you mean 'ratio'?"),
    ("compressor", "none", {"ratio": 0.1},
     "compressor 'none': unknown option 'ratio'. It takes no options."),
    ("compressor", "compose", {}, "compressor 'compose': option 'compressors' is required"),
    ("memory", "residual", {"momentum": 0.9}, "Options: beta, gamma"),
    ("index_codec", "bloom", {"false_positive_rate": 0.1}, "index_codec 'bloom': unknown option"),
])
def test_unknown_or_missing_option_lists_the_allowed_ones(kind, name, options, message):
    with pytest.raises(ConfigError) as err:
        registry.create(kind, name, **options)
    assert message in str(err.value)


def test_build_from_a_mapping_reports_the_bad_option():
    with pytest.raises(ConfigError, match="unknown option 'compress_ratio'. Options: ratio"):
        gracecomm.build({"name": "topk", "compress_ratio": 0.01})


def test_grace_dictionary_builds_the_same_pipeline_as_our_names():
    ours = gracecomm.build({"name": "topk", "ratio": 0.01}, "residual", "allgather")
    theirs = grace_from_params({"compressor": "topk", "memory": "residual",
                                "communicator": "allgather", "compress_ratio": 0.01,
                                "world_size": 1, "kernel": "torch"})
    assert repr(theirs) == repr(ours)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # error feedback carries over identically
        assert torch.equal(theirs.step(g, "w"), ours.step(g, "w"))


def test_grace_options_map_onto_ours_with_grace_defaults():
    assert grace_from_params({"compressor": "topk", "memory": "residual",
                              "communicator": "allgather"}).compressor.ratio == 0.3
    qsgd = grace_from_params({"compressor": "qsgd_cuda", "communicator": "allgather",
                              "quantum_num": 64, "bucket_size": 256}).compressor
    assert (qsgd.registry_name, qsgd.levels, qsgd.bucket) == ("qsgd", 64, 256)
    power = grace_from_params({"compressor": "powersgd", "memory": "powersgd",
                               "compress_rank": 3})
    assert (power.compressor.rank, power.memory.registry_name) == (3, "residual")
    ef = grace_from_params({"compressor": "efsignsgd", "memory": "efsignsgd",
                            "communicator": "allgather", "lr": 0.2})
    assert ef.memory.gamma == 0.2
    dgc = grace_from_params({"compressor": "dgc", "memory": "dgc", "communicator": "allgather",
                             "momentum": 0.8, "gradient_clipping": False})
    assert (dgc.compressor.ratio, dgc.memory.momentum) == (0.3, 0.8)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_every_grace_compressor_builds(name):
    memory = {"efsignsgd": "efsignsgd", "dgc": "dgc"}.get(name, "residual")
    communicator = "allreduce" if name == "powersgd" else "allgather"
    grc = grace_from_params({"compressor": name, "memory": memory,
                             "communicator": communicator})
    assert grc.compressor.registry_name == COMPRESSORS[name].name
    assert grc.memory.registry_name == MEMORIES[memory].name
    out = grc.step(torch.randn(64, 3), "w")
    assert out.shape == (64, 3) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize(("params", "message"), [
    ({"compressor": "topk", "compress_ration": 0.1},
     "unknown key 'compress_ration'. Did you mean 'compress_ratio'?"),
    ({"compressor": "u8bit"}, "compressor 'u8bit' has no counterpart here"),
    ({"communicator": "alltoall"}, "accepted: allreduce, allgather, broadcast"),
    ({"compressor": "dgc", "memory": "dgc", "communicator": "allgather",
      "gradient_clipping": True}, "gradient_clipping=True"),
    ({"compressor": "fp16", "world_size": 4}, "world_size is 4 but the process group has 1"),
])
def test_grace_dictionary_errors_say_what_is_accepted(params, message):
    with pytest.raises(ConfigError) as err:
        grace_from_params(params)
    assert message in str(err.value)


def test_accepted_keys_cover_grace_option_names():
    assert {"compressor", "memory", "communicator", "compress_ratio", "quantum_num",
            "bucket_size", "compress_rank", "momentum", "threshold", "lr",
            "world_size"} <= set(accepted_keys())
