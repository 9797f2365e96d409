#!/usr/bin/env bash
# One device call of the 2026-12-03 (n) runs; everything goes into $OUT/x.tgz (the device
# returns few files). Parts: "dz" (benchmarks.probes.dz_pallas), "kernels" (CUPTI,
# the peers at 8192x4096->1024), "workspace" (the algorithm
# choice at 8192x4096->1024 with 1 GiB of workspace allowed), "check" (scripts/gpu_check.sh
# without its training tables), "suite", "training", "variants" (benchmarks.backward_variants).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv -lms 1000 > $W/smi-$(date +%H%M%S).csv &
smi=$!
step() { local t=$1; shift; echo "== $(date +%T) $*" >&2; timeout "$t" "$@"; echo "   rc=$? $(date +%T)" >&2; }
for part in "$@"; do
  case $part in
    dz) step 240 python3 -m benchmarks.probes.dz_pallas --out $W/dz ${DZ_ARGS:-} > $W/dz.log 2>&1 ;;
    workspace)  # 8192x4096->1024: 64 MiB (jax_epilog's allowance) against 1 GiB, one process each
      for args in "" "--workspace-mib 1024" "--workspace-mib 1024 --any-reduction"; do
        for act in relu gelu; do
          step 40 python3 -m benchmarks.probes.forced_algorithm $args --shape 8192 4096 1024 --activation $act
        done
      done > $W/workspace.txt 2> $W/workspace.log ;;
    kernels)  # CUPTI: the suite's forward calls at 8192x4096->1024, fused and its peers
      step 150 python3 -m benchmarks.probes.kernels $W/kernels --case peer-relu-jax_epilog --case peer-relu-xla \
        --case peer-relu-nvmath --case peer-relu-torch_addmm_act --case peer-gelu-jax_epilog --case peer-gelu-xla \
        --case peer-gelu-nvmath --case peer-gelu-torch_addmm_act > $W/kernels.log 2>&1 ;;
    check)
      mkdir -p $W/check; SKIP_TRAINING=1 OUT=$W/check step 290 bash scripts/gpu_check.sh > $W/check/check.log 2>&1 ;;
    suite)
      mkdir -p $W/suite; step 190 python3 -m benchmarks.run --quick --out $W/suite > $W/suite/suite.log 2>&1 ;;
    training)
      mkdir -p $W/training; step 400 python3 -m benchmarks.training --out $W/training > $W/training/training.log 2>&1 ;;
    variants)
      mkdir -p $W/variants; step 300 python3 -m benchmarks.backward_variants --out $W/variants > $W/variants/variants.log 2>&1 ;;
  esac
done
kill $smi
tar czf $OUT/x.tgz -C $W .
[ -f $W/workspace.txt ] && cut -c1-400 $W/workspace.txt && tail -n 4 $W/workspace.log
[ -f $W/kernels/kernels.json ] && python3 -c "
import json
for r in json.load(open('$W/kernels/kernels.json'))['rows']:
    if 'error' in r: print(r['case'], r['error']); continue
    top = '; '.join(f\"{k['kernel'][:70]} {k['us_per_step']:.1f}\" for k in r['kernels'][:2])
    print(f\"{r['case']:28} wall {r['wall_us']:6.1f} enq {r['enqueue_us']:6.1f} busy {r['busy_us_per_step']:6.1f} span {r['span_us_per_step']:6.1f} | {top}\")
"
[ -f $W/dz.log ] && grep -v "^==" $W/dz.log | cut -c1-200 | tail -n 80
[ -d $W/variants ] && tail -n 30 $W/variants/variants.log | cut -c1-220
[ -d $W/suite ] && grep -A8 "bfloat16 (bfloat16 bias), fwd" $W/suite/*.md | grep 8192 | cut -c1-220
[ -f $W/training/training.md ] && cut -c1-200 $W/training/training.md
[ -d $W/check ] && tail -n 45 $W/check/check.log | cut -c1-230
exit 0
