// What ops.cpp lends the fused decode step (decode.cpp): the kernel table in use and the products of several weights
// that share an input, as the ops block_linear_many / dense_linear_many compute them (the same numbers).
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

#include "common.h"

namespace dlk {

// the instruction set's table in use (ops.cpp's choice: $DECODERLAB_KERNELS or the best this CPU runs)
const KernelSet* kernel_set();
// x (..., k) float32 times each packed block weight (GGML type, out features): one (..., out) float32 a weight
std::vector<at::Tensor> products_of_blocks(const at::Tensor& x, const at::Tensor* packed, const int64_t* types,
                                           const int64_t* outs, size_t count);
// x (..., k) float32 times each (out, k) float32 / float16 / bfloat16 weight
std::vector<at::Tensor> products_of_dense(const at::Tensor& x, const at::Tensor* weights, size_t count);

}  // namespace dlk
