/* Compiled CPU top-k selection of bf16 indexer scores under the deterministic rule (higher score, then
 * lower id): what kernels/topk/selection.py's torch path (`rank_keys`, `topk`, the two sorts and the
 * masks of `select_topk`) gives, id for id. Integer work only, so nothing here depends on the numerics
 * profile: every step is a comparison of the keys below.
 *
 * Key of entry j of a row (as `rank_keys` makes it for bf16 rows of at most 2^16 entries): the score's
 * bits made monotone as a signed integer (a negative value's 15 magnitude bits flipped; -0 counts as +0;
 * every NaN gets +inf's bits plus one, above every score), shifted left 16, with 65535 - j in the low
 * bits. Keys are distinct, so the k largest are one set whatever the method: here a min-heap of the best
 * k for few picks against many entries, else a quickselect on a scratch copy (a sort of the range left
 * where it runs long); then the picked ids sorted ascending. With AVX2 the heap's scan makes 8 keys at
 * a time and lets through only those above the heap's least (session 41: a 24-token chunk's rows over
 * 225 entries, k = 16, 1.08 -> 0.56 us a row on an AMD EPYC), the same set as the scalar scan.
 * A pick is unusable when its id is at or past the row's visible count, (drop_neg_inf) when its score is
 * -inf, or (drop_nan) when it is NaN (a candidate pool keeps only blocks whose score is above -inf); the
 * row's kept ids come first, ascending, then -1 for the unusable ones.
 *
 * scores: [R, N] bf16 bits, rows contiguous; counts: [R] int64 visible counts; out: [R, K] int32.
 * Returns 0, or 1 when the scratch memory could not be allocated (nothing written then).
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define BF16_NEG_INF 0xFF80u
#define BF16_NAN_KEY 0x7F81 /* +inf's bits plus one */
/* partition rounds of one row before the range left is sorted instead (keys distinct: rare) */
#define MAX_ROUNDS 64
/* a min-heap of the best k when k is at most n / HEAP_RATIO (few entries pass its one comparison), else
 * the quickselect */
#define HEAP_RATIO 8

static inline int32_t rank_key(uint16_t bits, int64_t j) {
    int32_t mono;
    if ((bits & 0x7FFFu) > 0x7F80u) {
        mono = BF16_NAN_KEY;
    } else {
        int32_t s = (int16_t)(bits == 0x8000u ? 0u : bits);
        mono = s < 0 ? (s ^ 0x7FFF) : s;
    }
    return (int32_t)(((uint32_t)mono << 16) | (uint32_t)(65535 - j));
}

static int cmp_i32_asc(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static inline void swap_i32(int32_t *a, int32_t *b) {
    int32_t t = *a;
    *a = *b;
    *b = t;
}

/* Reorders keys[0, n) so that keys[n - k, n) are the k largest (in no order). */
static void top_k_last(int32_t *keys, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, target = n - k;
    for (int round = 0; lo < hi; round++) {
        if (round == MAX_ROUNDS) {
            qsort(keys + lo, (size_t)(hi - lo + 1), sizeof(int32_t), cmp_i32_asc);
            return;
        }
        /* median of three as the pivot, moved to hi */
        int64_t mid = lo + (hi - lo) / 2;
        if (keys[mid] < keys[lo]) swap_i32(&keys[mid], &keys[lo]);
        if (keys[hi] < keys[lo]) swap_i32(&keys[hi], &keys[lo]);
        if (keys[mid] < keys[hi]) swap_i32(&keys[mid], &keys[hi]);
        int32_t pivot = keys[hi];
        int64_t store = lo;
        for (int64_t i = lo; i < hi; i++) {
            if (keys[i] < pivot) swap_i32(&keys[i], &keys[store++]);
        }
        swap_i32(&keys[store], &keys[hi]);
        if (store == target) return;
        if (store < target) {
            lo = store + 1;
        } else {
            hi = store - 1;
        }
    }
}

/* Sift the root of a min-heap of m keys down. */
static inline void sift_down(int32_t *heap, int64_t m) {
    int64_t i = 0;
    for (;;) {
        int64_t l = 2 * i + 1, small = i;
        if (l < m && heap[l] < heap[small]) small = l;
        if (l + 1 < m && heap[l + 1] < heap[small]) small = l + 1;
        if (small == i) return;
        swap_i32(&heap[i], &heap[small]);
        i = small;
    }
}

/* The k largest keys of a row into heap[0, k) (in no order), by a min-heap of the best k so far: one
 * comparison for most entries when k is small against n. */
static void top_k_heap(const uint16_t *row, int64_t n, int64_t k, int32_t *heap) {
    for (int64_t j = 0; j < k; j++) {
        /* insert keeping the heap property (sift up) */
        int64_t i = j;
        heap[i] = rank_key(row[j], j);
        while (i > 0 && heap[(i - 1) / 2] > heap[i]) {
            swap_i32(&heap[(i - 1) / 2], &heap[i]);
            i = (i - 1) / 2;
        }
    }
    int64_t j = k;
#ifdef __AVX2__
    /* 8 entries at a time: their keys made as `rank_key` makes them and compared with the heap's least;
     * only those above it go through the heap (in order, each compared again with the heap's least of
     * the moment, which only rises: the set kept is the scalar loop's). */
    const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i magnitude = _mm256_set1_epi32(0x7FFF), inf_bits = _mm256_set1_epi32(0x7F80);
    const __m256i neg_zero = _mm256_set1_epi32(0x8000), nan_key = _mm256_set1_epi32(BF16_NAN_KEY);
    const __m256i top_id = _mm256_set1_epi32(65535), zero = _mm256_setzero_si256();
    for (; j + 8 <= n; j += 8) {
        const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + j)));
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, magnitude), inf_bits);
        const __m256i plain = _mm256_andnot_si256(_mm256_cmpeq_epi32(bits, neg_zero), bits); /* -0 -> +0 */
        const __m256i s = _mm256_srai_epi32(_mm256_slli_epi32(plain, 16), 16);              /* as int16 */
        __m256i mono = _mm256_blendv_epi8(s, _mm256_xor_si256(s, magnitude), _mm256_cmpgt_epi32(zero, s));
        mono = _mm256_blendv_epi8(mono, nan_key, nan);
        const __m256i j_lanes = _mm256_add_epi32(_mm256_set1_epi32((int32_t)j), lane_ids);
        const __m256i keys = _mm256_or_si256(_mm256_slli_epi32(mono, 16), _mm256_sub_epi32(top_id, j_lanes));
        const __m256i passing = _mm256_cmpgt_epi32(keys, _mm256_set1_epi32(heap[0]));
        unsigned above = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(passing));
        if (!above) continue;
        int32_t lane_keys[8];
        _mm256_storeu_si256((__m256i *)lane_keys, keys);
        while (above) {
            const int lane = __builtin_ctz(above);
            above &= above - 1;
            if (lane_keys[lane] > heap[0]) {
                heap[0] = lane_keys[lane];
                sift_down(heap, k);
            }
        }
    }
#endif
    for (; j < n; j++) {
        int32_t key = rank_key(row[j], j);
        if (key > heap[0]) {
            heap[0] = key;
            sift_down(heap, k);
        }
    }
}

static void sort_ids(int32_t *ids, int64_t k) {
    if (k > 32) {
        qsort(ids, (size_t)k, sizeof(int32_t), cmp_i32_asc);
        return;
    }
    for (int64_t i = 1; i < k; i++) {
        int32_t v = ids[i];
        int64_t j = i - 1;
        while (j >= 0 && ids[j] > v) {
            ids[j + 1] = ids[j];
            j--;
        }
        ids[j + 1] = v;
    }
}

int select_topk_bf16(const uint16_t *scores, int64_t rows, int64_t n, int64_t k, const int64_t *counts,
                     int drop_neg_inf, int drop_nan, int32_t *out) {
    if (k <= 0 || rows <= 0) return 0;
    int32_t *keys = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    int32_t *ids = (int32_t *)malloc((size_t)k * sizeof(int32_t));
    if (keys == NULL || ids == NULL) {
        free(keys);
        free(ids);
        return 1;
    }
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = scores + r * n;
        const int32_t *best;
        if (k * HEAP_RATIO <= n) {
            top_k_heap(row, n, k, keys);
            best = keys;
        } else {
            for (int64_t j = 0; j < n; j++) keys[j] = rank_key(row[j], j);
            top_k_last(keys, n, k);
            best = keys + (n - k);
        }
        for (int64_t i = 0; i < k; i++) ids[i] = 65535 - (best[i] & 0xFFFF);
        sort_ids(ids, k);
        int32_t *dst = out + r * k;
        int64_t kept = 0;
        for (int64_t i = 0; i < k; i++) {
            int32_t id = ids[i];
            if (id >= counts[r] || (drop_neg_inf && row[id] == BF16_NEG_INF) ||
                (drop_nan && (row[id] & 0x7FFFu) > 0x7F80u))
                continue;
            dst[kept++] = id;
        }
        for (int64_t i = kept; i < k; i++) dst[i] = -1;
    }
    free(keys);
    free(ids);
    return 0;
}
