/* One-row fp32 products of many rows in one call: row r of out[M, N] is x[r] . w^T computed exactly as
 * torch computes F.linear of that row alone, because it is the very same BLAS call.
 *
 * Why: a batched decode must give each sequence's row the sums of its lone decode (model/invariant.py).
 * A lone fp32 product of one row is, in torch 2.13 on the CPU, `mm` -> `cpublas::gemm` -> the BLAS
 * `sgemm_` with (transa 'T', transb 'N', m = N, n = 1, k = K, lda = K, ldb = K, ldc = N); MKL then takes
 * its matrix-vector kernel, whose summation order no C loop of ours reproduced (session 27 tried 65). For
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
