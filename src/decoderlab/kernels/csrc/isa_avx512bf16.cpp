// The bfloat16 weight product by AVX512-BF16's vdpbf16ps (Intel Cooper Lake, Sapphire Rapids and later, AMD Zen 4
// and later): compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16, called only where cpuid says
// the CPU has them beside AVX512-VNNI (ops.cpp's "avx512-bf16" set). As ggml's ggml_vec_dot_bf16: the activations
// rounded to bfloat16 (ops.cpp), each vdpbf16ps adds two exact products into a float32 lane (inputs and outputs
// below float32's normal range flushed to zero, as the instruction does), 32 weights an instruction.
#include <immintrin.h>

#include "common.h"

namespace {

#include "sums512.h"

inline __m512bh load_bh(const dlk::bf16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh(const dlk::bf16_t* p, int64_t n) {  // n < 32 values, the rest zero
  return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
}

// RW weight rows read once for NB activation rows: RW x NB accumulators. A decode step (few activation rows) reads
// one weight row at a time, start to end -- one stream for the hardware prefetcher: four rows side by side (four
// streams) read SmolLM2's step at half that rate on an AVX-512 EPYC (2026-12-07: 23.6 vs 10.9 ms; llama.cpp's
// 12.1). With more activation rows the products, not the reads, bound a pass: four weight rows share each
// activation load (half the loads of one row's pass).
template <int RW, int NB>
void tile(const dlk::bf16_t* w, int64_t in, const dlk::bf16_t* x, int64_t ldx, float* y, int64_t ldy) {
  __m512 acc[RW][NB];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < NB; ++a) acc[r][a] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    __m512bh wv[RW];
    for (int r = 0; r < RW; ++r) wv[r] = load_bh(w + r * in + k);
    for (int a = 0; a < NB; ++a) {
      const __m512bh xv = load_bh(x + a * ldx + k);
      for (int r = 0; r < RW; ++r) acc[r][a] = _mm512_dpbf16_ps(acc[r][a], wv[r], xv);
    }
  }
  if (k < in) {
    __m512bh wv[RW];
    for (int r = 0; r < RW; ++r) wv[r] = load_bh(w + r * in + k, in - k);
    for (int a = 0; a < NB; ++a) {
      const __m512bh xv = load_bh(x + a * ldx + k, in - k);
      for (int r = 0; r < RW; ++r) acc[r][a] = _mm512_dpbf16_ps(acc[r][a], wv[r], xv);
    }
  }
  float sums[RW * NB];
  sums16<RW * NB>(&acc[0][0], sums);
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < NB; ++a) y[a * ldy + r] = sums[r * NB + a];
}

template <int RW>
void rows(const dlk::bf16_t* w, int64_t in, const dlk::bf16_t* x, int64_t ldx, int n_act, float* y, int64_t ldy) {
  int a0 = 0;
  for (; n_act - a0 >= 4; a0 += 4) tile<RW, 4>(w, in, x + a0 * ldx, ldx, y + a0 * ldy, ldy);
  if (n_act - a0 == 3) tile<RW, 3>(w, in, x + a0 * ldx, ldx, y + a0 * ldy, ldy);
  if (n_act - a0 == 2) tile<RW, 2>(w, in, x + a0 * ldx, ldx, y + a0 * ldy, ldy);
  if (n_act - a0 == 1) tile<RW, 1>(w, in, x + a0 * ldx, ldx, y + a0 * ldy, ldy);
}

// activation rows from which four weight rows go together
constexpr int kFourRowsFrom = 4;
// there the products bound a pass, not the reads: the weight rows this many ahead are asked into L2 while these
// are multiplied, so that memory and arithmetic overlap (AVX-512 EPYC, 2026-12-07: SmolLM2's 211 products for 8
// rows 42-53 -> 28-29 ms; 4 to 32 rows ahead alike)
constexpr int64_t kAhead = 8;

// a prompt's rows in blocks that stay in L2 while the weight rows pass over them
void product(const void* weight, int64_t in, int64_t r0, int64_t r1, const void* xv, int64_t ldx, int n_act,
             float* y, int64_t ldy) {
  const auto* w = static_cast<const dlk::bf16_t*>(weight);
  for (int a0 = 0; a0 < n_act; a0 += 64) {
    const int n = n_act - a0 < 64 ? n_act - a0 : 64;
    const auto* x = static_cast<const dlk::bf16_t*>(xv) + a0 * ldx;
    int64_t r = r0;
    if (n >= kFourRowsFrom)
      for (; r + 4 <= r1; r += 4) {
        if (r + kAhead + 4 <= r1) dlk::ask_l2(w + (r + kAhead) * in, 4 * in * 2);
        rows<4>(w + r * in, in, x, ldx, n, y + a0 * ldy + r, ldy);
      }
    for (; r < r1; ++r) rows<1>(w + r * in, in, x, ldx, n, y + a0 * ldy + r, ldy);
  }
}

}  // namespace

dlk::DenseKernel dlk::dense_bf16_avx512bf16() { return product; }
