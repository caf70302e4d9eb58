#!/usr/bin/env bash
# The prepared device check for an NVIDIA machine without internet (issue 24), under 10 minutes: the NVIDIA probe
# on the real GPUs, a single trainer placed on its card by `workbench train`, a few bf16 GRPO steps there (TRL's
# in-process generation: vLLM is too large to bring). Run from the repository root:
#
#   make wheelhouse                      # here, with internet: the pure-Python wheels the GPU machine lacks -> .whl/
#   bash scripts/device_check.sh         # there: installs .whl/ into /tmp/site, runs scripts/device_check.py
#
# The machine must already have torch with CUDA, transformers and accelerate (the wheels carry TRL, datasets and
# the workbench's small dependencies only). Results: $OUT (or /tmp/device-check)/device_check.json and train.log.
set -uo pipefail
OUT="${OUT:-/tmp/device-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
started=$(date +%s)
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "FAIL  installing .whl/ (read pip's message above)"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WORKBENCH_DATA="${WORKBENCH_DATA:-/tmp/device-check-data}"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
"$PY" -c "import torch, transformers, accelerate, trl; print('versions: torch', torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| trl', trl.__version__)" \
  || { echo "FAIL  the trainer stack does not import (bring the missing wheels in .whl/)"; exit 1; }
"$PY" scripts/device_check.py --out "$OUT" "$@"
code=$?
echo "device check finished in $(( $(date +%s) - started ))s, exit $code"
exit $code
