"""One of the processes of tests/test_mesh.py's two-process run (jax.distributed on CPU, 2 devices each).

    python tests/multiprocess_worker.py <coordinator> <process id> <out.npz> [save|resume] [checkpoint dir]

Trains the 5 steps of tests/mesh_case.py; ``save`` also checkpoints step 3 into the directory while
training goes on; ``resume`` restores step 3 from it and trains steps 4 and 5.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax import distributed  # noqa: E402

coordinator, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
mode, ckpt_dir = (sys.argv[4], sys.argv[5]) if len(sys.argv) > 5 else (None, None)
import faulthandler; faulthandler.dump_traceback_later(300, exit=True)  # a hang fails the test, with stacks
distributed.initialize(coordinator, 2, pid)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from megatrain_jax import Decoder, Engine  # noqa: E402
from megatrain_jax.engine.transfer import host_view  # noqa: E402
from mesh_case import ADAMW, ENGINE, MODEL, batches  # noqa: E402

from megatrain_jax.checkpoint.manager import Checkpointer  # noqa: E402

engine = Engine(Decoder(MODEL, rngs=nnx.Rngs(0 if mode != "resume" else 7)), ADAMW(), ENGINE)
assert engine.placement.size == 4 and engine.placement.processes == 2, engine.placement.devices
ckpt = Checkpointer(ckpt_dir) if mode else None
todo = batches()
if mode == "resume":
    ckpt.restore(engine, 3)
    assert engine.state.step == 3
    todo = todo[3:]
losses = []
for b in todo:
    mine = jax.tree.map(lambda a: None if a is None else a[pid * 4:(pid + 1) * 4], b)  # this process's rows
    losses.append(engine.step(mine).resolve()["loss"])
    if mode == "save" and engine.state.step == 3:
        ckpt.save(engine)  # written in the background while steps 4 and 5 train
if ckpt is not None:
    ckpt.close()
engine.sync()
# Each process writes the pieces its devices hold: (leaf, start row, values); the test puts them together.
pieces = {}
for n, x in enumerate(jax.tree.leaves(engine.state.params())):
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0 if x.ndim else 0
        pieces[f"{n}_{start}"] = np.array(host_view(shard.data))
np.savez(f"{out}.{pid}.npz", losses=np.array(losses), **pieces)
jax.distributed.shutdown()
