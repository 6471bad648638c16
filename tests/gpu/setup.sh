#!/usr/bin/env bash
# The GPU lane's first part (run.sh runs it under its time limit):
#
#   bash tests/gpu/setup.sh ENVIRONMENT_JSON
#
# 1. installs carried wheels (.whl/*.whl, e.g. torchao for the float8 test) into /tmp/site (run.sh has put it on
#    PYTHONPATH), then this package (editable, no dependencies, no index: the GPU machine has no network);
# 2. prints nvidia-smi, the torch/CUDA/NCCL/Lightning/torchao versions, the GPU and whether torch has
#    torch.nn.functional.grouped_mm (the MoE part needs it), and writes them to ENVIRONMENT_JSON.
# Exits 1 when there is no usable GPU, unless the CPU smoke mode (LIGHTNING_2D_GPU_LANE_ON_CPU=1) or a dry run
# (LIGHTNING_2D_GPU_DRY_RUN=1: no installs, every GPU test skips) asks for none.
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
ENVIRONMENT_JSON=${1:?usage: bash tests/gpu/setup.sh ENVIRONMENT_JSON}
DRY_RUN=${LIGHTNING_2D_GPU_DRY_RUN:-0}

if [ "$DRY_RUN" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 1; }
fi
# --no-build-isolation: building the editable wheel must not try to download setuptools.
# LIGHTNING_2D_GPU_SKIP_INSTALL=1 leaves an existing environment alone (a shared local venv).
if [ "$DRY_RUN" != 1 ] && [ "${LIGHTNING_2D_GPU_SKIP_INSTALL:-0}" != 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        || echo "warning: the editable install failed; the tests import the checkout through PYTHONPATH"
fi

nvidia-smi || echo "nvidia-smi failed"
"$PY" - "$ENVIRONMENT_JSON" <<'EOF'
import json, os, sys
import torch, lightning
import torch.nn.functional as F

env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
       "lightning": lightning.__version__, "grouped_mm": hasattr(F, "grouped_mm"), "device_count": 0}
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| lightning", lightning.__version__,
      "| torch.nn.functional.grouped_mm:", "yes" if env["grouped_mm"] else "NO (the MoE part cannot run its kernels)")
usable = True
if torch.cuda.is_available():
    env.update(nccl=".".join(map(str, torch.cuda.nccl.version())), device_count=torch.cuda.device_count(),
               device_name=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)))
    print("NCCL", env["nccl"], "| devices:",
          [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(env["device_count"])])
elif os.environ.get("LIGHTNING_2D_GPU_LANE_ON_CPU") == "1":
    print("CUDA is not available: CPU smoke mode (LIGHTNING_2D_GPU_LANE_ON_CPU=1)")
elif os.environ.get("LIGHTNING_2D_GPU_DRY_RUN") == "1":
    print("CUDA is not available: dry run (LIGHTNING_2D_GPU_DRY_RUN=1), every GPU test will skip")
else:
    print("CUDA is not available: every test would be skipped, which is a failure of this lane")
    usable = False
try:
    import torchao
    env["torchao"] = torchao.__version__
    print("torchao", torchao.__version__)
except ImportError:
    print("torchao: not installed (the float8 test skips; see tests/gpu/README.md)")
with open(sys.argv[1], "w") as f:
    json.dump(env, f)
sys.exit(0 if usable else 1)
EOF
