// The 16- and 32-bit weight products, written once over the float vector interface each instruction set's file
// defines before including this one (inside its anonymous namespace):
//
//   VW (kLanes floats)  vw_zero()  vw_fmadd(a, b, c) = a b + c
//   vw_sums<N>(v, out)  the lane sums of N vectors, each by the same tree of additions whatever N
//   vw_w(const float*) vw_w(const dlk::f16_t*) vw_w(const dlk::bf16_t*): kLanes weights (or activations) widened
//   exactly to float32
//   kDenseTile: activation rows a pass keeps in registers
//
// A weight row is read once for all the activation rows of a tile: 4 weight rows x kDenseTile activation rows
// of float32 accumulators, the lanes summed at the end of the row. bfloat16 is a float32's top 16 bits (a shift),
// float16 is widened by F16C / AVX-512F: the products are float32 FMAs of exact float32 factors -- a bfloat16
// weight's activations rounded to bfloat16 first (ops.cpp, as ggml does), the others' float32 as they are. Each
// output's sum is the same sequence of FMAs and the same lane sum whatever the tile: a row's result does not
// depend on the rows beside it or on the threads.

// kLanes values from `n` (< kLanes) at p, the rest zero (a row's tail)
template <typename T>
inline VW vw_tail(const T* p, int64_t n) {
  T buf[kLanes] = {};
  __builtin_memcpy(buf, p, n * sizeof(T));
  return vw_w(static_cast<const T*>(buf));
}

template <typename T, typename X, int RW, int NB>
void dense_tile(const T* w, int64_t in, const X* x, int64_t ldx, float* y, int64_t ldy) {
  VW acc[RW][NB];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < NB; ++a) acc[r][a] = vw_zero();
  int64_t k = 0;
  for (; k + kLanes <= in; k += kLanes) {
    VW wv[RW];
    for (int r = 0; r < RW; ++r) {
      // each weight row is a stream of its own: ask for its bytes 512 ahead, as the one stream of a plain read
      _mm_prefetch(reinterpret_cast<const char*>(w + r * in + k) + 512, _MM_HINT_T0);
      wv[r] = vw_w(w + r * in + k);
    }
    for (int a = 0; a < NB; ++a) {
      const VW xv = vw_w(x + a * ldx + k);
      for (int r = 0; r < RW; ++r) acc[r][a] = vw_fmadd(wv[r], xv, acc[r][a]);
    }
  }
  if (k < in) {
    VW wv[RW];
    for (int r = 0; r < RW; ++r) wv[r] = vw_tail(w + r * in + k, in - k);
    for (int a = 0; a < NB; ++a) {
      const VW xv = vw_tail(x + a * ldx + k, in - k);
      for (int r = 0; r < RW; ++r) acc[r][a] = vw_fmadd(wv[r], xv, acc[r][a]);
    }
  }
  float sums[RW * NB];
  vw_sums<RW * NB>(&acc[0][0], sums);
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < NB; ++a) y[a * ldy + r] = sums[r * NB + a];
}

template <typename T, typename X, int RW>
void dense_rows(const T* w, int64_t in, const X* x, int64_t ldx, int n_act, float* y, int64_t ldy) {
  for (int a0 = 0; a0 < n_act; a0 += kDenseTile) {
    const int n = n_act - a0 < kDenseTile ? n_act - a0 : kDenseTile;
    const X* xa = x + a0 * ldx;
    float* ya = y + a0 * ldy;
    if (n == 1) dense_tile<T, X, RW, 1>(w, in, xa, ldx, ya, ldy);
    if (n == 2) dense_tile<T, X, RW, 2>(w, in, xa, ldx, ya, ldy);
    if constexpr (kDenseTile >= 3) {
      if (n == 3) dense_tile<T, X, RW, 3>(w, in, xa, ldx, ya, ldy);
    }
    if constexpr (kDenseTile >= 4) {
      if (n == 4) dense_tile<T, X, RW, 4>(w, in, xa, ldx, ya, ldy);
    }
  }
}

// weight rows [r0, r1): four at a time, then one at a time; a bfloat16 weight's activations come as bfloat16. A
// prompt's rows go in blocks of kDenseRowBlock, so that a block stays in L2 while the weight rows pass over it
constexpr int kDenseRowBlock = 64;

template <typename T>
void dense_product(const void* weight, int64_t in, int64_t r0, int64_t r1, const void* xv, int64_t ldx, int n_act,
                   float* y, int64_t ldy) {
  using X = std::conditional_t<std::is_same_v<T, dlk::bf16_t>, dlk::bf16_t, float>;
  const T* w = static_cast<const T*>(weight);
  for (int a0 = 0; a0 < n_act; a0 += kDenseRowBlock) {
    const int n = n_act - a0 < kDenseRowBlock ? n_act - a0 : kDenseRowBlock;
    const X* x = static_cast<const X*>(xv) + a0 * ldx;
    float* ya = y + a0 * ldy;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) dense_rows<T, X, 4>(w + r * in, in, x, ldx, n, ya + r, ldy);
    for (; r < r1; ++r) dense_rows<T, X, 1>(w + r * in, in, x, ldx, n, ya + r, ldy);
  }
}
