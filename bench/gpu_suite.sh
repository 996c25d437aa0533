#!/usr/bin/env bash
# One device call: GPU correctness tests, then the kernel and runtime benchmarks.
# Usage (on a CUDA machine, repository root): bash bench/gpu_suite.sh OUTDIR [STAGES...]
# Stages: tests kernels runtime verifier drafter (default: all); `kernels` is `ssm attn_conv linear`.
# Logs and JSON land in OUTDIR.
set -uo pipefail
out=${1:?output directory}; shift
stages=${*:-tests kernels runtime verifier drafter}
stages=${stages//kernels/ssm attn_conv linear}
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton, transformers, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__)" | tee -a "$out/device.txt"
for stage in $stages; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    tests) python3 -m pytest -q -p no:cacheprovider -k "not compile" tests/gpu tests/drafter/test_cuda.py 2>&1 \
             | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -40 ;;
    ssm) python3 -m bench.ssm_kernels --out "$out/ssm_kernels.json" 2>&1 | tee "$out/ssm_kernels.log" | tail -60 ;;
    linear)
      python3 -m bench.few_rows_linear --out "$out/few_rows_linear.json" 2>&1 | tee "$out/few_rows_linear.log" | tail -20
      python3 -m bench.few_rows_linear --in-graph --out "$out/few_rows_in_graph.json" 2>&1 | tee "$out/few_rows_in_graph.log" | tail -9
      python3 -m bench.few_rows_linear --in-graph --rows 16,64 --out "$out/few_rows_in_graph_dot.json" 2>&1 \
        | tee "$out/few_rows_in_graph_dot.log" | grep -v "^  " | tail -12 ;;
    attn_conv) python3 -m bench.attn_conv_kernels --out "$out/attn_conv_kernels.json" 2>&1 | tee "$out/attn_conv_kernels.log" | tail -30 ;;
    runtime)  # then the same without programmatic dependent launch: the A/B and honest kernel times
      for shape in mamba2-2.7b hybrid-8b; do
        python3 -m bench.model_runtime --shape $shape --out "$out/runtime_$shape.json" 2>&1 | tee "$out/runtime_$shape.log" | tail -25
        TREESERVE_PDL=0 python3 -m bench.model_runtime --shape $shape --hf-tokens 0 --sizes 16,64 \
          --out "$out/runtime_${shape}_no_pdl.json" 2>&1 | tee "$out/runtime_${shape}_no_pdl.log" | tail -45
      done ;;
    verifier)  # as shipped, then with every core kept out of idle states
      python3 -m bench.verifier_service --shape mamba2-2.7b --out "$out/verifier.json" 2>&1 | tee "$out/verifier.log" | tail -20
      python3 -m bench.verifier_service --shape mamba2-2.7b --modes stream --server-args "--keep-cores-awake all" \
        --out "$out/verifier_awake.json" 2>&1 | tee "$out/verifier_awake.log" | tail -12 ;;
    drafter)
      for graphs in cuda-graphs no-cuda-graphs; do
        python3 -m bench.drafter --model models/demo/drafter --target models/demo/target --device cuda --$graphs \
          --out "$out/drafter_$graphs.json" 2>&1 | tee "$out/drafter_$graphs.log" | tail -20
      done ;;
  esac
done
