#!/usr/bin/env bash
# The GPU part of issue 15 (vLLM generators on a GPU), in as few calls as a GPU machine with
# no network allows.
#
#   scripts/gpu_vllm.sh stash DIR                     keep the wheelhouse parts carried in DIR
#   scripts/gpu_vllm.sh run [--dry-run] OUTDIR [NAME ...]
#
# The machine: one NVIDIA GPU, Python 3.12 with torch 2.11.0 (CUDA) and the packages of
# scripts/gpu_image_packages.txt, no vLLM, no network, and at most 64 MiB carried per call.
# vLLM 0.26.0 is the release that pins torch==2.11.0; it and every package it and rollstream
# need that the image lacks (~340 MiB in 81 wheels, the vLLM wheel alone 290 MiB; protobuf and grpcio too, whose
# versions the generated stubs check at import) travel as a wheelhouse
# cut into parts:
#
#   1. Here (with network):  python scripts/gpu_wheelhouse.py .gpu-wheelhouse
#      -> .gpu-wheelhouse/parts/wheelhouse.tar.partNN (56 MiB each), .gpu-wheelhouse/SHA256SUMS
#      (.gpu-wheelhouse/ is git-ignored; nothing of it is committed).
#   2. One device call per part, back to back (the machine stays warm ~30 s after a call and
#      keeps what a call wrote outside $OUT until it goes back):
#        rm -rf .gpu-wheelhouse/carry && mkdir .gpu-wheelhouse/carry &&
#        cp .gpu-wheelhouse/SHA256SUMS .gpu-wheelhouse/parts/wheelhouse.tar.partNN .gpu-wheelhouse/carry/
#        device run: command "bash scripts/gpu_vllm.sh stash .gpu-wheelhouse/carry", carry [".gpu-wheelhouse/carry"]
#      `stash` copies the part to $ROLLSTREAM_WHEELHOUSE (default /root/rollstream-wheelhouse),
#      checks its sha256 against SHA256SUMS and says which parts are still missing.
#   3. The last call: "bash scripts/gpu_vllm.sh run $OUT" (nothing carried). It puts the parts
#      together, checks the tar's sha256, installs the wheels with pip --no-index --no-deps
#      --target $ROLLSTREAM_VLLM_SITE (default /tmp/rollstream-vllm-site), then runs, each
#      writing into OUTDIR and carrying on past a failing one:
#        setup                 install + `from vllm import LLM` (setup.log; the versions in summary.txt)
#        vllm_cuda             pytest -m vllm_cuda tests/vllm_cuda: the CUDA weight path bit-exact
#                              against the trainer's bits over several deltas and a lone fused
#                              shard, greedy outputs equal to transformers', versions, prefix
#                              cache reset (vllm_cuda.log, vllm_cuda.xml)
#        sync_latency_0.5b     benchmarks/weight_sync_latency.py --backend vllm --device cuda
#                              --shape 0.5b: trainer step end -> generator serving, per stage,
#                              and delta bytes per step (goal: <= 0.1 s)
#        generate_0.5b         benchmarks/vllm_generate_overhead.py --shape 0.5b --device cuda:
#                              VllmBackend.sample vs LLM.generate tokens/s (goal: lose <= 5%)
#      and summary.txt (which ran, which failed, versions). That is 8 files: the most one call
#      brings back. NAME ... runs only those steps (setup always runs unless vLLM is there).
#      --dry-run prints what would run, installs nothing, runs nothing (works anywhere).
#
# Models: Qwen2-shaped folders with random weights built on the spot (benchmarks/shapes.py:
# a tiny one for the tests, Qwen2-0.5B's shape for the benchmarks); nothing is downloaded.
# Every step sets VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in the generator's process, as
# the tests need to read weights back; an update crosses no process boundary).
#
# Expected time (an estimate, not measured): stash ~1 minute a part (7 parts); run: install
# 1-2 minutes, vllm_cuda 2-4, sync_latency 3-5 (the CPU trainer's AdamW steps on 0.5B), generate
# 3-5. Each step is cut at $STEP_TIMEOUT_S (default 900) seconds; keep the whole `run` inside
# one device call's 10 minutes with NAME ... if needed (e.g. `run $OUT vllm_cuda sync_latency_0.5b`
# then `run $OUT generate_0.5b`: the installed site stays while the machine is warm).
#
# Not run yet: written and dry-run on a CPU-only machine (no GPU was lent to the session that
# wrote it); the install was checked only as far as building the wheelhouse.
set -u

repo=$(cd "$(dirname "$0")/.." && pwd)
py=${ROLLSTREAM_PY:-python3}
stash_dir=${ROLLSTREAM_WHEELHOUSE:-/root/rollstream-wheelhouse}
site=${ROLLSTREAM_VLLM_SITE:-/tmp/rollstream-vllm-site}
step_timeout=${STEP_TIMEOUT_S:-900}

usage() {
    echo "usage: $0 stash DIR | $0 run [--dry-run] OUTDIR [NAME ...]" >&2
    exit 2
}

# -- stash: keep one call's parts -------------------------------------------------------------
stash() {
    local from=$1
    [ -f "$from/SHA256SUMS" ] || { echo "no SHA256SUMS in $from" >&2; exit 1; }
    mkdir -p "$stash_dir" || exit 1
    cp "$from/SHA256SUMS" "$stash_dir/SHA256SUMS.new" || exit 1
    if [ -f "$stash_dir/SHA256SUMS" ] && ! cmp -s "$stash_dir/SHA256SUMS" "$stash_dir/SHA256SUMS.new"; then
        echo "another wheelhouse was stashed before: starting over" >&2
        rm -f "$stash_dir"/wheelhouse.tar.part*
    fi
    mv "$stash_dir/SHA256SUMS.new" "$stash_dir/SHA256SUMS"
    local part
    for part in "$from"/wheelhouse.tar.part*; do
        [ -e "$part" ] || continue
        cp "$part" "$stash_dir/" || exit 1
    done
    (cd "$stash_dir" && grep 'wheelhouse.tar.part' SHA256SUMS | while read -r sum name; do
        if [ ! -f "$name" ]; then
            echo "missing: $name"
        elif [ "$(sha256sum "$name" | cut -d' ' -f1)" != "$sum" ]; then
            echo "corrupt: $name (removed)"
            rm -f "$name"
        else
            echo "ok: $name"
        fi
    done)
}

# -- install: parts -> tar -> wheels -> site --------------------------------------------------
have_vllm() {
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" -c 'import vllm, sys; sys.exit(0 if vllm.__version__ == "0.26.0" else 1)' 2>/dev/null
}

install() {
    if have_vllm; then
        echo "vllm 0.26.0 already importable (site $site)"
        return 0
    fi
    [ -f "$stash_dir/SHA256SUMS" ] || { echo "no wheelhouse stashed in $stash_dir (see the header: stash)" >&2; return 1; }
    local missing
    missing=$(cd "$stash_dir" && grep 'wheelhouse.tar.part' SHA256SUMS | while read -r sum name; do
        [ -f "$name" ] && [ "$(sha256sum "$name" | cut -d' ' -f1)" = "$sum" ] || echo "$name"
    done)
    if [ -n "$missing" ]; then
        echo "parts missing or corrupt: $missing" >&2
        return 1
    fi
    (cd "$stash_dir" && cat $(grep -o 'wheelhouse.tar.part[0-9]*' SHA256SUMS | sort) > wheelhouse.tar) || return 1
    local want got
    want=$(grep ' wheelhouse.tar$' "$stash_dir/SHA256SUMS" | cut -d' ' -f1)
    got=$(sha256sum "$stash_dir/wheelhouse.tar" | cut -d' ' -f1)
    if [ "$want" != "$got" ]; then
        echo "wheelhouse.tar sha256 $got, SHA256SUMS says $want" >&2
        return 1
    fi
    rm -rf "$stash_dir/wheels" && mkdir -p "$stash_dir/wheels" && tar -xf "$stash_dir/wheelhouse.tar" -C "$stash_dir/wheels" || return 1
    rm -f "$stash_dir/wheelhouse.tar"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$stash_dir"/wheels/*.whl || return 1
    have_vllm || { echo "vllm still not importable after the install" >&2; return 1; }
}

# -- run ----------------------------------------------------------------------------------------
run() {
    local dry_run=0
    if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
    [ $# -ge 1 ] || usage
    local outdir=$1
    shift
    local only=" $* "
    export PYTHONPATH="$site:$repo/core/src:$repo/services/generator/src:$repo/services/reward/src:$repo/services/reference/src:$repo/services/trainer/src${PYTHONPATH:+:$PYTHONPATH}"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network: fail rather than try
    export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_STREAM=ext://sys.stderr PYTHONUNBUFFERED=1
    local ran=() failed=()
    [ "$dry_run" = 1 ] || mkdir -p "$outdir" || exit 1

    step() {  # step NAME OUTFILE LOGFILE CMD...
        local name=$1 out=$2 log=$3
        shift 3
        if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then
            return
        fi
        if [ "$dry_run" = 1 ]; then
            echo "$name: timeout $step_timeout $* > $out 2> $log"
            return
        fi
        echo "== $name: $*" >&2
        local start=$SECONDS rc=0
        timeout "$step_timeout" "$@" > "$out" 2> "$log" || rc=$?
        echo "== $name: exit $rc after $((SECONDS - start)) s" >&2
        if [ "$rc" = 0 ]; then ran+=("$name ($((SECONDS - start)) s)"); else failed+=("$name (exit $rc, see $(basename "$log"))"); fi
    }

    if [ "$dry_run" = 1 ]; then
        echo "setup: install the wheelhouse from $stash_dir into $site (unless vllm 0.26.0 imports), then import vllm > $outdir/setup.log"
    else
        {
            install && "$py" -c 'import torch, vllm, transformers; from vllm import LLM; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE"); print("vllm", vllm.__version__, "transformers", transformers.__version__)'
        } > "$outdir/setup.log" 2>&1
        local rc=$?
        if [ "$rc" != 0 ]; then
            failed+=("setup (exit $rc, see setup.log)")
        else
            ran+=("setup")
        fi
    fi

    step vllm_cuda "$outdir/vllm_cuda.log" "$outdir/vllm_cuda.stderr" \
        "$py" -m pytest -m vllm_cuda "$repo/tests/vllm_cuda" -v -s -p no:cacheprovider --junitxml "$outdir/vllm_cuda.xml"
    step sync_latency_0.5b "$outdir/sync_latency_0.5b.json" "$outdir/sync_latency_0.5b.log" \
        "$py" "$repo/benchmarks/weight_sync_latency.py" --backend vllm --device cuda --shape 0.5b --enforce-eager --pushes 6
    step generate_0.5b "$outdir/generate_0.5b.json" "$outdir/generate_0.5b.log" \
        "$py" "$repo/benchmarks/vllm_generate_overhead.py" --shape 0.5b --device cuda --groups 32 --group-size 8 --max-new-tokens 256 --rounds 3

    if [ "$dry_run" = 1 ]; then
        echo "dry run: nothing installed or run"
        return 0
    fi
    # pytest's stderr is small: fold it into its log so the files stay at 8.
    if [ -f "$outdir/vllm_cuda.stderr" ]; then
        cat "$outdir/vllm_cuda.stderr" >> "$outdir/vllm_cuda.log" && rm -f "$outdir/vllm_cuda.stderr"
    fi
    {
        echo "ran (${#ran[@]}): ${ran[*]:-none}"
        echo "failed (${#failed[@]}): ${failed[*]:-none}"
        tail -n 2 "$outdir/setup.log" 2>/dev/null
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    } | tee "$outdir/summary.txt"
    [ ${#failed[@]} = 0 ]
}

case "${1:-}" in
    stash) [ $# = 2 ] || usage; stash "$2" ;;
    run) shift; run "$@" ;;
    *) usage ;;
esac
