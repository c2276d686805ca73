// Vector loads and stores of the CUDA kernels: N consecutive elements of the
// data type, converted to or from the accumulation type.
#pragma once

namespace torch_bn_grad::cuda {

// N consecutive elements, moved with one instruction when N * sizeof(T) == 16.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T, typename A>
__device__ __forceinline__ void load(const T* p, A (&out)[N]) {
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = static_cast<A>(pack.v[j]);
}

template <int N, typename T, typename A>
__device__ __forceinline__ void store(T* p, const A (&in)[N]) {
  Pack<T, N> pack;
#pragma unroll
  for (int j = 0; j < N; ++j) pack.v[j] = static_cast<T>(in[j]);
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

// The per-channel values of the N channels that column group `column` owns
// (columns of a channels-innermost array, inner == 1).
template <typename A, int N>
__device__ __forceinline__ void load_columns(const A* __restrict__ values, int64_t column, A (&out)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = values[column * N + j];
}

}  // namespace torch_bn_grad::cuda
