// decoderlab::pack_fields: the byte moves of kernels/pack.py's layout in one pass of C++ -- GGUF's row-major blocks
// regrouped 16 rows at a time, each field of the 16 rows' blocks side by side in chunks. NumPy's strided copies of
// 1-4 byte elements ran at 0.33 GB/s (Gemma 3's 180 MB q8_0 embedding: 0.54 s of a 2.1 s load); pack.py keeps
// them as the path where the library is not loaded, and does the rest (q5's transposed fifth bits, q6_k's
// quants, q8_0's flipped sign bits) itself. Compiled with the baseline flags.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

#include "common.h"

namespace dlk {
namespace {

template <int W>
void move_field(const uint8_t* src, uint8_t* dst, int64_t nb, int64_t bpb, int64_t first, int64_t length) {
  for (int64_t c = 0; c < length / W; ++c)
    for (int64_t r = 0; r < kRows; ++r) std::memcpy(dst + (c * kRows + r) * W, src + r * nb * bpb + first + c * W, W);
}

// blocks: (groups * 16 rows, nb blocks, bpb bytes) uint8, contiguous; fields: (first byte, length, bytes side by
// side) triplets. Returns the packed bytes, (groups, nb, 16 * bpb) flat: the fields' bytes in place, the rest of
// each packed block (q6_k's quants) left for the caller
at::Tensor pack_fields(const at::Tensor& blocks, int64_t nb, int64_t bpb, at::IntArrayRef fields) {
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.device().is_cpu() &&
                        nb > 0 && bpb > 0 && blocks.numel() % (kRows * nb * bpb) == 0 && fields.size() % 3 == 0,
                    "decoderlab::pack_fields: blocks must be contiguous uint8 CPU bytes of whole groups of 16 rows of ",
                    nb, " blocks of ", bpb, " bytes, fields triplets; got ", blocks.numel(), " bytes, ",
                    fields.size(), " field numbers");
  const int64_t groups = blocks.numel() / (kRows * nb * bpb);
  at::Tensor out = at::detail::empty_cpu({blocks.numel()}, at::kByte);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (size_t f = 0; f < fields.size(); f += 3)
    TORCH_CHECK_VALUE(fields[f] >= 0 && fields[f + 1] > 0 && fields[f] + fields[f + 1] <= bpb &&
                          (fields[f + 2] == 1 || fields[f + 2] == 2 || fields[f + 2] == 4) &&
                          fields[f + 1] % fields[f + 2] == 0,
                      "decoderlab::pack_fields: field (", fields[f], ", ", fields[f + 1], ", ", fields[f + 2],
                      ") does not fit a block of ", bpb, " bytes in chunks of 1, 2 or 4");
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* s = src + (g * kRows * nb + b) * bpb;
      uint8_t* d = dst + (g * nb + b) * kRows * bpb;
      int64_t at = 0;
      for (size_t f = 0; f < fields.size(); f += 3) {
        const int64_t first = fields[f], length = fields[f + 1], w = fields[f + 2];
        if (w == 4)
          move_field<4>(s, d + at, nb, bpb, first, length);
        else if (w == 2)
          move_field<2>(s, d + at, nb, bpb, first, length);
        else
          move_field<1>(s, d + at, nb, bpb, first, length);
        at += kRows * length;
      }
    }
  return out;
}

}  // namespace
}  // namespace dlk

TORCH_LIBRARY_IMPL(decoderlab, CPU, m) { m.impl("pack_fields", &dlk::pack_fields); }
