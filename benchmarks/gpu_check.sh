#!/usr/bin/env bash
# One-shot check of the GPU path on the embedded target (SmolLM2-135M-Instruct), through the stages the
# workflow runs: a short regeneration on the device -> the compile-cache warmup -> training (compiled
# flex_attention in bf16 on CUDA) -> evaluation on the device -> a DDP-wrapped compiled drafter against
# the warm cache. Prints tau, speedup, tokens/s and peak memory; writes everything under $OUT.
# Without a GPU it runs the same path on the CPU (SDPA, since flex has no CPU backward), so that it is tested.
#
#   benchmarks/gpu_check.sh                      # about 5 minutes on one GPU
#   PROMPTS=16 NEW_TOKENS=32 STEPS=16 EVAL=2 benchmarks/gpu_check.sh   # a CPU-sized run
# TARGET, PROMPT_SOURCE and DRAFT_VOCAB take another target, prompt source and draft vocabulary size
# (tests/test_benchmarks.py runs the script on the tiny chat target of the workflow tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-results/gpu-check}
PROMPTS=${PROMPTS:-256}        # prompts regenerated
NEW_TOKENS=${NEW_TOKENS:-128}  # per response, and per evaluated prompt
STEPS=${STEPS:-200}            # about: epochs are chosen to give at least this many steps
EVAL=${EVAL:-8}                # prompts per evaluation set
TARGET=${TARGET:-embedded}
PROMPT_SOURCE=${PROMPT_SOURCE:-sharegpt}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}   # null: the target's whole vocabulary

device=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
if [ "$device" = cuda ]; then backend=flex; precision=bf16; warm=cuda0; else backend=sdpa; precision=auto; warm=cpu; fi
mkdir -p "$OUT"
stage() { local name=$1; shift; local start=$SECONDS; "$PY" -m dflash "$@" > "$OUT/$name.log" 2>&1 || { tail -n 40 "$OUT/$name.log"; exit 1; }; echo "$name: $((SECONDS - start)) s"; }

data=$($PY -c "import json,sys; print(json.dumps({'prompts': {'source': sys.argv[4], 'limit': int(sys.argv[1])}, 'heldout_fraction': 0.4, 'heldout_limit': int(sys.argv[3]), 'validation': 8, 'max_length': 512, 'max_prompt_length': 256, 'generation': {'max_new_tokens': int(sys.argv[2]), 'batch_size': 32, 'chunk_size': 64}}))" "$PROMPTS" "$NEW_TOKENS" "$EVAL" "$PROMPT_SOURCE")
epochs=$($PY -c "import math,sys; print(max(1, math.ceil(int(sys.argv[1]) / math.ceil(int(sys.argv[2]) / 8))))" "$STEPS" "$PROMPTS")
drafter="{\"block_size\": 4, \"draft_vocab_size\": $DRAFT_VOCAB}"
train=$($PY -c "import json,sys; print(json.dumps({'epochs': int(sys.argv[1]), 'batch_size': 8, 'max_anchors': 64, 'attention_backend': sys.argv[2], 'precision': sys.argv[3], 'compile': True, 'log_every': 10, 'validate_every': 50}))" "$epochs" "$backend" "$precision")
topology=$($PY -c "import json,sys; print(json.dumps({'device': sys.argv[1]}))" "$device")
warmup_train=$($PY -c "import json,sys; t=json.loads(sys.argv[1]); [t.pop(k) for k in ('epochs','log_every','validate_every')]; print(json.dumps(t))" "$train")

stage prepare_target prepare-target --target "{\"source\": \"$TARGET\"}" --out "$OUT/target.json"
stage prepare_data prepare-data --data "$data" --topology "$topology" --target-manifest "$OUT/target.json" --out-dir "$OUT/data" --chunk-dir "$OUT/chunks"
stage warmup_cache warmup-cache --devices "$warm" --drafter "$drafter" --train "$warmup_train" --topology "$topology" \
  --target-manifest "$OUT/target.json" --samples "$OUT/data/train.parquet" --cache-root "$OUT/compile" --out-dir "$OUT/warmup"
stage train train --drafter "$drafter" --train "$train" --topology "$topology" --tracking '{"wandb_mode": "disabled"}' \
  --target-manifest "$OUT/target.json" --samples "$OUT/data/train.parquet" --validation "$OUT/data/validation.parquet" \
  --preflight "$OUT/warmup/$warm.json" --out-dir "$OUT/train" --checkpoint-dir "$OUT/cache"
eval=$($PY -c "import json,sys; n=int(sys.argv[1]); print(json.dumps({'max_new_tokens': int(sys.argv[2]), 'sets': [{'name': 'chat', 'source': 'heldout', 'limit': n}, {'name': 'humaneval', 'source': 'humaneval', 'limit': n}]}))" "$EVAL" "$NEW_TOKENS")
stage evaluate evaluate --eval "$eval" --topology "$topology" --target-manifest "$OUT/target.json" --drafter "$OUT/train/drafter" \
  --heldout "$OUT/data/heldout.jsonl" --validation "$OUT/data/validation.parquet" --out-dir "$OUT/eval"
start=$SECONDS
"$PY" benchmarks/ddp_warm_cache.py > "$OUT/ddp_warm_cache.log" 2>&1 || { cat "$OUT/ddp_warm_cache.log"; exit 1; }
echo "ddp_warm_cache: $((SECONDS - start)) s"

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
import pandas as pd
out = Path(sys.argv[1])
card, train = (json.loads((out / p).read_text()) for p in ("data/card.json", "train/summary.json"))
warmup = json.loads(next((out / "warmup").glob("*.json")).read_text())
summary = pd.read_csv(out / "eval" / "summary.csv")
print(f"\ndevice: {summary['device'].iloc[0]}")
print(f"regeneration: {card['regeneration_tokens_per_second']:.0f} tokens/s ({card['samples']} samples)")
print(f"warmup: {warmup['summary']}")
cache = train["compile_cache"]
print(f"training: {train['steps']} steps, {train['tokens_per_second']:.0f} tokens/s, target {train['target_tokens_per_second']:.0f} tokens/s, "
      f"first step {train['first_step_seconds']:.1f} s, compile cache {cache.get('fxgraph_cache_hit', 0)} hit(s) {cache.get('fxgraph_cache_miss', 0)} miss(es), "
      f"peak memory {train['peak_memory_gb']} GB")
for row in summary.itertuples():
    print(f"{row.set}: tau {row.tau:.2f}, speedup {row.speedup:.2f} (prompt lookup tau {row.pld_tau:.2f}, {row.pld_speedup:.2f}; "
          f"hybrid tau {row.hybrid_tau:.2f}, {row.hybrid_speedup:.2f}), lossless {row.lossless and row.pld_lossless and row.hybrid_lossless}")
print((out / "ddp_warm_cache.log").read_text().strip())
EOF
