"""Import cost of kiln's compiler in a fresh process (issue 15 item 3: the "rest" of a cold
CUDA compile): torch, kiln, kiln.api (what the first kiln.compile imports), the CUDA target's
modules, torch.export's tracer; and whether Python writes bytecode here.

    python scripts/diag_imports.py
"""
import os
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
t1 = time.perf_counter()
import kiln  # noqa: E402,F401
from kiln.models import get  # noqa: E402,F401
t2 = time.perf_counter()
import kiln.api  # noqa: E402,F401
t3 = time.perf_counter()
import kiln.targets.cuda.stages  # noqa: E402,F401
t4 = time.perf_counter()
import torch.export._trace  # noqa: E402,F401
t5 = time.perf_counter()
print(f"dont_write_bytecode={sys.flags.dont_write_bytecode} "
      f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE')!r} "
      f"pycache_prefix={sys.pycache_prefix!r}; import torch {t1 - t0:.2f} s, kiln+zoo "
      f"{t2 - t1:.2f}, kiln.api {t3 - t2:.2f}, CUDA target {t4 - t3:.2f}, torch.export._trace "
      f"{t5 - t4:.2f}", flush=True)
