#!/usr/bin/env bash
# Regenerate the pictures of the docs (docs/*.png) from real plans and runs (needs the plot extra:
# pip install -e ".[plot]"). About 8 minutes on 2 CPU cores: the pipeline benchmark (~2 min) and two
# 150-step fits of the main job (~2.5 and ~1.5 min). Run from anywhere: `bash docs/make_pictures.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
L2D=${L2D:-.venv/bin/lightning-2d}
export OMP_NUM_THREADS=1
RUNS=$(mktemp -d)  # the fits' CSV logs and output (fresh, so each log is version_0)

# Memory per device: the 405B pipeline recipe's plan (docs/scaling/pipeline.md, "Memory under a pipeline"), a bar per pipeline rank.
"$L2D" plan --config recipes/llama3_405b_pipeline.yaml --plot docs/plan_memory.png > "$RUNS/plan_memory.txt"

# The mesh: 4 nodes x 8 GPUs as 2 pipeline ranks x 2 replicas x 2 shards x 4 tensor-parallel ranks.
"$L2D" plan --model llama3-70b --num-nodes 4 --devices 8 --pipeline-parallel-size 2 --data-parallel-replicate-size 2 \
    --tensor-parallel-size 4 --activation-checkpointing full --seq-len 8192 \
    --plot-mesh docs/mesh.png > "$RUNS/plan_mesh.txt"

# The pipeline schedules: one measured step of each on 2 CPU processes, 4 micro-batches.
"$PYTHON" tests/benchmarks/bench_pipeline.py --stages 2 --microbatches 4 --steps 4 --plot docs/pipeline_schedules.png

# The main job's loss, 2 x 2 on 4 CPU processes against one device, same global batch (16 sequences) and seed.
"$L2D" prepare-data --config recipes/debug_cpu.yaml > /dev/null
"$L2D" fit --config recipes/debug_cpu.yaml --trainer.log_every_n_steps=1 \
    --trainer.logger.init_args.save_dir="$RUNS" --trainer.logger.init_args.name=dp2_tp2 > "$RUNS/dp2_tp2.log" 2>&1
"$L2D" fit --config recipes/debug_cpu.yaml --trainer.log_every_n_steps=1 \
    --trainer.devices=1 --trainer.strategy.init_args.data_parallel_size=1 \
    --trainer.strategy.init_args.tensor_parallel_size=1 --trainer.strategy.init_args.sequence_parallel=false \
    --data.batch_size=16 \
    --trainer.logger.init_args.save_dir="$RUNS" --trainer.logger.init_args.name=one_device > "$RUNS/one_device.log" 2>&1
"$PYTHON" -m lightning_2d.tools.plots loss \
    "$RUNS/dp2_tp2/version_0/metrics.csv" "$RUNS/one_device/version_0/metrics.csv" \
    --labels "2 × 2 (dp 2, tp 2, 4 CPU processes)" "one device (batch 16)" \
    --title "recipes/debug_cpu.yaml: the debug Llama, 150 fp32 AdamW steps, seed 42" \
    --out docs/loss_2x2_vs_one_device.png

ls -l docs/*.png
echo "plans, logs and metrics: $RUNS"
