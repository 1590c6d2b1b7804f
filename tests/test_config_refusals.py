"""Run-config values that ``train`` and ``plan`` must refuse as the config is read, with the key and what to set, and
``plot`` on a metrics file holding a line that is not a record: a one-line error, never a traceback."""

from __future__ import annotations

import json

import pytest

from megatrain_jax.cli import ConfigError, main, parse_config
from megatrain_jax.train_config import TrainConfig

# The tiny preset with 2 layers (tests/test_cli.py's TINY_RUN): every per-block count is against 2 blocks.
TINY_RUN = ["model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
            "data.eval_fraction=0.05", "train.eval_batches=1", "log.progress=lines", "log.tensorboard=false"]


@pytest.mark.parametrize("overrides, expected", [
    (["engine.resident_layers=3"], r"engine\.resident_layers = 3 is more than the model's 2 blocks: set at most 2"),
    (["engine.offload_activations=3"], r"engine\.offload_activations = 3 is more than the model's 2 blocks: set at "
                                       r"most 2"),
    (["engine.gpu_updated_layers=3"], r"engine\.gpu_updated_layers=3.*: gpu_updated_layers=3 exceeds the 2 blocks that "
                                      r"are not GPU-resident"),
    (["engine.resident_layers=1", "engine.gpu_updated_layers=2"],
     r"engine\.resident_layers=1, engine\.gpu_updated_layers=2.*: gpu_updated_layers=2 exceeds the 1 blocks that are "
     r"not GPU-resident \(resident_layers=1 of 2\)"),
    (["engine.grads_on_gpu=4"], r"engine\.grads_on_gpu=4.*: grads_on_gpu=4 exceeds the 3 parts updated on the host"),
    (["engine.disk_parts=3", "engine.disk_dir=/tmp/nowhere"], r"engine\.disk_parts=3.*: disk_parts=3 exceeds the 2 "
                                                              r"blocks updated on the host"),
    (["engine.kept_layers=3"], r"engine\.kept_layers=3.*: engine\.kept_layers = 3 is more than the model's 2 blocks"),
])
def test_per_block_counts_past_the_model_are_refused_as_the_config_is_read(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_config({}, "config", TINY_RUN + overrides)


@pytest.mark.parametrize("overrides", [
    ["engine.resident_layers=2"], ["engine.offload_activations=2"], ["engine.gpu_updated_layers=2"],
    ["engine.resident_layers=auto", "engine.gpu_updated_layers=2"], ["engine.grads_on_gpu=3"],
    ["engine.kept_layers=2"], ["engine.disk_parts=2", "engine.disk_dir=/tmp/nowhere"],
    ["engine.resident_layers=1", "engine.gpu_updated_layers=1", "engine.grads_on_gpu=1"],
])
def test_per_block_counts_within_the_model_stay_accepted(overrides):
    parse_config({}, "config", TINY_RUN + overrides)


def test_plan_says_a_resident_count_past_the_model_in_one_line(capsys):
    assert main(["plan", *TINY_RUN, "engine.resident_layers=5"]) == 2
    err = capsys.readouterr().err
    assert "engine.resident_layers = 5 is more than the model's 2 blocks: set at most 2" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("seed", [2**32, -1, 10**20])
def test_a_seed_jax_cannot_tell_apart_or_take_is_refused(seed):
    with pytest.raises(ConfigError, match=r"seed must be an integer from 0 to 4294967295"):
        parse_config({}, "config", [f"train.seed={seed}"])
    with pytest.raises(ValueError, match="seed must be"):
        TrainConfig(seed=seed)


def test_seeds_in_32_bits_stay_accepted():
    assert parse_config({}, "config", ["train.seed=4294967295"]).train.seed == 2**32 - 1
    assert TrainConfig(seed=0).seed == 0


@pytest.mark.parametrize("every", [0, -1])
def test_log_every_off_says_how_to_print_no_progress(every):
    """``TrainConfig.log_every = 0`` prints nothing; the command line's progress lines are ``[log] progress``'s."""
    with pytest.raises(ConfigError, match=r"log_every must be >= 1 \(steps between progress lines; "
                                          r"log.progress = 'off' prints none\)"):
        parse_config({}, "config", [f"train.log_every={every}"])


def _record(step: int) -> str:
    return json.dumps({"step": step, "loss": 5.0 - step / 10, "tokens_per_s": 1000.0}) + "\n"


@pytest.mark.parametrize("line", ["[1, 2]\n", '{"loss": 1.0}\n', '"text"\n', '{"step": "3", "loss": 1.0}\n'])
def test_plot_refuses_a_line_that_is_not_a_metrics_record(tmp_path, capsys, line):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text(_record(1) + line + _record(3))
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'}:2 is not a metrics record" in err, err
    assert "Traceback" not in err and not (tmp_path / "metrics.png").exists()


def test_plot_leaves_out_a_last_line_cut_short(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text(_record(1) + _record(2) + '{"step": 3, "lo')  # a run killed mid-write
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", ["q4", "m8v4"])
def test_a_removed_moment_format_says_why_and_what_to_set(name):
    """A config naming a moment format that is gone is told why and what to set, as EngineConfig tells Python, not
    only that it is not one of the values left."""
    with pytest.raises(ConfigError, match=rf"command-line override engine\.moment_dtype={name}: \[engine\] "
                                          rf"moment_dtype: .*removed: .*Set it to 'm7v5' \(the same bytes\) or 'q8'"):
        parse_config({}, "config", [f"engine.moment_dtype={name}"])
