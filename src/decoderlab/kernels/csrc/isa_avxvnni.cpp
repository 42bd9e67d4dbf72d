// AVX2 + FMA + F16C with AVX-VNNI (Intel Alder Lake and later, AMD Zen 5): the VEX-encoded vpdpbusd on 256-bit
// registers, for CPUs that have it without AVX-512. Compiled with -mavx2 -mfma -mf16c -mavxvnni, called only
// where cpuid says the CPU has them (ops.cpp).
#include <immintrin.h>

#include <type_traits>

#include "common.h"

#define DLK_YMM_VNNI 1

namespace {
#include "ymm_backend.h"
}  // namespace

const dlk::KernelSet* dlk::kernels_avxvnni() { return &kSet; }
