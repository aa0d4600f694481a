#!/usr/bin/env bash
# Build the CPU rig: a venv with real SGLang 0.5.23 that runs prefill/decode servers without a GPU.
#
# Why a separate venv outside the repository: it is ~7 GB (torch is a CUDA build even though it
# runs on the CPU) and takes ~2 minutes to build, so it is built once and reused by every test run.
# Idempotent: when the stamp file records this script's RIG_VERSION, nothing is done.
#
# Usage: backends/sglang_cpu/build_rig.sh          (env: SGLANG_RIG_DIR, default /opt/sglang-rig)
# Result: $SGLANG_RIG_DIR/venv/bin/python can `import sglang.launch_server` with the shims on
# PYTHONPATH (backends/sglang_cpu/shims); the log is $SGLANG_RIG_DIR/build.log.
set -euo pipefail

# Bump when the installed set changes, so existing rigs are rebuilt.
RIG_VERSION="sglang-0.5.23-cpu-1"
SGLANG_VERSION="0.5.23"
TORCH_PINS=("torch==2.14.1" "torchvision==0.29.1")
# Undeclared imports of SGLang, and the Mooncake build that loads without libcuda.
EXTRA_PACKAGES=("dill" "jsonschema" "soundfile" "mooncake-transfer-engine-non-cuda")
# Requirements that need CUDA, or pull another torch (torchaudio==2.11 pins its own torch;
# torchcodec needs FFmpeg); SGLang runs without them on the CPU. torch/torchvision: TORCH_PINS.
GPU_ONLY_REGEX='^(sglang-kernel|flashinfer.*|flash-attn.*|sgl-deep-.*|sgl-flash-mla|nvidia-.*|nvshmem.*|tilelang|quack-kernels|humming-kernels|cuda-python|torch-memory-saver|torch|torchvision|torchaudio|torchcodec)$'

PYTHON_BIN="${SGLANG_RIG_PYTHON:-python3.11}"
RIG_DIR="${SGLANG_RIG_DIR:-/opt/sglang-rig}"
VENV="$RIG_DIR/venv"
STAMP="$RIG_DIR/.rig-complete"
LOG="$RIG_DIR/build.log"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

mkdir -p "$RIG_DIR"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RIG_VERSION" && -x "$VENV/bin/python" ]]; then
    echo "rig: $VENV is complete ($RIG_VERSION); nothing to do"
    exit 0
fi

exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
log() { echo "rig[$(( $(date +%s) - START ))s]: $*"; }

log "building $RIG_VERSION in $VENV with $PYTHON_BIN"
rm -f "$STAMP"

# Mooncake's engine links libibverbs even when it only moves data over TCP.
if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    log "step 0/5: installing libibverbs1 (Debian) for the Mooncake transfer engine"
    if [[ $(id -u) -ne 0 ]]; then
        log "libibverbs.so.1 is missing and this is not root: apt-get install libibverbs1"
        exit 1
    fi
    apt-get install -y --no-install-recommends libibverbs1 \
        || { apt-get update -qq && apt-get install -y --no-install-recommends libibverbs1; }
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check --no-input)

log "step 1/5: ${TORCH_PINS[*]} (from the local disk where pip finds it)"
"${PIP[@]}" install "${TORCH_PINS[@]}"

log "step 2/5: sglang==$SGLANG_VERSION --no-deps"
"${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"

log "step 3/5: SGLang's own requirements from its wheel metadata, minus the GPU-only ones"
REQS="$RIG_DIR/requirements-cpu.txt"
SKIPPED="$RIG_DIR/requirements-skipped.txt"
"$PY" - "$GPU_ONLY_REGEX" "$REQS" "$SKIPPED" <<'EOF'
"""Write SGLang's unconditional requirements that apply here, split into kept and GPU-only."""
import re
import sys
from importlib.metadata import requires

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a fresh venv has packaging only inside pip
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

gpu_only = re.compile(sys.argv[1])
kept, skipped = [], []
for line in requires("sglang") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    (skipped if gpu_only.match(canonicalize_name(req.name)) else kept).append(line)
with open(sys.argv[2], "w") as out:
    out.write("\n".join(kept) + "\n")
with open(sys.argv[3], "w") as out:
    out.write("\n".join(skipped) + "\n")
print(f"kept {len(kept)}, skipped (GPU-only) {len(skipped)}: "
      + ", ".join(Requirement(s).name for s in skipped))
EOF
# Pinning torch in the same run keeps the resolver from swapping in another torch build.
if ! "${PIP[@]}" install -r "$REQS" "${TORCH_PINS[@]}"; then
    log "bulk install failed; installing one by one and recording failures"
    : > "$RIG_DIR/requirements-failed.txt"
    while IFS= read -r req; do
        [[ -z "$req" ]] && continue
        if ! "${PIP[@]}" install "$req" "${TORCH_PINS[@]}"; then
            log "FAILED (skipped): $req"
            echo "$req" >> "$RIG_DIR/requirements-failed.txt"
        fi
    done < "$REQS"
fi

log "step 4/5: extras: ${EXTRA_PACKAGES[*]}"
"${PIP[@]}" install "${EXTRA_PACKAGES[@]}" "${TORCH_PINS[@]}"

log "step 5/5: smoke test (import sglang.launch_server with the CPU shims)"
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$HERE/shims" "$PY" - <<'EOF'
"""Import what the servers import, so a broken rig fails here rather than in a test."""
import importlib

import torch

for name in ("sglang.launch_server", "sglang.srt.disaggregation.mooncake.conn", "transformers",
             "tokenizers", "mooncake.engine"):
    importlib.import_module(name)
conn = importlib.import_module("sglang.srt.disaggregation.mooncake.conn")
print("torch", torch.__version__, "cuda available:", torch.cuda.is_available())
print("supports_host_tensor_indices:", conn.MooncakeKVSender.supports_host_tensor_indices)
EOF

echo "$RIG_VERSION" > "$STAMP"
log "done: $(du -sh "$VENV" | cut -f1) in $VENV"
