/* Dense (f32 / f16) products, and q8 products with float32 activations: the 256-bit tiles of
 * AVX2 builds, the 512-bit multi-row tiles of AVX-512 builds, the tile shapes per number of x
 * rows, and run_range, which sends every job to its tiles (int8 activations and q4: lanes.c).
 * Every tile performs each pair's operations as kernels.c's header fixes them. */
#include "gemm.h"

#ifdef __AVX2__
/* Prefetch the 32-element block at element off of a dense weight pf_near bytes ahead into L1 and
 * pf_far ahead into L2 (0: that level not): two cache lines of f32, one of f16. */
AI void prefetch_dense(const int kind, const void *w, int64_t off) {
    const char *p = kind == K_F32 ? (const char *)((const float *)w + off)
                                  : (const char *)((const uint16_t *)w + off);
    const int64_t near = pf_near, far = pf_far;
    for (int l = 0; l < (kind == K_F32 ? 2 : 1); l++) {
        if (near > 0) _mm_prefetch(p + near + 64 * l, _MM_HINT_T0);
        if (far > 0) _mm_prefetch(p + far + 64 * l, _MM_HINT_T1);
    }
}

/* nb W rows x mb x rows, dense (f32 / f16).  w points at row n0, x at row m0.  Each pair keeps
 * four accumulators, chunk c of K going to accumulator c % 4 (see kernels.c's header). */
AI void dense_tile(const int kind, const int nb, const int mb, const float *x, const void *w,
                   float *y, int64_t K, int64_t ldx, int64_t ldy) {
    __m256 acc[NBMAX][MBMAX][4];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++)
            for (int c = 0; c < 4; c++) acc[i][j][c] = _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    int64_t k = 0;
    const int pf = dense_pf || (mb > 1 && dense_pf_rows); /* see dense_pf */
    for (; k + 32 <= K8; k += 32) {
        if (pf)
            for (int i = 0; i < nb; i++) prefetch_dense(kind, w, i * K + k);
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < nb; i++) {
                __m256 wv = load_w(kind, w, i * K + k + 8 * c);
                for (int j = 0; j < mb; j++)
                    acc[i][j][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * ldx + k + 8 * c),
                                                   acc[i][j][c]);
            }
    }
    for (int c = 0; k < K8; k += 8, c++)
        for (int i = 0; i < nb; i++) {
            __m256 wv = load_w(kind, w, i * K + k);
            for (int j = 0; j < mb; j++)
                acc[i][j][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * ldx + k), acc[i][j][c]);
        }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            __m256 a = _mm256_add_ps(_mm256_add_ps(acc[i][j][0], acc[i][j][1]),
                                     _mm256_add_ps(acc[i][j][2], acc[i][j][3]));
            float s = hsum8(a);
            for (int64_t t = K8; t < K; t++)
                s = fmaf(x[j * ldx + t], scalar_w(kind, w, i * K + t), s);
            y[j * ldy + i] = s;
        }
}

/* Chunk c (elements 8c .. 8c + 7) of q8 group g of the row at q, as floats. */
AI __m256 load_q8(const int8_t *q, int64_t g, int c) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 32 * g + 8 * c))));
}

/* Prefetch pf_q bytes ahead along nb q8 weight rows of length K, at group g. */
AI void prefetch_q8(const int nb, const int8_t *q, int64_t K, int64_t g) {
    const int64_t ahead = pf_q;
    if (ahead > 0)
        for (int i = 0; i < nb; i++)
            _mm_prefetch((const char *)(q + i * K + 32 * g) + ahead, _MM_HINT_T0);
}

/* nb W rows x mb x rows of q8 with float32 activations (the q8 arithmetic of kernels.c's
 * header), each W row prefetched PF_Q_BYTES ahead once per group. */
AI void q8_tile(const int nb, const int mb, const float *x, const int8_t *q, const float *sc,
                float *y, int64_t K, int64_t ldy) {
    const int64_t G = K / 32;
    __m256 acc[NBMAX][MBMAX];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 gs[NBMAX][MBMAX];
        for (int i = 0; i < nb; i++)
            for (int j = 0; j < mb; j++) gs[i][j] = _mm256_setzero_ps();
        prefetch_q8(nb, q, K, g);
        for (int c = 0; c < 4; c++) {
            __m256 wv[NBMAX];
            for (int i = 0; i < nb; i++) wv[i] = load_q8(q + i * K, g, c);
            for (int j = 0; j < mb; j++) {
                __m256 xv = _mm256_loadu_ps(x + j * K + 32 * g + 8 * c);
                for (int i = 0; i < nb; i++) gs[i][j] = _mm256_fmadd_ps(wv[i], xv, gs[i][j]);
            }
        }
        for (int i = 0; i < nb; i++) {
            __m256 sv = _mm256_set1_ps(sc[i * G + g]);
            for (int j = 0; j < mb; j++) acc[i][j] = _mm256_fmadd_ps(gs[i][j], sv, acc[i][j]);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) y[j * ldy + i] = hsum8(acc[i][j]);
}

#ifdef EXITLM_ZMM
/* ------------------------------------------------------------------ Multi-row tiles (AVX-512)
 *
 * Dense (f32 / f16) products, and q8 products of M > 1 rows with float32 activations, in builds
 * with AVX-512 F/VL/VNNI: the same operations per pair as above, in wider registers, with each
 * weight vector loaded (and converted) once per tile.  The dense tiles prefetch their weight
 * rows (prefetch_dense).
 *
 * Dense (f32 / f16): a pair's four 8-lane chains live in two 16-lane registers, (acc_0 | acc_1)
 * and (acc_2 | acc_3): one 16-float load of a weight row covers chunks c and c + 1 of a 32-float
 * block, whose chains are c and c + 1, so each 512-bit FMA performs two of the 8-lane FMAs of
 * the header, lane for lane.  The chunks of K % 32 and the final sums run on the 8-lane halves,
 * as in dense_tile.  32 registers hold nb * mb * 2 accumulators.
 *
 * q8 with float32 activations: two x rows per 16-lane register (q8_ztile).  q4, and every int8
 * activation product, have their own tiles, for every M (lanes.c). */

/* The upper 8 lanes of a 16-lane register (the lower ones: _mm512_castps512_ps256). */
AI __m256 hi256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

AI __m512 load_wz(int kind, const void *w, int64_t off) {
    if (kind == K_F32) return _mm512_loadu_ps((const float *)w + off);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + off)));
}

/* Prefetch the 32-element block at element off of a dense weight into L1 (dense_zspan's parts). */
AI void prefetch_dense_at(const int kind, const void *w, int64_t off) {
    const char *p = kind == K_F32 ? (const char *)((const float *)w + off)
                                  : (const char *)((const uint16_t *)w + off);
    _mm_prefetch(p, _MM_HINT_T0);
    if (kind == K_F32) _mm_prefetch(p + 64, _MM_HINT_T0);
}

/* Columns k0 .. k1 of the tile (k0, and k1 unless it is K, multiples of 32), for K in parts
 * (dense_kparts): st, when not NULL, carries each pair's two chains (pair i, j at
 * st[2 * (i * MBMAX + j)]) from the part before (k0 > 0) and to the next (k1 < K), so that
 * every chain performs the operations of the whole tile in the same order; the part that ends
 * at K adds the chunks of K % 32 and writes y.
 * pfo > 0: each weight block is prefetched pfo elements on (the same columns some rows on,
 * which the parts read next) rather than pf_near bytes on along its row. */
AI void dense_zspan(const int kind, const int nb, const int mb, const float *x, const void *w,
                    float *y, int64_t K, int64_t ldx, int64_t ldy, int64_t k0, int64_t k1,
                    __m512 *st, int64_t pfo) {
    __m512 a01[NBMAX][MBMAX], a23[NBMAX][MBMAX];
    const int resume = st != NULL && k0 > 0;
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < mb; j++) {
            a01[i][j] = resume ? st[2 * (i * MBMAX + j)] : _mm512_setzero_ps();
            a23[i][j] = resume ? st[2 * (i * MBMAX + j) + 1] : _mm512_setzero_ps();
        }
    const int64_t K8 = K & ~(int64_t)7, ke = k1 < K ? k1 : K8;
    int64_t k = k0;
    for (; k + 32 <= ke; k += 32) {
        __m512 w01[NBMAX], w23[NBMAX];
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
            if (pfo > 0)
                prefetch_dense_at(kind, w, i * K + k + pfo);
            else
                prefetch_dense(kind, w, i * K + k);
        }
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
            w01[i] = load_wz(kind, w, i * K + k);
            w23[i] = load_wz(kind, w, i * K + k + 16);
            /* in registers: GCC otherwise reloads the weight vectors of odd mb tiles for every
             * x row (3 rows of SmolLM2's fp32 products took 1.4-2.0x one row, 1.0-1.2x so) */
            __asm__("" : "+v"(w01[i]), "+v"(w23[i]));
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < mb; j++) {
            __m512 x01 = _mm512_loadu_ps(x + j * ldx + k);
            __m512 x23 = _mm512_loadu_ps(x + j * ldx + k + 16);
            /* in registers: GCC otherwise folds each x load into every weight row's FMA */
            if (nb > 1) __asm__("" : "+v"(x01), "+v"(x23));
            _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
                a01[i][j] = _mm512_fmadd_ps(w01[i], x01, a01[i][j]);
                a23[i][j] = _mm512_fmadd_ps(w23[i], x23, a23[i][j]);
            }
        }
    }
    if (k1 < K) { /* a part before the last: hand the chains on */
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
            _Pragma("GCC unroll 8") for (int j = 0; j < mb; j++) {
                st[2 * (i * MBMAX + j)] = a01[i][j];
                st[2 * (i * MBMAX + j) + 1] = a23[i][j];
            }
        return;
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < mb; j++) {
            __m256 acc[4] = {_mm512_castps512_ps256(a01[i][j]),
                             hi256(a01[i][j]),
                             _mm512_castps512_ps256(a23[i][j]),
                             hi256(a23[i][j])};
            for (int64_t kk = k, c = 0; kk < K8; kk += 8, c++)
                acc[c] = _mm256_fmadd_ps(load_w(kind, w, i * K + kk),
                                         _mm256_loadu_ps(x + j * ldx + kk), acc[c]);
            __m256 a = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            float s = hsum8(a);
            for (int64_t t = K8; t < K; t++)
                s = fmaf(x[j * ldx + t], scalar_w(kind, w, i * K + t), s);
            y[j * ldy + i] = s;
        }
}

AI void dense_ztile(const int kind, const int nb, const int mb, const float *x, const void *w,
                    float *y, int64_t K, int64_t ldx, int64_t ldy) {
    dense_zspan(kind, nb, mb, x, w, y, K, ldx, ldy, 0, K, NULL, 0);
}

/* q8 with float32 activations, M > 1: two x rows per 16-lane register (the x rows interleaved
 * per call, job_t.x2); chunk c of a weight group, converted once, fills both halves; per pair the
 * group sum gs and acc follow the operations of kernels.c's header lane by lane. */
AI __m512 load_q8z(const int8_t *q, int64_t g, int c) {
    int64_t b8;
    memcpy(&b8, q + 32 * g + 8 * c, 8);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set1_epi64x(b8)));
}

AI void q8_ztile(const int nb, const int mp, const int rows, const float *x2, const int8_t *q,
                 const float *sc, float *y, int64_t K, int64_t ldy) {
    const int64_t G = K / 32;
    __m512 acc[NBMAX][MBMAX / 2];
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) acc[i][p] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        prefetch_q8(nb, q, K, g);
        __m512 gs[NBMAX][MBMAX / 2];
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
            _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) gs[i][p] = _mm512_setzero_ps();
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            __m512 wv[NBMAX];
            _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) wv[i] = load_q8z(q + i * K, g, c);
            _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) {
                const __m512 xv = _mm512_loadu_ps(x2 + p * 2 * K + (4 * g + c) * 16);
                _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
                    gs[i][p] = _mm512_fmadd_ps(wv[i], xv, gs[i][p]);
            }
        }
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
            const __m512 sv = _mm512_set1_ps(sc[i * G + g]);
            _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++)
                acc[i][p] = _mm512_fmadd_ps(gs[i][p], sv, acc[i][p]);
        }
    }
    /* acc[i][p]: W row i against x rows 2p (lanes 0-7) and 2p + 1 (lanes 8-15, when present) */
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) {
            y[2 * p * ldy + i] = hsum8(_mm512_castps512_ps256(acc[i][p]));
            if (2 * p + 1 < rows) y[(2 * p + 1) * ldy + i] = hsum8(hi256(acc[i][p]));
        }
}

#define DZ_FN(KIND, NB, MB)                                                                     \
    static void dz_##KIND##_##NB##_##MB(const float *x, const void *w, float *y, int64_t K,    \
                                        int64_t ldx, int64_t ldy) {                             \
        dense_ztile(KIND, NB, MB, x, w, y, K, ldx, ldy);                                        \
    }
#define MB8Z(FN, KIND, NB)                                                                  \
    FN(KIND, NB, 1) FN(KIND, NB, 2) FN(KIND, NB, 3) FN(KIND, NB, 4) FN(KIND, NB, 5)          \
        FN(KIND, NB, 6) FN(KIND, NB, 7) FN(KIND, NB, 8)
#define ALL_ZTILES(FN, KIND) MB8Z(FN, KIND, 1) MB8Z(FN, KIND, 2) MB8Z(FN, KIND, 4)
ALL_ZTILES(DZ_FN, 0)
ALL_ZTILES(DZ_FN, 1)
typedef void (*dz_fn)(const float *, const void *, float *, int64_t, int64_t, int64_t);
#define ROW8Z(P, KIND, NB)                                                                  \
    {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3, P##KIND##_##NB##_4,         \
     P##KIND##_##NB##_5, P##KIND##_##NB##_6, P##KIND##_##NB##_7, P##KIND##_##NB##_8}
#define TABLEZ(P, KIND) {ROW8Z(P, KIND, 1), ROW8Z(P, KIND, 2), ROW8Z(P, KIND, 4)}
static const dz_fn DZ_TABLE[2][3][MBMAX] = {TABLEZ(dz_, 0), TABLEZ(dz_, 1)};
/* nb weight rows x mb x rows over columns k0 .. k1 (dense_zspan), for dense_kparts. */
#define DZP_FN(KIND, NB, MB)                                                                    \
    static void dzp_##KIND##_##NB##_##MB(const float *x, const void *w, float *y, int64_t K,    \
                                         int64_t ldx, int64_t ldy, int64_t k0, int64_t k1,      \
                                         __m512 *st, int64_t pfo) {                             \
        dense_zspan(KIND, NB, MB, x, w, y, K, ldx, ldy, k0, k1, st, pfo);                       \
    }
ALL_ZTILES(DZP_FN, 0)
ALL_ZTILES(DZP_FN, 1)
typedef void (*dzp_fn)(const float *, const void *, float *, int64_t, int64_t, int64_t, int64_t,
                       int64_t, __m512 *, int64_t);
static const dzp_fn DZP_TABLE[2][3][MBMAX] = {TABLEZ(dzp_, 0), TABLEZ(dzp_, 1)};
#define Q8Z_FN(NB, MP)                                                                        \
    static void q8z_##NB##_##MP(int rows, const float *x2, const int8_t *q, const float *sc, \
                                float *y, int64_t K, int64_t ldy) {                           \
        q8_ztile(NB, MP, rows, x2, q, sc, y, K, ldy);                                        \
    }
#define Q8Z_MP(NB) Q8Z_FN(NB, 1) Q8Z_FN(NB, 2) Q8Z_FN(NB, 3) Q8Z_FN(NB, 4)
Q8Z_MP(1)
Q8Z_MP(2)
Q8Z_MP(4)
typedef void (*q8z_fn)(int, const float *, const int8_t *, const float *, float *, int64_t,
                       int64_t);
#define Q8Z_ROW(NB) {q8z_##NB##_1, q8z_##NB##_2, q8z_##NB##_3, q8z_##NB##_4}
static const q8z_fn Q8Z_TABLE[3][MBMAX / 2] = {Q8Z_ROW(1), Q8Z_ROW(2), Q8Z_ROW(4)};
#else
#define DENSE_FN(KIND, NB, MB)                                                                  \
    static void dense_##KIND##_##NB##_##MB(const float *x, const void *w, float *y, int64_t K, \
                                           int64_t ldx, int64_t ldy) {                          \
        dense_tile(KIND, NB, MB, x, w, y, K, ldx, ldy);                                         \
    }
/* Instantiated tiles: nb = 4 or 2 with mb <= 3, nb = 1 with mb <= 8 (tile_cfg picks among them). */
#define MB3(FN, KIND, NB) FN(KIND, NB, 1) FN(KIND, NB, 2) FN(KIND, NB, 3)
#define MB8(FN, KIND, NB)                                                                   \
    MB3(FN, KIND, NB) FN(KIND, NB, 4) FN(KIND, NB, 5) FN(KIND, NB, 6) FN(KIND, NB, 7)         \
        FN(KIND, NB, 8)
#define ALL_TILES(FN, KIND) MB8(FN, KIND, 1) MB3(FN, KIND, 2) MB3(FN, KIND, 4)
ALL_TILES(DENSE_FN, 0)
ALL_TILES(DENSE_FN, 1)
typedef void (*dense_fn)(const float *, const void *, float *, int64_t, int64_t, int64_t);
#define ROW3(P, KIND, NB) {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3}
#define ROW8(P, KIND, NB)                                                                   \
    {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3, P##KIND##_##NB##_4,         \
     P##KIND##_##NB##_5, P##KIND##_##NB##_6, P##KIND##_##NB##_7, P##KIND##_##NB##_8}
#define TABLE(P, KIND) {ROW8(P, KIND, 1), ROW3(P, KIND, 2), ROW3(P, KIND, 4)}
static const dense_fn DENSE_TABLE[2][3][MBMAX] = {TABLE(dense_, 0), TABLE(dense_, 1)};
#endif /* EXITLM_ZMM */

/* The 256-bit q8 tiles (float32 activations: every M in AVX2 builds, M == 1 with AVX-512):
 * nb = 4 or 2 with mb <= 3, nb = 1 with mb <= 8 (tile_cfg picks among them). */
#define Q8_FN(NB, MB)                                                                         \
    static void q8_##NB##_##MB(const float *x, const int8_t *q, const float *sc, float *y,   \
                               int64_t K, int64_t ldy) {                                     \
        q8_tile(NB, MB, x, q, sc, y, K, ldy);                                                \
    }
#define Q8_MB3(NB) Q8_FN(NB, 1) Q8_FN(NB, 2) Q8_FN(NB, 3)
Q8_MB3(1) Q8_FN(1, 4) Q8_FN(1, 5) Q8_FN(1, 6) Q8_FN(1, 7) Q8_FN(1, 8)
Q8_MB3(2)
Q8_MB3(4)
typedef void (*q8_fn)(const float *, const int8_t *, const float *, float *, int64_t, int64_t);
static const q8_fn Q8_TABLE[3][MBMAX] = {
    {q8_1_1, q8_1_2, q8_1_3, q8_1_4, q8_1_5, q8_1_6, q8_1_7, q8_1_8},
    {q8_2_1, q8_2_2, q8_2_3},
    {q8_4_1, q8_4_2, q8_4_3},
};


/* 256-bit tile shape (W rows nb x x rows mb) of the dense kinds (AVX2 builds) and of q8 with
 * float32 activations (AVX2 builds; one x row with AVX-512), for M == 1 and for M > 1.  Speed
 * only: the arithmetic of a pair is the same in every tile.  nb in {2, 4} with mb <= 3, or nb =
 * 1 with mb <= 8 (measured with benchmarks/gemv_kernels.py on an AVX2 EPYC).  Dense kinds read
 * one weight row at a time: on that Zen 1 core a one-row fp32 product streamed ~27 GB/s with
 * four rows interleaved (one accumulator each) and ~39 GB/s row after row with four
 * accumulators (llama.cpp's order of access).  More than four x rows run in passes of at most
 * four over each weight row (run_range spreads the rows evenly: 6 as 3 + 3, 8 as 4 + 4), the
 * row's lines in L1 after the first: on a Zen 5 core (AVX2 build, the multi-row prefetch of
 * dense_pf; docs/measurements/avx2_multirow_2026-11-28.md) 8 rows of SmolLM2's and
 * layerskip-code's shapes took 0.53-0.86x the time of the former two weight rows x three x
 * rows, whose 24 accumulators do not fit in 16 registers.  On the Zen 1 EPYC, without the
 * prefetch, that tile had beaten passes of one weight row x three x rows (36 ms per 30 SmolLM2
 * layers at M = 8 against 45-50), so a Zen 1 core keeps it (tiles_init). */
static int tile_cfg[3][3][2] = {
    /*                  M == 1    M 2-4     M > 4 */
    /* f32 */ {{1, 1}, {1, 4}, {1, 4}},
    /* f16 */ {{1, 1}, {1, 4}, {1, 4}},
    /* q8  */ {{4, 1}, {1, 8}, {1, 8}},
};

/* A Zen 1 core (128-bit datapath: 256-bit operations split in two, one 256-bit load a cycle)
 * keeps the configuration measured best on it: two weight rows x three x rows for 5+ rows, no
 * software prefetch in the dense tiles (the passes of one weight row and their prefetch above
 * were measured on a Zen 5 core only).  A Zen 4 core multiplies one x row with q8 weights
 * (float32 activations: the int8 models' LM head) one weight row at a time: measured there
 * (EPYC family 25 model 17, one thread, weights streaming from memory; avx2 build and both
 * copies of the avx512 build alike), four interleaved rows took 1.6-1.8x the time of one
 * (SmolLM2's 49152 x 576 head 2972 against 1656 us, gate_up 211 against 130;
 * docs/measurements/zen4_narrow_2026-12-03.md). */
__attribute__((constructor)) static void tiles_init(void) {
    __builtin_cpu_init();
#ifndef EXITLM_ZMM
    if (__builtin_cpu_is("znver1")) {
        dense_pf_rows = 0;
        for (int kind = K_F32; kind <= K_F16; kind++) {
            tile_cfg[kind][2][0] = 2;
            tile_cfg[kind][2][1] = 3;
        }
    }
#endif
    if (cpu_zen4()) tile_cfg[K_Q8][0][0] = 1;
}

#ifdef EXITLM_ZMM
/* The 512-bit tiles: nb W rows in {1, 2, 4} x mb <= 8 x rows (q8: x rows in pairs, mb rounded
 * up to even), per tile_rows (row 0, M == 1: the dense kinds only, nb 1, 2 and 4 measured the
 * same; q8 runs the 256-bit tiles).  Measured on SmolLM2's shapes, weights streaming from DRAM,
 * on a Sapphire Rapids core (docs/measurements/multirow_2026-11-26.md,
 * cpu_kernels_2026-11-27.md): since the dense rows are prefetched (prefetch_dense), f32 too
 * streams one weight row at a time for all its x rows (4 rows: 1.06-1.14x one row against
 * 1.08-1.35 for nb 4 x mb 2; 8 rows: 1.44-1.72 against 1.95-2.49); f16 likewise, its
 * conversion shared by all x rows.  q8 with 5-8 x rows: four weight rows per tile (8 rows:
 * 1.60-1.69x one row against 1.47-2.29 with two, the head 1.68 against 2.29). */
/* Dense 512-bit tiles of one weight row whose x rows (the first tile's: min(M, mb) rows of K
 * floats) exceed ZX_L1_BYTES (fp16) or ZX_F32_PART_FROM (fp32) bytes run with K in parts of at
 * most ZX_PART_BYTES (fp16) or ZX_F32_PART_BYTES (fp32) of x rows (dense_kparts), because the
 * x rows, reread for every weight vector, would not stay in a 48 KB L1d next to the weight
 * stream.  Measured on a Zen 5 core (one thread, weights streaming from memory, x rows on
 * 64-byte lines, the installed build's flags; docs/measurements/kparts_zen5_2026-12-04.md),
 * rows x cost of 8 rows: SmolLM2's down projection (576 x 1536) fp32 1.58x against 2.06x for
 * the former rule (four weight rows per x load, whose 64 accumulators spill), a 2048 x 5632
 * fp16 product 1.96x against 4.28x (the former rule: passes of x rows over weight chunks
 * reread from L2).  The thresholds: fp32 4-6 rows of the down projection (24-36 KB) gained
 * from parts, 8 rows of SmolLM2's 576-column products (18 KB) lost (1.35x one row in one
 * part, 1.52x in parts); fp16 in parts from 20 KB took 1.5x where one part took 1.1x (3 rows
 * of the down projection): its conversions keep its loops busier than fp32's. */
#ifndef ZX_L1_BYTES
#define ZX_L1_BYTES 40960
#endif
#ifndef ZX_PART_BYTES
#define ZX_PART_BYTES 24576
#endif
#ifndef ZX_F32_PART_FROM
#define ZX_F32_PART_FROM 20480
#endif
#ifndef ZX_F32_PART_BYTES
#define ZX_F32_PART_BYTES 16384
#endif
/* Weight rows of each part before the next part (dense_kparts): their chains wait in a stack
 * buffer of ZK_ROWS KB (8 x rows). */
#ifndef ZK_ROWS
#define ZK_ROWS 16
#endif
static int ztile_cfg[3][3][2] = {
    /*                  M == 1    M 2-4     M > 4 */
    /* f32 */ {{1, 1}, {1, 4}, {1, 8}},
    /* f16 */ {{1, 1}, {1, 4}, {1, 8}},
    /* q8  */ {{1, 1}, {1, 4}, {4, 8}},
};
#endif

#ifndef EXITLM_ZMM
/* x rows per pass of a 256-bit dense tile of at most mbt x rows over M: the passes mbt needs,
 * the rows spread evenly over them (M = 6 as 3 + 3 rather than 4 + 2).  (The 512-bit tiles keep
 * full passes: there, 9 rows of SmolLM2's down projection took 1.35-1.5x the time as 5 + 4.) */
static int even_passes(int kind, int64_t M, int mbt) {
    if (kind == K_Q8 || M <= mbt) return mbt;
    const int64_t passes = (M + mbt - 1) / mbt;
    return (int)((M + passes - 1) / passes);
}
#endif

#ifdef EXITLM_ZMM
/* Dense products whose x rows, reread for every weight tile, exceed ZX_L1_BYTES (fp16) or
 * ZX_F32_PART_FROM (fp32) bytes: the x rows in groups of at most MBMAX, each group's K in parts
 * of at most ZX_PART_BYTES (fp16) or ZX_F32_PART_BYTES (fp32) of its x rows (multiples of 32
 * columns, spread evenly); each part runs the tiles (nbt x mbt) over ZK_ROWS weight rows
 * before the next part, every pair's chains carried between parts in st (dense_zspan).  A
 * part's x rows stay in L1 while the weights stream once from memory, each weight block
 * prefetched in the part some rows ahead; every output has the bits of the one-part tile. */
static void dense_kparts(const job_t *j, int64_t n0, int64_t n1, int64_t ldx, int nbt, int mbt) {
    const int64_t K = j->K, M = j->M, N = j->N, es = j->kind == K_F32 ? 4 : 2;
    const int64_t part = j->kind == K_F32 ? ZX_F32_PART_BYTES : ZX_PART_BYTES;
    __m512 st[ZK_ROWS * MBMAX * 2];
    for (int64_t g0 = 0; g0 < M; g0 += MBMAX) {
        const int64_t gm = M - g0 < MBMAX ? M - g0 : MBMAX;
        int64_t kb = (part / (4 * gm)) & ~(int64_t)31;
        kb = kb < 32 ? 32 : kb;
        const int64_t parts = (K + kb - 1) / kb;
        kb = ((K + parts - 1) / parts + 31) & ~(int64_t)31;
        /* rows ahead whose part blocks make up pf_near bytes (at least one row) */
        const int64_t ahead = (pf_near + kb * es - 1) / (kb * es), pfo = (ahead < 1 ? 1 : ahead) * K;
        for (int64_t c0 = n0; c0 < n1; c0 += ZK_ROWS) {
            const int64_t c1 = c0 + ZK_ROWS < n1 ? c0 + ZK_ROWS : n1;
            for (int64_t k0 = 0; k0 < K; k0 += kb) {
                const int64_t k1 = k0 + kb < K ? k0 + kb : K;
                for (int64_t n = c0; n < c1;) {
                    const int nb = c1 - n >= nbt ? nbt : (c1 - n >= 2 && nbt >= 2 ? 2 : 1);
                    const int nbi = nb == 4 ? 2 : nb - 1;
                    for (int64_t m = g0; m < g0 + gm;) {
                        const int mb = (int)(g0 + gm - m >= mbt ? mbt : g0 + gm - m);
                        DZP_TABLE[j->kind][nbi][mb - 1](
                            j->x + m * ldx, (const char *)j->w + n * K * es, j->y + m * N + n, K,
                            ldx, N, k0, k1, st + ((n - c0) * MBMAX + (m - g0)) * 2, pfo);
                        m += mb;
                    }
                    n += nb;
                }
            }
        }
    }
}
#endif

void run_range(const job_t *j, int64_t n0, int64_t n1) {
#ifdef EXITLM_ZMM
    if (j->M <= narrow_rows) { /* the 256-bit tiles (dense256.c, lanes256.c) */
        narrow_run_range(j, n0, n1);
        return;
    }
#endif
    const int64_t K = j->K, M = j->M, N = j->N, G = K / 32;
    const int kind = j->kind, r = tile_rows(M);
    if (kind == K_Q4 || j->xq != NULL) {
        lanes_range(j, n0, n1);
        return;
    }
    const int64_t ldx = j->ldx > 0 ? j->ldx : K;
#ifdef EXITLM_ZMM
    const int z = kind != K_Q8 || j->x2 != NULL; /* the 512-bit tiles */
    if (z && kind != K_Q8 && M > 1 &&
        (M < MBMAX ? M : MBMAX) * K * 4 > (kind == K_F32 ? ZX_F32_PART_FROM : ZX_L1_BYTES)) {
        dense_kparts(j, n0, n1, ldx, ztile_cfg[kind][r][0], ztile_cfg[kind][r][1]);
        return;
    }
    const int nbt = (z ? ztile_cfg : tile_cfg)[kind][r][0];
    const int mbt = (z ? ztile_cfg : tile_cfg)[kind][r][1];
#else
    const int nbt = tile_cfg[kind][r][0];
    const int mbt = even_passes(kind, M, tile_cfg[kind][r][1]);
#endif
    for (int64_t n = n0; n < n1;) {
        const int nb = n1 - n >= nbt ? nbt : (n1 - n >= 2 && nbt >= 2 ? 2 : 1);
        const int nbi = nb == 4 ? 2 : nb - 1;
#ifdef EXITLM_ZMM
        if (kind == K_Q8 && z) {
            const int mpt = (mbt + 1) / 2; /* x rows in pairs */
            for (int64_t p = 0; 2 * p < M;) {
                const int mp = (M - 2 * p + 1) / 2 >= mpt ? mpt : (int)((M - 2 * p + 1) / 2);
                const int rows = M - 2 * p >= 2 * mp ? 2 * mp : (int)(M - 2 * p);
                Q8Z_TABLE[nbi][mp - 1](rows, j->x2 + p * 2 * K, (const int8_t *)j->w + n * K,
                                       j->scales + n * G, j->y + 2 * p * N + n, K, N);
                p += mp;
            }
            n += nb;
            continue;
        }
#endif
        for (int64_t m = 0; m < M;) {
            const int mb = M - m >= mbt ? mbt : (int)(M - m);
            const float *x = j->x + m * ldx;
            float *y = j->y + m * N + n;
            if (kind == K_Q8) {
                Q8_TABLE[nbi][mb - 1](x, (const int8_t *)j->w + n * K, j->scales + n * G, y, K, N);
            } else {
                const void *w = (const char *)j->w + n * K * (kind == K_F32 ? 4 : 2);
#ifdef EXITLM_ZMM
                DZ_TABLE[kind][nbi][mb - 1](x, w, y, K, ldx, N);
#else
                DENSE_TABLE[kind][nbi][mb - 1](x, w, y, K, ldx, N);
#endif
            }
            m += mb;
        }
        n += nb;
    }
}

int dense_set_tile(int kind, int rows, int nb, int mb) {
#ifdef EXITLM_ZMM
    if (rows > 0 || kind <= K_F16) {
        ztile_cfg[kind][rows][0] = nb;
        ztile_cfg[kind][rows][1] = mb;
        return 0;
    }
#endif
    if (nb > 1 && mb > 3) return -1;
    tile_cfg[kind][rows][0] = nb;
    tile_cfg[kind][rows][1] = mb;
    return 0;
}
#endif
