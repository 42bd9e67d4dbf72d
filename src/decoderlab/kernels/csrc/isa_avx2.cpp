// AVX2 + FMA + F16C (Intel Haswell and later, AMD Zen and later) without VNNI: compiled with -mavx2 -mfma -mf16c,
// called only where cpuid says the CPU has them (ops.cpp). Bytes multiply by maddubs, then pairs add by madd.
#include <immintrin.h>

#include <type_traits>

#include "common.h"

#define DLK_YMM_VNNI 0

namespace {
#include "ymm_backend.h"
}  // namespace

const dlk::KernelSet* dlk::kernels_avx2() { return &kSet; }
