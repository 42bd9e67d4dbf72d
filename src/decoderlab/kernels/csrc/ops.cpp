// The torch.library ops of namespace decoderlab: the activation quantizers (ggml's, exactly), the dispatch to the
// instruction set's kernels by what cpuid reports, and the rows split over the intra-op threads. Compiled with
// the baseline flags: nothing here runs an instruction the CPU may lack.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include "common.h"

namespace dlk {
namespace {

// ---- the CPU's instruction sets ------------------------------------------------------------------------------

struct Isa {
  const char* name;
  const KernelSet* (*table)();
};

#if defined(__x86_64__) || defined(_M_X64)
uint64_t xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// the sets this CPU and its OS run, best first: cpuid leaves 1 and 7 for the instructions, XCR0 for the OS saving
// the registers (AVX's ymm; AVX-512's opmask and zmm)
std::vector<Isa> detect() {
  std::vector<Isa> found;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return found;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!(osxsave && avx && fma && f16c) || (xcr0() & 0x6) != 0x6) return found;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return found;
  const bool avx2 = b & (1u << 5);
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31)) &&
                      (xcr0() & 0xE6) == 0xE6;
  const bool avx512vnni = avx512 && (c & (1u << 11));
  unsigned a1 = 0, b1, c1, d1;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool avxvnni = avx2 && (a1 & (1u << 4));
  if (!avx2) return found;
#ifndef DLK_NO_AVX512VNNI
  if (avx512vnni) found.push_back({"avx512-vnni", kernels_avx512vnni});
#endif
#ifndef DLK_NO_AVXVNNI
  if (avxvnni) found.push_back({"avx-vnni", kernels_avxvnni});
#endif
  found.push_back({"avx2", kernels_avx2});
  return found;
}
#else
std::vector<Isa> detect() { return {}; }
#endif

const std::vector<Isa>& isas() {
  static const std::vector<Isa> found = detect();
  return found;
}

const KernelSet* g_set = nullptr;

const KernelSet* current() {
  if (g_set == nullptr) {
    TORCH_CHECK(!isas().empty(), "decoderlab kernels: this CPU has no AVX2 + FMA + F16C");
    g_set = isas().front().table();
  }
  return g_set;
}

// ---- activations, quantized as ggml's x86 CPU backend does -----------------------------------------------------

// round to nearest, ties to even, for |v| < 2^22: ggml's nearest_int (the float addition rounds)
inline int nearest_int(float v) {
  float t = v + 12582912.f;
  int32_t i;
  std::memcpy(&i, &t, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// q8_0 / q8_1, one block of 32: ggml-cpu's x86 quantize_row_q8_0 / _q8_1 (d = amax / 127 kept as float16,
// q = round-half-even(x * (127 / amax)), q8_1's s = float16(d * sum(q)) with d unrounded)
void quant32(const float* x, int8_t* q, c10::Half* dh, int32_t* sum, c10::Half* sh) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  int32_t s = 0;
  for (int j = 0; j < 32; ++j) {
    q[j] = static_cast<int8_t>(nearest_int(x[j] * id));
    s += q[j];
  }
  *dh = c10::Half(d);
  *sum = s;
  if (sh) *sh = c10::Half(d * static_cast<float>(s));
}

// q8_K, one block of 256: ggml's quantize_row_q8_K_ref (the x86 backend's q8_K): the scale from the signed value
// of largest magnitude (the first), q = min(127, nearest(-127 / max * x)), d = 1 / that, the sums of 16
void quant256(const float* x, int8_t* q, float* d, int32_t* bsums) {
  float amax = 0.f, max = 0.f;
  for (int j = 0; j < 256; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) {
      amax = ax;
      max = x[j];
    }
  }
  if (amax == 0.f) {
    std::memset(q, 0, 256);
    std::fill(bsums, bsums + 16, 0);
    *d = 0.f;
    return;
  }
  const float iscale = -127.f / max;
  for (int j = 0; j < 256; ++j) q[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * x[j])));
  for (int i = 0; i < 16; ++i) {
    int32_t s = 0;
    for (int j = 0; j < 16; ++j) s += q[16 * i + j];
    bsums[i] = s;
  }
  *d = 1.f / iscale;
}

// n rows of width k quantized for a product: the quants, the scales, the sums (common.h's Act)
struct Acts {
  std::vector<int8_t> qs;
  std::vector<float> d;
  std::vector<int32_t> s;
  std::vector<Act> rows;
};

void quantize_rows(const float* x, int64_t n, int64_t k, int block, Acts& out) {
  const int64_t nblk = k / block, nsum = block == 256 ? 24 : 1;
  out.qs.resize(n * k);
  out.d.resize(n * nblk);
  out.s.resize(n * nblk * nsum);
  out.rows.resize(n);
  for (int64_t r = 0; r < n; ++r) {
    int8_t* q = out.qs.data() + r * k;
    float* d = out.d.data() + r * nblk;
    int32_t* s = out.s.data() + r * nblk * nsum;
    for (int64_t b = 0; b < nblk; ++b) {
      const float* xb = x + r * k + b * block;
      if (block == 32) {
        c10::Half dh;
        quant32(xb, q + 32 * b, &dh, s + b, nullptr);
        d[b] = static_cast<float>(dh);
      } else {
        int32_t* sb = s + 24 * b;
        quant256(xb, q + 256 * b, d + b, sb);
        for (int j = 0; j < 8; ++j) sb[16 + j] = sb[2 * j] + sb[2 * j + 1];
      }
    }
    out.rows[r] = {q, d, s};
  }
}

// ---- the types ---------------------------------------------------------------------------------------------------

struct BlockType {
  int block, bytes;
  BlockKernel KernelSet::*kernel;
};

BlockType block_type(int64_t ggml_type) {
  switch (ggml_type) {
    case 8: return {32, 34, &KernelSet::q8_0};
    case 2: return {32, 18, &KernelSet::q4_0};
    case 3: return {32, 20, &KernelSet::q4_1};
    case 6: return {32, 22, &KernelSet::q5_0};
    case 7: return {32, 24, &KernelSet::q5_1};
    case 12: return {256, 144, &KernelSet::q4_k};
    case 13: return {256, 176, &KernelSet::q5_k};
    case 14: return {256, 210, &KernelSet::q6_k};
  }
  TORCH_CHECK_VALUE(false, "decoderlab::block_linear: GGML type ", ggml_type,
                    " is not a block type the kernels multiply (q8_0 = 8, q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, "
                    "q4_k = 12, q5_k = 13, q6_k = 14)");
}

void check_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1, "decoderlab::", op,
                    ": x must be a float32 CPU tensor of at least one dimension; got ", x.scalar_type(), " on ",
                    x.device(), " with ", x.dim(), " dimensions");
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t last) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = last;
  return shape;
}

// ---- the ops -------------------------------------------------------------------------------------------------------

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& packed, int64_t ggml_type, int64_t out_features) {
  check_input(x, "block_linear");
  const BlockType t = block_type(ggml_type);
  const int64_t k = x.size(-1), n = k ? x.numel() / k : 0;
  TORCH_CHECK_VALUE(k > 0 && k % t.block == 0, "decoderlab::block_linear: the width of x (", k,
                    ") is not a positive multiple of the type's block size ", t.block);
  const int64_t nblk = k / t.block, groups = (out_features + kRows - 1) / kRows;
  TORCH_CHECK_VALUE(out_features > 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                        packed.device().is_cpu() && packed.numel() == groups * kRows * nblk * t.bytes,
                    "decoderlab::block_linear: packed must be the contiguous uint8 CPU tensor of pack() for (",
                    out_features, ", ", k, "): ", groups * kRows * nblk * t.bytes, " bytes; got ", packed.numel(),
                    " ", packed.scalar_type());
  const BlockKernel kernel = current()->*t.kernel;
  const at::Tensor xc = x.contiguous();
  thread_local Acts acts;  // the buffers kept between calls of this thread: no allocation per product
  quantize_rows(xc.data_ptr<float>(), n, k, t.block, acts);
  const int64_t width = groups * kRows;
  at::Tensor y = at::empty(width == out_features ? out_shape(x, width) : std::vector<int64_t>{n, width}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  // (a pointer, not the name: inside the lambda a pool thread's `acts` would be its own thread_local)
  const Act* act_rows = acts.rows.data();
  const int64_t grain = std::max<int64_t>(1, 32768 / (kRows * k));  // ~32k weights a task at least
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    kernel(wp, nblk, g0, g1, act_rows, static_cast<int>(n), yp, width);
  });
  if (width == out_features) return y;
  return y.narrow(1, 0, out_features).contiguous().view(out_shape(x, out_features));
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight) {
  check_input(x, "dense_linear");
  const int64_t k = x.size(-1), n = k ? x.numel() / k : 0;
  const auto st = weight.scalar_type();
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == k && weight.is_contiguous() && weight.device().is_cpu() &&
                        (st == at::kFloat || st == at::kHalf || st == at::kBFloat16),
                    "decoderlab::dense_linear: weight must be a contiguous (out, ", k,
                    ") float32 / float16 / bfloat16 CPU tensor; got ", weight.sizes(), " ", st);
  const KernelSet* set = current();
  const DenseKernel kernel = st == at::kFloat ? set->f32 : st == at::kHalf ? set->f16 : set->bf16;
  const int64_t out = weight.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(out_shape(x, out), x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const void* wp = weight.data_ptr();
  const int64_t quads = (out + 3) / 4, grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, k));
  at::parallel_for(0, quads, grain, [&](int64_t q0, int64_t q1) {
    kernel(wp, k, 4 * q0, std::min(4 * q1, out), xp, k, static_cast<int>(n), yp, out);
  });
  return y;
}

// ggml's block bytes of x's rows quantized to q8_0 (8), q8_1 (9) or q8_K (15)
at::Tensor quantize_activation(const at::Tensor& x, int64_t ggml_type) {
  check_input(x, "quantize_activation");
  TORCH_CHECK_VALUE(ggml_type == 8 || ggml_type == 9 || ggml_type == 15, "decoderlab::quantize_activation: GGML type ",
                    ggml_type, " is not an activation type (q8_0 = 8, q8_1 = 9, q8_K = 15)");
  const int block = ggml_type == 15 ? 256 : 32, bytes = ggml_type == 15 ? 292 : ggml_type == 9 ? 36 : 34;
  const int64_t k = x.size(-1), n = k ? x.numel() / k : 0;
  TORCH_CHECK_VALUE(k > 0 && k % block == 0, "decoderlab::quantize_activation: the width of x (", k,
                    ") is not a positive multiple of the block size ", block);
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  at::Tensor out = at::empty({n, k / block * bytes}, x.options().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n * (k / block); ++i, o += bytes) {
    const float* xb = xp + i * block;
    if (block == 32) {
      c10::Half dh, sh;
      int32_t sum;
      quant32(xb, reinterpret_cast<int8_t*>(o + (ggml_type == 9 ? 4 : 2)), &dh, &sum, ggml_type == 9 ? &sh : nullptr);
      std::memcpy(o, &dh.x, 2);
      if (ggml_type == 9) std::memcpy(o + 2, &sh.x, 2);
    } else {
      float d;
      int32_t bsums[16];
      quant256(xb, reinterpret_cast<int8_t*>(o + 4), &d, bsums);
      std::memcpy(o, &d, 4);
      for (int j = 0; j < 16; ++j) {
        const int16_t s = static_cast<int16_t>(bsums[j]);
        std::memcpy(o + 260 + 2 * j, &s, 2);
      }
    }
  }
  return out.view(out_shape(x, k / block * bytes));
}

// the instruction set in use, after choosing `request` ("" keeps it, "auto" = the best this CPU has)
std::string kernels_isa(std::string request) {
  if (request == "auto") {
    g_set = nullptr;
  } else if (!request.empty()) {
    std::string names;
    for (const Isa& i : isas()) {
      if (request == i.name) {
        g_set = i.table();
        return request;
      }
      names += names.empty() ? i.name : std::string(", ") + i.name;
    }
    TORCH_CHECK_VALUE(false, "kernel instruction set '", request, "' is not one this CPU runs; it runs: ",
                      names.empty() ? "none" : names);
  }
  return isas().empty() ? std::string("none") : std::string(current()->name);
}

std::vector<std::string> kernels_isas() {
  std::vector<std::string> names;
  for (const Isa& i : isas()) names.emplace_back(i.name);
  return names;
}

}  // namespace
}  // namespace dlk

TORCH_LIBRARY(decoderlab, m) {
  m.def("block_linear(Tensor x, Tensor packed, int ggml_type, int out_features) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("quantize_activation(Tensor x, int ggml_type) -> Tensor");
  m.def("kernels_isa(str request) -> str", &dlk::kernels_isa);
  m.def("kernels_isas() -> str[]", &dlk::kernels_isas);
}

// the CPU kernels only where the CPU runs one of the instruction sets: elsewhere Python registers the portable path
TORCH_LIBRARY_IMPL(decoderlab, CPU, m) {
  if (dlk::isas().empty()) return;
  m.impl("block_linear", &dlk::block_linear);
  m.impl("dense_linear", &dlk::dense_linear);
  m.impl("quantize_activation", &dlk::quantize_activation);
}
