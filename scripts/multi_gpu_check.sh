#!/usr/bin/env bash
# Several GPUs, in one call on a machine with two or more NVIDIA GPUs. Writes to $OUT:
#   multi_device.{json,md}, multi_device.log   every split x layer x axis type against one
#       device, the collectives of ours and of XLA's layer (benchmarks/multi_device.py)
#   train-1.txt, train-N.txt   the transformer-MLP example with --fp8 (nn.Dense, FusedMLP,
#       its FP8 and Flax's FP8, trained in turn) on one GPU and data parallel on N GPUs,
#       the same batch per GPU: per-GPU throughput against one GPU's, ours against nn.Dense
# Knobs: OUT (default /tmp/jax_epilog_multi_gpu), DEVICES (default: every GPU), SIZE
# (default large), ROWS (multi_device's M, default 4096), SKIP_TRAINING=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_epilog_multi_gpu}
mkdir -p "$OUT"
status=0
n=${DEVICES:-$(python3 -c "import jax; print(jax.device_count())")}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sort | uniq -c

python3 -m benchmarks.multi_device --devices "$n" --rows "${ROWS:-4096}" --out "$OUT" \
  >"$OUT/multi_device.log" 2>&1 || status=1
grep -E "FAILED|ERROR" "$OUT/multi_device.log" | head -20
grep -cE "\| ok" "$OUT/multi_device.md" | sed 's/$/ cases ok/'

if [ "${SKIP_TRAINING:-0}" != 1 ]; then
  for d in 1 "$n"; do
    python3 examples/train_transformer_mlp.py --size "${SIZE:-large}" --fp8 --plot "" --devices "$d" 2>&1 \
      | grep -v "training in turn" >"$OUT/train-$d.txt" || status=1
    tail -n 9 "$OUT/train-$d.txt"
  done
  python3 - "$OUT/train-1.txt" "$OUT/train-$n.txt" "$n" <<'PY'
import re, sys
def rates(path):
    rows = {}
    for line in open(path):
        m = re.match(r"(nn\.Dense|FusedMLP FP8|FusedMLP|Flax FP8)\s.* ms\s+([\d,]+)", line)  # tokens/s
        if m:
            rows[m[1]] = float(m[2].replace(",", ""))
    return rows
one, many, n = rates(sys.argv[1]), rates(sys.argv[2]), int(sys.argv[3])
print(f"{'layer':<14}{'tokens/s/GPU on 1':>20}{f'on {n}':>12}{'ratio':>8}{'over nn.Dense':>15}")
for name in one:
    per = many[name] / n
    print(f"{name:<14}{one[name]:>20,.0f}{per:>12,.0f}{per / one[name]:>8.2f}{many[name] / many['nn.Dense']:>15.2f}")
PY
fi
exit $status
