"""The layered contract: a bring-your-own model (examples/gpt2.py) trains the same through the engine as
through the reference, check_model tells a right model from a wrong one, and contract errors say what to fix."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import traversals

from megatrain_jax.batch import Batch
from megatrain_jax.contract.layered import ContractError, check_contract, layered
from megatrain_jax.models import Decoder, preset
from megatrain_jax.reference import ReferenceTrainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-5


def load_example(name: str):
    """``examples/<name>.py`` as a module (examples are scripts, not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


gpt2 = load_example("gpt2")
CFG = gpt2.GPT2Config(vocab_size=97, max_positions=32, hidden=32, layers=2, heads=4, loss_chunk_tokens=16)


def randomize(model: nnx.Module, seed: int = 0) -> nnx.Module:
    """O(1)-scale parameters (the 0.02 initialization makes attention nearly uniform and positions barely
    matter, which would let a wrong position or mask path slip past a numerical test)."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    rng = np.random.default_rng(seed)
    new = []
    for path, leaf in leaves:
        name, z = str(getattr(path[-1], "key", path[-1])), rng.standard_normal(leaf.shape).astype(np.float32)
        z = {"kernel": z / np.sqrt(leaf.shape[0]), "lm_head": z / np.sqrt(leaf.shape[0]), "bias": 0.3 * z,
             "scale": 1.0 + 0.2 * z}.get(name, 0.5 * z)  # wte, wpe
        new.append(jnp.asarray(z))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, new))
    nnx.update(model, state)
    return model


def packed_batches(n, rows=4, seq=16, vocab=97, seed=0, mask=False):
    """Two documents per row: segment ids 1 then 2, positions restarting at the cut."""
    rng = np.random.default_rng(seed)
    cut, t = seq // 3, np.arange(seq)
    seg = np.broadcast_to(np.where(t < cut, 1, 2), (rows, seq))
    pos = np.broadcast_to(np.where(t < cut, t, t - cut), (rows, seq))
    out = []
    for _ in range(n):
        b = Batch.from_windows(rng.integers(0, vocab, (rows, seq + 1)))
        loss_mask = (rng.random((rows, seq)) > 0.3).astype(np.float32) if mask else None
        out.append(Batch(b.inputs, b.targets, loss_mask=loss_mask, positions=pos, segment_ids=seg))
    return out


def flat_params(model):
    return traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def assert_models_close(ref_model, model, tol=TOL):
    a, b = flat_params(ref_model), flat_params(model)
    assert a.keys() == b.keys()
    for k in a:
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        rel = np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)
        assert rel <= tol, f"{k}: relative difference {rel:.2e}"


# ---------------------------------------------------------------------------------------------------
# A bring-your-own model through the engine.
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied,mask", [(True, False), (False, True)], ids=["tied", "untied-masked"])
def test_gpt2_example_engine_equals_reference_on_packed_batches(tied, mask):
    """Learned absolute positions enter in io.embed: with packed rows (positions restarting at each
    document) the engine matches the reference only if it hands embed the batch's positions."""
    from megatrain_jax import Engine, EngineConfig

    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    tx = lambda: optax.adamw(1e-3, eps=1e-6, weight_decay=0.1)
    batches = packed_batches(3, vocab=cfg.vocab_size, mask=mask)
    ref = ReferenceTrainer(randomize(gpt2.GPT2(cfg, rngs=nnx.Rngs(0))), tx(), clip_norm=0.05)
    model = randomize(gpt2.GPT2(cfg, rngs=nnx.Rngs(0)))
    engine = Engine(model, tx(), EngineConfig(micro_batches=2, clip_norm=0.05))
    for s, batch in enumerate(batches):
        r = ref.step(batch)
        e = engine.step(batch).resolve()
        assert abs(e["loss"] - r["loss"]) <= TOL * abs(r["loss"]), (s, e, r)
        assert abs(e["grad_norm"] - r["grad_norm"]) <= 1e-4 * r["grad_norm"], (s, e, r)
    engine.write_back(model)
    assert_models_close(ref.model, model)


def test_gpt2_example_initializes_abstractly_part_by_part():
    """new_io / new_block rebuild exactly the parts of a model built whole (what fit does for an abstract
    model), with a traced block index as the engine passes it."""
    whole = gpt2.GPT2(CFG, rngs=nnx.Rngs(3))
    abstract = nnx.eval_shape(lambda: gpt2.GPT2(CFG, rngs=nnx.Rngs(3)))
    key = nnx.Rngs(3).params()
    io = jax.jit(lambda k: nnx.state(abstract.new_io(k), nnx.Param))(key)
    block1 = jax.jit(lambda k, i: nnx.state(abstract.new_block(i, k), nnx.Param))(key, jnp.int32(1))
    for got, want in [(io, nnx.state(whole.io, nnx.Param)), (block1, nnx.state(whole.blocks[1], nnx.Param))]:
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-9)  # jit vs eager: last-bit rounding
    layered(abstract)  # an abstract model passes the contract checks too


# ---------------------------------------------------------------------------------------------------
# check_model.
# ---------------------------------------------------------------------------------------------------

class StaleIO(gpt2.InputOutput):
    """An embed written for the old contract: it takes positions but assumes they are 0..T-1."""

    def embed(self, tokens_BT, positions_BT, segment_ids_BT):
        fresh = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        return super().embed(tokens_BT, fresh, segment_ids_BT)


class StaleGPT2(gpt2.GPT2):
    """__call__ (what the reference runs) adds the real position embeddings; io.embed (what the engine
    runs) does not: the two agree on plain rows and silently differ on packed ones."""

    def new_io(self, key):
        return StaleIO(self.cfg, rngs=nnx.Rngs(params=jax.random.fold_in(key, 0)))

    def __call__(self, tokens_BT, positions_BT, segment_ids_BT=None):
        io = self.io
        x = jnp.take(io.wte[...], tokens_BT, axis=0) + jnp.take(io.wpe[...], positions_BT, axis=0)
        for block in self.blocks:
            x = block(x, positions_BT, segment_ids_BT)
        return io.unembed(io.final_hidden(x))


def test_check_model_ok_for_our_decoder_and_leaves_it_unchanged():
    from megatrain_jax.check import check_model

    model = Decoder(preset("tiny", layers=2, vocab_size=97, hidden=32, ffn=48), rngs=nnx.Rngs(0))
    before = [np.asarray(x).copy() for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    result = check_model(model)
    assert result.ok, str(result)
    assert "OK" in str(result) and "NOT OK" not in str(result)
    for b, a in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(b, np.asarray(a))


def test_check_model_catches_an_embed_that_ignores_positions():
    from megatrain_jax.check import check_model

    # At the model's own initialization (what a user checks) the position embeddings are small ...
    result = check_model(StaleGPT2(CFG, rngs=nnx.Rngs(0)))
    assert not result.ok
    plain, packed = result.loss_rel_diffs
    assert plain <= 1e-6 < result.tol < packed, result
    assert "NOT OK" in str(result) and "positions_BT" in str(result)
    # ... and with O(1) parameters the loss difference is large.
    result = check_model(randomize(StaleGPT2(CFG, rngs=nnx.Rngs(0))))
    assert result.loss_rel_diff > 1e-2, str(result)


def test_check_model_refuses_abstract_models_and_raises_contract_errors_unchanged():
    from megatrain_jax.check import check_model

    with pytest.raises(ValueError, match="concrete model"):
        check_model(nnx.eval_shape(lambda: gpt2.GPT2(CFG, rngs=nnx.Rngs(0))))
    model = gpt2.GPT2(CFG, rngs=nnx.Rngs(0))
    model.blocks[1].attn.heads = 2
    with pytest.raises(ContractError, match=r"model.blocks\[1\] differs from model.blocks\[0\]: attn.heads = 2 vs 4"):
        check_model(model)


# ---------------------------------------------------------------------------------------------------
# Contract errors: ours, naming what to fix.
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: nnx.BatchStat(jnp.zeros(3)),
    lambda: nnx.Variable(jnp.zeros(3)),
    lambda: nnx.Rngs(0),
], ids=["batch-stat", "variable", "rngs"])
def test_non_param_state_gets_our_message(make):
    model = gpt2.GPT2(CFG, rngs=nnx.Rngs(0))
    model.blocks[1].attn.extra = make()
    for check in (layered, check_contract, lambda m: ReferenceTrainer(m, optax.sgd(0.1))):
        with pytest.raises(ContractError) as err:
            check(model)
        msg = str(err.value)
        assert "Non-exhaustive" not in msg
        assert msg.startswith("model.blocks[1].attn.extra") and "only nnx.Param" in msg, msg


def test_non_param_state_in_io_is_named():
    model = gpt2.GPT2(CFG, rngs=nnx.Rngs(0))
    model.io.rngs = nnx.Rngs(0)
    with pytest.raises(ContractError, match=r"^model\.io\.rngs\..* is an nnx\.Rng"):
        layered(model)


def test_parameters_outside_io_and_blocks_are_refused():
    model = gpt2.GPT2(CFG, rngs=nnx.Rngs(0))
    model.temperature = nnx.Param(jnp.ones(()))
    with pytest.raises(ContractError, match=r"model\.temperature is a parameter outside model\.io and model\.blocks"):
        layered(model)


def test_blocks_differing_name_what_differs():
    # A parameter shape (the graphdef alone would not show it: same modules, same attributes).
    model = gpt2.GPT2(CFG, rngs=nnx.Rngs(0))
    model.blocks[1].attn.qkv.kernel = nnx.Param(jnp.zeros((32, 64)))
    with pytest.raises(ContractError, match=r"model\.blocks\[1\] differs from model\.blocks\[0\]: "
                                            r"attn\.qkv\.kernel has shape \(32, 64\) vs \(32, 96\)"):
        layered(model)
    # A parameter present in one block only.
    model = gpt2.GPT2(CFG, rngs=nnx.Rngs(0))
    model.blocks[1].gate = nnx.Param(jnp.ones(()))
    with pytest.raises(ContractError, match=r"blocks\[1\].*it has parameter gate, which model\.blocks\[0\] lacks"):
        layered(model)
    # A plain attribute of a submodule.
    model = Decoder(preset("tiny", layers=3), rngs=nnx.Rngs(0))
    for i, act in enumerate(["gelu", "gelu", "relu"]):
        model.blocks[i].mlp.act = act
    with pytest.raises(ContractError, match=r"model\.blocks\[2\] differs from model\.blocks\[0\]: mlp\.act = 'relu' vs 'gelu'"):
        layered(model)
    # A field of a config dataclass held by a submodule. (A sliding window would make the block another kind
    # of block: Decoder blocks declare their attention type as their kind.)
    model = Decoder(preset("tiny", layers=2), rngs=nnx.Rngs(0))
    model.blocks[1] = Decoder(preset("tiny", layers=2, rope_theta=500.0), rngs=nnx.Rngs(0)).blocks[1]
    with pytest.raises(ContractError, match=r"blocks\[1\] differs .*: attn\.cfg\.rope_theta = 500\.0 vs 10000\.0"):
        layered(model)


def test_embed_without_positions_is_refused():
    class OldIO(gpt2.InputOutput):
        def embed(self, tokens_BT):  # the contract before positions reached embed
            return jnp.take(self.wte[...], tokens_BT, axis=0)

    model = gpt2.GPT2(CFG, rngs=nnx.Rngs(0))
    model.io = OldIO(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ContractError, match=r"model\.io\.embed\(tokens_BT\) cannot be called as "
                                            r"embed\(tokens_BT, positions_BT, segment_ids_BT\): add "
                                            r"`positions_BT, segment_ids_BT` parameters"):
        layered(model)

    class StarIO(gpt2.InputOutput):  # *args takes them
        def embed(self, tokens_BT, *rest):
            return super().embed(tokens_BT, *rest)

    model.io = StarIO(CFG, rngs=nnx.Rngs(0))
    layered(model)


def test_layered_parts_compose_to_the_model_call():
    """What the engine runs (lm.embed -> lm.block ... -> lm.head_nll_sum) equals what the reference runs
    (model.__call__), positions and segment ids included, for our decoder and the example."""
    from megatrain_jax.loss import causal_lm_loss

    batch = packed_batches(1, rows=2, seq=12, vocab=97)[0].filled()
    for model in (randomize(gpt2.GPT2(CFG, rngs=nnx.Rngs(0))),
                  Decoder(preset("tiny", vocab_size=97, hidden=32, ffn=48), rngs=nnx.Rngs(0))):
        lm = layered(model)
        io = nnx.state(model.io, nnx.Param)
        x = lm.embed(io, batch.inputs, batch.positions, batch.segment_ids)
        for block in model.blocks:
            x = lm.block(nnx.state(block, nnx.Param), x, batch.positions, batch.segment_ids)
        got = lm.head_nll_sum(io, x, batch.targets, batch.loss_mask) / batch.loss_mask.sum()
        want = causal_lm_loss(model(batch.inputs, batch.positions, batch.segment_ids), batch.targets, batch.loss_mask)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Dropout: refused unless it can never drop (the engine has no per-step key and no train/eval switch).
# ---------------------------------------------------------------------------------------------------

class DropoutBlock(nnx.Module):
    """A GPT-2 block followed by a dropout module."""

    def __init__(self, inner: nnx.Module, drop: nnx.Dropout):
        self.inner, self.drop = inner, drop

    def __call__(self, x_BTD, positions_BT, segment_ids_BT):
        return self.drop(self.inner(x_BTD, positions_BT, segment_ids_BT))


def dropout_model(make_dropout) -> nnx.Module:
    model = randomize(gpt2.GPT2(CFG, rngs=nnx.Rngs(0)))
    model.blocks = nnx.List([DropoutBlock(block, make_dropout()) for block in model.blocks])
    return model


def contract_checks():
    """Every entry point that checks the contract: layering, the engine, the reference and check_model."""
    from megatrain_jax import Engine, EngineConfig
    from megatrain_jax.check import check_model
    return {"layered": layered, "check_contract": check_contract, "check_model": check_model,
            "engine": lambda m: Engine(m, optax.sgd(0.1), EngineConfig(host_kernel=False)),
            "reference": lambda m: ReferenceTrainer(m, optax.sgd(0.1))}


@pytest.mark.parametrize("check", sorted(contract_checks()))
def test_active_dropout_is_refused_naming_the_modules(check):
    model = dropout_model(lambda: nnx.Dropout(0.1))
    with pytest.raises(ContractError) as err:
        contract_checks()[check](model)
    msg = str(err.value)
    assert msg.startswith("dropout is not supported"), msg
    assert "model.blocks[0].drop, model.blocks[1].drop" in msg and "Set the rate to 0" in msg, msg


def test_dropout_holding_an_rng_stream_is_refused_with_our_message():
    model = dropout_model(lambda: nnx.Dropout(0.0, rngs=nnx.Rngs(0)))
    with pytest.raises(ContractError, match=r"nnx\.Dropout at model\.blocks\[0\]\.drop, model\.blocks\[1\]\.drop "
                                            r"stores an RNG stream.*Create it without rngs"):
        layered(model)


@pytest.mark.parametrize("make_dropout", [lambda: nnx.Dropout(0.0), lambda: nnx.Dropout(0.3, deterministic=True)],
                         ids=["rate-0", "deterministic"])
def test_dropout_that_never_drops_is_accepted(make_dropout):
    from megatrain_jax.check import check_model
    result = check_model(dropout_model(make_dropout))
    assert result.ok, str(result)


def test_dropout_switched_to_eval_is_accepted():
    """model.eval() makes every Dropout deterministic: the model then trains as if it had none."""
    from megatrain_jax.check import check_model
    model = dropout_model(lambda: nnx.Dropout(0.3))
    with pytest.raises(ContractError, match="dropout is not supported"):
        layered(model)
    model.eval()
    assert check_model(model).ok


def test_the_gpt2_example_runs_as_written(capsys):
    """``python examples/gpt2.py`` as docs/model_contract.md says: check_model passes on the plain and the packed batch,
    and fit trains 30 steps."""
    import runpy
    runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "gpt2.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "check_model: OK" in out and "plain batch" in out and "packed batch" in out
    assert "step     30" in out and "Traceback" not in out
