#!/usr/bin/env bash
# CUDA smoke test of fedpipe on a GPU machine that has no network.
#
#   tools/gpu-smoke.sh prepare   # on a machine with network: download Python 3.12 wheels of
#                                # what fedpipe needs besides torch and numpy into $WHEELS
#   tools/gpu-smoke.sh [run]     # on the GPU machine (python3.12 and its own CUDA torch):
#                                # install the wheels offline into a private folder, then
#                                # 1. a 2-node swarm, both nodes --device cuda
#                                # 2. a mixed job: one --device cpu node, one --device cuda node
#                                # each trained job's weights checked against single-process
#                                # training on the CPU (max relative difference <= $TOL, TF32 off)
#                                # 3. the steady step time (ms) of a 2-stage 1F1B job whose
#                                # stages exchange 8 MiB activations, on cuda,cuda next to
#                                # cpu,cpu (tools/gpu_smoke.py --measure)
#                                # Where torch sees no CUDA device it says so in one line and
#                                # exits 0, having measured nothing.
#   tools/gpu-smoke.sh check-cpu # the same checks with two CPU nodes, and a small step
#                                # measurement on cpu,cpu, installing nothing: proves the
#                                # script and its checks on a machine without a GPU
#
# Nothing is installed into the GPU machine's Python: the wheels go to $SITE, put first on
# PYTHONPATH. torch and numpy are the machine's own (never downloaded, never replaced).
# Variables: PYTHON (default python3), WHEELS (default tools/wheels: git-ignored; carry it to
# the device machine), SITE (default /tmp/fedpipe-site), TOL (default 1e-4).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/tools/wheels}
SITE=${SITE:-/tmp/fedpipe-site}
TOL=${TOL:-1e-4}
# fedpipe's dependencies (pyproject.toml) but torch and numpy, which must match the machine's
# CUDA build, and matplotlib (the machine's own serves the tracker's plots); their own
# dependencies come along in `prepare`.
PACKAGES=(
  "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "protobuf>=7.35.1,<8" "zstandard>=0.22"
  "cryptography>=42" "psutil>=5.9" "tqdm>=4.66" "cloudpickle>=3.0" "prometheus-client>=0.20"
  "rich>=13.0"
)

prepare() {
  mkdir -p "$WHEELS"
  printf '*\n!.gitignore\n' > "$WHEELS/.gitignore"  # wheels are downloaded, never committed
  "$PYTHON" -m pip download --quiet --dest "$WHEELS" --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any "${PACKAGES[@]}"
  du -sh "$WHEELS"
  ls "$WHEELS"
}

install() {
  local py
  py=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [[ $py == 3.12 ]] || { echo "gpu-smoke: needs Python 3.12 (the wheels' version), $PYTHON is $py" >&2; exit 2; }
  compgen -G "$WHEELS/*.whl" > /dev/null \
    || { echo "gpu-smoke: no wheels in $WHEELS: run '$0 prepare' where there is network" >&2; exit 2; }
  rm -rf "$SITE"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
}

# Exit 0 with one line where torch sees no CUDA device and nvidia-smi lists none (nothing to
# measure there), 1 where nvidia-smi lists a GPU that torch cannot use; exit 2
# with one line where $PYTHON cannot import torch. Needs only the machine's own torch.
require_cuda() {
  local out
  if ! out=$("$PYTHON" -c 'import torch; print(torch.__version__, torch.cuda.is_available())' \
             2>&1); then
    echo "gpu-smoke: $PYTHON cannot import torch: $(tail -n 1 <<<"$out")" >&2
    exit 2
  fi
  out=$(tail -n 1 <<<"$out")  # after any warning torch printed
  if [[ ${out##* } != True ]]; then
    if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
      # a GPU is there but torch cannot use it (a CPU build, a driver mismatch): a failure
      echo "gpu-smoke: nvidia-smi lists a GPU but torch ${out% *} sees no CUDA device" >&2
      exit 1
    fi
    echo "gpu-smoke: no CUDA device (torch ${out% *} sees none): nothing was measured"
    exit 0
  fi
}

case "${1:-run}" in
  prepare) prepare ;;
  run)
    require_cuda
    install
    # TF32 off in every process (the nodes inherit the environment): full float32 matmuls
    export NVIDIA_TF32_OVERRIDE=0
    "$PYTHON" - <<'PY'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PY
    "$PYTHON" "$ROOT/tools/gpu_smoke.py" --devices cuda,cuda --tol "$TOL"
    "$PYTHON" "$ROOT/tools/gpu_smoke.py" --devices cpu,cuda --tol "$TOL"
    "$PYTHON" "$ROOT/tools/gpu_smoke.py" --measure cuda,cuda cpu,cpu
    ;;
  check-cpu)
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" "$ROOT/tools/gpu_smoke.py" --devices cpu,cpu --tol "$TOL"
    "$PYTHON" "$ROOT/tools/gpu_smoke.py" --measure cpu,cpu --width 1024 --batch 256 \
      --steps 8 --warmup 2
    ;;
  *) sed -n '2,24p' "$0" >&2; exit 2 ;;
esac
