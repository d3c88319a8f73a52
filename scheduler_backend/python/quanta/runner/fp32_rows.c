/*
 * fp32 products of up to 64 rows, y [M, N] = x [M, K] W^T (+ bias) (+ ReLU),
 * reading the weight W [N, K] as it is stored, in one pass.
 *
 * Why: a decode step reads every weight once and does little arithmetic with it. On one
 * thread MKL streams the stored weight at 13 GB/s for one row but falls to 5.5 GB/s at four
 * and 4.6 at eight, and oneDNN reads it at 7-9 GB/s from two to eight rows (its blocked copy
 * 9-11 GB/s, at the cost of the one-row rate and a second copy of the weight); from 16 to 64
 * rows oneDNN reaches 60-75 GFLOP/s of the core's ~140. Two forms, by rows:
 *
 * - Up to 8 rows ("dot" form): each group of three weight rows is read once and multiplied
 *   with all of x's rows while it sits in registers; 16 lanes of partial sums over K per
 *   output, summed at the end. x stays in the caches, so the weight stream is the only
 *   memory traffic.
 * - From 9 to 64 rows ("broadcast" form): x is transposed into [K, rows padded to 16] once,
 *   and each block of 6-12 weight rows is swept along K, every weight element broadcast
 *   against 16-64 rows of x at once: no sums across lanes, 12-24 accumulators in registers,
 *   and the next block prefetched into L2 while this one is multiplied. From 96 rows oneDNN
 *   is as fast (it nears the core's peak there), so calls stop at 64.
 *
 * In either form an output is one row of x against one row of W in an order fixed by K
 * alone, so a row's bits are the same whichever rows share the call within a form (unlike
 * MKL's and oneDNN's, whose summation order follows the batch).
 *
 * Built at run time by quanta.runner.fp32_rows (-O3 -march=native -fopenmp), the weight rows
 * split over torch's OpenMP threads; where the compiler does not target AVX-512,
 * `quanta_fp32_rows_available` says 0 and products stay on MKL and oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define QUANTA_AVX512 1
#else
#define QUANTA_AVX512 0
#endif

#define ROWS 8         /* calls of up to this many rows take the dot form, in one pass */
#define MAX_ROWS 64    /* rows a call takes (beyond, oneDNN is as fast or faster) */

int quanta_fp32_rows_available(void) { return QUANTA_AVX512; }

int quanta_fp32_rows_max(void) { return MAX_ROWS; }

int quanta_fp32_rows_dot_max(void) { return ROWS; }

#if QUANTA_AVX512
/* y[m][n0 + j] for j < NB weight rows and m < R rows of x, R and NB known at compile time so
 * that the R * NB accumulators stay in registers (at most 24 of the 32). */
#define BLOCK(R, NB)                                                                          \
    static void block_##R##_##NB(float *y, const float *x, const float *w, const float *bias, \
                                 int relu, int64_t n, int64_t k, int64_t n0) {                \
        __m512 acc[NB][R];                                                                    \
        for (int j = 0; j < NB; j++)                                                          \
            for (int m = 0; m < R; m++) acc[j][m] = _mm512_setzero_ps();                     \
        const float *wr = w + n0 * k;                                                         \
        int64_t c = 0;                                                                        \
        for (; c + 16 <= k; c += 16) {                                                        \
            __m512 wv[NB];                                                                    \
            for (int j = 0; j < NB; j++) {                                                    \
                wv[j] = _mm512_loadu_ps(wr + j * k + c);                                      \
                _mm_prefetch((const char *)(wr + (NB + j) * k + c), _MM_HINT_T0);             \
            }                                                                                 \
            for (int m = 0; m < R; m++) {                                                     \
                const __m512 xv = _mm512_loadu_ps(x + m * k + c);                             \
                for (int j = 0; j < NB; j++) acc[j][m] = _mm512_fmadd_ps(wv[j], xv, acc[j][m]); \
            }                                                                                 \
        }                                                                                     \
        if (c < k) {                                                                          \
            const __mmask16 tail = (__mmask16)((1u << (k - c)) - 1u);                         \
            __m512 wv[NB];                                                                    \
            for (int j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_ps(tail, wr + j * k + c); \
            for (int m = 0; m < R; m++) {                                                     \
                const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * k + c);                 \
                for (int j = 0; j < NB; j++) acc[j][m] = _mm512_fmadd_ps(wv[j], xv, acc[j][m]); \
            }                                                                                 \
        }                                                                                     \
        for (int m = 0; m < R; m++) {                                                         \
            for (int j = 0; j < NB; j++) {                                                    \
                float v = _mm512_reduce_add_ps(acc[j][m]);                                    \
                if (bias) v += bias[n0 + j];                                                  \
                if (relu && v < 0.0f) v = 0.0f;                                               \
                y[m * n + n0 + j] = v;                                                        \
            }                                                                                 \
        }                                                                                     \
    }
#define BLOCKS(R) BLOCK(R, 3) BLOCK(R, 1)
BLOCKS(1)
BLOCKS(2)
BLOCKS(3)
BLOCKS(4)
BLOCKS(5)
BLOCKS(6)
BLOCKS(7)
BLOCKS(8)

/* Broadcast form: xt [k][16 * MV] holds up to 16 * MV rows of x transposed (padding rows
 * zero); y[m][n0 + j] for the block's NR weight rows and m < rows. Each weight element is
 * broadcast against MV vectors of x, in K's order, into NR * MV accumulators (at most 24 of
 * the 32 registers). */
#define WIDE(MV, NR)                                                                          \
    static void wide_##MV##_##NR(float *y, const float *xt, const float *w, const float *bias, \
                                 int relu, int64_t rows, int64_t n, int64_t k, int64_t n0) {   \
        __m512 acc[NR][MV];                                                                   \
        _Pragma("GCC unroll 12") for (int j = 0; j < NR; j++)                                 \
        _Pragma("GCC unroll 4") for (int v = 0; v < MV; v++) acc[j][v] = _mm512_setzero_ps(); \
        const float *wr = w + n0 * k;                                                         \
        const int64_t next = n0 + 2 * NR <= n ? NR : 0; /* rows to the next block */          \
        const int64_t mp = 16 * MV;                                                           \
        int64_t c = 0;                                                                        \
        for (; c + 16 <= k; c += 16) {                                                        \
            _Pragma("GCC unroll 12") for (int j = 0; j < NR; j++)                             \
                _mm_prefetch((const char *)(wr + (next + j) * k + c), _MM_HINT_T1);           \
            _Pragma("GCC unroll 16") for (int kk = 0; kk < 16; kk++) {                        \
                const float *xr = xt + (c + kk) * mp;                                         \
                __m512 xv[MV];                                                                \
                _Pragma("GCC unroll 4") for (int v = 0; v < MV; v++)                          \
                    xv[v] = _mm512_load_ps(xr + 16 * v);                                      \
                _Pragma("GCC unroll 12") for (int j = 0; j < NR; j++) {                       \
                    const __m512 wb = _mm512_set1_ps(wr[j * k + c + kk]);                     \
                    _Pragma("GCC unroll 4") for (int v = 0; v < MV; v++)                      \
                        acc[j][v] = _mm512_fmadd_ps(wb, xv[v], acc[j][v]);                    \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (; c < k; c++) {                                                                  \
            const float *xr = xt + c * mp;                                                    \
            __m512 xv[MV];                                                                    \
            _Pragma("GCC unroll 4") for (int v = 0; v < MV; v++)                              \
                xv[v] = _mm512_load_ps(xr + 16 * v);                                          \
            _Pragma("GCC unroll 12") for (int j = 0; j < NR; j++) {                           \
                const __m512 wb = _mm512_set1_ps(wr[j * k + c]);                              \
                _Pragma("GCC unroll 4") for (int v = 0; v < MV; v++)                          \
                    acc[j][v] = _mm512_fmadd_ps(wb, xv[v], acc[j][v]);                        \
            }                                                                                 \
        }                                                                                     \
        float out[16 * MV] __attribute__((aligned(64)));                                      \
        for (int j = 0; j < NR; j++) {                                                        \
            _Pragma("GCC unroll 4") for (int v = 0; v < MV; v++)                              \
                _mm512_store_ps(out + 16 * v, acc[j][v]);                                     \
            const float b = bias ? bias[n0 + j] : 0.0f;                                       \
            for (int64_t m = 0; m < rows; m++) {                                              \
                float val = bias ? out[m] + b : out[m];                                       \
                if (relu && val < 0.0f) val = 0.0f;                                           \
                y[m * n + n0 + j] = val;                                                      \
            }                                                                                 \
        }                                                                                     \
    }
WIDE(1, 12)
WIDE(2, 12)
WIDE(3, 8)
WIDE(4, 6)
WIDE(1, 1)
WIDE(2, 1)
WIDE(3, 1)
WIDE(4, 1)

typedef void (*wide_fn)(float *, const float *, const float *, const float *, int, int64_t,
                        int64_t, int64_t, int64_t);
static const wide_fn WIDE_BLOCK[5] = {0, wide_1_12, wide_2_12, wide_3_8, wide_4_6};
static const wide_fn WIDE_ONE[5] = {0, wide_1_1, wide_2_1, wide_3_1, wide_4_1};
static const int WIDE_NR[5] = {0, 12, 12, 8, 6};

typedef void (*block_fn)(float *, const float *, const float *, const float *, int, int64_t,
                         int64_t, int64_t);
static const block_fn THREE[ROWS + 1] = {0, block_1_3, block_2_3, block_3_3, block_4_3,
                                         block_5_3, block_6_3, block_7_3, block_8_3};
static const block_fn ONE[ROWS + 1] = {0, block_1_1, block_2_1, block_3_1, block_4_1,
                                       block_5_1, block_6_1, block_7_1, block_8_1};


/* The dot form: up to ROWS rows, each block of three weight rows against all of them. */
static void dot_product(float *y, const float *x, const float *w, const float *bias, int relu,
                        int64_t rows, int64_t n, int64_t k, int threads) {
    const int64_t blocks = n / 3;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) THREE[rows](y, x, w, bias, relu, n, k, 3 * b);
    for (int64_t n0 = 3 * blocks; n0 < n; n0++) ONE[rows](y, x, w, bias, relu, n, k, n0);
}

/* The broadcast form: x transposed once into xt [k][16 * mv], then every block of weight
 * rows swept along K against it. Returns -1 where the transposed copy cannot be allocated. */
static int wide_product(float *y, const float *x, const float *w, const float *bias, int relu,
                        int64_t rows, int64_t n, int64_t k, int threads) {
    const int mv = (int)((rows + 15) / 16);
    const int64_t mp = 16 * (int64_t)mv;
    float *xt = aligned_alloc(64, (size_t)(k * mp) * sizeof(float));
    if (!xt) return -1;
    for (int64_t c = 0; c < k; c++) {
        for (int64_t r = 0; r < rows; r++) xt[c * mp + r] = x[r * k + c];
        for (int64_t r = rows; r < mp; r++) xt[c * mp + r] = 0.0f;
    }
    const int64_t nr = WIDE_NR[mv], blocks = n / nr;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) WIDE_BLOCK[mv](y, xt, w, bias, relu, rows, n, k, b * nr);
    for (int64_t n0 = blocks * nr; n0 < n; n0++) WIDE_ONE[mv](y, xt, w, bias, relu, rows, n, k, n0);
    free(xt);
    return 0;
}
#endif

/*
 * y [rows, n] = x [rows, k] w^T (+ bias [n]) (ReLU where relu), all fp32 and contiguous;
 * rows at most MAX_ROWS. Returns 0, or -1 where it cannot run (no AVX-512, too many rows, no
 * memory for x's transposed copy): nothing is written then.
 */
int quanta_fp32_rows(float *y, const float *x, const float *w, const float *bias, int relu,
                     int64_t rows, int64_t n, int64_t k, int threads) {
#if QUANTA_AVX512
    if (rows < 1 || rows > MAX_ROWS) return -1;
    if (rows <= ROWS) {
        dot_product(y, x, w, bias, relu, rows, n, k, threads);
        return 0;
    }
    return wide_product(y, x, w, bias, relu, rows, n, k, threads);
#else
    (void)y, (void)x, (void)w, (void)bias, (void)relu, (void)rows, (void)n, (void)k;
    (void)threads;
    return -1;
#endif
}
