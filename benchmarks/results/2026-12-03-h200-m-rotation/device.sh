#!/usr/bin/env bash
# One device call of the 2026-12-03 (m) runs; everything goes into $OUT/x.tgz (the device
# returns few files). Parts: "probe" (BGRADB), "check" (scripts/gpu_check.sh without its
# training tables: tests, examples, forward tables), "suite" (rotated rounds, chains also
# with x donated), "training" (benchmarks.training: fwd+bwd, MLP and example tables),
# "tuning" (the algorithm choice at 8192x4096->1024, split-K reductions allowed or not).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv -lms 1000 > $W/smi.csv &
smi=$!
step() { local t=$1; shift; echo "== $(date +%T) $*" >&2; timeout "$t" "$@"; echo "   rc=$? $(date +%T)" >&2; }
for part in "$@"; do
  case $part in
    probe) step 60 python3 -m benchmarks.probes.bgradb --out $W/bgradb > $W/bgradb.log 2>&1 ;;
    check)  # tests, examples, forward tables (the training tables: part "training")
      mkdir -p $W/check; SKIP_TRAINING=1 OUT=$W/check step 290 bash scripts/gpu_check.sh > $W/check/check.log 2>&1 ;;
    suite)
      mkdir -p $W/suite; step 190 python3 -m benchmarks.run --quick --out $W/suite > $W/suite/suite.log 2>&1 ;;
    training)
      mkdir -p $W/training; step 400 python3 -m benchmarks.training --out $W/training > $W/training/training.log 2>&1 ;;
    tuning)  # 8192x4096->1024: the tuner's choice, then with every split-K reduction scheme allowed
      t0=$SECONDS  # at most ~3.5 minutes of processes, one line each
      for args in "" "--any-reduction" "0 --any-reduction" "1 --any-reduction" "2 --any-reduction"; do
        for act in gelu relu; do
          [ $((SECONDS - t0)) -lt ${TUNING_S:-200} ] || break 2
          step 40 python3 -m benchmarks.probes.forced_algorithm $args --shape 8192 4096 1024 --activation $act
        done
      done > $W/forced.txt 2> $W/forced.log ;;
  esac
done
kill $smi
tar czf $OUT/x.tgz -C $W .
[ -f $W/forced.txt ] && cut -c1-400 $W/forced.txt && tail -n 5 $W/forced.log
[ -f $W/bgradb.log ] && tail -n 6 $W/bgradb.log | cut -c1-230
[ -d $W/suite ] && grep -A8 "bfloat16 (bfloat16 bias), fwd" $W/suite/*.md | grep 8192 | cut -c1-220
[ -f $W/training/training.md ] && cat $W/training/training.md | cut -c1-200
[ -d $W/check ] && tail -n 45 $W/check/check.log | cut -c1-230
exit 0
