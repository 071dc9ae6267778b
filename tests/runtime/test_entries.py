"""Packages of several entry points (kiln.compile({name: ...})): weights stored once, one state
buffer per loaded model shared by the entries, reset and copy of the state, entries by name
from Python and from C, errors naming the entry points; generation from Python, the CLI and
examples/c/generate.c against eager on a toy language model (tests/runtime/toy_lm.py)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from torch.export import Dim

import kiln
from kiln.errors import KilnError
from kiln.runtime import generate
from kiln.runtime.build import include_dir
from kiln.runtime.loader import libkiln
from kiln.package import read_package
from toy_lm import ToyLM, eager_greedy, entries

PROMPT = [1, 5, 7, 2]


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return ToyLM()


@pytest.fixture(scope="module")
def package(toy, tmp_path_factory):
    return kiln.compile(entries(toy)).save(tmp_path_factory.mktemp("entries") / "toy.kiln")


def _eager_copy(model):
    m = copy.deepcopy(model)
    m.cache.zero_()
    return m


def test_manifest_records_entries_and_stores_weights_once(package):
    pkg = read_package(package)
    m = pkg.manifest
    assert [e["name"] for e in m["entries"]] == ["prefill", "decode"]
    assert m["entries"][0]["library"] == "lib/model.so"
    assert m["entries"][1]["library"] == "entries/decode/lib/model.so"
    keys = [w["name"] for w in m["weights"]]
    assert len(keys) == len(set(keys)) == 4  # emb, head weight and bias, the cache: once each
    state = [w for w in m["weights"] if w.get("state")]
    assert [w["fqn"] for w in state] == ["cache"]
    for e in m["entries"]:  # both entries' weights map onto the same keys
        assert sorted(e["weights"].values()) == sorted(keys)


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_then_decode_match_eager_sharing_the_cache(package, toy, seed):
    g = torch.Generator().manual_seed(seed)
    eager = _eager_copy(toy)
    r = kiln.load(package)
    assert r.entries == ["prefill", "decode"]
    n = int(torch.randint(1, 9, (), generator=g))
    ids = torch.randint(0, 32, (1, n), generator=g)
    torch.testing.assert_close(r.prefill(ids, torch.arange(n)), eager(ids, torch.arange(n)))
    for pos in range(n, n + 5):
        tok = torch.randint(0, 32, (1, 1), generator=g)
        got = r.entry("decode")(tok, torch.tensor([pos]))
        torch.testing.assert_close(got, eager(tok, torch.tensor([pos])))
    torch.testing.assert_close(r.state()["cache"], eager.cache)
    torch.testing.assert_close(r(ids, torch.arange(n)), eager(ids, torch.arange(n)))  # default


def test_reset_and_copy_state(package, toy):
    a, b = kiln.load(package), kiln.load(package)
    ids = torch.tensor([[3, 4, 5]])
    a.prefill(ids, torch.arange(3))
    assert a.state()["cache"][:3].abs().sum() > 0
    assert b.state()["cache"].abs().sum() == 0  # each handle owns its state
    b.load_state(a)  # copy a's cache into b: both continue alike
    torch.testing.assert_close(b.state()["cache"], a.state()["cache"])
    tok = torch.tensor([[9]])
    torch.testing.assert_close(a.decode(tok, torch.tensor([3])), b.decode(tok, torch.tensor([3])))
    snapshot = a.state()
    a.decode(torch.tensor([[1]]), torch.tensor([4]))
    assert not torch.equal(a.state()["cache"], snapshot["cache"])
    a.load_state(snapshot)  # back to the snapshot: the same continuation as b's
    torch.testing.assert_close(a.decode(tok, torch.tensor([4])), b.decode(tok, torch.tensor([4])))
    a.reset_state()
    assert a.state()["cache"].abs().sum() == 0
    eager = _eager_copy(toy)
    torch.testing.assert_close(a.prefill(ids, torch.arange(3)), eager(ids, torch.arange(3)))
    with pytest.raises(kiln.errors.InputError, match=r"cache.*float32\[24, 16\].*float32\[2, 2\]"):
        a.load_state({"cache": torch.zeros(2, 2)})
    with pytest.raises(kiln.errors.InputError, match="missing state buffer 'cache'"):
        a.load_state({})


def test_bad_entry_names_name_the_entries(package, toy):
    r = kiln.load(package)
    with pytest.raises(KilnError, match=r"no entry point 'prefil'.*prefill, decode"):
        r.entry("prefil")
    with pytest.raises(AttributeError, match=r"no attribute 'prefil'.*prefill, decode"):
        r.prefil  # noqa: B018
    lib = libkiln()  # the C API says the same
    rc = lib.kiln_model_run_entry(r._handle, b"decod", None, 0, None, 0)
    assert rc != 0
    msg = lib.kiln_last_error().decode()
    assert "no entry point 'decod'" in msg and "prefill, decode" in msg, msg
    assert lib.kiln_model_entry_num_inputs(r._handle, b"nope") == -1
    assert "prefill, decode" in lib.kiln_last_error().decode()
    assert lib.kiln_model_num_entries(r._handle) == 2
    assert lib.kiln_model_entry_name(r._handle, 1) == b"decode"
    assert lib.kiln_model_entry_name(r._handle, 2) is None
    with pytest.raises(KilnError, match="not an identifier"):
        kiln.compile({"1st": entries(toy)["decode"]})
    with pytest.raises(KilnError, match="dict of entry points is empty"):
        kiln.compile({})


class _Counter(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(n))
        self.w = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        self.cache.add_(x)
        return self.cache * self.w


def test_entries_disagreeing_on_a_state_buffer_are_refused():
    with pytest.raises(KilnError, match=r"disagree on state buffer 'cache'.*float32\[3\]"):
        kiln.compile({"a": (_Counter(4), (torch.ones(4),)), "b": (_Counter(3), (torch.ones(3),))})


def test_same_fqn_other_values_stored_apart(tmp_path):
    torch.manual_seed(1)
    m1, m2 = _Counter(4), _Counter(4)  # same FQNs, other weights; the one cache is shared
    c = kiln.compile({"a": (m1, (torch.ones(4),)), "b": (m2, (torch.ones(4),))})
    keys = sorted(w["name"] for w in c.manifest["weights"])
    assert keys == ["b.p_w", "b_cache", "p_w"], keys
    r = c.load(tmp_path / "c.kiln")
    x = torch.randn(4)
    torch.testing.assert_close(r.a(x), x * m1.w.detach())
    torch.testing.assert_close(r.b(x), 2 * x * m2.w.detach())  # the cache a wrote


def test_package_without_entries_behaves_as_before(tmp_path):
    m = _Counter(4)
    c = kiln.compile(m, (torch.ones(4),))
    assert "entries" not in c.manifest and c.manifest["state_abi"] == 1
    r = c.load(tmp_path / "one.kiln")
    assert r.entries == ["forward"] and r.entry("forward") is r
    x = torch.ones(4)
    r(x)
    torch.testing.assert_close(r(x), 2 * x * m.w.detach())
    assert list(r.state()) == ["cache"]
    r.reset_state()
    torch.testing.assert_close(r(x), x * m.w.detach())
    lib = libkiln()
    assert lib.kiln_model_num_entries(r._handle) == 1
    assert lib.kiln_model_entry_name(r._handle, 0) == b"forward"
    with pytest.raises(KilnError, match=r"no entry point 'decode'.*forward"):
        r.entry("decode")


def test_package_without_state_functions_resets_by_recreating(make_toy_package, toy_reference):
    r = kiln.load(make_toy_package())  # a hand-written library: an older table, no state_abi
    x, s = torch.randn(2, 4), torch.tensor(2.0)
    r.reset_state()
    torch.testing.assert_close(r(x, scale=s), toy_reference(x, s))
    assert r.entries == ["forward"]
    assert r.state() == {}


@pytest.fixture(scope="module")
def generate_exe(libkiln_path, tmp_path_factory):
    """examples/c/generate.c built against libkiln (-Wall -Wextra -Werror)."""
    exe = tmp_path_factory.mktemp("cgen") / "generate"
    libdir = str(libkiln_path.parent)
    subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(include_dir()),
                    str(include_dir().parents[2] / "examples" / "c" / "generate.c"),
                    f"-L{libdir}", "-lkiln", f"-Wl,-rpath,{libdir}", "-o", str(exe)],
                   check=True)
    return exe


def _c_tokens(exe, package, prompt, *flags) -> list[int]:
    proc = subprocess.run([str(exe), *flags, str(package), ",".join(map(str, prompt))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("tokens: "))
    assert "tokens/s" in proc.stdout
    return [int(t) for t in line.removeprefix("tokens: ").split(",")]


def _cli_tokens(package, prompt, *flags) -> list[int]:
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "generate", str(package),
                           "--prompt-ids", ",".join(map(str, prompt)), "--json", *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["decode_tokens_per_s"] > 0
    return out["tokens"]


def test_greedy_generation_matches_eager_python_cli_and_c(package, toy, generate_exe):
    want = eager_greedy(toy, PROMPT, 12)
    r = kiln.load(package)
    assert generate(r, PROMPT, 12).tokens == want
    assert generate(r, PROMPT, 12).tokens == want  # the cache is reset for each generation
    assert _c_tokens(generate_exe, package, PROMPT, "-n", "12") == want
    assert _cli_tokens(package, PROMPT, "--max-new-tokens", "12") == want


def test_seeded_sampling_is_the_same_in_python_cli_and_c(package, generate_exe):
    r = kiln.load(package)
    flags = dict(temperature=1.5, top_k=10, top_p=0.95)
    a = generate(r, PROMPT, 16, seed=3, **flags).tokens
    assert generate(r, PROMPT, 16, seed=3, **flags).tokens == a
    others = {tuple(generate(r, PROMPT, 16, seed=s, **flags).tokens) for s in range(4, 8)}
    assert len(others | {tuple(a)}) > 1  # other seeds, other tokens
    c = _c_tokens(generate_exe, package, PROMPT, "-n", "16", "-T", "1.5", "-k", "10",
                  "-p", "0.95", "-s", "3")
    assert c == a
    assert _cli_tokens(package, PROMPT, "--max-new-tokens", "16", "--temperature", "1.5",
                       "--top-k", "10", "--top-p", "0.95", "--seed", "3") == a


def test_generate_errors(package, tmp_path, generate_exe):
    r = kiln.load(package)
    with pytest.raises(kiln.errors.InputError, match="prompt is empty"):
        generate(r, [], 4)
    one = kiln.compile(_Counter(4), (torch.ones(4),)).save(tmp_path / "one.kiln")
    with pytest.raises(KilnError, match=r"no entry point 'prefill' \(its entry points: forward"):
        generate(kiln.load(one), [1], 4)
    proc = subprocess.run([str(generate_exe), str(one), "1,2"], capture_output=True, text=True)
    assert proc.returncode == 1 and "no entry point 'prefill'" in proc.stderr, proc.stderr
    proc = subprocess.run([str(generate_exe), str(package), "1,x"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "bad prompt ids" in proc.stderr


def test_entries_take_dynamic_prompt_lengths_up_to_the_dim(toy, tmp_path):
    t = Dim("prompt", min=1, max=4)
    c = kiln.compile({"prefill": (toy, (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                                  {"input_ids": {1: t}, "cache_position": {0: t}})})
    r = c.load(tmp_path / "p.kiln")
    with pytest.raises(kiln.errors.InputError, match="input_ids"):
        r.prefill(torch.zeros(1, 6, dtype=torch.long), torch.arange(6))


def test_update_weights_reaches_every_entry_and_resets_state(package, toy):
    r = kiln.load(package)
    r.prefill(torch.tensor([[1, 2]]), torch.arange(2))
    torch.manual_seed(5)
    fresh = ToyLM()
    r.update_weights(fresh.state_dict())
    assert r.state()["cache"].abs().sum() == 0
    eager = _eager_copy(fresh)
    ids = torch.tensor([[4, 6, 8]])
    torch.testing.assert_close(r.prefill(ids, torch.arange(3)), eager(ids, torch.arange(3)))
    tok = torch.tensor([[3]])
    torch.testing.assert_close(r.decode(tok, torch.tensor([3])), eager(tok, torch.tensor([3])))


def test_cuda_package_of_entries_builds(tmp_path):
    """Compile-only (no GPU here): a CUDA package of two entries sharing a state buffer has
    the state and weight-sharing functions in each library and the entries in its manifest
    (on a GPU: tests/targets/cuda/test_generate_cuda.py)."""
    pytest.importorskip("triton")
    import zipfile

    opts = kiln.Options(cuda_archs=(90,))
    c = kiln.compile({"a": (_Counter(4), (torch.ones(4),)),
                      "b": (_Counter(4), (torch.ones(4),))}, device="cuda", options=opts)
    path = c.save(tmp_path / "c.kiln")
    assert [e["name"] for e in c.manifest["entries"]] == ["a", "b"]
    # 2: the tables also have weight_buffer / share_weight (one upload of the weights)
    assert c.manifest["device"] == "cuda" and c.manifest["state_abi"] == 2
    with zipfile.ZipFile(path) as z:
        for src in ("src/model_cuda.cpp", "entries/b/src/model_cuda.cpp"):
            text = z.read(src).decode()
            assert "int share_state(" in text and "state_buffer, share_state" in text
            assert "int share_weight(" in text and "weight_buffer, share_weight};" in text
            assert "if (!weights[i]) continue;" in text  # a shared weight is not uploaded
        assert {"lib/model.so", "entries/b/lib/model.so"} <= set(z.namelist())


def test_c_stop_token_and_several_prompts_for_a_batch_1_package(package, generate_exe):
    r = kiln.load(package)
    free = generate(r, PROMPT, 12).tokens
    stop = free[3]
    want = generate(r, PROMPT, 12, stop=stop).tokens
    assert want == free[:free.index(stop) + 1]
    assert _c_tokens(generate_exe, package, PROMPT, "-n", "12", "-e", str(stop)) == want
    proc = subprocess.run([str(generate_exe), str(package), "1,2", "3,4"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "decodes one sequence" in proc.stderr, proc.stderr
