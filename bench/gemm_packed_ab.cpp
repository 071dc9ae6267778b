// bench/gemm_packed_ab.cpp: kiln's packed GEMM as a package calls it (kr::gemm_cpp_packed
// with its default loop choice and a bias + ReLU epilogue), over mlp and hf_bert_base shapes.
// Built against two trees' headers and run alternately by bench/gemm_packed_ab.py (A/B of
// kiln_gemm.h). Prints "M N K median_us" per shape.
//   g++ -O3 -std=c++17 -march=native -pthread -IROOT/kiln/runtime/model \
//       -IROOT/kiln/runtime/include bench/gemm_packed_ab.cpp -o /tmp/gab && /tmp/gab [secs]
#include "kiln_model_rt.h"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

using clk = std::chrono::steady_clock;
constexpr int NR = 2 * kr::Vec<float>::width, MR = kr::kVecBytes == 64 ? 12 : 6;

int main(int argc, char **argv) {
  const double secs = argc > 1 ? atof(argv[1]) : 0.2;
  kr::Pool pool;
  kr::RunScope scope(&pool);
  const int64_t shapes[][3] = {{64, 1024, 1024}, {64, 256, 1024}, {128, 768, 768},
                               {128, 3072, 768}, {128, 768, 3072}, {1, 768, 768},
                               {8, 768, 768},    {16, 768, 768},   {16, 3072, 768}};
  for (auto &sh : shapes) {
    const int64_t M = sh[0], N = sh[1], K = sh[2];
    std::vector<float> A(M * K), W(N * K), bias(N), C(M * N), Bp((N + NR - 1) / NR * NR * K);
    uint64_t s = 88172645463325252ull;
    auto rnd = [&]() { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return float((s >> 11) * 0x1p-53 - 0.5); };
    for (auto &x : A) x = rnd();
    for (auto &x : W) x = rnd();
    for (auto &x : bias) x = rnd();
    kr::pack_b_panels<float, NR>(K, N, W.data(), 1, K, Bp.data());
    const float *b = bias.data();
    float *c = C.data();
    auto run = [&]() {
      kr::gemm_cpp_packed<float, NR, MR, 256>(1, 1, M, N, K, A.data(), 0, 0, K, 1, Bp.data(), c,
          [=](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
            for (int64_t r = r0; r < r1; ++r)
#pragma omp simd
              for (int64_t j = c0; j < c1; ++j) {
                const float v = c[r * N + j] + b[j];
                c[r * N + j] = v > 0 ? v : 0;
              }
          });
    };
    run();
    double err = 0;  // spot check against double
    for (int64_t i = 0; i < M; i += 7)
      for (int64_t j = 0; j < N; j += 13) {
        double r = bias[j];
        for (int64_t k = 0; k < K; ++k) r += double(A[i * K + k]) * W[j * K + k];
        err = std::max(err, std::abs((r > 0 ? r : 0) - C[i * N + j]));
      }
    if (err > 1e-3) { std::printf("error %g at %ld %ld %ld\n", err, (long)M, (long)N, (long)K); return 1; }
    std::vector<double> t;
    const auto t0 = clk::now();
    while (std::chrono::duration<double>(clk::now() - t0).count() < secs) {
      const auto t1 = clk::now();
      run();
      t.push_back(std::chrono::duration<double>(clk::now() - t1).count());
    }
    std::sort(t.begin(), t.end());
    std::printf("%ld %ld %ld %.2f\n", (long)M, (long)N, (long)K, t[t.size() / 2] * 1e6);
  }
}
