#!/usr/bin/env bash
# The medium model pair on a lent GPU: train it in the background, wait for it, benchmark it end to end.
# A trained pair (~270 MB) is too big to bring back, so all three steps run on one machine, one after
# the other, while it stays warm (the training survives between calls because it runs in its own
# process session).
#
#   bash bench/gpu_pair.sh train MINUTES      # start make_pair --preset medium in the background; returns at once
#   bash bench/gpu_pair.sh wait [SECONDS]     # until training ends (or SECONDS pass); prints progress
#   bash bench/gpu_pair.sh e2e OUTDIR [ARGS]  # treeserve bench e2e on the trained pair (ARGS go to it)
#
# The pair lives in $PAIR_DIR (default /tmp/treeserve-medium); its log in $PAIR_DIR.log.
set -uo pipefail
cmd=${1:?train, wait or e2e}; shift
pair=${PAIR_DIR:-/tmp/treeserve-medium}
source "$(dirname "$0")/gpu_env.sh"

running() { pgrep -f "models.training.make_pair --preset medium" >/dev/null; }

case $cmd in
  train)
    minutes=${1:?minutes}
    if running; then echo "already training"; exit 0; fi
    mkdir -p "$pair"
    setsid nohup python3 -m models.training.make_pair --preset medium --out "$pair" --minutes "$minutes" \
      --device cuda >"$pair.log" 2>&1 < /dev/null &
    sleep 2; echo "training started (pid $!), log $pair.log"; tail -3 "$pair.log" ;;
  wait)
    limit=${1:-570}; t0=$SECONDS
    while running && [ $((SECONDS - t0)) -lt "$limit" ]; do
      sleep 20; grep -E "step|valid|pair:" "$pair.log" | tail -2
    done
    running && echo "still training" || { echo "training done"; tail -8 "$pair.log"; cat "$pair/summary.json" 2>/dev/null; } ;;
  e2e)
    out=${1:?output directory}; shift
    [ -f "$pair/summary.json" ] || { echo "no trained pair in $pair"; exit 1; }
    mkdir -p "$out"; cp "$pair/summary.json" "$out/pair_summary.json"
    cp "$pair/target/card.md" "$out/target_card.md" 2>/dev/null; cp "$pair/drafter/card.md" "$out/drafter_card.md" 2>/dev/null
    python3 -m treeserve.cli bench e2e --device cuda --target "$pair/target" --drafter "$pair/drafter" \
      --out "$out" "$@" 2>&1 | tee "$out/e2e.log" ;;
  *) echo "unknown command $cmd"; exit 2 ;;
esac
