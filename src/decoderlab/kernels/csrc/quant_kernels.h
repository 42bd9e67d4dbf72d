// The activation quantizers of ggml's x86 CPU backend, and the rounding of activations to bfloat16, written once
// over a float vector interface each instruction set's file defines before including this one (inside its
// anonymous namespace):
//
//   VW (kLanes floats)  vw_load(p) vw_abs(v) vw_max(a, b) vw_hmax(v) (the lanes' largest) vw_mul(a, b) vw_set1(f)
//   vq_round(v)          the lanes rounded to int32, to nearest, ties to even (cvtps2dq under the default MXCSR)
//   vq_store8(p, q)      kLanes int32 (each within [-127, 127]; larger ones saturate) stored as int8
//   vq_min127(q)  vq_sum(q) (the lanes' int32 sum)  vq_first_eq(v, f) (the first lane equal to f, or -1)
//   vb_round(p, out)     kLanes floats rounded to bfloat16 (nearest, ties to even; a NaN kept a NaN)
//
// The results equal the scalar definitions bit for bit (tests/kernels checks ggml's bytes on every path):
// q8_0 / q8_1: per block of 32, amax = max |x|, d = float16(amax / 127), q = round(x * (127 / amax)) (ggml-cpu's x86
// quantize_row_q8_0 / _q8_1); q8_K: the first value m of largest magnitude, q = min(127, round(x * (-127 / m))),
// d = 1 / (-127 / m) (quantize_row_q8_K_ref). Every float operation is one IEEE operation in either form.

inline void quantize32(const float* x, int64_t k, int8_t* qs, float* d, int32_t* sums) {
  constexpr int kV = 32 / kLanes;
  for (int64_t b = 0; b < k / 32; ++b) {
    VW v[kV];
    VW a = vw_zero();
    for (int i = 0; i < kV; ++i) {
      v[i] = vw_load(x + 32 * b + kLanes * i);
      a = vw_max(a, vw_abs(v[i]));
    }
    const float amax = vw_hmax(a);
    const VW id = vw_set1(amax != 0.f ? 127.f / amax : 0.f);
    int32_t sum = 0;
    for (int i = 0; i < kV; ++i) {
      const VQ q = vq_round(vw_mul(v[i], id));
      vq_store8(qs + 32 * b + kLanes * i, q);
      sum += vq_sum(q);
    }
    d[b] = _cvtsh_ss(_cvtss_sh(amax / 127.f, 0));  // float16, to nearest even
    sums[b] = sum;
  }
}

inline void quantize256(const float* x, int64_t k, int8_t* qs, float* d, int32_t* sums) {
  constexpr int kV = 256 / kLanes, kPer16 = 16 / kLanes;
  for (int64_t sb = 0; sb < k / 256; ++sb) {
    const float* xb = x + 256 * sb;
    VW a = vw_zero();
    for (int i = 0; i < kV; ++i) a = vw_max(a, vw_abs(vw_load(xb + kLanes * i)));
    const float amax = vw_hmax(a);
    if (amax == 0.f) {
      __builtin_memset(qs + 256 * sb, 0, 256);
      for (int j = 0; j < 16; ++j) sums[16 * sb + j] = 0;
      d[sb] = 0.f;
      continue;
    }
    float peak = 0.f;  // the first value of largest magnitude
    for (int i = 0; i < kV; ++i) {
      const int lane = vq_first_eq(vw_abs(vw_load(xb + kLanes * i)), amax);
      if (lane >= 0) {
        peak = xb[kLanes * i + lane];
        break;
      }
    }
    const float iscale = -127.f / peak;
    const VW m = vw_set1(iscale);
    for (int j = 0; j < 16; ++j) {
      int32_t sum = 0;
      for (int i = 0; i < kPer16; ++i) {
        const VQ q = vq_min127(vq_round(vw_mul(vw_load(xb + 16 * j + kLanes * i), m)));
        vq_store8(qs + 256 * sb + 16 * j + kLanes * i, q);
        sum += vq_sum(q);
      }
      sums[16 * sb + j] = sum;
    }
    d[sb] = 1.f / iscale;
  }
}

inline uint16_t to_bf16_one(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 64);  // a NaN, kept quiet
  return static_cast<uint16_t>((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

inline void to_bf16(const float* x, int64_t n, dlk::bf16_t* out) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vb_round(x + i, out + i);
  for (; i < n; ++i) out[i].bits = to_bf16_one(x[i]);
}
