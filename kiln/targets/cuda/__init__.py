"""The CUDA target (NVIDIA GPUs): Triton kernels and cubins, the CUDA wrapper, its stage list
(stages.py) and its model-side header (include/kiln_cuda_rt.h)."""
