#!/usr/bin/env bash
# CI's second environment: the oldest torch pyproject.toml supports, in its own virtualenv (.venv-oldest),
# running the tests of what depends most on the torch version: the storage formats and quantization round
# trips (float8 casts), the reference ops, checkpoints, training (torch.optim.Muon, FSDP2 fully_shard) and
# the 2-process gloo runs, plus the Triton interpreter tests of the elementwise kernels (torch pins its
# triton). The whole suite runs in the main environment (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=$(python3 -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"];
print(next(re.match(r"torch>=([0-9.]+)", d).group(1) for d in deps if d.startswith("torch>=")))')
VENV=.venv-oldest
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$TORCH'))" 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
fi
echo "oldest-torch: installing torch==$TORCH.* into $VENV"
"$VENV/bin/pip" install -q "torch==$TORCH.*"
PYTHON="$VENV/bin/python" bash scripts/setup.sh --test
"$VENV/bin/python" -c 'import torch; print("oldest-torch: torch", torch.__version__)'
"$VENV/bin/python" -m pytest -p no:cacheprovider \
  tests/formats/test_formats.py tests/ops/test_ops_reference.py tests/model/test_config.py tests/checkpoint/test_checkpoint.py \
  tests/checkpoint/test_checkpoint_errors.py tests/checkpoint/test_checkpoint_helpers.py tests/train/test_train.py tests/train/test_distributed.py \
  tests/ops/test_triton_elementwise.py tests/formats/test_w8a8.py
