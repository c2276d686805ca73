// The output cache (see output_cache.h).
#include "cpu/output_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/environment.h"

namespace torch_bn_grad::cpu {
namespace {

// Smaller blocks come from malloc's heap, already mapped, at no fault cost.
constexpr size_t kMinCachedBytes = size_t{1} << 20;
// Sizes are rounded up to this, so near-equal requests share blocks.
constexpr size_t kGranule = size_t{1} << 16;
constexpr int64_t kDefaultLimitBytes = int64_t{2} << 30;

// One block of memory; the context of every DataPtr the cache hands out.
struct Block {
  c10::DataPtr memory;
  size_t size;
};

class OutputCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < kMinCachedBytes) return c10::GetCPUAllocator()->allocate(nbytes);
    const size_t size = (nbytes + kGranule - 1) / kGranule * kGranule;
    Block* block = take(size);
    if (block == nullptr) block = new Block{c10::GetCPUAllocator()->allocate(size), size};
    return {block->memory.get(), block, &OutputCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  OutputCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {limit_, idle_bytes_, static_cast<int64_t>(idle_.size()), hits_, misses_};
  }

  void set_limit(int64_t bytes) {
    TORCH_CHECK_VALUE(bytes >= 0, "set_output_cache_limit: expected bytes >= 0, got ", bytes);
    std::vector<std::unique_ptr<Block>> evicted;
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes;
    evict_until_fits(limit_, 0, evicted);
  }

  void clear() {
    std::vector<std::unique_ptr<Block>> evicted;
    std::lock_guard<std::mutex> lock(mutex_);
    evict_until_fits(0, 0, evicted);
  }

  static OutputCache& instance() {
    // Never destroyed: outputs may outlive static destruction at exit.
    static OutputCache* cache = new OutputCache();
    return *cache;
  }

 private:
  OutputCache() : limit_(megabytes_from_environment("TORCH_BN_GRAD_OUTPUT_CACHE_MB", kDefaultLimitBytes)) {}

  // The most recently freed idle block of exactly `size` bytes, or null.
  Block* take(size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
      if ((*it)->size == size) {
        Block* block = it->release();
        idle_.erase(std::next(it).base());
        idle_bytes_ -= static_cast<int64_t>(size);
        ++hits_;
        return block;
      }
    }
    ++misses_;
    return nullptr;
  }

  static void release(void* context) {
    std::unique_ptr<Block> block(static_cast<Block*>(context));
    instance().keep(std::move(block));
  }

  // Keeps a freed block, evicting the oldest idle ones to stay within the
  // limit; memory is returned to the system outside the lock.
  void keep(std::unique_ptr<Block> block) {
    std::vector<std::unique_ptr<Block>> evicted;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto size = static_cast<int64_t>(block->size);
    if (size > limit_) {
      evicted.push_back(std::move(block));
      return;
    }
    evict_until_fits(limit_, size, evicted);
    idle_bytes_ += size;
    idle_.push_back(std::move(block));
  }

  // Moves the oldest idle blocks to `evicted` until `incoming` more bytes fit
  // within `budget`; the caller frees them once the lock is released.
  void evict_until_fits(int64_t budget, int64_t incoming, std::vector<std::unique_ptr<Block>>& evicted) {
    size_t drop = 0;
    while (drop < idle_.size() && idle_bytes_ + incoming > budget) {
      idle_bytes_ -= static_cast<int64_t>(idle_[drop]->size);
      evicted.push_back(std::move(idle_[drop++]));
    }
    idle_.erase(idle_.begin(), idle_.begin() + static_cast<std::ptrdiff_t>(drop));
  }

  std::mutex mutex_;
  int64_t limit_;
  int64_t idle_bytes_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  std::vector<std::unique_ptr<Block>> idle_;  // oldest first
};

}  // namespace

c10::Allocator* output_allocator() { return &OutputCache::instance(); }

}  // namespace torch_bn_grad::cpu

namespace torch_bn_grad {

OutputCacheStats output_cache_stats() { return cpu::OutputCache::instance().stats(); }

void set_output_cache_limit(int64_t bytes) { cpu::OutputCache::instance().set_limit(bytes); }

void empty_output_cache() { cpu::OutputCache::instance().clear(); }

}  // namespace torch_bn_grad
