"""Batch > 1 decode with per-sequence positions (kiln/models/batched_decoder.py): prompts of
different lengths decoded together, each sequence at its own position, give the same greedy
tokens and logits as Hugging Face's own static-cache module run on each sequence alone
(batch 1), in eager and through the compiled package (prefill + decode entry points sharing
the weights and the [B, kv_heads, max_len, head_dim] caches).

One tiny Llama (2 layers, hidden 64, GQA 4:2) compiled once at batch 4 serves the default
cases (1, 3 and 4 prompts: rows past the prompts run a dummy one); packages compiled at
batch 1 and 3 are `slow`, the CUDA runs `gpu`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import kiln
from kiln.errors import InputError, KilnError
from kiln.models import batched_decoder as bd
from kiln.models import hf_decoder
from kiln.runtime import generate_batch

#: lengths 6, 2, 9, 1, 4: every set below mixes lengths
PROMPTS = [[3, 17, 42, 5, 99, 7], [8, 1], [5, 6, 7, 8, 9, 10, 11, 12, 13], [4],
           [200, 31, 77, 64]]
SETS = {1: [PROMPTS[2]], 3: PROMPTS[:3], 4: PROMPTS[:4]}
MAX_LEN, MAX_PROMPT, NEW = 32, 16, 8
TOL = dict(atol=2e-4, rtol=2e-4)  # float32 against float32, different reduction orders


def tiny(family: str = "llama"):
    # fan-in weights spread the logits: greedy tokens far from ties
    return hf_decoder.build(family, seed=1, init="fan_in")


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def package(model, tmp_path_factory):
    """The batch-4 package, compiled once for the module's tests."""
    c = kiln.compile(bd.export_batched(model, 4, MAX_LEN, max_prompt=MAX_PROMPT))
    path = c.save(tmp_path_factory.mktemp("batched") / "llama_b4.kiln")
    return path, kiln.load(path), c.manifest


@torch.no_grad()
def hf_steps(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's static-cache module at batch 1 on `prompt` alone: n greedy tokens and the logits
    each was chosen from (the prompt's last, then each decode step's)."""
    module = hf_decoder.static_cache_module(model, MAX_LEN)
    logits = module(input_ids=torch.tensor([prompt]),
                    cache_position=torch.arange(len(prompt)))[0, -1]
    toks, rows = [], []
    for i in range(n):
        rows.append(logits.clone())
        toks.append(int(logits.argmax()))
        if i + 1 < n:
            logits = module(input_ids=torch.tensor([[toks[-1]]]),
                            cache_position=torch.tensor([len(prompt) + i]))[0, -1]
    return toks, rows


@torch.no_grad()
def batched_steps(prefill, decode, batch: int, prompts: list[list[int]], n: int):
    """Greedy through prefill(ids, lengths) / decode(ids, positions) of one batch; the rows
    past the prompts run a one-token dummy. Tokens and logits of the real rows."""
    rows = prompts + [[0]] * (batch - len(prompts))
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lens = torch.tensor([len(r) for r in rows])
    logits = prefill(ids, lens)
    toks = [[int(logits[b].argmax())] for b in range(batch)]
    seen = [[logits[b].clone()] for b in range(batch)]
    for i in range(n - 1):
        logits = decode(torch.tensor([[t[-1]] for t in toks]), lens + i)
        for b in range(batch):
            toks[b].append(int(logits[b].argmax()))
            seen[b].append(logits[b].clone())
    return toks[:len(prompts)], seen[:len(prompts)]


def check_against_hf(model, toks, seen, prompts, tol=TOL):
    for b, prompt in enumerate(prompts):
        want_toks, want_rows = hf_steps(model, prompt, NEW)
        assert toks[b] == want_toks, f"sequence {b} (length {len(prompt)})"
        for step, (got, want) in enumerate(zip(seen[b], want_rows)):
            torch.testing.assert_close(got, want, **tol,
                                       msg=lambda m: f"sequence {b} step {step}: {m}")


@pytest.mark.parametrize("n", sorted(SETS))
def test_compiled_batch_matches_hf_per_sequence(model, package, n):
    path, runner, _ = package
    prompts = SETS[n]
    runner.reset_state()
    toks, seen = batched_steps(runner.entry("prefill"), runner.entry("decode"), 4, prompts, NEW)
    check_against_hf(model, toks, seen, prompts)
    # the Python API: same tokens, equal to eager_generate's
    g = generate_batch(runner, prompts, NEW)
    assert g.tokens == [hf_decoder.eager_generate(model, p, NEW, max_cache_len=MAX_LEN)
                        for p in prompts]
    assert g.batch == 4 and g.decode_steps == NEW - 1


def test_seeded_sampling_per_sequence(model, package):
    """Temperature / top-k sampling, each sequence with its own generator (seed + b): the
    package gives the eager module's tokens, the same on every run, and a stop token ends
    only its own sequence."""
    runner = package[1]
    prompts = SETS[3]
    kw = dict(temperature=0.9, top_k=20, seed=5)
    got = generate_batch(runner, prompts, NEW, **kw).tokens
    assert got == generate_batch(runner, prompts, NEW, **kw).tokens
    assert got == bd.eager_generate_batch(model, prompts, NEW, batch=4, max_len=MAX_LEN,
                                          **kw).tokens
    assert got != generate_batch(runner, prompts, NEW, **{**kw, "seed": 6}).tokens
    stop = got[1][2]
    cut = generate_batch(runner, prompts, NEW, stop=stop, **kw).tokens
    for want, have in zip(got, cut):
        end = want.index(stop) + 1 if stop in want else len(want)
        assert have == want[:end]


def test_weights_once_caches_shared_state(package):
    m = package[2]
    fqns = [w["fqn"] for w in m["weights"] if not w.get("state")]
    assert len(fqns) == len(set(fqns))  # each weight stored once for both entry points
    state = {w["fqn"]: w for w in m["weights"] if w.get("state")}
    assert set(state) == {f"m.{kv}_cache_{i}" for kv in "kv" for i in range(2)}
    for e in m["entries"]:
        assert {w["name"] for w in state.values()} <= set(e["weights"].values())


def test_cache_rows_filled_at_own_positions(package):
    path, runner, _ = package
    prompts = SETS[3]
    generate_batch(runner, prompts, 3)
    k = runner.state()["m.k_cache_0"]
    assert list(k.shape) == [4, 2, MAX_LEN, 16]
    for b, p in enumerate(prompts):  # prompt + 2 decoded tokens written, nothing past them
        end = len(p) + 2
        assert bool((k[b, :, :end].abs().sum(-1) > 0).all())
        assert float(k[b, :, max(end, max(map(len, prompts))):].abs().sum()) == 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("n", sorted(SETS))
def test_eager_batched_module_matches_hf(family, n):
    model = tiny(family)
    prompts = SETS[n]
    prefill, decode = bd.entries(model, n, MAX_LEN)
    toks, seen = batched_steps(prefill, decode, n, prompts, NEW)
    check_against_hf(model, toks, seen, prompts, tol=dict(atol=2e-5, rtol=2e-5))
    assert bd.eager_generate_batch(model, prompts, NEW, max_len=MAX_LEN).tokens == toks


def test_float64_logits(model):
    """In float64 the batched module's logits equal HF's to rounding: the float32 tolerance
    above is reduction order, not a different computation."""
    m64 = tiny().double()
    prompts = SETS[3]
    prefill, decode = bd.entries(m64, 3, MAX_LEN)
    toks, seen = batched_steps(prefill, decode, 3, prompts, NEW)
    check_against_hf(m64, toks, seen, prompts, tol=dict(atol=1e-10, rtol=1e-10))


def test_cli_several_prompts(model, package):
    path = package[0]
    prompts = SETS[3]
    cmd = [sys.executable, "-m", "kiln.cli.main", "generate", str(path), "--max-new-tokens",
           str(NEW), "--json"]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == [
        hf_decoder.eager_generate(model, p, NEW, max_cache_len=MAX_LEN) for p in prompts]


def test_bad_inputs_clear_errors(model, package):
    runner = package[1]
    decode = runner.entry("decode")
    with pytest.raises(InputError, match="expected size 4 for dim 0"):  # wrong B
        decode(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(KilnError, match="out of bounds"):  # a position past max_len
        decode(torch.zeros(4, 1, dtype=torch.long), torch.tensor([0, 1, MAX_LEN, 2]))
    with pytest.raises(KilnError, match="index out of range in gather"):  # a length of 0
        runner.entry("prefill")(torch.zeros(4, 3, dtype=torch.long), torch.tensor([0, 3, 1, 2]))
    with pytest.raises(InputError, match=r"expected a value in \[1, 16\]"):  # > max_prompt
        generate_batch(runner, [[1] * 20, [2]], 2)
    with pytest.raises(InputError, match="cache"):  # prompt + new tokens past the cache
        generate_batch(runner, [[1] * 20, [2]], MAX_LEN)
    with pytest.raises(InputError, match="at most 4"):
        generate_batch(runner, PROMPTS, 2)
    with pytest.raises(InputError, match="at least one"):
        generate_batch(runner, [[1], []], 2)
    prefill, dec = bd.entries(model, 2, MAX_LEN)
    with pytest.raises(InputError, match="outside the cache"):
        dec(torch.zeros(2, 1, dtype=torch.long), torch.tensor([3, MAX_LEN]))
    with pytest.raises(InputError, match=r"input_ids must be \[2, T\]"):
        dec(torch.zeros(3, 1, dtype=torch.long), torch.tensor([0, 1]))
    with pytest.raises(InputError, match="lengths"):
        prefill(torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 3]))
    assert runner.entry("decode")(torch.zeros(4, 1, dtype=torch.long),
                                  torch.zeros(4, dtype=torch.long)).shape == (4, 256)


@pytest.mark.parametrize("family", ["gemma", "phi"])
def test_unsupported_family_refused(family):
    with pytest.raises(KilnError, match="not supported"):
        bd.BatchedDecoder(tiny(family), 2, MAX_LEN)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_exact_batch(model, batch, tmp_path):
    """Packages compiled at batch 1 and 3 (every row a real prompt)."""
    runner = kiln.compile(bd.export_batched(model, batch, MAX_LEN, max_prompt=MAX_PROMPT)
                          ).load(tmp_path / "b.kiln")
    prompts = SETS[batch]
    toks, seen = batched_steps(runner.entry("prefill"), runner.entry("decode"), batch,
                               prompts, NEW)
    check_against_hf(model, toks, seen, prompts)


@pytest.mark.slow
def test_cuda_sm90_compiles_without_gpu():
    """The batched package compiles for CUDA (sm_90) on a machine without a GPU."""
    from kiln.options import Options

    c = kiln.compile(bd.export_batched(tiny(), 3, MAX_LEN, max_prompt=MAX_PROMPT),
                     device="cuda", options=Options(cuda_archs=(90,)))
    assert [e["name"] for e in c.manifest["entries"]] == ["prefill", "decode"]


@pytest.mark.gpu
@pytest.mark.parametrize("n", sorted(SETS))
def test_cuda_batch_matches_hf_per_sequence(n, tmp_path):
    model = tiny().to("cuda")
    from kiln.options import Options

    c = kiln.compile(bd.export_batched(model, 4, MAX_LEN, max_prompt=MAX_PROMPT),
                     device="cuda", options=Options(autotune=False))  # compile time
    runner = kiln.load(c.save(tmp_path / "b.kiln"), device="cuda")
    prompts = SETS[n]
    runner.reset_state()

    def on(entry):
        return lambda ids, x: entry(ids.cuda(), x.cuda()).cpu()

    toks, seen = batched_steps(on(runner.entry("prefill")), on(runner.entry("decode")), 4,
                               prompts, NEW)
    cpu = tiny()  # the reference on the CPU in float32; the tolerance allows TF32 GEMMs
    check_against_hf(cpu, toks, seen, prompts, tol=dict(atol=1e-2, rtol=1e-2))
    assert generate_batch(runner, prompts, NEW).tokens == toks
