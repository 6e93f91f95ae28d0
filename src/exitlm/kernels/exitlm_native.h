/* exitlm's native library: every exported function and shared struct, in one place.
 *
 * The library (the products: kernels.c and the files it names; block.c, reduce.c, channel.c)
 * is loaded from Python with ctypes; exitlm/kernels/abi.py mirrors this header (the structs as
 * ctypes.Structure, the functions as argtypes/restype lists) and
 * tests/kernels/test_native_abi.py parses this file and checks the mirror field by field and
 * argument by argument. At load, abi.py compares
 * exitlm_abi_version() and exitlm_struct_size() with its own values and refuses a library
 * that disagrees (a stale build or a one-sided edit would otherwise read the wrong memory).
 *
 * Change a struct or a signature here, in the C file that defines it and in abi.py together,
 * and bump EXITLM_ABI_VERSION.
 *
 * Conventions: every pointer argument is a raw address (ctypes.c_void_p); sizes and indices
 * are int64_t; a thread count is an int; functions returning int return 0 on success and a
 * negative code on failure.
 */
#ifndef EXITLM_NATIVE_H
#define EXITLM_NATIVE_H

#include <stdint.h>

#define EXITLM_ABI_VERSION 7

/* ------------------------------------------------------------------ shared structs */

/* A weight of any format (block.c). */
typedef struct exitlm_weight {
    int64_t fmt; /* 0 f32, 1 f16, 2 q8, 3 q4; q4 in 16-row blocks (exitlm_gemm_q4p; products
                  * only, not an embedding): 4 with float32 scales and mins, 5 float16 */
    int64_t n, k;
    const void *w; /* f32/f16 weight (n, k) or the quantized values */
    const float *scales;
    const float *mins; /* q4: or NULL for Q4_0's mins = -8 * scales */
} exitlm_weight;

/* The shapes and scalars of a Llama-family block (block.c). */
typedef struct exitlm_block_dims {
    int64_t dim, heads, kv_heads, head_dim, hidden;
    float eps;
    float attn_scale;
} exitlm_block_dims;

struct exitlm_reduce;

/* One layer of a chain of blocks (block.c): what exitlm_llama_block takes per layer. */
typedef struct exitlm_layer {
    const exitlm_block_dims *d;
    const float *norm1, *norm2;
    const exitlm_weight *wqkv, *wo, *w_in, *w_out;
    float *kc, *vc;
    int64_t head_stride;
    struct exitlm_reduce *red;
} exitlm_layer;

/* One rank's view of the tensor-parallel shared region (reduce.c). flags: world flags
 * 16 int64 apart; data: 2 buffers of world slots of `cap` floats. */
typedef struct exitlm_reduce {
    int64_t *flags;
    float *data;
    int64_t cap, rank, world, seq;
    double timeout_s;
    int64_t watch; /* 1: check that waited-for peers' processes still live */
} exitlm_reduce;

/* One end of a one-way byte channel between two processes (channel.c). */
typedef struct exitlm_chan {
    int64_t *header;
    uint8_t *ring;
    int64_t cap;
    int64_t sender; /* 1: this end sends, 0: it receives */
    int64_t watch;  /* 1: a wait checks that the peer's process still lives */
} exitlm_chan;

/* Indices for exitlm_struct_size (abi.py checks each against ctypes.sizeof). */
enum {
    EXITLM_STRUCT_WEIGHT = 0,
    EXITLM_STRUCT_BLOCK_DIMS = 1,
    EXITLM_STRUCT_LAYER = 2,
    EXITLM_STRUCT_REDUCE = 3,
    EXITLM_STRUCT_CHAN = 4
};

/* CPU features for exitlm_cpu_features (a bit mask). */
enum {
    EXITLM_CPU_AVX2 = 1,    /* with FMA and F16C: what the avx2 build needs */
    EXITLM_CPU_AVX512 = 2   /* AVX-512 F, BW, VL, DQ and VNNI: what the avx512 build needs */
};

/* ------------------------------------------------------------------ identity (kernels.c) */

int exitlm_abi_version(void);
int64_t exitlm_struct_size(int which);
const char *exitlm_isa(void);
int exitlm_cpu_features(void);
int exitlm_has_avx2(void);

/* ------------------------------------------------------------------ products (kernels.c) */

int exitlm_gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                    int nthreads);
int exitlm_gemm_f16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                    int nthreads);
int exitlm_gemm_q8(const float *x, const int8_t *q, const float *scales, float *y, int64_t M,
                   int64_t N, int64_t K, int nthreads);
int exitlm_gemm_q4(const float *x, const uint8_t *q, const float *scales, const float *mins,
                   float *y, int64_t M, int64_t N, int64_t K, int nthreads);
int exitlm_gemm_q8a8(const float *x, const int8_t *q, const float *scales, float *y, int64_t M,
                     int64_t N, int64_t K, int nthreads);
int exitlm_gemm_q4a8(const float *x, const uint8_t *q, const float *scales, const float *mins,
                     float *y, int64_t M, int64_t N, int64_t K, int nthreads);
/* q4 in 16-row blocks: W rows 16b .. 16b + 15 (past N, copies of row N - 1) form block b; per
 * block and group g of 32, q holds 256 bytes at (b * G + g) * 256 whose bytes 64c + 4r + i are
 * byte 4c + i (c < 4, i < 4) of the group's 16 plain bytes (exitlm_gemm_q4's layout) in row
 * 16b + r, and scales (mins) the 16 values at (b * G + g) * 16, lane r row 16b + r: float32,
 * or float16 when half != 0.  The same bits as exitlm_gemm_q4 / _q4a8 with the plain layout
 * and those values as float32; -3 on builds without AVX2. */
int exitlm_gemm_q4p(const float *x, const uint8_t *q, const void *scales, const void *mins,
                    int half, float *y, int64_t M, int64_t N, int64_t K, int nthreads);
int exitlm_gemm_q4pa8(const float *x, const uint8_t *q, const void *scales, const void *mins,
                      int half, float *y, int64_t M, int64_t N, int64_t K, int nthreads);
void exitlm_round_to_half(float *x, int64_t n);
int exitlm_pool_workers(void);
int exitlm_set_tile(int kind, int rows, int nb, int mb);
void exitlm_set_spin(int iters);
int exitlm_set_narrow_rows(int rows);

/* ------------------------------------------------------------------ greedy screens (kernels.c) */

int exitlm_screen_round(const float *x, int64_t M, int64_t K, float *xh, double *terms);
int64_t exitlm_screen_candidates(const float *a, const float *norms, const float *rounding,
                                 int64_t n, double e1, double l1, double extra, int half,
                                 int64_t cap, int64_t *out);

/* ------------------------------------------------------------------ blocks (block.c) */

int exitlm_set_int8_activations(int on);
int exitlm_int8_activations(void);
int64_t exitlm_block_scratch(const exitlm_block_dims *d, int64_t M, int64_t positions);
int exitlm_llama_block(float *h, int64_t M, const exitlm_block_dims *d, const float *norm1,
                       const float *norm2, const exitlm_weight *wqkv, const exitlm_weight *wo,
                       const exitlm_weight *w_in, const exitlm_weight *w_out,
                       const float *cos_t, const float *ssin, float *kc, float *vc,
                       int64_t head_stride, int64_t start, float *scratch, int nthreads,
                       exitlm_reduce *red);
int exitlm_llama_blocks(float *h, int64_t M, int64_t n, const exitlm_layer *layers,
                        const float *cos_t, const float *ssin, int64_t start, float *scratch,
                        int nthreads, int half_stream);
int exitlm_llama_blocks_rows(float *h, int64_t M, int64_t n, const exitlm_layer *layers,
                             const float *cos_t, const float *ssin, const int64_t *pos,
                             const int64_t *off, float *scratch, int nthreads, int half_stream);
int exitlm_chain(int64_t token, int64_t n, int64_t n_layers, const exitlm_layer *layers,
                 const float *cos_table, const float *ssin_table, int64_t start,
                 const exitlm_weight *embed, const float *norm, float eps,
                 const exitlm_weight *head, const int64_t *ids, float min_conf,
                 int64_t *steps, float *hidden, int64_t *tokens, float *work, float *scratch,
                 int nthreads);
int exitlm_segments(float *hidden, int64_t q, const int64_t *starts, const int64_t *bounds,
                    int64_t n_seg, int probe, float stop_prob, const exitlm_layer *layers,
                    const float *cos_table, const float *ssin_table, const float *norm,
                    float eps, const exitlm_weight *head, float *work, float *scratch,
                    int nthreads, int64_t *out);

/* ------------------------------------------------------------------ collectives (reduce.c) */

int exitlm_process_alive(int64_t pid);
double exitlm_now_s(void);
int exitlm_reduce_sum(exitlm_reduce *r, float *x, int64_t n);
int exitlm_reduce_gather(exitlm_reduce *r, const float *x, int64_t n, float *out);
void exitlm_reduce_abort(exitlm_reduce *r);

/* ------------------------------------------------------------------ channels (channel.c) */

int exitlm_chan_send(exitlm_chan *c, const void *buf, int64_t n, double timeout_s);
int exitlm_chan_recv(exitlm_chan *c, void *buf, int64_t n, double timeout_s);
int exitlm_chan_drain(exitlm_chan *c, double timeout_s);
void exitlm_chan_abort(exitlm_chan *c);
int64_t exitlm_chan_header_bytes(void);

#endif /* EXITLM_NATIVE_H */
