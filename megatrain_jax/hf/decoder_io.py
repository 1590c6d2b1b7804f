"""A Decoder from a Hugging Face folder, and a Decoder to one: one call each.

``from_hf`` reads ``config.json`` and each tensor once, into a model whose parameters are float32 host
(numpy) arrays, ready for a forward pass or for ``fit`` (which streams them to the GPU part by part).
``to_hf`` writes a model (or the state of the engine that trained it) as a folder transformers loads. For a model larger
than host memory allows twice, train from the folder itself (``model.hf_checkpoint`` in a run config, or
``fit(..., init_from=HFParts(folder))``): the engine's state is then filled part by part and no model object
holds the weights.

Logits equal transformers' to about 1e-6 in float32; on a GPU that needs
``jax.default_matmul_precision("highest")`` (XLA's default there rounds float32 matmuls to TF32), and in
bfloat16 (``dtype="bfloat16"``, the training default) expect bfloat16's rounding.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatrain_jax.hf.export_folder import tokenizer_files
from megatrain_jax.hf.export import save_hf
from megatrain_jax.hf.mapping import load_hf_into, read_config


def from_hf(model_dir: str | os.PathLike, dtype: str = "float32", **overrides: Any):
    """The Decoder of an HF folder (``config.json`` + safetensors), its weights read once each.

    ``dtype`` is the compute dtype (parameters stay float32, the master copy); ``overrides`` set fields the
    folder does not decide (``attention_impl``, ``loss_chunk_tokens``, ...)."""
    from flax import nnx

    from megatrain_jax.models import Decoder

    cfg = read_config(model_dir, dtype=dtype, **overrides)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # shapes only: nothing initialized
    load_hf_into(model, model_dir)
    return model


def to_hf(model: Any, model_dir: str | os.PathLike, dtype: str = "bfloat16", *, overwrite: bool = False,
          tokenizer: str | os.PathLike | None = None, engine: Any = None,
          max_shard_bytes: int | None = None) -> list[Path]:
    """Write a Decoder as an HF folder transformers loads, with its special token ids in ``config.json``
    and ``generation_config.json``. ``engine``: the Engine that trained ``model`` without writing its
    weights back (``fit(..., write_back=False)``): its state is written instead of the model's arrays.
    ``tokenizer``: a folder whose tokenizer and generation files go along (the HF folder the model came
    from, say). A folder that already holds a model is replaced only with ``overwrite``. Returns the files
    written."""
    from flax import nnx

    if not (hasattr(model, "cfg") and hasattr(model, "io") and hasattr(model, "blocks")):
        raise TypeError(f"to_hf writes a megatrain_jax Decoder, not {type(model).__name__}")
    if engine is not None:
        io, blocks = engine.parameters()
    else:
        io, blocks = nnx.state(model.io, nnx.Param), [nnx.state(b, nnx.Param) for b in model.blocks]
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return save_hf(model_dir, model.cfg, io, blocks, dtype=dtype, overwrite=overwrite,
                   extra_files=tokenizer_files(tokenizer, given=True), **kw)
