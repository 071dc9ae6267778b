"""Generation on CUDA (issue 17): the device sampler (kiln/models/device_sampler.py), the
`sample` entry point of a decoder package, the loop of kiln.runtime.generate and
examples/c/generate.c on the GPU, and one device copy of the weights per loaded package.

Without a GPU: the sampling kernel's semantics run in Triton's interpreter against a float64
reference (greedy = the first index of the largest logit; top-k / top-p keep the right sets;
a (seed, position) gives one token; the draws follow softmax(logits / T)), and the `sample`
program compiles into a CUDA package. On a GPU (`-m gpu`): the compiled sampler gives the
eager kernel's tokens; greedy generation on the device gives eager's tokens and the host
sampler's, in Python and in C; a seed reproduces its tokens; loading a two-entry package
uploads its weights once."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

import kiln  # noqa: E402
from device_memory import load_bytes  # noqa: E402
from kiln.models import device_sampler as S  # noqa: E402
from kiln.models import hf_decoder  # noqa: E402
from kiln.options import Options  # noqa: E402
from kiln.runtime.build import include_dir  # noqa: E402

OPTS = Options(cuda_archs=(90,), autotune=False)
# without a GPU driver torch cannot analyse a kernel and logs a traceback per call: noise here
logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
ROOT = pathlib.Path(__file__).resolve().parents[3]

_INTERP = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from kiln.models import device_sampler as S

    def run(logits, pos, t, k, p, seed):
        fp, ip = S.params(t, k, p, seed, "cpu")
        ids = torch.empty(1, 1, dtype=torch.long)
        nxt = torch.empty(1, dtype=torch.long)
        T, V = logits.shape[1], logits.shape[2]
        S.sample_kernel[(1,)](logits, pos, fp, ip, ids, nxt, T, V, BLOCK=S.block_for(V))
        assert int(nxt) == int(pos[-1]) + 1, (nxt, pos)
        return int(ids)

    def kept(row, t, k, p):
        # the float64 reference of the kept set: top-k by value (ties kept), then top-p
        x = row.double()
        keep = torch.ones_like(x, dtype=torch.bool)
        if 0 < k < x.numel():
            keep &= x >= x.topk(k).values[-1]
        if 0 < p < 1:
            e = torch.where(keep, torch.exp((x - x.max()) / t), torch.zeros_like(x))
            order = e.argsort(descending=True)
            mass = e[order].cumsum(0) / e.sum()
            n = int((mass < p).sum()) + 1
            keep &= x >= x[order[n - 1]]
        return keep

    bad = []
    g = torch.Generator().manual_seed(0)
    for V, dt, T in [(100, torch.float32, 1), (5000, torch.bfloat16, 3),
                     (300, torch.float16, 2), (4097, torch.float32, 1)]:
        lg = torch.randn(1, T, V, generator=g).to(dt)
        lg[0, -1, V // 3] = lg[0, -1, V - 1] = lg[0, -1].max() + 1  # a tie: the first wins
        pos = torch.arange(7, 7 + T)
        got = run(lg, pos, 0.0, 0, 1.0, 0)
        if got != V // 3:
            bad.append(f"greedy V={V} {dt}: {got}, want {V // 3}")
        for k, p in [(1, 1.0), (0, 1e-6), (5, 0.9)]:  # a one-token set: the argmax
            got = run(lg, pos, 1.0, k, p, 5) if (k, p) != (5, 0.9) else None
            if got is not None and got != V // 3:
                bad.append(f"k={k} p={p} V={V}: {got}, want {V // 3}")
    lg = torch.randn(1, 1, 64, generator=g) * 2
    row = lg[0, -1]
    for t, k, p in [(1.0, 5, 1.0), (0.7, 0, 0.6), (1.5, 12, 0.8), (1.0, 0, 1.0)]:
        keep = kept(row, t, k, p)
        toks = [run(lg, torch.tensor([pos]), t, k, p, 11) for pos in range(25)]
        if not all(keep[x] for x in toks):
            bad.append(f"t={t} k={k} p={p}: tokens {toks} outside the kept set "
                       f"{keep.nonzero().flatten().tolist()}")
        if int(keep.sum()) > 1 and len(set(toks)) < 2:
            bad.append(f"t={t} k={k} p={p}: one token for 25 positions: {toks}")
        if run(lg, torch.tensor([3]), t, k, p, 11) != toks[3]:
            bad.append(f"t={t} k={k} p={p}: not reproducible")
    # the draws follow softmax(x / t): total variation over 240 positions
    x = torch.tensor([[[1.0, 0.0, 2.0, -1.0, 0.5, 1.5]]])
    want = torch.softmax(x[0, 0].double() / 0.8, 0)
    toks = [run(x, torch.tensor([q]), 0.8, 0, 1.0, 2024) for q in range(240)]
    freq = torch.bincount(torch.tensor(toks), minlength=6).double() / len(toks)
    tv = 0.5 * (freq - want).abs().sum().item()
    if tv > 0.12:
        bad.append(f"distribution: total variation {tv:.3f} ({freq.tolist()} vs {want.tolist()})")
    seeds = {run(x, torch.tensor([5]), 0.8, 0, 1.0, s) for s in range(30)}
    if len(seeds) < 3:
        bad.append(f"30 seeds gave tokens {seeds}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
""")


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_sampling_kernel_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _INTERP], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


def test_sample_program_compiles_for_cuda():
    cm = kiln.compile(S.export_sampler(1000, torch.bfloat16, max_rows=64), device="cuda",
                      options=OPTS)
    m = cm.manifest
    assert [i["dtype"] for i in m["inputs"]] == ["bfloat16", "int64", "float32", "int64"]
    assert m["inputs"][0]["shape"][2] == 1000 and m["outputs"][0]["shape"] == [1, 1]
    info = m["cuda"]["user_kernels"]["sample_kernel"]
    assert info["constexprs"] == {"V": "1000", "BLOCK": "1024"}
    # nothing is copied before the kernel: it writes only its two fresh outputs
    assert "cuMemcpyDtoDAsync" not in cm.sources["model_cuda.cpp"]


def test_generate_rejects_bad_sampling_parameters():
    class R:  # a runner's surface: entry points only
        entries = ["prefill", "decode"]

        def entry(self, name):
            raise AssertionError("not reached")

    for kw, msg in [(dict(top_k=-1), "top_k"), (dict(top_p=1.5), "top_p"),
                    (dict(temperature=float("nan")), "temperature")]:
        with pytest.raises(kiln.errors.InputError, match=msg):
            kiln.runtime.generate(R(), [1, 2], 4, **kw)
    with pytest.raises(kiln.errors.KilnError, match="device sampling needs a CUDA runner.*"
                                                    "on cpu with entry points prefill, decode"):
        kiln.runtime.generate(R(), [1, 2], 4, device_sampling=True)


# ---------------------------------------------------------------- GPU

PROMPT = [3, 17, 42, 5, 99, 7]


@pytest.fixture(scope="module")
def cuda_pkg(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = hf_decoder.llama(layers=2, hidden=512, heads=8, kv_heads=4, vocab=32000, inter=512)
    progs = hf_decoder.export_decoder(model, max_cache_len=64, max_prompt=16,
                                      sampler=S.export_sampler)
    path = kiln.compile(progs, device="cuda", options=Options(autotune=False)).save(
        tmp_path_factory.mktemp("gen") / "g.kiln")  # autotune off: compile time
    return model, path


@pytest.mark.gpu
def test_compiled_sampler_equals_eager_kernel(cuda_pkg):
    _, path = cuda_pkg
    r = kiln.load(path, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    for t, k, p in [(0.0, 0, 1.0), (1.0, 40, 0.9), (0.8, 0, 0.5), (1.2, 0, 1.0)]:
        fp, ip = S.params(t, k, p, 99, "cuda")
        for rows in (1, 5):
            lg = torch.randn(1, rows, 32000, device="cuda", generator=g) * 3
            pos = torch.arange(rows, device="cuda") + 10
            want = S.sample_next(lg, pos, fp, ip)
            got = r.sample(lg, pos, fp, ip)
            assert int(got[0]) == int(want[0]) and int(got[1]) == int(pos[-1]) + 1
            if t == 0:
                assert int(got[0]) == int(lg[0, -1].argmax())


@pytest.mark.gpu
def test_greedy_on_device_equals_eager_and_host_sampler(cuda_pkg):
    model, path = cuda_pkg
    want = hf_decoder.eager_generate(model.to("cuda"), PROMPT, 20, max_cache_len=64)
    model.to("cpu")
    r = kiln.load(path, device="cuda")
    dev = kiln.runtime.generate(r, PROMPT, 20)
    host = kiln.runtime.generate(r, PROMPT, 20, device_sampling=False)
    assert dev.sampling == "device" and host.sampling == "host"
    assert dev.tokens == host.tokens == want
    i = next(i for i in range(3, 20) if want[i] not in want[:i])  # its first occurrence
    stopped = kiln.runtime.generate(r, PROMPT, 20, stop=want[i])
    assert stopped.tokens == want[:i + 1]


@pytest.mark.gpu
def test_sampling_on_device_is_reproducible(cuda_pkg):
    _, path = cuda_pkg
    r = kiln.load(path, device="cuda")
    kw = dict(temperature=0.9, top_k=50, top_p=0.95)
    a = kiln.runtime.generate(r, PROMPT, 24, seed=7, **kw).tokens
    b = kiln.runtime.generate(r, PROMPT, 24, seed=7, **kw).tokens
    c = kiln.runtime.generate(r, PROMPT, 24, seed=8, **kw).tokens
    assert a == b and a != c and all(0 <= x < 32000 for x in a + c)


@pytest.mark.gpu
def test_cli_and_c_generate_on_cuda(cuda_pkg, libkiln_path, tmp_path):
    model, path = cuda_pkg
    r = kiln.load(path, device="cuda")
    want = kiln.runtime.generate(r, PROMPT, 12).tokens
    sampled = kiln.runtime.generate(r, PROMPT, 12, temperature=0.8, top_k=20, seed=3).tokens
    r.close()
    ids = ",".join(map(str, PROMPT))
    cli = subprocess.run([sys.executable, "-m", "kiln.cli.main", "generate", str(path),
                          "--prompt-ids", ids, "--max-new-tokens", "12", "--device", "cuda",
                          "--repeat", "2", "--json"], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout)
    assert out["tokens"] == want and out["sampling"] == "device"
    assert out["decode_tokens_per_s"] > 0
    exe = tmp_path / "generate"
    lib = str(libkiln_path.parent)
    subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(include_dir()),
                    str(ROOT / "examples" / "c" / "generate.c"), f"-L{lib}", "-lkiln",
                    f"-Wl,-rpath,{lib}", "-ldl", "-o", str(exe)], check=True)
    for flags, tokens in [((), want), (("-T", "0.8", "-k", "20", "-s", "3"), sampled)]:
        c = subprocess.run([str(exe), "-n", "12", "-d", "cuda", *flags, str(path), ids],
                           capture_output=True, text=True, timeout=300)
        assert c.returncode == 0, c.stderr
        line = next(x for x in c.stdout.splitlines() if x.startswith("tokens: "))
        assert [int(t) for t in line[8:].split(",")] == tokens
        assert "tokens/s" in c.stdout


@pytest.mark.gpu
def test_entries_share_one_upload_of_the_weights(tmp_path):
    """prefill, decode and sample read the same weights: the three-entry package takes about
    the memory of its decode entry alone (one weight copy, not one per entry point), plus the
    other entries' own arenas, workspaces and modules (about 50 MiB each on an H200), far less
    than another copy of the 290 MB of weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = hf_decoder.llama(layers=1, hidden=1024, heads=8, kv_heads=4, vocab=32000,
                             inter=1024)
    progs = hf_decoder.export_decoder(model, max_cache_len=64, max_prompt=16,
                                      sampler=S.export_sampler)
    opts = Options(autotune=False)
    every = kiln.compile(progs, device="cuda", options=opts).save(tmp_path / "all.kiln")
    one = kiln.compile({"decode": progs["decode"]}, device="cuda", options=opts).save(
        tmp_path / "decode.kiln")
    blob = _weight_bytes(every)
    used_every, used_one = load_bytes(every), load_bytes(one)
    assert used_one > 0.9 * blob, (used_one, blob)  # the decode entry holds the weights
    assert used_every - used_one < blob / 2, (used_every, used_one, blob)
    r = kiln.load(every, device="cuda")
    assert kiln.runtime.generate(r, PROMPT, 4).tokens  # and the shared copy works


def _weight_bytes(path) -> int:
    with zipfile.ZipFile(path) as z:
        return z.getinfo("weights.safetensors").file_size
