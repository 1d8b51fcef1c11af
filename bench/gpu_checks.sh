#!/usr/bin/env bash
# Every check that needs a GPU, in one run on one GPU machine, results under $OUT (default
# ./out). Each step has its own time limit and the script goes on after a failure; the exit
# code is the number of steps that failed.
#
#   bash bench/gpu_checks.sh [graphs] [attention] [tests] [nixl]   # default: all but nixl
#
#   graphs     bench/cuda_graph_checks.py --models tiny: capture, replay = eager, step time
#   attention  bench/bench_paged_attention.py: the Triton decode kernel against copy bandwidth
#              and a torch baseline, native bf16, a cache past 2^31 elements
#   tests      the GPU-marked tests, the kernel tests natively (TRITON_INTERPRET=0), the Triton and token-exact
#              end-to-end tests (gRPC transport) with the workers on the GPU
#   tune       the kernel's configs and split counts, and small shapes inside CUDA graphs
#   nixl       bench/nixl_vram_checks.py: NIXL READs between two processes' pools in VRAM
#   roofline   bench/gpu_roofline.py: 8B-shaped models' decode step (CUDA graphs) and prefill
#              against the copy bandwidth and GEMM rate measured in the same run; int8/fp8 pages
#   onelaunch  bench/bench_paged_attention.py --sections onelaunch splits: the split-K/V kernel
#              in one launch against two, and the split count per K/V-head count
#   tp         bench/gpu_tensor_parallel.py: tensor-parallel ranks on their own GPUs (NCCL),
#              prefill and decode split (1,2), (2,1), (2,2) at the model level and as workers,
#              token-exact (needs 2 GPUs)
#   deploy     a Llama-3.1-8B-shaped disaggregated deployment (random weights, one prefill and
#              one decode worker sharing the GPU) under `kvferry bench` at a few request rates
#
# Python packages the machine lacks can be carried as wheels in .whl/ (and NIXL's in
# .whl-nixl/); they are installed under /tmp/site first (not with NO_WHEELS=1).
set -u
OUT=$(mkdir -p "${OUT:-out}" && cd "${OUT:-out}" && pwd)

export OUT PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
for dir in .whl .whl-nixl; do
  if [ "${NO_WHEELS:-0}" != 1 ] && compgen -G "$dir/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$dir"/*.whl || exit 100
  fi
done
export PYTHONPATH="/tmp/site:$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(graphs attention tests)
failed=0

run() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $* (limit ${limit} s) ==="
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - start)) s ==="
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1

for step in "${steps[@]}"; do
  case $step in
    graphs) run graphs 100 "$PY" bench/cuda_graph_checks.py --models tiny ;;
    attention) run attention 240 "$PY" bench/bench_paged_attention.py \
      --out "$OUT/paged_attention.json" --time-budget-s 150 --sections results launch ;;
    tune) run tune 200 "$PY" bench/bench_paged_attention.py --sections sweep launch \
      --out "$OUT/paged_attention_tune.json" --time-budget-s 150 ;;
    tests) TRITON_INTERPRET=0 run tests 150 "$PY" -m pytest -p no:cacheprovider -q \
      --timeout 120 --basetemp=/tmp/kvferry-gpu-tests \
      tests/kernels tests/kvferry/model/test_cuda_graphs.py tests/e2e/test_triton_path.py \
      "tests/e2e/test_token_exact.py::test_greedy_matches_transformers[qwen3-grpc]" \
      "tests/e2e/test_token_exact.py::test_greedy_matches_transformers[llama-grpc]" \
      tests/e2e/test_token_exact.py::test_text_prompt_streams_the_decoded_completion
      (cd /tmp/kvferry-gpu-tests && find . -name "*.log" | tar czf "$OUT/test_logs.tgz" -T -) ;;
    nixl) run nixl 150 "$PY" bench/nixl_vram_checks.py --sizes-mib 4 64 256 --reps 5 ;;
    roofline) run roofline 230 "$PY" bench/gpu_roofline.py --out "$OUT/gpu_roofline.json" \
      --time-budget-s 180 ;;
    onelaunch) run onelaunch 140 "$PY" bench/bench_paged_attention.py --sections onelaunch \
      splits --out "$OUT/paged_attention_onelaunch.json" --time-budget-s 100 ;;
    deploy) run deploy 200 bash -c '"$0" -m deploy.cli make-model --shape llama-3.1-8b \
      --out /tmp/llama-3.1-8b && "$0" -m deploy.cli bench --address launch:disagg \
      --model /tmp/llama-3.1-8b --load-format dummy --kv-pool-size 24GiB \
      --dataset-name random --input-len 512 --output-len 128 --num-prompts 48 \
      --request-rate 4 16 64 --disable-tqdm --launch-log-dir /tmp/deploy-logs \
      --result-file "$OUT/deploy_bench.json"; rc=$?
      tar czf "$OUT/deploy_logs.tgz" -C /tmp deploy-logs; exit $rc' "$PY" ;;
    tp) run tp 300 "$PY" bench/gpu_tensor_parallel.py --out "$OUT/tensor_parallel.json" ;;
    *) echo "unknown step $step"; failed=$((failed + 1)) ;;
  esac
done
echo "steps failed: $failed"
exit "$failed"
