/*
 * fp32 products of a few rows, y [M, N] = x [M, K] W^T (+ bias) (+ ReLU), reading the weight
 * W [N, K] as it is stored: one pass over the weight for up to 16 rows.
 *
 * Why: a decode step of a few rows reads every weight once and does little arithmetic with
 * it, so it takes the weights' bytes over the memory bandwidth. On one thread MKL streams the
 * stored weight at 13 GB/s for one row but falls to 5.5 GB/s at four and 4.6 at eight, and
 * oneDNN reads it at 7-9 GB/s from two to eight rows (its blocked copy 9-11 GB/s, at the cost
 * of the one-row rate and a second copy of the weight). Here each group of three weight rows
 * is read once and multiplied with all of x's rows while it sits in registers: x (a few rows
 * of K floats) stays in the caches, so the weight stream is the only memory traffic.
 *
 * Each output is one row of x against one row of W: 16 lanes of partial sums over K, summed
 * at the end. It does not depend on how many rows share the call, so a row's bits are the
 * same alone or batched (unlike MKL's and oneDNN's, whose summation order follows the batch).
 *
 * Built at run time by quanta.runner.fp32_rows (-O3 -march=native -fopenmp), the weight rows
 * split over torch's OpenMP threads; where the compiler does not target AVX-512,
 * `quanta_fp32_rows_available` says 0 and products stay on MKL and oneDNN.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define QUANTA_AVX512 1
#else
#define QUANTA_AVX512 0
#endif

#define ROWS 8     /* rows of x per pass over a block of weight rows */
#define MAX_ROWS 16 /* rows a call takes: two passes, the second reading the block from L1 */

int quanta_fp32_rows_available(void) { return QUANTA_AVX512; }

int quanta_fp32_rows_max(void) { return MAX_ROWS; }

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

typedef void (*block_fn)(float *, const float *, const float *, const float *, int, int64_t,
                         int64_t, int64_t);
static const block_fn THREE[ROWS + 1] = {0, block_1_3, block_2_3, block_3_3, block_4_3,
                                         block_5_3, block_6_3, block_7_3, block_8_3};
static const block_fn ONE[ROWS + 1] = {0, block_1_1, block_2_1, block_3_1, block_4_1,
                                       block_5_1, block_6_1, block_7_1, block_8_1};
#endif

/*
 * y [rows, n] = x [rows, k] w^T (+ bias [n]) (ReLU where relu), all fp32 and contiguous;
 * rows at most MAX_ROWS. Returns 0, or -1 where it cannot run (no AVX-512, too many rows):
 * nothing is written then.
 */
int quanta_fp32_rows(float *y, const float *x, const float *w, const float *bias, int relu,
                     int64_t rows, int64_t n, int64_t k, int threads) {
#if QUANTA_AVX512
    if (rows < 1 || rows > MAX_ROWS) return -1;
    const int64_t blocks = n / 3;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            const int64_t r = rows - m0 < ROWS ? rows - m0 : ROWS;
            THREE[r](y + m0 * n, x + m0 * k, w, bias, relu, n, k, 3 * b);
        }
    }
    for (int64_t n0 = 3 * blocks; n0 < n; n0++) {
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            const int64_t r = rows - m0 < ROWS ? rows - m0 : ROWS;
            ONE[r](y + m0 * n, x + m0 * k, w, bias, relu, n, k, n0);
        }
    }
    return 0;
#else
    (void)y, (void)x, (void)w, (void)bias, (void)relu, (void)rows, (void)n, (void)k;
    (void)threads;
    return -1;
#endif
}
