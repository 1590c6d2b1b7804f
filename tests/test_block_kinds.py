"""Block kinds (issue 34): a model whose blocks are of a few kinds, here a tiny Decoder whose layers alternate
sliding-window and full attention (``layer_types``, the window a static per-layer attribute). The engine
compiles one template per kind and walks the blocks in their order; it must still equal the in-memory
reference, over several devices and through a checkpoint too."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, preset
from megatrain_jax.check import check_model
from megatrain_jax.checkpoint.manager import Checkpointer
from megatrain_jax.contract.layered import ContractError, layered
from megatrain_jax.engine.program_memory import program_memory
from megatrain_jax.engine.transfer import Placement
from megatrain_jax.models import MoEConfig
from megatrain_jax.models.layers import MLP
from test_engine import ADAMW, assert_models_close, make_batches, run_both
from test_mesh import devices, reference, train

# sliding, full, sliding, full: a window of 3 tokens changes every sliding layer's output on 16-token rows
TWO_KINDS = preset("tiny", layers=4, sliding_window=3, layer_types=("sliding_attention", "full_attention") * 2)


def test_kinds_are_declared_by_the_blocks_and_numbered_in_order():
    lm = layered(Decoder(TWO_KINDS, rngs=nnx.Rngs(0)))
    assert lm.block_kinds == (0, 1, 0, 1) and lm.n_kinds == 2 and lm.first_of_kind(1) == 1
    one = layered(Decoder(preset("tiny", layers=3, sliding_window=3), rngs=nnx.Rngs(0)))
    assert one.block_kinds == (0, 0, 0) and one.n_kinds == 1  # every layer sliding: one kind, as before


def test_blocks_of_one_kind_must_be_identical_and_are_compared_with_the_first_of_their_kind():
    model = Decoder(TWO_KINDS, rngs=nnx.Rngs(0))
    model.blocks[3].mlp_chunk_tokens = 8
    with pytest.raises(ContractError, match=r"model\.blocks\[3\] differs from model\.blocks\[1\] of kind "
                                            r"'full_attention': it has attribute mlp_chunk_tokens = 8, which "
                                            r"model\.blocks\[1\] lacks"):
        layered(model)
    model.blocks[3].mlp_chunk_tokens = None
    model.blocks[2].kind = ["sliding"]
    with pytest.raises(ContractError, match=r"model\.blocks\[2\]\.kind = \['sliding'\] is not hashable"):
        layered(model)


def test_layer_types_are_checked():
    with pytest.raises(ValueError, match="layer_types must give each of the 4 layers"):
        preset("tiny", layers=4, sliding_window=3, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="sliding_window is not set"):
        preset("tiny", layers=2, layer_types=("sliding_attention", "full_attention"))


def test_engine_equals_reference_on_two_kinds_with_offload_and_kept_residuals():
    """Clipping, micro-batches and accumulation, the inputs of the first blocks offloaded, kept residuals:
    and one forward and one backward program per kind of block (per accumulator variant)."""
    engine = run_both(TWO_KINDS, ADAMW, EngineConfig(micro_batches=2, accumulate_steps=2, clip_norm=0.05,
                                                     offload_activations=2, keep_residuals=True))
    sizes = engine.fns.cache_sizes()
    assert sizes["forward"] == 2 and sizes["embed"] == 1, sizes


def test_an_abstract_model_of_two_kinds_initializes_part_by_part_as_built_whole():
    """Each block by its own program (new_block given a Python int index: the kind may depend on it)."""
    engine = Engine(nnx.eval_shape(lambda: Decoder(TWO_KINDS, rngs=nnx.Rngs(0))), ADAMW())
    whole = Decoder(TWO_KINDS, rngs=nnx.Rngs(0))
    io, blocks = engine.state.params()
    for block, params in zip(whole.blocks, blocks):
        for a, b in zip(jax.tree.leaves(nnx.state(block, nnx.Param)), jax.tree.leaves(params)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-9)  # jit vs eager


def test_checkpoint_of_two_kinds_resumes_exactly(tmp_path):
    engine_cfg = EngineConfig()
    batches = make_batches(3, vocab=TWO_KINDS.vocab_size)
    straight = Decoder(TWO_KINDS, rngs=nnx.Rngs(0))
    a = Engine(straight, ADAMW(), engine_cfg)
    for b in batches:
        a.step(b)
    a.write_back(straight)
    a = Engine(Decoder(TWO_KINDS, rngs=nnx.Rngs(0)), ADAMW(), engine_cfg)
    a.step(batches[0])
    ckpt = Checkpointer(tmp_path)
    ckpt.save(a, wait=True)
    model = Decoder(TWO_KINDS, rngs=nnx.Rngs(7))
    b_ = Engine(model, ADAMW(), engine_cfg)
    ckpt.restore(b_)
    ckpt.close()
    for b in batches[1:]:
        b_.step(b)
    b_.write_back(model)
    assert_models_close(straight, model, tol=0)


def test_check_model_and_program_memory_cover_every_kind():
    assert check_model(Decoder(TWO_KINDS, rngs=nnx.Rngs(0))).ok
    pm = program_memory(nnx.eval_shape(lambda: Decoder(TWO_KINDS, rngs=nnx.Rngs(0))), EngineConfig(), 2, 16,
                        placement=Placement(devices(1)))
    forwards = [f.variant for f in pm.figures if f.program == "forward"]
    assert forwards == ["kind 0 (model.blocks[0]): plain", "kind 1 (model.blocks[1]): plain"]


# Dense + MoE kinds (DeepSeek-V3, GLM-4.5): the first layer keeps a dense MLP, the other two route; a large
# load-balancing coefficient so that the routed kind's statistics visibly move its routers.
DENSE_MOE = preset("tiny-moe", layers=3, first_k_dense_replace=1,
                   moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, aux_loss_coef=0.5))


def test_leading_dense_layers_are_their_own_kind_and_only_moe_kinds_are_routed():
    model = Decoder(DENSE_MOE, rngs=nnx.Rngs(0))
    lm = layered(model)
    assert [b.kind for b in model.blocks] == ["dense", "moe", "moe"]
    assert lm.block_kinds == (0, 1, 1) and lm.routed_kinds == {1}
    assert isinstance(model.blocks[0].mlp, MLP) and model.blocks[0].mlp.up.kernel.shape == (64, DENSE_MOE.ffn)
    mixed = preset("tiny-moe", layers=4, first_k_dense_replace=2, sliding_window=3,
                   layer_types=("sliding_attention", "full_attention") * 2)
    assert [mixed.block_kind(i) for i in range(4)] == [("sliding_attention", "dense"), ("full_attention", "dense"),
                                                      ("sliding_attention", "moe"), ("full_attention", "moe")]
    assert DENSE_MOE.param_count() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with pytest.raises(ValueError, match="set moe, or leave first_k_dense_replace at 0"):
        preset("tiny", first_k_dense_replace=1)
    with pytest.raises(ValueError, match="leaves none of the 3 layers a mixture of experts"):
        DENSE_MOE.replace(first_k_dense_replace=3)


def test_the_plan_counts_each_block_as_its_kind():
    """Dense and MoE blocks differ in size: the plan streams, holds and updates each at its own count, and
    the counts add up to the model's parameters."""
    from megatrain_jax.engine.parts import IO, PartId
    from megatrain_jax.plan import layer_param_count, part_param_count, plan
    model = Decoder(DENSE_MOE, rngs=nnx.Rngs(0))
    actual = [sum(x.size for x in jax.tree.leaves(nnx.state(b, nnx.Param))) for b in model.blocks]
    counted = [part_param_count(DENSE_MOE, PartId.block(i)) for i in range(3)]
    assert counted == actual and actual[0] != actual[1]
    assert sum(counted) + part_param_count(DENSE_MOE, IO) == DENSE_MOE.param_count()
    assert layer_param_count(DENSE_MOE) == max(actual)
    # the dense block GPU-resident: its own size, not the average or the MoE block's
    big = dict(host_ram_bytes=2**40, gpu_bytes=2**40)
    resident = plan(DENSE_MOE, EngineConfig(resident_layers=1), 4, 16, **big)
    # (float32 masters and moments; the masters are what the block computes with here: no copy)
    assert resident.gpu["GPU-resident parts with their optimizer state (1 parts)"] == 12 * actual[0]
    streamed = plan(DENSE_MOE, EngineConfig(), 4, 16, **big)
    weights = next(v for k, v in streamed.gpu.items() if k.startswith("weights in use"))
    assert weights % 4 == 0 and weights >= 4 * actual[1]  # an MoE block's float32 weights, at least


def test_engine_equals_reference_on_dense_and_moe_kinds():
    """The auxiliary loss over the routed blocks only, summed over micro-batches; the dense block's backward
    takes no statistics' gradient. Clipped, with the kept-residual programs of both kinds."""
    engine = run_both(DENSE_MOE, ADAMW, EngineConfig(micro_batches=2, clip_norm=0.05, keep_residuals=True))
    assert engine.fns.cache_sizes()["forward"] == 2


@pytest.mark.parametrize("cfg", [TWO_KINDS, DENSE_MOE], ids=["sliding_and_full", "dense_and_moe"])
def test_kinds_over_two_devices_equal_the_reference(cfg):
    engine_cfg = EngineConfig(micro_batches=2)
    _, _, outs = train(2, cfg, engine_cfg, steps=2)
    _, ref_outs = reference(cfg, engine_cfg, steps=2)
    for r, b in zip(ref_outs, outs):
        assert abs(r["loss"] - b["loss"]) <= 1e-5 * abs(r["loss"])


def test_program_memory_of_dense_and_moe_kinds():
    pm = program_memory(nnx.eval_shape(lambda: Decoder(DENSE_MOE, rngs=nnx.Rngs(0))), EngineConfig(), 2, 16,
                        placement=Placement(devices(1)))
    backwards = [f.variant for f in pm.figures if f.program == "backward"]
    assert backwards == ["kind 0 (model.blocks[0]): starts the accumulator",
                         "kind 1 (model.blocks[1]): starts the accumulator"]  # the routed one takes d_stats
