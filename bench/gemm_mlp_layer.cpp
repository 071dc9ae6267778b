// bench/gemm_mlp_layer.cpp: one mlp layer (C = relu(A @ W^T + bias), A 64 x 1024, W 1024 x
// 1024 prepacked) on kiln's packed GEMM (kr::gemm_cpp_packed), several tiles, interleaved.
//   g++ -O3 -std=c++17 -march=native -pthread -Ikiln/runtime/model -Ikiln/runtime/include \
//       bench/gemm_mlp_layer.cpp -o /tmp/gml && OMP_NUM_THREADS=2 /tmp/gml [M N K rounds]
#include "kiln_model_rt.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <functional>
#include <string>

using clk = std::chrono::steady_clock;
static int64_t M = 64, N = 1024, K = 1024;
static std::vector<float> A, W, bias, C, Bp;

template <int NR, int MR, int KC, int O>
static void run() {
  const float *b = bias.data();
  float *c = C.data();
  const int64_t n = N;
  kr::gemm_cpp_packed<float, NR, MR, KC, O>(1, 1, M, N, K, A.data(), 0, 0, K, 1, Bp.data(), c,
      [=](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
        for (int64_t r = r0; r < r1; ++r) {
#pragma omp simd
          for (int64_t j = c0; j < c1; ++j) {
            const float v = c[r * n + j] + b[j];
            c[r * n + j] = v > 0 ? v : 0;
          }
        }
      });
}

int main(int argc, char **argv) {
  if (argc > 3) { M = atoll(argv[1]); N = atoll(argv[2]); K = atoll(argv[3]); }
  const int rounds = argc > 4 ? atoi(argv[4]) : 15;
  kr::Pool pool;
  kr::RunScope scope(&pool);
  constexpr int NR = 2 * kr::Vec<float>::width;
  A.resize(M * K); W.resize(N * K); bias.resize(N); C.resize(M * N);
  Bp.resize((N + NR - 1) / NR * NR * K);
  uint64_t s = 88172645463325252ull;
  auto rnd = [&]() { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return float((s >> 11) * 0x1p-53 - 0.5); };
  for (auto &x : A) x = rnd();
  for (auto &x : W) x = rnd();
  for (auto &x : bias) x = rnd();
  kr::pack_b_panels<float, NR>(K, N, W.data(), 1, K, Bp.data());
  struct V { std::string name; std::function<void()> f; std::vector<double> t; };
  std::vector<V> vs = {
    {"rows_mr12_kc256", run<NR, 12, 256, 1>}, {"rows_mr8_kc256", run<NR, 8, 256, 1>},
    {"rows_mr6_kc256", run<NR, 6, 256, 1>}, {"rows_mr8_kc512", run<NR, 8, 512, 1>},
    {"cols_mr12_kc256", run<NR, 12, 256, 2>}, {"cols_mr8_kc256", run<NR, 8, 256, 2>},
    {"cols_mr6_kc256", run<NR, 6, 256, 2>}, {"cols_mr12_kc128", run<NR, 12, 128, 2>},
    {"cols_mr8_kc128", run<NR, 8, 128, 2>}, {"cols_mr12_kc384", run<NR, 12, 384, 2>},
  };
  // check against a double reference
  for (auto &v : vs) {
    std::fill(C.begin(), C.end(), 123.f);
    v.f();
    double err = 0;
    for (int64_t i = 0; i < M; i += 7)
      for (int64_t j = 0; j < N; j += 13) {
        double r = bias[j];
        for (int64_t k = 0; k < K; ++k) r += double(A[i * K + k]) * W[j * K + k];
        r = r > 0 ? r : 0;
        err = std::max(err, std::abs(r - C[i * N + j]));
      }
    if (err > 1e-3) { std::printf("%s: error %g\n", v.name.c_str(), err); return 1; }
  }
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < vs.size(); ++i) {
      auto &v = vs[(i + r) % vs.size()];
      v.f();
      const auto t0 = clk::now();
      int it = 0;
      do { v.f(); ++it; } while (std::chrono::duration<double>(clk::now() - t0).count() < 0.05);
      v.t.push_back(std::chrono::duration<double>(clk::now() - t0).count() / it);
    }
  const double flop = 2.0 * M * N * K;
  for (auto &v : vs) {
    std::sort(v.t.begin(), v.t.end());
    std::printf("%-14s median %8.1f us  min %8.1f us  %6.1f GFLOP/s (median)\n", v.name.c_str(),
                v.t[v.t.size() / 2] * 1e6, v.t[0] * 1e6, flop / v.t[v.t.size() / 2] * 1e-9);
  }
}
