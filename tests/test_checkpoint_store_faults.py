"""Parameter files and checkpoints that are not what they claim, refused when they are read (naming what is wrong
and what to do) rather than at a later export or resume, and saves that fail or are cut short losing nothing."""

from __future__ import annotations

import json
from contextlib import closing as _closing

import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Engine, EngineConfig, Hook, TrainConfig, default_optimizer, fit
from megatrain_jax.checkpoint import Checkpointer, ShapeMismatchError, committed_steps, load_params, save_params
from megatrain_jax.checkpoint.params import MARKER, check_params
from megatrain_jax.cli.convert import convert, load_npz, save_npz
from megatrain_jax.contract.layered import block_params, io_params
from megatrain_jax.models import Decoder, preset
from megatrain_jax.checkpoint.parts import nest
from megatrain_jax.checkpoint.store import NonFiniteCheckpointError
from megatrain_jax.data import DataConfig
from megatrain_jax.engine.parts import IO
from megatrain_jax.engine.transfer import host_view

CFG = preset("tiny", layers=2, vocab_size=97, hidden=32, ffn=64, heads=2, kv_heads=1)
ENGINE_CFG = preset("tiny", layers=2, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def weights():
    """(io, blocks) of a tiny decoder as float32 numpy pure dicts."""
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    pure = lambda s: {k: np.asarray(v) for k, v in _flat(nnx.to_pure_dict(s)).items()}  # noqa: E731
    return pure(io_params(model)), [pure(b) for b in block_params(model)]


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _trees(weights, change=lambda flat: None):
    """``weights`` as nested trees, after ``change(flat)`` edited the flat ``{"io/...", "blocks/1/...": array}``."""
    io, blocks = weights
    flat = {**{f"io/{k}": v.copy() for k, v in io.items()},
            **{f"blocks/{i}/{k}": v.copy() for i, b in enumerate(blocks) for k, v in b.items()}}
    change(flat)
    tree = nest(flat, sep="/")
    return tree["io"], [tree["blocks"][str(i)] for i in range(len(blocks))]


def _drop(flat):
    del flat["blocks/1/attn/q/kernel"]


def _reshape(flat):
    flat["blocks/0/mlp/up/kernel"] = np.zeros((32, 65), np.float32)


def _extra(flat):
    flat["blocks/0/mlp/bias"] = np.zeros(64, np.float32)


def _integer(flat):
    flat["io/final_norm/scale"] = np.ones(32, np.int32)


CHANGES = {"missing": (_drop, "blocks/1/attn/q/kernel: missing"),
           "shape": (_reshape, "blocks/0/mlp/up/kernel: expected shape (32, 64), found (32, 65)"),
           "extra": (_extra, "blocks/0/mlp/bias: not a parameter of this model"),
           "dtype": (_integer, "io/final_norm/scale: int32, not floating point")}


@pytest.mark.parametrize("how", ["missing", "shape", "extra"])  # save_params writes every leaf as float32
def test_a_parameter_folder_that_does_not_fit_its_config_is_refused_at_load_naming_the_leaf(tmp_path, weights, how):
    """Before: load_params gave the trees as they were, and only a later export (to Hugging Face) found the missing
    or misshapen leaf; an .npz or Orbax output was written with it."""
    change, said = CHANGES[how]
    save_params(tmp_path / "p", CFG, *_trees(weights, change))
    with pytest.raises(ShapeMismatchError, match="does not hold the parameters its config describes") as err:
        load_params(tmp_path / "p")
    assert said in str(err.value) and "write it again" in str(err.value)
    with pytest.raises(ShapeMismatchError, match="nothing was written"):
        convert(tmp_path / "p", tmp_path / "out.npz")
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.parametrize("how", list(CHANGES))
def test_an_npz_that_does_not_fit_its_config_is_named_leaf_by_leaf(tmp_path, weights, how):
    """``convert``'s .npz reader (``load_npz``) checks every leaf the file holds against its config, extra blocks
    included, before anything is written from it (before: only a later Hugging Face export noticed)."""
    change, said = CHANGES[how]
    with np.load(save_npz(tmp_path / "m.npz", CFG, *_trees(weights))) as z:
        flat = {k: z[k] for k in z.files}
    change(flat)  # as a file written by hand, or by another tool, may be
    np.savez(tmp_path / "bad.npz", **flat)
    with pytest.raises(ShapeMismatchError) as err:
        load_npz(tmp_path / "bad.npz")
    assert said in str(err.value)


def test_a_block_past_the_configs_last_is_named(weights):
    io, blocks = _trees(weights)
    with pytest.raises(ShapeMismatchError, match="blocks/2/attn/q/kernel: not a parameter of this model"):
        check_params(CFG, io, {"0": blocks[0], "1": blocks[1], "2": blocks[1]}, "m.npz")


def test_parameters_with_a_nan_are_refused_at_load_and_never_converted(tmp_path, weights):
    """Before: a diverged model's weights loaded and converted (to .npz, Orbax or Hugging Face) without a word."""
    def poison(flat):
        flat["blocks/1/mlp/down/kernel"][3, 4] = np.nan
        flat["io/embedding"][0, 0] = np.inf
    save_params(tmp_path / "p", CFG, *_trees(weights, poison))
    with pytest.raises(ValueError, match=r"NaN or infinite weights in 2 parameter\(s\) \(io/embedding, "
                                         r"blocks/1/mlp/down/kernel\).*Use an earlier checkpoint"):
        load_params(tmp_path / "p")
    with pytest.raises(ValueError, match="NaN or infinite"):
        convert(tmp_path / "p", tmp_path / "hf", to="hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("marker", ['{"format": 1, "model": {"hidd', '[1, 2]', '{"format": 1, "blocks": "two"}'])
def test_a_parameter_folder_whose_marker_is_cut_short_says_so(tmp_path, weights, marker):
    """Before: a JSONDecodeError, TypeError or KeyError traceback."""
    save_params(tmp_path / "p", CFG, *_trees(weights))
    (tmp_path / "p" / MARKER).write_text(marker)
    with pytest.raises(ValueError, match=f"{MARKER} cannot be read as what save_params writes.*write it again"):
        load_params(tmp_path / "p")


def test_a_parameter_folder_with_fewer_blocks_than_its_marker_says_is_not_a_whole_model(tmp_path, weights):
    """Before: a KeyError traceback ('2')."""
    save_params(tmp_path / "p", CFG, *_trees(weights))
    record = json.loads((tmp_path / "p" / MARKER).read_text())
    (tmp_path / "p" / MARKER).write_text(json.dumps({**record, "blocks": 3}))
    with pytest.raises(ValueError, match=r"holds the parameters of io and blocks \['0', '1'\].*says 3 blocks"):
        load_params(tmp_path / "p")


def test_parameters_are_never_saved_over_a_file(tmp_path, weights):
    """Before: a NotADirectoryError traceback from listing the file."""
    (tmp_path / "p").write_text("notes")
    with pytest.raises(FileExistsError, match="is a file, not a folder.*nothing was written"):
        save_params(tmp_path / "p", CFG, *_trees(weights))
    assert (tmp_path / "p").read_text() == "notes"


# ---------------------------------------------------------------------------------------- training checkpoints
def tiny_engine(config=EngineConfig(micro_batches=1), cfg=ENGINE_CFG):
    return Engine(Decoder(cfg, rngs=nnx.Rngs(0)), default_optimizer(1e-3), config)


def test_a_checkpointer_that_would_keep_no_checkpoint_is_refused(tmp_path):
    """Before: ``Checkpointer(dir, keep=0)`` saved, then deleted the step it had just committed: nothing on disk."""
    with pytest.raises(ValueError, match="keep=0.*keep=None"):
        Checkpointer(tmp_path, keep=0)
    with _closing(Checkpointer(tmp_path, keep=1)) as ckpt:
        ckpt.save(tiny_engine(), wait=True)
    assert committed_steps(tmp_path) == [0]


def test_a_checkpoint_of_another_model_says_what_to_do(tmp_path):
    """Before: the list of mismatched tensors alone, with nothing said of what to do about it."""
    with _closing(Checkpointer(tmp_path)) as ckpt:
        ckpt.save(tiny_engine(), wait=True)
    other = tiny_engine(cfg=ENGINE_CFG.replace(hidden=48))
    with pytest.raises(ShapeMismatchError, match="(?s)mismatches.*Nothing was loaded. To resume it, use the model, "
                                                 "optimizer and engine settings it was saved with"):
        Checkpointer(tmp_path, read_only=True).restore(other)


def _poisoned_checkpoint(root, config):
    """A checkpoint of step 0 whose embedding's first row (a token the data never holds) is NaN, written by a
    ``Checkpointer`` directly (a session never saves a skipped step; an old or damaged save may hold one)."""
    engine = tiny_engine(config)
    embedding = host_view(engine.state[IO].params["embedding"].get_value())
    embedding[0, :] = np.nan
    with _closing(Checkpointer(root)) as ckpt:
        ckpt.save(engine, wait=True)


@pytest.mark.parametrize("masters", ["float32", "bfloat16"])
def test_a_checkpoint_with_nan_weights_is_refused_at_restore(tmp_path, masters):
    """Before: restored without a word. A NaN in a row of the embedding that no token reaches leaves every loss
    finite: the run trained on and saved it in every checkpoint, and only the export at its end refused."""
    config = EngineConfig(micro_batches=1, master_dtype=masters)
    _poisoned_checkpoint(tmp_path, config)
    with pytest.raises(NonFiniteCheckpointError, match=r"NaN or infinite values in io/params\.embedding\.value"
                                                       r".*Resume from an earlier checkpoint"):
        Checkpointer(tmp_path, read_only=True).restore(tiny_engine(config))


def test_a_run_resumed_from_nan_weights_trains_no_step(tmp_path):
    _poisoned_checkpoint(tmp_path, EngineConfig(micro_batches=1))
    seen = []
    data = DataConfig(seq_len=16, batch_size=2, seed=3, demo_tokens=1 << 14).build(ENGINE_CFG.vocab_size)
    with pytest.raises(NonFiniteCheckpointError):
        fit(Decoder(ENGINE_CFG, rngs=nnx.Rngs(0)), data, default_optimizer(1e-3), engine=EngineConfig(micro_batches=1),
            train=TrainConfig(steps=3, log_every=0, checkpoint_dir=str(tmp_path), resume=True),
            hooks=[Hook(lambda m, info: seen.append(m["step"]))])
    assert seen == [] and committed_steps(tmp_path) == [0]
