// The torch.library ops of namespace decoderlab: the activations quantized once per call (each instruction set's
// quantizers, ggml's exactly), the dispatch to the instruction set's kernels by what cpuid reports, and the
// weights' rows split over the intra-op threads. Compiled with the baseline flags: nothing here runs an
// instruction the CPU may lack.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#include "common.h"
#include "products.h"

namespace dlk {
namespace {

// ---- the CPU's instruction sets ------------------------------------------------------------------------------

struct Isa {
  const char* name;
  const KernelSet* (*table)();
};

#if !defined(DLK_NO_AVX512VNNI) && !defined(DLK_NO_AVX512BF16)
// AVX512-VNNI's table with the bfloat16 product by vdpbf16ps
const KernelSet* kernels_avx512bf16() {
  static const KernelSet set = [] {
    KernelSet s = *kernels_avx512vnni();
    s.name = "avx512-bf16";
    s.bf16 = dense_bf16_avx512bf16();
    s.bf16_x_float = false;  // vdpbf16ps multiplies bfloat16 pairs
    return s;
  }();
  return &set;
}
#endif

#if !defined(DLK_NO_AVX512VNNI) && !defined(DLK_NO_AVX512BF16) && !defined(DLK_NO_AMX)
// AVX512-BF16's table with the bfloat16 product by AMX's tiles
const KernelSet* kernels_amx() {
  static const KernelSet set = [] {
    KernelSet s = *kernels_avx512bf16();
    s.name = "amx-bf16";
    s.bf16 = dense_bf16_amx();
    return s;
  }();
  return &set;
}
#endif

#if defined(__x86_64__) || defined(_M_X64)
// Linux hands a process AMX's tile registers (8 KB of state a thread) only when asked; a tile instruction before
// that is SIGILL. Asked once, at detection: the set is offered only where the kernel said yes
bool tiles_granted() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

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
  const bool avxvnni = avx2 && (a1 & (1u << 4)), avx512bf16 = avx512vnni && (a1 & (1u << 5));
  // AMX-BF16 and AMX-TILE (leaf 7's EDX bits 22, 24); XCR0's tile configuration and data (bits 17, 18)
  const bool amx = avx512bf16 && (d & (1u << 22)) && (d & (1u << 24)) && (xcr0() & 0x60000) == 0x60000;
  if (!avx2) return found;
#ifndef DLK_NO_AVX512VNNI
#ifndef DLK_NO_AVX512BF16
#ifndef DLK_NO_AMX
  if (amx && tiles_granted()) found.push_back({"amx-bf16", kernels_amx});
#endif
  if (avx512bf16) found.push_back({"avx512-bf16", kernels_avx512bf16});
#endif
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

// ---- activations -------------------------------------------------------------------------------------------------

// n rows of width k quantized for a product by the instruction set's quantizer (quant_kernels.h): the quants, the
// scales and the per-block terms of common.h's Act
struct Acts {
  std::vector<int8_t> qs;
  std::vector<float> d, ds;
  std::vector<int32_t> sums, s8, s16, s128, bs16x32, bs32;
  std::vector<Act> rows;
};

const Act* quantize_rows(const KernelSet* set, const float* x, int64_t n, int64_t k, int block, Acts& a) {
  const int64_t nblk = k / block, nsum = block == 256 ? 16 : 1;
  int8_t* qs = grow(a.qs, n * k);
  float* d = grow(a.d, n * nblk);
  int32_t* sums = grow(a.sums, n * nblk * nsum);
  Act* rows = grow(a.rows, n);
  if (block == 32) {
    float* ds = grow(a.ds, n * nblk);
    int32_t *s8 = grow(a.s8, n * nblk), *s16 = grow(a.s16, n * nblk), *s128 = grow(a.s128, n * nblk);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t o = r * nblk;
      set->quantize32(x + r * k, k, qs + r * k, d + o, sums + o);
      for (int64_t b = o; b < o + nblk; ++b) {
        s8[b] = 8 * sums[b], s16[b] = 16 * sums[b], s128[b] = 128 * sums[b];
        ds[b] = d[b] * static_cast<float>(sums[b]);
      }
      rows[r] = {qs + r * k, d + o, s8 + o, s16 + o, s128 + o, ds + o, nullptr, nullptr};
    }
  } else {
    int32_t *bs16x32 = grow(a.bs16x32, n * nblk * 16), *bs32 = grow(a.bs32, n * nblk * 4);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t o = r * nblk;
      int32_t* s = sums + 16 * o;
      set->quantize256(x + r * k, k, qs + r * k, d + o, s);
      for (int64_t j = 0; j < 16 * nblk; ++j) bs16x32[16 * o + j] = 32 * s[j];
      for (int64_t j = 0; j < 4 * nblk; ++j) {  // sums of 32 (at most 4064 in magnitude) as int16 pairs
        const uint32_t lo = static_cast<uint32_t>(s[4 * j] + s[4 * j + 1]) & 0xffffu;
        const uint32_t hi = static_cast<uint32_t>(s[4 * j + 2] + s[4 * j + 3]);
        bs32[4 * o + j] = static_cast<int32_t>((hi << 16) | lo);
      }
      rows[r] = {qs + r * k, d + o, nullptr, nullptr, nullptr, nullptr, bs16x32 + 16 * o, bs32 + 4 * o};
    }
  }
  return rows;
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

// a float32 output, allocated without a trip through the dispatcher
at::Tensor new_output(const std::vector<int64_t>& shape) { return at::detail::empty_cpu(shape, at::kFloat); }

// ---- block products ----------------------------------------------------------------------------------------------

// one block weight of a call: checked, its kernel, where its output goes
struct BlockJob {
  BlockKernel kernel;
  const uint8_t* w;
  int64_t nblk, groups, width, out;
  int block;
  float* y;
  at::Tensor t;
};

BlockJob block_job(const KernelSet* set, const at::Tensor& x, const at::Tensor& packed, int64_t ggml_type,
                   int64_t out_features) {
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
  const int64_t width = groups * kRows;
  at::Tensor y = new_output(width == out_features ? out_shape(x, width) : std::vector<int64_t>{n, width});
  return {set->*t.kernel, packed.data_ptr<uint8_t>(), nblk, groups, width, out_features, t.block,
          y.data_ptr<float>(), y};
}

at::Tensor finished(const BlockJob& j, const at::Tensor& x) {
  if (j.width == j.out) return j.t;
  return j.t.narrow(1, 0, j.out).contiguous().view(out_shape(x, j.out));
}

// the jobs' groups as one range split over the threads: each group is computed by one thread, the same way
// whatever the split (~32k weights a task at least)
void run_blocks(std::vector<BlockJob>& jobs, const Act* act32, const Act* act256, int64_t n, int64_t k) {
  int64_t total = 0;
  for (const BlockJob& j : jobs) total += j.groups;
  const int64_t grain = std::max<int64_t>(1, 32768 / (kRows * k));
  BlockJob* js = jobs.data();
  const size_t nj = jobs.size();
  at::parallel_for(0, total, grain, [&](int64_t g0, int64_t g1) {
    int64_t base = 0;
    for (size_t i = 0; i < nj && base < g1; base += js[i].groups, ++i) {
      const int64_t lo = std::max(g0, base) - base, hi = std::min(g1, base + js[i].groups) - base;
      if (lo < hi)
        js[i].kernel(js[i].w, js[i].nblk, lo, hi, js[i].block == 32 ? act32 : act256, static_cast<int>(n), js[i].y,
                     js[i].width);
    }
  });
}

thread_local Acts t_acts32, t_acts256;

std::vector<at::Tensor> block_products(const at::Tensor& x, const at::Tensor* packed, const int64_t* types,
                                       const int64_t* outs, size_t count) {
  check_input(x, "block_linear");
  const KernelSet* set = current();
  std::vector<BlockJob> jobs;
  jobs.reserve(count);
  bool b32 = false, b256 = false;
  for (size_t i = 0; i < count; ++i) {
    jobs.push_back(block_job(set, x, packed[i], types[i], outs[i]));
    (jobs.back().block == 32 ? b32 : b256) = true;
  }
  const int64_t k = x.size(-1), n = x.numel() / k;
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  // (pointers, not the names: inside the lambda a pool thread's buffers would be its own thread_locals)
  const Act* act32 = b32 && n ? quantize_rows(set, xp, n, k, 32, t_acts32) : nullptr;
  const Act* act256 = b256 && n ? quantize_rows(set, xp, n, k, 256, t_acts256) : nullptr;
  if (n) run_blocks(jobs, act32, act256, n, k);
  std::vector<at::Tensor> ys;
  ys.reserve(count);
  for (const BlockJob& j : jobs) ys.push_back(finished(j, x));
  return ys;
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& packed, int64_t ggml_type, int64_t out_features) {
  return block_products(x, &packed, &ggml_type, &out_features, 1)[0];
}

std::vector<at::Tensor> block_linear_many(const at::Tensor& x, at::TensorList packed, at::IntArrayRef types,
                                          at::IntArrayRef outs) {
  TORCH_CHECK_VALUE(packed.size() == types.size() && packed.size() == outs.size() && !packed.empty(),
                    "decoderlab::block_linear_many: one GGML type and one out_features per packed weight (and at "
                    "least one weight); got ", packed.size(), " weights, ", types.size(), " types, ", outs.size(),
                    " out_features");
  return block_products(x, packed.data(), types.data(), outs.data(), packed.size());
}

// ---- 16- and 32-bit products ---------------------------------------------------------------------------------------

thread_local std::vector<bf16_t> t_xbf16;
thread_local std::vector<float> t_xrounded;

std::vector<at::Tensor> dense_products(const at::Tensor& x, const at::Tensor* weights, size_t count) {
  check_input(x, "dense_linear");
  const int64_t k = x.size(-1), n = k ? x.numel() / k : 0;
  const KernelSet* set = current();
  bool bf16 = false;
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& w = weights[i];
    const auto st = w.scalar_type();
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == k && w.is_contiguous() && w.device().is_cpu() &&
                          (st == at::kFloat || st == at::kHalf || st == at::kBFloat16),
                      "decoderlab::dense_linear: weight must be a contiguous (out, ", k,
                      ") float32 / float16 / bfloat16 CPU tensor; got ", w.sizes(), " ", st);
    bf16 = bf16 || st == at::kBFloat16;
  }
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const void* xb = nullptr;
  if (bf16 && n) {  // a bfloat16 weight multiplies the activations rounded to bfloat16, as ggml's
    bf16_t* buf = grow(t_xbf16, n * k);
    set->to_bf16(xp, n * k, buf);
    if (set->bf16_x_float) {  // widened back once, not at every weight row (the generic kernels take float32 x)
      float* wide = grow(t_xrounded, n * k);
      for (int64_t i = 0; i < n * k; ++i) {
        const uint32_t bits = static_cast<uint32_t>(buf[i].bits) << 16;
        std::memcpy(wide + i, &bits, 4);
      }
      xb = wide;
    } else {
      xb = buf;
    }
  }
  std::vector<at::Tensor> ys;
  ys.reserve(count);
  std::vector<int64_t> quads(count + 1, 0);  // weight i's rows are quads [quads[i], quads[i + 1]) of the range
  for (size_t i = 0; i < count; ++i) {
    ys.push_back(new_output(out_shape(x, weights[i].size(0))));
    quads[i + 1] = quads[i] + (weights[i].size(0) + 3) / 4;
  }
  if (n == 0) return ys;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, k));
  at::parallel_for(0, quads[count], grain, [&](int64_t q0, int64_t q1) {
    for (size_t i = 0; i < count; ++i) {
      const int64_t lo = std::max(q0, quads[i]) - quads[i], hi = std::min(q1, quads[i + 1]) - quads[i];
      if (lo >= hi) continue;
      const at::Tensor& w = weights[i];
      const auto st = w.scalar_type();
      const DenseKernel kernel = st == at::kFloat ? set->f32 : st == at::kHalf ? set->f16 : set->bf16;
      const int64_t out = w.size(0);
      kernel(w.data_ptr(), k, 4 * lo, std::min(4 * hi, out), st == at::kBFloat16 ? xb : static_cast<const void*>(xp),
             k, static_cast<int>(n), ys[i].data_ptr<float>(), out);
    }
  });
  return ys;
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight) { return dense_products(x, &weight, 1)[0]; }

std::vector<at::Tensor> dense_linear_many(const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK_VALUE(!weights.empty(), "decoderlab::dense_linear_many: no weights");
  return dense_products(x, weights.data(), weights.size());
}

// ---- activation bytes -----------------------------------------------------------------------------------------------

// ggml's block bytes of x's rows quantized to q8_0 (8), q8_1 (9) or q8_K (15), by the instruction set's quantizer
at::Tensor quantize_activation(const at::Tensor& x, int64_t ggml_type) {
  check_input(x, "quantize_activation");
  TORCH_CHECK_VALUE(ggml_type == 8 || ggml_type == 9 || ggml_type == 15, "decoderlab::quantize_activation: GGML type ",
                    ggml_type, " is not an activation type (q8_0 = 8, q8_1 = 9, q8_K = 15)");
  const int block = ggml_type == 15 ? 256 : 32, bytes = ggml_type == 15 ? 292 : ggml_type == 9 ? 36 : 34;
  const int64_t k = x.size(-1), n = k ? x.numel() / k : 0;
  TORCH_CHECK_VALUE(k > 0 && k % block == 0, "decoderlab::quantize_activation: the width of x (", k,
                    ") is not a positive multiple of the block size ", block);
  const at::Tensor xc = x.contiguous();
  const int64_t nblk = n * (k / block), nsum = block == 256 ? 16 : 1;
  std::vector<int8_t> qs(n * k);
  std::vector<float> d(nblk);
  std::vector<int32_t> sums(nblk * nsum);
  const Quantizer quantize = block == 32 ? current()->quantize32 : current()->quantize256;
  for (int64_t r = 0; r < n; ++r)
    quantize(xc.data_ptr<float>() + r * k, k, qs.data() + r * k, d.data() + r * (k / block),
             sums.data() + r * (k / block) * nsum);
  at::Tensor out = at::detail::empty_cpu({n, k / block * bytes}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < nblk; ++i, o += bytes) {
    const int8_t* q = qs.data() + i * block;
    if (block == 32) {
      const c10::Half dh(d[i]);  // exact: d is a float16's value
      std::memcpy(o, &dh.x, 2);
      if (ggml_type == 9) {  // s = float16(d * sum(q)) with d before its rounding, as ggml's: amax / 127
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(xc.data_ptr<float>()[i * 32 + j]));
        const c10::Half sh(amax / 127.f * static_cast<float>(sums[i]));
        std::memcpy(o + 2, &sh.x, 2);
      }
      std::memcpy(o + (ggml_type == 9 ? 4 : 2), q, 32);
    } else {
      std::memcpy(o, &d[i], 4);
      std::memcpy(o + 4, q, 256);
      for (int j = 0; j < 16; ++j) {
        const int16_t s = static_cast<int16_t>(sums[i * 16 + j]);
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

const KernelSet* kernel_set() { return current(); }

std::vector<at::Tensor> products_of_blocks(const at::Tensor& x, const at::Tensor* packed, const int64_t* types,
                                           const int64_t* outs, size_t count) {
  return block_products(x, packed, types, outs, count);
}

std::vector<at::Tensor> products_of_dense(const at::Tensor& x, const at::Tensor* weights, size_t count) {
  return dense_products(x, weights, count);
}

}  // namespace dlk

TORCH_LIBRARY(decoderlab, m) {
  m.def("block_linear(Tensor x, Tensor packed, int ggml_type, int out_features) -> Tensor");
  m.def("block_linear_many(Tensor x, Tensor[] packed, int[] ggml_types, int[] out_features) -> Tensor[]");
  m.def("dense_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("dense_linear_many(Tensor x, Tensor[] weights) -> Tensor[]");
  m.def("quantize_activation(Tensor x, int ggml_type) -> Tensor");
  // SymInt: a compiled graph's row count (a batch's token count) stays symbolic -- with int, dynamo fixes
  // it and compiles a graph per batch size
  m.def("dequantize(Tensor packed, int ggml_type, SymInt out_features, SymInt in_features, SymInt start, "
        "SymInt stop) -> Tensor");
  m.def("decode_step(Tensor x, Tensor positions, int column, Tensor? padding_mask, Tensor[] tensors, int[] ints, "
        "float[] floats, Tensor(a!)[] k_cache, Tensor(b!)[] v_cache) -> Tensor");
  m.def("pack_fields(Tensor blocks, int blocks_per_row, int block_bytes, int[] fields) -> Tensor");
  m.def("kernels_isa(str request) -> str", &dlk::kernels_isa);
  m.def("kernels_isas() -> str[]", &dlk::kernels_isas);
}

// the CPU kernels only where the CPU runs one of the instruction sets: elsewhere Python registers the portable path
TORCH_LIBRARY_IMPL(decoderlab, CPU, m) {
  if (dlk::isas().empty()) return;
  m.impl("block_linear", &dlk::block_linear);
  m.impl("block_linear_many", &dlk::block_linear_many);
  m.impl("dense_linear", &dlk::dense_linear);
  m.impl("dense_linear_many", &dlk::dense_linear_many);
  m.impl("quantize_activation", &dlk::quantize_activation);
}
