// AVX-512 with VNNI (Intel Cascade Lake and later, AMD Zen 4 and later): compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c, called only where cpuid says the CPU has them (ops.cpp).
// One 512-bit register holds the 16 rows of a packed group; vpdpbusd multiplies 64 byte pairs an instruction.
#include <immintrin.h>

#include "common.h"

namespace {

struct VI { __m512i v; };
struct VF { __m512 v; };
constexpr int kTile = 4;
constexpr bool kQ8Biased = true;  // vpdpbusd multiplies unsigned weights: q + 128, then 128 * sum(x) taken off

inline VI vi_load(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline VI vi_zero() { return {_mm512_setzero_si512()}; }
inline VI vi_set1_8(char b) { return {_mm512_set1_epi8(b)}; }
inline VI vi_set1_32(int32_t i) { return {_mm512_set1_epi32(i)}; }
inline VI vi_and(VI a, VI b) { return {_mm512_and_si512(a.v, b.v)}; }
inline VI vi_or(VI a, VI b) { return {_mm512_or_si512(a.v, b.v)}; }
inline VI vi_add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline VI vi_sub(VI a, VI b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline VI vi_mul(VI a, VI b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
template <int N> inline VI vi_srl16(VI a) { return {_mm512_srli_epi16(a.v, N)}; }
template <int N> inline VI vi_sll16(VI a) { return {_mm512_slli_epi16(a.v, N)}; }
inline VI vi_srl32(VI a, int n) { return {_mm512_srl_epi32(a.v, _mm_cvtsi32_si128(n))}; }
inline VI vi_sll32(VI a, int n) { return {_mm512_sll_epi32(a.v, _mm_cvtsi32_si128(n))}; }
inline VI vi_bit(VI h, VI m, VI v) { return {_mm512_maskz_mov_epi8(_mm512_test_epi8_mask(h.v, m.v), v.v)}; }
inline VI vi_dot(VI acc, VI w, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x4))}; }
inline VI vi_dot_q8(VI acc, VI w, int32_t x4) { return vi_dot(acc, w, x4); }
inline VI vi_u8x(__m128i b) { return {_mm512_cvtepu8_epi32(b)}; }
inline VI vi_s8x(__m128i b) { return {_mm512_cvtepi8_epi32(b)}; }

inline VF vf_zero() { return {_mm512_setzero_ps()}; }
inline VF vf_set1(float f) { return {_mm512_set1_ps(f)}; }
inline VF vf_cvt(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline VF vf_half(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline VF vf_mul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF vf_fmadd(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VF vf_fnmadd(VF a, VF b, VF c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline void vf_store(float* p, VF v) { _mm512_storeu_ps(p, v.v); }

#include "block_kernels.h"

typedef __m512 VW;
constexpr int kLanes = 16;
constexpr int kDenseTile = 4;
inline VW vw_zero() { return _mm512_setzero_ps(); }
inline VW vw_fmadd(VW a, VW b, VW c) { return _mm512_fmadd_ps(a, b, c); }
inline float vw_sum(VW v) { return _mm512_reduce_add_ps(v); }
inline VW vw_x(const float* p) { return _mm512_loadu_ps(p); }
inline VW vw_w(const float* p) { return _mm512_loadu_ps(p); }
inline VW vw_w(const dlk::f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline VW vw_w(const dlk::bf16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

#include "dense_kernels.h"

const dlk::KernelSet kSet = {
    "avx512-vnni",
    block_product<Q8_0>, block_product<Q32<false, false>>, block_product<Q32<true, false>>,
    block_product<Q32<false, true>>, block_product<Q32<true, true>>,
    block_product<QK45<false>>, block_product<QK45<true>>, block_product<Q6K>,
    dense_product<float>, dense_product<dlk::f16_t>, dense_product<dlk::bf16_t>,
};

}  // namespace

const dlk::KernelSet* dlk::kernels_avx512vnni() { return &kSet; }
