/* Residual add + RMSNorm (LLaMA's and Gemma's) or LayerNorm, the rotary embedding, SiLU * up,
 * GELU(tanh) * up and ReLU of a decoder layer, and the store of a step's K/V, each one call
 * instead of a chain of torch operators: at batch 1 a chain of 8 operators on a 576-wide row costs its dispatch, not its
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

#if defined(__AVX512F__) && !defined(QUANTA_NO_LIBMVEC)
#include <immintrin.h>
/* glibc's vector expf (libmvec, within 1 ulp in the tests here, as torch's Sleef expf is). */
__m512 _ZGVeN16v_expf(__m512);
#define QUANTA_VECTOR_EXP 1
#else
#define QUANTA_VECTOR_EXP 0
#endif

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

/* s = one row of the residual stream: residual + x, rounded to the dtype and written back to
 * residual, when x is given, else residual as it is. Every norm below starts from it. */
static void residual_row(float *s, void *residual, const void *x, int64_t base, int64_t dim,
                         int dtype) {
    for (int64_t i = 0; i < dim; i++) {
        float v = load(residual, base + i, dtype);
        if (x) {
            v = round_to(v + load(x, base + i, dtype), dtype);
            store(residual, base + i, v, dtype);
        }
        s[i] = v;
    }
}

/* 1 / sqrt(mean(s^2) + eps): both RMSNorms' scale of a row. */
static float inv_rms(const float *s, int64_t dim, float eps) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < dim; i++) acc += s[i] * s[i];
    return 1.0f / sqrtf(acc / (float)dim + eps);
}

/* out = weight * (s * rsqrt(mean(s^2) + eps)) per row, where s = residual + x when x is given
 * (and s is written back to residual), else s = residual. */
void quanta_add_rms_norm(void *out, void *residual, const void *x, const void *weight,
                         int64_t rows, int64_t dim, float eps, int dtype) {
    float s[dim];
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * dim;
        residual_row(s, residual, x, base, dim, dtype);
        float inv = inv_rms(s, dim, eps);
        for (int64_t i = 0; i < dim; i++) {
            float h = round_to(s[i] * inv, dtype);
            store(out, base + i, load(weight, i, dtype) * h, dtype);
        }
    }
}

/* Gemma's RMSNorm: out = (s * rsqrt(mean(s^2) + eps)) * (offset + weight), all in fp32 and
 * rounded once, where LLaMA's rounds the normalised row before the weight; s as above. */
void quanta_add_rms_norm_offset(void *out, void *residual, const void *x, const void *weight,
                                int64_t rows, int64_t dim, float eps, float offset, int dtype) {
    float s[dim];
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * dim;
        residual_row(s, residual, x, base, dim, dtype);
        float inv = inv_rms(s, dim, eps);
        for (int64_t i = 0; i < dim; i++)
            store(out, base + i, (s[i] * inv) * (offset + load(weight, i, dtype)), dtype);
    }
}

/* LayerNorm with bias: out = (s - mean) * rsqrt(var + eps) * weight + bias in fp32, rounded
 * once (torch's layer_norm keeps bf16 rows in fp32 throughout); s as above. */
void quanta_add_layer_norm(void *out, void *residual, const void *x, const void *weight,
                           const void *bias, int64_t rows, int64_t dim, float eps, int dtype) {
    float s[dim];
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * dim;
        residual_row(s, residual, x, base, dim, dtype);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += s[i];
        const float mean = sum / (float)dim;
        float var = 0.0f;
#pragma omp simd reduction(+ : var)
        for (int64_t i = 0; i < dim; i++) var += (s[i] - mean) * (s[i] - mean);
        const float inv = 1.0f / sqrtf(var / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) {
            float h = (s[i] - mean) * inv * load(weight, i, dtype);
            store(out, base + i, bias ? h + load(bias, i, dtype) : h, dtype);
        }
    }
}

/* ReLU in place on [rows, dim] (OPT's MLP): max(x, 0), NaN kept, as torch's relu. */
void quanta_relu_(void *x, int64_t rows, int64_t dim, int dtype) {
    for (int64_t i = 0; i < rows * dim; i++) {
        const float v = load(x, i, dtype);
        if (v < 0.0f) store(x, i, 0.0f, dtype);
    }
}

int quanta_silu_mul_available(void) { return QUANTA_VECTOR_EXP; }

#if QUANTA_VECTOR_EXP
/* 16 elements as fp32 (lanes outside m read as 0). */
static inline __m512 vload(const void *p, int64_t i, __mmask16 m, int dtype) {
    if (!dtype) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

/* bf16 bits of v, round-to-nearest-even (NaN stays a quiet NaN), in the low 16 of each lane. */
static inline __m512i vbf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

static inline __m512 vround(__m512 v, int dtype) {
    return dtype ? _mm512_castsi512_ps(_mm512_slli_epi32(vbf16(v), 16)) : v;
}

static inline void vstore(void *p, int64_t i, __mmask16 m, __m512 v, int dtype) {
    if (!dtype)
        _mm512_mask_storeu_ps((float *)p + i, m, v);
    else
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(vbf16(v)));
}
#endif

/* out [rows, inner] = silu(gate) * up of gate_up [rows, 2 * inner] (gate's columns, then
 * up's): silu(g) = g / (1 + exp(-g)) in fp32, rounded to the element type, times up, rounded
 * again, as torch's F.silu and mul round. Vectorised through libmvec's expf: a scalar expf
 * loop was slower than torch's four operators. */
void quanta_silu_mul(void *out, const void *gate_up, int64_t rows, int64_t inner, int dtype) {
#if QUANTA_VECTOR_EXP
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in = r * 2 * inner, at = r * inner;
        for (int64_t i = 0; i < inner; i += 16) {
            const int64_t n = inner - i < 16 ? inner - i : 16;
            const __mmask16 m = (__mmask16)((1u << n) - 1);
            __m512 g = vload(gate_up, in + i, m, dtype), u = vload(gate_up, in + inner + i, m, dtype);
            __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
            __m512 h = vround(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), dtype);
            vstore(out, at + i, m, _mm512_mul_ps(h, u), dtype);
        }
    }
#else
    (void)out, (void)gate_up, (void)rows, (void)inner, (void)dtype;
#endif
}

/* out [rows, inner] = gelu_tanh(gate) * up of gate_up [rows, 2 * inner] (Gemma's GeGLU):
 * gelu_tanh(g) = (0.5 g) * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 g^3), in torch's
 * order in fp32, rounded to the element type, times up, rounded again. tanh(u) is
 * sign(u) * (1 - 2 / (exp(2|u|) + 1)) through libmvec's expf (as SiLU * up's exp): accurate
 * near -1 too, so 1 + tanh(u) is 0 exactly where an fp32 tanh rounds to -1, as torch's is. */
void quanta_gelu_tanh_mul(void *out, const void *gate_up, int64_t rows, int64_t inner,
                          int dtype) {
#if QUANTA_VECTOR_EXP
    const __m512 beta = _mm512_set1_ps(0.7978845608028654f), kappa = _mm512_set1_ps(0.044715f);
    const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
    const __m512 half = _mm512_set1_ps(0.5f), sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in = r * 2 * inner, at = r * inner;
        for (int64_t i = 0; i < inner; i += 16) {
            const int64_t n = inner - i < 16 ? inner - i : 16;
            const __mmask16 m = (__mmask16)((1u << n) - 1);
            __m512 g = vload(gate_up, in + i, m, dtype), u = vload(gate_up, in + inner + i, m, dtype);
            __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
            __m512 arg = _mm512_mul_ps(beta, _mm512_add_ps(g, _mm512_mul_ps(kappa, cube)));
            __m512 size = _mm512_abs_ps(arg);
            __m512 e = _ZGVeN16v_expf(_mm512_add_ps(size, size));
            __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
            t = _mm512_xor_ps(t, _mm512_and_ps(arg, sign));
            __m512 h = _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, t));
            vstore(out, at + i, m, _mm512_mul_ps(vround(h, dtype), u), dtype);
        }
    }
#else
    (void)out, (void)gate_up, (void)rows, (void)inner, (void)dtype;
#endif
}

/* Rotary embedding in place on the first `heads` heads of each row (q's, then k's), heads
 * `head_stride` elements apart, the first `head_dim` features of each (all of it, or a partial
 * rotation's share): x * cos + rotate_half(x) * sin, with cos and sin [rows, head_dim] in the
 * element type. */
static __attribute__((unused)) void rope_scalar(void *x, const void *cos_t, const void *sin_t,
                                                int64_t rows, int64_t heads, int64_t head_dim,
                                                int64_t head_stride, int64_t row_stride,
                                                int dtype) {
    int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            int64_t base = r * row_stride + h * head_stride;
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

/* Rotary embedding in place, as rope_scalar above.
 * 16 lanes at a time where the CPU has AVX-512 (the same roundings, in the same order, as
 * the scalar loop: each product rounded, then their sum on the store); a prefill of 768
 * rows took 2.8 ms through the scalar loop against torch's 1.2 ms. */
void quanta_rope(void *x, const void *cos_t, const void *sin_t, int64_t rows, int64_t heads,
                 int64_t head_dim, int64_t head_stride, int64_t row_stride, int dtype) {
#if QUANTA_VECTOR_EXP
    const int64_t half = head_dim / 2;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r * head_dim;
        for (int64_t i = 0; i < half; i += 16) {
            const int64_t n = half - i < 16 ? half - i : 16;
            const __mmask16 m = (__mmask16)((1u << n) - 1);
            const __m512 c_lo = vload(cos_t, t + i, m, dtype), s_lo = vload(sin_t, t + i, m, dtype);
            const __m512 c_hi = vload(cos_t, t + i + half, m, dtype);
            const __m512 s_hi = vload(sin_t, t + i + half, m, dtype);
            for (int64_t h = 0; h < heads; h++) {
                const int64_t base = r * row_stride + h * head_stride;
                const __m512 x1 = vload(x, base + i, m, dtype), x2 = vload(x, base + i + half, m, dtype);
                const __m512 lo = _mm512_add_ps(vround(_mm512_mul_ps(x1, c_lo), dtype),
                                                vround(_mm512_mul_ps(_mm512_xor_ps(x2, sign), s_lo), dtype));
                const __m512 hi = _mm512_add_ps(vround(_mm512_mul_ps(x2, c_hi), dtype),
                                                vround(_mm512_mul_ps(x1, s_hi), dtype));
                vstore(x, base + i, m, lo, dtype);
                vstore(x, base + i + half, m, hi, dtype);
            }
        }
    }
#else
    rope_scalar(x, cos_t, sin_t, rows, heads, head_dim, head_stride, row_stride, dtype);
#endif
}

/* A step's keys and values into the paged cache: row r of k (and of v), `width` elements of
 * `size` bytes at k + r * k_stride elements, to cache row slots[r] of kc (and vc). torch's
 * index_copy_ of the strided K/V views (columns of the fused qkv product) took 2.5 ms a
 * layer for an OPT-125M prefill of 3072 rows. Every slot is checked against `slot_count`
 * before anything is written: returns the first row whose slot is out of range, or -1. */
int64_t quanta_store_kv(void *kc, void *vc, const void *k, const void *v, const int64_t *slots,
                        int64_t rows, int64_t slot_count, int64_t width, int64_t k_stride,
                        int64_t v_stride, int64_t size) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= slot_count) return r;
    const size_t bytes = (size_t)(width * size);
    for (int64_t r = 0; r < rows; r++) {
        memcpy((char *)kc + slots[r] * (int64_t)bytes, (const char *)k + r * k_stride * size,
               bytes);
        memcpy((char *)vc + slots[r] * (int64_t)bytes, (const char *)v + r * v_stride * size,
               bytes);
    }
    return -1;
}
