#!/usr/bin/env bash
# The checks only a CUDA GPU can run, in one go (docs/gpu.md has the figures):
#   1. the equivalence tests of the attention dispatch and the fused kernel on CUDA
#      (tests/test_attention.py, tests/test_kernels.py: every CUDA case against float64), and
#      EMA + checkpoint resume on CUDA (tests/test_cuda_resume.py), and evaluation and the
#      inference commands with the model on CUDA against the CPU (tests/test_cuda_inference.py);
#   2. the blockwise methods' fused kernel against SDPA and the blockwise kernel at L 16384,
#      and in half precision each of its CUDA kernels (cuDNN's, opt-in; FlashAttention-2; the
#      memory-efficient one), a row saying why where the GPU refuses one
#      (scripts/bench_kernel_device.py);
#   3. `dspzoo bench` at SP 1 on the GPU (scripts/benchmark.py in one process): absolute step
#      times of the video and the text benchmark models, and the video model under bf16 and
#      fp16 autocast (--mixed-precision; fp16 runs only on a GPU);
#   4. one af2-width Evoformer block forward at R = 4096 (chunked, SP 1): its peak memory beside
#      scripts/protein_memory.py's model;
#   5. sync_free: a stdit-mini training step (forward, loss, backward) at SP 1 under
#      torch.cuda.set_sync_debug_mode("error") after a warm-up step: no host synchronisation
#      anywhere in it, else the op that synchronised (scripts/check_sync_free.py).
#
#   bash scripts/gpu_checks.sh [OUTDIR]      # default: $OUT, else outputs/gpu
#   GPU_CHECKS_STEPS=tests,kernels_bfloat16 bash scripts/gpu_checks.sh   # only these steps
#
# Steps: env, tests, bench_video, bench_text, bench_video_bf16, bench_video_fp16,
# kernels_float32, kernels_bfloat16, kernels_float16, protein, sync_free.
#
# Runs ${PYTHON:-python3}: the first python3 on PATH (an activated .venv's, else the machine's),
# which needs a CUDA build of torch, pytest, accelerate and einops; without a CUDA device it
# stops at once with one line (status 2). The repository is put on PYTHONPATH as the package
# `dspzoo`. Each step has its own time limit, all of them share one budget (GPU_CHECKS_BUDGET_S,
# default 780 s: a 15-minute device lease less the machine's start; a step is cut to what is
# left, and skipped, as failed, when under 20 s is), and a failing step does not stop the others;
# the exit status is the number of failed or skipped steps. OUTDIR receives gpu_checks.log (every step's
# output), junit.xml, bench_video.json, bench_text.json, bench_video_bf16.json,
# bench_video_fp16.json and protein_r4096.json.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$root/outputs/gpu}}
mkdir -p "$out"
log="$out/gpu_checks.log"
: >"$log"
link=$(mktemp -d)
trap 'rm -rf "$link"' EXIT
ln -s "$root" "$link/dspzoo"
export PYTHONPATH="$link${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$root" || exit 1
py=${PYTHON:-python3}
failed=0

budget_end=$((SECONDS + ${GPU_CHECKS_BUDGET_S:-780}))

# the steps asked for (GPU_CHECKS_STEPS: names separated by commas or spaces; unset: all). A
# misspelt or empty list would make every step return early and the run look green: refuse it
STEPS="env tests bench_video bench_text bench_video_bf16 bench_video_fp16 kernels_float32 kernels_bfloat16 kernels_float16 protein sync_free"
wanted=" $STEPS "
if [ -n "${GPU_CHECKS_STEPS+set}" ]; then
    read -ra asked <<<"${GPU_CHECKS_STEPS//,/ }"
    if [ "${#asked[@]}" -eq 0 ]; then
        echo "gpu_checks.sh: GPU_CHECKS_STEPS is set but names no step; the steps: $STEPS" >&2
        exit 2
    fi
    for name in "${asked[@]}"; do
        if [[ " $STEPS " != *" $name "* ]]; then
            echo "gpu_checks.sh: GPU_CHECKS_STEPS names '$name', which is no step; the steps: $STEPS" >&2
            exit 2
        fi
    done
    wanted=" ${asked[*]} "
fi

# step NAME LIMIT_S COMMAND...: run it within the budget, log everything, print its time
step() {
    local name=$1 limit=$2
    shift 2
    [[ "$wanted" == *" $name "* ]] || return  # not among the steps asked for
    local left=$((budget_end - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left} s of the budget left" | tee -a "$log"
        failed=$((failed + 1))
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    local start=$SECONDS
    echo "== $name: $*" | tee -a "$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $((SECONDS - start)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

# without a GPU every CUDA case below would be skipped and the run would look green: stop here
if ! "$py" -c 'import torch, pytest, accelerate, einops' >>"$log" 2>&1; then
    echo "gpu_checks.sh: $py lacks torch, pytest, accelerate or einops (see $log);" \
        "point PYTHON= at a python that has them (the GPU machine's own, or an activated .venv)" >&2
    exit 2
fi
if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    version=$("$py" -c 'import torch; print(torch.__version__)')
    echo "gpu_checks.sh: $py (torch $version) sees no CUDA device; nothing run. These checks" \
        "need a GPU and a CUDA build of torch: run them there, or point PYTHON= at such a" \
        "python" | tee -a "$log" >&2
    exit 2
fi

step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
    $py -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0)); \
import importlib.util as u; print(\"flash_attn importable:\", u.find_spec(\"flash_attn\") is not None)'"

step tests 300 "$py" -m pytest -q -p no:cacheprovider -rs --junitxml="$out/junit.xml" \
    tests/test_attention.py tests/test_kernels.py tests/test_cuda_resume.py \
    tests/test_cuda_inference.py

for spec in "video --model stdit-mini" "text --model bytelm-small --seq-len 2048"; do
    name=${spec%% *}
    step "bench_$name" 150 "$py" scripts/benchmark.py ${spec#* } --peer off --no-progress \
        --reps 10 --warmup 3 --cluster h100-nvlink-ib --out "$link/bench_$name"
    cp "$link/bench_$name/results.json" "$out/bench_$name.json" 2>/dev/null
    tail -n 25 "$link/bench_$name/results.md" 2>/dev/null
done

for precision in bf16 fp16; do
    step "bench_video_$precision" 90 "$py" scripts/benchmark.py --model stdit-mini --peer off \
        --no-progress --reps 5 --warmup 2 --cluster h100-nvlink-ib --mixed-precision "$precision" \
        --out "$link/bench_video_$precision"
    cp "$link/bench_video_$precision/results.json" "$out/bench_video_$precision.json" 2>/dev/null
done

for dtype in float32 bfloat16 float16; do
    kernels=sdpa,fused,blockwise
    [ "$dtype" = float32 ] || kernels=sdpa,fused,fused-cudnn,fused-flash,fused-efficient,blockwise
    step "kernels_$dtype" 120 "$py" scripts/bench_kernel_device.py --device cuda --seq-len 16384 \
        --dtype "$dtype" --reps 5 --kernels "$kernels" --no-progress
done

step protein 180 "$py" scripts/protein_memory.py --one-block 4096 --device cuda --msa-depth 8 \
    --chunk-size 8 --channel-chunk 8 --json "$out/protein_r4096.json"
tail -n 20 "$log" | grep -E "^\|"

step sync_free 90 "$py" scripts/check_sync_free.py --frames 4 --latent 16 --batch 2
grep "^check_sync_free.py:" "$log" | tail -n 1

grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$log" | tail -n 20
echo "== $failed step(s) failed; log: $log" | tee -a "$log"
exit "$failed"
