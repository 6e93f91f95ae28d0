/* Products that put W rows in the lanes of a register: q8 and q4 weights with int8 activations
 * (q8a8 / q4a8) and q4 weights with float32 activations, 16 W rows a tile on AVX-512, 8 on AVX2. */
#include "gemm.h"

#ifdef __AVX2__
/* ------------------------------------------------------------------ int8 activations
 *
 * q8a8 / q4a8 (the "rows in lanes" arithmetic of kernels.c's header).  A tile holds A8_LANES
 * consecutive W rows (16 with EXITLM_ZMM, else 8; past N the last row repeats and its results
 * are dropped) and mb <= 8 x rows.  Per group g, the tile's weight bytes are transposed so that register c
 * (c = 0..7) holds, in lane r, the four weights 4c..4c+3 of W row r; q4's nibbles come out of
 * the transposed bytes (low nibbles: elements 4c..4c+3, high: 16+4c..16+4c+3).  The four x
 * bytes 4c..4c+3 of an x row, broadcast to every lane, meet them in one four-product dot per
 * lane (AVX-512 VNNI vpdpbusd, unsigned times signed bytes; AVX2 maddubs + madd), and the eight
 * c's add up to the group's exact int32 isum_g of each W row, lane by lane.  Then per lane, for
 * the lane's (x row, W row) pair: d = scale_g * d_g (one float product; the tile's scales are
 * transposed once per block of A8_GB groups), y = fma((float) isum_g, d, y), and q4
 * y = fma(X_g, min_g, y): every float operation of a pair happens in its own lane, in the order
 * of the header, whatever the tile, so each output keeps its bits for every M and thread count.
 * q8 on AVX-512: the unsigned operand is the x byte + 128 (xq in [-127, 127]) and each lane
 * starts from -128 * (the weights' sum), once per tile and group; AVX2: |w| times x with w's
 * sign (maddubs cannot overflow: |w| <= 128, |x| <= 127).  q4 on AVX2 sums the eight maddubs
 * (16-bit, each <= 2 * 15 * 127) before widening: 8 * 3810 < 32768, exact.
 *
 * Why lanes are W rows: the float work per group (convert, scale, fma, min) is one instruction
 * per A8_LANES pairs instead of one per pair, so several x rows cost little more than one
 * (llama.cpp gets the same effect from weights repacked at load; here the transposition is done
 * on the fly from the plain (N, K) layout, in registers). */
#ifdef EXITLM_ZMM
#define A8_LANES 16
#else
#define A8_LANES 8
#endif
#define A8_GB 64 /* groups per block of transposed scales */

/* Output of a lanes tile: y[m0 + m, n0 + r] = lane r of acc[m] for m < mb, n0 + r < n1. */
#ifdef EXITLM_ZMM
AI void lanes_store(const job_t *j, const __m512 *acc, const int mb, int64_t n0, int64_t n1,
                    int64_t m0) {
    const __mmask16 keep = n1 - n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n1 - n0)) - 1u);
    _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++)
        _mm512_mask_storeu_ps(j->y + (m0 + m) * j->N + n0, keep, acc[m]);
}
#else
AI void lanes_store(const job_t *j, const __m256 *acc, const int mb, int64_t n0, int64_t n1,
                    int64_t m0) {
    for (int m = 0; m < mb; m++) {
        float out[8];
        _mm256_storeu_ps(out, acc[m]);
        for (int r = 0; r < 8 && n0 + r < n1; r++) j->y[(m0 + m) * j->N + n0 + r] = out[r];
    }
}
#endif

/* x rows per tile (1..8) per tile_rows(M), for q8 and q4: A8_LANES W rows x mb x rows (8 x rows
 * per tile measured faster than 4 for M = 8 on AVX2 as on AVX-512: the weights' transposition is
 * shared by more rows). */
static int a8_cfg[2][3] = {{1, 4, 8}, {1, 4, 8}};

#ifdef EXITLM_ZMM
/* t[g * 16 + r] = sr[r][g0 + g] for g < gb <= 16: a 16 x 16 float transpose in registers (rows
 * past gb masked off). */
AI void a8_transpose(const float *const sr[16], int64_t g0, int gb, float *t) {
    const __mmask16 k = gb >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << gb) - 1u);
    __m512 a[16], u[16];
    _Pragma("GCC unroll 8") for (int r = 0; r < 16; r += 2) {
        const __m512 x0 = _mm512_maskz_loadu_ps(k, sr[r] + g0), x1 = _mm512_maskz_loadu_ps(k, sr[r + 1] + g0);
        a[r] = _mm512_unpacklo_ps(x0, x1); /* per 128-bit lane: r[0] r+1[0] r[1] r+1[1] */
        a[r + 1] = _mm512_unpackhi_ps(x0, x1);
    }
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) { /* u[4q + e] lane L: rows 4q.., element 4L + e */
        u[4 * q] = _mm512_shuffle_ps(a[4 * q], a[4 * q + 2], 0x44);
        u[4 * q + 1] = _mm512_shuffle_ps(a[4 * q], a[4 * q + 2], 0xEE);
        u[4 * q + 2] = _mm512_shuffle_ps(a[4 * q + 1], a[4 * q + 3], 0x44);
        u[4 * q + 3] = _mm512_shuffle_ps(a[4 * q + 1], a[4 * q + 3], 0xEE);
    }
    _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
        const __m512 w0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD), w1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
        _mm512_storeu_ps(t + 16 * e, _mm512_shuffle_f32x4(v0, v1, 0x88));        /* element e */
        _mm512_storeu_ps(t + 16 * (8 + e), _mm512_shuffle_f32x4(v0, v1, 0xDD));  /* 8 + e */
        _mm512_storeu_ps(t + 16 * (4 + e), _mm512_shuffle_f32x4(w0, w1, 0x88));  /* 4 + e */
        _mm512_storeu_ps(t + 16 * (12 + e), _mm512_shuffle_f32x4(w0, w1, 0xDD)); /* 12 + e */
    }
}
#else
/* In-lane 4 x 4 transposition of dwords: R[k] holds, in each 128-bit half h, four dwords
 * d0..d3 of row k + 4h; T[c] gets dword c of rows 4h..4h+3 in half h: of rows 0..7 in order.
 * (No lane-crossing permutes: Zen 1 runs those as 8 micro-ops.) */
AI void t4x4_epi32(const __m256i R[4], __m256i T[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(R[0], R[1]), t1 = _mm256_unpackhi_epi32(R[0], R[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(R[2], R[3]), t3 = _mm256_unpackhi_epi32(R[2], R[3]);
    T[0] = _mm256_unpacklo_epi64(t0, t2);
    T[1] = _mm256_unpackhi_epi64(t0, t2);
    T[2] = _mm256_unpacklo_epi64(t1, t3);
    T[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* 16 bytes at a (lower half) and 16 at b (upper half). */
AI __m256i load_halves(const void *a, const void *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

/* t[g * 8 + r] = sr[r][g0 + g] for g < 8: two in-lane 4 x 4 transpositions per 4 groups. */
AI void a8_transpose(const float *const sr[8], int64_t g0, float *t) {
    for (int q = 0; q < 8; q += 4) {
        __m256i R[4], T[4];
        for (int k = 0; k < 4; k++) R[k] = load_halves(sr[k] + g0 + q, sr[k + 4] + g0 + q);
        t4x4_epi32(R, T);
        for (int c = 0; c < 4; c++) _mm256_storeu_si256((__m256i *)(t + (q + c) * 8), T[c]);
    }
}
#endif

/* The tile's scales (and q4 mins) of groups g0 .. g0 + gb - 1, lane-major: t[g * LANES + r]. */
AI void a8_scales(const float *const sr[A8_LANES], int64_t g0, int gb, float *t) {
#ifdef EXITLM_ZMM
    for (int g = 0; g < gb; g += 16) a8_transpose(sr, g0 + g, gb - g, t + g * 16);
#else
    int g = 0;
    for (; g + 8 <= gb; g += 8) a8_transpose(sr, g0 + g, t + g * 8);
    for (; g < gb; g++)
        for (int r = 0; r < 8; r++) t[g * 8 + r] = sr[r][g0 + g];
#endif
}

/* The tile's q4 mins of groups g0 .. g0 + gb - 1, lane-major like a8_scales; without a mins
 * array (Q4_0) -8 times the transposed scales scT: the floats that array would hold (q4_min). */
AI void a8_mins(const job_t *j, const float *const mr[A8_LANES], int64_t g0, int gb,
                const float *scT, float *t) {
    if (j->mins != NULL) {
        a8_scales(mr, g0, gb, t);
        return;
    }
    for (int i = 0; i < gb * A8_LANES; i++) t[i] = -8.0f * scT[i];
}

/* Four bytes at p as one int32 (what a broadcast of x's bytes 4c..4c+3 starts from). */
AI int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The tile's A8_LANES weight rows from n0 (past n1 the last one repeats), their scales and, for
 * q4, their mins. */
AI void a8_rows(const int kind, const job_t *j, int64_t n0, int64_t n1, const uint8_t *rw[],
                const float *sr[], const float *mr[]) {
    const int64_t G = j->K / 32, rowlen = kind == K_Q8 ? j->K : j->K / 2;
    _Pragma("GCC unroll 16") for (int r = 0; r < A8_LANES; r++) {
        const int64_t n = n0 + r < n1 ? n0 + r : n1 - 1;
        rw[r] = (const uint8_t *)j->w + n * rowlen;
        sr[r] = j->scales + n * G;
        mr[r] = row_mins(j, n);
    }
}

/* Prefetch group g's share of the next tile (rows n0 + A8_LANES ..; q4: pf_q4_tiles tiles
 * ahead): its weight bytes (A8_LANES rows x bpg bytes) and the line of scales (and q4 mins) its
 * groups start (A8_LANES floats a group: every group with 16 lanes, every other one with 8). */
AI void a8_prefetch_next(const int kind, const job_t *j, int64_t n0, int64_t g) {
    if (!PF_Q_BYTES) return;
    const int64_t G = j->K / 32, rowlen = kind == K_Q8 ? j->K : j->K / 2;
    const int64_t next = n0 + (kind == K_Q4 ? pf_q4_tiles : 1) * A8_LANES;
    const int bpg = kind == K_Q8 ? 32 : 16; /* weight bytes per group and row */
    const char *w = (const char *)j->w + next * rowlen + g * A8_LANES * bpg;
    for (int l = 0; l < A8_LANES * bpg / 64; l++) _mm_prefetch(w + 64 * l, _MM_HINT_T0);
    if ((g * A8_LANES) % 16 == 0) {
        _mm_prefetch((const char *)(j->scales + next * G + A8_LANES * g), _MM_HINT_T0);
        if (kind == K_Q4 && j->mins != NULL)
            _mm_prefetch((const char *)(j->mins + next * G + A8_LANES * g), _MM_HINT_T0);
    }
}

/* ------------------------------------------------------------------ q4 weights in 16-row blocks
 *
 * The layout exitlm_gemm_q4p reads (exitlm_native.h; packed at load by exitlm/kernels/native.py
 * pack_q4): W rows in blocks of 16 (the last block padded with copies of the last row), and per
 * block b and group g the 256 bytes at (b * G + g) * 256 that a8_t16 would build in registers:
 * bytes 64c + 4r .. 64c + 4r + 3 are bytes 4c .. 4c + 3 of the group in row 16b + r.  A 16-lane
 * tile loads its group's T[c] as four straight 64-byte loads; an 8-lane tile on rows 8h .. 8h + 7
 * of a block loads the 32 bytes at 64c + 32h.  Scales (and Q4_1 mins) the same way: the 16
 * floats at (b * G + g) * 16 are group g of the block's rows, lane-major, so the tile reads them
 * as they are instead of transposing them per tile (a8_scales).  Same operands, same
 * operations, same bits as the plain layout; a tile's inputs are one forward stream. */

/* Where tile n0's packed data start: its bytes (group 0, c = 0), scales and mins (or NULL):
 * float32, or float16 with pk = 2 (job_t.packed; weights whose scales and mins are all exact
 * in float16, as GGUF's are: the same floats in 10% fewer bytes). */
typedef struct {
    const uint8_t *w;
    const char *s, *m;
} q4p_t;

AI q4p_t q4p_tile(const int pk, const job_t *j, int64_t n0) {
    const int64_t G = j->K / 32, b = n0 / 16, h = (n0 / 8) & 1; /* A8_LANES 16: h = 0 */
    const int64_t off = (b * G * 16 + 8 * h) * (pk == 2 ? 2 : 4);
    q4p_t t = {(const uint8_t *)j->w + b * G * 256 + 32 * h, (const char *)j->scales + off,
               j->mins != NULL ? (const char *)j->mins + off : NULL};
    return t;
}

/* The tile's A8_LANES floats of group g at p (q4p_t's s or m). */
#ifdef EXITLM_ZMM
AI __m512 q4p_floats(const int pk, const char *p, int64_t g) {
    if (pk == 2) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * g)));
    return _mm512_loadu_ps((const float *)p + 16 * g);
}
#else
AI __m256 q4p_floats(const int pk, const char *p, int64_t g) {
    if (pk == 2) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 * g)));
    return _mm256_loadu_ps((const float *)p + 16 * g);
}
#endif

/* Prefetch group g of the block pf_q4_tiles tiles ahead of tile n0 (at least the next block):
 * 16 lanes, its four lines of bytes and its line of scales (and mins); 8 lanes, half of that per
 * tile (the block's two tiles read the same lines). */
AI void q4p_prefetch(const int pk, const job_t *j, int64_t n0, int64_t g) {
    if (!PF_Q_BYTES) return;
    const int64_t G = j->K / 32, ahead = (pf_q4_tiles * A8_LANES + 15) / 16;
    const int64_t b = n0 / 16 + ahead, h = (n0 / 8) & 1, es = pk == 2 ? 2 : 4;
    const char *w = (const char *)j->w + (b * G + g) * 256;
    const char *s = (const char *)j->scales + (b * G + g) * 16 * es;
    const char *m = j->mins != NULL ? (const char *)j->mins + (b * G + g) * 16 * es : NULL;
    const int first = A8_LANES == 16 ? 0 : 2 * (int)h, last = A8_LANES == 16 ? 4 : first + 2;
    for (int l = first; l < last; l++) _mm_prefetch(w + 64 * l, _MM_HINT_T0);
    if (A8_LANES == 16 || h == 0) _mm_prefetch(s, _MM_HINT_T0);
    if (m != NULL && (A8_LANES == 16 || h == 1)) _mm_prefetch(m, _MM_HINT_T0);
}

#ifdef EXITLM_ZMM
/* The 16 bytes at off of 16 rows, transposed: T[c] lane r = bytes off + 4c .. off + 4c + 3 of
 * row r (q4: group g at off = 16g, byte j holding element j in the low nibble, 16 + j in the
 * high one). */
AI void a8_t16(const uint8_t *const rw[16], int64_t off, __m512i T[4]) {
    __m512i R[4];
    _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) { /* 128-bit lane L: row k + 4L */
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rw[k] + off)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rw[k + 4] + off)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rw[k + 8] + off)), 2);
        R[k] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rw[k + 12] + off)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(R[0], R[1]), t1 = _mm512_unpackhi_epi32(R[0], R[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(R[2], R[3]), t3 = _mm512_unpackhi_epi32(R[2], R[3]);
    T[0] = _mm512_unpacklo_epi64(t0, t2);
    T[1] = _mm512_unpackhi_epi64(t0, t2);
    T[2] = _mm512_unpacklo_epi64(t1, t3);
    T[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Group g of 16 q4 rows: W[c] lane r = the nibbles of elements 4c..4c+3 of row r (c < 4: low
 * nibbles of bytes 4c..4c+3; c >= 4: high nibbles of bytes 4(c-4)..). */
AI void a8_nibbles(const __m512i T[4], __m512i W[8]) {
    const __m512i m4 = _mm512_set1_epi8(15);
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        W[c] = _mm512_and_si512(T[c], m4);
        W[c + 4] = _mm512_and_si512(_mm512_srli_epi16(T[c], 4), m4);
    }
}

AI void a8_w4(const uint8_t *const rw[16], int64_t g, __m512i W[8]) {
    __m512i T[4];
    a8_t16(rw, 16 * g, T);
    a8_nibbles(T, W);
}

/* Group g's T[c] (a8_t16's registers) of a packed tile: four loads. */
AI void q4p_t16(const q4p_t *P, int64_t g, __m512i T[4]) {
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
        T[c] = _mm512_loadu_si512((const void *)(P->w + g * 256 + 64 * c));
}

/* Group g of 16 q8 rows: W[c] lane r = bytes 4c..4c+3 of row r's group. */
AI void a8_w8(const uint8_t *const rw[16], int64_t g, __m512i W[8]) {
    __m512i A[8], S[8], U[8];
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) { /* halves: rows (k, k+4), k < 4; (k+4, k+8) */
        const int lo = k < 4 ? k : k + 4;
        A[k] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(rw[lo] + 32 * g))),
            _mm256_loadu_si256((const __m256i *)(rw[lo + 4] + 32 * g)), 1);
    }
    _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
        S[2 * k] = _mm512_unpacklo_epi32(A[2 * k], A[2 * k + 1]);
        S[2 * k + 1] = _mm512_unpackhi_epi32(A[2 * k], A[2 * k + 1]);
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        const int b = 4 * h;
        U[b] = _mm512_unpacklo_epi64(S[b], S[b + 2]);     /* dwords 0 | 4 */
        U[b + 1] = _mm512_unpackhi_epi64(S[b], S[b + 2]); /* 1 | 5 */
        U[b + 2] = _mm512_unpacklo_epi64(S[b + 1], S[b + 3]);
        U[b + 3] = _mm512_unpackhi_epi64(S[b + 1], S[b + 3]);
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        W[c] = _mm512_shuffle_i32x4(U[c], U[c + 4], 0x88);     /* 128-bit lanes 0, 2 | 0, 2 */
        W[c + 4] = _mm512_shuffle_i32x4(U[c], U[c + 4], 0xDD); /* 1, 3 | 1, 3 */
    }
}

AI void a8_tile(const int kind, const int pk, const int mb, const job_t *j, int64_t n0,
                int64_t n1, int64_t m0) {
    const int64_t K = j->K, G = K / 32;
    const uint8_t *rw[16];
    const float *sr[16], *mr[16];
    q4p_t P = {NULL, NULL, NULL};
    if (pk)
        P = q4p_tile(pk, j, n0);
    else
        a8_rows(kind, j, n0, n1, rw, sr, mr);
    const __m512i zero = _mm512_setzero_si512(), b80 = _mm512_set1_epi8((char)0x80);
    __m512 acc[MBMAX];
    _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    float scT[A8_GB * 16], mnT[A8_GB * 16];
    for (int64_t g0 = 0; g0 < G; g0 += A8_GB) {
        const int gb = G - g0 < A8_GB ? (int)(G - g0) : A8_GB;
        if (!pk) {
            a8_scales(sr, g0, gb, scT);
            if (kind == K_Q4) a8_mins(j, mr, g0, gb, scT, mnT);
        }
        for (int gi = 0; gi < gb; gi++) {
            const int64_t g = g0 + gi;
            if (pk)
                q4p_prefetch(pk, j, n0, g);
            else
                a8_prefetch_next(kind, j, n0, g);
            __m512i W[8], base = zero;
            if (kind == K_Q8) {
                a8_w8(rw, g, W);
                __m512i s0 = zero, s1 = zero;
                _Pragma("GCC unroll 4") for (int c = 0; c < 8; c += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, b80, W[c]);
                    s1 = _mm512_dpbusd_epi32(s1, b80, W[c + 1]);
                }
                base = _mm512_sub_epi32(zero, _mm512_add_epi32(s0, s1));
            } else if (pk) {
                __m512i T[4];
                q4p_t16(&P, g, T);
                a8_nibbles(T, W);
            } else {
                a8_w4(rw, g, W);
            }
            const __m512 sv = pk ? q4p_floats(pk, P.s, g) : _mm512_loadu_ps(scT + gi * 16);
            __m512 mv = sv;
            if (kind == K_Q4)
                mv = !pk ? _mm512_loadu_ps(mnT + gi * 16)
                         : P.m != NULL ? q4p_floats(pk, P.m, g)
                                       : _mm512_mul_ps(_mm512_set1_ps(-8.0f), sv); /* q4_min */
            _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++) {
                const int64_t xm = (m0 + m) * K + 32 * g;
                __m512i i0 = base, i1 = zero;
                _Pragma("GCC unroll 4") for (int c = 0; c < 8; c += 2) {
                    if (kind == K_Q8) {
                        i0 = _mm512_dpbusd_epi32(i0, _mm512_set1_epi32(load_i32(j->xu + xm + 4 * c)), W[c]);
                        i1 = _mm512_dpbusd_epi32(i1, _mm512_set1_epi32(load_i32(j->xu + xm + 4 * c + 4)),
                                                 W[c + 1]);
                    } else {
                        i0 = _mm512_dpbusd_epi32(i0, W[c], _mm512_set1_epi32(load_i32(j->xq + xm + 4 * c)));
                        i1 = _mm512_dpbusd_epi32(i1, W[c + 1],
                                                 _mm512_set1_epi32(load_i32(j->xq + xm + 4 * c + 4)));
                    }
                }
                const __m512 d = _mm512_mul_ps(sv, _mm512_set1_ps(j->xd[(m0 + m) * G + g]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), d, acc[m]);
                if (kind == K_Q4)
                    acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(j->xg[(m0 + m) * G + g]), mv, acc[m]);
            }
        }
    }
    lanes_store(j, acc, mb, n0, n1, m0);
}
#else
/* The 16 bytes at off of 8 rows, transposed: T[c] lane r = bytes off + 4c .. off + 4c + 3 of
 * row r. */
AI void a8_t16(const uint8_t *const rw[8], int64_t off, __m256i T[4]) {
    __m256i R[4];
    for (int k = 0; k < 4; k++) R[k] = load_halves(rw[k] + off, rw[k + 4] + off);
    t4x4_epi32(R, T);
}

/* Group g of 8 q4 rows: W[c] lane r = the nibbles of elements 4c..4c+3 of row r. */
AI void a8_nibbles(const __m256i T[4], __m256i W[8]) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        W[c] = _mm256_and_si256(T[c], m4);
        W[c + 4] = _mm256_and_si256(_mm256_srli_epi16(T[c], 4), m4);
    }
}

AI void a8_w4(const uint8_t *const rw[8], int64_t g, __m256i W[8]) {
    __m256i T[4];
    a8_t16(rw, 16 * g, T);
    a8_nibbles(T, W);
}

/* Group g's T[c] (a8_t16's registers) of a packed tile: four loads. */
AI void q4p_t16(const q4p_t *P, int64_t g, __m256i T[4]) {
    for (int c = 0; c < 4; c++)
        T[c] = _mm256_loadu_si256((const __m256i *)(P->w + g * 256 + 64 * c));
}

/* Group g of 8 q8 rows: W[c] lane r = bytes 4c..4c+3 of row r's group (bytes 0-15, then 16-31). */
AI void a8_w8(const uint8_t *const rw[8], int64_t g, __m256i W[8]) {
    for (int h = 0; h < 2; h++) {
        __m256i R[4];
        for (int k = 0; k < 4; k++)
            R[k] = load_halves(rw[k] + 32 * g + 16 * h, rw[k + 4] + 32 * g + 16 * h);
        t4x4_epi32(R, W + 4 * h);
    }
}

AI void a8_tile(const int kind, const int pk, const int mb, const job_t *j, int64_t n0,
                int64_t n1, int64_t m0) {
    const int64_t K = j->K, G = K / 32;
    const uint8_t *rw[8];
    const float *sr[8], *mr[8];
    q4p_t P = {NULL, NULL, NULL};
    if (pk)
        P = q4p_tile(pk, j, n0);
    else
        a8_rows(kind, j, n0, n1, rw, sr, mr);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MBMAX];
    for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
    float scT[A8_GB * 8], mnT[A8_GB * 8];
    for (int64_t g0 = 0; g0 < G; g0 += A8_GB) {
        const int gb = G - g0 < A8_GB ? (int)(G - g0) : A8_GB;
        if (!pk) {
            a8_scales(sr, g0, gb, scT);
            if (kind == K_Q4) a8_mins(j, mr, g0, gb, scT, mnT);
        }
        for (int gi = 0; gi < gb; gi++) {
            const int64_t g = g0 + gi;
            if (pk)
                q4p_prefetch(pk, j, n0, g);
            else
                a8_prefetch_next(kind, j, n0, g);
            __m256i W[8];
            if (kind == K_Q8) {
                a8_w8(rw, g, W);
            } else if (pk) {
                __m256i T[4];
                q4p_t16(&P, g, T);
                a8_nibbles(T, W);
            } else {
                a8_w4(rw, g, W);
            }
            __m256i Wa[8];
            if (kind == K_Q8)
                for (int c = 0; c < 8; c++) Wa[c] = _mm256_sign_epi8(W[c], W[c]); /* |w| */
            const __m256 sv = pk ? q4p_floats(pk, P.s, g) : _mm256_loadu_ps(scT + gi * 8);
            __m256 mv = sv;
            if (kind == K_Q4)
                mv = !pk ? _mm256_loadu_ps(mnT + gi * 8)
                         : P.m != NULL ? q4p_floats(pk, P.m, g)
                                       : _mm256_mul_ps(_mm256_set1_ps(-8.0f), sv); /* q4_min */
            for (int m = 0; m < mb; m++) {
                const int8_t *xp = j->xq + (m0 + m) * K + 32 * g;
                __m256i isum;
                if (kind == K_Q8) {
                    __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c += 2) {
                        __m256i x0 = _mm256_set1_epi32(load_i32(xp + 4 * c));
                        __m256i x1 = _mm256_set1_epi32(load_i32(xp + 4 * c + 4));
                        i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                      Wa[c], _mm256_sign_epi8(x0, W[c])), ones));
                        i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                      Wa[c + 1], _mm256_sign_epi8(x1, W[c + 1])), ones));
                    }
                    isum = _mm256_add_epi32(i0, i1);
                } else {
                    __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c += 2) {
                        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(
                                                      W[c], _mm256_set1_epi32(load_i32(xp + 4 * c))));
                        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(
                                                      W[c + 1], _mm256_set1_epi32(load_i32(xp + 4 * c + 4))));
                    }
                    isum = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones);
                }
                const __m256 d = _mm256_mul_ps(sv, _mm256_set1_ps(j->xd[(m0 + m) * G + g]));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[m]);
                if (kind == K_Q4)
                    acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(j->xg[(m0 + m) * G + g]), mv, acc[m]);
            }
        }
    }
    lanes_store(j, acc, mb, n0, n1, m0);
}
#endif

/* Tables by layout (variant V: 2 q8, 3 q4, 4 q4 packed, 5 q4 packed with float16 scales)
 * and x rows. */
#define A8_FN(V, MB)                                                                        \
    static void a8_##V##_##MB(const job_t *j, int64_t n0, int64_t n1, int64_t m0) {        \
        a8_tile(V == 2 ? K_Q8 : K_Q4, V >= 4 ? V - 3 : 0, MB, j, n0, n1, m0);               \
    }
#define A8_ALL(V) A8_FN(V, 1) A8_FN(V, 2) A8_FN(V, 3) A8_FN(V, 4) A8_FN(V, 5) \
    A8_FN(V, 6) A8_FN(V, 7) A8_FN(V, 8)
A8_ALL(2)
A8_ALL(3)
A8_ALL(4)
A8_ALL(5)
typedef void (*a8_fn)(const job_t *, int64_t, int64_t, int64_t);
#define A8_ROW(V) {a8_##V##_1, a8_##V##_2, a8_##V##_3, a8_##V##_4, a8_##V##_5, \
                   a8_##V##_6, a8_##V##_7, a8_##V##_8}
static const a8_fn A8_TABLE[4][MBMAX] = {A8_ROW(2), A8_ROW(3), A8_ROW(4), A8_ROW(5)};

/* ------------------------------------------------------------------ q4, float32 activations: W rows in lanes
 *
 * q4 with float32 x rows (the q4 arithmetic of kernels.c's header) in the int8-activation
 * tiles' layout: A8_LANES consecutive W rows in the lanes of a register (past N the last row repeats and its
 * results are dropped), a group's 16 bytes transposed by a8_t16 (T[c] lane r = bytes 4c..4c+3
 * of row r: elements 4c + b in the low nibbles, 16 + 4c + b in the high ones).  Each weight
 * vector e (element e of every W row of the tile) is converted to float once per group, and
 * each x row of the tile meets it in four chains: s_{e % 4} = fma(w_e, x_e broadcast, s_{e % 4})
 * lane by lane, QF_ROWS x rows at a time so that their chains stay in registers (more rows:
 * the vectors converted once into wf, in L1, for every pass); then, per lane, y = fma((s_0 +
 * s_1) + (s_2 + s_3), scale_g, y) and y = fma(X_g, min_g, y).  Every float operation of a pair
 * happens in its own lane, in the order of kernels.c's header, whatever the tile, build or
 * thread count.
 *
 * Why: the per-row layout (q8's tiles above) converts each nibble once per W row and sums every
 * pair horizontally, with the min term on top; here conversion, scale and min are one
 * instruction per A8_LANES pairs, so the FMAs of the extra x rows are most of what several rows
 * add.  (q8 keeps the per-row layout: its bytes convert in one sign-extending load there, and
 * on AVX2 the lanes made one-row q8 products 4-10% slower.) */
#ifdef EXITLM_ZMM
#define QF_ROWS 4 /* x rows sharing each converted weight vector: 16 chains in registers */
typedef __m512 vf_t;
typedef __m512i vi_t;
AI vf_t vf_zero(void) { return _mm512_setzero_ps(); }
AI vf_t vf_set1(float a) { return _mm512_set1_ps(a); }
AI vf_t vf_load(const float *p) { return _mm512_loadu_ps(p); }
AI vf_t vf_add(vf_t a, vf_t b) { return _mm512_add_ps(a, b); }
AI vf_t vf_mul(vf_t a, vf_t b) { return _mm512_mul_ps(a, b); }
AI vf_t vf_fma(vf_t a, vf_t b, vf_t c) { return _mm512_fmadd_ps(a, b, c); }
AI vf_t vi_float(vi_t v) { return _mm512_cvtepi32_ps(v); }
AI vi_t vi_srli(vi_t v, const int n) { return _mm512_srli_epi32(v, n); }
AI vi_t vi_and15(vi_t v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
#else
#define QF_ROWS 2 /* 8 chains: AVX2 has 16 registers */
typedef __m256 vf_t;
typedef __m256i vi_t;
AI vf_t vf_zero(void) { return _mm256_setzero_ps(); }
AI vf_t vf_set1(float a) { return _mm256_set1_ps(a); }
AI vf_t vf_load(const float *p) { return _mm256_loadu_ps(p); }
AI vf_t vf_add(vf_t a, vf_t b) { return _mm256_add_ps(a, b); }
AI vf_t vf_mul(vf_t a, vf_t b) { return _mm256_mul_ps(a, b); }
AI vf_t vf_fma(vf_t a, vf_t b, vf_t c) { return _mm256_fmadd_ps(a, b, c); }
AI vf_t vi_float(vi_t v) { return _mm256_cvtepi32_ps(v); }
AI vi_t vi_srli(vi_t v, const int n) { return _mm256_srli_epi32(v, n); }
AI vi_t vi_and15(vi_t v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
#endif

/* Weight vector e of the group (lane r: element e of row r) as floats: for e = 16h + 4c + b,
 * the low (h = 0) or high nibble of byte b of T[c]. */
AI vf_t qf_weight(const vi_t T[4], const int e) {
    const int c = (e >> 2) & 3, sh = 8 * (e & 3) + 4 * (e >> 4);
    return vi_float(sh == 28 ? vi_srli(T[c], 28) : vi_and15(sh == 0 ? T[c] : vi_srli(T[c], sh)));
}

/* x rows row0 .. row0 + nr - 1 (nr <= QF_ROWS) against group g (T: its transposed bytes; wf:
 * its weight vectors, converted, or NULL to convert them here); then each row's y takes the
 * group (see above). */
AI void qf_rows(const int nr, const job_t *j, int64_t row0, int64_t g, const vi_t T[4],
                const vf_t *wf, vf_t sv, vf_t mv, vf_t *acc) {
    const int64_t K = j->K, G = K / 32;
    vf_t s[QF_ROWS][4];
    const float *xp[QF_ROWS];
    _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++) {
        xp[r] = j->x + (row0 + r) * K + 32 * g;
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) s[r][t] = vf_zero();
    }
    _Pragma("GCC unroll 32") for (int e = 0; e < 32; e++) {
        const vf_t w = wf != NULL ? wf[e] : qf_weight(T, e);
        _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++)
            s[r][e & 3] = vf_fma(w, vf_set1(xp[r][e]), s[r][e & 3]);
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++) {
        const vf_t gs = vf_add(vf_add(s[r][0], s[r][1]), vf_add(s[r][2], s[r][3]));
        acc[r] = vf_fma(gs, sv, acc[r]);
        acc[r] = vf_fma(vf_set1(j->xg[(row0 + r) * G + g]), mv, acc[r]);
    }
}

AI void qf_tile(const int pk, const int mb, const job_t *j, int64_t n0, int64_t n1, int64_t m0) {
    const int64_t K = j->K, G = K / 32;
    const uint8_t *rw[A8_LANES];
    const float *sr[A8_LANES], *mr[A8_LANES];
    q4p_t P = {NULL, NULL, NULL};
    if (pk)
        P = q4p_tile(pk, j, n0);
    else
        a8_rows(K_Q4, j, n0, n1, rw, sr, mr);
    vf_t acc[MBMAX];
    _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++) acc[m] = vf_zero();
    float scT[A8_GB * A8_LANES], mnT[A8_GB * A8_LANES];
    for (int64_t g0 = 0; g0 < G; g0 += A8_GB) {
        const int gb = G - g0 < A8_GB ? (int)(G - g0) : A8_GB;
        if (!pk) {
            a8_scales(sr, g0, gb, scT);
            a8_mins(j, mr, g0, gb, scT, mnT);
        }
        for (int gi = 0; gi < gb; gi++) {
            const int64_t g = g0 + gi;
            vi_t T[4];
            vf_t sv, mv;
            if (pk) {
                q4p_prefetch(pk, j, n0, g);
                q4p_t16(&P, g, T);
                sv = q4p_floats(pk, P.s, g);
                mv = P.m != NULL ? q4p_floats(pk, P.m, g) : vf_mul(vf_set1(-8.0f), sv); /* q4_min */
            } else {
                a8_prefetch_next(K_Q4, j, n0, g);
                a8_t16(rw, 16 * g, T);
                sv = vf_load(scT + gi * A8_LANES);
                mv = vf_load(mnT + gi * A8_LANES);
            }
            if (mb <= QF_ROWS) { /* one pass: each weight vector converted as it is used */
                qf_rows(mb, j, m0, g, T, NULL, sv, mv, acc);
            } else { /* converted once into wf (L1) for the passes of QF_ROWS rows */
                vf_t wf[32];
                _Pragma("GCC unroll 32") for (int e = 0; e < 32; e++) wf[e] = qf_weight(T, e);
                _Pragma("GCC unroll 8") for (int m = 0; m < mb; m += QF_ROWS)
                    qf_rows(mb - m < QF_ROWS ? mb - m : QF_ROWS, j, m0 + m, g, T, wf, sv, mv,
                            acc + m);
            }
        }
    }
    lanes_store(j, acc, mb, n0, n1, m0);
}

#define QF_FN(PK, MB)                                                                       \
    static void qf_##PK##_##MB(const job_t *j, int64_t n0, int64_t n1, int64_t m0) {       \
        qf_tile(PK, MB, j, n0, n1, m0);                                                     \
    }
#define QF_ALL(PK) QF_FN(PK, 1) QF_FN(PK, 2) QF_FN(PK, 3) QF_FN(PK, 4) QF_FN(PK, 5) \
    QF_FN(PK, 6) QF_FN(PK, 7) QF_FN(PK, 8)
QF_ALL(0)
QF_ALL(1)
QF_ALL(2)
#define QF_ROW(PK) {qf_##PK##_1, qf_##PK##_2, qf_##PK##_3, qf_##PK##_4, qf_##PK##_5, \
                    qf_##PK##_6, qf_##PK##_7, qf_##PK##_8}
static const a8_fn QF_TABLE[3][MBMAX] = {QF_ROW(0), QF_ROW(1), QF_ROW(2)};

/* x rows per q4 float32-activation tile (1..8) per tile_rows(M). */
static int qf_cfg[3] = {1, 4, 8};

/* Output rows n0..n1 of a job on the W-rows-in-lanes tiles (int8 activations; q4 with float32
 * ones): tiles of A8_LANES W rows x a8_cfg or qf_cfg x rows. */
void lanes_range(const job_t *j, int64_t n0, int64_t n1) {
    const int a8 = j->xq != NULL, q4 = j->kind == K_Q4, r = tile_rows(j->M);
    const int64_t M = j->M;
    const int mbt = a8 ? a8_cfg[q4][r] : qf_cfg[r];
    const int pk = q4 ? j->packed : 0;
    const a8_fn *table = a8 ? A8_TABLE[q4 + pk] : QF_TABLE[pk];
    for (int64_t n = n0; n < n1; n += A8_LANES)
        for (int64_t m = 0; m < M;) {
            const int mb = M - m >= mbt ? mbt : (int)(M - m);
            table[mb - 1](j, n, n1 - n < A8_LANES ? n1 : n + A8_LANES, m);
            m += mb;
        }
}

int lanes_set_tile(int kind, int rows, int mb) {
    if (kind == K_Q4)
        qf_cfg[rows] = mb;
    else
        a8_cfg[kind - 4][rows] = mb;
    return 0;
}
#endif
