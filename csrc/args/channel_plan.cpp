// The channel plan (channel_plan.h): kept dims and the order of src's dims.
#include "args/channel_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace torch_bn_grad {

std::vector<bool> kept_dims(const char* op, const at::Tensor& src, const at::Tensor* ref,
                            const char* ref_name, c10::string_view data_format,
                            std::vector<int64_t>& stats_shape) {
  const int64_t rank = src.dim();
  std::vector<bool> kept(rank, false);
  const bool broadcast_form = ref != nullptr && ref->dim() == rank && (rank == 1 || ref->dim() >= 2);
  if (broadcast_form) {
    for (int64_t d = 0; d < rank; ++d) {
      const int64_t s = ref->size(d);
      TORCH_CHECK_VALUE(s == 1 || s == src.size(d), op, ": ", ref_name, " has src's rank ", rank,
                        " (broadcast form), so each of its dims must be 1 or equal src's; dim ",
                        d, " must be 1 or ", src.size(d), ", got ", s, " (", ref_name, " shape ",
                        ref->sizes(), ", src shape ", src.sizes(), ")");
      kept[d] = s != 1;
    }
    stats_shape = ref->sizes().vec();
    return kept;
  }
  TORCH_CHECK_VALUE(rank >= 2, op, ": src of rank 1 takes the broadcast form: ",
                    ref != nullptr ? ref_name : "mean/variance or gamma/beta",
                    " must have shape (L,) or (1,), got ",
                    ref != nullptr ? c10::str(ref->sizes()) : std::string("none"));
  const int64_t axis = data_format == "NCX" ? 1 : rank - 1;
  const int64_t channels = src.size(axis);
  if (ref != nullptr) {
    TORCH_CHECK_VALUE(ref->dim() == 1, op, ": ", ref_name, " must be 1-D of length C or have src's rank ",
                      rank, ", got shape ", ref->sizes());
    TORCH_CHECK_VALUE(ref->size(0) == channels, op, ": ", ref_name, " must have shape [", channels,
                      "] (C is dim ", axis, " of src shape ", src.sizes(), " for data_format='",
                      std::string(data_format), "'), got ", ref->sizes());
  }
  kept[axis] = true;
  stats_shape = {channels};
  return kept;
}

namespace {
int64_t product(const at::Tensor& t, const std::vector<int64_t>& dims, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= t.size(dims[i]);
  return p;
}
}  // namespace

ChannelPlan build_plan(const at::Tensor& src, const std::vector<bool>& kept,
                       std::vector<int64_t> stats_shape) {
  const int64_t rank = src.dim();
  std::vector<int64_t> unit, logical;
  for (int64_t d = 0; d < rank; ++d) (src.size(d) == 1 ? unit : logical).push_back(d);

  auto kept_is_run = [&](const std::vector<int64_t>& order, size_t& begin, size_t& end) {
    begin = order.size();
    end = order.size();
    for (size_t i = 0; i < order.size(); ++i) {
      if (!kept[order[i]]) continue;
      if (begin == order.size()) begin = i;
      else if (end != i) return false;  // a gap since the run ended
      end = i + 1;
    }
    if (begin == order.size()) end = begin;  // no kept dim
    return true;
  };

  std::vector<int64_t> order = logical;
  if (src.is_non_overlapping_and_dense()) {
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return src.stride(a) > src.stride(b); });
  }
  size_t begin = 0, end = 0;
  if (!kept_is_run(order, begin, end)) {
    order = logical;
    if (!kept_is_run(order, begin, end)) {
      order.clear();
      for (int64_t d : logical) if (!kept[d]) order.push_back(d);
      for (int64_t d : logical) if (kept[d]) order.push_back(d);
      kept_is_run(order, begin, end);
    }
  }

  ChannelPlan plan;
  plan.permutation = unit;
  plan.permutation.insert(plan.permutation.end(), order.begin(), order.end());
  if (begin == end) {
    // Nothing kept: one channel over everything, read as one long row.
    plan.outer = 1;
    plan.channels = 1;
    plan.inner = product(src, order, 0, order.size());
  } else {
    plan.outer = product(src, order, 0, begin);
    plan.channels = product(src, order, begin, end);
    plan.inner = product(src, order, end, order.size());
  }
  plan.kept_kernel.assign(order.begin() + begin, order.begin() + end);
  plan.kept_logical = plan.kept_kernel;
  std::sort(plan.kept_logical.begin(), plan.kept_logical.end());
  plan.stats_shape = std::move(stats_shape);
  return plan;
}

}  // namespace torch_bn_grad
