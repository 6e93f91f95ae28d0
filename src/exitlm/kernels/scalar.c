/* Products of builds without AVX2 (any x86-64, other architectures): every (x row, W row) pair
 * computed lane by lane with fmaf, which rounds like the vector FMA, in the order kernels.c's
 * header fixes, so these builds give the bits of the AVX2 and AVX-512 builds. */
#include "gemm.h"

#ifndef __AVX2__

static float pair_dense(int kind, const float *x, const void *wrow, int64_t K) {
    float acc[4][8] = {{0}};
    int64_t K8 = K & ~(int64_t)7;
    const float *wf = (const float *)wrow;
    const uint16_t *wh = (const uint16_t *)wrow;
    for (int64_t k = 0; k < K8; k += 8) {
        float *a = acc[(k / 8) & 3];
        for (int l = 0; l < 8; l++) {
            float w = kind == K_F32 ? wf[k + l] : half_to_float(wh[k + l]);
            a[l] = fmaf(w, x[k + l], a[l]);
        }
    }
    float sum[8];
    for (int l = 0; l < 8; l++) sum[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    float s = hsum8_scalar(sum);
    for (int64_t k = K8; k < K; k++) {
        float w = kind == K_F32 ? wf[k] : half_to_float(wh[k]);
        s = fmaf(x[k], w, s);
    }
    return s;
}

/* One (x row, W row) pair of q8 with float32 activations (the arithmetic of kernels.c's header). */
static float pair_q8(const float *x, const int8_t *qrow, const float *sc, int64_t K) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        float gs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 8; l++)
                gs[l] = fmaf((float)qrow[32 * g + 8 * c + l], x[32 * g + 8 * c + l], gs[l]);
        for (int l = 0; l < 8; l++) acc[l] = fmaf(gs[l], sc[g], acc[l]);
    }
    return hsum8_scalar(acc);
}

/* Element e of q4 group g of the row at q: byte e % 16's low nibble for e < 16, else its high. */
static int nibble(const uint8_t *q, int64_t g, int e) {
    const uint8_t b = q[16 * g + (e & 15)];
    return e < 16 ? (b & 15) : (b >> 4);
}

/* One (x row, W row) pair of q4 with float32 activations (the arithmetic of kernels.c's header). */
static float pair_q4(const float *x, const float *xg, const uint8_t *qrow, const float *sc,
                     const float *mn, int64_t K) {
    float y = 0.0f;
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int e = 0; e < 32; e++)
            s[e & 3] = fmaf((float)nibble(qrow, g, e), x[32 * g + e], s[e & 3]);
        y = fmaf((s[0] + s[1]) + (s[2] + s[3]), sc[g], y);
        y = fmaf(xg[g], q4_min(sc, mn, g), y);
    }
    return y;
}

/* One (x row, W row) pair with int8 activations: the "rows in lanes" arithmetic of kernels.c's
 * header. */
static float pair_a8(int kind, const int8_t *xq, const float *xd, const float *xg,
                     const void *qrow, const float *sc, const float *mn, int64_t K) {
    float y = 0.0f;
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        int32_t isum = 0;
        for (int e = 0; e < 32; e++) {
            const int32_t w = kind == K_Q8 ? ((const int8_t *)qrow)[32 * g + e]
                                           : nibble((const uint8_t *)qrow, g, e);
            isum += w * (int32_t)xq[32 * g + e];
        }
        float d = sc[g] * xd[g];
        y = fmaf((float)isum, d, y);
        if (kind == K_Q4) y = fmaf(xg[g], q4_min(sc, mn, g), y);
    }
    return y;
}

void run_range(const job_t *j, int64_t n0, int64_t n1) {
    int64_t K = j->K, G = K / 32;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < j->M; m++) {
            const float *x = j->x + m * K;
            float v;
            if (j->xq != NULL)
                v = pair_a8(j->kind, j->xq + m * K, j->xd + m * G,
                            j->kind == K_Q4 ? j->xg + m * G : NULL,
                            (const char *)j->w + n * (j->kind == K_Q8 ? K : K / 2),
                            j->scales + n * G, row_mins(j, n), K);
            else if (j->kind == K_F32)
                v = pair_dense(K_F32, x, (const float *)j->w + n * K, K);
            else if (j->kind == K_F16)
                v = pair_dense(K_F16, x, (const uint16_t *)j->w + n * K, K);
            else if (j->kind == K_Q8)
                v = pair_q8(x, (const int8_t *)j->w + n * K, j->scales + n * G, K);
            else
                v = pair_q4(x, j->xg + m * G, (const uint8_t *)j->w + n * (K / 2),
                            j->scales + n * G, row_mins(j, n), K);
            j->y[m * j->N + n] = v;
        }
}

#endif
