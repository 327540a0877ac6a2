/* Compiled CPU lightning-indexer scores: bit for bit what kernels/index_score/reference.py computes with
 * torch 2.13 under the portable numerics profile (ATen's AVX2 kernels, oneDNN off), NaN payloads aside
 * (a NaN is the canonical bf16 quiet NaN here).
 *
 * score[r, n] = bf16( sum_h bf16( relu(bf16(q[r, h] . k[n])) * w[r, h] ) ), -inf where n >= visible[r].
 *
 * Why the sums are written out as they are: the reference's bf16 einsum reaches ATen's reduced-precision
 * dot product (fp32 arithmetic), whose order decides the last bit of every score. Measured against torch
 * on 21M random products at D = 32 and millions more at D = 16..128 (tests/kernels/test_index_score_cpu.py
 * re-checks it on fresh inputs): the products go into eight fp32 vector registers of eight lanes, element
 * l of each 64-wide chunk into register (l / 8) % 8, lane l % 8, each register a fused multiply-add
 * chain; the registers are summed pairwise (r + r + 4, then + 2, then + 1); the remaining 8-wide pieces of
 * a D that is not a multiple of 64 are multiply-added into that sum one after another; the eight lanes are
 * then summed pairwise the same way. The head sum of the reference (`sum(dim=2)` over bf16) accumulates
 * in fp32 from +0 in head order, and relu keeps -0 (x < 0 ? +0 : x).
 *
 * Layout for speed: keys are converted to fp32 once per block of 8 keys, transposed so that one AVX2
 * vector holds one dimension of 8 different keys; every (row, head) then runs the same ordered sums on 8
 * keys at once. Each key's sums are still exactly the order above: vectorizing across keys never
 * reassociates within one key. A whole block of 8 keys is converted and transposed with shuffles
 * (`transpose_keys`: bits moved, nothing computed), at D = 32 (the models' index head dim) the sums are
 * written out with D known (`dot_block_32`), and a block a row sees whole is stored as 8 packed bf16: at
 * 24 rows x 2 heads over 450 keys, 96 -> 42 us a call (AMD EPYC, session 41), the same bits. Where a key
 * of 64 or more dimensions serves only a few (row, head) products (a decode row: one row, two heads), the
 * transposition costs more than they do, and each key's sums run on it directly, vectorized across the
 * dimension with each lane holding what that lane holds above (`dot_direct`); at D = 16 and 32 a decode
 * row is faster blocked.
 * Built without fast-math and with -ffp-contract=off (kernels/native), so
 * the only fused operations are the explicit _mm256_fmadd_ps, where ATen fuses too (measured: products
 * whose fp32 rounding is visible, subnormal ones, match only fused). Needs AVX2 and FMA, which the
 * portable profile needs anyway; on other CPUs the build fails and callers keep the reference.
 *
 * q: [R, H, D] bf16 bits; k: [N, D] bf16 bits; w: [R, H] bf16 bits; visible: [R] int64 or NULL;
 * out: [R, N] bf16 bits. D must be a multiple of 8 (the caller checks).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../native/bf16.h"
#include "../native/transpose.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "cpu_index_score.c needs AVX2 and FMA (the portable profile's instruction set)"
#endif

#define KEYS 8   /* keys per block: one fp32 AVX2 vector per dimension */
#define LANES 8  /* ATen's fp32 vector width at the AVX2 level */
#define REGS 8   /* ATen's accumulator registers per 64-wide chunk */
/* (row, head) products a key up to which each key's products run on it directly (`scores_direct`) rather
 * than on a transposed block of 8 keys, for head dims above DIRECT_MIN_D: measured on the Zen 4 VM (session
 * 32), a decode row's 2 heads. Since the blocks are transposed with shuffles (session 41, AMD EPYC), a
 * decode row at D = 32 is faster blocked (2 heads over 450 keys 5.1-5.3 against 7.8-8.3 us; D = 16 4.6-4.8
 * against 8.4-8.6), while at D = 64 and 128 the direct loop stays faster (9.1-9.4 against 12.5-14.6 us). */
#define DIRECT_MAX_PRODUCTS 4
#define DIRECT_MIN_D 64

static inline __m256 round_bf16(__m256 x) { return _mm256_castsi256_ps(round_bf16_bits(x)); }

/* The dot products of one query row qv[D] (fp32) with the 8 keys of a transposed block kt[D] (one vector
 * per dimension), in ATen's order (file comment). */
static inline __m256 dot_block(const float *qv, const __m256 *kt, int d) {
    const int chunks = d / (REGS * LANES);
    __m256 lane[LANES];
    for (int j = 0; j < LANES; j++) {
        __m256 s = _mm256_setzero_ps();
        if (chunks > 0) {
            __m256 reg[REGS];
            for (int r = 0; r < REGS; r++) {
                __m256 v = _mm256_setzero_ps();
                for (int c = 0; c < chunks; c++) {
                    const int l = c * REGS * LANES + r * LANES + j;
                    v = _mm256_fmadd_ps(_mm256_set1_ps(qv[l]), kt[l], v);
                }
                reg[r] = v;
            }
            for (int half = REGS / 2; half >= 1; half /= 2)
                for (int r = 0; r < half; r++) reg[r] = _mm256_add_ps(reg[r], reg[r + half]);
            s = reg[0];
        }
        for (int l = chunks * REGS * LANES + j; l < d; l += LANES)
            s = _mm256_fmadd_ps(_mm256_set1_ps(qv[l]), kt[l], s);
        lane[j] = s;
    }
    for (int half = LANES / 2; half >= 1; half /= 2)
        for (int j = 0; j < half; j++) lane[j] = _mm256_add_ps(lane[j], lane[j + half]);
    return lane[0];
}

/* The same dot product for one query row qv[D] and one key kv[D] (both fp32), vectorized across the
 * dimension instead of across keys: lane j of each vector holds what lane j of `dot_block` holds for that
 * key (element l of a 64-wide chunk in register (l / 8) % 8, lane l % 8, the same fused multiply-add chain
 * per register, the same pairwise register sum, the same leftover pieces after it), and the lanes are
 * summed in the same pairs (j + 4, then + 2, then + 1). Bit for bit `dot_block`'s lane for this key. */
static inline float dot_direct(const float *qv, const float *kv, int d) {
    const int chunks = d / (REGS * LANES);
    __m256 s = _mm256_setzero_ps();
    if (chunks > 0) {
        /* each register's chain runs over the chunks in order; the registers are independent, so
         * stepping them together (chunk by chunk) changes no sum */
        __m256 reg[REGS];
        for (int r = 0; r < REGS; r++) reg[r] = _mm256_setzero_ps();
        for (int c = 0; c < chunks; c++)
            for (int r = 0; r < REGS; r++) {
                const float *at_q = qv + (c * REGS + r) * LANES, *at_k = kv + (c * REGS + r) * LANES;
                reg[r] = _mm256_fmadd_ps(_mm256_loadu_ps(at_q), _mm256_loadu_ps(at_k), reg[r]);
            }
        for (int half = REGS / 2; half >= 1; half /= 2)
            for (int r = 0; r < half; r++) reg[r] = _mm256_add_ps(reg[r], reg[r + half]);
        s = reg[0];
    }
    for (int l = chunks * REGS * LANES; l < d; l += LANES)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(qv + l), _mm256_loadu_ps(kv + l), s);
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)); /* j + (j + 4) */
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));                         /* + (j + 2) */
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));                    /* + (j + 1) */
}

/* dot_block for d == 32 (no 64-wide chunk): lane j is the fused chain over elements j, j + 8, j + 16,
 * j + 24 from zero, then the lanes summed pairwise (j + 4, then + 2, then + 1): `dot_block`'s order,
 * written out with d known. */
static inline __m256 dot_block_32(const float *qv, const __m256 *kt) {
    __m256 s[LANES];
    for (int j = 0; j < LANES; j++) {
        __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(qv[j]), kt[j], _mm256_setzero_ps());
        v = _mm256_fmadd_ps(_mm256_set1_ps(qv[j + 8]), kt[j + 8], v);
        v = _mm256_fmadd_ps(_mm256_set1_ps(qv[j + 16]), kt[j + 16], v);
        s[j] = _mm256_fmadd_ps(_mm256_set1_ps(qv[j + 24]), kt[j + 24], v);
    }
    const __m256 a0 = _mm256_add_ps(s[0], s[4]), a1 = _mm256_add_ps(s[1], s[5]);
    const __m256 a2 = _mm256_add_ps(s[2], s[6]), a3 = _mm256_add_ps(s[3], s[7]);
    return _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
}

/* kt[l] = (k[0][l], ..., k[7][l]) as fp32 for l < d, from 8 whole keys of d bf16 each laid end to end (d a
 * multiple of 8): kernels/native/transpose.h. */
static inline void transpose_keys(const uint16_t *k, int d, __m256 *kt) {
    const uint16_t *key[KEYS];
    for (int n = 0; n < KEYS; n++) key[n] = k + (int64_t)n * d;
    transpose_8_keys(key, d, kt);
}

static inline float round_bf16_f32(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* Few (row, head) products a key (a decode step's one row): each key is converted once and its products
 * run on it directly (`dot_direct`), where transposing a block of 8 keys would cost more than the products
 * it serves. The same scores as the blocked loop below, element for element. */
static void scores_direct(const float *qf, const float *wf, const uint16_t *k, int64_t rows, int heads,
                          int d, int64_t computed, int64_t n_keys, const int64_t *visible, float *kf,
                          uint16_t *out) {
    for (int64_t n = 0; n < computed; n++) {
        for (int l = 0; l < d; l += LANES) { /* bf16 -> fp32 is exact: the bits shifted up */
            const __m128i b = _mm_loadu_si128((const __m128i *)(k + n * d + l));
            _mm256_storeu_ps(kf + l, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
        }
        for (int64_t r = 0; r < rows; r++) {
            if (visible && n >= visible[r]) {
                out[r * n_keys + n] = 0xFF80;
                continue;
            }
            float total = 0.0f; /* the head sum starts at +0, as torch's fp32 sum does */
            for (int h = 0; h < heads; h++) {
                float s = round_bf16_f32(dot_direct(qf + (r * heads + h) * d, kf, d));
                s = s < 0.0f ? 0.0f : s; /* relu keeps -0 and NaN, as torch's does */
                total = total + round_bf16_f32(s * wf[r * heads + h]);
            }
            out[r * n_keys + n] = f32_to_bf16(total);
        }
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated (the caller falls back to the reference). */
int index_score_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *w, int64_t rows, int heads, int d,
                     int64_t n_keys, const int64_t *visible, uint16_t *out) {
    float *qf = malloc(sizeof(float) * (size_t)(rows * heads * d));
    float *wf = malloc(sizeof(float) * (size_t)(rows * heads));
    __m256 *kt = aligned_alloc(32, sizeof(__m256) * (size_t)d);
    if (!qf || !wf || !kt) {
        free(qf);
        free(wf);
        free(kt);
        return -1;
    }
    for (int64_t i = 0; i < rows * heads * d; i++) qf[i] = bf16_to_f32(q[i]);
    for (int64_t i = 0; i < rows * heads; i++) wf[i] = bf16_to_f32(w[i]);
    const __m256 zero = _mm256_setzero_ps();
    /* Keys at or past every row's visible count score -inf whatever their products: they are filled, not
     * computed (a batched decode pads every sequence's keys to the longest history's). */
    int64_t computed = n_keys;
    if (visible) {
        int64_t most = 0;
        for (int64_t r = 0; r < rows; r++) most = visible[r] > most ? visible[r] : most;
        computed = most < n_keys ? most : n_keys;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = computed; n < n_keys; n++) out[r * n_keys + n] = 0xFF80;
    if (rows * heads <= DIRECT_MAX_PRODUCTS && d >= DIRECT_MIN_D) {
        scores_direct(qf, wf, k, rows, heads, d, computed, n_keys, visible, (float *)kt, out);
        free(qf);
        free(wf);
        free(kt);
        return 0;
    }
    for (int64_t n0 = 0; n0 < computed; n0 += KEYS) {
        const int nb = computed - n0 < KEYS ? (int)(computed - n0) : KEYS;
        /* transpose the block to fp32 [D] x 8 keys; a short last block pads with zero keys, never stored */
        if (nb == KEYS) {
            transpose_keys(k + n0 * d, d, kt);
        } else {
            for (int l = 0; l < d; l++) {
                float col[KEYS];
                for (int n = 0; n < KEYS; n++) col[n] = n < nb ? bf16_to_f32(k[(n0 + n) * d + l]) : 0.0f;
                kt[l] = _mm256_loadu_ps(col);
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            __m256 total = zero; /* the head sum starts at +0, as torch's fp32 sum does */
            for (int h = 0; h < heads; h++) {
                const float *qv = qf + (r * heads + h) * d;
                __m256 s = round_bf16(d == 32 ? dot_block_32(qv, kt) : dot_block(qv, kt, d));
                /* relu keeps -0 and NaN (x < 0 ? +0 : x), as torch's does */
                s = _mm256_blendv_ps(s, zero, _mm256_cmp_ps(s, zero, _CMP_LT_OQ));
                total = _mm256_add_ps(total, round_bf16(_mm256_mul_ps(s, _mm256_set1_ps(wf[r * heads + h]))));
            }
            const __m256i rounded = round_bf16_bits(total);
            const int64_t seen = visible ? visible[r] : INT64_MAX;
            uint16_t *o = out + r * n_keys + n0;
            if (nb == KEYS && n0 + KEYS <= seen) {
                /* a whole block the row sees: the 8 bf16 values (each below 2^16) packed and stored at once */
                const __m256i high = _mm256_srli_epi32(rounded, 16);
                _mm_storeu_si128((__m128i *)o, _mm_packus_epi32(_mm256_castsi256_si128(high),
                                                                _mm256_extracti128_si256(high, 1)));
            } else {
                uint32_t bits[KEYS];
                _mm256_storeu_si256((__m256i *)bits, rounded);
                for (int n = 0; n < nb; n++) o[n] = n0 + n >= seen ? 0xFF80 : (uint16_t)(bits[n] >> 16);
            }
        }
    }
    free(qf);
    free(wf);
    free(kt);
    return 0;
}
