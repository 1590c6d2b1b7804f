"""Command-line mistakes answered with what was meant: a key in the wrong section, a command line argparse would
refuse bare (overrides or a config file without a command, a config file for the demo), data here that ``train``
would refuse (``plan`` refuses it too), and windows longer than the model allows (refused as the config is read)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.cli import ConfigError, load_config, main

REPO = Path(__file__).resolve().parents[1]
DEMO_TOML = REPO / "experiments" / "configs" / "demo_tiny.toml"
HF_LLAMA = REPO / "tests" / "fixtures" / "hf" / "llama"  # max_position_embeddings 128


# ------------------------------------------------------------------------------------- a key in the wrong section
@pytest.mark.parametrize("override, expected", [
    ("train.seq_len=64", "unknown key 'seq_len' in command-line override train.seq_len=64: 'seq_len' is a [data] "
                         "key: data.seq_len=64"),
    ("train.micro_batches=2", "'micro_batches' is an [engine] key: engine.micro_batches=2"),
    ("optimizer.clip_norm=1.0", "'clip_norm' is an [engine] key: engine.clip_norm=1.0"),
    ("data.layers=4", "'layers' is a [model] key: model.layers=4"),  # [model]'s keys are DecoderConfig's
    ("optimizer.seed=3", "'seed' is a key of [data] and [train]: data.seed=3 or train.seed=3"),
    ("train.rope_scaling.factor=2", "'rope_scaling' is a [model] key: model.rope_scaling.factor=2"),
    ("rope_scaling.factor=2", "'rope_scaling' is outside any section; 'rope_scaling' is a [model] key: "
                              "model.rope_scaling.factor=2"),
])
def test_a_key_in_another_section_is_named_as_that_sections(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO_TOML, [override])
    assert expected in str(err.value) and "did you mean" not in str(err.value), str(err.value)


def test_a_key_under_the_wrong_table_of_a_file_says_where_it_goes(tmp_path):
    cases = [("[train]\nseq_len = 64\n", "unknown key 'seq_len' in {path} [train]: 'seq_len' is a [data] key: move it "
                                         "under [data]"),
             ("[train.rope_scaling]\nfactor = 2.0\n",
              "'rope_scaling' is a [model] key: move it to [model.rope_scaling]"),
             ("seq_len = 64\n[train]\nsteps = 2\n", "{path}: 'seq_len' is outside any section; 'seq_len' is a [data] "
                                                    "key: move it under [data]")]
    for text, expected in cases:
        path = tmp_path / "run.toml"
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert expected.format(path=path) in str(err.value), str(err.value)
    # a near miss that no other section holds keeps its "did you mean"
    with pytest.raises(ConfigError, match=r"unknown key 'stpes' .*did you mean 'steps'\? valid keys: "):
        load_config(None, ["train.stpes=3"])


# ------------------------------------------------------------------------------------- the command line's shape
@pytest.mark.parametrize("argv, expected", [
    (["train.steps=2"], "'train.steps=2' is not a command: overrides for the demo: megatrain-jax demo train.steps=2"),
    (["--config", "demo_tiny.toml"], "did you mean: megatrain-jax train --config demo_tiny.toml"),
    (["demo_tiny.toml", "train.steps=3"], "did you mean: megatrain-jax train --config demo_tiny.toml train.steps=3"),
    (["train.steps=2", "-c", "x.toml"], "did you mean: megatrain-jax train --config x.toml train.steps=2"),
    (["demo", "--config", "x", "train.steps=2"], "the demo runs its built-in config and reads no config file: did you "
                                                 "mean: megatrain-jax train --config x train.steps=2"),
    (["demo", "--config=x"], "did you mean: megatrain-jax train --config x"),
    (["trian", "--config", "x"], "unknown command 'trian'; did you mean: megatrain-jax train --config x"),
])
def test_a_command_line_argparse_would_refuse_bare_says_what_was_meant(argv, expected, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "invalid choice" not in err and "unrecognized arguments" not in err, err


def test_the_module_says_how_to_give_the_demo_overrides():
    """``python -m megatrain_jax`` runs the demo; overrides without ``demo`` are answered with it, not argparse's
    "invalid choice"."""
    out = subprocess.run([sys.executable, "-m", "megatrain_jax", "train.steps=2"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 2 and "overrides for the demo: megatrain-jax demo train.steps=2" in out.stderr, out.stderr


def test_other_command_lines_still_reach_argparse(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])  # nothing close: argparse's list of commands
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "COMMAND" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- data that train would refuse
def test_plan_refuses_a_token_file_here_that_train_would_refuse_and_notes_one_that_is_not_here(tmp_path, capsys):
    """Out-of-vocabulary ids (windows are not read for the step time, but checked) and a broken file exit 2 naming
    the data; a missing file (the plan may be for another machine) is noted, and the plan goes on (exit 0)."""
    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([1, 2, 300, 4] * 64, dtype=np.int32))  # the tiny preset's vocabulary is 256
    for mode in ("windows", "packed"):
        assert main(["plan", "--config", str(DEMO_TOML), f"data.path={bad}", f"data.mode={mode}"]) == 2
        err = capsys.readouterr().err
        assert "train would refuse this data" in err and "token id 300 at position 2" in err, err
    (tmp_path / "lines.bin").write_text('{"text": "hello"}\n')  # no sidecar: not a token file
    assert main(["plan", "--config", str(DEMO_TOML), f"data.path={tmp_path / 'lines.bin'}"]) == 2
    assert "train would refuse this data" in capsys.readouterr().err
    assert main(["plan", "--config", str(DEMO_TOML), f"data.path={tmp_path / 'absent.npy'}"]) == 0
    out = capsys.readouterr().out
    assert f"note: the data cannot be read here ({tmp_path / 'absent.npy'} does not exist)" in out
    good = tmp_path / "good.npy"  # the demo config's 2% held out takes one window of 129 tokens: 164 of 8192
    np.save(good, np.arange(8192, dtype=np.int32) % 256)
    assert main(["plan", "--config", str(DEMO_TOML), f"data.path={good}"]) == 0
    assert "cannot be read" not in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["chat", "preference"])
def test_plan_refuses_instruction_and_preference_data_with_a_bad_line(fmt, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from test_instruct import make_tokenizer_folder
    tok = make_tokenizer_folder(tmp_path / "tok")
    line = ({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}]}
            if fmt == "chat" else {"prompt": "what is two plus two? ", "chosen": "four.", "rejected": "the dog."})
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(line) + "\n{not json\n")
    args = ["plan", "model.preset=tiny", "model.vocab_size=512", f"data.format={fmt}", "data.mode=padded",
            f"data.path={path}", f"data.tokenizer={tok}", f"data.cache_dir={tmp_path / 'cache'}", "data.batch_size=4"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"train would refuse this data: {path}:2: not valid JSON" in err, err
    path.write_text((json.dumps(line) + "\n") * 4)  # a batch of 4 rows: 4 examples, one a row
    assert main(args) == 0, capsys.readouterr().err
    assert main([*args[:-3], f"data.tokenizer={tmp_path / 'not-downloaded'}", *args[-2:]]) == 0
    assert "the data cannot be read here" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- windows past max_positions
def test_windows_longer_than_the_model_allows_are_refused_as_the_config_is_read(tmp_path, capsys):
    """``train`` refuses before anything loads (no run folder), with the plan's message; packed rows (positions
    restart at each document) are only noted by plan; a Hugging Face checkpoint's max_positions is its config.json's."""
    with pytest.raises(ConfigError, match=r"command-line override data\.seq_len=600: data\.seq_len=600 is longer "
                                          r"than the model's max_positions=512: train would refuse every batch"):
        load_config(None, ["data.seq_len=600"])
    run = tmp_path / "run"
    assert main(["train", "--config", str(DEMO_TOML), "data.seq_len=600", f"train.run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "longer than the model's max_positions=512: train would refuse every batch" in err and not run.exists()
    assert load_config(None, ["data.seq_len=600", "model.max_positions=600"]).data.seq_len == 600
    assert main(["plan", "--config", str(DEMO_TOML), "data.seq_len=600", "data.mode=packed",
                 "model.max_segments=4"]) == 0
    assert "note: data.seq_len=600 is longer than the model's max_positions=512: train refuses any example longer" \
           in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"data\.seq_len=256 is longer than the model's max_positions=128"):
        load_config(None, [f"model.hf_checkpoint={HF_LLAMA}", "data.seq_len=256"])


def test_a_warm_up_as_long_as_the_run_is_said(tmp_path, capsys):
    """The schedule fits a warm-up of train.steps or more into the run (the rate reaches optimizer.lr at the last
    step): trained, and said."""
    assert main(["train", "--config", str(DEMO_TOML), "train.steps=3", "optimizer.warmup_steps=1000",
                 "train.eval_every=0", "log.progress=lines", f"train.run_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "note: optimizer.warmup_steps=1000 is not under train.steps=3: the rate warms up over the first 2 steps" in out


def test_plan_checks_the_checkpoints_weights_as_train_does(tmp_path, capsys):
    """plan reads the weights' headers as train's start does: a truncated file is refused (exit 2), a folder with its
    config.json only (the plan before the download) is a note, a whole one plans."""
    import shutil
    good = tmp_path / "good"
    shutil.copytree(HF_LLAMA, good)
    assert main(["plan", f"model.hf_checkpoint={good}", "log.progress=lines"]) == 0
    capsys.readouterr()
    cut = tmp_path / "cut"
    shutil.copytree(HF_LLAMA, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["plan", f"model.hf_checkpoint={cut}"]) == 2
    assert "train would refuse these weights" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(HF_LLAMA / "config.json", bare / "config.json")
    assert main(["plan", f"model.hf_checkpoint={bare}"]) == 0
    assert "holds no weights here (config.json only)" in capsys.readouterr().out


def test_data_held_out_and_never_evaluated_is_said(tmp_path, capsys):
    """``data.eval_fraction > 0`` with ``train.eval_every = 0``: the held-out share neither trains nor evaluates."""
    from megatrain_jax.cli import main
    assert main(["train", "model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
                 "log.tensorboard=false", "train.steps=1", "data.eval_fraction=0.1", "train.eval_every=0",
                 f"train.run_dir={tmp_path / 'run'}"]) == 0
    assert "note: data.eval_fraction=0.1 holds out that share of the data, which train.eval_every=0 never " \
           "evaluates" in capsys.readouterr().out
