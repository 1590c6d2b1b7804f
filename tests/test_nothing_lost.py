"""Nothing committed is lost, ever: a diverging run keeps its last good checkpoint, an export never writes NaN
weights and a failed one keeps the trained state, every output path is checked before training, convert never
falls back to an older step in silence, checkpoints never run ahead of metrics.jsonl, a refused or failed start
leaves the run folder as it was (SIGHUP saving as SIGTERM does: tests/test_run_folder.py). Faults are injected as in
tests/test_save_failures.py (tests run as root, which writes through permission bits)."""

from __future__ import annotations

from flax import nnx

from megatrain_jax import Decoder, EngineConfig, TrainConfig, default_optimizer, fit
from megatrain_jax.checkpoint import committed_steps
from megatrain_jax.cli import main
from tests.test_faults import CFG, data


def test_convert_refuses_a_run_whose_newest_checkpoint_is_broken(tmp_path, capsys):
    ck = tmp_path / "ck"
    fit(Decoder(CFG, rngs=nnx.Rngs(0)), data(), default_optimizer(1e-3), engine=EngineConfig(micro_batches=2),
        train=TrainConfig(steps=4, log_every=0, checkpoint_dir=str(ck), checkpoint_every=2))
    assert committed_steps(ck) == [4, 2]
    (ck / "4" / "state" / "MANIFEST.json").write_text("{")
    capsys.readouterr()
    assert main(["convert", str(ck), str(tmp_path / "hf"), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert "the newest checkpoint" in err and "step 4, fails its check" in err
    assert f"The newest complete one is step 2: to use it, give its folder ({ck / '2'})" in err
    assert not (tmp_path / "hf").exists()
    assert main(["convert", str(ck / "2"), str(tmp_path / "hf"), "--to", "hf"]) == 0
