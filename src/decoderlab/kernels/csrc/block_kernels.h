// The block products, written once over a small vector interface that each instruction set's file defines before
// including this one (inside its anonymous namespace, so that nothing here is shared between files):
//
//   VI   64 bytes = 16 lanes of int32, lane r = packed row r      VF   16 floats, lane r = row r
//   vi_load(p) vi_zero() vi_set1_8(b) vi_set1_32(i) vi_and vi_or vi_add vi_sub vi_mul (int32 lanes)
//   vi_srl16<n> vi_sll16<n> (16-bit shifts; callers mask so that no bit crosses a byte), vi_srl32 vi_sll32 (by n)
//   vi_bit(h, m, v)      per byte: v where (h & m) != 0, else 0
//   vi_dot(acc, w, x4)   acc lane += w's 4 unsigned bytes of the lane times x4's 4 signed bytes
//   vi_dot_q8(acc, w, x4) the same for q8_0's quants stored + 128; kQ8Biased: whether 128 * sum(x) is left in
//   vi_u8x(m128) vi_s8x(m128) (16 bytes widened to the 16 lanes)
//   vf_zero vf_set1 vf_cvt(VI) vf_half(p: 16 float16) vf_mul vf_fmadd(a, b, c) = a b + c, vf_fnmadd = c - a b
//   vf_store(p, v); kTile: activation rows a pass keeps in registers
//
// Every integer sum is exact in int32 (at most 63.5e6 in q5_k's super-block sum); each float term is a scale
// product times a converted integer sum, added into a float32 lane -- the float32 rounding the tests bound.
// The packed layouts are pack.py's; the activation rows are common.h's Act.

inline int32_t ld32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// 32-weight blocks ---------------------------------------------------------------------------------------------

// q8_0: d[16] | 8 chunks of 16 rows x 4 quants (+ 128)
struct Q8_0 {
  static constexpr int64_t kBytes = 16 * 34;
  template <int NB>
  static void run(const uint8_t* g, int64_t nblk, const dlk::Act* act, float* y, int64_t ldy) {
    VF facc[NB];
    for (int a = 0; a < NB; ++a) facc[a] = vf_zero();
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t* p = g + b * kBytes;
      VI acc[NB];
      for (int a = 0; a < NB; ++a) acc[a] = vi_zero();
      for (int c = 0; c < 8; ++c) {
        VI w = vi_load(p + 32 + 64 * c);
        for (int a = 0; a < NB; ++a) acc[a] = vi_dot_q8(acc[a], w, ld32(act[a].qs + 32 * b + 4 * c));
      }
      VF dw = vf_half(p);
      for (int a = 0; a < NB; ++a) {
        VI s = kQ8Biased ? vi_sub(acc[a], vi_set1_32(128 * act[a].s[b])) : acc[a];
        facc[a] = vf_fmadd(vf_cvt(s), vf_mul(dw, vf_set1(act[a].d[b])), facc[a]);
      }
    }
    for (int a = 0; a < NB; ++a) vf_store(y + a * ldy, facc[a]);
  }
};

// q4_0 / q5_0 (MIN = false): d[16] | (q5: qh) | 4 chunks; q4_1 / q5_1 (MIN = true): d[16] | m[16] | (qh) | 4
// chunks. A chunk's low nibbles are weights 4c..4c+3 of each row, its high nibbles weights 16+4c..; q5's fifth
// bits are packed so that bit c of a lane's byte i is weight 4c+i's (pack.py): chunk c's are then one shift away
template <bool MIN, bool FIVE>
struct Q32 {
  static constexpr int64_t kBytes = 16 * (18 + (MIN ? 2 : 0) + (FIVE ? 4 : 0));
  static constexpr int kOffset = FIVE ? 16 : 8;  // w = d (q - offset) without a minimum
  static VI fifth(VI h, int c, VI m10) {  // bit c of each byte -> bit 4
    return vi_and(c <= 4 ? vi_sll32(h, 4 - c) : vi_srl32(h, c - 4), m10);
  }
  template <int NB>
  static void run(const uint8_t* g, int64_t nblk, const dlk::Act* act, float* y, int64_t ldy) {
    const VI m0f = vi_set1_8(0x0F), m10 = vi_set1_8(0x10);
    VF facc[NB];
    for (int a = 0; a < NB; ++a) facc[a] = vf_zero();
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t* p = g + b * kBytes;
      const uint8_t* qh = p + (MIN ? 64 : 32);
      const uint8_t* q = qh + (FIVE ? 64 : 0);
      const VI h = FIVE ? vi_load(qh) : vi_zero();
      VI lo_acc[NB], hi_acc[NB];
      for (int a = 0; a < NB; ++a) lo_acc[a] = hi_acc[a] = vi_zero();
      for (int c = 0; c < 4; ++c) {
        VI v = vi_load(q + 64 * c);
        VI lo = vi_and(v, m0f), hi = vi_and(vi_srl16<4>(v), m0f);
        if (FIVE) {
          lo = vi_or(lo, fifth(h, c, m10));
          hi = vi_or(hi, fifth(h, c + 4, m10));
        }
        for (int a = 0; a < NB; ++a) {
          const int8_t* x = act[a].qs + 32 * b + 4 * c;
          lo_acc[a] = vi_dot(lo_acc[a], lo, ld32(x));
          hi_acc[a] = vi_dot(hi_acc[a], hi, ld32(x + 16));
        }
      }
      VF dw = vf_half(p);
      for (int a = 0; a < NB; ++a) {
        VI s = vi_add(lo_acc[a], hi_acc[a]);
        float dx = act[a].d[b];
        if (MIN) {
          facc[a] = vf_fmadd(vf_cvt(s), vf_mul(dw, vf_set1(dx)), facc[a]);
          facc[a] = vf_fmadd(vf_half(p + 32), vf_set1(dx * float(act[a].s[b])), facc[a]);
        } else {
          s = vi_sub(s, vi_set1_32(kOffset * act[a].s[b]));
          facc[a] = vf_fmadd(vf_cvt(s), vf_mul(dw, vf_set1(dx)), facc[a]);
        }
      }
    }
    for (int a = 0; a < NB; ++a) vf_store(y + a * ldy, facc[a]);
  }
};

// 256-weight super-blocks ------------------------------------------------------------------------------------

// q4_k / q5_k's eight 6-bit scales and minimums of the 16 rows, from the 12 byte planes (plane k = byte k of the
// rows' 12 scale bytes): ggml's get_scale_min_k4, 16 rows at a time
inline void k_scales(const uint8_t* planes, VI* sc, VI* mn) {
  __m128i pl[12];
  for (int k = 0; k < 12; ++k) pl[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * k));
  const __m128i m63 = _mm_set1_epi8(63), m0f = _mm_set1_epi8(0x0F), m30 = _mm_set1_epi8(0x30);
  for (int j = 0; j < 4; ++j) {
    sc[j] = vi_u8x(_mm_and_si128(pl[j], m63));
    mn[j] = vi_u8x(_mm_and_si128(pl[j + 4], m63));
    __m128i top_sc = _mm_and_si128(_mm_srli_epi16(pl[j], 2), m30);      // bits 6-7 of byte j -> 4-5
    __m128i top_mn = _mm_and_si128(_mm_srli_epi16(pl[j + 4], 2), m30);  // of byte j + 4
    sc[j + 4] = vi_u8x(_mm_or_si128(_mm_and_si128(pl[j + 8], m0f), top_sc));
    mn[j + 4] = vi_u8x(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(pl[j + 8], 4), m0f), top_mn));
  }
}

// q4_k (HIGH = false): d[16] | dmin[16] | 12 scale planes | 32 chunks (pair p of sub-blocks, chunk c: low
// nibbles sub-block 2p, high 2p+1); q5_k (HIGH = true) puts 8 chunks of qh (bit j = sub-block j's fifth bit)
// before the 32
template <bool HIGH>
struct QK45 {
  static constexpr int64_t kBytes = HIGH ? 16 * 176 : 16 * 144;
  template <int NB>
  static void run(const uint8_t* g, int64_t nsb, const dlk::Act* act, float* y, int64_t ldy) {
    const VI m0f = vi_set1_8(0x0F), v16 = vi_set1_8(16);
    VF facc[NB];
    for (int a = 0; a < NB; ++a) facc[a] = vf_zero();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = g + sb * kBytes;
      const uint8_t* qh = p + 256;
      const uint8_t* qs = p + (HIGH ? 256 + 512 : 256);
      VI sc[8], mn[8], isum[NB], msum[NB];
      k_scales(p + 64, sc, mn);
      for (int a = 0; a < NB; ++a) isum[a] = msum[a] = vi_zero();
      for (int pr = 0; pr < 4; ++pr) {
        VI lo_acc[NB], hi_acc[NB];
        for (int a = 0; a < NB; ++a) lo_acc[a] = hi_acc[a] = vi_zero();
        for (int c = 0; c < 8; ++c) {
          VI v = vi_load(qs + 64 * (8 * pr + c));
          VI lo = vi_and(v, m0f), hi = vi_and(vi_srl16<4>(v), m0f);
          if (HIGH) {
            VI h = vi_load(qh + 64 * c);
            lo = vi_or(lo, vi_bit(h, vi_set1_8(1 << (2 * pr)), v16));
            hi = vi_or(hi, vi_bit(h, vi_set1_8(1 << (2 * pr + 1)), v16));
          }
          for (int a = 0; a < NB; ++a) {
            const int8_t* x = act[a].qs + 256 * sb + 64 * pr + 4 * c;
            lo_acc[a] = vi_dot(lo_acc[a], lo, ld32(x));
            hi_acc[a] = vi_dot(hi_acc[a], hi, ld32(x + 32));
          }
        }
        for (int a = 0; a < NB; ++a)
          isum[a] = vi_add(isum[a], vi_add(vi_mul(lo_acc[a], sc[2 * pr]), vi_mul(hi_acc[a], sc[2 * pr + 1])));
      }
      VF dw = vf_half(p), dmin = vf_half(p + 32);
      for (int a = 0; a < NB; ++a) {
        const int32_t* s32 = act[a].s + 24 * sb + 16;  // the activation's sums of 32
        for (int j = 0; j < 8; ++j) msum[a] = vi_add(msum[a], vi_mul(mn[j], vi_set1_32(s32[j])));
        VF dx = vf_set1(act[a].d[sb]);
        facc[a] = vf_fmadd(vf_cvt(isum[a]), vf_mul(dw, dx), facc[a]);
        facc[a] = vf_fnmadd(vf_cvt(msum[a]), vf_mul(dmin, dx), facc[a]);
      }
    }
    for (int a = 0; a < NB; ++a) vf_store(y + a * ldy, facc[a]);
  }
};

// q6_k: d[16] | 16 planes of int8 scales (sub-block s of the 16 rows) | per half n, chunk c: ql[64n + 4c..],
// ql[64n + 32 + 4c..], qh[32n + 4c..] of the 16 rows. Quant k (0..3) of a chunk is weight 128n + 32k + 4c..
// of sub-block 8n + 2k + c / 4; q - 32 is summed as q minus 32 times the activation's sum of 16
struct Q6K {
  static constexpr int64_t kBytes = 16 * 210;
  template <int NB>
  static void run(const uint8_t* g, int64_t nsb, const dlk::Act* act, float* y, int64_t ldy) {
    const VI m0f = vi_set1_8(0x0F), m03 = vi_set1_8(0x03), m0c = vi_set1_8(0x0C), m30 = vi_set1_8(0x30),
             mc0 = vi_set1_8(static_cast<char>(0xC0));
    VF facc[NB];
    for (int a = 0; a < NB; ++a) facc[a] = vf_zero();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = g + sb * kBytes;
      VI isum[NB];
      for (int a = 0; a < NB; ++a) isum[a] = vi_zero();
      for (int n = 0; n < 2; ++n) {
        for (int cq = 0; cq < 2; ++cq) {
          VI acc[4][NB];
          for (int k = 0; k < 4; ++k)
            for (int a = 0; a < NB; ++a) acc[k][a] = vi_zero();
          for (int c = 4 * cq; c < 4 * cq + 4; ++c) {
            const uint8_t* q = p + 288 + 192 * (8 * n + c);
            VI A = vi_load(q), B = vi_load(q + 64), H = vi_load(q + 128);
            VI w[4] = {vi_or(vi_and(A, m0f), vi_sll16<4>(vi_and(H, m03))),
                       vi_or(vi_and(B, m0f), vi_sll16<2>(vi_and(H, m0c))),
                       vi_or(vi_and(vi_srl16<4>(A), m0f), vi_and(H, m30)),
                       vi_or(vi_and(vi_srl16<4>(B), m0f), vi_srl16<2>(vi_and(H, mc0)))};
            for (int a = 0; a < NB; ++a) {
              const int8_t* x = act[a].qs + 256 * sb + 128 * n + 4 * c;
              for (int k = 0; k < 4; ++k) acc[k][a] = vi_dot(acc[k][a], w[k], ld32(x + 32 * k));
            }
          }
          for (int k = 0; k < 4; ++k) {
            const int s = 8 * n + 2 * k + cq;
            VI scale = vi_s8x(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * s)));
            for (int a = 0; a < NB; ++a) {
              VI centred = vi_sub(acc[k][a], vi_set1_32(32 * act[a].s[24 * sb + s]));
              isum[a] = vi_add(isum[a], vi_mul(centred, scale));
            }
          }
        }
      }
      VF dw = vf_half(p);
      for (int a = 0; a < NB; ++a)
        facc[a] = vf_fmadd(vf_cvt(isum[a]), vf_mul(dw, vf_set1(act[a].d[sb])), facc[a]);
    }
    for (int a = 0; a < NB; ++a) vf_store(y + a * ldy, facc[a]);
  }
};

// the driver: packed groups [g0, g1), the activation rows kTile at a time (each group's bytes are read once from
// memory, again from cache for the next tile)
template <typename K>
void block_product(const uint8_t* packed, int64_t nblk, int64_t g0, int64_t g1, const dlk::Act* act, int n_act,
                   float* y, int64_t ldy) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = packed + g * nblk * K::kBytes;
    for (int a0 = 0; a0 < n_act; a0 += kTile) {
      const int n = n_act - a0 < kTile ? n_act - a0 : kTile;
      float* out = y + a0 * ldy + g * dlk::kRows;
      if (n == 1) K::template run<1>(gp, nblk, act + a0, out, ldy);
      if (n == 2) K::template run<2>(gp, nblk, act + a0, out, ldy);
      if constexpr (kTile >= 3) {
        if (n == 3) K::template run<3>(gp, nblk, act + a0, out, ldy);
      }
      if constexpr (kTile >= 4) {
        if (n == 4) K::template run<4>(gp, nblk, act + a0, out, ldy);
      }
    }
  }
}
