// What the dispatching file (ops.cpp) and each instruction set's file share: plain pointers, no torch, no
// intrinsics -- so that no inline function compiled for one instruction set is linked into another's callers.
#pragma once
#include <cstdint>

namespace dlk {

// output rows per packed group: one per 32-bit lane of a 512-bit register (pack.py's ROWS)
constexpr int kRows = 16;

// 16-bit weights as their bits (the float16 and bfloat16 of a torch tensor)
struct f16_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

// One activation row quantized to 8-bit blocks (ggml's q8_0 / q8_1 / q8_K, held apart):
//   qs: the int8 quants, the row's width of them
//   d:  one float scale per block (q8_0 / q8_1: the float16 scale as a float; q8_K: its float32 scale)
//   s:  per block, the integer sums: q8_0 / q8_1 one (the sum of the block's 32 quants); q8_K 24 (the sums of
//       its 16 runs of 16 quants, then of its 8 runs of 32)
struct Act {
  const int8_t* qs;
  const float* d;
  const int32_t* s;
};

// y[a * ldy + 16 g + lane] for packed groups g in [g0, g1), of a block weight of `nblk` blocks a row, times
// `n_act` activation rows
typedef void (*BlockKernel)(const uint8_t* packed, int64_t nblk, int64_t g0, int64_t g1, const Act* act,
                            int n_act, float* y, int64_t ldy);
// y[a * ldy + r] for weight rows r in [r0, r1) of a row-major (out, in) float32 / float16 / bfloat16 weight,
// times `n_act` float32 rows x[a * ldx + k]
typedef void (*DenseKernel)(const void* w, int64_t in, int64_t r0, int64_t r1, const float* x, int64_t ldx,
                            int n_act, float* y, int64_t ldy);

struct KernelSet {
  const char* name;
  BlockKernel q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k;
  DenseKernel f32, f16, bf16;
};

// each instruction set's table (isa_*.cpp, compiled with that set's flags)
const KernelSet* kernels_avx2();
const KernelSet* kernels_avxvnni();
const KernelSet* kernels_avx512vnni();

}  // namespace dlk
