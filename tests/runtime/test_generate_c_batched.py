"""examples/c/generate.c with a batched package (kiln.models.batched_decoder.export_batched):
it tells the package apart through libkiln's input and state records (minor 7:
kiln_model_entry_input_name / _input_shape, kiln_model_state_shape) and runs several prompts
with kiln.runtime.generate_batch's loop, so its tokens equal generate_batch's for 1, 3 and 4
prompts of different lengths, greedy, seeded-sampled (seed + b per sequence) and with a stop
token; usage errors exit with 2, kiln errors with 1.

One tiny Llama (2 layers, hidden 64) compiled once at batch 4 serves every case."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import test_entries

import kiln
from kiln.models import batched_decoder as bd
from kiln.models import hf_decoder
from kiln.runtime import generate_batch
from kiln.runtime.loader import libkiln

generate_exe = test_entries.generate_exe  # the fixture: examples/c/generate.c built

#: lengths 6, 2, 9, 1: every set mixes lengths (the 1-prompt set is the longest alone)
PROMPTS = [[3, 17, 42, 5, 99, 7], [8, 1], [5, 6, 7, 8, 9, 10, 11, 12, 13], [4]]
SETS = {1: [PROMPTS[2]], 3: PROMPTS[:3], 4: PROMPTS}
BATCH, MAX_LEN, MAX_PROMPT, NEW = 4, 32, 16, 8
SAMPLING = dict(temperature=1.5, top_k=10, top_p=0.95, seed=3)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    model = hf_decoder.build("llama", seed=1, init="fan_in")
    c = kiln.compile(bd.export_batched(model, BATCH, MAX_LEN, max_prompt=MAX_PROMPT))
    path = c.save(tmp_path_factory.mktemp("cgen_batched") / "llama_b4.kiln")
    return path, kiln.load(path)


def _run(exe, path, prompts, *flags):
    return subprocess.run([str(exe), *flags, str(path), *(",".join(map(str, p))
                                                          for p in prompts)],
                          capture_output=True, text=True, timeout=120)


def _c_tokens(exe, path, prompts, *flags) -> list[list[int]]:
    proc = _run(exe, path, prompts, *flags)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [x for x in lines if x.startswith("tokens[")]
    assert [r.split(":")[0] for r in rows] == [f"tokens[{b}]" for b in range(len(prompts))]
    assert lines[-1].startswith(f"batch {BATCH} ({len(prompts)} prompts)"), proc.stdout
    assert "tokens/s" in lines[-1]
    return [[int(t) for t in r.split(": ", 1)[1].split(",")] for r in rows]


def test_input_and_state_records_through_the_c_api(package):
    lib = libkiln()
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kiln_model_entry_input_name.restype = ctypes.c_char_p
    lib.kiln_model_entry_input_name.argtypes = [vp, ctypes.c_char_p, i64]
    lib.kiln_model_entry_input_shape.restype = i64
    lib.kiln_model_entry_input_shape.argtypes = [vp, ctypes.c_char_p, i64,
                                                 ctypes.POINTER(i64), i64]
    lib.kiln_model_state_shape.restype = i64
    lib.kiln_model_state_shape.argtypes = [vp, i64, ctypes.POINTER(i64), i64]
    assert lib.kiln_abi_minor() >= 7
    h = package[1]._handle
    names = {e: [lib.kiln_model_entry_input_name(h, e.encode(), k) for k in range(2)]
             for e in ("prefill", "decode")}
    assert names == {"prefill": [b"input_ids", b"lengths"],
                     "decode": [b"input_ids", b"positions"]}
    dims = (i64 * 4)()

    def shape(entry, k):
        n = lib.kiln_model_entry_input_shape(h, entry, k, dims, 4)
        return list(dims[:n])

    assert shape(b"prefill", 0) == [BATCH, -1]  # the prompt length is dynamic
    assert shape(b"decode", 0) == [BATCH, 1] and shape(b"decode", 1) == [BATCH]
    assert lib.kiln_model_entry_input_shape(h, b"decode", 0, None, 0) == 2  # rank only
    n = lib.kiln_model_state_shape(h, 0, dims, 4)
    assert n == 4 and dims[0] == BATCH and dims[2] == MAX_LEN
    assert lib.kiln_model_entry_input_name(h, b"decode", 2) is None
    assert "out of range" in lib.kiln_last_error().decode()
    assert lib.kiln_model_entry_input_shape(h, b"nope", 0, dims, 4) == -1
    assert "prefill, decode" in lib.kiln_last_error().decode()
    assert lib.kiln_model_entry_input_shape(h, b"decode", 0, None, 4) == -1
    assert lib.kiln_model_state_shape(h, 99, dims, 4) == -1
    assert "out of range" in lib.kiln_last_error().decode()


@pytest.mark.parametrize("n", [1, 3, 4])
def test_c_tokens_equal_generate_batch(package, generate_exe, n):
    path, runner = package
    prompts = SETS[n]
    want = generate_batch(runner, prompts, NEW).tokens
    assert _c_tokens(generate_exe, path, prompts, "-n", str(NEW)) == want
    sampled = generate_batch(runner, prompts, NEW, **SAMPLING).tokens
    assert sampled != want or n == 1
    assert _c_tokens(generate_exe, path, prompts, "-n", str(NEW), "-T", "1.5", "-k", "10",
                     "-p", "0.95", "-s", "3") == sampled


def test_stop_token_ends_only_its_sequence(package, generate_exe):
    path, runner = package
    prompts = SETS[3]
    free = generate_batch(runner, prompts, NEW).tokens
    stop = free[1][2]  # sequence 1's third token: it ends there, the others run on
    want = generate_batch(runner, prompts, NEW, stop=stop).tokens
    assert want[1] == free[1][:free[1].index(stop) + 1]
    assert max(map(len, want)) > len(want[1])
    assert _c_tokens(generate_exe, path, prompts, "-n", str(NEW), "-e", str(stop)) == want


@pytest.mark.parametrize("prompts,flags,status,message", [
    ([[1], [2], [3], [4], [5]], (), 2, "5 prompts for a package of batch 4"),
    ([[1, 2], ""], (), 2, "bad prompt ids"),
    ([[1] * 10], ("-n", "30"), 2, "need 39 cache positions; the package's cache holds 32"),
    ([[1] * 20, [2]], ("-n", "2"), 1, r"input 0 (input_ids)"),  # > max_prompt: kiln's check
    ([[1, 2]], ("-n", "0"), 2, "usage"),
])
def test_usage_and_kiln_errors(package, generate_exe, prompts, flags, status, message):
    proc = _run(generate_exe, package[0], prompts, *flags)
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert message in proc.stderr, proc.stderr
    assert proc.stdout == ""
