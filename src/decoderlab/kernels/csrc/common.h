// What the dispatching file (ops.cpp) and each instruction set's file share: plain pointers, no torch, no
// intrinsics -- so that no inline function compiled for one instruction set is linked into another's callers.
#pragma once
#include <cstdint>
#include <vector>

namespace dlk {

// output rows per packed group: one per 32-bit lane of a 512-bit register (pack.py's ROWS)
constexpr int kRows = 16;

// ask `bytes` at p into L2 (prefetcht1 on x86: the same instruction whatever the set a file is compiled for), a
// cache line at a time: a pass over several activation rows asks for the weight rows after its own (dense_kernels.h)
inline void ask_l2(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
}

// a thread's buffer, kept between calls: it only grows, so that a product allocates nothing but its output
template <typename T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// 16-bit weights as their bits (the float16 and bfloat16 of a torch tensor)
struct f16_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

// One activation row quantized to 8-bit blocks (ggml's q8_0 / q8_1 / q8_K, held apart), with the per-block
// integers and floats the kernels add to a block's dot product precomputed once per row, so that a kernel reads
// each as a broadcast from memory:
//   qs:  the int8 quants, the row's width of them
//   d:   one float scale per block (q8_0 / q8_1: the float16 scale as a float; q8_K: its float32 scale)
//   32-weight blocks (q8_0 / q8_1), per block: sum(q) times 8 (q4_0's offset), 16 (q5_0's) and 128 (q8_0's
//   quants stored + 128), and d * sum(q) (q4_1 / q5_1's minimum; exact in float32: an 11-bit d by a 12-bit sum)
//   256-weight super-blocks (q8_K), per super-block: 32 times its 16 sums of 16 (q6_k's offset), and its 8 sums
//   of 32 as int16 pairs in 4 int32 words (q4_k / q5_k's minimums, by vpdpwssd / vpmaddwd)
struct Act {
  const int8_t* qs;
  const float* d;
  const int32_t* s8;
  const int32_t* s16;
  const int32_t* s128;
  const float* ds;
  const int32_t* bs16x32;
  const int32_t* bs32;
};

// The raw results of quantizing one row, which ops.cpp turns into an Act: quants, scales and integer sums (32-weight
// blocks: one sum a block; 256: the 16 sums of 16 a super-block)
typedef void (*Quantizer)(const float* x, int64_t k, int8_t* qs, float* d, int32_t* sums);
// n float32 values rounded to bfloat16, to nearest, ties to even (ggml's GGML_FP32_TO_BF16; a NaN stays a NaN)
typedef void (*ToBF16)(const float* x, int64_t n, bf16_t* out);

// y[a * ldy + 16 g + lane] for packed groups g in [g0, g1), of a block weight of `nblk` blocks a row, times
// `n_act` activation rows
typedef void (*BlockKernel)(const uint8_t* packed, int64_t nblk, int64_t g0, int64_t g1, const Act* act,
                            int n_act, float* y, int64_t ldy);
// y[a * ldy + r] for weight rows r in [r0, r1) of a row-major (out, in) float32 / float16 / bfloat16 weight,
// times `n_act` rows x[a * ldx + k]: float32 rows; for a bfloat16 weight the rows already rounded to bfloat16 (as
// float32 values, or as bfloat16 where the table's bf16_x_float is false)
typedef void (*DenseKernel)(const void* w, int64_t in, int64_t r0, int64_t r1, const void* x, int64_t ldx,
                            int n_act, float* y, int64_t ldy);

struct KernelSet {
  const char* name;
  BlockKernel q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k;
  DenseKernel f32, f16, bf16;
  Quantizer quantize32, quantize256;
  ToBF16 to_bf16;
  // whether the bf16 kernel takes its activations (rounded to bfloat16) widened to float32, or as bfloat16
  bool bf16_x_float = true;
};

// each instruction set's table (isa_*.cpp, compiled with that set's flags)
const KernelSet* kernels_avx2();
const KernelSet* kernels_avxvnni();
const KernelSet* kernels_avx512vnni();
// the bfloat16 product by AVX512-BF16's vdpbf16ps (isa_avx512bf16.cpp), for CPUs that have it beside AVX512-VNNI
DenseKernel dense_bf16_avx512bf16();
// the bfloat16 product by AMX's tdpbf16ps (isa_amx.cpp), for CPUs with AMX-TILE and AMX-BF16 beside AVX512-BF16
DenseKernel dense_bf16_amx();

}  // namespace dlk
