python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
for i in 1 2; do timeout 200 python3 .old/relu_y.py $OUT/ry$i > $OUT/ry$i.log 2>&1; done
cd $OUT && tar czf ry.tgz ry1 ry2 && rm -rf ry1 ry2
python3 - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/ry*.log")):
    for l in open(f):
        if l.startswith("{"):
            r=json.loads(l); print(os.path.basename(f), r["shape"], r["loss"], " ".join(f"{c}={r[c+'_us']:.1f}({r['xla/'+c]:.3f})" for c in ("xla","lib_cublaslt","mask","y")), {k: round(v,4) for k,v in r["rel_err"].items()})
P
