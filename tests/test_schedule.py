"""The step's operation list, checked as data (no device involved), and the table that runs it."""

from __future__ import annotations

import typing

import pytest

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.parts import IO, HostRoles, PartId
from megatrain_jax.engine.passes import CATEGORY, HANDLERS, PHASE
from megatrain_jax.engine.schedule import (Op, OpKind, eval_ops, max_resident_layers, norm_ops, second_pass_ops,
                                          step_ops, step_passes)
from megatrain_jax.plan.gpu_ledger import RULES

B = PartId.block


@pytest.mark.parametrize("layers,micro,depth", [(1, 1, 1), (4, 2, 1), (5, 3, 2), (3, 1, 3)])
@pytest.mark.parametrize("ops_of", [step_ops, eval_ops, second_pass_ops], ids=["step", "eval", "second-pass"])
def test_every_part_is_fetched_before_use_and_released_after(layers, micro, depth, ops_of):
    ops = ops_of(layers, micro, depth)
    live: set[PartId] = set()
    for op in ops:
        if op.kind == "fetch":
            assert op.part not in live, f"{op} fetched twice while on the device"
            live.add(op.part)
        elif op.kind == "release":
            live.remove(op.part)
        elif op.kind in ("forward", "backward"):
            assert op.part in live, f"{op} before its fetch"
        elif op.kind in ("embed", "head", "embed_backward", "loss"):
            assert IO in live, f"{op} without the io part"
    assert not live
    assert max_resident_layers(ops) <= depth + 1


def test_forward_then_backward_order_and_all_micro_batches():
    ops = step_ops(3, 2, 1)
    fwd = [(o.part.layer, o.micro) for o in ops if o.kind == "forward"]
    bwd = [(o.part.layer, o.micro) for o in ops if o.kind == "backward"]
    assert fwd == [(i, m) for i in range(3) for m in range(2)]
    assert bwd == [(i, m) for i in reversed(range(3)) for m in range(2)]
    assert ops.index(Op("head", micro=0)) > ops.index(Op("forward", B(2), 1))


def test_prefetch_is_dispatched_after_the_current_layers_compute():
    """Fetching may wait on the host optimizer: block i's forward must be issued before fetch(i + depth)."""
    ops = step_ops(4, 1, 1)
    for i in range(3):
        assert ops.index(Op("forward", B(i), 0)) < ops.index(Op("fetch", B(i + 1)))


def test_updates_follow_the_norm_in_forward_order_then_commit():
    ops = step_ops(3, 1, 1)
    tail = [repr(o) for o in ops[ops.index(Op("grad_norm")):]]
    assert tail == ["grad_norm()", "update(io)", "update(block_00000)", "update(block_00001)",
                    "update(block_00002)", "commit()"]
    no_update = step_ops(3, 1, 1, update=False)
    assert not any(o.kind in ("grad_norm", "update", "commit") for o in no_update)


def test_eval_is_the_forward_then_the_loss_and_nothing_else():
    ops = eval_ops(3, 2, 1)
    assert {o.kind for o in ops} == {"fetch", "release", "embed", "forward", "loss"}
    assert [(o.part.layer, o.micro) for o in ops if o.kind == "forward"] == [(i, m) for i in range(3) for m in range(2)]
    assert [o.micro for o in ops if o.kind == "loss"] == [0, 1]
    assert max_resident_layers(ops) == 2  # the block computing and the one fetched ahead


def test_every_op_kind_has_one_handler_a_category_and_one_ledger_rule():
    """An op kind is taught in one table per concern, keyed alike: ``passes.HANDLERS`` (how it runs),
    ``passes.CATEGORY`` (what it is, for timelines), ``passes.PHASE`` (its phase, for out-of-memory reports)
    and ``plan.gpu_ledger.RULES`` (what it holds on the GPU, for the memory plan)."""
    kinds = set(typing.get_args(OpKind))
    assert set(HANDLERS) == kinds and set(CATEGORY) == kinds and set(RULES) == kinds and set(PHASE) == kinds
    assert len(set(HANDLERS.values())) == len(kinds) and all(map(callable, RULES.values()))
    ops = step_ops(2, 2, 1, offload=1) + eval_ops(2, 2, 1) + norm_ops(2, 2, 1) + step_ops(2, 1, 1, visited=[1])
    assert {o.kind for o in ops} == kinds


def test_gpu_updated_blocks_are_visited_in_the_forward_and_fetched_for_the_backward():
    """``visited`` (``gpu_updated_layers``): right after the io part's fetch each such block's state is brought
    over, in order; the forward's fetch of those blocks is a ``visit`` (their update of the step before runs
    there), at the same place; the backward fetches them; their update op stays in order."""
    plain, visited = step_ops(4, 2, 2), step_ops(4, 2, 2, visited=[2, 1])
    assert visited[:3] == [Op("fetch", IO), Op("bring", B(1)), Op("bring", B(2))]
    rest = visited[:1] + visited[3:]
    assert len(plain) == len(rest)
    changed = [(a, b) for a, b in zip(plain, rest) if a != b]
    assert changed == [(Op("fetch", B(1)), Op("visit", B(1))), (Op("fetch", B(2)), Op("visit", B(2)))]
    assert max_resident_layers(visited) == max_resident_layers(plain)
    assert [o for o in visited if o.kind == "update"] == [Op("update", p) for p in [IO, B(0), B(1), B(2), B(3)]]


def test_the_io_part_updated_on_the_gpu_is_visited_first_and_brought_with_block_0s_backward_fetch():
    """``visit_io`` (``gpu_updated_io``): the forward's first op visits the io part; ``bring_io`` (the pass that
    updates) brings its state right after block 0's fetch for the backward, or before the backward's first block
    where block 0 stayed from the forward. Nothing else moves."""
    plain, io = step_ops(4, 2, 2), step_ops(4, 2, 2, visit_io=True, bring_io=True)
    assert io[0] == Op("visit", IO)
    at = io.index(Op("fetch", B(0)), io.index(Op("head", micro=0)))  # the backward's fetch of block 0
    assert io[at + 1] == Op("bring", IO) and io.count(Op("bring", IO)) == 1
    assert [o for o in io[1:] if o != Op("bring", IO)] == plain[1:]
    short = step_ops(2, 1, 2, bring_io=True)  # both blocks stay from the forward: no fetch of block 0
    assert short[short.index(Op("head", micro=0)) + 1] == Op("bring", IO)
    assert Op("bring", IO) not in step_ops(4, 2, 2, update=False, visit_io=True)
    with pytest.raises(ValueError, match="bring_io brings the io part's state"):
        step_ops(4, 2, 2, update=False, bring_io=True)


def test_part_ids_name_themselves_and_order_like_updates():
    assert [str(p) for p in (IO, B(0), B(12))] == ["io", "block_00000", "block_00012"]
    assert PartId.from_name("block_00012") == B(12) and PartId.from_name("io") == IO
    assert sorted([B(1), IO, B(0)]) == [IO, B(0), B(1)]
    with pytest.raises(ValueError, match="not a block"):
        IO.layer
    with pytest.raises(ValueError, match="not a part name"):
        PartId.from_name("block_x")


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="at least one layer"):
        step_ops(0, 1)
    with pytest.raises(ValueError, match="prefetch depth"):
        step_ops(2, 1, 0)


@pytest.mark.parametrize("layers,micro,depth,offload", [(4, 2, 1, 2), (5, 3, 2, 5), (3, 1, 1, 1), (4, 1, 3, 4)])
def test_offloaded_inputs_leave_after_their_forward_and_return_with_their_block(layers, micro, depth, offload):
    ops = step_ops(layers, micro, depth, offload=offload)
    stored = [op.part.layer for op in ops if op.kind == "store_acts"]
    loaded = [op.part.layer for op in ops if op.kind == "load_acts"]
    n = min(offload, layers - depth)  # the last `depth` blocks' inputs never leave
    assert stored == list(range(n)) and loaded == list(reversed(range(n)))
    at = {repr(op): k for k, op in enumerate(ops)}
    for i in range(n):
        assert at[f"store_acts({B(i)})"] > max(at[f"forward({B(i)}, {m})"] for m in range(micro))
        assert at[f"load_acts({B(i)})"] == at[f"fetch({B(i)})"] + 1  # with its backward fetch (the later one)
        assert at[f"load_acts({B(i)})"] < min(at[f"backward({B(i)}, {m})"] for m in range(micro))
        if i + 1 < layers:  # back one block ahead: before the block above it starts its backward
            assert at[f"load_acts({B(i)})"] < min(at[f"backward({B(i + 1)}, {m})"] for m in range(micro))
    assert step_ops(layers, micro, depth, offload=0) == [op for op in ops if op.kind not in ("store_acts", "load_acts")]


def test_negative_offload_is_rejected():
    with pytest.raises(ValueError, match="activation offload must be >= 0"):
        step_ops(3, 1, offload=-1)



def test_a_norm_first_step_is_a_norm_pass_then_updates_as_gradients_come_home():
    """``norm_ops``: the one-pass forward and backward with each ``send_grads`` a ``norm``, then the global norm;
    ``second_pass_ops``: no embedding or forward, the io part and the last ``depth`` blocks fetched as the forward
    leaves them, the heads, then the one-pass backward with each part's update right after its gradient is sent
    (reverse order, io last), no norm; the offloaded blocks' inputs come back before their backward again."""
    plain, first = step_ops(3, 2, 1, update=False), norm_ops(3, 2, 1)
    assert [o.kind for o in first[:-1]] == [("norm" if o.kind == "send_grads" else o.kind) for o in plain]
    assert first[-1] == Op("grad_norm") and not any(o.kind in ("send_grads", "update") for o in first)
    for depth, offload in ((1, 0), (2, 0), (1, 2), (2, 5)):
        second = second_pass_ops(4, 2, depth, offload)
        one = step_ops(4, 2, depth, update=False, offload=offload)
        back = one[one.index(Op("head", micro=0)):]
        assert second[:1 + depth] == [Op("fetch", IO)] + [Op("fetch", B(i)) for i in range(3, 3 - depth, -1)]
        assert not any(o.kind in ("embed", "forward", "store_acts", "grad_norm", "commit", "norm") for o in second)
        assert [o for o in second[1 + depth:] if o.kind != "update"] == back  # the one-pass backward, as it was
        sends = [i for i, o in enumerate(second) if o.kind == "send_grads"]
        assert [second[i + 2] for i in sends] == [Op("update", B(i)) for i in (3, 2, 1, 0)] + [Op("update", IO)]
        loads = [o.part.layer for o in second if o.kind == "load_acts"]
        assert loads == sorted(range(min(offload, 4 - depth)), reverse=True)
        assert max_resident_layers(second) == depth + 1


def test_an_optimizer_step_is_its_passes_as_the_engine_runs_them():
    """``step_passes``: accumulating passes, the first visiting the GPU-updated blocks and the last updating; a
    norm_first step's two passes."""
    e = EngineConfig(micro_batches=2, accumulate_steps=3, gpu_updated_layers=1, prefetch_depth=2)
    roles = HostRoles.of_config(4, e)
    passes = step_passes(4, e, roles)
    assert [sum(op.kind == "update" for op in ops) > 0 for ops in passes] == [False, False, True]
    assert [sum(op.kind == "visit" for op in ops) for ops in passes] == [1, 0, 0]
    assert passes[0] == step_ops(4, 2, 2, update=False, visited=(0,))
    two = EngineConfig(micro_batches=2, norm_first=True, offload_activations=1, prefetch_depth=1)
    assert step_passes(4, two, HostRoles.of_config(4, two)) == [norm_ops(4, 2, 1, offload=1),
                                                               second_pass_ops(4, 2, 1, offload=1)]
