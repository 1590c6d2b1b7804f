"""The command line: TOML configs to typed dataclasses, and train / plan / convert / plot end to end."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import tomllib
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from megatrain_jax.cli import ConfigError, load_config, main, parse_config, to_toml
from megatrain_jax.cli.run import DEMO
from megatrain_jax.cli.run_config import RunConfig
from megatrain_jax.cli.toml_dataclass import apply_overrides
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.models.config import RopeScaling

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "experiments" / "configs"
HF_LLAMA = REPO / "tests" / "fixtures" / "hf" / "llama"

# A run small enough for seconds on a CPU: the tiny preset (hidden 64) with 2 layers, 32-token rows.
TINY_RUN = ["model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
            "data.eval_fraction=0.05", "train.eval_batches=1", "log.progress=lines", "log.tensorboard=false"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------ config files
def test_sections_become_typed_dataclasses(tmp_path):
    path = write(tmp_path, """
[model]
preset = "tiny"
layers = 3
rope_scaling = { factor = 4.0, original_max_position = 256 }
[data]
seq_len = 64
[engine]
micro_batches = 2
stream_dtype = "bfloat16"
[optimizer]
lr = 1          # an integer where a float is expected is fine
decay = "constant"
[train]
steps = 7
peak_tflops = 989
""")
    cfg = load_config(path)
    assert cfg.model.overrides["layers"] == 3
    assert cfg.model.build().layers == 3 and cfg.model.build().rope_scaling == RopeScaling(
        factor=4.0, original_max_position=256)
    assert cfg.data.seq_len == 64 and cfg.data.batch_size == 8  # default kept
    assert cfg.engine == EngineConfig(micro_batches=2, stream_dtype="bfloat16")
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.train.steps == 7 and cfg.train.peak_tflops == 989.0


def test_dotted_overrides(tmp_path):
    path = write(tmp_path, "[model]\npreset = 'tiny'\n[train]\nsteps = 100\n")
    cfg = load_config(path, ["model.layers=4", "train.steps=20", "engine.clip_norm=none", "optimizer.lr=1e-3",
                             "data.mode=packed", "log.wandb=true", "model.rope_scaling.factor=2.0"])
    assert cfg.model.build().layers == 4
    assert cfg.train.steps == 20 and cfg.engine.clip_norm is None and cfg.optimizer.lr == 1e-3
    assert cfg.data.mode == "packed" and cfg.log.wandb is True
    assert cfg.model.build().rope_scaling == RopeScaling(factor=2.0)
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(path, ["steps=3"])


@pytest.mark.parametrize("text, override, expected", [
    ("[model]\nlyers = 2\n", (), "'layers'"),
    ("[trian]\nsteps = 2\n", (), r"\[train\]"),
    ("", ("train.stpes=3",), "'steps'"),
    ("", ("engine.microbatches=2",), "'micro_batches'"),
    ("", ("optimizer.warmup=10",), "'warmup_steps'"),
])
def test_unknown_key_names_the_closest(tmp_path, text, override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, text), override)


@pytest.mark.parametrize("override, expected", [
    ("train.steps=ten", r"\[train\] steps must be an integer, got 'ten'"),
    ("train.steps=2.5", "must be an integer"),
    ("engine.clip_norm=true", "must be a finite number or none"),
    ("optimizer.decay=cosin", r"one of 'cosine', 'constant'.*did you mean 'cosine'"),
    ("engine.micro_batches=0", "micro_batches must be an integer >= 1"),
    ("model.preset=llama9", "unknown preset 'llama9'"),
    ("model.family=gpt", "must be one of 'llama'"),
    ("train.resume=3", "must be true or false or a string"),
    ("train.eval_every=10", "needs held-out data"),
    ("engine.micro_batches=3", "cannot be split into"),
    ("model.rope_theta=0", "rope_theta must be a positive, finite number"),
    ("model.norm_eps=-1", "norm_eps must be a positive, finite number"),
    ("optimizer.weight_decay=-1", "weight_decay >= 0, finite"),
    ("optimizer.eps=0", "eps > 0"),
    ("optimizer.lr=0", "need lr > 0"),
    ("optimizer.lr=inf", "lr must be a finite number"),
    ("data.prefetch=-1", r"\[data\] prefetch must be an integer >= 0"),
    ("data.seq_len=0", r"\[data\] seq_len must be an integer >= 1"),
    ("data.seed=-1", r"\[data\] seed must be an integer >= 0"),
    ("data.demo_tokens=0", r"\[data\] demo_tokens must be an integer >= 1"),
])
def test_wrong_values_say_what_is_allowed(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


def test_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))
    with pytest.raises(ConfigError, match="must be a table"):
        parse_config({"model": 3})


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["model.preset=7b", "model.layers=4", "engine.clip_norm=none", "train.export_hf=out",
                             "model.rope_scaling.factor=8.0", "train.resume=true"])
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg


def test_example_configs_parse_and_demo_file_matches_the_builtin_demo():
    names = sorted(p.name for p in CONFIGS.glob("*.toml"))
    for required in ("demo_tiny.toml", "h100_3p5b_32k.toml", "h100_3p5b_98k.toml", "h100_7b_32k.toml",
                     "h200_7b_32k.toml"):
        assert required in names
    assert any(n.startswith("gh200") for n in names)
    assert {"h100_sft_8b.toml", "h200_sft_8b.toml"} <= set(names)
    spec = importlib.util.spec_from_file_location("plan_comments", REPO / "scripts" / "plan_comments.py")
    plan_comments = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_comments)
    for name in names:
        if "hf_checkpoint" in (CONFIGS / name).read_text():  # a Hugging Face folder the user downloads first
            with pytest.raises(ConfigError, match="config.json"):
                load_config(CONFIGS / name)
            cfg = plan_comments.load_example(CONFIGS / name)  # the shape its '# plan shape:' line names
            assert cfg.data.format == "chat" and cfg.train.export_hf
        else:
            load_config(CONFIGS / name)
    assert load_config(CONFIGS / "demo_tiny.toml") == parse_config(DEMO)


def test_shipped_configs_on_the_demo_corpus_pass_the_data_check_train_runs_at_start():
    """Every shipped config that trains on the built-in demo corpus (no data.path) has data ``train`` accepts as
    written: its training split fills a batch and, where it evaluates, its held-out share holds a whole window
    (five configs held out 0.001 of the demo's 1M tokens, no window of 2,048, so ``train`` refused them at start)."""
    from megatrain_jax.cli.run import packed_pieces
    checked = []
    for path in sorted(CONFIGS.glob("*.toml")):
        if "hf_checkpoint" in path.read_text():
            continue
        cfg = load_config(path)
        if cfg.data.path is not None:
            continue
        model = cfg.model.build()
        cfg.data.check(model.vocab_size, packed_pieces(model, cfg.data), model.max_positions,
                       evaluate=bool(cfg.train.eval_interval(cfg.data.eval_fraction)))
        checked.append(path.name)
    assert {"h200_7b_32k.toml", "h100_7b_32k.toml", "h100_3p5b_98k.toml", "demo_tiny.toml"} <= set(checked)


def test_defaults_without_a_file():
    assert load_config(None) == RunConfig()
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


# ------------------------------------------------------------------------------------------ commands
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One short training run shared by the tests that read its folder."""
    run_dir = tmp_path_factory.mktemp("run")
    status = main(["train", "--config", str(CONFIGS / "demo_tiny.toml"), *TINY_RUN, "train.steps=5",
                   "train.eval_every=2", "train.log_every=2", f"train.run_dir={run_dir}"])
    assert status == 0
    return run_dir


def test_train_end_to_end_writes_metrics(trained_run):
    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        for key in ("loss", "grad_norm", "lr", "tokens_per_s", "model_tflops", "host_peak_rss_gib", "elapsed_s"):
            assert key in r and np.isfinite(r[key])
    # evaluation after steps 2 and 4 (every 2) and after the last step
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 5]
    assert all(np.isclose(r["eval_ppl"], np.exp(r["eval_loss"])) for r in records if "eval_loss" in r)
    assert records[0]["lr"] == 0.0 and records[-1]["lr"] > 0  # warm-up from 0
    # the resolved config is saved and reproduces the run's config
    saved = load_config(trained_run / "config.toml")
    assert saved.train.steps == 5 and saved.model.build().layers == 2


def test_train_progress_lines(tmp_path, capsys):
    assert main(["train", *TINY_RUN, "train.steps=3", "train.log_every=1", "train.eval_every=3",
                 f"train.run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "step      1/3  loss" in out and "step      3/3" in out and "tok/s" in out
    assert "eval      3  eval_loss" in out and "done: loss" in out


def test_train_profiles_the_step_it_is_asked_to(tmp_path, capsys):
    """``train.profile_step``: that step's seconds per lane go to metrics.jsonl and a line of the output (beside
    the plan's busy seconds where the step-time model knows the GPU; not on this CPU); a negative step is refused."""
    assert main(["train", *TINY_RUN, "train.steps=3", "train.profile_step=2", f"train.run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "step 2 profiled, each op waited for before the next: GPU " in out and "host update" in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("profiled") for r in records] == [None, 1.0, None]
    assert records[1]["profile_serialized_s"] > 0 and records[1]["profile_compute_s"] > 0
    assert main(["train", *TINY_RUN, "train.profile_step=-1", f"train.run_dir={tmp_path / 'x'}"]) == 2
    assert "profile_step must be >= 0" in capsys.readouterr().err
    assert main(["train", *TINY_RUN, "train.steps=3", "train.profile_step=4", f"train.run_dir={tmp_path / 'y'}"]) == 2
    assert "profile_step=4 is past the run's last step (steps=3)" in capsys.readouterr().err


def test_the_profile_line_sets_each_lane_beside_the_plan():
    from megatrain_jax.cli.run import profile_line
    from megatrain_jax.plan.step_time import StepTime
    m = {"step": 4, "profile_serialized_s": 9.5, "profile_compute_s": 3.0, "profile_device_update_s": 0.25,
         "profile_h2d_s": 2.5, "profile_d2h_s": 1.25, "profile_host_update_s": 2.5}
    predicted = StepTime(seconds=4.8, bound="gpu", busy={"main": 0.6, "gpu": 2.98, "h2d": 2.34, "d2h": 1.25,
                                                          "host": 2.07}, h2d_bytes=0, d2h_bytes=0, resident_share=0.0,
                         speeds="H200")
    line = profile_line(m, predicted)
    assert ("GPU 3.25 s (plan 2.98), to the GPU 2.50 s (plan 2.34), to the host 1.25 s (plan 1.25), host update "
            "2.50 s (plan 2.07); serialized 9.50 s (the plan's overlapped step: 4.80 s)") in line
    assert "plan" not in profile_line(m, None)


def test_train_from_hf_checkpoint_and_export(tmp_path, monkeypatch):
    from megatrain_jax.hf import load_hf
    export = tmp_path / "export"
    monkeypatch.chdir(tmp_path)  # a relative export folder: the run's config.toml records where it went
    assert main(["train", f"model.hf_checkpoint={HF_LLAMA}", "model.dtype=float32", *TINY_RUN[1:],
                 "train.steps=2", "optimizer.lr=1e-12", "optimizer.weight_decay=0.0", f"train.run_dir={tmp_path}",
                 "train.export_hf=export"]) == 0
    assert tomllib.loads((tmp_path / "config.toml").read_text())["train"]["export_hf"] == str(export)
    _, io, blocks = load_hf(HF_LLAMA, dtype="float32")
    _, io2, blocks2 = load_hf(export, dtype="float32")  # trained with a negligible lr: the loaded weights
    np.testing.assert_allclose(io2["embedding"], io["embedding"], rtol=1e-2, atol=1e-6)
    np.testing.assert_allclose(blocks2[0]["attn"]["q"]["kernel"], blocks[0]["attn"]["q"]["kernel"],
                               rtol=1e-2, atol=1e-6)


def test_checkpoint_and_resume(tmp_path, capsys):
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=4"]) == 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    assert main(["train", *run, "train.steps=6"]) == 2  # a fresh run refuses to overwrite checkpoints
    capsys.readouterr()
    # resumed past the step to profile: said, and nothing profiled
    assert main(["train", *run, "train.steps=6", "train.resume=true", "train.profile_step=3"]) == 0
    assert "train.profile_step=3 is not after this run's start (step 4): no step is profiled" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and not any(r.get("profiled") for r in records)


@pytest.mark.parametrize("key", ["train.run_dir", "train.checkpoint_dir", "train.resume", "train.export_hf",
                                 "data.path", "data.tokenizer", "data.cache_dir", "model.hf_checkpoint"])
def test_an_empty_path_is_a_config_error_not_the_current_directory(key):
    with pytest.raises(ConfigError, match=rf"command-line override.* {key}=: .*{key.split('.')[1]} is an empty path, "
                                          rf"which would mean the current directory: give "):
        parse_config({}, overrides=[f"{key}="])


def test_train_into_an_empty_run_dir_writes_nothing_here(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY_RUN, "train.steps=1", "train.run_dir="]) == 2
    assert "run_dir is an empty path" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_config_errors_exit_cleanly(capsys):
    assert main(["train", "model.lyers=2"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'layers'" in err and "Traceback" not in err


def test_plan_prints_the_table(capsys):
    assert main(["plan", "model.preset=7b", "data.seq_len=2048", "data.batch_size=16", "engine.micro_batches=2",
                 "--host-gib", "1000", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "master weights, float32" in out and "Adam moments" in out and "boundary activations" in out
    assert "fits" in out and "OVER" not in out
    gpu = lambda text: float(text.split("GPU, at its peak")[1].split(" total ")[1].split()[0])  # noqa: E731
    assert main(["plan", "model.preset=7b", "data.seq_len=2048", "data.batch_size=16", "engine.micro_batches=2",
                 "train.devices=2", "--host-gib", "1000", "--gpu-gib", "80"]) == 0
    two = capsys.readouterr().out
    assert "per GPU of 2" in two and "2 pools, one per GPU" in two and gpu(two) < 0.75 * gpu(out)
    assert main(["plan", "model.preset=7b", "--host-gib", "32", "--gpu-gib", "8"]) == 1
    out = capsys.readouterr().out
    assert "OVER by" in out and "options that fit" in out


def test_plot_writes_a_png(trained_run, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    assert main(["plot", str(trained_run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_convert_hf_npz_hf_round_trip(tmp_path):
    pytest.importorskip("ml_dtypes")
    from megatrain_jax.hf import load_hf
    cfg, io, blocks = load_hf(HF_LLAMA, dtype="float32")
    npz = tmp_path / "llama.npz"
    assert main(["convert", str(HF_LLAMA), str(npz)]) == 0
    assert main(["convert", str(npz), str(tmp_path / "hf32"), "--dtype", "float32"]) == 0
    cfg2, io2, blocks2 = load_hf(tmp_path / "hf32", dtype="float32")
    assert dataclasses.replace(cfg2, max_positions=cfg.max_positions) == cfg
    np.testing.assert_array_equal(io2["embedding"], io["embedding"])
    np.testing.assert_array_equal(blocks2[1]["mlp"]["down"]["kernel"], blocks[1]["mlp"]["down"]["kernel"])
    # HF -> HF in bfloat16: same names, values rounded to bf16
    assert main(["convert", str(HF_LLAMA), str(tmp_path / "hf16")]) == 0
    _, io3, _ = load_hf(tmp_path / "hf16", dtype="float32")
    np.testing.assert_allclose(io3["embedding"], io["embedding"], rtol=1e-2, atol=1e-3)
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_convert_from_an_npz_that_is_not_one_says_so(tmp_path, capsys):
    bad = tmp_path / "params.npz"
    bad.write_bytes(b"not a zip" * 50)
    assert main(["convert", str(bad), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"{bad} is not a .npz archive" in err and "megatrain-jax convert HF_DIR params.npz" in err
    assert "allow_pickle" not in err


def test_plot_of_a_file_that_is_not_a_run_folder_says_so(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    assert main(["plot", str(tmp_path / "notes.txt")]) == 2
    assert f"{tmp_path / 'notes.txt'} is a file, not a run folder" in capsys.readouterr().err


def test_convert_hf_orbax_hf_round_trip(tmp_path):
    """HF -> parameters-only Orbax -> HF keeps every tensor and the config."""
    from megatrain_jax.hf import load_hf
    cfg, io, blocks = load_hf(HF_LLAMA, dtype="float32")
    assert main(["convert", str(HF_LLAMA), str(tmp_path / "orbax"), "--to", "orbax"]) == 0
    assert main(["convert", str(tmp_path / "orbax"), str(tmp_path / "hf"), "--to", "hf", "--dtype", "float32"]) == 0
    cfg2, io2, blocks2 = load_hf(tmp_path / "hf", dtype="float32")
    assert dataclasses.replace(cfg2, max_positions=cfg.max_positions) == cfg
    for a, b in zip(jax.tree.leaves((io, blocks)), jax.tree.leaves((io2, blocks2))):
        np.testing.assert_array_equal(a, b)
    assert main(["convert", str(HF_LLAMA), str(tmp_path / "orbax"), "--to", "orbax"]) == 2  # never overwrites


def test_convert_training_checkpoint_to_hf(tmp_path):
    """The parameters of a fit checkpoint export to an HF folder equal to the trained model's."""
    from flax import nnx
    from megatrain_jax import Batch, Decoder, TrainConfig, fit, preset
    from megatrain_jax.hf import load_hf
    cfg = preset("tiny", layers=2)
    rng = np.random.default_rng(0)
    batches = [Batch.from_windows(rng.integers(0, cfg.vocab_size, (2, 17))) for _ in range(3)]
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    fit(model, batches, train=TrainConfig(log_every=0, checkpoint_dir=str(tmp_path / "ckpt")))
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf", "--dtype", "float32"]) == 0
    _, io, blocks = load_hf(tmp_path / "hf", dtype="float32")
    np.testing.assert_array_equal(io["embedding"], np.asarray(model.io.embedding[...]))
    np.testing.assert_array_equal(blocks[1]["mlp"]["up"]["kernel"], np.asarray(model.blocks[1].mlp.up.kernel[...]))


def test_bench_is_a_script_not_a_command(capsys):
    """The benchmark times named layouts of the source repository: ``python experiments/bench.py``, which the
    package never loads (the import linter sees every tie); the command line does not offer it."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--configs", "tiny_cpu"])
    assert e.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "experiments/bench.py", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0 and "--configs" in out.stdout


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "megatrain_jax", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0 and "train" in out.stdout and "plan" in out.stdout and "convert" in out.stdout


# ------------------------------------------------------------------------------------------ issue 13
@pytest.mark.parametrize("override, expected", [
    ("data.mode=pakced", r"\[data\] mode must be one of 'windows', 'packed', 'padded', got 'pakced'; did you mean "
                         r"'packed'\?"),
    ("engine.stream_dtype=bfloat61", r"stream_dtype must be one of 'float32', 'bfloat16' or none.*"
                                     r"did you mean 'bfloat16'\?"),
    ("model.dtype=flaot32", r"did you mean 'float32'\?"),
    ("model.attention_impl=cudn", r"did you mean 'cudnn'\?"),
    ("model.family=lama", r"did you mean 'llama'\?"),
    ("log.progress=bars", r"did you mean 'bar'\?"),
])
def test_enumerated_value_typos_say_did_you_mean(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


def test_enumerated_value_typo_in_a_file_says_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.toml \[data\] mode must be one of .*did you mean 'packed'\?"):
        load_config(write(tmp_path, "[data]\nmode = 'pakced'\n"))


def test_errors_name_the_override_or_the_file_the_value_came_from(tmp_path):
    path = write(tmp_path, "[model]\npreset = 'tiny'\nlayers = 3\n[engine]\nmicro_batches = 2\n")
    cases = [  # (overrides, the start of the message)
        (["model.layers=abc"], "command-line override model.layers=abc: [model] layers must be an integer"),
        (["model.rope_scaling.factor=x"],
         "command-line override model.rope_scaling.factor=x: [model] rope_scaling factor must be a finite number"),
        (["train.stpes=3"], "unknown key 'stpes' in command-line override train.stpes=3; did you mean 'steps'?"),
        (["trian.steps=3"], "command-line override trian.steps=3: unknown section [trian]"),
        (["engine.micro_batches=0"], "command-line override engine.micro_batches=0: EngineConfig.micro_batches"),
        # a check across keys that the file and an override both fed
        (["data.batch_size=3"], f"{path} with command-line override data.batch_size=3: [data] batch_size: a batch of "
                                f"3 rows cannot be split into micro_batches = 2"),
        (["model.preset=llama9"], "command-line override model.preset=llama9: unknown preset"),
        # a value refused by its section's own check: the override the message names, not every one of the section
        (["data.seq_len=64", "data.eval_fraction=1.5"],
         "command-line override data.eval_fraction=1.5: [data] eval_fraction must lie in [0, 1)"),
    ]
    for overrides, start in cases:
        with pytest.raises(ConfigError) as err:
            load_config(path, overrides)
        assert str(err.value).startswith(start), (overrides, str(err.value))
    # A value from the file keeps the file's name, even when other keys were overridden.
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nlayers = 'abc'\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad, ["model.preset=tiny", "train.steps=3"])
    assert str(err.value).startswith(f"{bad} [model] layers must be an integer"), str(err.value)
    # The last override of a key is the one named (it is the one applied).
    with pytest.raises(ConfigError, match=r"^command-line override train\.steps=x: "):
        load_config(path, ["train.steps=2", "train.steps=x"])


def test_command_line_errors_name_the_override(capsys):
    assert main(["train", "model.layers=abc"]) == 2
    err = capsys.readouterr().err
    assert "command-line override model.layers=abc: [model] layers must be an integer" in err
    assert "Traceback" not in err


def test_train_picks_the_lean_mode_when_host_ram_is_short(tmp_path, capsys, monkeypatch):
    """With less host RAM than the run needs as configured (but enough for its lean mode), ``train`` keeps
    gradients on the device, says so, trains, and records what ran in config.toml."""
    from megatrain_jax.plan import machine, memory
    wide = [*TINY_RUN, "model.hidden=512", "model.ffn=1024"]  # megabytes of gradients
    cfg = load_config(None, wide)
    args = (cfg.model.build(), cfg.engine, cfg.data.batch_size, cfg.data.seq_len)
    full = memory.plan(*args, host_ram_bytes=1000 * 2**30, detect=False)
    lean = memory.plan(*args[:1], dataclasses.replace(cfg.engine, grads_on_gpu=3), *args[2:],
                            host_ram_bytes=1000 * 2**30, detect=False)
    assert lean.host_total < full.host_total
    between = lambda: (lean.host_total + full.host_total) // 2  # noqa: E731
    monkeypatch.setattr(machine, "available_host_bytes", between)
    monkeypatch.setattr(memory, "available_host_bytes", between)
    assert main(["train", *wide, "train.steps=2", "train.memory_check=false", f"train.run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "host RAM is short" in out and "engine.grads_on_gpu=" in out and "done: loss" in out
    assert load_config(tmp_path / "config.toml").engine.grads_on_gpu > 0


def test_resident_layers_auto_is_picked_by_the_plan_and_recorded(tmp_path, capsys):
    """``engine.resident_layers=auto`` becomes a number before the engine starts: the plan's pick is said and
    config.toml records it (no GPU here: none resident)."""
    assert main(["train", *TINY_RUN, "train.steps=1", "engine.resident_layers=auto", f"train.run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "engine.resident_layers='auto': 0 (no GPU to plan for)" in out and "done: loss" in out
    assert load_config(tmp_path / "config.toml").engine.resident_layers == 0
    assert main(["plan", "model.preset=7b", "model.layers=16", "data.seq_len=2048", "data.batch_size=4",
                 "engine.resident_layers=auto", "engine.resident_io=true", "--host-gib", "120",
                 "--gpu-gib", "80"]) == 0
    assert "16 of 16 blocks GPU-resident, the most that fit" in capsys.readouterr().out


def test_packed_mode_with_a_bound_of_one_segment_is_refused_with_what_to_set(tmp_path, capsys):
    args = ["train", "--config", str(CONFIGS / "demo_tiny.toml"), *TINY_RUN, "train.steps=1", "data.mode=packed",
            "model.max_segments=1", f"train.run_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    assert "needs model.max_segments >= 2 (a row's padding counts as one segment), got 1" in capsys.readouterr().err


def test_the_start_line_counts_the_devices_the_run_uses(monkeypatch):
    """``train.devices=1`` on a host that shows 2: the start line says 1 of the 2 (issue 31 item 4)."""
    from megatrain_jax.cli import run
    monkeypatch.setattr(run.jax, "device_count", lambda: 2)
    assert run._device_line(1).endswith(", 1 device(s) of the 2 visible")
    assert run._device_line(None).endswith(", 2 device(s)") and run._device_line(2).endswith(", 2 device(s)")


def test_held_out_data_is_evaluated_unless_eval_every_says_otherwise(tmp_path, capsys):
    """``data.eval_fraction`` without ``train.eval_every``: evaluated every tenth of the run (issue 32); an
    explicit ``eval_every = 0`` keeps it off."""
    run = [*TINY_RUN, "data.eval_fraction=0.05", "train.steps=20", "train.eval_every=none", "train.eval_batches=1"]
    assert main(["train", *run, f"train.run_dir={tmp_path / 'auto'}"]) == 0
    assert "evaluating the held-out 0.05 of the data every 2 steps" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == list(range(2, 21, 2))
    assert main(["train", *run, "train.eval_every=0", f"train.run_dir={tmp_path / 'off'}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval_loss" in r for r in rows)
    capsys.readouterr()
    many = ["train.steps=2", "train.eval_batches=100000", f"train.run_dir={tmp_path / 'many'}"]
    assert main(["train", *run, *many]) == 0
    said = re.search(r"every 1 steps \((\d+) batch(?:es)?, all the held-out part holds of train.eval_batches=100000;",
                     capsys.readouterr().out)
    assert said and 0 < int(said.group(1)) < 100000  # what it evaluates, not what was asked


def test_longrope_factors_are_toml_arrays():
    """A Phi-3 preset with LongRoPE from a config file: its factors are arrays (tuples in the config), written back
    by to_toml; a wrong entry names the key."""
    rope = {"kind": "longrope", "factor": 4.0, "original_max_position": 64, "short_factor": [1.0] * 8,
            "long_factor": [1, 2, 3, 4, 5, 6, 7, 8]}
    cfg = parse_config({"model": {"preset": "tiny", "family": "phi3", "rope_scaling": rope}})
    assert cfg.model.build().rope_scaling.long_factor == tuple(float(i) for i in range(1, 9))
    assert parse_config(tomllib.loads(to_toml(cfg))) == cfg
    with pytest.raises(ConfigError, match=r"rope_scaling long_factor must be an array, each entry a finite number or none"):
        parse_config({"model": {"preset": "tiny", "family": "phi3", "rope_scaling": dict(rope, long_factor=["x"])}})


def test_a_config_whose_checkpoint_is_not_downloaded_yet_says_how_to_plan_it(tmp_path, capsys):
    """A shipped HF config before its download: the error says how to plan the shape without it, and that
    way (``model.hf_checkpoint=none`` and a preset) plans."""
    config = CONFIGS / "rtx4090_sft_8b.toml"
    assert main(["plan", "--config", str(config), "--host-gib", "128", "--gpu-gib", "24"]) == 2
    err = capsys.readouterr().err
    assert "no config.json in checkpoints/Llama-3.1-8B-Instruct" in err
    assert "model.hf_checkpoint=none model.preset=NAME" in err
    assert main(["plan", "--config", str(config), "--host-gib", "128", "--gpu-gib", "24", "model.hf_checkpoint=none",
                 "model.preset=llama3.1-8b"]) == 0
    out = capsys.readouterr().out
    assert "memory plan: 8.03 B params (32 layers, hidden 4096, vocab 128256)" in out
    assert "capacity mode (this run)" in out


def test_plan_refuses_windows_longer_than_the_model_allows(capsys):
    """``plan`` says what ``train`` would: rows of windows longer than max_positions are refused (exit 2)."""
    from megatrain_jax.cli import main
    assert main(["plan", "model.preset=tiny", "data.seq_len=1024"]) == 2
    assert "longer than the model's max_positions=512" in capsys.readouterr().err


@pytest.mark.parametrize("code,advice", [(30, "read-only; make it writable or choose another folder"),
                                         (28, "the disk is full; free space there"),
                                         (20, "a part of the path is a file, not a folder")])
def test_a_path_the_machine_refuses_is_a_clear_error_not_a_traceback(monkeypatch, capsys, code, advice):
    """Read-only, full or mistyped paths (the run folder's lock, a checkpoint folder) end with exit 2 and the path
    named; other OS errors still raise (a bug, or the machine failing, is not bad input)."""
    from megatrain_jax.cli import commands

    def refuse(args):
        raise OSError(code, os.strerror(code), "/runs/r1/.lock")
    monkeypatch.setitem(commands.COMMANDS, "plot", refuse)
    assert commands.main(["plot", "/runs/r1"]) == 2
    err = capsys.readouterr().err
    assert "/runs/r1/.lock" in err and advice in err and "Traceback" not in err

    def full(args):  # no file named (a write deep in a library): the command's own outputs are named instead
        raise OSError(28, os.strerror(28))
    monkeypatch.setitem(commands.COMMANDS, "convert", full)
    assert commands.main(["convert", "/in", "/out"]) == 2
    err = capsys.readouterr().err
    assert "a path megatrain-jax convert writes: the disk is full; free space there or choose another folder (the " \
           "output given to convert)" in err and "train.run_dir" not in err, err

    def fail(args):
        raise OSError(5, os.strerror(5), "/dev/sda")
    monkeypatch.setitem(commands.COMMANDS, "plot", fail)
    with pytest.raises(OSError):
        commands.main(["plot", "/runs/r1"])


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
@pytest.mark.parametrize("key", ["data.eval_fraction", "engine.clip_norm", "train.peak_tflops",
                                 "model.final_logit_softcap", "model.rope_scaling.factor", "optimizer.b1"])
def test_a_number_in_a_config_is_finite(key, value):
    """TOML reads nan and inf; no number of a run config means them: refused, naming the key."""
    section, name = key.split(".", 1)
    with pytest.raises(ConfigError, match=rf"{name.split('.')[-1]} must be .*finite number.*got {value}"):
        load_config(None, ["model.preset=7b", f"{key}={value}"])


@pytest.mark.parametrize("value", ["inf", "nan", "-3", "0", "lots"])
@pytest.mark.parametrize("flag", ["--host-gib", "--gpu-gib"])
def test_plan_sizes_are_positive_finite_numbers(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "model.preset=7b", flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{value!r} is not a size in GiB" in err and "Traceback" not in err


def test_held_out_share_is_a_fraction():
    from megatrain_jax.data import DataConfig
    for bad in (float("nan"), -0.1, 1.0):
        with pytest.raises(ValueError, match=r"eval_fraction must lie in \[0, 1\)"):
            DataConfig(eval_fraction=bad)


def test_a_run_whose_checkpoints_or_export_cannot_fit_its_disk_is_refused_before_it_trains(tmp_path, monkeypatch,
                                                                                            capsys):
    """train counts what it will write on each disk (the checkpoints the keep-N rule holds at once, of masters and
    moments: disk_room.peak_checkpoints; the bfloat16 export) against that disk's free space:
    short, it refuses at start, saying the bytes, before it writes anything but its locks."""
    from megatrain_jax.cli import disk_room
    cfg = load_config(None, [*TINY_RUN, "train.checkpoint_every=2", "train.steps=10", f"train.run_dir={tmp_path}"])
    model = cfg.model.build()
    size = disk_room.checkpoint_bytes(model, cfg.engine)
    assert size == model.param_count() * 12  # float32 masters and two float32 moments
    (folder, total, what, _), = disk_room.writes(cfg.train, model, cfg.engine)
    assert total == 4 * size and "4 checkpoints" in what  # checkpoint_keep 3, and the next before the oldest goes
    export = dataclasses.replace(cfg.train, checkpoint_every=0, export_hf=str(tmp_path / "hf"))
    assert [w[1] for w in disk_room.writes(export, model, cfg.engine)] == [2 * model.param_count()]
    monkeypatch.setattr(disk_room, "free_space", lambda folder: (size, 7))  # room for one checkpoint only
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "train.checkpoint_every=2", "train.steps=10", f"train.run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "not enough disk for this run: 4 checkpoints of about" in err and "train.checkpoint_keep" in err, err
    assert {p.name for p in run.rglob("*")} <= {".lock", "checkpoints"}  # the run locks only
    assert main(["train", *TINY_RUN, "train.checkpoint_every=2", "train.checkpoint_keep=1", "train.steps=2",
                 f"train.run_dir={run}"]) == 2  # two checkpoints (no more than the run saves) do not fit
    assert main(["plan", *TINY_RUN, "train.checkpoint_every=2", "train.steps=10", f"train.run_dir={run}"]) == 0
    assert "disk: 4 checkpoints of about" in capsys.readouterr().out  # plan says what train would refuse
    monkeypatch.setattr(disk_room, "free_space", lambda folder: None)  # the system does not say: not checked
    assert main(["train", *TINY_RUN, "train.checkpoint_every=2", "train.steps=2", f"train.run_dir={run}"]) == 0
