import collections, importlib.util, re, sys
from pathlib import Path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
spec = importlib.util.spec_from_file_location("train_transformer_mlp", "examples/train_transformer_mlp.py")
ex = importlib.util.module_from_spec(spec); sys.modules[spec.name] = ex; spec.loader.exec_module(ex)
args = ex.parse_args(["--size", "large"])
for key in ex.LAYERS:
    step, params, opt, batch = ex.setup(args, key)
    txt = step.lower(params, opt, *batch(0)).compile().as_text()
    (out / f"{key}.hlo.txt").write_text(txt)
    entry = txt[txt.index("ENTRY"):]
    ops = collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", entry))
    calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', txt))
    print(key, dict(sorted(ops.items())), dict(calls))
