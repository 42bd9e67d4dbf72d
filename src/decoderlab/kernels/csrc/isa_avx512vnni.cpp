// AVX-512 with VNNI (Intel Cascade Lake and later, AMD Zen 4 and later): compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c, called only where cpuid says the CPU has them (ops.cpp).
// One 512-bit register holds the 16 rows of a packed group; vpdpbusd multiplies 64 byte pairs an instruction.
#include <immintrin.h>

#include <type_traits>

#include "common.h"

namespace {

inline int32_t ld32(const void* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

struct VI { __m512i v; };
struct VF { __m512 v; };
constexpr int kTile = 8;   // 32-weight blocks: 8 rows' sums and accumulators, the chunks of a block, in 32 registers
constexpr int kTileK = 8;  // super-blocks: a sub-block's sums and the super-block's, the scales
constexpr bool kQ8Biased = true;  // vpdpbusd multiplies unsigned weights: q + 128, then 128 * sum(x) taken off

inline VI vi_load(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline VI vi_zero() { return {_mm512_setzero_si512()}; }
inline VI vi_set1_8(char b) { return {_mm512_set1_epi8(b)}; }
inline VI vi_and(VI a, VI b) { return {_mm512_and_si512(a.v, b.v)}; }
inline VI vi_or(VI a, VI b) { return {_mm512_or_si512(a.v, b.v)}; }
inline VI vi_add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline VI vi_mul(VI a, VI b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline VI vi_sub_at(VI a, const int32_t* p) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(*p))}; }
template <int N> inline VI vi_srl16(VI a) { return {_mm512_srli_epi16(a.v, N)}; }
template <int N> inline VI vi_sll16(VI a) { return {_mm512_slli_epi16(a.v, N)}; }
inline VI vi_srl32(VI a, int n) { return {_mm512_srl_epi32(a.v, _mm_cvtsi32_si128(n))}; }
inline VI vi_sll32(VI a, int n) { return {_mm512_sll_epi32(a.v, _mm_cvtsi32_si128(n))}; }
inline VI vi_bit(VI h, VI m, VI v) { return {_mm512_maskz_mov_epi8(_mm512_test_epi8_mask(h.v, m.v), v.v)}; }
inline VI vi_dot(VI acc, VI w, const int8_t* x) {
  return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(ld32(x)))};
}
inline VI vi_dot_q8(VI acc, VI w, const int8_t* x) { return vi_dot(acc, w, x); }
inline VI vi_dot16(VI acc, VI w, const int32_t* x) { return {_mm512_dpwssd_epi32(acc.v, w.v, _mm512_set1_epi32(*x))}; }
typedef VI VS;  // (vpdpbusd sums into int32: the 16-bit partial sums of ymm_backend.h's AVX2 are these)
inline VS vs_zero() { return vi_zero(); }
inline VS vs_dot(VS acc, VI w, const int8_t* x) { return vi_dot(acc, w, x); }
inline VI vi_add_vs(VI acc, VS s) { return vi_add(acc, s); }
inline VI vi_u8x(__m128i b) { return {_mm512_cvtepu8_epi32(b)}; }
inline VI vi_s8x(__m128i b) { return {_mm512_cvtepi8_epi32(b)}; }
inline VI vi_pair16(__m128i a, __m128i b) {
  return {_mm512_or_si512(_mm512_cvtepu8_epi32(a), _mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 16))};
}

inline VF vf_zero() { return {_mm512_setzero_ps()}; }
inline VF vf_cvt(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline VF vf_half(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline VF vf_mul_at(VF a, const float* p) { return {_mm512_mul_ps(a.v, _mm512_set1_ps(*p))}; }
inline VF vf_fmadd(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VF vf_fmadd_at(VF a, const float* p, VF c) { return {_mm512_fmadd_ps(a.v, _mm512_set1_ps(*p), c.v)}; }
inline VF vf_fnmadd(VF a, VF b, VF c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline void vf_store(float* p, VF v) { _mm512_storeu_ps(p, v.v); }

#include "block_kernels.h"

typedef __m512 VW;
typedef __m512i VQ;
constexpr int kLanes = 16;
constexpr int kDenseTile = 4;
constexpr int64_t kDensePrefetch = 0;
inline VW vw_zero() { return _mm512_setzero_ps(); }
inline VW vw_fmadd(VW a, VW b, VW c) { return _mm512_fmadd_ps(a, b, c); }
inline VW vw_add(VW a, VW b) { return _mm512_add_ps(a, b); }
#include "sums512.h"
template <int N>
inline void vw_sums(const VW* v, float* out) { sums16<N>(v, out); }
inline VW vw_w(const float* p) { return _mm512_loadu_ps(p); }
// float16 widened as two 8-lane F16C conversions: the one 16-lane vcvtph2ps read SmolLM2's F16 step at 0.7 of this
// rate on an AVX-512 EPYC (2026-12-07: 19.3 vs 13.4 ms a token, llama.cpp's 10.4)
inline VW vw_w(const dlk::f16_t* p) {
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
inline VW vw_w(const dlk::bf16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

#include "dense_kernels.h"

inline VW vw_load(const float* p) { return _mm512_loadu_ps(p); }
inline VW vw_abs(VW v) { return _mm512_abs_ps(v); }
inline VW vw_max(VW a, VW b) { return _mm512_max_ps(a, b); }
inline float vw_hmax(VW v) { return _mm512_reduce_max_ps(v); }
inline VW vw_mul(VW a, VW b) { return _mm512_mul_ps(a, b); }
inline VW vw_set1(float f) { return _mm512_set1_ps(f); }
inline VQ vq_round(VW v) { return _mm512_cvtps_epi32(v); }
inline VQ vq_min127(VQ q) { return _mm512_min_epi32(q, _mm512_set1_epi32(127)); }
inline void vq_store8(int8_t* p, VQ q) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(q)); }
inline int32_t vq_sum(VQ q) { return _mm512_reduce_add_epi32(q); }
inline int vq_first_eq(VW v, float f) {
  const unsigned m = _mm512_cmp_ps_mask(v, _mm512_set1_ps(f), _CMP_EQ_OQ);
  return m ? __builtin_ctz(m) : -1;
}
inline void vb_round(const float* p, dlk::bf16_t* out) {
  const __m512 v = _mm512_loadu_ps(p);
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(64));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

#include "quant_kernels.h"

const dlk::KernelSet kSet = {
    "avx512-vnni",
    block_product<Q8_0>, block_product<Q32<false, false>>, block_product<Q32<true, false>>,
    block_product<Q32<false, true>>, block_product<Q32<true, true>>,
    block_product<QK45<false>>, block_product<QK45<true>>, block_product<Q6K>,
    dense_product<float>, dense_product<dlk::f16_t>, dense_product<dlk::bf16_t>,
    quantize32, quantize256, to_bf16,
};

}  // namespace

const dlk::KernelSet* dlk::kernels_avx512vnni() { return &kSet; }
