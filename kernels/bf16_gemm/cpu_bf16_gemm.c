/* Compiled CPU bf16 linear: out[M, N] = bf16(x[M, K] . w[N, K]) bit for bit what torch 2.13's
 * F.linear(x, w) gives on bf16 CPU tensors under the portable numerics profile (ATen's AVX2 kernels,
 * oneDNN off), NaN payloads aside (a NaN is the canonical bf16 quiet NaN here).
 *
 * Why the sums are written out as they are: with oneDNN off, ATen computes each output of a bf16 product
 * of two or more rows as one reduced-precision dot product in fp32 arithmetic, and its order decides the
 * output's last bit. Measured against torch (230K outputs of wide-range inputs at K = 16..1024, where
 * two other plausible orders each missed 6-11 outputs; tests/kernels/test_bf16_linear.py re-checks it
 * on fresh inputs): the products of each 64-wide chunk go into eight fp32 vector registers of eight lanes,
 * element l into register (l / 8) % 8, lane l % 8, each register a fused multiply-add chain over the
 * chunks; the registers are summed pairwise (r + r + 4, then + 2, then + 1) and that register's eight
 * lanes pairwise the same way. What a K that is not a multiple of 64 leaves is taken 16 at a time into a
 * second register from zero (elements t..t+7, then t+8..t+15, lane by lane, fused), whose lanes are
 * summed the same way and added to the first sum. The output is that fp32 sum rounded to bf16.
 * K must be a multiple of 16 (the caller checks): ATen's last scalar tail was not measured.
 *
 * Layout for speed: the weight is converted to fp32 once, by the caller (`pack_bf16_weight`), in blocks
 * of 8 outputs transposed so that one AVX2 vector holds one element of 8 different outputs; every row
 * then runs the ordered sums above on 8 outputs at once, four rows per weight load (`dot_block_rows`).
 * Each output's sums are still exactly that order: vectorizing across outputs or rows never reassociates
 * within one output. Built without fast-math and
 * with -ffp-contract=off (kernels/native), so the only fused operations are the explicit
 * _mm256_fmadd_ps, where ATen fuses too. Needs AVX2 and FMA, which the portable profile needs anyway; on
 * other CPUs the build fails and callers keep torch.
 *
 * x: [M, K] bf16 bits; wt: [ceil(N/8), K, 8] fp32 (zero past N); out: [M, N] bf16 bits.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../native/bf16.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "cpu_bf16_gemm.c needs AVX2 and FMA (the portable profile's instruction set)"
#endif

#define OUTS 8   /* outputs per block: one fp32 AVX2 vector per element of K */
#define LANES 8  /* ATen's fp32 vector width at the AVX2 level */
#define REGS 8   /* ATen's accumulator registers per 64-wide chunk */
#define CHUNK (REGS * LANES)
#define TAIL 16  /* ATen's tail step: one vector of 16 bf16, as two fp32 registers */

/* ATen's horizontal sum of one register, here for 8 outputs at once: v[j] holds lane j of each. */
static inline __m256 lanes_sum(__m256 *v) {
    for (int half = LANES / 2; half >= 1; half /= 2)
        for (int j = 0; j < half; j++) v[j] = _mm256_add_ps(v[j], v[j + half]);
    return v[0];
}

/* The dot products of one row xv[K] (fp32) with the 8 outputs of a transposed weight block wt[K] (one
 * vector per element), in ATen's order (file comment). */
static inline __m256 dot_block(const float *xv, const __m256 *wt, int k) {
    const int chunks = k / CHUNK;
    __m256 lane[LANES];
    for (int j = 0; j < LANES; j++) {
        __m256 reg[REGS];
        for (int r = 0; r < REGS; r++) {
            __m256 v = _mm256_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                const int l = c * CHUNK + r * LANES + j;
                v = _mm256_fmadd_ps(_mm256_set1_ps(xv[l]), wt[l], v);
            }
            reg[r] = v;
        }
        for (int half = REGS / 2; half >= 1; half /= 2)
            for (int r = 0; r < half; r++) reg[r] = _mm256_add_ps(reg[r], reg[r + half]);
        lane[j] = reg[0];
    }
    const __m256 main_sum = lanes_sum(lane);
    __m256 tail[LANES];
    for (int j = 0; j < LANES; j++) {
        __m256 v = _mm256_setzero_ps();
        for (int t = chunks * CHUNK; t + TAIL <= k; t += TAIL) {
            v = _mm256_fmadd_ps(_mm256_set1_ps(xv[t + j]), wt[t + j], v);
            v = _mm256_fmadd_ps(_mm256_set1_ps(xv[t + LANES + j]), wt[t + LANES + j], v);
        }
        tail[j] = v;
    }
    return _mm256_add_ps(main_sum, lanes_sum(tail));
}

/* dot_block for ROWS rows at once: each weight vector is loaded once for all of them (the single-row
 * loop loads one weight vector per fused multiply-add). Every row's sums are dot_block's, operation for
 * operation: the same chains from zero, the same pairwise register and lane sums, the same tail; only
 * the order in which independent operations are issued differs, which changes no result. */
#define ROWS 4
static inline void dot_block_rows(const float *xv, int64_t stride, const __m256 *wt, int k, __m256 *res) {
    const int chunks = k / CHUNK;
    __m256 lane[ROWS][LANES];
    for (int j = 0; j < LANES; j++) {
        __m256 reg[REGS][ROWS];
        for (int r = 0; r < REGS; r++) {
            __m256 v[ROWS];
            for (int q = 0; q < ROWS; q++) v[q] = _mm256_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                const int l = c * CHUNK + r * LANES + j;
                const __m256 w = wt[l];
                for (int q = 0; q < ROWS; q++)
                    v[q] = _mm256_fmadd_ps(_mm256_set1_ps(xv[q * stride + l]), w, v[q]);
            }
            for (int q = 0; q < ROWS; q++) reg[r][q] = v[q];
        }
        for (int half = REGS / 2; half >= 1; half /= 2)
            for (int r = 0; r < half; r++)
                for (int q = 0; q < ROWS; q++) reg[r][q] = _mm256_add_ps(reg[r][q], reg[r + half][q]);
        for (int q = 0; q < ROWS; q++) lane[q][j] = reg[0][q];
    }
    __m256 tail[ROWS][LANES];
    for (int j = 0; j < LANES; j++) {
        __m256 v[ROWS];
        for (int q = 0; q < ROWS; q++) v[q] = _mm256_setzero_ps();
        for (int t = chunks * CHUNK; t + TAIL <= k; t += TAIL) {
            const __m256 w0 = wt[t + j], w1 = wt[t + LANES + j];
            for (int q = 0; q < ROWS; q++) {
                v[q] = _mm256_fmadd_ps(_mm256_set1_ps(xv[q * stride + t + j]), w0, v[q]);
                v[q] = _mm256_fmadd_ps(_mm256_set1_ps(xv[q * stride + t + LANES + j]), w1, v[q]);
            }
        }
        for (int q = 0; q < ROWS; q++) tail[q][j] = v[q];
    }
    for (int q = 0; q < ROWS; q++) res[q] = _mm256_add_ps(lanes_sum(lane[q]), lanes_sum(tail[q]));
}

static inline void store_outputs(__m256 sums, uint16_t *o, int valid) {
    uint32_t bits[OUTS];
    _mm256_storeu_si256((__m256i *)bits, round_bf16_bits(sums));
    for (int j = 0; j < valid; j++) o[j] = (uint16_t)(bits[j] >> 16);
}

/* Returns 0, or -1 when scratch memory could not be allocated (the caller falls back to torch). */
int linear_bf16(const uint16_t *x, const float *wt, int64_t m, int64_t n, int k, uint16_t *out) {
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    if (!xf) return -1;
    for (int64_t i = 0; i < m * k; i++) xf[i] = bf16_to_f32(x[i]);
    const int64_t blocks = (n + OUTS - 1) / OUTS;
    for (int64_t b = 0; b < blocks; b++) {
        const __m256 *w = (const __m256 *)(wt + b * k * OUTS);
        const int valid = n - b * OUTS < OUTS ? (int)(n - b * OUTS) : OUTS;
        int64_t i = 0;
        for (; i + ROWS <= m; i += ROWS) {
            __m256 sums[ROWS];
            dot_block_rows(xf + i * k, k, w, k, sums);
            for (int q = 0; q < ROWS; q++) store_outputs(sums[q], out + (i + q) * n + b * OUTS, valid);
        }
        for (; i < m; i++) store_outputs(dot_block(xf + i * k, w, k), out + i * n + b * OUTS, valid);
    }
    free(xf);
    return 0;
}
