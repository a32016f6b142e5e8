#!/usr/bin/env bash
# One lease on the lent GPU: install the carried wheels, run the GPU tests, then the benchmarks
# named in $STAGES (default: tests decode serve). Logs and JSON go to $OUT (default .bench/gpu).
#   OUT=/tmp/out STAGES="tests decode" bash benchmarks/gpu_session.sh
# FUSION_ARGS=--quick narrows the fusion-* sweeps' config grid; HF_ARGS=--no-hf-eager runs the
# hf-full-* stages' transformers with static cache + compile alone.
set -uo pipefail
OUT=${OUT:-.bench/gpu}
STAGES=${STAGES:-tests decode serve}
mkdir -p "$OUT" /tmp/base
for w in .whl/*.whl; do pip install -q --no-index --no-deps --target /tmp/base "$w" 2>/dev/null; done
export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD/scripts:/tmp/base
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/device.txt"
MODEL8=/tmp/noesis-bench/llama-8b
make_8b() {
  [ -f "$MODEL8/config.json" ] || python -c "
from pathlib import Path
from make_random_checkpoint import make_checkpoint
make_checkpoint(Path('$MODEL8'), 'llama-8b', 'bfloat16', 8192, 0, False, 'cuda')"
}
MODEL1=/tmp/noesis-bench/llama-1b
make_1b() {
  [ -f "$MODEL1/config.json" ] || python -c "
from pathlib import Path
from make_random_checkpoint import make_checkpoint
make_checkpoint(Path('$MODEL1'), 'llama-1b', 'bfloat16', 8192, 0, True, 'cuda')"
}
graph_ab() {  # $1: what to compare, then graph_ab.py options; both shapes, buckets up to 8
  make_8b; make_1b
  for model in $MODEL8 $MODEL1; do
    python benchmarks/graph_ab.py --model $model --what "$@" --max-batch 8 2>&1 | tail -6 \
      | tee -a "$OUT/$1_ab.txt"
  done
}
for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) python -m pytest -m gpu tests/gpu -q -x 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt" ;;
    telemetry) make_8b  # noesis bench on the 8B shape: latency, throughput, telemetry overhead
      python -m noesis.cli bench --model $MODEL8 --device cuda --dtype bfloat16 \
        --max-model-len 4096 --batches 1,64 --overhead 1,64 --overhead-steps 128 \
        --json "$OUT/bench_8b.json" 2>&1 | tail -12 | tee "$OUT/bench_8b.txt" ;;
    decode) python benchmarks/gpu_decode.py --shapes llama-8b --no-hf --batches 8,32,64,128 \
              --json "$OUT/decode_8b.json" 2>&1 | tail -9 | tee "$OUT/decode_8b.txt" ;;
    decode-lt) python benchmarks/gpu_decode.py --shapes llama-8b --no-hf --batches 64 \
              --blas cublaslt --json "$OUT/decode_8b_lt.json" 2>&1 | tail -9 \
              | tee "$OUT/decode_8b_lt.txt" ;;
    tune) python benchmarks/tune_paged_decode.py --json "$OUT/tune.json" 2>&1 | grep -v skip \
              | tee "$OUT/tune.txt" ;;
    timeline) make_8b; python benchmarks/step_timeline.py --model $MODEL8 --batches 1,64,128 \
              2>&1 | tail -8 | tee "$OUT/timeline.txt" ;;
    b1) python benchmarks/gpu_decode.py --shapes llama-1b,llama-8b --no-hf --batches "" \
              --json "$OUT/decode_b1.json" 2>&1 | tail -9 | tee "$OUT/decode_b1.txt" ;;
    decode-1b) python benchmarks/gpu_decode.py --shapes llama-1b --no-hf --batches 8,32,64,128 \
              --json "$OUT/decode_1b.json" 2>&1 | tail -9 | tee "$OUT/decode_1b.txt" ;;
    hf-1b) python benchmarks/gpu_decode.py --shapes llama-1b --batches 1,64 \
              --hf-compile llama-1b --json "$OUT/decode_1b.json" 2>&1 | tail -14 \
              | tee "$OUT/decode_1b.txt" ;;
    serve) make_8b
      for mode in "" "--no-overlap" ""; do
        python benchmarks/serve.py --model $MODEL8 --device cuda --concurrency 128 \
          --prompt-len 512 --output-len 256 --requests 2 --max-seconds 40 --engine-only $mode \
          --out "$OUT/serve_engine${mode}.json" 2>&1 | tail -2 | tee -a "$OUT/serve.txt"
      done
      python benchmarks/serve.py --model $MODEL8 --device cuda --concurrency 128 \
        --prompt-len 512 --output-len 256 --requests 2 --max-seconds 40 \
        --out "$OUT/serve_http.json" 2>&1 | tail -2 | tee -a "$OUT/serve.txt" ;;
    sweep) make_8b; python benchmarks/serve.py --model $MODEL8 --device cuda \
              --concurrency 1,8,32,64,128 --prompt-len 512 --output-len 256 --requests 2 \
              --max-seconds 40 --chat-turns 20 --out "$OUT/serve_sweep.json" 2>&1 | tail -12 \
              | tee "$OUT/sweep.txt" ;;
    profile) make_8b; python benchmarks/profile_decode.py --shape llama-8b 2>&1 | tail -45 \
              | tee "$OUT/profile.txt" ;;
    profile-1b) python benchmarks/profile_decode.py --shape llama-1b 2>&1 | tail -45 \
              | tee "$OUT/profile_1b.txt" ;;
    blas) make_8b; python benchmarks/graph_ab.py --model $MODEL8 --what blas 2>&1 | tail -6 \
              | tee "$OUT/blas.txt" ;;
    gemv-ab) graph_ab gemv ;;
    fusion-8b|fusion-1b)  # the one-row kernels' config sweep, one shape per stage
      shape=llama-${stage#fusion-}
      python benchmarks/gemv_fused.py --shapes $shape ${FUSION_ARGS:-} --json "$OUT/fusion_$shape.json" \
        --save-configs "$OUT/row_gemv_configs.json" 2>&1 \
        | grep -v "wrong\|skipped" | tail -7 | tee -a "$OUT/fusion.txt" ;;
    fusion-ab|pdl-ab)  # TUNED: the sweeps' JSON files, comma-separated, from another call
      graph_ab ${stage%-ab} --tuned "${TUNED:-$OUT/fusion_llama-8b.json,$OUT/fusion_llama-1b.json}" ;;
    hf-full-1b|hf-full-8b-a|hf-full-8b-b)
      # transformers eager and static+compile at batch 1 (TTFT 128/2048 included) and at batch
      # 8-128, beside noesis at batch 1 (its batch figures come from `decode`). Each shape and
      # batch compiles twice (1 and 256 new tokens), 20-30 s each: one 600 s call holds the 1B
      # shape, the 8B one takes two.
      case $stage in
        hf-full-1b) shape=llama-1b; hf_batches=8,32,64,128 ;;
        hf-full-8b-a) shape=llama-8b; hf_batches=8,32 ;;
        hf-full-8b-b) shape=llama-8b; hf_batches=64,128 ;;
      esac
      python benchmarks/gpu_decode.py --shapes $shape --batches "" --hf-compile $shape \
        --hf-batches $hf_batches ${HF_ARGS:-} --json "$OUT/decode_full_$stage.json" \
        > "$OUT/decode_full_$stage.log" 2>&1
      tail -14 "$OUT/decode_full_$stage.log" ;;
    sampling) python benchmarks/sampling.py --json "$OUT/sampling.json" 2>&1 | tail -24 \
              | tee "$OUT/sampling.txt" ;;
    hf-8b) python benchmarks/gpu_decode.py --shapes llama-8b --batches "" \
              --hf-compile llama-8b --json "$OUT/decode_8b_hf.json" 2>&1 | tail -10 \
              | tee "$OUT/decode_8b_hf.txt" ;;
    *) python benchmarks/$stage 2>&1 | tail -30 | tee -a "$OUT/extra.txt" ;;
  esac
done
echo "=== done $(date +%T)"
