// Host driver of csrc/math/compensated.h for tests/cuda/test_cuda_statistics_accuracy.py: runs the
// CUDA kernels' schedule on the host (blocks of threads, each thread reading
// every threads-th vector of N values of its block, lanes folded, threads
// merged in a tree, block partials merged with Chan's formula in float64).
//
//   compensated_driver f|d moments FILE COUNT BLOCKS THREADS N    -> mean m2 count
//   compensated_driver f|d grad FILE COUNT BLOCKS THREADS N MEAN  -> sum_dy sum_dy_xc
// FILE: COUNT values of x (then COUNT of dy for grad), float32 (f) or float64 (d).
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "math/compensated.h"

namespace math = torch_bn_grad::math;

template <typename S>
S tree(std::vector<S> s) {  // pairwise, as the warp and block reductions
  if (s.empty()) return S{};
  for (size_t half = 1; half < s.size(); half *= 2)
    for (size_t i = 0; i + half < s.size(); i += 2 * half) s[i] = math::merge(s[i], s[i + half]);
  return s[0];
}

template <typename A>
int run(bool grad, const char* path, long count, long blocks, long threads, int n, double mean_arg) {
  std::vector<A> x(count), dy(grad ? count : 0);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(x.data(), sizeof(A), count, f) != size_t(count) ||
      (grad && std::fread(dy.data(), sizeof(A), count, f) != size_t(count)))
    return 2;
  std::fclose(f);
  const A centre = count > 0 ? x[0] : A(0);  // the channel's first value
  const A mean = static_cast<A>(mean_arg);
  const long per_block = (count + blocks - 1) / blocks;
  math::Moments<double, int64_t> moments{0, 0.0, 0.0};
  math::GradSums<double> sums{0.0, 0.0};
  for (long b = 0; b < blocks; ++b) {
    const long lo = b * per_block, hi = std::min(count, lo + per_block);
    std::vector<math::ShiftedSums<A>> states(threads);
    std::vector<math::ExactGradSums<A>> grads(threads);
    for (long t = 0; t < threads; ++t) {
      std::vector<math::ShiftedSums<A>> lanes(n);
      std::vector<math::ExactGradSums<A>> glanes(n);
      for (long v = lo + t * n; v < hi; v += threads * n)
        for (int j = 0; j < n && v + j < hi; ++j) {
          math::add(lanes[j], x[v + j], centre);
          math::add_grad(glanes[j].dy, glanes[j].dy_xc, x[v + j], grad ? dy[v + j] : A(0), mean);
        }
      states[t] = lanes[0];
      grads[t] = glanes[0];
      for (int j = 1; j < n; ++j) {
        states[t] = math::merge(states[t], lanes[j]);
        grads[t] = math::merge(grads[t], glanes[j]);
      }
    }
    moments = math::merge(moments, math::shifted_moments(tree(states), centre));
    sums = math::merge(sums, math::grad_sums_of(tree(grads)));
  }
  if (grad) std::printf("%.17g %.17g\n", sums.sum_dy, sums.sum_dy_xc);
  else std::printf("%.17g %.17g %lld\n", moments.mean, moments.m2, static_cast<long long>(moments.count));
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 8) return 2;
  const bool grad = argv[2][0] == 'g';
  const long count = std::atol(argv[4]), blocks = std::atol(argv[5]), threads = std::atol(argv[6]);
  const int n = std::atoi(argv[7]);
  const double mean = argc > 8 ? std::atof(argv[8]) : 0.0;
  return argv[1][0] == 'd' ? run<double>(grad, argv[3], count, blocks, threads, n, mean)
                           : run<float>(grad, argv[3], count, blocks, threads, n, mean);
}
