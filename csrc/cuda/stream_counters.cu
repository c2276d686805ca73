#include "cuda/stream_counters.h"

#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>
#include <unordered_map>

namespace torch_bn_grad::cuda {
namespace {

struct StreamKey {
  c10::DeviceIndex device;
  c10::StreamId stream;
  bool operator==(const StreamKey& o) const { return device == o.device && stream == o.stream; }
};

struct StreamKeyHash {
  size_t operator()(const StreamKey& k) const {
    return std::hash<int64_t>()(k.stream) * 31 + static_cast<size_t>(k.device);
  }
};

// Never destroyed: the tensors would otherwise be freed after the CUDA
// runtime has gone at exit.
struct Workspaces {
  std::mutex mutex;
  std::unordered_map<StreamKey, at::Tensor, StreamKeyHash> counters;
};

Workspaces& workspaces() {
  static Workspaces* w = new Workspaces();
  return *w;
}

}  // namespace

unsigned* stream_counters(int64_t count) {
  if (count > kMaxStreamCounters) return nullptr;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return nullptr;
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  Workspaces& w = workspaces();
  const std::lock_guard<std::mutex> lock(w.mutex);
  at::Tensor& t = w.counters[StreamKey{stream.device_index(), stream.id()}];
  if (!t.defined() || t.numel() < count) {
    int64_t n = 1024;
    while (n < count) n *= 2;
    // Filled on the current stream, before any kernel of it takes them. The
    // tensor replaced, if any, was allocated on this stream too, so the
    // caching allocator reuses its memory only after its kernels.
    t = at::zeros({n}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, stream.device_index()));
  }
  return reinterpret_cast<unsigned*>(t.mutable_data_ptr<int32_t>());
}

}  // namespace torch_bn_grad::cuda
