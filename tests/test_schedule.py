"""The step's operation list, checked as data (no device involved)."""

from __future__ import annotations

import pytest

from megatrain_jax.schedule import Op, max_resident_layers, step_ops


@pytest.mark.parametrize("layers,micro,depth", [(1, 1, 1), (4, 2, 1), (5, 3, 2), (3, 1, 3)])
def test_every_layer_is_fetched_before_use_and_released_after(layers, micro, depth):
    ops = step_ops(layers, micro, depth)
    live: set[int] = set()
    for op in ops:
        if op.kind == "fetch":
            assert op.layer not in live, f"{op} fetched twice while on the device"
            live.add(op.layer)
        elif op.kind == "release":
            live.remove(op.layer)
        elif op.kind in ("forward", "backward"):
            assert op.layer in live, f"{op} before its fetch"
    assert not live
    assert max_resident_layers(ops) <= depth + 1


def test_forward_then_backward_order_and_all_micro_batches():
    ops = step_ops(3, 2, 1)
    fwd = [(o.layer, o.micro) for o in ops if o.kind == "forward"]
    bwd = [(o.layer, o.micro) for o in ops if o.kind == "backward"]
    assert fwd == [(i, m) for i in range(3) for m in range(2)]
    assert bwd == [(i, m) for i in reversed(range(3)) for m in range(2)]
    assert ops.index(Op("head", micro=0)) > ops.index(Op("forward", 2, 1))


def test_prefetch_is_dispatched_after_the_current_layers_compute():
    """Fetching may wait on the host optimizer: layer i's forward must be issued before fetch(i + depth)."""
    ops = step_ops(4, 1, 1)
    for i in range(3):
        assert ops.index(Op("forward", i, 0)) < ops.index(Op("fetch", i + 1))


def test_updates_follow_the_norm_in_forward_order_then_commit():
    ops = step_ops(3, 1, 1)
    tail = [repr(o) for o in ops[ops.index(Op("grad_norm")):]]
    assert tail == ["grad_norm()", "update_io()", "update(0)", "update(1)", "update(2)", "commit()"]
    no_update = step_ops(3, 1, 1, update=False)
    assert not any(o.kind in ("grad_norm", "update", "update_io", "commit") for o in no_update)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="at least one layer"):
        step_ops(0, 1)
    with pytest.raises(ValueError, match="prefetch depth"):
        step_ops(2, 1, 0)
