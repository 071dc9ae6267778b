"""scratch: which tuned kernel faults on segformer (CUDA)."""
import os, sys, json
import torch
sys.path.insert(0, os.getcwd())
import kiln
from kiln.models import hf_corpus as C
from kiln.targets.cuda import launch_tune as LT
out = os.environ.get("OUT", "/tmp/out")
orig = LT._time_ms
def timed(ck, grid, args, torch_, reps=20):
    f = sys._getframe(1).f_locals
    k, tks, j = f.get("k"), f.get("tks"), f.get("j")
    name = getattr(k, "name", "?")
    try:
        torch.cuda.synchronize()
        ms = orig(ck, grid, args, torch_, reps=1)
        torch.cuda.synchronize()
    except Exception as e:
        src = getattr(tks[j], "source", None) or getattr(tks[j], "text", None) or repr(tks[j])
        open(f"{out}/fault.txt", "w").write(f"{name} cand {j} grid {grid}\nargs {[tuple(a.shape) if hasattr(a,'shape') else a for a in args]}\n{src}\n")
        print("FAULT in", name, j, grid, flush=True)
        raise
    return ms
LT._time_ms = timed
model_type = sys.argv[1] if len(sys.argv) > 1 else "segformer"
kind = C.ARCHS[model_type]
flat, cfg, _ = C.build(model_type, device="cuda", realistic=True)
example = {k: v.cuda() for k, v in C.inputs(kind, cfg, 2, 16).items()}
ep = C.export(flat, kind, example, dynamic=True)
try:
    cm = kiln.compile(ep, device="cuda")
    print("compiled ok")
except Exception as e:
    print("ERR", str(e)[:300])
