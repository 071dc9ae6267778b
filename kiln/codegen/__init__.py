"""Printers: C++ kernels from schedules, and the C++ / Python wrappers from Program IR."""
