"""`python -m kiln.runtime [CXX]`: the install step. Builds libkiln into the installed package
(kiln/runtime/lib), so that no process ever compiles it while loading (kiln/runtime/build.py)."""
from __future__ import annotations

import sys

from kiln.runtime.build import install

if __name__ == "__main__":
    print(install(sys.argv[1] if len(sys.argv) > 1 else None))
