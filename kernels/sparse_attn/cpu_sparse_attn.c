/* The two products of the sparse attention's block loop (kernels/sparse_attn/reference.py), compiled: the
 * gather, fp32 conversion and masking of the indexed KV rows fused into each product, so a block's KV rows
 * are never gathered into a tensor of their own.
 *
 * scores: out[r, h, j] = (ids[r, j] != -1 ? q[r, h] . kv[row_j] : -inf) * scale, what the reference's
 *         `torch.where(valid, einsum("bmhd,bmkd->bmhk", q, kv_blk), -inf) * scale` gives;
 * accumulate: acc[r, h, :] = acc[r, h, :] * rescale[r, h] + sum_j p[r, h, j] * kv_blk[r, j, :], what its
 *         `acc_o * rescale.unsqueeze(-1) + einsum("bmhk,bmkd->bmhd", p_bf16.float(), kv_blk)` gives,
 *         where kv_blk[r, j] = kv[row_j] * (ids[r, j] != -1): an id of -1 reads row 0, which the reference
 *         zeroes by a multiply. Here row 0 is used as it is, with the same bits: a masked slot's
 *         probability is exp(-inf - running max), +0 or NaN, and +0 * x equals +0 * (x * 0) for every x
 *         (a zero of x's sign when x is finite, NaN for an infinity or NaN), NaN * anything is NaN.
 * row_j = max(ids[r, j], 0), in the kv rows of row r's batch row (r / rows_per_batch).
 *
 * The order of the sums is the one parameter (`order`). Both operands are bf16 values, so every product is
 * exact unless it leaves fp32's normal range; then only the same fusing matches. Two orders, each what MKL
 * computes for these batched products somewhere (read off at the model's shapes):
 * ORDER_CHAIN, MKL's strict CNR mode on an Intel Xeon (session 42): every sum a fused multiply-add chain
 *   from +0 in index order (over the head dim for a score, over the block's ids for an accumulation);
 * ORDER_LANES, MKL's AVX2 kernels on an AMD EPYC VM at H = 2 under both profiles (session 43): every product
 *   rounded to fp32 before it is added (a multiply, then an add); an accumulation a chain from +0 in index
 *   order; a score, in a block of fewer than 4 ids, a chain from +0 over the head dim, else for the ids in
 *   whole groups of 4 four chains (lane l over dims l, l + 4, ...; folded (0 + 2) + (1 + 3)) and for the last
 *   blk % 4 ids eight (lane l over dims l, l + 8, ...; folded ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))).
 * The caller's first-use probe (cpu.py) finds which order, if either, gives torch's bits and otherwise keeps
 * the torch ops. Built without fast-math and with -ffp-contract=off (kernels/native), so the only fused
 * operations are the explicit fmadd intrinsics.
 *
 * Vectorized across keys for the scores (a block of 8 keys converted and transposed with shuffles,
 * kernels/native/transpose.h: one AVX2 vector per dimension, each lane its key's chain) and across the
 * head dim for the accumulation (each lane its output's chain): vectorizing never reassociates within
 * one output's sums.
 *
 * Returns 0, or 1 + the flat position of the first id outside [-1, n_kv) (nothing read past the rows).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../native/bf16.h"
#include "../native/transpose.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "cpu_sparse_attn.c needs AVX2 and FMA (the portable profile's instruction set)"
#endif

#define KEYS 8 /* keys per transposed block: one fp32 AVX2 vector per dimension */

enum { ORDER_CHAIN = 0, ORDER_LANES = 1 };

/* acc + a * b: fused (one rounding, ORDER_CHAIN) or the product rounded first (ORDER_LANES). */
static inline __m256 madd(__m256 a, __m256 b, __m256 acc, int fused) {
    return fused ? _mm256_fmadd_ps(a, b, acc) : _mm256_add_ps(_mm256_mul_ps(a, b), acc);
}

static const uint16_t ZERO_ROW[1024]; /* a padding lane's key: read, never stored */

/* The ids of one row's block checked against [-1, n_kv): 0, or 1 + the first bad position in the row. */
static inline int64_t check_ids(const int32_t *id, int64_t blk, int64_t n_kv) {
    for (int64_t j = 0; j < blk; j++)
        if (id[j] < -1 || id[j] >= n_kv) return 1 + j;
    return 0;
}

/* A score in ORDER_LANES with 4 lanes: lane l a chain over dims l, l + 4, ..., folded (0+2)+(1+3). */
static inline float dot_4_lanes(const float *q, const uint16_t *k, int d) {
    __m128 acc = _mm_setzero_ps();
    for (int l = 0; l < d; l += 8) {
        const __m256 v = bf16x8_to_f32(k + l);
        acc = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(q + l), _mm256_castps256_ps128(v)), acc);
        acc = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(q + l + 4), _mm256_extractf128_ps(v, 1)), acc);
    }
    const __m128 half = _mm_add_ps(acc, _mm_movehl_ps(acc, acc)); /* 0 + 2, 1 + 3 */
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1)));
}

/* A score in ORDER_LANES with 8 lanes: lane l a chain over dims l, l + 8, ..., folded
 * ((0+4)+(2+6))+((1+5)+(3+7)). */
static inline float dot_8_lanes(const float *q, const uint16_t *k, int d) {
    __m256 acc = _mm256_setzero_ps();
    for (int l = 0; l < d; l += 8) acc = madd(_mm256_loadu_ps(q + l), bf16x8_to_f32(k + l), acc, 0);
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 half = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1)));
}

/* One row's scores in ORDER_LANES for blk >= 4 (qf: the row's query as fp32, H x D). */
static void scores_in_lanes(const float *qf, const uint16_t *base, const int32_t *id, int heads, int d,
                            int64_t blk, float scale, float masked, float *out) {
    const int64_t grouped = blk / 4 * 4;
    for (int h = 0; h < heads; h++) {
        const float *qh = qf + h * d;
        float *o = out + h * blk;
        for (int64_t j = 0; j < blk; j++) {
            if (id[j] == -1) {
                o[j] = masked;
                continue;
            }
            const uint16_t *k = base + (int64_t)id[j] * d;
            o[j] = (j < grouped ? dot_4_lanes(qh, k, d) : dot_8_lanes(qh, k, d)) * scale;
        }
    }
}

/* q [R, H, D] bf16, kv [B, n_kv, D] bf16, ids: row r's block at ids + r * ids_stride (blk int32),
 * out [R, H, blk] fp32, order ORDER_CHAIN or ORDER_LANES. D a multiple of 8, at most 1024 (the caller
 * checks). */
int64_t sparse_scores(const uint16_t *q, const uint16_t *kv, const int32_t *ids, int64_t ids_stride,
                      int64_t rows, int64_t rows_per_batch, int64_t n_kv, int heads, int d, int64_t blk,
                      float scale, int order, float *out) {
    __m256 kt[1024];
    float qf[1024];
    const float masked = -INFINITY * scale;
    const int fused = order == ORDER_CHAIN, lanes = order == ORDER_LANES && blk >= 4;
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *id = ids + r * ids_stride;
        const int64_t bad = check_ids(id, blk, n_kv);
        if (bad) return 1 + r * blk + (bad - 1);
        const uint16_t *base = kv + (r / rows_per_batch) * n_kv * d;
        for (int l = 0; l < heads * d; l++) qf[l] = bf16_to_f32(q[r * heads * d + l]);
        if (lanes) {
            scores_in_lanes(qf, base, id, heads, d, blk, scale, masked, out + r * heads * blk);
            continue;
        }
        for (int64_t j0 = 0; j0 < blk; j0 += KEYS) {
            const uint16_t *key[KEYS];
            for (int n = 0; n < KEYS; n++) {
                const int64_t j = j0 + n;
                /* an id of -1 is masked below whatever its row holds; padding lanes read zeros */
                key[n] = (j < blk && id[j] >= 0) ? base + (int64_t)id[j] * d : ZERO_ROW;
            }
            transpose_8_keys(key, d, kt);
            for (int h = 0; h < heads; h++) {
                const float *qh = qf + h * d;
                __m256 acc = _mm256_setzero_ps();
                for (int l = 0; l < d; l++) acc = madd(_mm256_set1_ps(qh[l]), kt[l], acc, fused);
                float lane[KEYS];
                _mm256_storeu_ps(lane, acc);
                float *o = out + (r * heads + h) * blk;
                for (int n = 0; n < KEYS && j0 + n < blk; n++)
                    o[j0 + n] = id[j0 + n] != -1 ? lane[n] * scale : masked;
            }
        }
    }
    return 0;
}

/* p [R, H, blk] bf16 (the rounded probabilities), rescale [R, H] fp32, kv / ids as above, acc [R, H, D]
 * fp32 updated in place, order ORDER_CHAIN or ORDER_LANES. */
int64_t sparse_accumulate(const uint16_t *p, const float *rescale, const uint16_t *kv, const int32_t *ids,
                          int64_t ids_stride, int64_t rows, int64_t rows_per_batch, int64_t n_kv, int heads,
                          int d, int64_t blk, int order, float *acc) {
    const __m256 zero = _mm256_setzero_ps();
    const int fused = order == ORDER_CHAIN;
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *id = ids + r * ids_stride;
        const int64_t bad = check_ids(id, blk, n_kv);
        if (bad) return 1 + r * blk + (bad - 1);
        const uint16_t *base = kv + (r / rows_per_batch) * n_kv * d;
        for (int h = 0; h < heads; h++) {
            const uint16_t *ph = p + (r * heads + h) * blk;
            const __m256 scale = _mm256_set1_ps(rescale[r * heads + h]);
            float *a = acc + (r * heads + h) * d;
            for (int l = 0; l < d; l += 8) {
                __m256 sum = zero;
                for (int64_t j = 0; j < blk; j++) {
                    const int32_t at = id[j] < 0 ? 0 : id[j];
                    const __m256 v = bf16x8_to_f32(base + (int64_t)at * d + l);
                    sum = madd(_mm256_set1_ps(bf16_to_f32(ph[j])), v, sum, fused);
                }
                _mm256_storeu_ps(a + l, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(a + l), scale), sum));
            }
        }
    }
    return 0;
}
