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

static inline f32x16 load_bf16(const bf16_t *p) {
    u16x16 raw;
    memcpy(&raw, p, sizeof raw);
    const u32x16 bits = __builtin_convertvector(raw, u32x16) << 16;
    f32x16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline float lane_sum(f32x16 v) {
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += v[i];
    return total;
}

/*
 * Scores of one row's query heads against its n slots: scores[h * n + j]. Slot by slot, every
 * KV head of the slot's key row in turn, so the row's context is read front to back once
 * (a block is block_size contiguous key rows); query head h reads KV head h / group.
 */
#define DEFINE_SCORES(NAME, T, LOAD, LOADV)                                                   \
    static void NAME(const float *q, const T *keys, const int64_t *slots, int64_t n,         \
                     int64_t kv_heads, int64_t group, int64_t dim, int64_t slot_stride,     \
                     float scale, float *scores) {                                           \
        const int vector = dim % LANES == 0;                                                \
        for (int64_t j = 0; j < n; j++) {                                                   \
            const T *row = keys + slots[j] * slot_stride;                                   \
            for (int64_t kvh = 0; kvh < kv_heads; kvh++) {                                  \
                const T *k = row + kvh * dim;                                               \
                for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {                 \
                    const float *qh = q + h * dim;                                          \
                    float acc = 0.0f;                                                       \
                    if (vector) {                                                           \
                        f32x16 lanes = {0};                                                 \
                        for (int64_t d = 0; d < dim; d += LANES)                            \
                            lanes += load_f32(qh + d) * LOADV(k + d);                       \
                        acc = lane_sum(lanes);                                              \
                    } else {                                                                \
                        for (int64_t d = 0; d < dim; d++) acc += qh[d] * LOAD(k[d]);         \
                    }                                                                       \
                    scores[h * n + j] = acc * scale;                                        \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }

/* acc[h * dim + d] = sum_j weights[h * n + j] * values[slot_j][h / group][d], slot by slot */
#define DEFINE_WEIGHTED_SUM(NAME, T, LOAD, LOADV)                                             \
    static void NAME(const float *weights, const T *values, const int64_t *slots, int64_t n, \
                     int64_t kv_heads, int64_t group, int64_t dim, int64_t slot_stride,     \
                     float *acc) {                                                           \
        const int vector = dim % LANES == 0;                                                \
        memset(acc, 0, sizeof(float) * kv_heads * group * dim);                             \
        for (int64_t j = 0; j < n; j++) {                                                   \
            const T *row = values + slots[j] * slot_stride;                                 \
            for (int64_t kvh = 0; kvh < kv_heads; kvh++) {                                  \
                const T *v = row + kvh * dim;                                               \
                for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {                 \
                    const float w = weights[h * n + j];                                     \
                    float *ah = acc + h * dim;                                              \
                    if (vector) {                                                           \
                        for (int64_t d = 0; d < dim; d += LANES) {                          \
                            const f32x16 sum = load_f32(ah + d) + w * LOADV(v + d);        \
                            memcpy(ah + d, &sum, sizeof sum);                               \
                        }                                                                   \
                    } else {                                                                \
                        for (int64_t d = 0; d < dim; d++) ah[d] += w * LOAD(v[d]);           \
                    }                                                                       \
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
        const int64_t first = b * heads * dim; /* the row's query and output offset */
        for (int64_t i = 0; i < heads * dim; i++) {
            q[i] = dtype == 0 ? ((const float *)queries)[first + i]
                              : bf16_to_float(((const bf16_t *)queries)[first + i]);
        }
        if (n == 0) {
            memset(acc, 0, sizeof(float) * heads * dim);
        } else if (dtype == 0) {
            scores_f32(q, key_cache, row_slots, n, kv_heads, group, dim, slot_stride, scale,
                       scores);
            if (softcap > 0.0f) soft_cap(scores, heads * n, softcap);
            softmax_rows(scores, heads, n);
            weighted_sum_f32(scores, value_cache, row_slots, n, kv_heads, group, dim,
                             slot_stride, acc);
        } else {
            scores_bf16(q, key_cache, row_slots, n, kv_heads, group, dim, slot_stride, scale,
                        scores);
            if (softcap > 0.0f) soft_cap(scores, heads * n, softcap);
            softmax_rows(scores, heads, n);
            weighted_sum_bf16(scores, value_cache, row_slots, n, kv_heads, group, dim,
                              slot_stride, acc);
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
