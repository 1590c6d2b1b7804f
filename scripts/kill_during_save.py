"""A real training process for the crash-safety test (tests/test_checkpoint.py): a tiny model trained by
``fit`` on the demo corpus, checkpointing every ``--every`` steps into ``--dir``.

The test runs it twice: once with ``--part-delay S``, which makes the checkpoint writer sleep after each
part it writes (injected here, by wrapping ``Snapshot.release``; the library has no such knob), so that
the test can SIGKILL it in the middle of a save (``--delay-from-step N``: only in the saves of step N and
later, the earlier ones at full speed); and once with ``--resume`` to finish from the last
complete checkpoint. At the end
the final float32 parameters are written to ``--out`` (``.npz``, arrays only) and the losses next to it
(``.json``), so the test can compare the runs bit for bit.

    python scripts/kill_during_save.py --dir /tmp/ck --steps 8 --every 2 --out /tmp/final.npz [--resume] [--part-delay 0.5]
        [--delay-from-step 4] [--disk-dir /tmp/tier]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from flax import nnx
from flax.nnx import traversals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="checkpoint directory")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--out", required=True, help="where to write the final parameters (.npz)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--part-delay", type=float, default=0.0, help="seconds the writer sleeps after each part")
    p.add_argument("--delay-from-step", type=int, default=0,
                   help="with --part-delay: only the saves of this step and later sleep")
    p.add_argument("--disk-dir", help="keep the last block's Adam moments in files there (the disk tier)")
    args = p.parse_args(argv)

    from megatrain_jax import Decoder, EngineConfig, Hook, TrainConfig, default_optimizer, fit, preset
    from megatrain_jax.checkpoint.store import Snapshot
    from megatrain_jax.data import DataConfig

    if args.part_delay:
        release = Snapshot.release

        def slow_release(self, name: str) -> None:
            release(self, name)
            if self.step >= args.delay_from_step:
                time.sleep(args.part_delay)
        Snapshot.release = slow_release

    cfg = preset("tiny", layers=2, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    data = DataConfig(seq_len=16, batch_size=2, seed=3, prefetch=2, demo_tokens=1 << 14).build(cfg.vocab_size)
    progress = Hook(lambda m, info: print(f"STEP {m['step']}", flush=True))
    train = TrainConfig(steps=args.steps, log_every=0, checkpoint_dir=args.dir, checkpoint_every=args.every,
                        resume=args.resume)
    engine = EngineConfig(micro_batches=2, **({"disk_parts": 1, "disk_dir": args.disk_dir} if args.disk_dir else {}))
    history = fit(model, data, default_optimizer(1e-3), train=train, engine=engine, hooks=[progress])
    flat = traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    np.savez(args.out, **{"/".join(map(str, k)): np.asarray(v) for k, v in flat.items()})
    with open(args.out.removesuffix(".npz") + ".json", "w") as f:
        json.dump({"steps": history["step"], "loss": history["loss"]}, f)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
