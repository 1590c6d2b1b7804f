#!/usr/bin/env bash
# Issue 31: the shipped 8B SFT example as a user runs it, to the end: a random Llama-3.1-8B-shaped HF folder
# and generated chat data (sft_run.py's stages), `megatrain-jax train --config experiments/configs/h100_sft_8b.toml`
# for $STEPS steps with its defaults and an HF export, then transformers loads the export and runs it.
#   OUT=... STEPS=30 bash experiments/studies/sft_export.sh   (on the H100 box)
set -u
OUT=${OUT:-/tmp/sft_export_out}; STEPS=${STEPS:-30}; W=${WORK:-/tmp/sft8b}
mkdir -p "$OUT" "$W"
export PYTHONPATH=. PYTHONUNBUFFERED=1
t0=$(date +%s)
if [ ! -f "$W/checkpoint/model.safetensors.index.json" ]; then  # a warm machine keeps them from the last call
  python experiments/studies/sft_run.py --work "$W" --preset llama3.1-8b --examples 4000 --stage data > "$OUT/make.log" 2>&1
  python experiments/studies/sft_run.py --work "$W" --preset llama3.1-8b --stage checkpoint >> "$OUT/make.log" 2>&1
fi
echo "made checkpoint and data: $(( $(date +%s) - t0 )) s"
rm -rf /tmp/run_export /tmp/export
timeout "${LIMIT:-360}" python -m megatrain_jax train --config experiments/configs/h100_sft_8b.toml \
  model.hf_checkpoint="$W/checkpoint" data.path="$W/chat.jsonl" train.steps="$STEPS" train.eval_every=0 \
  train.log_every=1 train.run_dir=/tmp/run_export train.export_hf=/tmp/export > "$OUT/train.log" 2>&1
echo "train: rc=$? after $(( $(date +%s) - t0 )) s"
cp /tmp/run_export/metrics.jsonl /tmp/run_export/memory_plan.json "$OUT/" 2>/dev/null
grep -E "megatrain_jax:|planned memory|exported|done:|error" "$OUT/train.log" | cut -c1-400
python - > "$OUT/transformers_load.json" 2> "$OUT/transformers_load.log" <<'PY'
import json, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained("/tmp/export", dtype=torch.bfloat16).to("cuda")
tok = AutoTokenizer.from_pretrained("/tmp/export")
load_s = time.perf_counter() - t
enc = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True,
                              return_tensors="pt")
ids = (enc["input_ids"] if hasattr(enc, "keys") else enc).to("cuda")  # transformers 5 returns a BatchEncoding
with torch.no_grad():
    logits = model(ids).logits.float()
out = model.generate(ids, max_new_tokens=8, do_sample=False)
print(json.dumps({"loaded": type(model).__name__, "params": sum(p.numel() for p in model.parameters()),
                  "load_s": round(load_s, 1), "prompt_tokens": int(ids.shape[-1]),
                  "logits_finite": bool(torch.isfinite(logits).all()), "logits_abs_max": float(logits.abs().max()),
                  "generated": tok.decode(out[0, ids.shape[-1]:])}))
PY
echo "transformers: rc=$? after $(( $(date +%s) - t0 )) s"; cat "$OUT/transformers_load.json"; tail -3 "$OUT/transformers_load.log"
