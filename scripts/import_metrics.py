"""Import structure and function sizes of a kiln tree, for before/after reports of a
restructuring (docs/architecture.md, Layers): cycles between parts, imports against
kiln/layers.py, kiln imports inside functions, function length percentiles, the largest.

    python scripts/import_metrics.py [TREE]      # default: this checkout

A tree from before the layout of stop 13 (kiln/autotune, kiln/codegen, kiln/pipeline_cuda.py)
is measured with its modules mapped to where they went (MOVES), against this checkout's
kiln/layers.py. tests/ir/test_layers.py enforces the first three figures on this tree."""

import ast
import collections
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
ns: dict = {}
exec((HERE / "kiln" / "layers.py").read_text(), ns)
RANK = {u: i for i, layer in enumerate(ns["LAYERS"]) for u in layer}
#: old file -> new file of the stop-13 layout
MOVES = {
    "kiln/autotune/__init__.py": "kiln/gemm/__init__.py",
    **{
        f"kiln/autotune/{x}.py": f"kiln/gemm/{x}.py"
        for x in ("blaslt cache cpu cutlass cutlass_evt cutlass_link gpu printed problem "
                  "profile select triton_gemm").split()
    },
    "kiln/schedule/gemm_fuse.py": "kiln/gemm/fuse.py",
    "kiln/codegen/cpp_kernel.py": "kiln/targets/cpu/kernel.py",
    "kiln/codegen/cpp_ops.py": "kiln/targets/cpu/ops.py",
    "kiln/codegen/gemm_cpp.py": "kiln/targets/cpu/gemm.py",
    "kiln/codegen/wrapper_cpp.py": "kiln/targets/cpu/wrapper.py",
    "kiln/codegen/wrapper_py.py": "kiln/targets/cpu/wrapper_py.py",
    "kiln/codegen/float8.py": "kiln/targets/float8.py",
    "kiln/codegen/triton_kernel.py": "kiln/targets/cuda/kernel.py",
    "kiln/codegen/triton_ops.py": "kiln/targets/cuda/ops.py",
    "kiln/codegen/triton_attention.py": "kiln/targets/cuda/attention.py",
    "kiln/codegen/triton_gemm_kernel.py": "kiln/targets/cuda/gemm_template.py",
    "kiln/codegen/triton_py.py": "kiln/targets/cuda/wrapper_py.py",
    "kiln/codegen/wrapper_cuda.py": "kiln/targets/cuda/wrapper.py",
    "kiln/codegen/wrapper_cuda_parts.py": "kiln/targets/cuda/wrapper_parts.py",
    "kiln/toolchain/autotune.py": "kiln/targets/cuda/launch_tune.py",
    "kiln/toolchain/user_triton.py": "kiln/targets/cuda/user_triton.py",
    "kiln/pipeline_cuda.py": "kiln/targets/cuda/build.py",
}
MODMAP = {
    a.removesuffix(".py").removesuffix("/__init__").replace("/", "."): b.removesuffix(".py")
    .removesuffix("/__init__")
    .replace("/", ".")
    for a, b in MOVES.items()
}
MODMAP["kiln.schedule.control"] = "kiln.schedule.program"
os.chdir(ROOT)


def modname(p):
    return p.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def new(m):
    for k in sorted(MODMAP, key=len, reverse=True):
        if m == k or m.startswith(k + "."):
            return MODMAP[k] + m[len(k) :]
    return m


def part(m):
    m = new(m)
    ps = m.split(".")
    if len(ps) == 1:
        return "kiln"
    two = ".".join(ps[1:3])
    return two if two in RANK else ps[1]


def exists(m):
    p = m.replace(".", "/")
    return os.path.exists(p + ".py") or os.path.exists(p + "/__init__.py")


bad = 0
fn = 0
edges = collections.defaultdict(set)
lens = []
big = []
for d, _, fs in os.walk("kiln"):
    for f in fs:
        if not f.endswith(".py"):
            continue
        p = os.path.join(d, f)
        m = modname(p)
        tree = ast.parse(open(p).read())
        pkg = m if f == "__init__.py" else m.rsplit(".", 1)[0]
        par = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                lens.append(n)
                big.append((n, f"{p}:{node.name}"))
            tg = []
            if isinstance(node, ast.Import):
                tg = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    b = pkg.split(".")
                    b = b[: len(b) - node.level + 1]
                    base = ".".join(b + ([node.module] if node.module else []))
                tg = [
                    base + "." + a.name if exists(base + "." + a.name) else base for a in node.names
                ]
            q = node
            infn = False
            while q in par:
                q = par[q]
                if isinstance(q, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    infn = True
                    break
            for t in tg:
                if not (t == "kiln" or t.startswith("kiln.")):
                    continue
                if infn:
                    fn += 1
                su, tu = part(m), part(t)
                if su != tu:
                    edges[m.split(".")[1] if "." in m else "kiln"].add(
                        t.split(".")[1] if "." in t else "kiln"
                    )
                    if RANK.get(tu, 99) >= RANK.get(su, -1):
                        bad += 1
# cycles between (old-name) subpackages, top-level modules excluded from the subpackage count
idx = {}
low = {}
st = []
on = set()
sccs = []
c = [0]
sys.setrecursionlimit(10000)


def sc(v):
    idx[v] = low[v] = c[0]
    c[0] += 1
    st.append(v)
    on.add(v)
    for w in edges.get(v, ()):
        if w not in idx:
            sc(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        sccs.append(comp)


for v in sorted(set(edges) | {x for s in edges.values() for x in s}):
    if v not in idx:
        sc(v)
cyc = [sorted(s) for s in sccs if len(s) > 1]
lens.sort()
big.sort(reverse=True)
print(f"cycles: {cyc}")
print(f"imports against the declared order: {bad}; function-level kiln imports: {fn}")
p90 = lens[int(0.9 * len(lens))]
print(f"functions: {len(lens)}, median {statistics.median(lens)}, p90 {p90}, max {lens[-1]}")
print("largest:", big[:6])
