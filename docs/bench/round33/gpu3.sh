nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
source bench/gpu_env.sh
for mode in direct grpcio; do
  extra=""; [ $mode = grpcio ] && extra="--grpcio-only"
  t=$SECONDS
  timeout 200 python3 -m treeserve.cli bench e2e --device cuda --prompts 4 --max-new-tokens 128 --paths grpc \
    --methods dynamic-16 ngram-16 "server default" --temperatures 0 $extra --out $OUT/demo_$mode 2>&1 \
    | grep -v "it/s\|prompt/s" | grep -B3 -A12 "^method"
  rm -f $OUT/demo_$mode/*.png $OUT/demo_$mode/e2e.md; echo "== demo $mode $((SECONDS-t)) s"
done
bash .scratch/s33/gpu_e2e.sh hybrid-8b h8 h8_fp32 --dtype fp32 --prompts 4 --max-new-tokens 128 --max-depth 15 --paths grpc inproc --methods ngram-16 "server default" --temperatures 0
