#!/usr/bin/env bash
# Every one-GPU check of the lane in one command, within 7:50 on one H100/H200 whatever happens:
#
#   LIGHTNING_2D_GPU_COMMIT=<the commit sent> bash tests/gpu/run.sh   # set OUT=<folder> to collect the results there
#
# Parts, in order, each under its own time limit (tests/gpu/budget.py: a part gets its guaranteed seconds plus what
# the parts before it left unused, never the time of the parts after it; ~6 minutes expected):
#   setup      tests/gpu/setup.sh: carried wheels, this package, nvidia-smi, versions (stops the lane without a GPU)
#   moe        tests/gpu/test_moe.py        grouped_mm's CUDA kernels in bf16, a debug-moe model trained on them
#   attention  tests/gpu/test_attention.py  FlexAttention block masks, forward and backward, compiled once
#   mfu        tests/gpu/test_mfu.py        MFU of the ~1B Llama, TokenThroughputMonitor against it
#   resume     tests/gpu/test_resume.py     async checkpoints, resume reproducing the uninterrupted run
#   parity     tests/gpu/test_parity.py     NCCL parity with one device: bf16/fp32, options, compile, float8, (Q)LoRA
# Then the summary table, summary.md (a few lines to paste into a closing note) and the verdict.
#
# What it leaves in $OUT (else in $LIGHTNING_2D_GPU_WORK): run.log (everything printed), lane.json (the commit and a
# digest of the sources that ran, the versions, the budget, each part's status, time and limit, every measured number
# and every test's outcome; rewritten after each part), summary.md and job_logs.tar.gz (per-rank logs, pytest's JUnit
# and JSON reports). File them with `python tests/gpu/record.py save <folder>` (tests/gpu/README.md).
#
# Variables: LIGHTNING_2D_GPU_COMMIT (the commit, where the tree has no .git), LIGHTNING_2D_GPU_PARTS (some parts
# only, e.g. "parity" for a rerun), LIGHTNING_2D_GPU_PYTEST_ARGS (e.g. "-k lora"), LIGHTNING_2D_GPU_DEADLINE (seconds,
# default 470; every limit scales with it), LIGHTNING_2D_GPU_DRY_RUN=1 (no GPU: no installs, every test skips; checks
# the orchestration), LIGHTNING_2D_GPU_LANE_ON_CPU=1 (the CPU smoke mode; give it a longer deadline).
# `bash tests/gpu/run.sh perf` runs the performance pass instead (tests/gpu/perf.py, within 7:50; README).
# Exit status: 0 (PASSED) only when every part passed, every test ran and none was left out; 3 (NOT RUN) when what
# ran passed but some tests were skipped or left out (on one GPU the N x 1, ranks-agree and async-TP tests always
# skip); 1 (FAILED) when a part failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
WORK=${LIGHTNING_2D_GPU_WORK:-/tmp/lightning_2d_gpu_lane}
RESULTS=${OUT:-$WORK}
LANE=$RESULTS/lane.json
LOG=$RESULTS/run.log
EXTRA_ARGS=${LIGHTNING_2D_GPU_PYTEST_ARGS:-}
if [ "${LIGHTNING_2D_GPU_DRY_RUN:-0}" = 1 ]; then
    MODE=dry-run
elif [ "${LIGHTNING_2D_GPU_LANE_ON_CPU:-0}" = 1 ]; then
    MODE=cpu-smoke
else
    MODE=cuda
fi

main() {
    local rc=0 parts left_out budget commit part limit grace started prc
    local -a tests extra junits partial
    parts=$("$PY" tests/gpu/budget.py parts) || return 1  # a part name LIGHTNING_2D_GPU_PARTS misspelt
    left_out=$("$PY" tests/gpu/budget.py left-out)
    budget=$("$PY" tests/gpu/budget.py plan)
    read -r -a extra <<< "$EXTRA_ARGS"
    commit=$("$PY" tests/gpu/record.py start "$LANE" --mode "$MODE" --budget "$budget") || return 1
    [ "$commit" = unknown ] || export LIGHTNING_2D_GPU_COMMIT=$commit  # each report records it too
    echo "== GPU lane ($MODE) at commit $commit"
    "$PY" tests/gpu/budget.py table

    if [ "$MODE" != dry-run ] && compgen -G ".whl/*.whl" >/dev/null; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # setup.sh installs the carried wheels there
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1
    # One Inductor cache for every part: a graph compiled by one job is a cache hit for the next.
    export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor_cache

    for part in $parts; do
        read -r limit grace <<< "$("$PY" tests/gpu/budget.py allot "$part" "$SECONDS")"
        # No number (budget.py broke): not run, rather than `timeout 0`, which would mean no limit at all.
        [[ "$limit" =~ ^[0-9]+$ && "$grace" =~ ^[0-9]+$ ]] || { limit=0; grace=0; }
        started=$SECONDS
        if [ "$limit" -le 0 ]; then
            echo "== $part: no time left in the budget, not run (${SECONDS}s)"
            prc=1
        elif [ "$part" = setup ]; then
            echo "== setup, limit ${limit}s (${SECONDS}s)"
            timeout -k "$grace" $((limit - grace)) bash tests/gpu/setup.sh "$WORK/environment.json"
            prc=$?
            "$PY" tests/gpu/record.py environment "$LANE" "$WORK/environment.json"
        else
            echo "== $part, limit ${limit}s (${SECONDS}s)"
            read -r -a tests <<< "$("$PY" tests/gpu/budget.py tests "$part")"
            junits+=("$WORK/junit_$part.xml")
            LIGHTNING_2D_GPU_REPORT=$WORK/report_$part.json timeout -k "$grace" $((limit - grace)) \
                "$PY" -m pytest -m gpu "${tests[@]}" -q -s -p no:cacheprovider --basetemp="$WORK/$part" \
                --junitxml="$WORK/junit_$part.xml" ${extra[@]+"${extra[@]}"}
            prc=$?
        fi
        "$PY" tests/gpu/record.py part "$LANE" "$part" --rc "$prc" --seconds $((SECONDS - started)) \
            --limit "$limit" --report "$WORK/report_$part.json" --junit "$WORK/junit_$part.xml"
        if [ "$prc" != 0 ]; then
            echo "$part: FAILED or out of time (rc $prc, $((SECONDS - started))s of ${limit}s)"
            rc=1
            [ "$part" = setup ] && { echo "setup failed: no part can run"; break; }
        fi
    done

    echo "== summary (${SECONDS}s)"
    "$PY" tests/gpu/summary.py "$WORK"/report_*.json
    if [ -n "${OUT:-}" ]; then
        # Logs, per-rank JSON and pytest's reports only: no checkpoints, token caches or compiled code.
        (cd "$WORK" && tar -czf "$OUT/job_logs.tar.gz" --exclude='ckpt*' --exclude='token_cache' \
            --exclude='corpus.txt' --exclude='inductor_cache' --exclude='*.pt' --exclude='*.distcp' \
            $(ls -d $parts junit_*.xml report_*.json environment.json 2>/dev/null)) || echo "no job logs to pack"
    fi
    # A skipped or left-out test is not a passed one: PASSED needs every test to have run (summary.py --verdict).
    [ -z "$left_out" ] || partial+=(--partial "parts left out by LIGHTNING_2D_GPU_PARTS: $left_out")
    [ -z "$EXTRA_ARGS" ] || partial+=(--partial "tests filtered by LIGHTNING_2D_GPU_PYTEST_ARGS: $EXTRA_ARGS")
    [ "$MODE" = cuda ] || partial+=(--partial "mode $MODE: nothing was measured on a GPU")
    local verdict_lines verdict_exit
    verdict_lines=$("$PY" tests/gpu/summary.py --verdict "$rc" ${partial[@]+"${partial[@]}"} \
        ${junits[@]+"${junits[@]}"})
    verdict_exit=$?
    "$PY" tests/gpu/record.py finish "$LANE" --rc "$rc" --verdict-exit "$verdict_exit" --seconds "$SECONDS" \
        ${partial[@]+"${partial[@]}"}
    echo "== summary.md, for the closing note"
    "$PY" tests/gpu/summary.py --short "$LANE" | tee "$RESULTS/summary.md"
    echo "== done in ${SECONDS}s"
    echo "$verdict_lines"
    return "$verdict_exit"
}

# `bash tests/gpu/run.sh perf`: the performance pass (tests/gpu/perf.py), its own invocation with its own deadline
# (LIGHTNING_2D_GPU_PERF_DEADLINE, default 470 s from this script's start, the wheel install included): perf.json,
# perf.md and perf.log in $OUT. Exit 2 without CUDA (unless LIGHTNING_2D_GPU_LANE_ON_CPU=1: the CPU smoke mode).
perf() {
    if [ "$MODE" = cuda ] && compgen -G ".whl/*.whl" >/dev/null; then  # torchao, for QLoRA's NF4 bases
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || echo "installing the carried wheels failed: QLoRA will fail without torchao"
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1
    export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor_cache
    local total=${LIGHTNING_2D_GPU_PERF_DEADLINE:-470}
    local left=$((total - SECONDS))
    [ "$left" -gt 20 ] || { echo "perf: no time left (${SECONDS}s of ${total}s)"; return 1; }
    # perf.py keeps its own budget within $left seconds; timeout is the backstop (SIGKILL 5 s after SIGTERM).
    LIGHTNING_2D_GPU_PERF_DEADLINE=$left timeout -k 5 "$left" "$PY" tests/gpu/perf.py --out "$RESULTS" \
        --work "$WORK/perf"
}

rm -rf "$WORK" && mkdir -p "$WORK" "$RESULTS"
if [ "${1:-}" = perf ]; then
    perf 2>&1 | tee "$RESULTS/perf.log"
    exit "${PIPESTATUS[0]}"
fi
main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
