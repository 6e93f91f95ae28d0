/* One Llama-family transformer block for a few consecutive positions of one sequence, in a
 * single call (issue 16, "fewer, fused kernels per layer").
 *
 * Decoding one token runs ~15 small operations per layer besides the four weight products;
 * through torch each costs a dispatch from caches that the previous multi-megabyte product
 * flushed (measured: ~0.6 ms per layer on the embedded 30-layer model, as much as the
 * products themselves). This file runs the whole block - RMSNorm, fused q/k/v product,
 * rotary embedding (half-split convention), the key/value cache write, grouped-query
 * attention over the cache, output product and residual, RMSNorm, SwiGLU MLP and residual -
 * on plain float arrays, calling the weight products of kernels.c.
 *
 * Exactness: every row's arithmetic depends on that row, its own position and the cache
 * only, in a fixed order (the products are row-invariant, see kernels.c; norms, rotary,
 * softmax and the attention sums are computed row by row with fixed summation orders). So a
 * block over M rows gives each row bit-for-bit what M calls of one row give: plain decoding
 * and the verification of M drafts agree exactly. No -ffast-math: the order written is the
 * order computed.
 */

#include "gemm.h" /* run_tasks (pool.c); the products of kernels.c, the reduce of reduce.c */
#ifdef __AVX__
#include <immintrin.h>
#endif
#include "half.h"

/* Whether the blocks' int8 / int4 products round their activations to int8 first (kernels.c:
 * q8a8 / q4a8, as llama.cpp computes Q8_0 / Q4_x); on unless switched off. One setting for
 * every block of the process, so that plain steps and verification chunks round alike. */
static int act8 = 1;

int exitlm_set_int8_activations(int on) {
    int prev = act8;
    act8 = on != 0;
    return prev;
}

int exitlm_int8_activations(void) { return act8; }

/* x (M, k) times w^T; grouped weights with int8 activations when a8 (kernels.c's q8a8/q4a8),
 * else with float32 ones. */
static int weight_product(const exitlm_weight *w, const float *x, float *y, int64_t M,
                          int nthreads, int a8) {
    switch (w->fmt) {
    case 0: return exitlm_gemm_f32(x, (const float *)w->w, y, M, w->n, w->k, nthreads);
    case 1: return exitlm_gemm_f16(x, (const uint16_t *)w->w, y, M, w->n, w->k, nthreads);
    case 2:
        return (a8 ? exitlm_gemm_q8a8 : exitlm_gemm_q8)(x, (const int8_t *)w->w, w->scales, y,
                                                        M, w->n, w->k, nthreads);
    case 3:
        return (a8 ? exitlm_gemm_q4a8 : exitlm_gemm_q4)(x, (const uint8_t *)w->w, w->scales,
                                                        w->mins, y, M, w->n, w->k, nthreads);
    case 4:
    case 5:
        return (a8 ? exitlm_gemm_q4pa8 : exitlm_gemm_q4p)(x, (const uint8_t *)w->w, w->scales,
                                                          w->mins, w->fmt == 5, y, M, w->n, w->k,
                                                          nthreads);
    default: return -3;
    }
}

/* A block's or a head's product: int8 activations as the process setting says (for quantized
 * weights; a float head ignores it), as NativeRunner.project takes the heads on the Python
 * side. */
static int product(const exitlm_weight *w, const float *x, float *y, int64_t M, int nthreads) {
    return weight_product(w, x, y, M, nthreads, act8);
}

/* ---- Vectors, dot products and attention over the cache ---------------------------------
 * Attention keeps the arithmetic of the plain loops (dot() per position; o[i] += p_t * v_t[i] in order
 * of t from o = 0), laid out for the processor: a query meets four positions at once (four
 * independent sums instead of one chain of dependent adds), and the output's 64 floats stay
 * in registers over all positions instead of a load and store per position. Lanes of GCC's
 * vector types compute exactly what the scalar code computes, in every build. */
typedef float v8f __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* unaligned loads/stores */

static inline v8f load8(const float *p) { return *(const v8u *)p; }

typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f splat8(float c) { return (v8f){c, c, c, c, c, c, c, c}; }

/* Sixteen lanes, for the loops whose lanes are independent (softmax, SiLU, value sums): one
 * 512-bit register in AVX-512 builds, two of 256 bits in the others. Macros, not functions: no
 * function takes or returns such a vector (GCC notes an ABI change for those without AVX-512). */
typedef float v16f __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define LOAD16(p) (*(const v16u *)(p))
#define SPLAT16(c) ((v16f){(c), (c), (c), (c), (c), (c), (c), (c), (c), (c), (c), (c), (c), (c), (c), (c)})

/* e^x in eight lanes, the same bits in every build (and for one value in lane 0 as for it
 * among seven others): Cephes' expf - n = floor(x log2 e + 1/2), r = x - n ln 2 in two
 * parts (Cody-Waite), a degree-7 polynomial in r (relative error ~1e-7), times 2^n built in
 * the exponent bits. Below -87 it returns 0 (e^-87 ~ 1.6e-38: nothing a softmax weight or a
 * SiLU keeps); above 88 it saturates at e^88; a NaN stays NaN. libm's expf is a scalar call
 * per value, the attention's softmax and the MLP's SiLU call it for every position and every
 * hidden unit. */
/* The operations, on vectors of eight lanes (exp8) or sixteen (EXP_LANES(v16f, v16i, ...)):
 * the same per lane. OUT = e^X. */
#define EXP_LANES(VF, VI, X, OUT)                                                              \
    do {                                                                                       \
        VF x_ = (X);                                                                           \
        const VF lo_ = (VF){0} - 87.0f, hi_ = (VF){0} + 88.0f;                                 \
        const VI tiny_ = x_ < lo_;                                                             \
        const VI big_ = x_ > hi_;                                                              \
        x_ = (VF)(((VI)x_ & ~big_) | ((VI)hi_ & big_));                                        \
        x_ = (VF)(((VI)x_ & ~tiny_) | ((VI)lo_ & tiny_));                                      \
        VF fx_ = x_ * 1.44269504088896341f + 0.5f;                                             \
        VI n_ = __builtin_convertvector(fx_, VI); /* truncation; floor below */               \
        n_ += (VI)(__builtin_convertvector(n_, VF) > fx_); /* -1 where it rounded up */       \
        const VF fn_ = __builtin_convertvector(n_, VF);                                        \
        x_ = x_ - fn_ * 0.693359375f;                                                          \
        x_ = x_ - fn_ * -2.12194440e-4f;                                                       \
        const VF z_ = x_ * x_;                                                                 \
        VF y_ = (VF){0} + 1.9875691500e-4f;                                                    \
        y_ = y_ * x_ + 1.3981999507e-3f;                                                       \
        y_ = y_ * x_ + 8.3334519073e-3f;                                                       \
        y_ = y_ * x_ + 4.1665795894e-2f;                                                       \
        y_ = y_ * x_ + 1.6666665459e-1f;                                                       \
        y_ = y_ * x_ + 5.0000001201e-1f;                                                       \
        y_ = y_ * z_ + x_ + 1.0f;                                                              \
        const VF scale_ = (VF)((n_ + 127) << 23);                                              \
        (OUT) = (VF)((VI)(y_ * scale_) & ~tiny_);                                              \
    } while (0)

static inline v8f exp8(v8f x) {
    v8f out;
    EXP_LANES(v8f, v8i, x, out);
    return out;
}

/* exp8 of one value. */
static inline float exp1(float x) { return exp8(splat8(x))[0]; }

/* The fixed tree over the eight lanes of one partial-sum vector. */
static inline float tree8(v8f s) {
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

/* sum_i a[i] * b[i] with eight partial sums (lane i mod 8) combined in tree8's fixed tree. */
static float dot(const float *a, const float *b, int64_t n) {
    v8f s = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s += load8(a + i) * load8(b + i);
    for (; i < n; i++) s[i & 7] += a[i] * b[i];
    return tree8(s);
}

typedef float v4f __attribute__((vector_size(16)));
typedef float v4u __attribute__((vector_size(16), aligned(4))); /* unaligned stores */

/* tree8 of four partial-sum vectors at once, lane j of the result tree8 of the j-th: the
 * same adds in the same order ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)), on four
 * lanes instead of one. */
static inline v4f tree8x4(v8f a, v8f b, v8f c, v8f d) {
#ifdef __AVX__
    /* each vector's x_c = lane c + lane c + 4 in one add, a 4 x 4 transposition, then the same
     * two levels of adds (of the element-wise code below GCC makes ~60 scalar instructions:
     * with these, 8 rows' attention over 768 positions took 0.9x the time) */
    __m128 u0 = _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
    __m128 u1 = _mm_add_ps(_mm256_castps256_ps128((__m256)b), _mm256_extractf128_ps((__m256)b, 1));
    __m128 u2 = _mm_add_ps(_mm256_castps256_ps128((__m256)c), _mm256_extractf128_ps((__m256)c, 1));
    __m128 u3 = _mm_add_ps(_mm256_castps256_ps128((__m256)d), _mm256_extractf128_ps((__m256)d, 1));
    _MM_TRANSPOSE4_PS(u0, u1, u2, u3); /* u_c: x_c of a, b, c, d */
    return (v4f)_mm_add_ps(_mm_add_ps(u0, u1), _mm_add_ps(u2, u3));
#else
    const v4f x0 = {a[0] + a[4], b[0] + b[4], c[0] + c[4], d[0] + d[4]};
    const v4f x1 = {a[1] + a[5], b[1] + b[5], c[1] + c[5], d[1] + d[5]};
    const v4f x2 = {a[2] + a[6], b[2] + b[6], c[2] + c[6], d[2] + d[6]};
    const v4f x3 = {a[3] + a[7], b[3] + b[7], c[3] + c[7], d[3] + d[7]};
    return (x0 + x1) + (x2 + x3);
#endif
}

/* The largest of x[0..n) (NaNs ignored, -inf for none); the maximum does not depend on the
 * order it is taken in, so eight lanes find it. */
static float max_of(const float *x, int64_t n) {
    v8f m = splat8(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const v8f v = load8(x + t);
        const v8i gt = v > m;
        m = (v8f)(((v8i)v & gt) | ((v8i)m & ~gt));
    }
    float mx = -INFINITY;
    for (int j = 0; j < 8; j++)
        if (m[j] > mx) mx = m[j];
    for (; t < n; t++)
        if (x[t] > mx) mx = x[t];
    return mx;
}

/* sum_t x[t] with eight partial sums (lane t mod 8) combined in tree8's fixed tree. */
static float sum_of(const float *x, int64_t n) {
    v8f s = {0};
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) s += load8(x + t);
    for (; t < n; t++) s[t & 7] += x[t];
    return tree8(s);
}

/* scores[t] = dot(q, k_t) * scale for t < n (k_t = k + t * hd); returns their maximum. */
static float attention_scores(const float *q, const float *k, int64_t n, int64_t hd,
                              float scale, float *scores) {
    int64_t t = 0;
    if (hd % 8 == 0)
        for (; t + 4 <= n; t += 4) {
            const float *k0 = k + t * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
            v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            for (int64_t i = 0; i < hd; i += 8) {
                const v8f qv = load8(q + i);
                s0 += qv * load8(k0 + i);
                s1 += qv * load8(k1 + i);
                s2 += qv * load8(k2 + i);
                s3 += qv * load8(k3 + i);
            }
            const v4f sc = {scale, scale, scale, scale};
            *(v4u *)(scores + t) = tree8x4(s0, s1, s2, s3) * sc;
        }
    for (; t < n; t++) scores[t] = dot(q, k + t * hd, hd) * scale;
    return max_of(scores, n);
}

/* o[i] = sum_t p[t] * v_t[i] over t < n in order of t, from 0 (v_t = v + t * hd); one pass
 * over v for 64 values a position (eight accumulators), else 32 at a time. */
static void attention_values(const float *p, const float *v, int64_t n, int64_t hd, float *o) {
    int64_t i = 0;
    if (hd == 64) { /* sixteen lanes a vector: the lanes' sums are independent */
        v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t t = 0; t < n; t++) {
            const float *vt = v + t * 64;
            const float pv = p[t];
            const v16f pt = SPLAT16(pv);
            a0 += pt * LOAD16(vt);
            a1 += pt * LOAD16(vt + 16);
            a2 += pt * LOAD16(vt + 32);
            a3 += pt * LOAD16(vt + 48);
        }
        *(v16u *)(o) = a0;
        *(v16u *)(o + 16) = a1;
        *(v16u *)(o + 32) = a2;
        *(v16u *)(o + 48) = a3;
        return;
    }
    for (; i + 32 <= hd; i += 32) {
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t t = 0; t < n; t++) {
            const float *vt = v + t * hd + i;
            const v8f pt = splat8(p[t]);
            a0 += pt * load8(vt);
            a1 += pt * load8(vt + 8);
            a2 += pt * load8(vt + 16);
            a3 += pt * load8(vt + 24);
        }
        *(v8u *)(o + i) = a0;
        *(v8u *)(o + i + 8) = a1;
        *(v8u *)(o + i + 16) = a2;
        *(v8u *)(o + i + 24) = a3;
    }
    for (; i < hd; i++) {
        float a = 0.0f;
        for (int64_t t = 0; t < n; t++) a += p[t] * v[t * hd + i];
        o[i] = a;
    }
}

/* RMSNorm of one row: x * rsqrt(mean(x^2) + eps) * g. */
static void rms_norm(const float *x, const float *g, float eps, float *out, int64_t n) {
    float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * g[i];
}

/* Rotate one head vector v (d) in place by its position's cos / signed sin tables:
 * v * cos + [v2, v1] * [-sin, sin] (the half-split convention of exitlm.model.layers). */
static void rope(float *v, const float *cos_t, const float *ssin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos_t[i] + b * ssin[i];
        v[i + half] = b * cos_t[i + half] + a * ssin[i + half];
    }
}

/* A block's attention runs on several threads (nthreads > 1) in at most ATT_PARTS parts, when
 * its (head, row, position) triples reach ATT_PARALLEL_FROM (below, the hand-off costs more than
 * it saves: a triple is ~15-60 cycles). */
#ifndef ATT_PARTS
#define ATT_PARTS 16
#endif
#ifndef ATT_PARALLEL_FROM
#define ATT_PARALLEL_FROM 1024
#endif

/* Bytes of scratch a block over M rows attending to at most `positions` positions needs. */
int64_t exitlm_block_scratch(const exitlm_block_dims *d, int64_t M, int64_t positions) {
    int64_t qkv = (d->heads + 2 * d->kv_heads) * d->head_dim;
    int64_t floats = M * d->dim            /* normed input */
                     + M * qkv             /* q, k, v */
                     + M * d->heads * d->head_dim /* attention output */
                     + M * d->dim          /* product output */
                     + M * 2 * d->hidden   /* gate and up */
                     + M * d->hidden       /* silu(gate) * up */
                     + ATT_PARTS * positions; /* scores of one head, for each part */
    return floats * (int64_t)sizeof(float);
}

/* The most positions a row of a block call attends to (the scores each part needs). */
static int64_t positions_of(int64_t M, int64_t start, const int64_t *pos) {
    if (pos == NULL) return start + M;
    int64_t mx = 0;
    for (int64_t m = 0; m < M; m++) mx = pos[m] + 1 > mx ? pos[m] + 1 : mx;
    return mx;
}

/* Attention of a block's rows (block_rows): the (head, row) items, head by head, then row by
 * row - the rows of one sequence read the same keys and values of a head, which then stay in
 * the caches from one row to the next (verifying d drafts: d + 1 rows; a head's keys and values
 * at a context of n positions: 2 n head_dim floats). Each item is computed whole by one thread
 * of a call (run_tasks), each part with its own scores, so the bits do not depend on the
 * thread count. */
typedef struct {
    const float *qkv;
    const float *kc, *vc;
    float *att, *scores;
    int64_t ss; /* floats of each part's scores: the most positions a row attends to */
    int64_t M, H, hd, QKV, group, head_stride, start;
    const int64_t *pos, *off;
    float scale;
} att_ctx;

static void attend_items(const void *c, int64_t i0, int64_t i1, int part) {
    const att_ctx *a = (const att_ctx *)c;
    const int64_t M = a->M, H = a->H, hd = a->hd;
    float *scores = a->scores + part * a->ss;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t hh = i / M, m = i % M;
        /* attends to positions 0 .. its own of its cache row */
        const int64_t n_pos = (a->pos != NULL ? a->pos[m] : a->start + m) + 1;
        const int64_t o = a->off != NULL ? a->off[m] : 0;
        const float *row = a->qkv + m * a->QKV;
        const float *kh = a->kc + o + (hh / a->group) * a->head_stride;
        const float *vh = a->vc + o + (hh / a->group) * a->head_stride;
        const float mx = attention_scores(row + hh * hd, kh, n_pos, hd, a->scale, scores);
        int64_t t = 0;
        for (; t + 16 <= n_pos; t += 16) {
            v16f e;
            EXP_LANES(v16f, v16i, LOAD16(scores + t) - SPLAT16(mx), e);
            *(v16u *)(scores + t) = e;
        }
        for (; t + 8 <= n_pos; t += 8)
            *(v8u *)(scores + t) = exp8(load8(scores + t) - splat8(mx));
        for (; t < n_pos; t++) scores[t] = exp1(scores[t] - mx);
        const float total = sum_of(scores, n_pos);
        float *out = a->att + m * H * hd + hh * hd;
        attention_values(scores, vh, n_pos, hd, out);
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < hd; j++) out[j] *= inv;
    }
}

/* h (M, dim) <- block(h) for M rows: row m at position pos[m] of the cache row that starts
 * off[m] floats after kc / vc (pos NULL: positions start .. start+M-1; off NULL: one cache row,
 * as exitlm_llama_block).  Rows of several sequences (a batch) each attend to positions
 * 0 .. pos[m] of their own cache row; the rows of one sequence are consecutive, in order, and
 * every row's keys/values are written before any row attends, so row m also sees the rows
 * before it of its sequence.  Every row's arithmetic is that of exitlm_llama_block whatever
 * rows share the call: a batch's rows get the bits of their sequences decoded alone. */
static int block_rows(float *h, int64_t M, const exitlm_block_dims *d, const float *norm1,
                      const float *norm2, const exitlm_weight *wqkv, const exitlm_weight *wo,
                      const exitlm_weight *w_in, const exitlm_weight *w_out,
                      const float *cos_t, const float *ssin, float *kc, float *vc,
                      int64_t head_stride, int64_t start, const int64_t *pos,
                      const int64_t *off, float *scratch, int nthreads,
                      struct exitlm_reduce *red) {
    const int64_t D = d->dim, H = d->heads, Hkv = d->kv_heads, hd = d->head_dim;
    const int64_t F = d->hidden, QKV = (H + 2 * Hkv) * hd, group = H / Hkv;
    float *xn = scratch;
    float *qkv = xn + M * D;
    float *att = qkv + M * QKV;
    float *tmp = att + M * H * hd;
    float *gu = tmp + M * D;
    float *act = gu + M * 2 * F;
    float *scores = act + M * F;
    int rc;

    for (int64_t m = 0; m < M; m++) rms_norm(h + m * D, norm1, d->eps, xn + m * D, D);
    if ((rc = product(wqkv, xn, qkv, M, nthreads)) != 0) return rc;
    for (int64_t m = 0; m < M; m++) {
        float *row = qkv + m * QKV;
        const int64_t p = pos != NULL ? pos[m] : start + m, o = off != NULL ? off[m] : 0;
        for (int64_t j = 0; j < H + Hkv; j++) rope(row + j * hd, cos_t + m * hd, ssin + m * hd, hd);
        for (int64_t j = 0; j < Hkv; j++) {
            memcpy(kc + o + j * head_stride + p * hd, row + (H + j) * hd, hd * sizeof(float));
            memcpy(vc + o + j * head_stride + p * hd, row + (H + Hkv + j) * hd,
                   hd * sizeof(float));
        }
    }
    const att_ctx ac = {qkv, kc, vc, att, scores, positions_of(M, start, pos), M, H, hd, QKV,
                        group, head_stride, start, pos, off, d->attn_scale};
    if (nthreads > 1 && H * M * ac.ss >= ATT_PARALLEL_FROM)
        run_tasks(attend_items, &ac, H * M, ATT_PARTS, nthreads);
    else
        attend_items(&ac, 0, H * M, 0);
    if ((rc = product(wo, att, tmp, M, nthreads)) != 0) return rc;
    if (red != NULL && (rc = exitlm_reduce_sum(red, tmp, M * D)) != 0) return rc;
    for (int64_t i = 0; i < M * D; i++) h[i] += tmp[i];
    for (int64_t m = 0; m < M; m++) rms_norm(h + m * D, norm2, d->eps, xn + m * D, D);
    if ((rc = product(w_in, xn, gu, M, nthreads)) != 0) return rc;
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * F, *u = g + F;
        float *a = act + m * F;
        int64_t j = 0;
        for (; j + 16 <= F; j += 16) {
            const v16f gj = LOAD16(g + j);
            v16f e;
            EXP_LANES(v16f, v16i, -gj, e);
            *(v16u *)(a + j) = gj / (SPLAT16(1.0f) + e) * LOAD16(u + j);
        }
        for (; j + 8 <= F; j += 8) {
            const v8f gj = load8(g + j);
            *(v8u *)(a + j) = gj / (splat8(1.0f) + exp8(-gj)) * load8(u + j);
        }
        for (; j < F; j++) a[j] = g[j] / (1.0f + exp1(-g[j])) * u[j];
    }
    if ((rc = product(w_out, act, tmp, M, nthreads)) != 0) return rc;
    if (red != NULL && (rc = exitlm_reduce_sum(red, tmp, M * D)) != 0) return rc;
    for (int64_t i = 0; i < M * D; i++) h[i] += tmp[i];
    return 0;
}

/* h (M, dim) <- block(h) for positions start .. start+M-1 of one sequence.
 * cos_t, ssin: (M, head_dim) rotary tables of those positions. kc, vc: this sequence's cache
 * for this layer, (kv_heads, positions_capacity, head_dim) with `head_stride` floats between
 * kv heads; the block writes positions start .. start+M-1 and reads 0 .. start+M-1.
 * red: NULL, or a tensor-parallel rank's shard (its heads, its MLP rows; EE-LLM Sec. 3.1 /
 * Megatron-LM): the output and MLP-out partial products are summed over the ranks
 * (reduce.c) before their residuals. */
int exitlm_llama_block(float *h, int64_t M, const exitlm_block_dims *d, const float *norm1,
                       const float *norm2, const exitlm_weight *wqkv, const exitlm_weight *wo,
                       const exitlm_weight *w_in, const exitlm_weight *w_out,
                       const float *cos_t, const float *ssin, float *kc, float *vc,
                       int64_t head_stride, int64_t start, float *scratch, int nthreads,
                       struct exitlm_reduce *red) {
    return block_rows(h, M, d, norm1, norm2, wqkv, wo, w_in, w_out, cos_t, ssin, kc, vc,
                      head_stride, start, NULL, NULL, scratch, nthreads, red);
}

static int blocks_rows(float *h, int64_t M, int64_t n, const exitlm_layer *layers,
                       const float *cos_t, const float *ssin, int64_t start, const int64_t *pos,
                       const int64_t *off, float *scratch, int nthreads, int half_stream) {
    for (int64_t i = 0; i < n; i++) {
        const exitlm_layer *L = &layers[i];
        int rc = block_rows(h, M, L->d, L->norm1, L->norm2, L->wqkv, L->wo, L->w_in, L->w_out,
                            cos_t, ssin, L->kc, L->vc, L->head_stride, start, pos, off, scratch,
                            nthreads, L->red);
        if (rc != 0) return rc;
        /* a float16 model hands each block its input rounded to float16 */
        if (half_stream) exitlm_round_to_half(h, M * L->d->dim);
    }
    return 0;
}

/* h (M, dim) <- layers[n-1](...layers[0](h)): consecutive blocks of one sequence in one call,
 * each exactly as exitlm_llama_block computes it (the same function, in order), so a chain
 * gives the bits of its layers called one by one. scratch: the largest need of the layers.
 * half_stream: round h to float16 after every block (exitlm_round_to_half), as a float16
 * model's blocks called one by one do. */
int exitlm_llama_blocks(float *h, int64_t M, int64_t n, const exitlm_layer *layers,
                        const float *cos_t, const float *ssin, int64_t start, float *scratch,
                        int nthreads, int half_stream) {
    return blocks_rows(h, M, n, layers, cos_t, ssin, start, NULL, NULL, scratch, nthreads,
                       half_stream);
}

/* The same for M rows of several sequences (a batch; see block_rows): row m at position pos[m]
 * of the cache row off[m] floats after each layer's kc / vc; cos_t, ssin hold each row's
 * rotary table row. */
int exitlm_llama_blocks_rows(float *h, int64_t M, int64_t n, const exitlm_layer *layers,
                             const float *cos_t, const float *ssin, const int64_t *pos,
                             const int64_t *off, float *scratch, int nthreads, int half_stream) {
    return blocks_rows(h, M, n, layers, cos_t, ssin, 0, pos, off, scratch, nthreads,
                       half_stream);
}

/* ---- Chains: n greedy steps through layers and a head, in one call -------------------- */

/* Row `id` of a token embedding of any format, as exitlm dequantizes it on lookup
 * (quant.py): f32 copied, f16 converted (exactly), q8 `q * scale`, q4 `nibble * scale + min` (each op rounded; this
 * file is compiled in ISO C mode, so no contraction into fused multiply-adds). */
static int embed_row(const exitlm_weight *e, int64_t id, float *out) {
    const int64_t K = e->k, G = K / 32;
    if (id < 0 || id >= e->n) return -4;
    switch (e->fmt) {
    case 0: memcpy(out, (const float *)e->w + id * K, K * sizeof(float)); return 0;
    case 1: {
        const uint16_t *row = (const uint16_t *)e->w + id * K;
        for (int64_t k = 0; k < K; k++) out[k] = half_to_float(row[k]);
        return 0;
    }
    case 2: {
        const int8_t *q = (const int8_t *)e->w + id * K;
        const float *s = e->scales + id * G;
        for (int64_t k = 0; k < K; k++) out[k] = (float)q[k] * s[k / 32];
        return 0;
    }
    case 3: {
        const uint8_t *q = (const uint8_t *)e->w + id * (K / 2);
        const float *s = e->scales + id * G, *mn = e->mins != NULL ? e->mins + id * G : NULL;
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < 16; j++) {
                const uint8_t b = q[g * 16 + j];
                const float m = mn != NULL ? mn[g] : -8.0f * s[g]; /* Q4_0 (q4_min) */
                out[g * 32 + j] = (float)(b & 15) * s[g] + m;
                out[g * 32 + j + 16] = (float)(b >> 4) * s[g] + m;
            }
        return 0;
    }
    default: return -3;
    }
}

/* Index of the largest of y[0..n-1], the first one on ties, a NaN before any number (what
 * torch.argmax returns). */
static int64_t argmax(const float *y, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++) {
        if (isnan(y[best])) break;
        if (isnan(y[i]) || y[i] > y[best]) best = i;
    }
    return best;
}

/* A greedy chain of one sequence: from token `token` at position `start`, n steps through
 * the first `n_layers` layers, each followed by the head (RMSNorm + output embedding) whose
 * argmax is the next step's token; the hidden state after the layers is kept for every step:
 *
 *   for j = 0..n:  h = embed(token_j); h = layers(h) at position start + j (writing their
 *                  cache); hidden[j] = h; if j < n: token_{j+1} = tokens[j] =
 *                  ids[argmax(head(rms_norm(h)))] (ids: the token ids of head's rows, a
 *                  ranked draft vocabulary; NULL: row r is token r).
 *
 * With min_conf > 0 the chain ends early: a draft whose softmax probability under the head
 * is below min_conf is the last one (its step still runs the layers, so that its hidden state
 * is there). *steps receives the number of drafts made.
 *
 * (LayerSkip Sec. 4.3.1's self-drafting is such a chain through the first E layers; a plain
 * decoding step is one with n == 0; a PPD branch one with n == 0 through the first d - d_bar
 * layers.) cos_table, ssin_table: rotary tables (rows by position, head_dim each) covering
 * start + n. work: dim + head->n floats. With n == 0 norm, head and work are unused and may be
 * NULL. The layers are computed by exitlm_llama_block as a chain of blocks computes them (same
 * bits); the norm is this file's rms_norm, whose summation order differs from torch's mean, so
 * a step's logits may differ from torch's in the last bits. */
static float confidence(const float *y, int64_t n, int64_t *top);

int exitlm_chain(int64_t token, int64_t n, int64_t n_layers, const exitlm_layer *layers,
                 const float *cos_table, const float *ssin_table, int64_t start,
                 const exitlm_weight *embed, const float *norm, float eps,
                 const exitlm_weight *head, const int64_t *ids, float min_conf,
                 int64_t *steps, float *hidden, int64_t *tokens, float *work, float *scratch,
                 int nthreads) {
    if (n_layers < 1) return -5;
    const int64_t D = layers[0].d->dim, hd = layers[0].d->head_dim;
    if (embed->k != D || (n > 0 && (head == NULL || head->k != D))) return -5;
    float *xn = work, *logits = work + D;
    const int half_stream = embed->fmt == 1; /* a float16 model: a float16 stream */
    for (int64_t j = 0;; j++) {
        float *h = hidden + j * D;
        int rc = embed_row(embed, token, h);
        if (rc != 0) return rc;
        const int64_t pos = start + j;
        rc = exitlm_llama_blocks(h, 1, n_layers, layers, cos_table + pos * hd,
                                 ssin_table + pos * hd, pos, scratch, nthreads, half_stream);
        if (rc != 0) return rc;
        if (j == n) {
            *steps = n;
            return 0;
        }
        rms_norm(h, norm, eps, xn, D);
        if ((rc = product(head, xn, logits, 1, nthreads)) != 0) return rc;
        int64_t col;
        if (min_conf > 0.0f) {  /* an unsure draft is the last one */
            const float conf = confidence(logits, head->n, &col);
            if (!(conf >= min_conf) && j + 1 < n) n = j + 1;
        } else {
            col = argmax(logits, head->n);
        }
        token = tokens[j] = ids != NULL ? ids[col] : col;  /* a ranked draft vocabulary */
    }
}

/* ---- Segments: layers over pending positions, probed at their bounds --------------------- */

/* The head's confidence in its own top token: max softmax(y) = 1 / sum_i exp(y_i - max y),
 * and that token (argmax, first on ties). A NaN makes the confidence NaN (never reaches a
 * threshold). */
static float confidence(const float *y, int64_t n, int64_t *top) {
    *top = argmax(y, n);
    const float mx = y[*top];
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) total += expf(y[i] - mx);
    return 1.0f / total;
}

/* One position's forward through the layers of one sequence as segments, each over the
 * positions whose keys/values its first layer is missing (EE-LLM Sec. 4 / App. D.3's KV
 * recomputation: positions that left at an earlier exit join the next forward from the depth
 * they reached), probing the head at every inner bound.
 *
 * hidden: (capacity, dim) rows, row p the state of position p at the depth it has reached (row
 * q, the position fed now, holds its embedding). bounds[0..n_seg]: layer bounds 0 < ... < L;
 * starts[i]: the first position segment i (layers bounds[i] .. bounds[i+1]) runs; rows
 * starts[i] .. q are updated in place. If probe, after every segment but the last the head
 * (RMSNorm + output embedding) gives row q's logits, and when their confidence reaches
 * stop_prob the call returns there. out[0]: segments run, out[1]: the bound probed last
 * successfully (0: none; row q then holds the last layer's output), out[2]: that probe's top
 * token; the probe's logits are left in work + dim. cos_table/ssin_table cover position q;
 * work: dim + head->n floats; scratch: exitlm_block_scratch for q - min(starts) + 1 rows. */
int exitlm_segments(float *hidden, int64_t q, const int64_t *starts, const int64_t *bounds,
                    int64_t n_seg, int probe, float stop_prob, const exitlm_layer *layers,
                    const float *cos_table, const float *ssin_table, const float *norm,
                    float eps, const exitlm_weight *head, float *work, float *scratch,
                    int nthreads, int64_t *out) {
    const int64_t D = layers[0].d->dim, hd = layers[0].d->head_dim;
    const int64_t L = bounds[n_seg];
    if (head->k != D) return -5;
    float *xn = work, *logits = work + D;
    out[0] = 0;
    out[1] = 0;
    out[2] = -1;
    for (int64_t i = 0; i < n_seg; i++) {
        const int64_t a = bounds[i], e = bounds[i + 1], s = starts[i];
        if (s < 0 || s > q || e <= a) return -5;
        int rc = exitlm_llama_blocks(hidden + s * D, q - s + 1, e - a, layers + a,
                                     cos_table + s * hd, ssin_table + s * hd, s, scratch,
                                     nthreads, 0);
        if (rc != 0) return rc;
        out[0] = i + 1;
        if (!probe || e >= L) continue;
        rms_norm(hidden + q * D, norm, eps, xn, D);
        if ((rc = product(head, xn, logits, 1, nthreads)) != 0) return rc;
        int64_t top;
        if (confidence(logits, head->n, &top) >= stop_prob) {
            out[1] = e;
            out[2] = top;
            return 0;
        }
    }
    return 0;
}
