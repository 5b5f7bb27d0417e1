#!/usr/bin/env bash
# Create .venv and install the exact version set (pyproject.toml + constraints.txt).
# Safe to rerun: pip skips what is already installed. `make setup` calls this only when
# pyproject.toml or constraints.txt changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      python=$candidate
      break
    fi
  done
fi
if [ -z "$python" ]; then
  echo "error: Python 3.11 is required (the pinned torch/ray wheels are built for it); set PYTHON=/path/to/python3.11." >&2
  exit 2
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() {
  # Some machines list package mirrors that do not exist; pip warns once per package.
  .venv/bin/python -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
# torch first, exactly pinned: left to a resolver, a CPU-only machine could pull a multi-GB
# CUDA build. DS_BUILD_OPS=0: DeepSpeed compiles its C++ ops on first use instead of at install.
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu in GitHub Actions) adds the index
# with the CPU build; the +cpu local version sorts above PyPI's CUDA build, so pip takes it.
pip install --quiet --disable-pip-version-check -c constraints.txt torch==2.13.0 \
  ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
DS_BUILD_OPS=0 pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
echo "installed: $(.venv/bin/python -c 'import torch, ray, transformers, deepspeed; print(f"torch {torch.__version__}, ray {ray.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")' 2>/dev/null)"
