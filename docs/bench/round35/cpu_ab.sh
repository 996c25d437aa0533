#!/usr/bin/env bash
# bench e2e on the CPU (demo pair): this tree against BASE (a checkout of the code before the
# per-tree shape choice), alternated. Run from the repository root:
#   git worktree add /tmp/base 0330fb3 && BASE=/tmp/base bash docs/bench/round35/cpu_ab.sh
set -u
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=1
new=$PWD; base="$BASE"
out=${OUT:-/tmp/cpu_ab}
mkdir -p $out
for run in 1 2 3; do
  for which in new base; do
    dir=${!which}
    (cd $dir && PYTHONPATH=$dir timeout 900 $new/.venv/bin/python -m treeserve.cli bench e2e --device cpu --prompts 4 \
      --max-new-tokens 128 --paths grpc --methods dynamic-16 ngram-16 "server default" --temperatures 0 1 \
      --target $new/models/demo/target --drafter $new/models/demo/drafter --out $out/${which}_$run > $out/${which}_$run.log 2>&1;
     echo "$which $run rc=$?")
    grep -A12 "^method" $out/${which}_$run.log | sed "s/^/$which$run /"
  done
done
