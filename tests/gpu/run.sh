#!/usr/bin/env bash
# The GPU check lane in one go, sized for one H200 (~5 minutes, at most 7; every step time-limited):
#
#   bash tests/gpu/run.sh        # from anywhere; set OUT=<folder> to collect the results there
#
# 1. installs carried wheels (.whl/*.whl, e.g. torchao for the float8 test) into /tmp/site, then
#    this package (editable, no dependencies, no index: the GPU machine has no network);
# 2. prints the GPU, driver and the torch/CUDA/NCCL/Lightning/torchao versions;
# 3. correctness: `pytest -m gpu tests/gpu -x` without the MFU test, limited to $CORRECTNESS_LIMIT s;
# 4. MFU of the ~1B Llama (runs even when step 3 failed), limited to $MFU_LIMIT s;
# 5. prints the summary table (each check against its bound, MFU against the 45 % target);
# 6. with $OUT set: run.log, the two reports and a tarball of the per-rank job logs land there;
# 7. lists every skipped test as NOT RUN (from pytest's JUnit reports) and prints the verdict.
# Exit status: 0 (PASSED) only when every step passed and no test was skipped; 3 (NOT RUN) when what
# ran passed but some tests were skipped (e.g. the N x 1 and async-TP tests on one GPU); 1 (FAILED)
# when any step failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
WORK=${LIGHTNING_2D_GPU_WORK:-/tmp/lightning_2d_gpu_lane}
CORRECTNESS_LIMIT=${CORRECTNESS_LIMIT:-250}
MFU_LIMIT=${MFU_LIMIT:-130}
LOG=${OUT:+$OUT/run.log}
LOG=${LOG:-$WORK/run.log}

main() {
    local rc=0
    echo "== setup"
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { echo "installing the carried wheels failed"; return 1; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    # --no-build-isolation: building the editable wheel must not try to download setuptools.
    # LIGHTNING_2D_GPU_SKIP_INSTALL=1 leaves an existing environment alone (a shared local venv).
    if [ "${LIGHTNING_2D_GPU_SKIP_INSTALL:-0}" != 1 ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
            || echo "warning: the editable install failed; the tests import the checkout through PYTHONPATH"
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1
    # One Inductor cache for every job: a graph compiled by one job is a cache hit for the next.
    export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor_cache

    echo "== environment ($((SECONDS))s)"
    nvidia-smi || echo "nvidia-smi failed"
    "$PY" - <<'EOF' || rc=1
import os, sys
import torch, lightning
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| lightning", lightning.__version__)
if torch.cuda.is_available():
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())), "| devices:",
          [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())])
elif os.environ.get("LIGHTNING_2D_GPU_LANE_ON_CPU") == "1":
    print("CUDA is not available: CPU smoke mode (LIGHTNING_2D_GPU_LANE_ON_CPU=1)")
else:
    print("CUDA is not available: every test would be skipped, which is a failure of this lane")
    sys.exit(1)
try:
    import torchao
    print("torchao", torchao.__version__)
except ImportError:
    print("torchao: not installed (the float8 test skips; see tests/gpu/README.md)")
EOF
    [ "$rc" = 0 ] || { echo "no usable GPU: stopping"; return "$rc"; }

    echo "== correctness, limit ${CORRECTNESS_LIMIT}s ($((SECONDS))s)"
    LIGHTNING_2D_GPU_REPORT=$WORK/report_correctness.json timeout -k 10 "$CORRECTNESS_LIMIT" \
        "$PY" -m pytest -m gpu tests/gpu --ignore=tests/gpu/test_mfu.py -x -q -s -p no:cacheprovider \
        --basetemp="$WORK/correctness" --junitxml="$WORK/junit_correctness.xml" \
        || { echo "correctness: FAILED or out of time (rc $?)"; rc=1; }

    echo "== MFU, limit ${MFU_LIMIT}s ($((SECONDS))s)"
    LIGHTNING_2D_GPU_REPORT=$WORK/report_mfu.json timeout -k 10 "$MFU_LIMIT" \
        "$PY" -m pytest -m gpu tests/gpu/test_mfu.py -q -s -p no:cacheprovider \
        --basetemp="$WORK/mfu" --junitxml="$WORK/junit_mfu.xml" || { echo "MFU: FAILED or out of time (rc $?)"; rc=1; }

    echo "== summary ($((SECONDS))s)"
    "$PY" tests/gpu/summary.py "$WORK/report_correctness.json" "$WORK/report_mfu.json"
    if [ -n "${OUT:-}" ]; then
        cp "$WORK"/report_*.json "$WORK"/junit_*.xml "$OUT"/ 2>/dev/null
        # Logs and per-rank JSON only: no checkpoints, token caches or compiled code.
        tar -czf "$OUT/job_logs.tar.gz" -C "$WORK" --exclude='ckpt*' --exclude='token_cache' \
            --exclude='corpus.txt' --exclude='inductor_cache' correctness mfu 2>/dev/null
    fi
    # A skipped test is not a passed one: PASSED needs every test to have run (summary.py --verdict).
    echo "== done in ${SECONDS}s"
    "$PY" tests/gpu/summary.py --verdict "$rc" "$WORK/junit_correctness.xml" "$WORK/junit_mfu.xml"
}

rm -rf "$WORK" && mkdir -p "$WORK" "$(dirname "$LOG")"
main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
