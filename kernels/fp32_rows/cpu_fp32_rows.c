/* One-row fp32 products of many rows in one call: row r of out[M, N] is x[r] . w^T computed exactly as
 * torch computes F.linear of that row alone, because it is the very same BLAS call.
 *
 * Why: a batched decode must give each sequence's row the sums of its lone decode (model/invariant.py).
 * A lone fp32 product of one row is, in torch 2.13 on the CPU, `mm` -> `cpublas::gemm` -> the BLAS
 * `sgemm_` with (transa 'T', transb 'N', m = N, n = 1, k = K, lda = K, ldb = K, ldc = N); MKL then takes
 * its matrix-vector kernel, whose summation order no C loop of ours reproduced in session 27 (65 tried;
 * session 34 read it off, below: `fp32_rows_gemv_order`). For
 * small products (the MoE gate: K = 96, N = 2) torch's bmm of one-row problems runs a loop of its own
 * with another order, so `rowwise_linear` made one `F.linear` per row: about 3 us of dispatch a row, 276
 * calls a 46-row decode step of v41-sib-s. Here the loop over rows is C and each row is the same `sgemm_`
 * call with the same arguments, on the same memory (the caller passes rows as they lie in its tensor), so
 * the bits are the lone product's by construction; kernels/fp32_rows checks that on first use anyway.
 *
 * sgemm: the address of the BLAS `sgemm_` torch itself calls (its LP64 interface: 32-bit integers).
 * w: [N, K] fp32 contiguous; x: [M, K] fp32 contiguous; out: [M, N] fp32.
 */
#include <stdint.h>

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

void fp32_rows_linear(void *sgemm, const float *w, const float *x, float *out, int64_t rows, int32_t k,
                      int32_t n) {
    sgemm_fn gemm = (sgemm_fn)sgemm;
    const char trans = 'T', plain = 'N';
    const int one = 1, kk = k, nn = n;
    const float alpha = 1.0f, beta = 0.0f;
    for (int64_t r = 0; r < rows; r++) {
        gemm(&trans, &plain, &nn, &one, &kk, &alpha, w, &kk, x + r * (int64_t)k, &kk, &beta,
             out + r * (int64_t)n, &nn);
    }
}

/* The same one-row products computed here in the order of MKL's matrix-vector kernel, for many rows and
 * outputs at once instead of one BLAS call per row (each of which reads the whole weight).
 *
 * The order, read off with the method of FPRev (Xie et al., "FPRev: Revealing the order of floating-point
 * summation", 2024: for every pair of elements i < j, the products are 1 except +2^40 at i and -2^40 at j;
 * the sum then counts the products outside the smallest subtree holding both, which fixes the tree) on
 * torch 2.13's MKL under MKL_CBWR=AVX2, at K = 96 and 384 for N = 24, 64 and 4096, and then checked on
 * wide-range values at K = 8..1024 (multiples of 4) for N = 24..4096: product 0 goes into lane 0 of four
 * accumulators from zero; products 1..K-4 go four at a time into lanes 0..3 (product 1 + 4g + j into lane
 * j), each a separate multiply and add; the lanes are summed as (0 + 2) + (1 + 3); products K-3, K-2 and
 * K-1 are then added to that sum one by one. Products are rounded before they are added (no fused
 * multiply-add: a fused order matched 29-59% of outputs). Read with wide-range inputs, a kernel like
 * this agrees on every output or on few, so kernels/fp32_rows compares it with the BLAS call bit for bit
 * on first use of each shape (`agrees_gemv_order`) and keeps the per-row call where it differs (MKL
 * sums the last N mod 4 outputs another way, for N = 2 it takes yet another route, and K not a multiple
 * of 4 was not read).
 *
 * Layout for speed: the weight is packed once by the caller into blocks of 8 outputs, transposed
 * ([ceil(N/8), K, 8], zeros past N), so that the loops over a block's 8 outputs are plain vector
 * operations, each output in its own lane (vectorizing across outputs never reassociates one output's
 * sums; built with -ffp-contract=off, so no multiply-add is fused). Rows run ROWS at a time per weight
 * load.
 *
 * wt: [ceil(N/8), K, 8] fp32; x: [M, K] fp32 contiguous; out: [M, N] fp32. K: a multiple of 4, >= 8.
 */
#include <string.h>

#define GEMV_OUTS 8
#define GEMV_ROWS 2

/* 8 fp32 lanes (GCC/Clang vector extension: AVX registers where the build has them, else pairs of SSE
 * ones; lane-wise IEEE operations either way) */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8 splat8(float f) { return (v8){f, f, f, f, f, f, f, f}; }

/* `rows` (1..GEMV_ROWS) rows of x against one block of 8 outputs; R fixed per instantiation so that the
 * accumulators stay in registers. */
#define GEMV_BLOCK(R)                                                                                  \
    static void gemv_block_##R(const float *wb, const float *x, float *out, int32_t k, int32_t n,     \
                               int32_t outs) {                                                         \
        v8 a0[R], a1[R], a2[R], a3[R];                                                                 \
        const v8 w_first = load8(wb);                                                                  \
        for (int r = 0; r < R; r++) {                                                                  \
            a0[r] = splat8(0.0f) + w_first * splat8(x[r * (int64_t)k]);                                \
            a1[r] = a2[r] = a3[r] = splat8(0.0f);                                                      \
        }                                                                                              \
        const int32_t groups = (k - 4) / 4;                                                            \
        for (int32_t g = 0; g < groups; g++) {                                                         \
            const int32_t e = 1 + 4 * g;                                                               \
            const float *w = wb + (int64_t)e * GEMV_OUTS;                                              \
            const v8 w0 = load8(w), w1 = load8(w + GEMV_OUTS), w2 = load8(w + 2 * GEMV_OUTS),          \
                     w3 = load8(w + 3 * GEMV_OUTS);                                                    \
            for (int r = 0; r < R; r++) {                                                              \
                const float *xr = x + r * (int64_t)k + e;                                              \
                a0[r] = a0[r] + w0 * splat8(xr[0]);                                                    \
                a1[r] = a1[r] + w1 * splat8(xr[1]);                                                    \
                a2[r] = a2[r] + w2 * splat8(xr[2]);                                                    \
                a3[r] = a3[r] + w3 * splat8(xr[3]);                                                    \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) {                                                                  \
            const float *xr = x + r * (int64_t)k;                                                      \
            v8 s = (a0[r] + a2[r]) + (a1[r] + a3[r]);                                                  \
            for (int32_t t = k - 3; t < k; t++) {                                                      \
                s = s + load8(wb + (int64_t)t * GEMV_OUTS) * splat8(xr[t]);                            \
            }                                                                                          \
            if (outs == GEMV_OUTS) {                                                                   \
                memcpy(out + r * (int64_t)n, &s, sizeof s);                                            \
            } else {                                                                                   \
                float lanes[GEMV_OUTS];                                                                \
                memcpy(lanes, &s, sizeof lanes);                                                       \
                for (int o = 0; o < outs; o++) out[r * (int64_t)n + o] = lanes[o];                     \
            }                                                                                          \
        }                                                                                              \
    }

GEMV_BLOCK(1)
GEMV_BLOCK(2)
GEMV_BLOCK(3)
GEMV_BLOCK(4)

void fp32_rows_gemv_order(const float *wt, const float *x, float *out, int64_t rows, int32_t k, int32_t n) {
    const int32_t blocks = (n + GEMV_OUTS - 1) / GEMV_OUTS;
    for (int32_t b = 0; b < blocks; b++) {
        const float *wb = wt + (int64_t)b * k * GEMV_OUTS;
        const int32_t outs = n - b * GEMV_OUTS < GEMV_OUTS ? n - b * GEMV_OUTS : GEMV_OUTS;
        float *ob = out + (int64_t)b * GEMV_OUTS;
        for (int64_t r = 0; r < rows; r += GEMV_ROWS) {
            const float *xr = x + r * (int64_t)k;
            float *o = ob + r * (int64_t)n;
            switch (rows - r < GEMV_ROWS ? rows - r : GEMV_ROWS) {
                case 4: gemv_block_4(wb, xr, o, k, n, outs); break;
                case 3: gemv_block_3(wb, xr, o, k, n, outs); break;
                case 2: gemv_block_2(wb, xr, o, k, n, outs); break;
                default: gemv_block_1(wb, xr, o, k, n, outs); break;
            }
        }
    }
}
