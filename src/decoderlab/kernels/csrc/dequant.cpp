// decoderlab::dequantize: rows [start, stop) of a packed block weight (pack.py's layout, read as it is: no unpack)
// as float32 -- gguf.quants' numbers bit for bit, as portable.py's dequantize_bytes computes them. What a LoRA
// step's backward multiplies (grad_x = grad_y @ W, a cache-sized slice of W at a time) and a block embedding's rows.
//
// Every value is one float32 rounding at most, so no instruction set changes a bit: the scale products are exact
// (a float16 d of 11 significant bits times a 6-bit scale, or q6_k's int8 one, times a quant of 4 to 6 bits: at
// most 24 bits), and the one rounding is q4_1 / q5_1's + m and the K-quants' - dmin * mn (itself exact). Portable
// C++ at the baseline's flags (-ffp-contract=off: no FMA where numpy rounds twice); the loops run over a row's
// weights of one chunk (4 bytes of one row, 64 bytes apart per chunk) into contiguous floats.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "common.h"

namespace dlk {
namespace {

// the 16 rows' float16 at p as float32, exactly (normal, subnormal, zero, inf, NaN): the branch-free conversion of
// c10's fp16_ieee_to_fp32_value (the FP16 library's), written as one loop the compiler vectorizes
inline void halves(const uint8_t* p, float* f) {
  uint16_t h[kRows];
  std::memcpy(h, p, sizeof h);
  for (int r = 0; r < kRows; ++r) {
    const uint32_t w = static_cast<uint32_t>(h[r]) << 16, two_w = w + w;
    const uint32_t nb = (two_w >> 4) + (0xE0u << 23), db = (two_w >> 17) | (126u << 23);
    float normal, denormal;
    std::memcpy(&normal, &nb, 4);
    std::memcpy(&denormal, &db, 4);
    normal *= 0x1.0p-112f;  // rebias the exponent (inf and NaN stay so)
    denormal -= 0.5f;       // a subnormal half's mantissa, exactly
    uint32_t nbits, dbits;
    std::memcpy(&nbits, &normal, 4);
    std::memcpy(&dbits, &denormal, 4);
    const uint32_t bits = (w & 0x80000000u) | (two_w < (1u << 27) ? dbits : nbits);
    std::memcpy(f + r, &bits, 4);
  }
}

// 4 bytes of a row's chunk as one word (the bytes' order kept), so that a chunk's fields come out in a few word
// operations (SWAR); the weights' quants then land in a contiguous byte row that one loop widens to floats
inline uint32_t word(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

inline void put(uint8_t* q, uint32_t w) { std::memcpy(q, &w, 4); }

constexpr uint32_t kLow4 = 0x0F0F0F0Fu, kBit0 = 0x01010101u;

// One block of the 16 rows of a group: p its packed bytes, `rows` of them wanted (the last group's may be fewer),
// written to y[r * ld + 0 .. block)
typedef void (*BlockDequant)(const uint8_t* p, int rows, float* y, int64_t ld);

// q8_0: d[16] | 8 chunks of 16 rows x 4 quants stored + 128
void q8_0(const uint8_t* p, int rows, float* y, int64_t ld) {
  float d[kRows];
  halves(p, d);
  for (int r = 0; r < rows; ++r) {
    uint8_t q[32];
    for (int c = 0; c < 8; ++c) put(q + 4 * c, word(p + 32 + 64 * c + 4 * r) ^ 0x80808080u);
    float* o = y + r * ld;
    for (int l = 0; l < 32; ++l) o[l] = d[r] * static_cast<float>(static_cast<int8_t>(q[l]));
  }
}

// q4_0 / q5_0: d (q - 8 or 16); q4_1 / q5_1 (MIN): d q + m. d[16] | (m[16]) | (qh: 16 rows x 4 bytes, bit c of
// byte i weight 4c + i's fifth bit) | 4 chunks: low nibbles weights 4c.., high nibbles 16 + 4c..
template <bool MIN, bool FIVE>
void q32(const uint8_t* p, int rows, float* y, int64_t ld) {
  constexpr int kOffset = MIN ? 0 : FIVE ? 16 : 8;
  float d[kRows], m[kRows];
  halves(p, d);
  if (MIN) halves(p + 32, m);
  const uint8_t* qh = p + (MIN ? 64 : 32);
  const uint8_t* qs = qh + (FIVE ? 64 : 0);
  for (int r = 0; r < rows; ++r) {
    const uint32_t h = FIVE ? word(qh + 4 * r) : 0;
    uint8_t q[32];
    for (int c = 0; c < 4; ++c) {
      const uint32_t v = word(qs + 64 * c + 4 * r);
      put(q + 4 * c, (v & kLow4) | (((h >> c) & kBit0) << 4));
      put(q + 16 + 4 * c, ((v >> 4) & kLow4) | (((h >> (c + 4)) & kBit0) << 4));
    }
    float* o = y + r * ld;
    for (int l = 0; l < 32; ++l) {
      if (MIN) o[l] = d[r] * static_cast<float>(q[l]) + m[r];
      else o[l] = d[r] * static_cast<float>(q[l] - kOffset);
    }
  }
}

// q4_k / q5_k (HIGH): d[16] | dmin[16] | 12 scale planes (byte k of the 16 rows) | (8 chunks of qh: bit j of
// weight l's byte, sub-block j's fifth bit) | 32 chunks (pair p of sub-blocks, chunk c: low nibbles sub-block 2p,
// high 2p + 1, weights 4c..). Each weight (d sc) q - dmin mn, both products exact
template <bool HIGH>
void qk45(const uint8_t* p, int rows, float* y, int64_t ld) {
  float d[kRows], dmin[kRows];
  halves(p, d);
  halves(p + 32, dmin);
  const uint8_t* planes = p + 64;
  const uint8_t* qh = p + 256;
  const uint8_t* qs = p + (HIGH ? 256 + 512 : 256);
  for (int r = 0; r < rows; ++r) {
    float* o = y + r * ld;
    uint8_t s[12];
    for (int k = 0; k < 12; ++k) s[k] = planes[16 * k + r];
    uint32_t h[8];
    for (int c = 0; c < 8; ++c) h[c] = HIGH ? word(qh + 64 * c + 4 * r) : 0;
    for (int j = 0; j < 8; ++j) {  // ggml's get_scale_min_k4
      const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
      const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      const float scale = d[r] * static_cast<float>(sc), low = dmin[r] * static_cast<float>(mn);
      uint8_t q[32];
      for (int c = 0; c < 8; ++c)
        put(q + 4 * c, ((word(qs + 64 * (8 * (j / 2) + c) + 4 * r) >> (4 * (j % 2))) & kLow4) |
                           (((h[c] >> j) & kBit0) << 4));
      for (int l = 0; l < 32; ++l) o[32 * j + l] = scale * static_cast<float>(q[l]) - low;
    }
  }
}

// q6_k: d[16] | 16 planes of int8 scales | per half n, chunk c: ql[64n + 4c..], ql[64n + 32 + 4c..], qh[32n +
// 4c..] of the 16 rows; quant k (0..3) of a chunk is weight 128n + 32k + 4c.., of sub-block 8n + 2k + c / 4
void q6_k(const uint8_t* p, int rows, float* y, int64_t ld) {
  float d[kRows];
  halves(p, d);
  for (int r = 0; r < rows; ++r) {
    float* o = y + r * ld;
    for (int n = 0; n < 2; ++n) {
      uint8_t q[128];
      for (int c = 0; c < 8; ++c) {
        const uint8_t* ch = p + 288 + 192 * (8 * n + c) + 4 * r;
        const uint32_t a = word(ch), b = word(ch + 64), h = word(ch + 128);
        put(q + 4 * c, (a & kLow4) | ((h & 0x03030303u) << 4));
        put(q + 32 + 4 * c, (b & kLow4) | ((h & 0x0C0C0C0Cu) << 2));
        put(q + 64 + 4 * c, ((a >> 4) & kLow4) | (h & 0x30303030u));
        put(q + 96 + 4 * c, ((b >> 4) & kLow4) | ((h >> 2) & 0x30303030u));
      }
      for (int s = 0; s < 8; ++s) {
        const float scale = d[r] * static_cast<float>(static_cast<int8_t>(p[32 + 16 * (8 * n + s) + r]));
        for (int l = 16 * s; l < 16 * s + 16; ++l) o[128 * n + l] = scale * static_cast<float>(q[l] - 32);
      }
    }
  }
}

struct DequantType {
  const char* name;
  int block, bytes;
  BlockDequant fn;
};

DequantType dequant_type(int64_t ggml_type) {
  switch (ggml_type) {
    case 8: return {"q8_0", 32, 34, q8_0};
    case 2: return {"q4_0", 32, 18, q32<false, false>};
    case 3: return {"q4_1", 32, 20, q32<true, false>};
    case 6: return {"q5_0", 32, 22, q32<false, true>};
    case 7: return {"q5_1", 32, 24, q32<true, true>};
    case 12: return {"q4_k", 256, 144, qk45<false>};
    case 13: return {"q5_k", 256, 176, qk45<true>};
    case 14: return {"q6_k", 256, 210, q6_k};
  }
  TORCH_CHECK_VALUE(false, "decoderlab::dequantize: GGML type ", ggml_type,
                    " is not a block type the kernels hold (q8_0 = 8, q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, "
                    "q4_k = 12, q5_k = 13, q6_k = 14)");
}

at::Tensor dequantize(const at::Tensor& packed, int64_t ggml_type, int64_t out_features, int64_t in_features,
                      int64_t start, int64_t stop) {
  const DequantType t = dequant_type(ggml_type);
  TORCH_CHECK_VALUE(out_features > 0 && in_features > 0 && in_features % t.block == 0,
                    "decoderlab::dequantize: a ", t.name, " matrix needs out_features > 0 and in_features a positive "
                    "multiple of ", t.block, "; got (", out_features, ", ", in_features, ")");
  const int64_t nblk = in_features / t.block, groups = (out_features + kRows - 1) / kRows;
  const int64_t group_bytes = nblk * kRows * t.bytes;
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.device().is_cpu() &&
                        packed.numel() == groups * group_bytes,
                    "decoderlab::dequantize: packed must be the contiguous uint8 CPU tensor of pack() for (",
                    out_features, ", ", in_features, "): ", groups * group_bytes, " bytes; got ", packed.numel(),
                    " ", packed.scalar_type(), " on ", packed.device());
  TORCH_CHECK_VALUE(0 <= start && start <= stop && stop <= out_features && start % kRows == 0,
                    "decoderlab::dequantize: rows [start, stop) = [", start, ", ", stop, ") must lie in [0, ",
                    out_features, "] with start a multiple of ", kRows);
  at::Tensor out = at::detail::empty_cpu({stop - start, in_features}, at::kFloat);
  if (stop == start) return out;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t g0 = start / kRows, g1 = (stop + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, 32768 / (kRows * in_features));
  at::parallel_for(g0, g1, grain, [&](int64_t a, int64_t b) {
    for (int64_t g = a; g < b; ++g) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, stop - g * kRows));
      const uint8_t* gp = w + g * group_bytes;
      float* yg = y + (g * kRows - start) * in_features;
      for (int64_t k = 0; k < nblk; ++k) t.fn(gp + k * kRows * t.bytes, rows, yg + k * t.block, in_features);
    }
  });
  return out;
}

}  // namespace
}  // namespace dlk

// plain C++ that every x86-64 CPU runs: registered whatever instruction sets the CPU has
TORCH_LIBRARY_IMPL(decoderlab, CPU, m) { m.impl("dequantize", &dlk::dequantize); }
