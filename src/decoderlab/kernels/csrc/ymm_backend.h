// The vector interface of block_kernels.h and dense_kernels.h on 256-bit registers (AVX2 + FMA + F16C, and
// AVX-VNNI's vpdpbusd where DLK_YMM_VNNI is 1): a packed group's 16 rows are two registers, rows 0-7 and 8-15.
// Included by isa_avx2.cpp and isa_avxvnni.cpp inside their anonymous namespaces.

inline int32_t ld32(const void* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

struct VI { __m256i lo, hi; };
struct VF { __m256 lo, hi; };
// 4 activation rows a pass: their accumulators outnumber the 16 ymm registers and the compiler keeps some in L1,
// which costs less than unpacking each weight block again for a second pass (8 rows of SmolLM2-135M's q4_1
// products: 0.65x the time of 2-row passes, bench/llamacpp.py's batch line; one row unchanged)
constexpr int kTile = 4;
constexpr int kTileK = 4;
// maddubs sums two unsigned x signed byte products into a saturating int16: q8_0's q + 128 (up to 255) times an
// activation (up to 127) could pass 32767, so without VNNI q8_0 multiplies |q| by x with q's sign, as ggml does
constexpr bool kQ8Biased = DLK_YMM_VNNI;

inline VI vi_load(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline VI vi_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline VI vi_set1_8(char b) { return {_mm256_set1_epi8(b), _mm256_set1_epi8(b)}; }
inline VI vi_and(VI a, VI b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline VI vi_or(VI a, VI b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline VI vi_add(VI a, VI b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline VI vi_sub_at(VI a, const int32_t* p) {
  const __m256i s = _mm256_set1_epi32(*p);
  return {_mm256_sub_epi32(a.lo, s), _mm256_sub_epi32(a.hi, s)};
}
inline VI vi_mul(VI a, VI b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
template <int N> inline VI vi_srl16(VI a) { return {_mm256_srli_epi16(a.lo, N), _mm256_srli_epi16(a.hi, N)}; }
template <int N> inline VI vi_sll16(VI a) { return {_mm256_slli_epi16(a.lo, N), _mm256_slli_epi16(a.hi, N)}; }
inline VI vi_srl32(VI a, int n) {
  const __m128i k = _mm_cvtsi32_si128(n);
  return {_mm256_srl_epi32(a.lo, k), _mm256_srl_epi32(a.hi, k)};
}
inline VI vi_sll32(VI a, int n) {
  const __m128i k = _mm_cvtsi32_si128(n);
  return {_mm256_sll_epi32(a.lo, k), _mm256_sll_epi32(a.hi, k)};
}
inline __m256i bit8(__m256i h, __m256i m, __m256i v) {
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, m), m), v);
}
inline VI vi_bit(VI h, VI m, VI v) { return {bit8(h.lo, m.lo, v.lo), bit8(h.hi, m.hi, v.hi)}; }

#if DLK_YMM_VNNI
inline __m256i dot8(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
inline __m256i dot8_q8(__m256i acc, __m256i w, __m256i x) { return dot8(acc, w, x); }
inline __m256i dot16(__m256i acc, __m256i w, __m256i x) { return _mm256_dpwssd_avx_epi32(acc, w, x); }
#else
inline __m256i dot16(__m256i acc, __m256i w, __m256i x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
inline __m256i dot8(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
inline __m256i dot8_q8(__m256i acc, __m256i w, __m256i x) {
  const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // the signed quants back
  return dot8(acc, _mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
}
#endif
inline VI vi_dot(VI acc, VI w, const int8_t* p) {
  const __m256i x = _mm256_set1_epi32(ld32(p));
  return {dot8(acc.lo, w.lo, x), dot8(acc.hi, w.hi, x)};
}
inline VI vi_dot_q8(VI acc, VI w, const int8_t* p) {
  const __m256i x = _mm256_set1_epi32(ld32(p));
  return {dot8_q8(acc.lo, w.lo, x), dot8_q8(acc.hi, w.hi, x)};
}
inline VI vi_dot16(VI acc, VI w, const int32_t* p) {
  const __m256i x = _mm256_set1_epi32(*p);
  return {dot16(acc.lo, w.lo, x), dot16(acc.hi, w.hi, x)};
}
// 16-bit partial sums of byte products: without VNNI, maddubs's int16 pairs added in int16 and widened by one madd
// for several dots (block_kernels.h says how many fit); with VNNI, vpdpbusd's int32 sums themselves
#if DLK_YMM_VNNI
typedef VI VS;
inline VS vs_zero() { return vi_zero(); }
inline VS vs_dot(VS acc, VI w, const int8_t* p) { return vi_dot(acc, w, p); }
inline VI vi_add_vs(VI acc, VS s) { return vi_add(acc, s); }
#else
struct VS { __m256i lo, hi; };
inline VS vs_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline VS vs_dot(VS acc, VI w, const int8_t* p) {
  const __m256i x = _mm256_set1_epi32(ld32(p));
  return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(w.lo, x)), _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(w.hi, x))};
}
inline VI vi_add_vs(VI acc, VS s) {
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(s.lo, one)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(s.hi, one))};
}
#endif
inline VI vi_u8x(__m128i b) { return {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))}; }
inline VI vi_s8x(__m128i b) { return {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))}; }
inline VI vi_pair16(__m128i a, __m128i b) {
  const VI lo = vi_u8x(a), hi = vi_u8x(b);
  return {_mm256_or_si256(lo.lo, _mm256_slli_epi32(hi.lo, 16)), _mm256_or_si256(lo.hi, _mm256_slli_epi32(hi.hi, 16))};
}

inline VF vf_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VF vf_cvt(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline VF vf_half(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline VF vf_mul_at(VF a, const float* p) {
  const __m256 f = _mm256_set1_ps(*p);
  return {_mm256_mul_ps(a.lo, f), _mm256_mul_ps(a.hi, f)};
}
inline VF vf_fmadd(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline VF vf_fmadd_at(VF a, const float* p, VF c) {
  const __m256 f = _mm256_set1_ps(*p);
  return {_mm256_fmadd_ps(a.lo, f, c.lo), _mm256_fmadd_ps(a.hi, f, c.hi)};
}
inline VF vf_fnmadd(VF a, VF b, VF c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline void vf_store(float* p, VF v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}

#include "block_kernels.h"

typedef __m256 VW;
typedef __m256i VQ;
constexpr int kLanes = 8;
constexpr int kDenseTile = 3;
constexpr int64_t kDensePrefetch = 1024;
inline VW vw_zero() { return _mm256_setzero_ps(); }
inline VW vw_fmadd(VW a, VW b, VW c) { return _mm256_fmadd_ps(a, b, c); }
inline VW vw_add(VW a, VW b) { return _mm256_add_ps(a, b); }
inline float vw_sum(VW v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
template <int N>
inline void vw_sums(const VW* v, float* out) {
  for (int n = 0; n < N; ++n) out[n] = vw_sum(v[n]);
}
inline VW vw_w(const float* p) { return _mm256_loadu_ps(p); }
inline VW vw_w(const dlk::f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VW vw_w(const dlk::bf16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#include "dense_kernels.h"

inline VW vw_load(const float* p) { return _mm256_loadu_ps(p); }
inline VW vw_abs(VW v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
inline VW vw_max(VW a, VW b) { return _mm256_max_ps(a, b); }
inline float vw_hmax(VW v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline VW vw_mul(VW a, VW b) { return _mm256_mul_ps(a, b); }
inline VW vw_set1(float f) { return _mm256_set1_ps(f); }
inline VQ vq_round(VW v) { return _mm256_cvtps_epi32(v); }
inline VQ vq_min127(VQ q) { return _mm256_min_epi32(q, _mm256_set1_epi32(127)); }
inline void vq_store8(int8_t* p, VQ q) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}
inline int32_t vq_sum(VQ q) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}
inline int vq_first_eq(VW v, float f) {
  const int m = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(f), _CMP_EQ_OQ));
  return m ? __builtin_ctz(m) : -1;
}
inline void vb_round(const float* p, dlk::bf16_t* out) {
  const __m256 v = _mm256_loadu_ps(p);
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(64)), nan);
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), w);
}

#include "quant_kernels.h"

const dlk::KernelSet kSet = {
    DLK_YMM_VNNI ? "avx-vnni" : "avx2",
    block_product<Q8_0>, block_product<Q32<false, false>>, block_product<Q32<true, false>>,
    block_product<Q32<false, true>>, block_product<Q32<true, true>>,
    block_product<QK45<false>>, block_product<QK45<true>>, block_product<Q6K>,
    dense_product<float>, dense_product<dlk::f16_t>, dense_product<dlk::bf16_t>,
    quantize32, quantize256, to_bf16,
};
