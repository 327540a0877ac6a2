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
 * of OUTS outputs transposed so that one vector register holds one element of OUTS different outputs;
 * every row then runs the ordered sums above on OUTS outputs at once, ROWS rows per weight load
 * (`dot_block`). OUTS is 16 (one AVX-512 register) where the build targets AVX-512F, else 8 (one AVX2
 * register); the caller asks the library (`linear_bf16_outputs_per_block`) and packs to match. Either
 * width gives every output the same bits: each output lives in one lane, and a lane's fused
 * multiply-adds and adds are the same IEEE operations in a 256-bit or a 512-bit register, so vectorizing
 * across outputs or rows never reassociates within one output. Built without fast-math and
 * with -ffp-contract=off (kernels/native), so the only fused operations are the explicit
 * VFMA, where ATen fuses too. Needs AVX2 and FMA, which the portable profile needs anyway; on
 * other CPUs the build fails and callers keep torch.
 *
 * x: [M, K] bf16 bits; wt: [ceil(N/OUTS), K, OUTS] fp32 (zero past N); out: [M, N] bf16 bits.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../native/bf16.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "cpu_bf16_gemm.c needs AVX2 and FMA (the portable profile's instruction set)"
#endif

/* The register that holds one element of K for OUTS outputs, and the lane-wise operations on it. */
#if defined(__AVX512F__)
#define OUTS 16  /* outputs per block: one fp32 AVX-512 vector per element of K */
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VSET1(v) _mm512_set1_ps(v)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#else
#define OUTS 8  /* outputs per block: one fp32 AVX2 vector per element of K */
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VSET1(v) _mm256_set1_ps(v)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#endif
#define LANES 8  /* ATen's fp32 vector width at the AVX2 level (the order's, not this file's registers) */
#define REGS 8   /* ATen's accumulator registers per 64-wide chunk */
#define CHUNK (REGS * LANES)
#define TAIL 16  /* ATen's tail step: one vector of 16 bf16, as two fp32 registers */

/* Every row's sums below are the order of the file comment, written as the trees they are and evaluated
 * depth first, for ROWS rows at once (each weight vector is loaded once for all of them). Depth first
 * keeps few partial sums live: the earlier form held a whole level of the tree (8 registers x 8 lanes x
 * 4 rows) and spilled it to memory, which made it 1.8x slower on an AMD EPYC Zen 1 (session 18).
 * Vectorizing across outputs or rows, and the order in which independent operations are issued, never
 * reassociate within one output: every output gets the same chains from zero, the same pairwise sums.
 * `rows` is a compile-time constant at each call (the functions are always inlined), so the loops over
 * it unroll and the partial sums stay in registers. */
/* 4 rows per weight load with AVX-512's 32 vector registers (measured on an Intel Xeon with AVX-512,
 * session 21: 66 against 71 us for 240 rows x 96 x 96); 2 with AVX2's 16, where 4 spilled (session 18). */
#if defined(__AVX512F__)
#define ROWS 4
#else
#define ROWS 2
#endif
#define INLINE static inline __attribute__((always_inline))

/* The chain of element l of every 64-wide chunk: a fused multiply-add from zero, chunk after chunk. */
INLINE void chains(const float *xv, int64_t stride, const float *wt, int l, int chunks, int rows, vec *v) {
    for (int q = 0; q < rows; q++) v[q] = VZERO();
    for (int c = 0; c < chunks; c++) {
        const vec w = VLOAD(wt + (int64_t)(c * CHUNK + l) * OUTS);
        for (int q = 0; q < rows; q++)
            v[q] = VFMA(VSET1(xv[q * stride + c * CHUNK + l]), w, v[q]);
    }
}

INLINE void add_rows(const vec *a, const vec *b, int rows, vec *out) {
    for (int q = 0; q < rows; q++) out[q] = VADD(a[q], b[q]);
}

/* Lane j of the chunk sums: the registers' pairwise sum ((r0 + r4) + (r2 + r6)) + ((r1 + r5) + (r3 + r7)),
 * register r holding element 8r + j. */
INLINE void reg_pair(const float *xv, int64_t stride, const float *wt, int j, int chunks, int r, int rows, vec *out) {
    vec a[ROWS], b[ROWS];
    chains(xv, stride, wt, r * LANES + j, chunks, rows, a);
    chains(xv, stride, wt, (r + REGS / 2) * LANES + j, chunks, rows, b);
    add_rows(a, b, rows, out);
}

INLINE void lane(const float *xv, int64_t stride, const float *wt, int j, int chunks, int rows, vec *out) {
    vec a[ROWS], b[ROWS], c[ROWS], d[ROWS];
    reg_pair(xv, stride, wt, j, chunks, 0, rows, a);
    reg_pair(xv, stride, wt, j, chunks, 2, rows, b);
    add_rows(a, b, rows, c);
    reg_pair(xv, stride, wt, j, chunks, 1, rows, a);
    reg_pair(xv, stride, wt, j, chunks, 3, rows, b);
    add_rows(a, b, rows, d);
    add_rows(c, d, rows, out);
}

/* Lane j of the tail: one chain over the 16-wide steps past the whole chunks (elements t + j, then
 * t + 8 + j, fused). */
INLINE void tail_lane(const float *xv, int64_t stride, const float *wt, int j, int from, int k, int rows, vec *v) {
    for (int q = 0; q < rows; q++) v[q] = VZERO();
    for (int t = from; t + TAIL <= k; t += TAIL) {
        const vec w0 = VLOAD(wt + (int64_t)(t + j) * OUTS), w1 = VLOAD(wt + (int64_t)(t + LANES + j) * OUTS);
        for (int q = 0; q < rows; q++) {
            v[q] = VFMA(VSET1(xv[q * stride + t + j]), w0, v[q]);
            v[q] = VFMA(VSET1(xv[q * stride + t + LANES + j]), w1, v[q]);
        }
    }
}

/* The lanes' pairwise sum ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), of the chunk sums (tail 0)
 * or of the tail's chains (tail 1). */
INLINE void lane_pair(const float *xv, int64_t stride, const float *wt, int j, int chunks, int k, int tail,
                      int rows, vec *out) {
    vec a[ROWS], b[ROWS];
    if (tail) {
        tail_lane(xv, stride, wt, j, chunks * CHUNK, k, rows, a);
        tail_lane(xv, stride, wt, j + LANES / 2, chunks * CHUNK, k, rows, b);
    } else {
        lane(xv, stride, wt, j, chunks, rows, a);
        lane(xv, stride, wt, j + LANES / 2, chunks, rows, b);
    }
    add_rows(a, b, rows, out);
}

INLINE void lanes_sum(const float *xv, int64_t stride, const float *wt, int chunks, int k, int tail, int rows,
                      vec *out) {
    vec a[ROWS], b[ROWS], c[ROWS], d[ROWS];
    lane_pair(xv, stride, wt, 0, chunks, k, tail, rows, a);
    lane_pair(xv, stride, wt, 2, chunks, k, tail, rows, b);
    add_rows(a, b, rows, c);
    lane_pair(xv, stride, wt, 1, chunks, k, tail, rows, a);
    lane_pair(xv, stride, wt, 3, chunks, k, tail, rows, b);
    add_rows(a, b, rows, d);
    add_rows(c, d, rows, out);
}

/* The dot products of `rows` rows (xv, a row every `stride` floats) with the 8 outputs of a transposed
 * weight block wt[K] (one vector per element): the chunk sum plus the tail sum. */
INLINE void dot_block(const float *xv, int64_t stride, const float *wt, int k, int rows, vec *res) {
    const int chunks = k / CHUNK;
    vec main_sum[ROWS], tail_sum[ROWS];
    lanes_sum(xv, stride, wt, chunks, k, 0, rows, main_sum);
    lanes_sum(xv, stride, wt, chunks, k, 1, rows, tail_sum);
    add_rows(main_sum, tail_sum, rows, res);
}

/* The OUTS sums of a block rounded to bf16, the first `valid` of them stored. */
static inline void store_outputs(vec sums, uint16_t *o, int valid) {
    uint32_t bits[OUTS];
#if defined(__AVX512F__)
    const __m512i whole = _mm512_castps_si512(sums);
    _mm256_storeu_si256((__m256i *)bits, round_bf16_bits(_mm256_castsi256_ps(_mm512_castsi512_si256(whole))));
    _mm256_storeu_si256((__m256i *)(bits + 8),
                        round_bf16_bits(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(whole, 1))));
#else
    _mm256_storeu_si256((__m256i *)bits, round_bf16_bits(sums));
#endif
    for (int j = 0; j < valid; j++) o[j] = (uint16_t)(bits[j] >> 16);
}

/* How many outputs a block of the packed weight holds (the caller packs to match). */
int linear_bf16_outputs_per_block(void) { return OUTS; }

/* Returns 0, or -1 when scratch memory could not be allocated (the caller falls back to torch). */
int linear_bf16(const uint16_t *x, const float *wt, int64_t m, int64_t n, int k, uint16_t *out) {
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    if (!xf) return -1;
    for (int64_t i = 0; i < m * k; i++) xf[i] = bf16_to_f32(x[i]);
    const int64_t blocks = (n + OUTS - 1) / OUTS;
    for (int64_t b = 0; b < blocks; b++) {
        const float *w = wt + b * k * OUTS;
        const int valid = n - b * OUTS < OUTS ? (int)(n - b * OUTS) : OUTS;
        int64_t i = 0;
        for (; i + ROWS <= m; i += ROWS) {
            vec sums[ROWS];
            dot_block(xf + i * k, k, w, k, ROWS, sums);
            for (int q = 0; q < ROWS; q++) store_outputs(sums[q], out + (i + q) * n + b * OUTS, valid);
        }
        for (; i < m; i++) {
            vec sums[ROWS];
            dot_block(xf + i * k, k, w, k, 1, sums);
            store_outputs(sums[0], out + i * n + b * OUTS, valid);
        }
    }
    free(xf);
    return 0;
}
