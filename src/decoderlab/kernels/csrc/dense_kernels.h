// The 16- and 32-bit weight products, written once over the float vector interface each instruction set's file
// defines before including this one (inside its anonymous namespace):
//
//   VW (kLanes floats)  vw_zero()  vw_fmadd(a, b, c) = a b + c  vw_add(a, b)
//   vw_sums<N>(v, out)  the lane sums of N vectors, each by the same tree of additions whatever N
//   vw_w(const float*) vw_w(const dlk::f16_t*) vw_w(const dlk::bf16_t*): kLanes weights (or activations) widened
//   exactly to float32
//   kDenseTile: activation rows a pass keeps in registers (four accumulators each)
//   kDensePrefetch: how far ahead (bytes) a pass asks for the weight row's lines, 0 for none -- measured per
//   family: 1 KB helped an AVX2-only EPYC; on an AVX-512 EPYC (2026-12-07) no software prefetch read SmolLM2's
//   step 1.1-1.3x faster on every path (the hardware prefetcher follows one stream; the hints only cost)
//
// A weight row is read once for all the activation rows of a tile, from start to end: one stream, which the
// hardware prefetcher follows at the read rate (four rows side by side, four streams, read a 113 MB float32 matrix
// at ~0.7 of that rate on an AVX2 EPYC; on an AVX-512 EPYC two or four float16 rows side by side, each with its
// four accumulators, took 2x one row's time for SmolLM2's step, in 4 KiB pages and in huge pages alike). Its products go into four accumulators per activation row (the row's
// chunks of kLanes taken in turn: chunk c into accumulator c % 4, so that four FMA chains overlap), added as
// (a0 + a1) + (a2 + a3) and then across the lanes. bfloat16 is a float32's top 16 bits (a shift), float16 is
// widened by F16C / AVX-512F: the products are float32 FMAs of exact float32 factors -- a bfloat16 weight's
// activations rounded to bfloat16 first (ops.cpp, as ggml does), the others' float32 as they are. Each output's sum
// is the same sequence of FMAs and the same additions whatever the tile: a row's result does not depend on the
// rows beside it or on the threads.

// kLanes values from `n` (< kLanes) at p, the rest zero (a row's tail)
template <typename T>
inline VW vw_tail(const T* p, int64_t n) {
  T buf[kLanes] = {};
  __builtin_memcpy(buf, p, n * sizeof(T));
  return vw_w(static_cast<const T*>(buf));
}

template <typename T, typename X, int NB>
void dense_tile(const T* w, int64_t in, const X* x, int64_t ldx, float* y, int64_t ldy) {
  VW acc[NB][4];
  for (int a = 0; a < NB; ++a)
    for (int j = 0; j < 4; ++j) acc[a][j] = vw_zero();
  int64_t k = 0;
  for (; k + 4 * kLanes <= in; k += 4 * kLanes) {
    // every cache line of the bytes this pass reads, kDensePrefetch bytes ahead (float32's 4 x 8 lanes span two
    // lines); none where the backend says 0
    if constexpr (kDensePrefetch > 0) {
      for (int64_t b = 0; b < 4 * kLanes * static_cast<int64_t>(sizeof(T)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + k) + kDensePrefetch + b, _MM_HINT_T0);
    }
    for (int j = 0; j < 4; ++j) {
      const VW wv = vw_w(w + k + j * kLanes);
      for (int a = 0; a < NB; ++a) acc[a][j] = vw_fmadd(wv, vw_w(x + a * ldx + k + j * kLanes), acc[a][j]);
    }
  }
  int j = 0;
  for (; k + kLanes <= in; k += kLanes, ++j) {
    const VW wv = vw_w(w + k);
    for (int a = 0; a < NB; ++a) acc[a][j] = vw_fmadd(wv, vw_w(x + a * ldx + k), acc[a][j]);
  }
  if (k < in) {
    const VW wv = vw_tail(w + k, in - k);
    for (int a = 0; a < NB; ++a) acc[a][j] = vw_fmadd(wv, vw_tail(x + a * ldx + k, in - k), acc[a][j]);
  }
  VW total[NB];
  for (int a = 0; a < NB; ++a) total[a] = vw_add(vw_add(acc[a][0], acc[a][1]), vw_add(acc[a][2], acc[a][3]));
  float sums[NB];
  vw_sums<NB>(total, sums);
  for (int a = 0; a < NB; ++a) y[a * ldy] = sums[a];
}

template <typename T, typename X>
void dense_rows(const T* w, int64_t in, const X* x, int64_t ldx, int n_act, float* y, int64_t ldy) {
  for (int a0 = 0; a0 < n_act; a0 += kDenseTile) {
    const int n = n_act - a0 < kDenseTile ? n_act - a0 : kDenseTile;
    const X* xa = x + a0 * ldx;
    float* ya = y + a0 * ldy;
    if (n == 1) dense_tile<T, X, 1>(w, in, xa, ldx, ya, ldy);
    if (n == 2) dense_tile<T, X, 2>(w, in, xa, ldx, ya, ldy);
    if constexpr (kDenseTile >= 3) {
      if (n == 3) dense_tile<T, X, 3>(w, in, xa, ldx, ya, ldy);
    }
    if constexpr (kDenseTile >= 4) {
      if (n == 4) dense_tile<T, X, 4>(w, in, xa, ldx, ya, ldy);
    }
  }
}

// Weight rows [r0, r1), one at a time, each for every activation row (tiles of kDenseTile); a prompt's rows go in
// blocks of kDenseRowBlock, so that a block stays in L2 while the weight rows pass over it. From two activation
// rows on the products bound a pass more than the reads, and the row kDenseAhead rows ahead is asked into L2 while
// this one is multiplied, so that memory and arithmetic overlap (AVX-512 EPYC, 2026-12-07: SmolLM2's 211 products
// for 8 rows, float16 54-59 -> 43-50 ms, float32 72-88 -> 49-57; 4 to 32 rows ahead alike). A
// decode step's one row is left to the hardware prefetcher, which reads one stream at the memory's rate. Not kept
// (same CPU, 8 rows, f32): two weight rows a pass sharing each activation load (48-51 -> 59-74 ms: two streams);
// one accumulator chain of 3 weight x 8 activation rows at a time, four passes (51-57 -> 80-94 ms).
constexpr int kDenseRowBlock = 64;
constexpr int64_t kDenseAhead = 8;

template <typename T>
void dense_product(const void* weight, int64_t in, int64_t r0, int64_t r1, const void* xv, int64_t ldx, int n_act,
                   float* y, int64_t ldy) {
  using X = float;  // (a bfloat16 weight's activations come rounded to bfloat16, as float32 values: ops.cpp)
  const T* w = static_cast<const T*>(weight);
  for (int a0 = 0; a0 < n_act; a0 += kDenseRowBlock) {
    const int n = n_act - a0 < kDenseRowBlock ? n_act - a0 : kDenseRowBlock;
    const X* x = static_cast<const X*>(xv) + a0 * ldx;
    float* ya = y + a0 * ldy;
    for (int64_t r = r0; r < r1; ++r) {
      if (n > 1 && r + kDenseAhead < r1) dlk::ask_l2(w + (r + kDenseAhead) * in, in * sizeof(T));
      dense_rows<T, X>(w + r * in, in, x, ldx, n, ya + r, ldy);
    }
  }
}
