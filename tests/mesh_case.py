"""The run that tests/test_mesh.py trains in one process and in two (tests/multiprocess_worker.py)."""

from megatrain_jax import EngineConfig, adamw, preset
from test_engine import make_batches

STEPS = 5
MODEL = preset("tiny", layers=2)
ENGINE = EngineConfig(micro_batches=2)  # float32 masters: pinned, so each process can gather them
ADAMW = lambda: adamw(1e-3, eps=1e-6, weight_decay=0.1)


def batches():
    return make_batches(STEPS, rows=8, vocab=MODEL.vocab_size, mask=True)
