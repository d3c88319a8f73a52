/* bf16 products y = x W^T (+ bias) that stream the weight at memory speed.
 *
 * At batch 1 a decode step is a chain of one-row products, each reading its whole weight to
 * use every element once: the time is the weight's bytes over the memory bandwidth, plus what
 * each call costs. oneDNN's blocked kernels, on one row, streamed 6.6-7.6 GB/s with ~17 us of
 * fixed cost per call (docs/results/benchmarks.md); this kernel streams the same bytes at 10-13 GB/s.
 *
 * Layout. The weight is packed once, at load, into panels of PANEL output columns:
 * [N / PANEL][K / 2][PANEL][2], pairs of input columns side by side, which is the operand
 * AVX512_BF16's vdpbf16ps multiplies against a broadcast pair of x. A panel is one contiguous
 * stream, each 64-byte load feeds rows of x without a horizontal sum, and a panel
 * (PANEL x K x 2 bytes) stays in L2 while every row of x passes over it.
 *
 * Arithmetic: bf16 inputs, products and sums in fp32, the result rounded once to bf16
 * (round-to-nearest-even), as oneDNN and HF's bf16 linear do; only the order of the fp32 sum
 * differs. The bias joins the fp32 sum before that rounding, as torch's addmm adds it.
 *
 * Output panels are split across `threads` OpenMP threads (the caller passes torch's count:
 * torch ships the libgomp this links against, and OpenMP's own count is per calling thread).
 * Machines without AVX512_BF16 are not served here
 * (quanta_panel_available says so and the caller keeps oneDNN).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 64
#define ROWS 4
/* How far ahead of its loads the panel is prefetched, in bytes (measured best of 1-8 KB). */
#define PREFETCH 4096

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QUANTA_PANEL 1
#else
#define QUANTA_PANEL 0
#endif

/* AVX512_VNNI's 16-bit integer pair dot product (vpdpwssd) serves int8 codes at a few rows:
 * every CPU with AVX512_BF16 has it, but the build checks rather than assumes. */
#if QUANTA_PANEL && defined(__AVX512VNNI__)
#define QUANTA_VNNI 1
#else
#define QUANTA_VNNI 0
#endif
/* Input columns per block of x's 16-bit form (int8_rows_vnni): a lane's int32 sum over a
 * block is at most 128 * 127 * 2^15 < 2^29, far from overflow. */
#define XBLOCK 128

#if QUANTA_PANEL && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define QUANTA_AMX 1
#else
#define QUANTA_AMX 0
#endif
/* Rows from which a product runs on AMX tiles (where the CPU has them and Linux lets this
 * process use them): past the 4 rows one pass of pair dot products serves, a 16-row tile
 * product is faster even with most of its rows padding (3072 x 576, one thread: 230 us at
 * 8 rows against 275 us for 4 rows of pair dot products). int4 panels are dequantized to
 * bf16 for the tiles, which pays from 16 rows (520 us against 670 us at 32 rows and 1.5 ms
 * for the pair dot products; at 8 rows the direct path's 435 us wins). */
#define AMX_ROWS 5
/* Rows of x per pass over a bf16 weight's panels (panel_product_bf16). One thread, OPT-125M
 * layer's four products at 3072 rows: 72 ms unblocked, 63-66 ms at 256-1024 rows a pass
 * (identical results: each output is the same sum); at 768 rows no difference. */
#define ROW_BLOCK 512
#define AMX_INT4_ROWS 16

int quanta_panel_available(void) { return QUANTA_PANEL; }

static int amx_ready = 0;

/* Asks Linux for the AMX tile state (it is off for a process until asked); returns 1 when
 * products of AMX_ROWS rows and more will run on tiles from now on, 0 when they stay on
 * AVX512_BF16 (no AMX, or the kernel or hypervisor refused it). */
int quanta_panel_amx_init(void) {
#if QUANTA_AMX
    /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
    amx_ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
    return amx_ready;
}

int quanta_panel_amx_rows(void) { return AMX_ROWS; }

/* 1 when int8 products of up to ROWS rows run on 16-bit integer dot products (x in 16-bit
 * fixed point per block, int8_rows_vnni), 0 when they widen the codes to bf16 instead. */
int quanta_panel_int8_vnni(void) { return QUANTA_VNNI; }

/* Packed size in bf16 elements of an [n, k] weight. */
int64_t quanta_panel_packed_size(int64_t n, int64_t k) {
    return ((n + PANEL - 1) / PANEL) * PANEL * ((k + 1) / 2) * 2;
}

/* w [n, k] row-major -> packed, for elements of `size` bytes (zeros where n or k is padded). */
static inline __attribute__((always_inline)) void pack(void *packed, const void *w, int64_t n,
                                                      int64_t k, size_t size) {
    int64_t pairs = (k + 1) / 2, panels = (n + PANEL - 1) / PANEL;
    char *out = packed;
    const char *in = w;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kp = 0; kp < pairs; kp++)
            for (int64_t i = 0; i < PANEL; i++)
                for (int64_t c = 0; c < 2; c++) {
                    int64_t row = p * PANEL + i, col = kp * 2 + c;
                    char *at = out + (((p * pairs + kp) * PANEL + i) * 2 + c) * size;
                    if (row < n && col < k)
                        memcpy(at, in + (row * k + col) * size, size);
                    else
                        memset(at, 0, size);
                }
}

void quanta_panel_pack(uint16_t *packed, const uint16_t *w, int64_t n, int64_t k) {
    pack(packed, w, n, k, sizeof *w);
}

/* The same layout for int8 codes: weight-only int8 with a scale per output column, the
 * weight being code * scale. */
void quanta_panel_pack_i8(int8_t *packed, const int8_t *w, int64_t n, int64_t k) {
    pack(packed, w, n, k, sizeof *w);
}


/* Packed size in bytes of an [n, k] int4 weight (k even): half a byte per code. */
int64_t quanta_panel_i4_packed_size(int64_t n, int64_t k) {
    return ((n + PANEL - 1) / PANEL) * (k / 2) * PANEL;
}

/* int4 codes (one per byte, 0..15, [n, k], k even) -> the panel layout of the bf16 weight
 * with four codes per 16-bit word: of a pair row's PANEL x 2 codes (one pair of input
 * columns), code 32 v + j sits in bits 4 v .. 4 v + 3 of word j, so one 64-byte load
 * widens into the pair row's four 32-code registers with a shift and a mask each (widen4). */
void quanta_panel_pack_i4(uint8_t *packed, const uint8_t *codes, int64_t n, int64_t k) {
    const int64_t pairs = k / 2, panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kp = 0; kp < pairs; kp++) {
            uint16_t words[PANEL / 2] = {0};
            for (int64_t w = 0; w < 2 * PANEL; w++) {
                const int64_t row = p * PANEL + w / 2, col = kp * 2 + w % 2;
                const uint16_t code = row < n ? codes[row * k + col] & 0x0F : 0;
                words[w % 32] |= (uint16_t)(code << (4 * (w / 32)));
            }
            memcpy(packed + (p * pairs + kp) * PANEL, words, sizeof words);
        }
}

#if QUANTA_PANEL

/* The 16 columns from `col` that exist (n may end inside them). */
static inline __mmask16 columns(int64_t col, int64_t n) {
    const int64_t left = n - col;
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* The bias of those columns in fp32 (zeros without a bias). */
static inline __m512 bias16(const uint16_t *bias, int64_t col, __mmask16 m) {
    return bias ? _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, bias + col))
                : _mm512_setzero_ps();
}

/* max(0, v) per lane with torch's relu's NaN: vmaxps returns its second operand where
 * either is NaN. */
static inline __m512 relu16(__m512 v) { return _mm512_max_ps(_mm512_setzero_ps(), v); }

/* Pair kp of row r of x as a 32-bit word (zero-padded past an odd k). */
static inline int32_t pair(const uint16_t *x, int64_t k, int64_t kp) {
    uint32_t lo = x[2 * kp], hi = 2 * kp + 1 < k ? x[2 * kp + 1] : 0;
    return (int32_t)(lo | (hi << 16));
}

/* 32 int8 codes widened to bf16 (exact: bf16 holds every integer of -128..127). */
static inline __m512bh widen(const int8_t *codes) {
    __m256i c = _mm256_loadu_si256((const __m256i *)codes);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* R rows of x against one panel: y[r, n0 .. n0 + PANEL) for r < R. The panel holds bf16
 * weights, or int8 codes (`int8`, a constant at every call, so each instance has one path)
 * widened in registers for the same pair dot product: half the bytes for four more
 * instructions per 32 weights, still memory-bound at one row. With `scales` each column's
 * scale multiplies the fp32 sum. */
static inline __attribute__((always_inline)) void panel_rows(
    uint16_t *y, const uint16_t *x, const void *panel, int int8, const float *scales,
    const uint16_t *bias, int relu, int R, int64_t n, int64_t k, int64_t n0) {
    const int64_t pairs = (k + 1) / 2, even = k / 2, size = int8 ? 1 : 2;
    __m512 acc[ROWS][PANEL / 16];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < PANEL / 16; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < pairs; kp++) {
        const char *wp = (const char *)panel + kp * PANEL * 2 * size;
        for (int line = 0; line < 2 * size; line++)
            _mm_prefetch(wp + PREFETCH + 64 * line, _MM_HINT_T0);
        __m512bh xv[ROWS];
        for (int r = 0; r < R; r++) {
            const uint16_t *xr = x + r * k;
            int32_t word;
            if (kp < even)
                memcpy(&word, xr + 2 * kp, sizeof word);
            else
                word = pair(xr, k, kp);
            xv[r] = (__m512bh)_mm512_set1_epi32(word);
        }
        for (int v = 0; v < PANEL / 16; v++) {
            const char *at = wp + v * 32 * size;
            __m512bh wv = int8 ? widen((const int8_t *)at)
                               : (__m512bh)_mm512_loadu_si512((const void *)at);
            for (int r = 0; r < R; r++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv, xv[r]);
        }
    }
    for (int v = 0; v < PANEL / 16; v++) {
        int64_t col = n0 + v * 16;
        if (col >= n) break;
        __mmask16 m = columns(col, n);
        __m512 b = bias16(bias, col, m);
        __m512 s = scales ? _mm512_maskz_loadu_ps(m, scales + col) : _mm512_set1_ps(1.0f);
        for (int r = 0; r < R; r++) {
            __m512 sum = scales ? _mm512_fmadd_ps(acc[r][v], s, b) : _mm512_add_ps(acc[r][v], b);
            if (relu) sum = relu16(sum);
            __m256bh out = _mm512_cvtneps_pbh(sum);
            _mm256_mask_storeu_epi16(y + r * n + col, m, (__m256i)out);
        }
    }
}

/* Every row of x against one panel, ROWS rows at a time (the panel stays in L2). */
static inline __attribute__((always_inline)) void panel_all(
    uint16_t *y, const uint16_t *x, const void *panel, int int8, const float *scales,
    const uint16_t *bias, int relu, int64_t rows, int64_t n, int64_t k, int64_t n0) {
    int64_t r = 0;
    for (; r + ROWS <= rows; r += ROWS)
        panel_rows(y + r * n, x + r * k, panel, int8, scales, bias, relu, ROWS, n, k, n0);
    switch (rows - r) {
    case 3: panel_rows(y + r * n, x + r * k, panel, int8, scales, bias, relu, 3, n, k, n0); break;
    case 2: panel_rows(y + r * n, x + r * k, panel, int8, scales, bias, relu, 2, n, k, n0); break;
    case 1: panel_rows(y + r * n, x + r * k, panel, int8, scales, bias, relu, 1, n, k, n0); break;
    default: break;
    }
}

#if QUANTA_AMX
/* `rows` rows of a panel's fp32 sums (out [rows][PANEL]) into y's bf16 columns n0 .. n0 +
 * PANEL (those that exist): scaled, biased, ReLU where asked, rounded once. */
static inline void amx_rows_out(uint16_t *y, const float *out, int rows, const float *scales,
                                const uint16_t *bias, int relu, int64_t n, int64_t n0) {
    for (int v = 0; v < PANEL / 16; v++) {
        const int64_t col = n0 + v * 16;
        if (col >= n) break;
        const __mmask16 mask = columns(col, n);
        const __m512 b = bias16(bias, col, mask);
        const __m512 s = scales ? _mm512_maskz_loadu_ps(mask, scales + col) : _mm512_set1_ps(1.0f);
        for (int r = 0; r < rows; r++) {
            const __m512 acc = _mm512_load_ps(out + r * PANEL + v * 16);
            __m512 sum = scales ? _mm512_fmadd_ps(acc, s, b) : _mm512_add_ps(acc, b);
            if (relu) sum = relu16(sum);
            _mm256_mask_storeu_epi16(y + r * n + col, mask, (__m256i)_mm512_cvtneps_pbh(sum));
        }
    }
}

/* Tiles 0-3: y's 16 x 64 block in fp32; 4: 16 rows x 32 of x; 5, 6: 16 pairs x 16 columns
 * of the panel, which is already the pair-interleaved operand TDPBF16PS reads (its row
 * stride is the panel's pair row, PANEL x 2 bf16). With m 16, tiles 0-7 also serve
 * panel_amx_32's layout (y's 32 x 32 block in 0-3, x in 4 and 5, the panel in 6 and 7). */
static void configure_tiles(int m) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t < 5 ? (uint8_t)m : 16;
    }
    /* The compiler does not see ldtilecfg read the struct, and may drop the stores above as
     * dead: seen with gcc 12 in a variant of this function (colsb and rows never written,
     * and ldtilecfg faulted). */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* Every row of x against one bf16 panel on AMX tiles, 16 rows at a time (k a multiple of
 * 32); the epilogue (scale, bias, one rounding to bf16) is amx_rows_out, as panel_rows'. */
static void panel_amx(uint16_t *y, const uint16_t *x, const uint16_t *panel,
                      const float *scales, const uint16_t *bias, int relu, int64_t rows,
                      int64_t n, int64_t k, int64_t n0) {
    float out[16 * PANEL] __attribute__((aligned(64)));
    const int64_t chunks = k / 32, pair_row = PANEL * 2;
    int configured = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int m = rows - r0 < 16 ? (int)(rows - r0) : 16;
        if (m != configured) {
            configure_tiles(m);
            configured = m;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t *xr = x + r0 * k;
        for (int64_t c = 0; c < chunks; c++) {
            const uint16_t *b = panel + c * 16 * pair_row;
            _tile_loadd(4, xr + c * 32, k * 2);
            _tile_loadd(5, b, pair_row * 2);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + 32, pair_row * 2);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, b + 64, pair_row * 2);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, b + 96, pair_row * 2);
            _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, out, PANEL * 4);
        _tile_stored(1, out + 16, PANEL * 4);
        _tile_stored(2, out + 32, PANEL * 4);
        _tile_stored(3, out + 48, PANEL * 4);
        amx_rows_out(y + r0 * n, out, m, scales, bias, relu, n, n0);
    }
    _tile_release();
}

/* Rows of x per pass of panel_amx_32 (two row tiles). */
#define AMX_PAIR_ROWS 32

/* Every 32 rows of x against one bf16 panel, half the panel's columns at a time: each tile
 * of x and of the panel loaded feeds two products (panel_amx's 16 rows load five tiles for
 * four), which is what the tile unit waits on at prefill sizes. Each output is the same sum
 * in the same order as panel_amx's, so the rows past the last 32 go there and a row's bits
 * do not depend on which of the two took it. */
static void panel_amx_32(uint16_t *y, const uint16_t *x, const uint16_t *panel,
                         const float *scales, const uint16_t *bias, int relu, int64_t rows,
                         int64_t n, int64_t k, int64_t n0) {
    float out[AMX_PAIR_ROWS * PANEL] __attribute__((aligned(64)));
    const int64_t chunks = k / 32, pair_row = PANEL * 2;
    const int64_t full = rows / AMX_PAIR_ROWS * AMX_PAIR_ROWS;
    if (full) configure_tiles(16);
    for (int64_t r0 = 0; r0 < full; r0 += AMX_PAIR_ROWS) {
        const uint16_t *x0 = x + r0 * k, *x1 = x + (r0 + 16) * k;
        for (int h = 0; h < 2; h++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t c = 0; c < chunks; c++) {
                const uint16_t *b = panel + c * 16 * pair_row + h * 64;
                _tile_loadd(4, x0 + c * 32, k * 2);
                _tile_loadd(6, b, pair_row * 2);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, b + 32, pair_row * 2);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, x1 + c * 32, k * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, out + h * 32, PANEL * 4);
            _tile_stored(1, out + h * 32 + 16, PANEL * 4);
            _tile_stored(2, out + 16 * PANEL + h * 32, PANEL * 4);
            _tile_stored(3, out + 16 * PANEL + h * 32 + 16, PANEL * 4);
        }
        amx_rows_out(y + r0 * n, out, AMX_PAIR_ROWS, scales, bias, relu, n, n0);
    }
    if (full) _tile_release();
    if (rows > full)
        panel_amx(y + full * n, x + full * k, panel, scales, bias, relu, rows - full, n, k, n0);
}
#endif

static void panel_all_bf16(uint16_t *y, const uint16_t *x, const uint16_t *panel,
                           const float *scales, const uint16_t *bias, int relu, int64_t rows,
                           int64_t n, int64_t k, int64_t n0) {
#if QUANTA_AMX
    if (amx_ready && rows >= AMX_ROWS && k % 32 == 0) {
        panel_amx_32(y, x, panel, scales, bias, relu, rows, n, k, n0);
        return;
    }
#endif
    panel_all(y, x, panel, 0, scales, bias, relu, rows, n, k, n0);
}

#if QUANTA_VNNI
/* int8 at a few rows without widening the codes to bf16. Widening costs five instructions
 * per 32 codes (two sign extensions, two conversions to fp32, one to bf16): at one row that
 * bounds the product at about 10 GB/s of codes, below what memory delivers. Here x is
 * converted once per call instead, to 16-bit integers per block of XBLOCK input columns,
 *   q = round(x * 2^s), s such that the block's largest |x| lands in [2^14, 2^15),
 * and each code only sign-extends to 16 bits for vpdpwssd, which sums the pair's two products
 * exactly in int32. A bf16 x has 8 significant bits, so every element within 2^7 of its
 * block's largest converts exactly; a smaller one is rounded to 2^-15 of that largest, 64
 * times finer than bf16's own rounding of the largest. Each block's int32 sums become fp32
 * and are scaled by 2^-s into the fp32 sum; the column's scale, the bias and the one rounding
 * to bf16 are panel_rows'. */

/* The 16-bit form of x's rows: q [rows][2 * pairs] (zero past k), 2^-s per block in
 * step [rows][blocks]. Returns 0 when a row holds an infinity or NaN, which has no integer
 * form: the caller keeps the widening path, so they propagate as in bf16. */
static int quantize_rows(int16_t *q, float *step, const uint16_t *x, int64_t rows, int64_t k,
                         int64_t width, int64_t blocks) {
    const __m512i exponent = _mm512_set1_epi32(0x7F800000);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * k;
        int16_t *qr = q + r * width;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t c0 = b * XBLOCK, c1 = c0 + XBLOCK < width ? c0 + XBLOCK : width;
            __m512 big = _mm512_setzero_ps();
            for (int64_t c = c0; c < c1; c += 16) {
                const __mmask16 m = columns(c, k < c1 ? k : c1);
                const __m512i bits = _mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, xr + c)), 16);
                if (_mm512_mask_cmpeq_epi32_mask(m, _mm512_and_si512(bits, exponent), exponent))
                    return 0;
                big = _mm512_max_ps(big, _mm512_abs_ps(_mm512_castsi512_ps(bits)));
            }
            const float largest = _mm512_reduce_max_ps(big);
            int s = 0;
            if (largest > 0) {
                int e;
                frexpf(largest, &e); /* largest in [2^(e-1), 2^e) */
                s = 15 - e;
                s = s > 126 ? 126 : s;
            }
            step[r * blocks + b] = ldexpf(1.0f, -s);
            const __m512 up = _mm512_set1_ps(ldexpf(1.0f, s));
            for (int64_t c = c0; c < c1; c += 16) {
                const __mmask16 in = columns(c, k < c1 ? k : c1), out = columns(c, c1);
                const __m512i bits = _mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, xr + c)), 16);
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(bits), up));
                _mm256_mask_storeu_epi16(qr + c, out, _mm512_cvtsepi32_epi16(v));
            }
        }
    }
    return 1;
}

/* R rows of x's 16-bit form against one int8 panel: y[r, n0 .. n0 + PANEL) for r < R. */
static inline __attribute__((always_inline)) void int8_rows_vnni(
    uint16_t *y, const int16_t *q, const float *step, int64_t width, int64_t blocks,
    const int8_t *panel, const float *scales, const uint16_t *bias, int R, int64_t n,
    int64_t k, int64_t n0) {
    const int64_t pairs = (k + 1) / 2;
    __m512 acc[ROWS][PANEL / 16];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < PANEL / 16; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t kp0 = b * (XBLOCK / 2);
        const int64_t kp1 = kp0 + XBLOCK / 2 < pairs ? kp0 + XBLOCK / 2 : pairs;
        __m512i part[ROWS][PANEL / 16];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < PANEL / 16; v++) part[r][v] = _mm512_setzero_si512();
        for (int64_t kp = kp0; kp < kp1; kp++) {
            const int8_t *wp = panel + kp * PANEL * 2;
            _mm_prefetch((const char *)wp + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)wp + PREFETCH + 64, _MM_HINT_T0);
            __m512i xv[ROWS];
            for (int r = 0; r < R; r++) {
                int32_t word;
                memcpy(&word, q + r * width + 2 * kp, sizeof word);
                xv[r] = _mm512_set1_epi32(word);
            }
            for (int v = 0; v < PANEL / 16; v++) {
                const __m512i wv =
                    _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wp + v * 32)));
                for (int r = 0; r < R; r++) part[r][v] = _mm512_dpwssd_epi32(part[r][v], wv, xv[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(step[r * blocks + b]);
            for (int v = 0; v < PANEL / 16; v++)
                acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r][v]), s, acc[r][v]);
        }
    }
    for (int v = 0; v < PANEL / 16; v++) {
        const int64_t col = n0 + v * 16;
        if (col >= n) break;
        const __mmask16 m = columns(col, n);
        const __m512 b = bias16(bias, col, m);
        const __m512 s = _mm512_maskz_loadu_ps(m, scales + col);
        for (int r = 0; r < R; r++) {
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[r][v], s, b));
            _mm256_mask_storeu_epi16(y + r * n + col, m, (__m256i)out);
        }
    }
}

static void int8_all_vnni(uint16_t *y, const int16_t *q, const float *step, int64_t width,
                          int64_t blocks, const int8_t *panel, const float *scales,
                          const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int64_t n0) {
    switch (rows) {
    case 4: int8_rows_vnni(y, q, step, width, blocks, panel, scales, bias, 4, n, k, n0); break;
    case 3: int8_rows_vnni(y, q, step, width, blocks, panel, scales, bias, 3, n, k, n0); break;
    case 2: int8_rows_vnni(y, q, step, width, blocks, panel, scales, bias, 2, n, k, n0); break;
    default: int8_rows_vnni(y, q, step, width, blocks, panel, scales, bias, 1, n, k, n0); break;
    }
}

/* The product of up to ROWS rows through int8_rows_vnni; returns 0 (nothing written) where
 * x has no 16-bit form (a non-finite element) or its scratch could not be allocated. */
static int quanta_panel_i8_vnni(uint16_t *y, const uint16_t *x, const int8_t *packed,
                                const float *scales, const uint16_t *bias, int64_t rows,
                                int64_t n, int64_t k, int threads) {
    const int64_t width = ((k + 1) / 2) * 2, blocks = (width + XBLOCK - 1) / XBLOCK;
    const int64_t panels = (n + PANEL - 1) / PANEL, stride = width * PANEL;
    int16_t *q = malloc((size_t)(rows * width) * sizeof *q);
    float *step = malloc((size_t)(rows * blocks) * sizeof *step);
    const int ok = q && step && quantize_rows(q, step, x, rows, k, width, blocks);
    if (ok) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t p = 0; p < panels; p++)
            int8_all_vnni(y, q, step, width, blocks, packed + p * stride, scales, bias, rows, n,
                          k, p * PANEL);
    }
    free(q);
    free(step);
    return ok;
}
#endif

static void panel_all_i8(uint16_t *y, const uint16_t *x, const int8_t *panel,
                         const float *scales, const uint16_t *bias, int64_t rows, int64_t n,
                         int64_t k, int64_t n0) {
    panel_all(y, x, panel, 1, scales, bias, 0, rows, n, k, n0);
}

/* Every panel against ROW_BLOCK rows of x at a time, then the next rows: the block of x stays
 * in cache while the panels pass over it, where a whole prefill's x (3072 rows of 3072
 * columns: 18 MiB) would come from the far caches or memory once per panel. */
static void panel_product_bf16(uint16_t *y, const uint16_t *x, const uint16_t *packed,
                               const uint16_t *bias, int relu, int64_t rows, int64_t n,
                               int64_t k, int threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, stride = ((k + 1) / 2) * PANEL * 2;
    for (int64_t r0 = 0, m; r0 < rows; r0 += m) {
        /* A short tail joins the block before it, so that every block of a product of
         * AMX_ROWS rows or more runs on the same kernel (a row's bits never depend on the
         * rows beside it). */
        m = rows - r0 >= ROW_BLOCK + AMX_ROWS ? ROW_BLOCK : rows - r0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t p = 0; p < panels; p++)
            panel_all_bf16(y + r0 * n, x + r0 * k, packed + p * stride, NULL, bias, relu, m, n,
                           k, p * PANEL);
    }
}

/* y [rows, n] = x [rows, k] W^T (+ bias [n]); W packed by quanta_panel_pack; bf16,
 * contiguous rows. */
void quanta_panel_bf16(uint16_t *y, const uint16_t *x, const uint16_t *packed,
                      const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int threads) {
    panel_product_bf16(y, x, packed, bias, 0, rows, n, k, threads);
}

/* quanta_panel_bf16 with ReLU applied to the fp32 sum before its one rounding: the same
 * values as rounding first (rounding keeps signs and zero), without a second pass over y
 * (OPT's fc1 output at prefill: a [tokens, 4 * hidden] tensor read and written again). */
void quanta_panel_bf16_relu(uint16_t *y, const uint16_t *x, const uint16_t *packed,
                           const uint16_t *bias, int64_t rows, int64_t n, int64_t k,
                           int threads) {
    panel_product_bf16(y, x, packed, bias, 1, rows, n, k, threads);
}

/* y [rows, n] = x [rows, k] (codes * scales)^T (+ bias [n]); codes packed by
 * quanta_panel_pack_i8, scales fp32 [n], x and y bf16. Up to ROWS rows read the codes
 * directly; more rows would widen each code once per group of ROWS, so the panel is widened
 * to bf16 once, into a per-thread scratch that stays in L2, and the bf16 path reads it. */
void quanta_panel_i8(uint16_t *y, const uint16_t *x, const int8_t *packed, const float *scales,
                     const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, stride = ((k + 1) / 2) * PANEL * 2;
#if QUANTA_VNNI
    if (rows <= ROWS && quanta_panel_i8_vnni(y, x, packed, scales, bias, rows, n, k, threads))
        return;
#endif
    if (rows <= ROWS) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t p = 0; p < panels; p++)
            panel_all_i8(y, x, packed + p * stride, scales, bias, rows, n, k, p * PANEL);
        return;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t *wide = aligned_alloc(64, (size_t)((stride * 2 + 63) / 64) * 64);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int8_t *codes = packed + p * stride;
            if (wide) {
                for (int64_t i = 0; i < stride; i += 32)
                    _mm512_storeu_si512((void *)(wide + i), (__m512i)widen(codes + i));
                panel_all_bf16(y, x, wide, scales, bias, 0, rows, n, k, p * PANEL);
            } else {  // no memory for the scratch: the slower direct path, never a failure
                panel_all_i8(y, x, codes, scales, bias, rows, n, k, p * PANEL);
            }
        }
        free(wide);
    }
}

/* int4 codes, grouped: the weight of column c in group g is code * scale[c, g] + min[c, g]
 * (torch's (code - 8) * scale + zero, with min = zero - 8 * scale; llama.cpp's Q4_1 d * q + m
 * and Q4_0 d * (q - 8) exactly). Scales and mins are fp16 (which holds GGUF's d and m
 * exactly), laid out [panel][group][scale, min][PANEL].
 *
 * A code widens to the bf16 word 0x4300 | code, which is 128 + code: one mask-and-or per 32
 * codes, no table lookup. So the pair dot product sums x_k (128 + code_ck), exactly products
 * in fp32, and the group's weights come out of it as
 *   y_c = sum_g scale[c, g] * part_cg + (min[c, g] - 128 scale[c, g]) * sum_{k in g} x_k,
 * two fused multiply-adds per 16 columns and group. The 128 costs 7 of fp32's 24 bits of the
 * partial sum, far below the bf16 rounding of the result.
 *
 * A row's arithmetic does not depend on how many rows share the call: from ROWS + 1 rows up
 * a panel's codes are widened once to their bf16 words in a per-thread scratch and the same
 * loop reads them, so a request gets the same bits at batch 1 and in a prefill. */

/* The four 32-code registers of a pair row from its 64 packed bytes (quanta_panel_pack_i4). */
static inline void widen4(const uint8_t *bytes, __m512bh out[4]) {
    const __m512i b = _mm512_loadu_si512((const void *)bytes);
    const __m512i low = _mm512_set1_epi16(0x000F), base = _mm512_set1_epi16(0x4300);
    /* 0xEA: (a & b) | c */
    out[0] = (__m512bh)_mm512_ternarylogic_epi32(b, low, base, 0xEA);
    out[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), low, base, 0xEA);
    out[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 8), low, base, 0xEA);
    out[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 12), base);
}

/* R rows of x against one int4 panel (`wide`: the panel holds bf16 codes, [K/2][PANEL][2]). */
static inline __attribute__((always_inline)) void panel_rows_i4(
    uint16_t *y, const uint16_t *x, const void *panel, int wide, const uint16_t *sm,
    const float *xsum, const uint16_t *bias, int R, int64_t n, int64_t k, int64_t n0,
    int64_t group) {
    const int64_t groups = k / group, gp = group / 2;
    const int64_t pair_bytes = wide ? PANEL * 4 : PANEL;
    __m512 acc[ROWS][PANEL / 16];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < PANEL / 16; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        /* Two partial sums, even and odd pairs: twice the independent chains of dot
         * products, which at one row are bound by their latency, not by the loads. */
        __m512 part[2][ROWS][PANEL / 16];
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++)
                for (int v = 0; v < PANEL / 16; v++) part[h][r][v] = _mm512_setzero_ps();
        for (int64_t kp = g * gp; kp < (g + 1) * gp; kp++) {
            const uint8_t *wp = (const uint8_t *)panel + kp * pair_bytes;
            for (int line = 0; line < pair_bytes / 64; line++)
                _mm_prefetch((const char *)wp + PREFETCH + 64 * line, _MM_HINT_T0);
            __m512bh wv[PANEL / 16];
            if (wide) {
                for (int v = 0; v < PANEL / 16; v++)
                    wv[v] = (__m512bh)_mm512_loadu_si512((const void *)(wp + v * 64));
            } else {
                widen4(wp, wv);
            }
            const int h = (int)(kp & 1);
            for (int r = 0; r < R; r++) {
                int32_t word;
                memcpy(&word, x + r * k + 2 * kp, sizeof word);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(word);
                for (int v = 0; v < PANEL / 16; v++)
                    part[h][r][v] = _mm512_dpbf16_ps(part[h][r][v], wv[v], xv);
            }
        }
        const uint16_t *gsm = sm + g * 2 * PANEL;
        for (int v = 0; v < PANEL / 16; v++) {
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gsm + v * 16)));
            const __m512 m =
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gsm + PANEL + v * 16)));
            const __m512 shifted = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, m);
            for (int r = 0; r < R; r++) {
                const __m512 sum = _mm512_add_ps(part[0][r][v], part[1][r][v]);
                acc[r][v] = _mm512_fmadd_ps(sum, s, acc[r][v]);
                acc[r][v] = _mm512_fmadd_ps(shifted, _mm512_set1_ps(xsum[r * groups + g]), acc[r][v]);
            }
        }
    }
    for (int v = 0; v < PANEL / 16; v++) {
        int64_t col = n0 + v * 16;
        if (col >= n) break;
        __mmask16 mask = columns(col, n);
        __m512 b = bias16(bias, col, mask);
        for (int r = 0; r < R; r++) {
            __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], b));
            _mm256_mask_storeu_epi16(y + r * n + col, mask, (__m256i)out);
        }
    }
}

static inline __attribute__((always_inline)) void panel_all_i4(
    uint16_t *y, const uint16_t *x, const void *panel, int wide, const uint16_t *sm,
    const float *xsum, const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int64_t n0,
    int64_t group) {
    const int64_t groups = k / group;
    int64_t r = 0;
#define I4_ROWS(R)                                                                            \
    panel_rows_i4(y + r * n, x + r * k, panel, wide, sm, xsum + r * groups, bias, R, n, k, n0, \
                  group)
    for (; r + ROWS <= rows; r += ROWS) I4_ROWS(ROWS);
    switch (rows - r) {
    case 3: I4_ROWS(3); break;
    case 2: I4_ROWS(2); break;
    case 1: I4_ROWS(1); break;
    default: break;
    }
#undef I4_ROWS
}

static void panel_all_i4_nibbles(uint16_t *y, const uint16_t *x, const void *panel,
                                 const uint16_t *sm, const float *xsum, const uint16_t *bias,
                                 int64_t rows, int64_t n, int64_t k, int64_t n0, int64_t group) {
    panel_all_i4(y, x, panel, 0, sm, xsum, bias, rows, n, k, n0, group);
}

static void panel_all_i4_wide(uint16_t *y, const uint16_t *x, const void *panel,
                              const uint16_t *sm, const float *xsum, const uint16_t *bias,
                              int64_t rows, int64_t n, int64_t k, int64_t n0, int64_t group) {
    panel_all_i4(y, x, panel, 1, sm, xsum, bias, rows, n, k, n0, group);
}

#if QUANTA_AMX
/* A panel's weights, code * scale + min rounded to bf16, into `wide` (the bf16 panel layout):
 * prefill on AMX tiles reads the dequantized panel, as a bf16 product would. */
static void dequantize_panel_i4(uint16_t *wide, const uint8_t *codes, const uint16_t *sm,
                                int64_t pairs, int64_t group) {
    /* lane 2c + j of a widened register is column c's code j: each column's scale twice */
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int64_t kp = 0; kp < pairs; kp++) {
        const uint16_t *gsm = sm + (2 * kp / group) * 2 * PANEL;
        __m512bh wv[PANEL / 16];
        widen4(codes + kp * PANEL, wv);
        for (int v = 0; v < PANEL / 16; v++) {
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gsm + v * 16)));
            const __m512 m =
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gsm + PANEL + v * 16)));
            const __m512 shifted = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, m);
            const __m512i words = (__m512i)wv[v];
            const __m512 w_lo = _mm512_fmadd_ps(
                _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(words)),
                _mm512_permutexvar_ps(lo, s), _mm512_permutexvar_ps(lo, shifted));
            const __m512 w_hi = _mm512_fmadd_ps(
                _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(words, 1)),
                _mm512_permutexvar_ps(hi, s), _mm512_permutexvar_ps(hi, shifted));
            _mm512_storeu_si512((void *)(wide + kp * PANEL * 2 + v * 32),
                                (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
        }
    }
}
#endif

/* y [rows, n] = x [rows, k] W^T (+ bias [n]) for int4 codes packed by quanta_panel_pack_i4,
 * fp16 scales and mins [panels][k / group][2][PANEL]; x and y bf16, k a multiple of the
 * (even) group. Returns 0, or -1 when the rows' group sums cannot be allocated. */
int quanta_panel_i4(uint16_t *y, const uint16_t *x, const uint8_t *packed, const uint16_t *sm,
                    const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int64_t group,
                    int threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, pairs = k / 2, groups = k / group;
    const int64_t stride = pairs * PANEL, sm_stride = groups * 2 * PANEL;
    float *xsum = malloc(sizeof(float) * (size_t)(rows * groups));
    if (!xsum) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t i = g * group; i < (g + 1) * group; i++) {
                uint32_t bits = (uint32_t)x[r * k + i] << 16;
                float f;
                memcpy(&f, &bits, sizeof f);
                s += f;
            }
            xsum[r * groups + g] = s;
        }
    if (rows <= ROWS) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t p = 0; p < panels; p++)
            panel_all_i4_nibbles(y, x, packed + p * stride, sm + p * sm_stride, xsum, bias, rows,
                                 n, k, p * PANEL, group);
        free(xsum);
        return 0;
    }
#if QUANTA_AMX
    /* From AMX_INT4_ROWS rows on AMX tiles: each panel dequantized to bf16 once, then the bf16 tile
     * product (the rows then see the weights rounded to bf16, as a bf16 product does). */
    const int tiles = amx_ready && rows >= AMX_INT4_ROWS && k % 32 == 0;
#else
    const int tiles = 0;
    (void)tiles;
#endif
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t *wide = aligned_alloc(64, (size_t)(pairs * PANEL * 4));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const uint8_t *codes = packed + p * stride;
#if QUANTA_AMX
            if (wide && tiles) {
                dequantize_panel_i4(wide, codes, sm + p * sm_stride, pairs, group);
                panel_amx(y, x, wide, NULL, bias, 0, rows, n, k, p * PANEL);
                continue;
            }
#endif
            if (wide) {
                for (int64_t kp = 0; kp < pairs; kp++) {
                    __m512bh wv[PANEL / 16];
                    widen4(codes + kp * PANEL, wv);
                    for (int v = 0; v < PANEL / 16; v++)
                        _mm512_storeu_si512((void *)(wide + kp * PANEL * 2 + v * 32), (__m512i)wv[v]);
                }
                panel_all_i4_wide(y, x, wide, sm + p * sm_stride, xsum, bias, rows, n, k,
                                  p * PANEL, group);
            } else {  // no memory for the scratch: the direct path, same bits, slower
                panel_all_i4_nibbles(y, x, codes, sm + p * sm_stride, xsum, bias, rows, n, k,
                                     p * PANEL, group);
            }
        }
        free(wide);
    }
    free(xsum);
    return 0;
}

#else

void quanta_panel_bf16(uint16_t *y, const uint16_t *x, const uint16_t *packed,
                      const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int threads) {
    (void)y, (void)x, (void)packed, (void)bias, (void)rows, (void)n, (void)k, (void)threads;
}

void quanta_panel_bf16_relu(uint16_t *y, const uint16_t *x, const uint16_t *packed,
                           const uint16_t *bias, int64_t rows, int64_t n, int64_t k,
                           int threads) {
    (void)y, (void)x, (void)packed, (void)bias, (void)rows, (void)n, (void)k, (void)threads;
}

void quanta_panel_i8(uint16_t *y, const uint16_t *x, const int8_t *packed, const float *scales,
                     const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int threads) {
    (void)y, (void)x, (void)packed, (void)scales, (void)bias, (void)rows, (void)n, (void)k;
    (void)threads;
}

int quanta_panel_i4(uint16_t *y, const uint16_t *x, const uint8_t *packed, const uint16_t *sm,
                    const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int64_t group,
                    int threads) {
    (void)y, (void)x, (void)packed, (void)sm, (void)bias, (void)rows, (void)n, (void)k;
    (void)group, (void)threads;
    return -1;
}

#endif
