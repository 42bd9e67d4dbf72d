// The block products, written once over a small vector interface that each instruction set's file defines before
// including this one (inside its anonymous namespace, so that nothing here is shared between files):
//
//   VI   64 bytes = 16 lanes of int32, lane r = packed row r      VF   16 floats, lane r = row r
//   vi_load(p) vi_zero() vi_set1_8(b) vi_and vi_or vi_add vi_mul (int32 lanes)
//   vi_srl16<n> vi_sll16<n> (16-bit shifts; callers mask so that no bit crosses a byte), vi_srl32 vi_sll32 (by n)
//   vi_bit(h, m, v)       per byte: v where (h & m) != 0, else 0
//   vi_dot(acc, w, x)     acc lane += w's 4 unsigned bytes of the lane times the 4 signed bytes at x
//   vi_dot_q8(acc, w, x)  the same for q8_0's quants stored + 128; kQ8Biased: whether 128 * sum(x) is left in
//   vi_dot16(acc, w, x)   acc lane += w's 2 int16 of the lane times the 2 int16 at x
//   VS vs_zero() vs_dot(s, w, x) vi_add_vs(acc, s): vi_dot's sums kept in VS, added to an int32 VI by vi_add_vs --
//                         16-bit lanes where the ISA lacks VNNI (maddubs's pairs added without madd), so a VS holds
//                         at most 8 dots of 4-bit weights (8 x 2 x 15 x 127 = 30480 < 32768)
//   vi_sub_at(a, p)       a minus the int32 at p in every lane
//   vi_u8x(m128) vi_s8x(m128)  16 bytes widened to the 16 lanes (unsigned, signed)
//   vi_pair16(a, b)       lane r: the two int16 a[r], b[r] of two sets of 16 unsigned bytes
//   vf_zero vf_cvt(VI) vf_half(p: 16 float16) vf_mul_at(a, p) (times the float at p) vf_fmadd(a, b, c) = a b + c,
//   vf_fnmadd = c - a b, vf_fmadd_at(a, p, c) = a * (the float at p) + c; vf_store(p, v)
//   kTile: activation rows a 32-weight block's pass keeps in registers (a power of two), kTileK: a super-block's
//
// Every integer sum is exact in int32 (at most 63.5e6 in q5_k's super-block sum), so any order of them is the same;
// the float terms are added into a lane in one fixed order per row, whatever the number of rows a pass takes: a
// row's result does not depend on the rows beside it or on the threads (the tests hold both). Each float term is a
// scale product times a converted integer sum -- the float32 rounding the tests bound. The packed layouts are
// pack.py's; the activation rows are common.h's Act.

// the bytes of the block two after p's, asked for ahead of their turn (a group's blocks are one stream)
template <int64_t kBytes>
inline void prefetch_next(const uint8_t* p) {
  for (int64_t at = 2 * kBytes; at < 3 * kBytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T0);
}

// 32-weight blocks ---------------------------------------------------------------------------------------------

// q8_0: d[16] | 8 chunks of 16 rows x 4 quants (+ 128)
struct Q8_0 {
  static constexpr int64_t kBytes = 16 * 34;
  static constexpr int kMax = kTile;
  template <int NB>
  static void run(const uint8_t* g, int64_t nblk, const dlk::Act* act, float* y, int64_t ldy) {
    VF facc[NB];
    for (int a = 0; a < NB; ++a) facc[a] = vf_zero();
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t* p = g + b * kBytes;
      prefetch_next<kBytes>(p);
      VI acc[NB];
      for (int a = 0; a < NB; ++a) acc[a] = vi_zero();
      for (int c = 0; c < 8; ++c) {
        const VI w = vi_load(p + 32 + 64 * c);
        for (int a = 0; a < NB; ++a) acc[a] = vi_dot_q8(acc[a], w, act[a].qs + 32 * b + 4 * c);
      }
      const VF dw = vf_half(p);
      for (int a = 0; a < NB; ++a) {
        const VI s = kQ8Biased ? vi_sub_at(acc[a], act[a].s128 + b) : acc[a];
        facc[a] = vf_fmadd(vf_cvt(s), vf_mul_at(dw, act[a].d + b), facc[a]);
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
  static constexpr int kMax = kTile;
  static VI fifth(VI h, int c, VI m10) {  // bit c of each byte -> bit 4
    return vi_and(c <= 4 ? vi_sll32(h, 4 - c) : vi_srl32(h, c - 4), m10);
  }
  static const int32_t* offset(const dlk::Act& a) { return FIVE ? a.s16 : a.s8; }  // w = d (q - 8 or 16)
  template <int NB>
  static void run(const uint8_t* g, int64_t nblk, const dlk::Act* act, float* y, int64_t ldy) {
    const VI m0f = vi_set1_8(0x0F), m10 = vi_set1_8(0x10);
    VF facc[NB];
    for (int a = 0; a < NB; ++a) facc[a] = vf_zero();
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t* p = g + b * kBytes;
      prefetch_next<kBytes>(p);
      const uint8_t* qh = p + (MIN ? 64 : 32);
      const uint8_t* q = qh + (FIVE ? 64 : 0);
      const VI h = FIVE ? vi_load(qh) : vi_zero();
      VI acc[NB];
      for (int a = 0; a < NB; ++a) acc[a] = vi_zero();
      if (FIVE) {
        for (int c = 0; c < 4; ++c) {
          const VI v = vi_load(q + 64 * c);
          const VI lo = vi_or(vi_and(v, m0f), fifth(h, c, m10));
          const VI hi = vi_or(vi_and(vi_srl16<4>(v), m0f), fifth(h, c + 4, m10));
          for (int a = 0; a < NB; ++a) {
            const int8_t* x = act[a].qs + 32 * b + 4 * c;
            acc[a] = vi_dot(vi_dot(acc[a], lo, x), hi, x + 16);
          }
        }
      } else {  // 4-bit weights: the block's 8 dots in one VS
        VS s[NB];
        for (int a = 0; a < NB; ++a) s[a] = vs_zero();
        for (int c = 0; c < 4; ++c) {
          const VI v = vi_load(q + 64 * c);
          const VI lo = vi_and(v, m0f), hi = vi_and(vi_srl16<4>(v), m0f);
          for (int a = 0; a < NB; ++a) {
            const int8_t* x = act[a].qs + 32 * b + 4 * c;
            s[a] = vs_dot(vs_dot(s[a], lo, x), hi, x + 16);
          }
        }
        for (int a = 0; a < NB; ++a) acc[a] = vi_add_vs(acc[a], s[a]);
      }
      const VF dw = vf_half(p);
      if (MIN) {
        const VF m = vf_half(p + 32);
        for (int a = 0; a < NB; ++a) {
          facc[a] = vf_fmadd(vf_cvt(acc[a]), vf_mul_at(dw, act[a].d + b), facc[a]);
          facc[a] = vf_fmadd_at(m, act[a].ds + b, facc[a]);
        }
      } else {
        for (int a = 0; a < NB; ++a)
          facc[a] = vf_fmadd(vf_cvt(vi_sub_at(acc[a], offset(act[a]) + b)), vf_mul_at(dw, act[a].d + b), facc[a]);
      }
    }
    for (int a = 0; a < NB; ++a) vf_store(y + a * ldy, facc[a]);
  }
};

// 256-weight super-blocks ------------------------------------------------------------------------------------

// q4_k / q5_k's eight 6-bit scales of the 16 rows, and their minimums as pairs (mins 2i, 2i + 1 as the two int16
// of each lane: vi_dot16 multiplies them by the activation's sums of 32 two at a time), from the 12 byte planes
// (plane k = byte k of the rows' 12 scale bytes): ggml's get_scale_min_k4, 16 rows at a time
inline void k_scales(const uint8_t* planes, VI* sc, VI* mn2) {
  __m128i pl[12];
  for (int k = 0; k < 12; ++k) pl[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * k));
  const __m128i m63 = _mm_set1_epi8(63), m0f = _mm_set1_epi8(0x0F), m30 = _mm_set1_epi8(0x30);
  __m128i mn[8];
  for (int j = 0; j < 4; ++j) {
    sc[j] = vi_u8x(_mm_and_si128(pl[j], m63));
    mn[j] = _mm_and_si128(pl[j + 4], m63);
    const __m128i top_sc = _mm_and_si128(_mm_srli_epi16(pl[j], 2), m30);      // bits 6-7 of byte j -> 4-5
    const __m128i top_mn = _mm_and_si128(_mm_srli_epi16(pl[j + 4], 2), m30);  // of byte j + 4
    sc[j + 4] = vi_u8x(_mm_or_si128(_mm_and_si128(pl[j + 8], m0f), top_sc));
    mn[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(pl[j + 8], 4), m0f), top_mn);
  }
  for (int i = 0; i < 4; ++i) mn2[i] = vi_pair16(mn[2 * i], mn[2 * i + 1]);
}

// q4_k (HIGH = false): d[16] | dmin[16] | 12 scale planes | 32 chunks (pair p of sub-blocks, chunk c: low
// nibbles sub-block 2p, high 2p+1); q5_k (HIGH = true) puts 8 chunks of qh (bit j = sub-block j's fifth bit)
// before the 32. A sub-block at a time (its pair's chunks read twice, from L1): a row holds one sum and the
// super-block's, so that 8 rows fit the registers
template <bool HIGH>
struct QK45 {
  static constexpr int64_t kBytes = HIGH ? 16 * 176 : 16 * 144;
  static constexpr int kMax = kTileK;
  template <int NB, bool TOP>
  static void sub_block(const uint8_t* qs, const uint8_t* qh, int j, const int8_t* const* x, VI* acc) {
    const VI m0f = vi_set1_8(0x0F), v16 = vi_set1_8(16);
    for (int a = 0; a < NB; ++a) acc[a] = vi_zero();
    if (HIGH) {
      for (int c = 0; c < 8; ++c) {
        const VI v = vi_load(qs + 64 * (8 * (j / 2) + c));
        VI w = TOP ? vi_and(vi_srl16<4>(v), m0f) : vi_and(v, m0f);
        w = vi_or(w, vi_bit(vi_load(qh + 64 * c), vi_set1_8(static_cast<char>(1 << j)), v16));
        for (int a = 0; a < NB; ++a) acc[a] = vi_dot(acc[a], w, x[a] + 32 * j + 4 * c);
      }
      return;
    }
    VS s[NB];  // 4-bit weights: the sub-block's 8 dots in one VS
    for (int a = 0; a < NB; ++a) s[a] = vs_zero();
    for (int c = 0; c < 8; ++c) {
      const VI v = vi_load(qs + 64 * (8 * (j / 2) + c));
      const VI w = TOP ? vi_and(vi_srl16<4>(v), m0f) : vi_and(v, m0f);
      for (int a = 0; a < NB; ++a) s[a] = vs_dot(s[a], w, x[a] + 32 * j + 4 * c);
    }
    for (int a = 0; a < NB; ++a) acc[a] = vi_add_vs(acc[a], s[a]);
  }
  template <int NB>
  static void run(const uint8_t* g, int64_t nsb, const dlk::Act* act, float* y, int64_t ldy) {
    VF facc[NB];
    for (int a = 0; a < NB; ++a) facc[a] = vf_zero();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = g + sb * kBytes;
      prefetch_next<kBytes>(p);
      const uint8_t* qh = p + 256;
      const uint8_t* qs = p + (HIGH ? 256 + 512 : 256);
      const int8_t* x[NB];
      for (int a = 0; a < NB; ++a) x[a] = act[a].qs + 256 * sb;
      VI sc[8], mn2[4], isum[NB], acc[NB];
      k_scales(p + 64, sc, mn2);
      for (int a = 0; a < NB; ++a) isum[a] = vi_zero();
      for (int j = 0; j < 8; ++j) {
        if (j % 2) sub_block<NB, true>(qs, qh, j, x, acc);
        else sub_block<NB, false>(qs, qh, j, x, acc);
        for (int a = 0; a < NB; ++a) isum[a] = vi_add(isum[a], vi_mul(acc[a], sc[j]));
      }
      const VF dw = vf_half(p), dmin = vf_half(p + 32);
      for (int a = 0; a < NB; ++a) {
        const int32_t* s32 = act[a].bs32 + 4 * sb;  // the activation's sums of 32, two to a word
        VI msum = vi_zero();
        for (int i = 0; i < 4; ++i) msum = vi_dot16(msum, mn2[i], s32 + i);
        facc[a] = vf_fmadd(vf_cvt(isum[a]), vf_mul_at(dw, act[a].d + sb), facc[a]);
        facc[a] = vf_fnmadd(vf_cvt(msum), vf_mul_at(dmin, act[a].d + sb), facc[a]);
      }
    }
    for (int a = 0; a < NB; ++a) vf_store(y + a * ldy, facc[a]);
  }
};

// q6_k: d[16] | 16 planes of int8 scales (sub-block s of the 16 rows) | per half n, chunk c: ql[64n + 4c..],
// ql[64n + 32 + 4c..], qh[32n + 4c..] of the 16 rows. Quant k (0..3) of a chunk is weight 128n + 32k + 4c..
// of sub-block 8n + 2k + c / 4; q - 32 is summed as q minus 32 times the activation's sum of 16. A sub-block at a
// time (its chunks read once for each k, from L1), so that 8 rows fit the registers
struct Q6K {
  static constexpr int64_t kBytes = 16 * 210;
  static constexpr int kMax = kTileK;
  template <int K>
  static VI quant(const uint8_t* q) {  // quant K of a chunk's 16 rows, 6 bits
    const VI m0f = vi_set1_8(0x0F);
    const VI H = vi_load(q + 128);
    if (K == 0) return vi_or(vi_and(vi_load(q), m0f), vi_sll16<4>(vi_and(H, vi_set1_8(0x03))));
    if (K == 1) return vi_or(vi_and(vi_load(q + 64), m0f), vi_sll16<2>(vi_and(H, vi_set1_8(0x0C))));
    if (K == 2) return vi_or(vi_and(vi_srl16<4>(vi_load(q)), m0f), vi_and(H, vi_set1_8(0x30)));
    return vi_or(vi_and(vi_srl16<4>(vi_load(q + 64)), m0f), vi_srl16<2>(vi_and(H, vi_set1_8(static_cast<char>(0xC0)))));
  }
  template <int NB, int K>
  static void sub_block(const uint8_t* p, int n, int cq, const int8_t* const* x, VI* acc) {
    for (int a = 0; a < NB; ++a) acc[a] = vi_zero();
    for (int c = 4 * cq; c < 4 * cq + 4; ++c) {
      const VI w = quant<K>(p + 288 + 192 * (8 * n + c));
      for (int a = 0; a < NB; ++a) acc[a] = vi_dot(acc[a], w, x[a] + 128 * n + 32 * K + 4 * c);
    }
  }
  template <int NB, int K>
  static void add(const uint8_t* p, int64_t sb, int n, int cq, const dlk::Act* act, const int8_t* const* x,
                  VI* isum) {
    VI acc[NB];
    sub_block<NB, K>(p, n, cq, x, acc);
    const int s = 8 * n + 2 * K + cq;
    const VI scale = vi_s8x(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * s)));
    for (int a = 0; a < NB; ++a)
      isum[a] = vi_add(isum[a], vi_mul(vi_sub_at(acc[a], act[a].bs16x32 + 16 * sb + s), scale));
  }
  template <int NB>
  static void run(const uint8_t* g, int64_t nsb, const dlk::Act* act, float* y, int64_t ldy) {
    VF facc[NB];
    for (int a = 0; a < NB; ++a) facc[a] = vf_zero();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = g + sb * kBytes;
      prefetch_next<kBytes>(p);
      const int8_t* x[NB];
      for (int a = 0; a < NB; ++a) x[a] = act[a].qs + 256 * sb;
      VI isum[NB];
      for (int a = 0; a < NB; ++a) isum[a] = vi_zero();
      for (int n = 0; n < 2; ++n) {
        for (int cq = 0; cq < 2; ++cq) {
          add<NB, 0>(p, sb, n, cq, act, x, isum);
          add<NB, 1>(p, sb, n, cq, act, x, isum);
          add<NB, 2>(p, sb, n, cq, act, x, isum);
          add<NB, 3>(p, sb, n, cq, act, x, isum);
        }
      }
      const VF dw = vf_half(p);
      for (int a = 0; a < NB; ++a) facc[a] = vf_fmadd(vf_cvt(isum[a]), vf_mul_at(dw, act[a].d + sb), facc[a]);
    }
    for (int a = 0; a < NB; ++a) vf_store(y + a * ldy, facc[a]);
  }
};

// the driver: packed groups [g0, g1), the activation rows in passes of K::kMax, then halves of it for what is left
// (each group's bytes are read once from memory, again from cache for the next pass). A prompt's rows go in blocks
// of kRowBlock, so that a block's quantized rows stay in L2 while the groups pass over them
constexpr int kRowBlock = 256;

template <typename K, int NB>
void passes(const uint8_t* gp, int64_t nblk, const dlk::Act* act, int& a0, int a1, float* y, int64_t ldy) {
  for (; a1 - a0 >= NB; a0 += NB) K::template run<NB>(gp, nblk, act + a0, y + a0 * ldy, ldy);
}

template <typename K>
void block_product(const uint8_t* packed, int64_t nblk, int64_t g0, int64_t g1, const dlk::Act* act, int n_act,
                   float* y, int64_t ldy) {
  for (int r0 = 0; r0 < n_act; r0 += kRowBlock) {
    const int r1 = n_act - r0 < kRowBlock ? n_act : r0 + kRowBlock;
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gp = packed + g * nblk * K::kBytes;
      float* out = y + g * dlk::kRows;
      int a0 = r0;
      if constexpr (K::kMax >= 8) passes<K, 8>(gp, nblk, act, a0, r1, out, ldy);
      if constexpr (K::kMax >= 4) passes<K, 4>(gp, nblk, act, a0, r1, out, ldy);
      if constexpr (K::kMax >= 2) passes<K, 2>(gp, nblk, act, a0, r1, out, ldy);
      passes<K, 1>(gp, nblk, act, a0, r1, out, ldy);
    }
  }
}
