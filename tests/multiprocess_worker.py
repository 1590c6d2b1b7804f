"""One of the processes of tests/test_mesh.py's two-process run (jax.distributed on CPU, 2 devices each).

    python tests/multiprocess_worker.py <coordinator> <process id> <out.npz>
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax import distributed  # noqa: E402

coordinator, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import faulthandler; faulthandler.dump_traceback_later(300, exit=True)  # a hang fails the test, with stacks
distributed.initialize(coordinator, 2, pid)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from megatrain_jax import Decoder, Engine  # noqa: E402
from megatrain_jax.transfer import host_view  # noqa: E402
from mesh_case import ADAMW, ENGINE, MODEL, batches  # noqa: E402

engine = Engine(Decoder(MODEL, rngs=nnx.Rngs(0)), ADAMW(), ENGINE)
assert engine.placement.size == 4 and engine.placement.processes == 2, engine.placement.devices
losses = []
for b in batches():
    mine = jax.tree.map(lambda a: None if a is None else a[pid * 4:(pid + 1) * 4], b)  # this process's rows
    losses.append(engine.step(mine).resolve()["loss"])
engine.sync()
# Each process writes the pieces its devices hold: (leaf, start row, values); the test puts them together.
pieces = {}
for n, x in enumerate(jax.tree.leaves(engine.state.params())):
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0 if x.ndim else 0
        pieces[f"{n}_{start}"] = np.array(host_view(shard.data))
np.savez(f"{out}.{pid}.npz", losses=np.array(losses), **pieces)
jax.distributed.shutdown()
