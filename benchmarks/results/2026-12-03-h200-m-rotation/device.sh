#!/usr/bin/env bash
# One device call of the 2026-12-03 (m) runs; everything goes into $OUT/x.tgz (the device
# returns few files). Parts: "check": the BGRADB probe, then the whole GPU check at this
# commit (tests, examples, forward and training tables); "suite": the suite (rotated rounds,
# chains also with x donated).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv -lms 1000 > $W/smi.csv &
smi=$!
step() { local t=$1; shift; echo "== $(date +%T) $*" >&2; timeout "$t" "$@"; echo "   rc=$? $(date +%T)" >&2; }
git log -1 --format='%h %s' > $W/commit.txt
for part in "$@"; do
  case $part in
    check)
      step 70 python3 -m benchmarks.probes.bgradb --out $W/bgradb > $W/bgradb.log 2>&1
      mkdir -p $W/check; OUT=$W/check step 470 bash scripts/gpu_check.sh > $W/check/check.log 2>&1 ;;
    suite)
      mkdir -p $W/suite; step 200 python3 -m benchmarks.run --quick --out $W/suite > $W/suite/suite.log 2>&1 ;;
  esac
done
kill $smi
tar czf $OUT/x.tgz -C $W .
[ -f $W/bgradb.log ] && tail -n 6 $W/bgradb.log | cut -c1-230
[ -d $W/suite ] && grep -A8 "bfloat16 (bfloat16 bias), fwd" $W/suite/*.md | grep 8192 | cut -c1-220
[ -d $W/check ] && tail -n 45 $W/check/check.log | cut -c1-230
exit 0
