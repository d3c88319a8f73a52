/* A decode step's decoder layers in one call: norm, q/k/v product (q/k norms), rotary
 * embedding, K/V store, paged attention (sliding window, soft-cap), output product, norm(s),
 * MLP (gated SiLU or GELU, or plain ReLU), layer after layer, with no Python between them.
 * Each layer's options are flags of its row in the layer table, so every family of the
 * layer kit (LLaMA, Qwen2/3, Mistral, Phi-3, Gemma 2) runs through the same loop.
 *
 * At batch 1 the weights stream in about 29 ms per SmolLM2-135M step, and the same step
 * dispatched from Python spent another 10-12 ms between those products: some 27 torch
 * operators and ctypes calls per layer, each a few microseconds, 30 layers deep. The
 * arithmetic here is not new: every operation is the kernel the Python path calls
 * (panel_linear.c, layer_ops.c, paged_decode.c), reached through the function pointers the
 * caller passes, so the chain's values are bit for bit the Python path's. What it removes is
 * the dispatch and the temporary tensors between them.
 *
 * Element type: bf16 activations (the panel kernel's), products bf16, int8 codes with fp32
 * scales (native-int8) or grouped int4 codes with fp16 scales and mins (native-int4).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*panel_bf16_fn)(uint16_t *, const uint16_t *, const uint16_t *, const uint16_t *,
                              int64_t, int64_t, int64_t, int);
typedef void (*panel_i8_fn)(uint16_t *, const uint16_t *, const int8_t *, const float *,
                            const uint16_t *, int64_t, int64_t, int64_t, int);
typedef int (*panel_i4_fn)(uint16_t *, const uint16_t *, const uint8_t *, const uint16_t *,
                           const uint16_t *, int64_t, int64_t, int64_t, int64_t, int);
typedef void (*norm_fn)(void *, void *, const void *, const void *, int64_t, int64_t, float, int);
typedef void (*norm_offset_fn)(void *, void *, const void *, const void *, int64_t, int64_t, float,
                               float, int);
typedef void (*layer_norm_fn)(void *, void *, const void *, const void *, const void *, int64_t,
                              int64_t, float, int);
typedef void (*rope_fn)(void *, const void *, const void *, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int);
typedef int (*attend_fn)(void *, const void *, const void *, const void *, const int64_t *,
                         const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                         int64_t, float, int);
typedef void (*gated_fn)(void *, const void *, int64_t, int64_t, int);
typedef void (*relu_fn)(void *, int64_t, int64_t, int);

/* The kernels, in the order of ``build``'s table in decode_chain.py. */
struct fns {
    panel_bf16_fn panel;
    panel_i8_fn panel_i8;
    panel_i4_fn panel_i4;
    norm_fn norm;
    norm_offset_fn norm_offset;
    layer_norm_fn layer_norm;
    rope_fn rope;
    attend_fn attend;
    gated_fn silu_mul;
    gated_fn gelu_tanh_mul;
    relu_fn relu;
};

enum { PRODUCT_BF16 = 0, PRODUCT_INT8 = 1, PRODUCT_INT4 = 2 };
/* A layer's norms: LLaMA's RMSNorm, Gemma's (offset + weight), LayerNorm with its bias. */
enum { NORM_RMS = 0, NORM_RMS_OFFSET = 1, NORM_LAYER = 2 };
/* Its MLP: gated (gate/up product, act(gate) * up, down), or plain (fc1, act in place, fc2). */
enum { MLP_SILU = 0, MLP_GELU_TANH = 1, MLP_RELU = 2 };

/* One projection: its packed weight, its scales (int8: fp32 per column; int4: the fp16
 * scales and mins of quanta_panel_i4) or NULL (bf16), its bias or NULL, which kernel reads
 * it, and (int4) its group size. */
struct product {
    const void *packed;
    const void *scales;
    const uint16_t *bias;
    int64_t kind;
    int64_t group;
};

struct norm {
    const uint16_t *weight;
    const uint16_t *bias; /* LayerNorm's, or NULL */
};

/* One layer, as the Python side lays it out (8-byte slots, LAYER_SLOTS each). The attention
 * output is normalised by post_attention before its residual add where pre_feedforward is set
 * (Gemma 2's sandwich: pre_feedforward then normalises the stream for the MLP, and
 * post_feedforward the MLP's output); otherwise post_attention does the add and the norm. */
struct layer {
    struct norm input, post_attention, pre_feedforward, post_feedforward;
    const uint16_t *q_norm, *k_norm; /* per-head RMSNorm of q and k before the rotation, or NULL */
    struct product qkv, o, gate_up, down;
    int64_t norm_kind, mlp_kind;
    int64_t rotary; /* how many of each q and k head's features rotate; 0: none */
    int64_t window; /* attend to the last `window` positions; 0: all */
    double eps, offset, scale, softcap; /* softcap 0: none */
};

enum { BF16 = 1 };

/* What a step's time is spent on, where the caller asks (timings: seconds per part,
 * added to): the profile of quanta_lab.bench.decode_profile. The calling thread's CPU time,
 * as the profile's other figures: on a shared machine a wall clock also counts the time other
 * processes hold the core. */
enum { T_NORMS, T_QKV, T_QK_NORM_ROPE, T_KV_STORE, T_ATTENTION, T_O, T_UP, T_ACTIVATION, T_DOWN,
       T_PARTS };

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Adds the time since *mark to timings[part] and moves the mark; nothing without timings. */
static void lap(double *timings, int part, double *mark) {
    if (!timings) return;
    const double now = seconds();
    timings[part] += now - *mark;
    *mark = now;
}

/* Returns 0, or -1 when the int4 kernel could not allocate its group sums. */
static int product(const struct fns *f, const struct product *p, uint16_t *y, const uint16_t *x,
                   int64_t rows, int64_t n, int64_t k, int threads) {
    switch (p->kind) {
    case PRODUCT_INT8:
        f->panel_i8(y, x, p->packed, p->scales, p->bias, rows, n, k, threads);
        return 0;
    case PRODUCT_INT4:
        return f->panel_i4(y, x, p->packed, p->scales, p->bias, rows, n, k, p->group, threads);
    default:
        f->panel(y, x, p->packed, p->bias, rows, n, k, threads);
        return 0;
    }
}

static void normalize(const struct fns *f, const struct layer *layer, const struct norm *n,
                      uint16_t *out, uint16_t *residual, const uint16_t *x, int64_t rows,
                      int64_t dim) {
    const float eps = (float)layer->eps;
    switch (layer->norm_kind) {
    case NORM_RMS_OFFSET:
        f->norm_offset(out, residual, x, n->weight, rows, dim, eps, (float)layer->offset, BF16);
        return;
    case NORM_LAYER:
        f->layer_norm(out, residual, x, n->weight, n->bias, rows, dim, eps, BF16);
        return;
    default:
        f->norm(out, residual, x, n->weight, rows, dim, eps, BF16);
    }
}

/*
 * Layers [first, last) of a decode step of `rows` single-token rows (row r at cache slot
 * slot_mapping[r], attending over slots[bounds[r]:bounds[r + 1]], the last `window` of them
 * in a windowed layer).
 *
 * x [rows, hidden]: the previous layer's MLP output, overwritten with the last layer's;
 * residual [rows, hidden]: the residual stream, or with `start` set (the model's first layer)
 * nothing yet: x is then the stream, copied into residual. shape: hidden, heads, kv_heads,
 * head_dim, inner. kv: layer 0's key cache [slots, kv_heads, head_dim]; a layer's value cache
 * lies value_offset elements after its key cache, the next layer's key cache layer_stride
 * elements on. cos, sin [rows, rotated features] (NULL where no layer rotates).
 *
 * timings: NULL, or T_PARTS seconds the step's parts add their CPU time to (lap).
 *
 * Returns 0, -1 when scratch space cannot be allocated, -2 when attention could not; the step
 * has then written K/V past the rows' computed tokens only, which a rerun writes again.
 */
int quanta_decode_chain(const int64_t *fn_table, const int64_t *layer_table, int64_t first,
                        int64_t last, const int64_t *shape, uint16_t *x, uint16_t *residual,
                        int start, const uint16_t *cos, const uint16_t *sin, uint16_t *kv,
                        int64_t layer_stride, int64_t value_offset, const int64_t *slot_mapping,
                        const int64_t *slots, const int64_t *bounds, int64_t rows,
                        int threads, double *timings) {
    const struct fns *f = (const struct fns *)fn_table;
    const struct layer *layers = (const struct layer *)layer_table;
    const int64_t hidden = shape[0], heads = shape[1], kv_heads = shape[2], dim = shape[3];
    const int64_t inner = shape[4];
    const int64_t q_width = heads * dim, kv_width = kv_heads * dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const int64_t widest = qkv_width > 2 * inner ? qkv_width : 2 * inner;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(rows * hidden));
    uint16_t *wide = malloc(sizeof(uint16_t) * (size_t)(rows * widest));
    uint16_t *q = malloc(sizeof(uint16_t) * (size_t)(rows * q_width));
    uint16_t *attn = malloc(sizeof(uint16_t) * (size_t)(rows * (q_width > inner ? q_width : inner)));
    uint16_t *o = malloc(sizeof(uint16_t) * (size_t)(rows * hidden));
    int status = 0;
    double mark = timings ? seconds() : 0.0;
    if (!h || !wide || !q || !attn || !o) {
        status = -1;
        goto done;
    }
    for (int64_t l = first; l < last; l++) {
        const struct layer *layer = &layers[l];
        const int sandwich = layer->pre_feedforward.weight != NULL;
        uint16_t *keys = kv + l * layer_stride, *values = keys + value_offset;
        if (start && l == first) {
            memcpy(residual, x, sizeof(uint16_t) * (size_t)(rows * hidden));
            normalize(f, layer, &layer->input, h, residual, NULL, rows, hidden);
        } else {
            normalize(f, layer, &layer->input, h, residual, x, rows, hidden);
        }
        lap(timings, T_NORMS, &mark);
        if (product(f, &layer->qkv, wide, h, rows, qkv_width, hidden, threads)) {
            status = -1;
            goto done;
        }
        lap(timings, T_QKV, &mark);
        if (layer->q_norm) { /* in place: the kernel reads a row before writing it */
            for (int64_t r = 0; r < rows; r++) {
                uint16_t *row = wide + r * qkv_width;
                f->norm(row, row, NULL, layer->q_norm, heads, dim, (float)layer->eps, BF16);
                f->norm(row + q_width, row + q_width, NULL, layer->k_norm, kv_heads, dim,
                        (float)layer->eps, BF16);
            }
        }
        if (layer->rotary)
            f->rope(wide, cos, sin, rows, heads + kv_heads, layer->rotary, dim, qkv_width, BF16);
        lap(timings, T_QK_NORM_ROPE, &mark);
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *row = wide + r * qkv_width;
            memcpy(keys + slot_mapping[r] * kv_width, row + q_width, sizeof(uint16_t) * kv_width);
            memcpy(values + slot_mapping[r] * kv_width, row + q_width + kv_width,
                   sizeof(uint16_t) * kv_width);
            memcpy(q + r * q_width, row, sizeof(uint16_t) * q_width);
        }
        lap(timings, T_KV_STORE, &mark);
        if (f->attend(attn, q, keys, values, slots, bounds, rows, heads, kv_heads, dim, kv_width,
                      (float)layer->scale, layer->window, (float)layer->softcap, BF16) != 0) {
            status = -2;
            goto done;
        }
        lap(timings, T_ATTENTION, &mark);
        if (product(f, &layer->o, o, attn, rows, hidden, q_width, threads)) {
            status = -1;
            goto done;
        }
        lap(timings, T_O, &mark);
        if (sandwich) {
            normalize(f, layer, &layer->post_attention, o, o, NULL, rows, hidden);
            normalize(f, layer, &layer->pre_feedforward, h, residual, o, rows, hidden);
        } else {
            normalize(f, layer, &layer->post_attention, h, residual, o, rows, hidden);
        }
        lap(timings, T_NORMS, &mark);
        const uint16_t *activated = attn;
        if (layer->mlp_kind == MLP_RELU) {
            if (product(f, &layer->gate_up, wide, h, rows, inner, hidden, threads)) {
                status = -1;
                goto done;
            }
            lap(timings, T_UP, &mark);
            f->relu(wide, rows, inner, BF16);
            activated = wide;
        } else {
            if (product(f, &layer->gate_up, wide, h, rows, 2 * inner, hidden, threads)) {
                status = -1;
                goto done;
            }
            lap(timings, T_UP, &mark);
            (layer->mlp_kind == MLP_GELU_TANH ? f->gelu_tanh_mul : f->silu_mul)(attn, wide, rows,
                                                                               inner, BF16);
        }
        lap(timings, T_ACTIVATION, &mark);
        if (product(f, &layer->down, x, activated, rows, hidden, inner, threads)) {
            status = -1;
            goto done;
        }
        lap(timings, T_DOWN, &mark);
        if (sandwich) normalize(f, layer, &layer->post_feedforward, x, x, NULL, rows, hidden);
        lap(timings, T_NORMS, &mark);
    }
done:
    free(h);
    free(wide);
    free(q);
    free(attn);
    free(o);
    return status;
}
