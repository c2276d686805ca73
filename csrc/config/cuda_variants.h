// CUDA variants: code paths compiled into every CUDA build whose results or
// speed a GPU has not yet confirmed, each off until asked for by name
// (TORCH_BN_GRAD_CUDA_VARIANTS or torch_bn_grad.config.cuda_variants, which
// sets this registry). The host code that plans a launch asks
// cuda_variant_on(); a variant that a GPU run proves becomes the default
// there and its switch is removed (docs/design.md, "CUDA variants").
// Process-wide, read without a lock; built in CPU-only builds too, where no
// code asks for a variant.
#pragma once

#include <string>
#include <vector>

namespace torch_bn_grad {

// Every variant: X(enumerator, name). The name is what users and the GPU
// check (scripts/gpu_check.sh variants) call it.
// fused_update: the running-statistics update in the training forward's kernels.
// param_dtype_grads: a half-precision model's parameters into the backward
// kernels uncast, their gradients out in their dtype (autograd/channel_algebra.h).
// last_block_coefficients: the two-kernel path's coefficients stored by the
// last block of its first stage (cuda/last_block.cuh): two launches, not three.
#define TBG_CUDA_VARIANTS(X)                \
  X(kFusedUpdate, "fused_update")           \
  X(kParamDtypeGrads, "param_dtype_grads")  \
  X(kLastBlockCoefficients, "last_block_coefficients")

enum class CudaVariant : int {
#define TBG_CUDA_VARIANT_ENUM(id, name) id,
  TBG_CUDA_VARIANTS(TBG_CUDA_VARIANT_ENUM)
#undef TBG_CUDA_VARIANT_ENUM
};

bool cuda_variant_on(CudaVariant variant);

}  // namespace torch_bn_grad
