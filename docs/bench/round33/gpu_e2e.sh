# usage: bash .scratch/s33/gpu_e2e.sh SHAPE TAG OUTNAME [e2e args...]
shape=$1; tag=$2; name=$3; shift 3
source bench/gpu_env.sh
t=$SECONDS
[ -f /tmp/$tag/model.safetensors ] || python3 -m bench.random_checkpoint --shape $shape --init repeating \
   --tokenizer models/demo/target --device cuda --out /tmp/$tag
echo "== $name: checkpoint $((SECONDS-t)) s"
timeout 300 python3 -m treeserve.cli bench e2e --device cuda --dtype bf16 --target /tmp/$tag \
  --out $OUT/$name "$@" 2>&1 | grep -v "it/s\|prompt/s" | grep -A30 "^method"
rm -f $OUT/$name/*.png $OUT/$name/e2e.md
echo "== $name: total $((SECONDS-t)) s"
