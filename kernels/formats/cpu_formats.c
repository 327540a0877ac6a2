/* Compiled CPU quantizers and dequantizers of the block formats: one pass per tensor, bit for bit the
 * torch reference (kernels/formats/reference.py) on finite input; NaN outputs are the canonical bf16 /
 * fp32 quiet NaN. Built by kernels/formats/cpu.py with -O3 -ffp-contract=off (no FMA contraction, no
 * fast-math: every float operation is the IEEE one the reference performs).
 *
 * x: n_groups * group contiguous values, bf16 (raw uint16 bits) or fp32.
 * Lookup tables passed in by the caller come from torch itself: e4m3 -> fp32 (256) and E8M0 -> fp32 (256).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bits_to_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* fp32 -> bf16 round to nearest even (c10::BFloat16); NaN -> 0x7FC0. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* fp32 f (not NaN) -> float8_e4m3fn RNE byte of clamp(f, +-448), branch-free (c10 fp8e4m3fn_from_fp32_value): normals round
 * their mantissa to 3 bits; below 2^-6 adding 2^14 rounds to a multiple of 2^-9 (RNE) in the fp32 add. */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t u = f32_to_bits(f);
    uint32_t sign = (u >> 24) & 0x80u;
    u &= 0x7FFFFFFFu;
    /* saturate the magnitude at 448 (0x43E00000): the reference's clamp to +-448, on the bits */
    u = u < 0x43E00000u ? u : 0x43E00000u;
    uint32_t normal = (u + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1u)) >> 20;
    uint32_t sub = f32_to_bits(bits_to_f32(u) + 16384.0f) - (141u << 23);
    return (uint8_t)((u >= (121u << 23) ? normal : sub) | sign);
}

static inline int32_t ceil_log2(float t) {
    uint32_t b = f32_to_bits(t);
    return (int32_t)((b >> 23) & 0xFFu) - 127 + ((b & 0x7FFFFFu) != 0);
}

static inline float pow2f(int32_t k) { return bits_to_f32((uint32_t)(k + 127) << 23); }

/* One group into fp32 v[]; returns the bits of its amax (|x| bits compare as the values do; a NaN or
 * inf gives >= 0x7F800000). */
static inline __attribute__((always_inline)) uint32_t load_group(const void *x, int is_bf16, int64_t base, int group, float *v) {
    uint32_t amax = 0;
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)x + base;
        for (int j = 0; j < group; j++) {
            uint32_t u = (uint32_t)p[j] << 16;
            v[j] = bits_to_f32(u);
            uint32_t a = u & 0x7FFFFFFFu;
            amax = a > amax ? a : amax;
        }
    } else {
        const float *p = (const float *)x + base;
        for (int j = 0; j < group; j++) {
            uint32_t u = f32_to_bits(p[j]);
            v[j] = p[j];
            uint32_t a = u & 0x7FFFFFFFu;
            amax = a > amax ? a : amax;
        }
    }
    return amax;
}

/* FP4: E2M1 codes packed two per byte (even element low nibble); scales E4M3 (pow2 = 0) or E8M0 (1). */
static inline __attribute__((always_inline)) void fp4_quantize_impl(const void *x, int is_bf16, int64_t n_groups, int group, int pow2, float amax_floor,
                  float inv_emax, const float *thr, const float *e4m3_table, uint8_t *packed,
                  uint8_t *scales) {
    float v[64];
    uint32_t codes[64];
    const float t0 = thr[0], t1 = thr[1], t2 = thr[2], t3 = thr[3], t4 = thr[4], t5 = thr[5], t6 = thr[6];
    for (int64_t g = 0; g < n_groups; g++) {
        int64_t base = g * group;
        uint32_t amax_bits = load_group(x, is_bf16, base, group, v);
        uint8_t *out = packed + base / 2;
        if (amax_bits >= 0x7F800000u) {
            scales[g] = pow2 ? 0xFF : 0x7F;
            memset(out, 0, (size_t)group / 2);
            continue;
        }
        float amax = bits_to_f32(amax_bits);
        amax = amax < amax_floor ? amax_floor : amax;
        if (pow2) {
            int32_t k = ceil_log2(amax * inv_emax);
            /* x / 2^k and x * 2^-k round the same real number: the reciprocal of a power of two is exact */
            float inv = 1.0f / pow2f(k);
            scales[g] = (uint8_t)(k + 127);
            for (int j = 0; j < group; j++) v[j] = v[j] * inv;
        } else {
            uint8_t b = f32_to_e4m3(amax / 6.0f);
            float scale = e4m3_table[b];
            scales[g] = b;
            for (int j = 0; j < group; j++) v[j] = v[j] / scale;
        }
        for (int j = 0; j < group; j++) {
            uint32_t u = f32_to_bits(v[j]);
            float a = bits_to_f32(u & 0x7FFFFFFFu);
            codes[j] = ((u >> 28) & 8u) + (uint32_t)(a > t0) + (uint32_t)(a > t1) + (uint32_t)(a > t2) +
                       (uint32_t)(a > t3) + (uint32_t)(a > t4) + (uint32_t)(a > t5) + (uint32_t)(a > t6);
        }
        for (int j = 0; j < group / 2; j++) out[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
    }
}

/* out (bf16 bits or fp32) = E2M1 value * scale; scale_table maps the scale byte to fp32. */
static inline __attribute__((always_inline)) void fp4_dequantize_impl(const uint8_t *packed, const uint8_t *scales, int64_t n_groups, int group,
                    const float *scale_table, const float *e2m1_table, int out_bf16, void *out) {
    float lut[16];
    uint16_t lut16[16];
    for (int64_t g = 0; g < n_groups; g++) {
        float s = scale_table[scales[g]];
        int64_t base = g * group;
        const uint8_t *p = packed + base / 2;
        for (int c = 0; c < 16; c++) lut[c] = e2m1_table[c] * s;
        if (out_bf16) {
            for (int c = 0; c < 16; c++) lut16[c] = f32_to_bf16(lut[c]);
            uint16_t *o = (uint16_t *)out + base;
            for (int j = 0; j < group / 2; j++) {
                o[2 * j] = lut16[p[j] & 0x0F];
                o[2 * j + 1] = lut16[p[j] >> 4];
            }
        } else {
            for (int c = 0; c < 16; c++) lut[c] = isnan(lut[c]) ? NAN : lut[c];
            float *o = (float *)out + base;
            for (int j = 0; j < group / 2; j++) {
                o[2 * j] = lut[p[j] & 0x0F];
                o[2 * j + 1] = lut[p[j] >> 4];
            }
        }
    }
}

/* FP8: E4M3 values with one E8M0 scale per group. */
static inline __attribute__((always_inline)) void fp8_quantize_impl(const void *x, int is_bf16, int64_t n_groups, int group, float amax_floor, float inv_emax,
                  uint8_t *values, uint8_t *scales) {
    float v[256];
    for (int64_t g = 0; g < n_groups; g++) {
        int64_t base = g * group;
        uint32_t amax_bits = load_group(x, is_bf16, base, group, v);
        if (amax_bits >= 0x7F800000u) {
            scales[g] = 0xFF;
            memset(values + base, 0, (size_t)group);
            continue;
        }
        float amax = bits_to_f32(amax_bits);
        amax = amax < amax_floor ? amax_floor : amax;
        int32_t k = ceil_log2(amax * inv_emax);
        float inv = 1.0f / pow2f(k);
        scales[g] = (uint8_t)(k + 127);
        uint8_t *o = values + base;
        for (int j = 0; j < group; j++) {
            o[j] = f32_to_e4m3(v[j] * inv);
        }
    }
}

static inline __attribute__((always_inline)) void fp8_dequantize_impl(const uint8_t *values, const uint8_t *scales, int64_t n_groups, int group,
                    const float *e4m3_table, const float *e8m0_table, int out_bf16, void *out) {
    for (int64_t g = 0; g < n_groups; g++) {
        float s = e8m0_table[scales[g]];
        int64_t base = g * group;
        for (int j = 0; j < group; j++) {
            float v = e4m3_table[values[base + j]] * s;
            if (out_bf16) ((uint16_t *)out)[base + j] = f32_to_bf16(v);
            else ((float *)out)[base + j] = isnan(v) ? NAN : v;
        }
    }
}

/* Entry points: the group size and input dtype become compile-time constants of each specialization, so
 * the per-group loops unroll and vectorize. */
void fp4_quantize(const void *x, int is_bf16, int64_t n_groups, int group, int pow2, float amax_floor,
                  float inv_emax, const float *thr, const float *e4m3_table, uint8_t *packed,
                  uint8_t *scales) {
#define FP4Q(BF, G, P) fp4_quantize_impl(x, BF, n_groups, G, P, amax_floor, inv_emax, thr, e4m3_table, packed, scales)
    if (is_bf16 && group == 16 && !pow2) FP4Q(1, 16, 0);
    else if (is_bf16 && group == 32 && pow2) FP4Q(1, 32, 1);
    else if (!is_bf16 && group == 16 && !pow2) FP4Q(0, 16, 0);
    else if (!is_bf16 && group == 32 && pow2) FP4Q(0, 32, 1);
    else FP4Q(is_bf16, group, pow2);
#undef FP4Q
}

void fp4_dequantize(const uint8_t *packed, const uint8_t *scales, int64_t n_groups, int group,
                    const float *scale_table, const float *e2m1_table, int out_bf16, void *out) {
#define FP4D(G, BF) fp4_dequantize_impl(packed, scales, n_groups, G, scale_table, e2m1_table, BF, out)
    if (group == 16 && out_bf16) FP4D(16, 1);
    else if (group == 32 && out_bf16) FP4D(32, 1);
    else FP4D(group, out_bf16);
#undef FP4D
}

void fp8_quantize(const void *x, int is_bf16, int64_t n_groups, int group, float amax_floor, float inv_emax,
                  uint8_t *values, uint8_t *scales) {
    if (is_bf16 && group == 32) fp8_quantize_impl(x, 1, n_groups, 32, amax_floor, inv_emax, values, scales);
    else if (!is_bf16 && group == 32) fp8_quantize_impl(x, 0, n_groups, 32, amax_floor, inv_emax, values, scales);
    else fp8_quantize_impl(x, is_bf16, n_groups, group, amax_floor, inv_emax, values, scales);
}

void fp8_dequantize(const uint8_t *values, const uint8_t *scales, int64_t n_groups, int group,
                    const float *e4m3_table, const float *e8m0_table, int out_bf16, void *out) {
    if (group == 32 && out_bf16) fp8_dequantize_impl(values, scales, n_groups, 32, e4m3_table, e8m0_table, 1, out);
    else fp8_dequantize_impl(values, scales, n_groups, group, e4m3_table, e8m0_table, out_bf16, out);
}
