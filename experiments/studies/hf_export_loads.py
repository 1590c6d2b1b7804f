"""Whether transformers loads an exported Hugging Face folder and computes finite logits with it: the check that
closes a `megatrain-jax train` run with `train.export_hf` (needs torch and transformers, as on the GPU image).

    python experiments/studies/hf_export_loads.py FOLDER --out $OUT/export_loads.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch
    import transformers
    record = {"name": os.path.basename(args.out).removesuffix(".json"),
              "command": f"python experiments/studies/hf_export_loads.py {args.folder} --out {args.out}",
              "git_commit": os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
              "device": {"name": "cpu (torch)", "host_ram_gib": round(os.sysconf("SC_PAGE_SIZE")
                                                                        * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                         "cpu_cores": os.cpu_count()},
              "date": datetime.date.today().isoformat(), "runs": []}
    run = {"system": "transformers", "transformers": transformers.__version__, "torch": torch.__version__,
           "folder": args.folder, "files": sorted(os.listdir(args.folder)) if os.path.isdir(args.folder) else None}
    record["runs"].append(run)
    try:
        t = time.time()
        model = transformers.AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.bfloat16).eval()
        run["load_s"] = round(time.time() - t, 1)
        run["class"] = type(model).__name__
        run["params"] = sum(p.numel() for p in model.parameters())
        tokens = torch.arange(1, 17).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=tokens).logits.float()
        run.update(logits_finite=bool(torch.isfinite(logits).all()), logits_shape=list(logits.shape), status="ok")
    except Exception as e:  # recorded, not hidden
        run["status"] = f"error: {type(e).__name__}: {str(e)[:500]}"
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: run.get(k) for k in ("status", "class", "params", "logits_finite", "load_s")}))


if __name__ == "__main__":
    main()
