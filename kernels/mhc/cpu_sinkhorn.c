/* Compiled Sinkhorn normalization of the mHC comb: bit for bit what kernels/mhc/reference.py computes
 * with torch on CPU fp32 tensors.
 *
 * Why it is written out: the reference is 3 torch ops per half-round and 2 x 20 half-rounds per mix, some
 * 120 calls on tensors of 16 floats a row, so a lone decode paid about a sixth of its time there
 * (v41-sib-s). The arithmetic is the reference's, op for op: torch sums the hc elements of a row or a
 * column of a comb one after another from the first for combs of up to 4 lanes (measured against torch
 * for 1 to 40000 combs at 1 and 2 threads: a pairwise sum differs; from 5 lanes on torch sums otherwise,
 * so the caller keeps the reference there), divides in fp32 and adds eps as an fp32 value. Every comb is
 * independent, so the code keeps the combs' elements apart (element e of every comb in one array) and
 * runs each op over all combs at once: the compiler vectorizes across combs, never within one, and
 * without fast-math (kernels/native) it reorders nothing.
 *
 * comb: [S, hc, hc] fp32, normalized in place.
 */
#include <stdint.h>
#include <stdlib.h>

/* Returns 0, or -1 when scratch memory could not be allocated (the caller falls back to the reference). */
int sinkhorn_f32(float *comb, int64_t s, int hc, int iters, float eps) {
    const int hh = hc * hc;
    float *a = malloc(sizeof(float) * (size_t)(hh * s));
    float *t = malloc(sizeof(float) * (size_t)s);
    if (!a || !t) {
        free(a);
        free(t);
        return -1;
    }
    for (int64_t k = 0; k < s; k++)
        for (int e = 0; e < hh; e++) a[e * s + k] = comb[k * hh + e];
    for (int it = 0; it < iters; it++) {
        for (int i = 0; i < hc; i++) {
            float *row = a + (int64_t)i * hc * s;
            for (int64_t k = 0; k < s; k++) t[k] = row[k];
            for (int j = 1; j < hc; j++)
                for (int64_t k = 0; k < s; k++) t[k] = t[k] + row[j * s + k];
            for (int j = 0; j < hc; j++) {
                float *x = row + j * s;
                if (it == 0) /* the first round: comb / sum + eps */
                    for (int64_t k = 0; k < s; k++) x[k] = x[k] / t[k] + eps;
                else
                    for (int64_t k = 0; k < s; k++) x[k] = x[k] / (t[k] + eps);
            }
        }
        for (int j = 0; j < hc; j++) {
            for (int64_t k = 0; k < s; k++) t[k] = a[j * s + k];
            for (int i = 1; i < hc; i++)
                for (int64_t k = 0; k < s; k++) t[k] = t[k] + a[(i * hc + j) * s + k];
            for (int i = 0; i < hc; i++) {
                float *x = a + (int64_t)(i * hc + j) * s;
                for (int64_t k = 0; k < s; k++) x[k] = x[k] / (t[k] + eps);
            }
        }
    }
    for (int64_t k = 0; k < s; k++)
        for (int e = 0; e < hh; e++) comb[k * hh + e] = a[e * s + k];
    free(a);
    free(t);
    return 0;
}
