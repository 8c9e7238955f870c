#!/usr/bin/env bash
# Nsight Compute profiles of lab 04's attention at B=4 H=32 N=4096 D=128 bf16 (issue 19: where the time goes).
#   bash bench/lab04_hopper_profile.sh [VARIANT ...]     # names from bench/lab04_hopper_tuning.py's VARIANTS, or cudnn
# One text report per variant and mask in $OUT (or ./build/profile): speed of light, pipe utilization, warp stalls,
# occupancy, registers. The clocks are left alone (--clock-control none), as the device notes ask.
set -u
out=${OUT:-build/profile}
mkdir -p "$out"
[ $# -gt 0 ] || set -- "base 128x128 s2" cudnn
for variant in "$@"; do
  for mask in full causal; do
    flag=$([ $mask = causal ] && echo --causal || true)
    if [ "$variant" = cudnn ]; then filter='regex:sdpa|fmha|flash|attn'; else filter='regex:attention_variant'; fi
    name=$(echo "ncu $variant $mask" | tr -c 'A-Za-z0-9\n' _)
    timeout 240 ncu --clock-control none -k "$filter" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats --section InstructionStats --print-details all \
      python3 bench/lab04_hopper_tuning.py --one "$variant" $flag > "$out/$name.txt" 2>&1
    echo "$variant $mask: exit $? -> $out/$name.txt"
  done
done
