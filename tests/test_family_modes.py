"""Every family in every training mode: the streamed engine equals the in-memory reference (jax.grad + optax)
over 3 steps, gradients clipped and accumulated, on each Hugging Face fixture's own config and weights.

The family tests (test_engine, test_olmo2, test_gemma3, test_glm4_moe, test_deepseek_v3, test_gpt_oss, test_moe)
cover plain rows; test_remat, test_mesh and test_block_kinds cover packed rows, kept residuals, offloaded
activations and several devices on Llama-shaped models. Here each family runs
- SFT batches (tests/test_instruct.py's chat pipeline, packed: segment ids, positions restarting and the loss on
  the assistant's tokens only) with kept residuals (XLA standing in for cuDNN: test_remat's ``cudnn_stand_in``),
  the first blocks' inputs offloaded, two micro-batches, accumulation and clipping, on one device;
- the same batches, accumulated and clipped, over two (simulated CPU, tests/conftest.py) devices.
Both compare with one reference per family, trained once. Compilation dominates: about 85 s with a warm
persistent compilation cache (tests/conftest.py), about 6 minutes cold, on 2 CPU cores.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import jax  # noqa: E402

from megatrain_jax import EngineConfig  # noqa: E402
from megatrain_jax.families import FAMILIES as REGISTRY  # noqa: E402
from megatrain_jax.hf import load_hf_into, read_config  # noqa: E402
from test_engine import run_both, train_reference  # noqa: E402
from test_instruct import CONVERSATION, small_vocab_tokenizer, write_jsonl  # noqa: E402
from test_mesh import ADAMW, devices  # noqa: E402 (ADAMW: the fused kernel's optimizer)
from test_remat import cudnn_stand_in  # noqa: E402, F401 (a fixture)

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = [family.model_type for family in REGISTRY.values()]  # each registered family's fixture
STEPS, ACCUMULATE, ROWS, SEQ = 3, 2, 4, 32


@functools.cache
def sft_batches(vocab: int, tmp: Path):
    """STEPS * ACCUMULATE packed SFT batches of ROWS x SEQ: several examples per row, loss on the answers."""
    from megatrain_jax.data import DataConfig
    small_vocab_tokenizer(tmp, vocab)
    lines = [CONVERSATION] + [{"messages": [{"role": "user", "content": "what is two plus two"},
                                           {"role": "assistant", "content": "four " * (1 + i % 3)}]}
                              for i in range(12)]
    data = DataConfig(path=str(write_jsonl(tmp / "chat.jsonl", lines)), format="chat", mode="packed",
                      tokenizer=str(tmp), seq_len=SEQ, batch_size=ROWS, prefetch=0, cache_dir=str(tmp / "cache"))
    stream = data.build(model_vocab=vocab)
    out = [next(stream) for _ in range(STEPS * ACCUMULATE)]
    assert all(b.segment_ids is not None and b.segment_ids.max() > 1 for b in out)
    assert all(0 < b.loss_mask.sum() < b.loss_mask.size for b in out)
    return out


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """The folder of the SFT data, its tokenizer and its tokenized cache."""
    return tmp_path_factory.mktemp("sft")


CLIP = 0.05


@functools.cache
def fixture(family: str):
    """The fixture's config (float32) and a ``prepare`` loading its weights into a fresh Decoder."""
    folder = FIXTURES / family
    return read_config(folder, dtype="float32"), lambda model: load_hf_into(model, folder)


@functools.cache
def reference(family: str, tmp: Path):
    """The reference trained once per family: both tests compare with it (its result depends on neither kept
    residuals, offloading, micro-batches nor devices)."""
    cfg, prepare = fixture(family)
    return train_reference(cfg, ADAMW, CLIP, sft_batches(cfg.vocab_size, tmp), STEPS, prepare)


def run_family(family, tmp, engine_cfg, devices=None, observers=()):
    cfg, prepare = fixture(family)
    return run_both(cfg, ADAMW, engine_cfg, steps=STEPS, batches=sft_batches(cfg.vocab_size, tmp), devices=devices,
                    prepare=prepare, reference=reference(family, tmp), observers=observers)


class StoredActivations:
    """What each ``store_acts`` op sends to host memory: a block's inputs and kept residuals, all micro-batches'."""

    def __init__(self):
        self.stores = []

    def on_op(self, op, start, end, out):
        if op.kind == "store_acts":
            self.stores.append((op.part.layer, len(jax.tree.leaves(out))))

    def on_task(self, *a, **k):
        pass


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_packed_on_two_devices_equals_reference(family, sft):
    """Rows split over two devices, each step's gradient summed over them, clipped and accumulated."""
    run_family(family, sft, EngineConfig(accumulate_steps=ACCUMULATE, clip_norm=CLIP), devices=devices(2))


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_packed_kept_residuals_offloaded_equals_reference(family, sft, cudnn_stand_in):  # noqa: F811
    """Two micro-batches, the first blocks' inputs and kept residuals through host memory (2-layer fixtures: one), the
    last block's matrix products kept on the device. GPT-OSS's sink
    attention marks nothing to keep on any path (packed rows take XLA's; cuDNN's sink forms are recomputed too), so
    it is the only family that keeps nothing."""
    micro, offload = 2, 2
    watch = StoredActivations()
    engine = run_family(family, sft, EngineConfig(micro_batches=micro, accumulate_steps=ACCUMULATE, clip_norm=CLIP,
                                                  keep_residuals=True, offload_activations=offload, kept_layers=1,
                                                  prefetch_depth=1),
                        observers=[watch])
    # the last block keeps its matrix products too (``kept_layers``), the others what the model marks
    assert {name for name, *_ in engine.fns._programs} >= {"forward_keep", "backward_kept", "forward_products",
                                                           "backward_products"}
    cfg = fixture(family)[0]
    kept_per_micro = 0 if cfg.attention_sinks else 1
    # never the last prefetch_depth (1) blocks': they are on the device when the backward starts
    assert {layer for layer, _ in watch.stores} == set(range(min(offload, cfg.layers - 1)))
    assert all(n >= micro * (1 + kept_per_micro) and (n == micro) == (kept_per_micro == 0) for _, n in watch.stores), \
        watch.stores
