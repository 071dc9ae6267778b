"""Hugging Face decoders (tiny Llama and Qwen2 configs, random weights) compiled as one package
of prefill + decode (kiln.models.hf_decoder): greedy tokens from the Python runner, `kiln
generate` and examples/c/generate.c equal eager's; the weights are stored once, the KV cache
is shared state. Slow: exporting and compiling two programs per model takes about a minute."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kiln
from kiln.models import hf_decoder
from kiln.runtime import generate
from test_entries import _c_tokens, generate_exe  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

PROMPT = [3, 17, 42, 5, 99, 7]
MAX_CACHE = 48


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def compiled(request, tmp_path_factory):
    model = hf_decoder.build(request.param, seed=1)
    c = kiln.compile(hf_decoder.export_decoder(model, max_cache_len=MAX_CACHE, max_prompt=16))
    path = c.save(tmp_path_factory.mktemp("hf") / f"{request.param}.kiln")
    return model, c, path


def test_greedy_tokens_match_eager(compiled, generate_exe):  # noqa: F811
    model, c, path = compiled
    want = hf_decoder.eager_generate(model, PROMPT, 24, max_cache_len=MAX_CACHE)
    r = kiln.load(path)
    assert generate(r, PROMPT, 24).tokens == want
    assert _c_tokens(generate_exe, path, PROMPT, "-n", "24") == want
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "generate", str(path),
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "24",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == want


def test_weights_once_cache_shared(compiled):
    model, c, path = compiled
    m = c.manifest
    params = {n for n, _ in [*model.named_parameters(), *model.named_buffers()]}
    fqns = [w["fqn"] for w in m["weights"] if not w.get("state")]
    assert len(fqns) == len(set(fqns))  # each weight once
    assert {f.removeprefix("model.") for f in fqns} <= params | {"lm_head.weight"}
    state = [w for w in m["weights"] if w.get("state")]
    assert {w["fqn"] for w in state} >= {"key_cache_0", "value_cache_0"}
    for e in m["entries"]:
        assert {w["name"] for w in state} <= set(e["weights"].values())
    r = kiln.load(path)
    generate(r, PROMPT, 4)
    st = r.state()
    assert st["key_cache_0"][..., :len(PROMPT) + 3, :].abs().sum() > 0
    assert st["key_cache_0"][..., len(PROMPT) + 3:, :].abs().sum() == 0  # filled so far only
    r.reset_state()
    assert all(float(t.double().abs().sum()) == 0 for k, t in r.state().items()
               if "cache" in k and "cumulative" not in k)
