/* bf16 <-> fp32 as c10::BFloat16 converts, shared by the compiled kernels (included by path; the build's
 * cache key covers the headers a source includes, kernels/native/build.py).
 *
 * fp32 -> bf16 rounds to nearest even; a NaN becomes the canonical quiet NaN 0x7FC0 (torch keeps the NaN's
 * payload, which no kernel here promises to reproduce). The AVX2 helpers need AVX2 (defined only then).
 */
#ifndef KVRESUME_NATIVE_BF16_H
#define KVRESUME_NATIVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __AVX2__
#include <immintrin.h>

/* 8 fp32 -> their bf16 (as above), as fp32 bit patterns (bf16 << 16). */
static inline __m256i round_bf16_bits(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    const __m256i bits = _mm256_slli_epi32(_mm256_srli_epi32(rounded, 16), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
}
#endif

#endif
