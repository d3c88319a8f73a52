/*
 * Decode attention read in place from the paged KV cache: for each single-token query row,
 * its own slots only, one pass over their keys and one over their values.
 *
 * Why a hand-written kernel: the torch formulations either gather every row's context into a
 * new buffer first (SDPA per row: the context is read, written and read again) or pay
 * Dynamo's guards and Inductor's generic loops on every call (torch.compile: ~75 us a call
 * before any work, and twice the bandwidth floor on a batch of 8). A decode step of a small
 * model calls this once per layer, so both costs show in tokens/s (docs/results/benchmarks.md).
 *
 * Layout: queries [B, H, D]; caches [slots, KVH, D] with rows `slot_stride` elements apart;
 * slots[bounds[b] .. bounds[b + 1]) are row b's context in position order; out [B, H, D].
 * A sliding window (`window` > 0) keeps each row's last `window` slots only; a soft-cap
 * (`softcap` > 0, Gemma 2) maps each scaled score s to softcap * tanh(s / softcap), as HF does
 * before the softmax.
 * Grouped-query: query head h reads KV head h / (H / KVH), and a key is loaded once for its
 * whole group. Scores, softmax and the weighted sum are fp32 whatever the storage dtype.
 *
 * Built at run time by quanta.runner.native_decode with the machine's C compiler
 * (-O3 -march=native), so the vector width is the CPU's own; `omp simd` (-fopenmp-simd: no
 * OpenMP runtime) marks the softmax loops, which the compiler would not vectorise unasked. Single-threaded: the engine runs
 * it where torch runs one thread (the documented rule), other configurations keep the
 * compiled kernel.
 */
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_float(bf16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN stays a (quiet) NaN */
        return (bf16_t)((bits >> 16) | 0x40u);
    }
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even */
    return (bf16_t)(bits >> 16);
}

/*
 * Rows of 16 lanes (GCC/Clang vector extensions: the compiler lowers them to the machine's
 * own width, two AVX2 or one AVX-512 register). The plain loops below them serve head sizes
 * that are not a multiple of 16; left to itself the compiler vectorised the bf16 loops badly
 * (scalar FMAs after every conversion), so the hot path does not rely on it.
 */
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
#define LANES 16

static inline f32x16 load_f32(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 bf16 values widened to fp32. With AVX-512 one widening load and a shift: left to the
 * vector extension, GCC split it into 256-bit halves (six instructions where two do), and
 * those conversions were most of the bf16 kernel's time. */
static inline f32x16 load_bf16(const bf16_t *p) {
#ifdef __AVX512F__
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (f32x16)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
    u16x16 raw;
    memcpy(&raw, p, sizeof raw);
    const u32x16 bits = __builtin_convertvector(raw, u32x16) << 16;
    f32x16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

/*
 * Slots go through the score and weighted-sum loops LANES at a time, head by head: a block's
 * key and value rows (LANES slots of every KV head) stay in L1 while each query head reads
 * them, each head's weighted sums stay in registers across the block, and the block's 16
 * scores of a head are summed across their lanes together (sum_lanes16: 15 vector adds and
 * 30 two-source shuffles, where one score at a time took 16 lane extractions and adds). With
 * the widening bf16 load above, a layer's attention over cached rows took 1.1-1.5x less time
 * (grouped-query heads gain most); out of cache, the prefetches (prefetch_rows) count more.
 */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE __builtin_shufflevector
/* r[i] = the sum of v[i]'s lanes: a transposing add tree, halving the lanes per vector. */
static inline f32x16 sum_lanes16(const f32x16 *v) {
    f32x16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* a[i]: v[2i]'s 8 partial sums, then v[2i + 1]'s */
        a[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                       22, 23) +
               SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                       29, 30, 31);
    for (int i = 0; i < 4; i++) /* b[i]: 4 partial sums each of v[4i] .. v[4i + 3] */
        b[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                       26, 27) +
               SHUFFLE(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                       29, 30, 31);
    for (int i = 0; i < 2; i++) /* c[i]: 2 partial sums each of v[8i] .. v[8i + 7] */
        c[i] = SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                       28, 29) +
               SHUFFLE(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26,
                       27, 30, 31);
    return SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else /* compilers without __builtin_shufflevector: one vector at a time */
static inline f32x16 sum_lanes16(const f32x16 *v) {
    f32x16 r;
    for (int i = 0; i < LANES; i++) {
        float total = 0.0f;
        for (int l = 0; l < LANES; l++) total += v[i][l];
        r[i] = total;
    }
    return r;
}
#endif

/*
 * Asks for one KV head's rows at m slots (`bytes` each, rows `slot_bytes` apart) ahead of
 * their use. A decode step's KV rows come from memory (the layers' weights evict them from
 * the caches), 16 slots at scattered places, and the hardware prefetcher does not take one
 * head's 128-byte pieces of 16 rows 1.5 KB apart for a stream. Keys a block ahead, values
 * while the scores are taken, the next row's keys while the current row's values are summed:
 * the 12 layers' attention of a 32-row step of OPT-125M's shape (12 KV heads, 112 tokens of
 * context each, the caches out of cache) took 31 ms against 55 in bf16 and 43 against 62 in
 * fp32, where the step's weights and KV rows were read at a third of the memory's speed.
 */
static inline void prefetch_rows(const void *head, const int64_t *slots, int64_t m,
                                 int64_t slot_bytes, int64_t bytes) {
    for (int64_t i = 0; i < m; i++) {
        const char *row = (const char *)head + slots[i] * slot_bytes;
        for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
    }
}

/*
 * Scores of one row's query heads against its n slots: scores[h * n + j]; query head h
 * reads KV head h / group. Blocks of LANES slots, each query head's 16 dot products summed
 * together (sum_lanes16); head sizes that are not a multiple of LANES go slot by slot.
 */
#define DEFINE_SCORES(NAME, T, LOAD, LOADV)                                                   \
    static void NAME(const float *q, const T *keys, const T *values, const int64_t *slots,   \
                     int64_t n, int64_t kv_heads, int64_t group, int64_t dim,               \
                     int64_t slot_stride, float scale, float *scores) {                      \
        const int64_t row_bytes = slot_stride * (int64_t)sizeof(T);                         \
        const int64_t head_bytes = dim * (int64_t)sizeof(T);                                \
        const int64_t heads = kv_heads * group;                                             \
        if (dim % LANES != 0) {                                                             \
            for (int64_t j = 0; j < n; j++) {                                               \
                const T *row = keys + slots[j] * slot_stride;                               \
                for (int64_t h = 0; h < heads; h++) {                                       \
                    const T *k = row + (h / group) * dim;                                   \
                    const float *qh = q + h * dim;                                          \
                    float acc = 0.0f;                                                       \
                    for (int64_t d = 0; d < dim; d++) acc += qh[d] * LOAD(k[d]);             \
                    scores[h * n + j] = acc * scale;                                        \
                }                                                                           \
            }                                                                               \
            return;                                                                         \
        }                                                                                   \
        for (int64_t j0 = 0; j0 < n; j0 += LANES) {                                         \
            const int64_t m = n - j0 < LANES ? n - j0 : LANES;                              \
            for (int64_t h = 0; h < heads; h++) {                                           \
                const T *head = keys + (h / group) * dim;                                   \
                const float *qh = q + h * dim;                                              \
                if (h % group == 0) { /* the next block's keys, this block's values */     \
                    const int64_t next = n - j0 - LANES;                                    \
                    if (next > 0)                                                           \
                        prefetch_rows(head, slots + j0 + LANES, next < LANES ? next : LANES, \
                                      row_bytes, head_bytes);                               \
                    prefetch_rows(values + (h / group) * dim, slots + j0, m, row_bytes,     \
                                  head_bytes);                                              \
                }                                                                           \
                f32x16 part[LANES];                                                         \
                for (int64_t i = 0; i < m; i++) {                                           \
                    const T *k = head + slots[j0 + i] * slot_stride;                        \
                    f32x16 lanes = {0};                                                     \
                    for (int64_t d = 0; d < dim; d += LANES)                                \
                        lanes += load_f32(qh + d) * LOADV(k + d);                           \
                    part[i] = lanes;                                                        \
                }                                                                           \
                for (int64_t i = m; i < LANES; i++) part[i] = (f32x16){0};                  \
                const f32x16 sums = sum_lanes16(part) * scale;                              \
                memcpy(scores + h * n + j0, &sums, sizeof(float) * (size_t)m);              \
            }                                                                               \
        }                                                                                   \
    }

/*
 * acc[h * dim + d] = sum_j weights[h * n + j] * values[slot_j][h / group][d], in slot order
 * for every (h, d). Blocks of LANES slots, each query head's sums held in registers across
 * the block (four vectors, 64 features, at a time).
 */
#define DEFINE_WEIGHTED_SUM(NAME, T, LOAD, LOADV)                                             \
    static void NAME(const float *weights, const T *values, const int64_t *slots, int64_t n, \
                     int64_t kv_heads, int64_t group, int64_t dim, int64_t slot_stride,     \
                     const T *keys, const int64_t *ahead, int64_t ahead_n, float *acc) {    \
        const int64_t row_bytes = slot_stride * (int64_t)sizeof(T);                         \
        const int64_t heads = kv_heads * group;                                             \
        memset(acc, 0, sizeof(float) * heads * dim);                                        \
        if (dim % LANES != 0) {                                                             \
            for (int64_t j = 0; j < n; j++) {                                               \
                const T *row = values + slots[j] * slot_stride;                             \
                for (int64_t h = 0; h < heads; h++) {                                       \
                    const T *v = row + (h / group) * dim;                                   \
                    const float w = weights[h * n + j];                                     \
                    float *ah = acc + h * dim;                                              \
                    for (int64_t d = 0; d < dim; d++) ah[d] += w * LOAD(v[d]);               \
                }                                                                           \
            }                                                                               \
            return;                                                                         \
        }                                                                                   \
        for (int64_t j0 = 0; j0 < n; j0 += LANES) {                                         \
            const int64_t m = n - j0 < LANES ? n - j0 : LANES;                              \
            for (int64_t h = 0; h < heads; h++) {                                           \
                const T *head = values + (h / group) * dim;                                 \
                const float *w = weights + h * n + j0;                                      \
                if (h % group == 0 && j0 < ahead_n) /* the next row's keys */              \
                    prefetch_rows(keys + (h / group) * dim, ahead + j0,                     \
                                  ahead_n - j0 < LANES ? ahead_n - j0 : LANES, row_bytes,   \
                                  dim * (int64_t)sizeof(T));                                \
                float *ah = acc + h * dim;                                                  \
                int64_t d = 0;                                                              \
                for (; d + 4 * LANES <= dim; d += 4 * LANES) {                              \
                    f32x16 s0 = load_f32(ah + d), s1 = load_f32(ah + d + LANES);            \
                    f32x16 s2 = load_f32(ah + d + 2 * LANES);                               \
                    f32x16 s3 = load_f32(ah + d + 3 * LANES);                               \
                    for (int64_t i = 0; i < m; i++) {                                       \
                        const T *v = head + slots[j0 + i] * slot_stride + d;                \
                        s0 += w[i] * LOADV(v);                                              \
                        s1 += w[i] * LOADV(v + LANES);                                      \
                        s2 += w[i] * LOADV(v + 2 * LANES);                                  \
                        s3 += w[i] * LOADV(v + 3 * LANES);                                  \
                    }                                                                       \
                    memcpy(ah + d, &s0, sizeof s0);                                         \
                    memcpy(ah + d + LANES, &s1, sizeof s1);                                 \
                    memcpy(ah + d + 2 * LANES, &s2, sizeof s2);                             \
                    memcpy(ah + d + 3 * LANES, &s3, sizeof s3);                             \
                }                                                                           \
                for (; d < dim; d += LANES) {                                               \
                    f32x16 s = load_f32(ah + d);                                            \
                    for (int64_t i = 0; i < m; i++)                                         \
                        s += w[i] * LOADV(head + slots[j0 + i] * slot_stride + d);          \
                    memcpy(ah + d, &s, sizeof s);                                           \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_float(x)

DEFINE_SCORES(scores_f32, float, LOAD_F32, load_f32)
DEFINE_SCORES(scores_bf16, bf16_t, LOAD_BF16, load_bf16)
DEFINE_WEIGHTED_SUM(weighted_sum_f32, float, LOAD_F32, load_f32)
DEFINE_WEIGHTED_SUM(weighted_sum_bf16, bf16_t, LOAD_BF16, load_bf16)

/*
 * exp(x) for x <= 0 (a score minus its row's peak), within 2 ulp of expf, written so the
 * compiler vectorises the softmax loop: glibc's vector expf is only offered under
 * -ffast-math, which would also drop NaN and infinity semantics. Cody-Waite reduction
 * x = n ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial of r (Cephes' expf). Below
 * -87.33 the result is 0 (exp underflows fp32); NaN stays NaN.
 */
static inline float exp_nonpositive(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f;
    const float ln2_lo = -2.12194440e-4f;
    const float clamped = x < -87.33f ? -87.33f : x;
    const float n = __builtin_rintf(clamped * log2e);
    const float r = (clamped - n * ln2_hi) - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    const float y = p * scale;
    return x < -87.33f ? 0.0f : (x != x ? x : y);
}

/*
 * tanh(x) within a few ulp, written to vectorise as exp_nonpositive is (a scalar tanhf per
 * score made Gemma 2's soft-capped decode step 3x slower at batch 32): Cephes' tanhf, an odd
 * polynomial below |x| = 0.625, above it (1 - e) / (1 + e) with e = exp(-2|x|), where no
 * cancellation is left. NaN stays NaN.
 */
static inline float tanh_vectorisable(float x) {
    const float size = x < 0.0f ? -x : x;
    const float z = x * x;
    const float small =
        ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
          1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
    const float e = exp_nonpositive(-2.0f * size);
    const float large = (1.0f - e) / (1.0f + e);
    return size < 0.625f ? small : (x < 0.0f ? -large : large);
}

/* Gemma 2's soft-cap of n scores in place: s -> softcap * tanh(s / softcap), as HF's. */
static void soft_cap(float *scores, int64_t n, float softcap) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) scores[j] = tanh_vectorisable(scores[j] / softcap) * softcap;
}

/* Softmax of each of `heads` rows of n scores, in place: each row then sums to 1. */
static void softmax_rows(float *scores, int64_t heads, int64_t n) {
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * n;
        float peak = -INFINITY;
#pragma omp simd reduction(max : peak)
        for (int64_t j = 0; j < n; j++) peak = s[j] > peak ? s[j] : peak;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < n; j++) {
            const float e = exp_nonpositive(s[j] - peak);
            s[j] = e;
            total += e;
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < n; j++) s[j] *= inv;
    }
}

/*
 * dtype: 0 = float32, 1 = bfloat16 (queries, caches and out alike).
 * Returns 0, or -1 when a scratch buffer cannot be allocated (nothing is written then).
 */
int quanta_paged_decode(void *out, const void *queries, const void *key_cache,
                        const void *value_cache, const int64_t *slots, const int64_t *bounds,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t slot_stride, float scale, int64_t window, float softcap,
                        int dtype) {
    const int64_t group = heads / kv_heads;
    int64_t longest = 0;
    for (int64_t b = 0; b < rows; b++) {
        const int64_t n = bounds[b + 1] - bounds[b];
        longest = n > longest ? n : longest;
    }
    longest = window > 0 && window < longest ? window : longest;
    float *scores = malloc(sizeof(float) * (size_t)(heads * (longest > 0 ? longest : 1)));
    float *q = malloc(sizeof(float) * (size_t)(heads * dim));
    float *acc = malloc(sizeof(float) * (size_t)(heads * dim));
    if (scores == NULL || q == NULL || acc == NULL) {
        free(scores);
        free(q);
        free(acc);
        return -1;
    }
    for (int64_t b = 0; b < rows; b++) {
        const int64_t total = bounds[b + 1] - bounds[b];
        const int64_t n = window > 0 && window < total ? window : total;
        const int64_t *row_slots = slots + bounds[b + 1] - n;
        int64_t ahead_n = 0; /* the next row's slots, whose keys the weighted sum prefetches */
        if (b + 1 < rows) {
            const int64_t next = bounds[b + 2] - bounds[b + 1];
            ahead_n = window > 0 && window < next ? window : next;
        }
        const int64_t *ahead = b + 1 < rows ? slots + bounds[b + 2] - ahead_n : slots;
        const int64_t first = b * heads * dim; /* the row's query and output offset */
        for (int64_t i = 0; i < heads * dim; i++) {
            q[i] = dtype == 0 ? ((const float *)queries)[first + i]
                              : bf16_to_float(((const bf16_t *)queries)[first + i]);
        }
        if (n == 0) {
            memset(acc, 0, sizeof(float) * heads * dim);
        } else if (dtype == 0) {
            scores_f32(q, key_cache, value_cache, row_slots, n, kv_heads, group, dim, slot_stride,
                       scale, scores);
            if (softcap > 0.0f) soft_cap(scores, heads * n, softcap);
            softmax_rows(scores, heads, n);
            weighted_sum_f32(scores, value_cache, row_slots, n, kv_heads, group, dim,
                             slot_stride, key_cache, ahead, ahead_n, acc);
        } else {
            scores_bf16(q, key_cache, value_cache, row_slots, n, kv_heads, group, dim,
                        slot_stride, scale, scores);
            if (softcap > 0.0f) soft_cap(scores, heads * n, softcap);
            softmax_rows(scores, heads, n);
            weighted_sum_bf16(scores, value_cache, row_slots, n, kv_heads, group, dim,
                              slot_stride, key_cache, ahead, ahead_n, acc);
        }
        for (int64_t i = 0; i < heads * dim; i++) {
            if (dtype == 0) {
                ((float *)out)[first + i] = acc[i];
            } else {
                ((bf16_t *)out)[first + i] = float_to_bf16(acc[i]);
            }
        }
    }
    free(scores);
    free(q);
    free(acc);
    return 0;
}
