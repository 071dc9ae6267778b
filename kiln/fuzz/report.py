"""Writes a minimised failing program as a standalone pytest file (the program spec inline,
checked by `kiln.fuzz.runner.check`), named by a hash of the spec so reruns do not duplicate."""

from __future__ import annotations

import hashlib
import json
import pprint
from pathlib import Path

from kiln.fuzz.runner import Outcome

TEMPLATE = '''"""Fuzzer reproducer: {title}

Found by `kiln fuzz` ({origin}); minimised to {n_ops} op(s). Failure when found:
{detail}
"""

from kiln.fuzz.runner import check
{gpu}
SPEC = {spec}


def test_fuzz_{key}(tmp_path):
    out = check(SPEC, tmp_path)
    assert out.status in ("ok", "error"), out.detail
'''


GPU = '''import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
'''


def write_repro(spec: dict, outcome: Outcome, out_dir: str | Path, origin: str) -> Path:
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    detail = "\n".join("    " + line for line in outcome.detail.splitlines()[:6])
    gpu = "" if spec.get("device", "cpu") == "cpu" else GPU
    text = TEMPLATE.format(gpu=gpu, title=outcome.signature()[:80], origin=origin,
                           n_ops=len(spec["ops"]), detail=detail, key=key,
                           spec=pprint.pformat(spec, width=96, sort_dicts=True))
    path = Path(out_dir) / f"test_fuzz_{key}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
