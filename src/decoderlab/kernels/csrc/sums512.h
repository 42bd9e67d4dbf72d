// The lane sums of N float32 accumulators of 16 lanes at once (AVX-512), for the dense products' tiles: each sum is
// the halving tree of its own vector's lanes -- lane i + lane i + 8, then + 4, + 2, + 1 -- the tree a single
// vector's _mm512_reduce_add_ps adds too, whatever N: so a tile's sums do not depend on the tile's shape. The
// vectors travel through the tree together (two at a level into one register), 4 levels of shuffles and adds for
// up to 16 vectors instead of 8 operations a vector. Included inside an instruction set file's anonymous namespace.

template <int N>
inline void sums16(const __m512* v, float* out) {
  static_assert(N >= 1 && N <= 16, "up to 16 vectors");
  const __m512 zero = _mm512_setzero_ps();
  constexpr int N1 = (N + 1) / 2, N2 = (N1 + 1) / 2, N3 = (N2 + 1) / 2;
  __m512 l1[N1], l2[N2], l3[N3];
  for (int k = 0; k < N1; ++k) {  // lanes 0-7: vector 2k's i + i+8; lanes 8-15: vector 2k+1's
    const __m512 a = v[2 * k], b = 2 * k + 1 < N ? v[2 * k + 1] : zero;
    l1[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int k = 0; k < N2; ++k) {  // quarter q: vector 4k+q's i + i+4
    const __m512 a = l1[2 * k], b = 2 * k + 1 < N1 ? l1[2 * k + 1] : zero;
    l2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int k = 0; k < N3; ++k) {  // quarter q, lanes 0-1: vector 8k+q's i + i+2; lanes 2-3: vector 8k+4+q's
    const __m512 a = l2[2 * k], b = 2 * k + 1 < N2 ? l2[2 * k + 1] : zero;
    l3[k] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 a = l3[0], b = N3 > 1 ? l3[1] : zero;  // lane 4q + j: vector 4j + q's sum
  alignas(64) float s[16];
  _mm512_store_ps(s, _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))));
  for (int n = 0; n < N; ++n) out[n] = s[4 * (n % 4) + n / 4];
}
