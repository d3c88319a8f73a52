/*
 * Prefill attention on AMX tiles, read in place from the paged KV cache: one chunk of query
 * rows (a prompt, or the uncached rest of one) against every key up to each row's own
 * position, in bf16.
 *
 * Why a hand-written kernel: torch's CPU flash attention runs bf16 products at about 130
 * GFLOP/s on one core, and a chunk that starts past position 0 (a cached prefix, a second
 * chunk) needs an explicit mask it turns into floats on every call, over a context it first
 * gathers out of the paged cache. Attention was then 52-60% of a cached-prefix prefill of
 * SmolLM2 (docs/prefix-caching.md). Here the scores and the weighted sums run on AMX tiles,
 * the causal bound is implicit (key groups past a tile's last row are never computed), the
 * keys are read from their blocks as they lie, and each KV head's values are transposed once
 * per call.
 *
 * A sliding window (`window` > 0) lets a row see only its last `window` positions, itself
 * included; key groups wholly before every row of a tile's window are never computed. A
 * soft-cap (`softcap` > 0, Gemma 2) maps each scaled score s to softcap * tanh(s / softcap)
 * in fp32, as HF does, before the mask. Without them the torch path these layers took ran
 * HF's eager sequence (an einsum, tanh, mask, softmax and einsum per head group in bf16), 60%
 * of a Gemma 2 prefill.
 *
 * Layout: q and out [T, H, D] (rows q_stride and out_stride elements apart, heads D apart);
 * caches [slots, KVH, D] with rows `slot_stride` elements apart; key position p of the chunk's
 * context lives in slot block_ids[p / block_size] * block_size + p % block_size. The chunk's
 * row i is position start + i and sees keys 0 .. start + i. Grouped-query: head h reads KV
 * head h / (H / KVH).
 *
 * Numerics: scores are exact fp32 sums of bf16 products (the tiles accumulate in fp32), the
 * softmax runs online in fp32 over groups of 64 keys (exp by a polynomial within 2e-7), and
 * each group's probabilities are rounded once to bf16 for the product with V, as torch's
 * bf16 flash attention does. A row's
 * result depends only on its own position and context, never on where its chunk starts or
 * which rows share its tile: a key group past a row's position adds exactly zero to it. So a
 * prompt gives the same bits whether it was prefilled whole, in chunks, or after a cached
 * prefix.
 *
 * Built at run time by quanta.runner.native_prefill (-O3 -march=native). Where the compiler
 * does not see AMX, or Linux refuses this process the tile state, `quanta_prefill_init`
 * says 0 and the engine keeps SDPA. Single-threaded, as the decode kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define QUANTA_AMX 1
#else
#define QUANTA_AMX 0
#endif

#define KEYS 64     /* keys per group: four tiles of scores, two of probabilities */
#define ROWS 16     /* query rows per tile */
#define MAX_DIM 256 /* head sizes the scratch rows are sized for */

static int amx_ready = 0;

/* Asks Linux for the AMX tile state (off for a process until asked); 1 when the kernel runs. */
int quanta_prefill_init(void) {
#if QUANTA_AMX
    amx_ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
    return amx_ready;
}

#if QUANTA_AMX
/* Every tile is 16 rows x 64 bytes. The products run transposed, with the chunk's queries as
 * the 16 columns: S^T = K Q^T (keys as rows) and O^T = V^T P^T (head columns as rows), so
 * each query's online softmax lives in one lane of a vector, and the cache's key rows are
 * the A operand as they lie. For a group of 64 keys: tiles 0-3 take its scores (16 keys
 * each, fp32), and later 32 of O^T's rows at a time; 4 takes key rows or rows of V^T; 5 the
 * queries' columns as column pairs x queries; 6 and 7 the probabilities as key pairs x
 * queries (bf16). The scores of the next group are computed between the vector stores of
 * this group's probabilities and the tile loads that read them: a tile load right after
 * vector stores to the same lines waits for them to drain (it was 27% of the kernel). */
static void configure_tiles(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    /* ldtilecfg reads the struct behind the compiler's back: keep the stores above. */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* 2^t for t <= 0 in 16 lanes: t = n + f with n an integer and |f| <= 1/2, 2^f by a degree-5
 * polynomial fitted with its constant fixed at 1 (relative error 1.8e-7, about fp32's own
 * step), then scaled by 2^n; below -126, and for -inf, exactly 0. 2^0 is exactly 1, so a
 * group a query sees none of leaves its sums untouched (alpha 1, probabilities 0): that is
 * what makes a row's bits independent of its chunk. The scores are kept in log2 units
 * (scaled by log2 e), so the argument is one fused multiply-add. */
static inline __m512 exp2_16(__m512 t) {
    const __mmask16 kept = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    const __m512 c = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(c, n);
    __m512 p = _mm512_set1_ps(1.326769358e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671513923e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550723523e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402224243e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470037e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f)); /* exactly 1 at f = 0: see below */
    return _mm512_maskz_scalef_ps(kept, p, n);
}

/* tanh of 16 lanes within a few ulp, as the decode kernel's tanh_vectorisable (Cephes'
 * tanhf): an odd polynomial below |x| = 0.625, above it (1 - e) / (1 + e) with
 * e = exp(-2|x|), where no cancellation is left; tanh(+-inf) is +-1. */
static inline __m512 tanh_16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 size = _mm512_abs_ps(x);
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    const __m512 e = exp2_16(_mm512_mul_ps(size, _mm512_set1_ps(-2.0f * 1.44269504088896341f)));
    const __m512 large = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 sign = _mm512_and_ps(x, _mm512_set1_ps(-0.0f));
    const __mmask16 near_zero = _mm512_cmp_ps_mask(size, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(near_zero, _mm512_or_ps(large, sign), small);
}

/* One KV head's V^T, a group of KEYS keys at a time: vt[(g * dim + d) * KEYS + k] is
 * column d of key KEYS g + k, zero past the context's end; groups before `from` (no row's
 * window reaches them) are left unwritten. */
static void pack_values(uint16_t *vt, const uint16_t *values, const int64_t *block_ids,
                        int64_t block_size, int64_t context, int64_t groups, int64_t from,
                        int64_t dim, int64_t slot_stride, int64_t kvh) {
    const int64_t tail = context % KEYS;
    if (tail) {
        for (int64_t d = 0; d < dim; d++) {
            memset(vt + ((groups - 1) * dim + d) * KEYS + tail, 0, sizeof(uint16_t) * (KEYS - tail));
        }
    }
    for (int64_t p = from * KEYS; p < context; p++) {
        const int64_t slot = block_ids[p / block_size] * block_size + p % block_size;
        const uint16_t *v = values + slot * slot_stride + kvh * dim;
        uint16_t *col = vt + (p / KEYS) * dim * KEYS + p % KEYS;
        for (int64_t d = 0; d < dim; d++) col[d * KEYS] = v[d];
    }
}

/* Scores of 16 keys from position p (rows of tile T) against every column chunk of the
 * queries. */
#define SCORES(T, p)                                                                          \
    do {                                                                                      \
        const uint16_t *k = keys + (block_ids[(p) / block_size] * block_size +                \
                                    (p) % block_size) * slot_stride + kvh * dim;              \
        for (int64_t c = 0; c < chunks; c++) {                                                \
            _tile_loadd(5, qt + c * 256, 64);                                                 \
            _tile_loadd(4, k + c * 32, slot_stride * 2);                                      \
            _tile_dpbf16ps(T, 4, 5);                                                          \
        }                                                                                     \
    } while (0)

/* Group g's scores (keys up to `last` only) into st: 64 keys x 16 queries, fp32. */
#define GROUP_SCORES(g, st)                                                                   \
    do {                                                                                      \
        const int64_t p0 = (g) * KEYS;                                                        \
        _tile_zero(0);                                                                        \
        _tile_zero(1);                                                                        \
        _tile_zero(2);                                                                        \
        _tile_zero(3);                                                                        \
        SCORES(0, p0);                                                                        \
        if (p0 + 16 <= last) SCORES(1, p0 + 16);                                              \
        if (p0 + 32 <= last) SCORES(2, p0 + 32);                                              \
        if (p0 + 48 <= last) SCORES(3, p0 + 48);                                              \
        _tile_stored(0, (st), 64);                                                            \
        _tile_stored(1, (st) + 256, 64);                                                      \
        _tile_stored(2, (st) + 512, 64);                                                      \
        _tile_stored(3, (st) + 768, 64);                                                      \
    } while (0)

/* Queries [i0, i0 + m) of head h (the tile's 16 columns, zero past m) against their context;
 * keys are read in place from the cache, whose blocks hold a multiple of 16 keys. */
static void attend_tile(uint16_t *out, const uint16_t *q, const uint16_t *keys,
                        const uint16_t *vt, const int64_t *block_ids, int64_t block_size,
                        int64_t i0, int64_t m, int64_t h, int64_t kvh, int64_t start,
                        int64_t dim, int64_t q_stride, int64_t out_stride, int64_t slot_stride,
                        float scale, int64_t window, float softcap) {
    uint32_t qt[MAX_DIM / 2 * 16] __attribute__((aligned(64))); /* column pairs x queries */
    uint16_t pt[KEYS / 2 * 32] __attribute__((aligned(64)));    /* key pairs x queries */
    float st[2][KEYS * 16] __attribute__((aligned(64)));        /* keys x queries */
    float ot[MAX_DIM * 16] __attribute__((aligned(64)));        /* columns x queries */
    float blk[32 * 16] __attribute__((aligned(64)));
    const int64_t chunks = dim / 32;
    memset(qt, 0, sizeof(uint32_t) * (dim / 2) * 16);
    memset(ot, 0, sizeof(float) * dim * 16);
    for (int64_t n = 0; n < m; n++) {
        const uint32_t *row = (const uint32_t *)(q + (i0 + n) * q_stride + h * dim);
        for (int64_t r = 0; r < dim / 2; r++) qt[r * 16 + n] = row[r];
    }
    /* Each query's position and its window's first key (0 without a window); a padding
     * column's result is dropped, whatever it sees. */
    int32_t where[16], from[16];
    for (int n = 0; n < 16; n++) {
        where[n] = n < m ? (int32_t)(start + i0 + n) : INT32_MAX;
        from[n] = window > 0 && where[n] - window + 1 > 0 ? (int32_t)(where[n] - window + 1) : 0;
    }
    const __m512i position = _mm512_loadu_si512(where);
    const __m512i earliest = _mm512_loadu_si512(from);
    const __m512i pair_order = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    /* Soft-capped scores are scaled as they are capped; the exponent's factor is then log2 e. */
    const __m512 vscale = _mm512_set1_ps((softcap > 0.0f ? 1.0f : scale) * 1.44269504088896341f);
    const __m512 cap = _mm512_set1_ps(softcap), into_cap = _mm512_set1_ps(scale / softcap);
    const __m512 hidden = _mm512_set1_ps(-INFINITY);
    __m512 peak = hidden, total = _mm512_setzero_ps();
    const int64_t first = start + i0, last = start + i0 + m - 1;
    const int64_t groups = last / KEYS + 1;
    /* The first group any row's window reaches; a row's groups before its own window's, and
     * after its position, are wholly masked and add exactly nothing to it (see exp2_16). */
    const int64_t g0 = window > 0 && first - window + 1 > 0 ? (first - window + 1) / KEYS : 0;
    const int64_t last_from = window > 0 ? last - window + 1 : 0;
    GROUP_SCORES(g0, st[g0 & 1]);
    for (int64_t g = g0; g < groups; g++) {
        float *sg = st[g & 1];
        const int64_t p0 = g * KEYS;
        __m512 top = hidden;
        if (softcap > 0.0f) { /* before the mask: tanh would turn a hidden -inf into -softcap */
            for (int k = 0; k < KEYS; k++) {
                const __m512 s = _mm512_mul_ps(_mm512_load_ps(sg + k * 16), into_cap);
                _mm512_store_ps(sg + k * 16, _mm512_mul_ps(cap, tanh_16(s)));
            }
        }
        if (p0 + KEYS - 1 > first || p0 < last_from) { /* some query sees only some keys */
            for (int k = 0; k < KEYS; k++) {
                const __m512i key = _mm512_set1_epi32((int32_t)(p0 + k));
                const __mmask16 seen = _mm512_cmp_epi32_mask(key, position, _MM_CMPINT_LE) &
                                       _mm512_cmp_epi32_mask(key, earliest, _MM_CMPINT_NLT);
                const __m512 sk = _mm512_mask_mov_ps(hidden, seen, _mm512_load_ps(sg + k * 16));
                _mm512_store_ps(sg + k * 16, sk);
                top = _mm512_max_ps(top, sk);
            }
        } else {
            for (int k = 0; k < KEYS; k++) top = _mm512_max_ps(top, _mm512_load_ps(sg + k * 16));
        }
        /* In log2 units: t = score * scale * log2(e); the scale is positive, so the peak of
         * the raw scores is the peak of t. */
        const __m512 next = _mm512_max_ps(peak, _mm512_mul_ps(top, vscale));
        const __m512 alpha = exp2_16(_mm512_sub_ps(peak, next)); /* 0 while peak is -inf */
        peak = next;
        __m512 sum = _mm512_setzero_ps();
        for (int k = 0; k < KEYS; k += 2) {
            const __m512 a = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(sg + k * 16), vscale, next));
            const __m512 b = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(sg + k * 16 + 16), vscale, next));
            sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            _mm512_store_si512((__m512i *)(pt + (k / 2) * 32), _mm512_permutexvar_epi16(pair_order, both));
        }
        total = _mm512_fmadd_ps(total, alpha, sum);
        if (g + 1 < groups) GROUP_SCORES(g + 1, st[(g + 1) & 1]);
        _tile_loadd(6, pt, 64);
        _tile_loadd(7, pt + 16 * 32, 64);
        for (int64_t d0 = 0; d0 < dim; d0 += 32) {
            const uint16_t *a = vt + (g * dim + d0) * KEYS;
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(4, a, KEYS * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(4, a + 32, KEYS * 2);
            _tile_dpbf16ps(0, 4, 7);
            _tile_loadd(4, a + 16 * KEYS, KEYS * 2);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(4, a + 16 * KEYS + 32, KEYS * 2);
            _tile_dpbf16ps(1, 4, 7);
            _tile_stored(0, blk, 64);
            _tile_stored(1, blk + 256, 64);
            for (int64_t d = 0; d < 32; d++) {
                float *o = ot + (d0 + d) * 16;
                _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), alpha, _mm512_load_ps(blk + d * 16)));
            }
        }
    }
    float inv[16] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
    for (int64_t d = 0; d < dim; d += 16) { /* 16 columns of every query at once */
        for (int64_t n = 0; n < m; n++) {
            uint16_t *o = out + (i0 + n) * out_stride + h * dim + d;
            const __m512 col = _mm512_set_ps(
                ot[(d + 15) * 16 + n], ot[(d + 14) * 16 + n], ot[(d + 13) * 16 + n], ot[(d + 12) * 16 + n],
                ot[(d + 11) * 16 + n], ot[(d + 10) * 16 + n], ot[(d + 9) * 16 + n], ot[(d + 8) * 16 + n],
                ot[(d + 7) * 16 + n], ot[(d + 6) * 16 + n], ot[(d + 5) * 16 + n], ot[(d + 4) * 16 + n],
                ot[(d + 3) * 16 + n], ot[(d + 2) * 16 + n], ot[(d + 1) * 16 + n], ot[d * 16 + n]);
            _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(col, _mm512_set1_ps(inv[n]))));
        }
    }
}
#endif

/*
 * out, q: the chunk's n rows [n, H, D] (bf16, rows `out_stride` and `q_stride` elements
 * apart, heads D apart); key_cache, value_cache: [slots, KVH, D] (bf16); block_ids: the
 * chunk's context blocks, of block_size slots each; start: the chunk's first position;
 * window: each row's keys, itself included (0: all); softcap: the scores' cap (0: none). dim
 * must be a multiple of 32 and at most MAX_DIM, H a multiple of KVH, block_size a multiple
 * of 16. Returns 0; -1 when the scratch space cannot be allocated; -2 when the kernel cannot
 * run (no AMX, or a shape it does not serve): nothing is written then.
 */
int quanta_paged_prefill(void *out, const void *q, const void *key_cache, const void *value_cache,
                         const int64_t *block_ids, int64_t block_size, int64_t start, int64_t n,
                         int64_t heads, int64_t kv_heads, int64_t dim, int64_t q_stride,
                         int64_t out_stride, int64_t slot_stride, float scale, int64_t window,
                         float softcap) {
#if QUANTA_AMX
    if (!amx_ready || dim % 32 != 0 || dim > MAX_DIM || heads % kv_heads != 0 || n <= 0 ||
        block_size % 16 != 0 || window < 0 || softcap < 0.0f)
        return -2;
    const int64_t context = start + n, groups = (context + KEYS - 1) / KEYS;
    uint16_t *vt = aligned_alloc(64, (size_t)(groups * dim * KEYS) * sizeof(uint16_t));
    if (vt == NULL) return -1;
    const int64_t group = heads / kv_heads;
    const int64_t from = window > 0 && start - window + 1 > 0 ? (start - window + 1) / KEYS : 0;
    configure_tiles();
    for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
        pack_values(vt, value_cache, block_ids, block_size, context, groups, from, dim, slot_stride,
                    kvh);
        for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
            for (int64_t i0 = 0; i0 < n; i0 += ROWS) {
                const int64_t m = n - i0 < ROWS ? n - i0 : ROWS;
                attend_tile(out, q, key_cache, vt, block_ids, block_size, i0, m, h, kvh, start,
                            dim, q_stride, out_stride, slot_stride, scale, window, softcap);
            }
        }
    }
    _tile_release();
    free(vt);
    return 0;
#else
    (void)out, (void)q, (void)key_cache, (void)value_cache, (void)block_ids, (void)block_size;
    (void)start, (void)n, (void)heads, (void)kv_heads, (void)dim, (void)q_stride;
    (void)out_stride, (void)slot_stride, (void)scale, (void)window, (void)softcap;
    return -2;
#endif
}
