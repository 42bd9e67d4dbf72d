// The bfloat16 weight product by AMX (Intel Sapphire Rapids and later): compiled with -mamx-tile -mamx-bf16, called
// only where cpuid lists AMX-TILE and AMX-BF16 beside AVX512-BF16 and Linux granted the process the tile registers
// (ops.cpp's "amx-bf16" set). One tdpbf16ps multiplies a tile of 16 weight rows x 32 bfloat16 weights by 32
// activations of up to 16 rows: 8,192 multiply-adds an instruction, against vdpbf16ps's 32 -- a prompt's or a
// batch's products stop being bound by the multiplies. The activations arrive rounded to bfloat16 (ops.cpp), as
// ggml's. Each output is its own sequence: float32 sums of the exact products of bfloat16 pairs, the weights in
// order along the row (denormals flushed, as the instruction does), whatever the rows beside it -- so a row's
// result is the same alone or in any batch, and a decode step (1 row) takes this product too.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

// palette 1: tiles 0-1 the sums C[n][m] (16 weight rows x up to 16 activation rows of float32), 4 the weights A (16
// rows x 32 bfloat16), 6-7 the activations B (16 pairs of weights x the activation rows x 2 bfloat16, VNNI's pair
// layout). The activation tiles are as wide as the rows there are: a decode step's one row multiplies one column,
// with no zeros to write or read beside it
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int rows0, int rows1) {
  TileConfig c;
  const int cols[2] = {rows0, rows1};
  for (int t = 0; t < 2; ++t)
    if (cols[t]) {
      c.rows[t] = c.rows[6 + t] = 16;
      c.colsb[t] = c.colsb[6 + t] = static_cast<uint16_t>(4 * cols[t]);
    }
  c.rows[4] = 16, c.colsb[4] = 64;
  _tile_loadconfig(&c);
}

constexpr int64_t kChunk = 32;  // weights a tile row holds

thread_local std::vector<dlk::bf16_t> t_b, t_w;

// `rows` activation rows as B tiles, one a chunk of 32 weights: tile row r holds, for each activation row m, the
// pair x[m][32c + 2r], x[m][32c + 2r + 1]; zeros past the width
void pack_b(const dlk::bf16_t* x, int64_t ldx, int64_t in, int rows, int64_t chunks, dlk::bf16_t* b) {
  const int64_t tile = 16 * rows * 2;
  if (in % kChunk) std::memset(b + (chunks - 1) * tile, 0, sizeof(dlk::bf16_t) * tile);
  for (int m = 0; m < rows; ++m)
    for (int64_t k = 0; k < in; ++k) b[(k / kChunk) * tile + (k % kChunk) / 2 * (2 * rows) + 2 * m + k % 2] = x[m * ldx + k];
}

// weight rows [n0, n0 + n) as 16 rows of `width` (a multiple of 32) bfloat16, zeros past them: the A tiles of a
// block of fewer than 16 rows, or of a width no multiple of 32 (a tile load reads whole 64-byte rows)
const dlk::bf16_t* padded_rows(const dlk::bf16_t* w, int64_t in, int64_t n0, int64_t n, int64_t width) {
  dlk::bf16_t* a = dlk::grow(t_w, 16 * width);
  std::memset(a, 0, sizeof(dlk::bf16_t) * 16 * width);
  for (int64_t r = 0; r < n; ++r) std::memcpy(a + r * width, w + (n0 + r) * in, sizeof(dlk::bf16_t) * in);
  return a;
}

// the sums of a block: C[n][m] to y[m * ldy + n0 + n] for its n weight rows and `rows` activation rows
void store(int rows, int64_t n, int64_t n0, float* y, int64_t ldy, int which) {
  alignas(64) float c[16 * 16];
  if (which == 0)
    _tile_stored(0, c, 4 * rows);
  else
    _tile_stored(1, c, 4 * rows);
  for (int64_t r = 0; r < n; ++r)
    for (int m = 0; m < rows; ++m) y[m * ldy + n0 + r] = c[r * rows + m];
}

// one pass: activation rows as one or two B tiles (rows0, rows1 of them), over weight rows [r0, r1) 16 at a time
void pass(const dlk::bf16_t* w, int64_t in, int64_t r0, int64_t r1, const dlk::bf16_t* b0, const dlk::bf16_t* b1,
          int rows0, int rows1, float* y, int64_t ldy) {
  const int64_t chunks = (in + kChunk - 1) / kChunk, width = chunks * kChunk;
  for (int64_t n0 = r0; n0 < r1; n0 += 16) {
    const int64_t n = std::min<int64_t>(16, r1 - n0);
    const bool direct = n == 16 && in == width;
    const dlk::bf16_t* a = direct ? w + n0 * in : padded_rows(w, in, n0, n, width);
    const int64_t lda = sizeof(dlk::bf16_t) * (direct ? in : width);
    // the next block's 16 rows, one contiguous stretch, fetched into L2 a sixteenth a chunk: a tile load reads 64
    // bytes of each of 16 rows, streams too short for the hardware prefetcher to find
    const char* next = direct && n0 + 32 <= r1 ? reinterpret_cast<const char*>(w + (n0 + 16) * in) : nullptr;
    _tile_zero(0);
    if (rows1) _tile_zero(1);
    for (int64_t c = 0; c < chunks; ++c) {
      if (next)
        for (int line = 0; line < 16; ++line) _mm_prefetch(next + (c * 16 + line) * 64, _MM_HINT_T1);
      _tile_loadd(4, a + c * kChunk, lda);
      _tile_loadd(6, b0 + c * 32 * rows0, 4 * rows0);
      _tile_dpbf16ps(0, 4, 6);
      if (rows1) {
        _tile_loadd(7, b1 + c * 32 * rows1, 4 * rows1);
        _tile_dpbf16ps(1, 4, 7);
      }
    }
    store(rows0, n, n0, y, ldy, 0);
    if (rows1) store(rows1, n, n0, y + 16 * ldy, ldy, 1);
  }
}

// y[a * ldy + r] for weight rows r in [r0, r1), activation rows a < n_act (bfloat16, ldx apart): 32 activation
// rows a pass (two B tiles), 16 weight rows a block
void product(const void* weight, int64_t in, int64_t r0, int64_t r1, const void* xv, int64_t ldx, int n_act,
             float* y, int64_t ldy) {
  const auto* w = static_cast<const dlk::bf16_t*>(weight);
  const auto* x = static_cast<const dlk::bf16_t*>(xv);
  const int64_t chunks = (in + kChunk - 1) / kChunk;
  dlk::bf16_t* b = dlk::grow(t_b, 2 * chunks * 16 * 32);
  int configured[2] = {-1, -1};
  for (int m0 = 0; m0 < n_act; m0 += 32) {
    const int rows0 = std::min(16, n_act - m0), rows1 = std::max(0, std::min(16, n_act - m0 - 16));
    if (rows0 != configured[0] || rows1 != configured[1]) configure(rows0, rows1);
    configured[0] = rows0, configured[1] = rows1;
    dlk::bf16_t* b1 = b + chunks * 16 * 32;
    pack_b(x + m0 * ldx, ldx, in, rows0, chunks, b);
    if (rows1) pack_b(x + (m0 + 16) * ldx, ldx, in, rows1, chunks, b1);
    pass(w, in, r0, r1, b, b1, rows0, rows1, y + m0 * ldy, ldy);
  }
  _tile_release();
}

}  // namespace

dlk::DenseKernel dlk::dense_bf16_amx() { return product; }
