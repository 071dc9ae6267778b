"""The CPU target: C++ kernels, the C++ and Python wrappers, the host toolchain, its stage list
(stages.py) and its model-side header (include/kiln_lib.h)."""
