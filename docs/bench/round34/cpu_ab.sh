#!/usr/bin/env bash
# bench e2e on the CPU (demo pair): this tree against 76abc44, alternated. Run from the repository root
# with BASE=a checkout of 76abc44 (git worktree add /tmp/base 76abc44).
set -u
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=1
new=$PWD; base="$BASE"  # a checkout of 76abc44
for run in 1 2; do
  for which in new base; do
    dir=${!which}
    (cd $dir && PYTHONPATH=$dir timeout 900 $new/.venv/bin/python -m treeserve.cli bench e2e --device cpu --prompts 2 \
      --max-new-tokens 64 --paths grpc --methods dynamic-16 ngram-16 "server default" --temperatures 0 1 \
      --target $new/models/demo/target --drafter $new/models/demo/drafter --out /tmp/cpu_${which}_$run > /tmp/cpu_${which}_$run.log 2>&1;
     echo "$which $run rc=$?")
    grep -A12 "^method" /tmp/cpu_${which}_$run.log | sed "s/^/$which$run /"
  done
done
