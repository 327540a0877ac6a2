/* 8 bf16 keys transposed into fp32 AVX2 vectors, shared by the compiled kernels that vectorize dot
 * products across keys (kernels/index_score, kernels/sparse_attn; included by path, so the build's cache
 * key covers it, kernels/native/build.py).
 *
 * kt[l] = (key[0][l], ..., key[7][l]) as fp32 for l < d (d a multiple of 8): each key's 8-dimension pieces
 * converted (bf16 -> fp32 is the bits shifted up, exact) and 8 x 8 blocks transposed with shuffles. Moves
 * bits only: the same vectors as an element-by-element fill.
 */
#ifndef KVRESUME_NATIVE_TRANSPOSE_H
#define KVRESUME_NATIVE_TRANSPOSE_H

#include <immintrin.h>
#include <stdint.h>

static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

static inline void transpose_8_keys(const uint16_t *const *key, int d, __m256 *kt) {
    for (int c = 0; c < d; c += 8) {
        __m256 r[8];
        for (int n = 0; n < 8; n++) r[n] = bf16x8_to_f32(key[n] + c);
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
        kt[c + 0] = _mm256_permute2f128_ps(s0, s4, 0x20);
        kt[c + 1] = _mm256_permute2f128_ps(s1, s5, 0x20);
        kt[c + 2] = _mm256_permute2f128_ps(s2, s6, 0x20);
        kt[c + 3] = _mm256_permute2f128_ps(s3, s7, 0x20);
        kt[c + 4] = _mm256_permute2f128_ps(s0, s4, 0x31);
        kt[c + 5] = _mm256_permute2f128_ps(s1, s5, 0x31);
        kt[c + 6] = _mm256_permute2f128_ps(s2, s6, 0x31);
        kt[c + 7] = _mm256_permute2f128_ps(s3, s7, 0x31);
    }
}

#endif
