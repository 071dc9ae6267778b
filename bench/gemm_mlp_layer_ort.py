"""ONNX Runtime on one mlp layer (Gemm: C = A @ W^T + bias, A M x K, W N x K), the peer figure
for bench/gemm_mlp_layer.cpp: `python bench/gemm_mlp_layer_ort.py [M N K] --threads T`."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shape", nargs="*", type=int, default=[64, 1024, 1024])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--relu", action="store_true")
    a = p.parse_args()
    m, n, k = a.shape
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k), dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y0" if a.relu else "y"], transB=1)]
    if a.relu:
        nodes.append(helper.make_node("Relu", ["y0"], ["y"]))
    g = helper.make_graph(nodes, "layer",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((m, k), dtype=np.float32)
    feeds = {"x": x}
    ts = []
    for _ in range(3):
        sess.run(None, feeds)
    for _ in range(a.rounds):
        t0, it = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.05:
            sess.run(None, feeds)
            it += 1
        ts.append((time.perf_counter() - t0) / it)
    med = statistics.median(ts)
    print(f"ort {m}x{n}x{k} thr {a.threads}: median {med * 1e6:8.1f} us  min {min(ts) * 1e6:8.1f}"
          f" us  {2 * m * n * k / med * 1e-9:6.1f} GFLOP/s (median)")


if __name__ == "__main__":
    main()
