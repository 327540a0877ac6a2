/* Compiled mHC lane mixing: collapse (the sub-block input, a weighted sum of the hc lanes) and expand (the
 * lanes after a sub-block), bit for bit what kernels/mhc/reference.py computes with torch on CPU tensors.
 *
 * Why it is written out: torch forms the whole product tensor first (expand: [rows, hc, hc, d] fp32, 16
 * floats per output element) and reduces it in a second pass, about a fourteenth of a batched prefill step
 * of v41-sib-s. The arithmetic is the reference's, op for op, measured against torch on 12M outputs of
 * wide-range inputs (a pairwise or reversed sum differs): every product is rounded to fp32 apart, the
 * lane sum starts from +0 and adds the hc products one after another (so all -0 products give +0), and
 * expand adds post_j * y (rounded apart) to it; the result is rounded to bf16 (nearest even, NaN -> the
 * canonical quiet NaN). Built with -ffp-contract=off and without fast-math (kernels/native), so nothing
 * is fused or reordered; the compiler vectorizes across the d elements of a lane, never within one sum.
 *
 * Layouts (row-major, contiguous): x / residual [S, hc, d] bf16 bits; pre / post [S, hc] fp32; comb
 * [S, hc, hc] fp32 (input lane i, output lane j); y [S, d] bf16 bits; out collapse [S, d], expand
 * [S, hc, d] bf16 bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../native/bf16.h"

/* Both return 0, or -1 when scratch memory could not be allocated (the caller runs the reference). */
int collapse_bf16(const uint16_t *x, const float *pre, int64_t s, int hc, int d, uint16_t *out) {
    float *acc = malloc(sizeof(float) * (size_t)d);
    if (!acc) return -1;
    for (int64_t t = 0; t < s; t++) {
        for (int k = 0; k < d; k++) acc[k] = 0.0f;
        for (int i = 0; i < hc; i++) {
            const float w = pre[t * hc + i];
            const uint16_t *lane = x + (t * hc + i) * d;
            for (int k = 0; k < d; k++) {
                const float p = w * bf16_to_f32(lane[k]);
                acc[k] = acc[k] + p;
            }
        }
        for (int k = 0; k < d; k++) out[t * d + k] = f32_to_bf16(acc[k]);
    }
    free(acc);
    return 0;
}

int expand_bf16(const uint16_t *y, const uint16_t *residual, const float *post, const float *comb, int64_t s,
                int hc, int d, uint16_t *out) {
    float *acc = malloc(sizeof(float) * 2 * (size_t)d);
    if (!acc) return -1;
    float *yf = acc + d;
    for (int64_t t = 0; t < s; t++) {
        for (int k = 0; k < d; k++) yf[k] = bf16_to_f32(y[t * d + k]);
        for (int j = 0; j < hc; j++) {
            for (int k = 0; k < d; k++) acc[k] = 0.0f;
            for (int i = 0; i < hc; i++) {
                const float c = comb[(t * hc + i) * hc + j];
                const uint16_t *lane = residual + (t * hc + i) * d;
                for (int k = 0; k < d; k++) {
                    const float p = c * bf16_to_f32(lane[k]);
                    acc[k] = acc[k] + p;
                }
            }
            const float pj = post[t * hc + j];
            uint16_t *o = out + (t * hc + j) * d;
            for (int k = 0; k < d; k++) {
                const float q = pj * yf[k];
                o[k] = f32_to_bf16(q + acc[k]);
            }
        }
    }
    free(acc);
    return 0;
}
