/* Residual add + RMSNorm and the rotary embedding of a decoder layer, each one call instead of
 * a chain of torch operators: at batch 1 a chain of 8 operators on a 576-wide row costs its dispatch, not its
 * arithmetic.
 *
 * Every function rounds where HF transformers' eager model rounds (dtype 0: fp32, nothing to
 * round; dtype 1: bf16, round-to-nearest-even after each operation torch runs in bf16), so a
 * bf16 model takes the same values through the same roundings. Built without FMA contraction
 * (-ffp-contract=off): a fused multiply-add would skip a rounding HF makes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return 0x7FC0;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Round f to the element type (bf16 keeps 8 bits of mantissa; fp32 is already there). */
static inline float round_to(float f, int dtype) {
    return dtype ? bf16_to_float(float_to_bf16(f)) : f;
}

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* out = weight * (s * rsqrt(mean(s^2) + eps)) per row, where s = residual + x when x is given
 * (and s is written back to residual), else s = residual. */
void quanta_add_rms_norm(void *out, void *residual, const void *x, const void *weight,
                         int64_t rows, int64_t dim, float eps, int dtype) {
    float s[dim];
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * dim;
        for (int64_t i = 0; i < dim; i++) {
            float v = load(residual, base + i, dtype);
            if (x) {
                v = round_to(v + load(x, base + i, dtype), dtype);
                store(residual, base + i, v, dtype);
            }
            s[i] = v;
        }
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < dim; i++) acc += s[i] * s[i];
        float inv = 1.0f / sqrtf(acc / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) {
            float h = round_to(s[i] * inv, dtype);
            store(out, base + i, load(weight, i, dtype) * h, dtype);
        }
    }
}

/* Rotary embedding in place on the first `heads` heads of each row (q's, then k's):
 * x * cos + rotate_half(x) * sin, with cos and sin [rows, head_dim] in the element type. */
void quanta_rope(void *x, const void *cos_t, const void *sin_t, int64_t rows, int64_t heads,
                 int64_t head_dim, int64_t row_stride, int dtype) {
    int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            int64_t base = r * row_stride + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                float x1 = load(x, base + i, dtype), x2 = load(x, base + i + half, dtype);
                float lo = round_to(x1 * load(cos_t, t + i, dtype), dtype) +
                           round_to(-x2 * load(sin_t, t + i, dtype), dtype);
                float hi = round_to(x2 * load(cos_t, t + i + half, dtype), dtype) +
                           round_to(x1 * load(sin_t, t + i + half, dtype), dtype);
                store(x, base + i, lo, dtype);
                store(x, base + i + half, hi, dtype);
            }
        }
    }
}
