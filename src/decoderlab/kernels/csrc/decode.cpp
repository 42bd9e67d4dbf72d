// One KV-cache decode step of a whole decoder stack in one call (decoderlab::decode_step): each row's new token
// through every block -- norms, the q/k/v product, QK-norm, rotary positions, the key and value written into the
// layer's cache, attention over the cached keys, the output product, the gated MLP -- then the final norm and the
// output layer. The products are ops.cpp's (the same kernels and numbers as block_linear / dense_linear); the rest
// is float32 arithmetic written here. Why: an eager step in Python costs ~15 torch calls a layer at microseconds
// each, more than the layer's arithmetic on a small model (SmolLM2-135M: 30 layers, ~1/3 of a step was the
// kernels); here a step is one call. decoderlab/fastdecode.py writes the step's program (the module docstring
// there says which models it takes) and falls back to the model's own blocks for everything else. Compiled with
// the baseline flags: nothing here runs an instruction the CPU may lack (the products dispatch by cpuid).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "common.h"
#include "products.h"

namespace dlk {
namespace {

// the program's two streams (tensors; integers), each read in order
struct Reader {
  at::TensorList t;
  at::IntArrayRef i;
  size_t at_t = 0, at_i = 0;
  const at::Tensor& tensor() {
    TORCH_CHECK_VALUE(at_t < t.size(), "decoderlab::decode_step: the program ran out of tensors at ", at_t);
    return t[at_t++];
  }
  int64_t integer() {
    TORCH_CHECK_VALUE(at_i < i.size(), "decoderlab::decode_step: the program ran out of integers at ", at_i);
    return i[at_i++];
  }
};

// a linear layer: its weights stacked along the rows (parts; GGML type >= 0 for packed blocks, -1 for a float
// weight), each part's output features, an optional float32 bias
struct Linear {
  std::vector<at::Tensor> parts;
  std::vector<int64_t> kinds, outs;
  at::Tensor bias;
  int64_t out = 0;
};

Linear read_linear(Reader& r) {
  Linear l;
  const int64_t n = r.integer();
  TORCH_CHECK_VALUE(n > 0, "decoderlab::decode_step: a linear layer of ", n, " weights");
  for (int64_t p = 0; p < n; ++p) {
    l.kinds.push_back(r.integer());
    l.outs.push_back(r.integer());
    l.parts.push_back(r.tensor());
    l.out += l.outs.back();
  }
  if (r.integer()) l.bias = r.tensor();
  return l;
}

at::Tensor new_rows(int64_t n, int64_t width) { return at::detail::empty_cpu({n, width}, at::kFloat); }

// x (n, k) times each linear: one (n, out) float32 a linear. Every block weight of the call is one products call
// (the input quantized once), every float weight another
std::vector<at::Tensor> apply(const at::Tensor& x, std::initializer_list<const Linear*> layers) {
  std::vector<at::Tensor> bp, dp;
  std::vector<int64_t> bk, bo;
  for (const Linear* l : layers)
    for (size_t p = 0; p < l->parts.size(); ++p) {
      if (l->kinds[p] >= 0) {
        bp.push_back(l->parts[p]), bk.push_back(l->kinds[p]), bo.push_back(l->outs[p]);
      } else {
        dp.push_back(l->parts[p]);
      }
    }
  const std::vector<at::Tensor> by = bp.empty() ? std::vector<at::Tensor>{}
                                                : products_of_blocks(x, bp.data(), bk.data(), bo.data(), bp.size());
  const std::vector<at::Tensor> dy = dp.empty() ? std::vector<at::Tensor>{} : products_of_dense(x, dp.data(), dp.size());
  const int64_t n = x.size(0);
  size_t ib = 0, id = 0;
  std::vector<at::Tensor> ys;
  for (const Linear* l : layers) {
    at::Tensor y;
    if (l->parts.size() == 1) {
      y = l->kinds[0] >= 0 ? by[ib++] : dy[id++];
    } else {  // the parts side by side in each row
      y = new_rows(n, l->out);
      int64_t col = 0;
      for (size_t p = 0; p < l->parts.size(); ++p) {
        const at::Tensor& part = l->kinds[p] >= 0 ? by[ib++] : dy[id++];
        const float* src = part.data_ptr<float>();
        for (int64_t r = 0; r < n; ++r)
          std::copy(src + r * l->outs[p], src + (r + 1) * l->outs[p], y.data_ptr<float>() + r * l->out + col);
        col += l->outs[p];
      }
    }
    if (l->bias.defined()) {
      const float* b = l->bias.data_ptr<float>();
      float* yp = y.data_ptr<float>();
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = 0; j < l->out; ++j) yp[r * l->out + j] += b[j];
    }
    ys.push_back(y);
  }
  return ys;
}

// y = x / sqrt(mean(x^2) + eps) * w over d values (RMSNorm; y may be x), rounded as ggml's rms_norm rounds it: the
// squares in float32 summed in double, the mean rounded to float32, then (x * scale) * w. The norm's output is
// quantized to 8-bit blocks for the next product, where one float32 ulp can move a quant: llama.cpp's rounding,
// not torch's, is the one the agreement with llama.cpp's logits asks for (bench/llamacpp.py --agreement)
void rms_norm(const float* x, const float* w, float eps, int64_t d, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < d; ++i) sum += static_cast<double>(x[i] * x[i]);
  const float mean = static_cast<float>(sum / static_cast<double>(d));
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = (x[i] * scale) * w[i];
}

void rms_norm_rows(const float* x, const at::Tensor& w, float eps, int64_t n, int64_t d, float* y) {
  TORCH_CHECK_VALUE(w.numel() == d && w.scalar_type() == at::kFloat && w.is_contiguous(),
                    "decoderlab::decode_step: a norm's weight must be ", d, " contiguous float32 values");
  for (int64_t r = 0; r < n; ++r) rms_norm(x + r * d, w.data_ptr<float>(), eps, d, y + r * d);
}

// one head's rotary positions at the row of cos/sin (hd / 2 each): layout 1 pairs (x[2i], x[2i+1]), layout 2 the
// halves (x[i], x[i + hd/2]) -- positions.py's RotaryEmbedding, the same float32 products and sums
void rope(float* x, const float* cos, const float* sin, int64_t hd, int64_t layout) {
  const int64_t half = hd / 2;
  if (layout == 2) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * cos[i] - x2 * sin[i];
      x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
  } else if (layout == 1) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[2 * i], x2 = x[2 * i + 1];
      x[2 * i] = x1 * cos[i] - x2 * sin[i];
      x[2 * i + 1] = x1 * sin[i] + x2 * cos[i];
    }
  }
}

struct Shape {
  int64_t n_head, n_kv_head, hd, layout, act;
  bool qk_norm, sandwich;
  float eps, qk_eps, scale;
};

struct Layer {
  int64_t ring, window;
  at::Tensor norm_1, q_norm, k_norm, cos, sin, norm_1_post, norm_2, norm_2_post;
  Linear qkv, o, gate, up, down;
};

Layer read_layer(Reader& r, const Shape& s) {
  Layer l;
  l.ring = r.integer();
  l.window = r.integer();
  l.norm_1 = r.tensor();
  l.qkv = read_linear(r);
  if (s.qk_norm) l.q_norm = r.tensor(), l.k_norm = r.tensor();
  if (s.layout) l.cos = r.tensor(), l.sin = r.tensor();
  l.o = read_linear(r);
  if (s.sandwich) l.norm_1_post = r.tensor();
  l.norm_2 = r.tensor();
  l.gate = read_linear(r);
  l.up = read_linear(r);
  l.down = read_linear(r);
  if (s.sandwich) l.norm_2_post = r.tensor();
  return l;
}

// QK-norm and rotary positions on each row's q and k heads, in place in qkv (B, (H + 2 H_kv) hd); k and v then
// written into the cache at `slot`
void queries_keys_values(const Shape& s, const Layer& l, float* qkv, int64_t b_rows, const int64_t* pos,
                         int64_t slot, const at::Tensor& kc, const at::Tensor& vc) {
  const int64_t hd = s.hd, width = (s.n_head + 2 * s.n_kv_head) * hd, cols = kc.size(2);
  float *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  for (int64_t b = 0; b < b_rows; ++b) {
    float* row = qkv + b * width;
    if (s.layout) {
      TORCH_CHECK_VALUE(pos[b] >= 0 && pos[b] < l.cos.size(0), "decoderlab::decode_step: position ", pos[b],
                        " is outside the rotary table's 0 .. ", l.cos.size(0) - 1);
    }
    for (int64_t h = 0; h < s.n_head + s.n_kv_head; ++h) {
      float* x = row + h * hd;
      if (s.qk_norm) rms_norm(x, (h < s.n_head ? l.q_norm : l.k_norm).data_ptr<float>(), s.qk_eps, hd, x);
      if (s.layout)
        rope(x, l.cos.data_ptr<float>() + pos[b] * (hd / 2), l.sin.data_ptr<float>() + pos[b] * (hd / 2), hd, s.layout);
    }
    for (int64_t g = 0; g < s.n_kv_head; ++g) {
      const int64_t at = ((b * s.n_kv_head + g) * cols + slot) * hd;
      std::copy(row + (s.n_head + g) * hd, row + (s.n_head + g + 1) * hd, kp + at);
      std::copy(row + (s.n_head + s.n_kv_head + g) * hd, row + (s.n_head + s.n_kv_head + g + 1) * hd, vp + at);
    }
  }
}

// The wider registers where the CPU has them (one clone a family, chosen at load by cpuid): the loops below are
// the same float32 operations in the same order in every clone (no contraction, no reassociation), only wider.
#if defined(__x86_64__) && defined(__ELF__) && (!defined(__clang__) || __clang_major__ >= 14)
#define DLK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DLK_CLONES
#endif

// out[j] = sum over t of w[t] * v[t][j], the keys in order for every j. Thirty-two outputs at a time are summed in
// registers across all the keys: summing into out itself stored and reloaded every output at every key (half of a
// batch-8 step's attention time went to that reload). The sums are the same sequence either way.
DLK_CLONES void weigh_values(const float* w, const float* v, int64_t n_k, int64_t hd, float* out) {
  constexpr int64_t kWide = 32;
  int64_t j0 = 0;
  for (; j0 + kWide <= hd; j0 += kWide) {
    float acc[kWide] = {};
    for (int64_t t = 0; t < n_k; ++t) {
      const float* vt = v + t * hd + j0;
      for (int64_t jj = 0; jj < kWide; ++jj) acc[jj] += w[t] * vt[jj];
    }
    std::copy(acc, acc + kWide, out + j0);
  }
  for (int64_t j = j0; j < hd; ++j) {
    float acc = 0.f;
    for (int64_t t = 0; t < n_k; ++t) acc += w[t] * v[t * hd + j];
    out[j] = acc;
  }
}

thread_local std::vector<float> t_scores;

// one row's query heads of one key/value head over its n_k cached keys: the scores by the float32 product kernel
// (the keys are a (n_k, hd) row-major matrix), softmax over the keys not padded, the values weighted
void attend_group(const Shape& s, const float* q, const float* k, const float* v, int64_t n_k, const bool* padded,
                  float* out) {
  const int64_t hd = s.hd, group = s.n_head / s.n_kv_head;
  if (static_cast<int64_t>(t_scores.size()) < group * n_k) t_scores.resize(group * n_k);
  float* sc = t_scores.data();
  kernel_set()->f32(k, hd, 0, n_k, q, hd, static_cast<int>(group), sc, n_k);
  for (int64_t a = 0; a < group; ++a) {
    float* p = sc + a * n_k;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n_k; ++t)
      if (!(padded && padded[t])) m = std::max(m, p[t] * s.scale);
    float sum = 0.f;
    for (int64_t t = 0; t < n_k; ++t) {
      p[t] = padded && padded[t] ? 0.f : std::exp(p[t] * s.scale - m);
      sum += p[t];
    }
    for (int64_t t = 0; t < n_k; ++t) p[t] /= sum;
    weigh_values(p, v, n_k, hd, out + a * hd);
  }
}

float act(float g, int64_t kind) {
  if (kind == 1) {  // GELU, tanh approximation
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + std::tanh(c * (g + 0.044715f * g * g * g)));
  }
  return g / (1.f + std::exp(-g));  // SiLU
}

void check_cache(const at::Tensor& c, const Shape& s, int64_t b_rows, int64_t slot, int64_t n_k) {
  TORCH_CHECK_VALUE(c.dim() == 4 && c.size(0) == b_rows && c.size(1) == s.n_kv_head && c.size(3) == s.hd &&
                        c.scalar_type() == at::kFloat && c.is_contiguous() && slot < c.size(2) && n_k <= c.size(2),
                    "decoderlab::decode_step: a layer's cache must be a contiguous float32 (", b_rows, ", ",
                    s.n_kv_head, ", > ", slot, ", ", s.hd, ") tensor; got ", c.sizes(), " ", c.scalar_type());
}

// one block over the residual stream x (B, d), in place
void block(const Shape& s, const Layer& l, at::Tensor& x, const int64_t* pos, int64_t column, const bool* mask,
           int64_t mask_cols, const at::Tensor& kc, const at::Tensor& vc) {
  const int64_t b_rows = x.size(0), d = x.size(1), hd = s.hd, group = s.n_head / s.n_kv_head;
  const int64_t slot = l.ring ? column % l.ring : column, n_k = l.ring ? std::min(column + 1, l.ring) : column + 1;
  // a window over a cache of every column: the keys W or more columns back are outside it
  const int64_t first = l.window ? std::max<int64_t>(0, column - l.window + 1) : 0;
  check_cache(kc, s, b_rows, slot, n_k);
  check_cache(vc, s, b_rows, slot, n_k);
  float* xs = x.data_ptr<float>();
  at::Tensor h = new_rows(b_rows, d);
  rms_norm_rows(xs, l.norm_1, s.eps, b_rows, d, h.data_ptr<float>());
  at::Tensor qkv = apply(h, {&l.qkv})[0];
  TORCH_CHECK_VALUE(qkv.size(1) == (s.n_head + 2 * s.n_kv_head) * hd, "decoderlab::decode_step: q/k/v of ",
                    qkv.size(1), " features");
  queries_keys_values(s, l, qkv.data_ptr<float>(), b_rows, pos, slot, kc, vc);
  at::Tensor z = new_rows(b_rows, s.n_head * hd);
  const int64_t cols = kc.size(2), width = qkv.size(1);
  const float *qp = qkv.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  float* zp = z.data_ptr<float>();
  at::parallel_for(0, b_rows * s.n_kv_head, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / s.n_kv_head, g = i % s.n_kv_head;
      attend_group(s, qp + b * width + g * group * hd, kp + ((b * s.n_kv_head + g) * cols + first) * hd,
                   vp + ((b * s.n_kv_head + g) * cols + first) * hd, n_k - first,
                   mask ? mask + b * mask_cols + first : nullptr, zp + (b * s.n_head + g * group) * hd);
    }
  });
  at::Tensor a = apply(z, {&l.o})[0];
  float* ap = a.data_ptr<float>();
  if (s.sandwich) rms_norm_rows(ap, l.norm_1_post, s.eps, b_rows, d, ap);
  for (int64_t j = 0; j < b_rows * d; ++j) xs[j] += ap[j];
  rms_norm_rows(xs, l.norm_2, s.eps, b_rows, d, h.data_ptr<float>());
  std::vector<at::Tensor> gu = apply(h, {&l.gate, &l.up});
  float *gp = gu[0].data_ptr<float>(), *up = gu[1].data_ptr<float>();
  for (int64_t j = 0; j < gu[0].numel(); ++j) gp[j] = act(gp[j], s.act) * up[j];
  at::Tensor m = apply(gu[0], {&l.down})[0];
  float* mp = m.data_ptr<float>();
  if (s.sandwich) rms_norm_rows(mp, l.norm_2_post, s.eps, b_rows, d, mp);
  for (int64_t j = 0; j < b_rows * d; ++j) xs[j] += mp[j];
}

// ints: n_layer, n_head, n_kv_head, head_dim, rope layout (0 none, 1 interleaved, 2 rotate_half), activation (0
// SiLU, 1 GELU tanh), qk_norm, sandwich; then each layer's ring (its buffer's columns) and window (over a cache of
// every column; 0 = none) and linears; floats:
// norm eps, QK-norm eps, attention scale
at::Tensor decode_step(const at::Tensor& x_in, const at::Tensor& positions, int64_t column,
                       const std::optional<at::Tensor>& padding_mask, at::TensorList tensors, at::IntArrayRef ints,
                       at::ArrayRef<double> floats, at::TensorList k_cache, at::TensorList v_cache) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
                    "decoderlab::decode_step: x must be a (B, d_model) float32 CPU tensor; got ", x_in.sizes(), " ",
                    x_in.scalar_type());
  TORCH_CHECK_VALUE(floats.size() == 3 && ints.size() >= 8, "decoderlab::decode_step: a program of ", ints.size(),
                    " integers and ", floats.size(), " floats has no header");
  Reader r{tensors, ints};
  const int64_t n_layer = r.integer();
  Shape s{};
  s.n_head = r.integer(), s.n_kv_head = r.integer(), s.hd = r.integer(), s.layout = r.integer(), s.act = r.integer();
  s.qk_norm = r.integer() != 0, s.sandwich = r.integer() != 0;
  s.eps = static_cast<float>(floats[0]), s.qk_eps = static_cast<float>(floats[1]), s.scale = static_cast<float>(floats[2]);
  const int64_t b_rows = x_in.size(0);
  TORCH_CHECK_VALUE(s.n_kv_head > 0 && s.n_head % s.n_kv_head == 0 && static_cast<int64_t>(k_cache.size()) == n_layer &&
                        static_cast<int64_t>(v_cache.size()) == n_layer && positions.numel() == b_rows &&
                        positions.scalar_type() == at::kLong && column >= 0,
                    "decoderlab::decode_step: ", n_layer, " layers with ", k_cache.size(), " key and ", v_cache.size(),
                    " value caches, ", positions.numel(), " positions for ", b_rows, " rows, column ", column);
  const at::Tensor pos = positions.contiguous();
  const bool* mask = nullptr;
  int64_t mask_cols = 0;
  at::Tensor mask_t;
  if (padding_mask.has_value()) {
    mask_t = padding_mask->contiguous();
    TORCH_CHECK_VALUE(mask_t.scalar_type() == at::kBool && mask_t.dim() == 2 && mask_t.size(0) == b_rows &&
                          mask_t.size(1) > column,
                      "decoderlab::decode_step: padding_mask must be (B, > column) bool; got ", mask_t.sizes());
    mask = mask_t.data_ptr<bool>(), mask_cols = mask_t.size(1);
  }
  at::Tensor x = x_in.contiguous().clone();
  for (int64_t i = 0; i < n_layer; ++i) {
    const Layer l = read_layer(r, s);
    TORCH_CHECK_VALUE(!(mask && l.ring), "decoderlab::decode_step: a padding mask over a ring cache");
    block(s, l, x, pos.data_ptr<int64_t>(), column, mask, mask_cols, k_cache[i], v_cache[i]);
  }
  const at::Tensor& norm_f = r.tensor();
  const Linear out = read_linear(r);
  TORCH_CHECK_VALUE(r.at_t == tensors.size() && r.at_i == ints.size(), "decoderlab::decode_step: ",
                    tensors.size() - r.at_t, " tensors and ", ints.size() - r.at_i, " integers left over");
  at::Tensor h = new_rows(b_rows, x.size(1));
  rms_norm_rows(x.data_ptr<float>(), norm_f, s.eps, b_rows, x.size(1), h.data_ptr<float>());
  return apply(h, {&out})[0];
}

}  // namespace
}  // namespace dlk

TORCH_LIBRARY_IMPL(decoderlab, CPU, m) { m.impl("decode_step", &dlk::decode_step); }
