/* Collectives of the tensor-parallel ranks of one machine through shared memory.
 *
 * Tensor-parallel decoding (exitlm.parallel.infer.tp_decode) sums two partial products per
 * layer over its ranks (Megatron-LM's row-parallel output and MLP projections) and gathers
 * the vocabulary-parallel logits. Through gloo each such call measured ~1 ms between two
 * processes on one 2-core machine - 60 of them per token of a 30-layer model, more than the
 * whole token takes in one process. Here every rank writes its part into its own slot of a
 * shared mapping, publishes a sequence number, waits for every peer's number and reads the
 * slots: a few microseconds when each rank has a core.
 *
 * Exactness: every rank adds the slots in rank order (slot 0 + slot 1 + ...), so all ranks
 * hold the same bits, which the decoders rely on to take the same decisions on every rank.
 *
 * Reuse: two buffers alternate by sequence parity. A rank can only start round s + 2 (which
 * writes the buffer of round s) after every peer published s + 1, and a peer publishes s + 1
 * only after it finished reading round s.
 *
 * Waiting spins with PAUSE, then yields the core (oversubscribed machines: more ranks than
 * cores), and gives up after the timeout, as soon as a peer marks itself failed (a negative
 * sequence number, exitlm_reduce_abort) or, with `watch`, once the awaited peer's process is
 * gone (killed ranks cannot mark anything), so a dead rank never hangs the others.
 */

#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#include "exitlm_native.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

#define FLAG_STRIDE 16 /* int64 per flag: one 128-byte line each, no false sharing */
#define SPINS_BEFORE_YIELD 2000 /* ~50 us of PAUSE; then share the core */

#define ERR_TIMEOUT (-20)
#define ERR_PEER (-21)
#define ERR_ARGS (-22)
#define ERR_DEAD (-23)
#define PID_SLOT 2 /* each rank's process id, in its flag's line */

/* Whether process `pid` still runs: not gone and not a zombie (a killed worker whose parent,
 * the rank waiting here, has not reaped it yet). Linux reads /proc; elsewhere kill(pid, 0).
 * Also the peer check of the pipeline channels (channel.c). */
int exitlm_process_alive(int64_t pid) {
    if (pid <= 0) return 1;
#ifdef __linux__
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL) return errno != ENOENT;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *rp = strrchr(buf, ')');
    return !(rp != NULL && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X'));
#else
    return kill((pid_t)pid, 0) == 0 || errno != ESRCH;
#endif
}

/* Monotonic seconds (also channel.c's clock). */
double exitlm_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Publish round `seq` and wait until every rank has. */
static int meet(exitlm_reduce *r, int64_t seq) {
    __atomic_store_n(&r->flags[r->rank * FLAG_STRIDE], seq, __ATOMIC_RELEASE);
    double deadline = -1.0;
    for (int64_t p = 0; p < r->world; p++) {
        if (p == r->rank) continue;
        int64_t *flag = &r->flags[p * FLAG_STRIDE];
        for (int64_t spins = 0;; spins++) {
            int64_t v = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
            if (v >= seq) break;
            if (v < 0) return ERR_PEER;
            if (spins < SPINS_BEFORE_YIELD) {
                RELAX();
                continue;
            }
            sched_yield();
            if ((spins & 63) == 0) {
                double t = exitlm_now_s();
                if (deadline < 0) deadline = t + r->timeout_s;
                else if (t > deadline) return ERR_TIMEOUT;
                if (r->watch && !exitlm_process_alive(__atomic_load_n(&r->flags[p * FLAG_STRIDE + PID_SLOT],
                                                            __ATOMIC_RELAXED)))
                    return ERR_DEAD;
            }
        }
    }
    return 0;
}

static float *slot(exitlm_reduce *r, int64_t seq, int64_t rank) {
    return r->data + ((seq & 1) * r->world + rank) * r->cap;
}

/* Every rank publishes x (n floats) in rounds of at most `cap`; after each round either
 * sum (non-NULL) receives the rank-order sum of the round's slots or gather (non-NULL,
 * (world, n) rank-major) their copies. */
static int exchange(exitlm_reduce *r, const float *x, int64_t n, float *sum, float *gather) {
    if (r == NULL || n < 0 || r->cap <= 0) return ERR_ARGS;
    for (int64_t off = 0; off < n; off += r->cap) {
        const int64_t len = n - off < r->cap ? n - off : r->cap;
        const int64_t seq = ++r->seq;
        memcpy(slot(r, seq, r->rank), x + off, (size_t)len * sizeof(float));
        int rc = meet(r, seq);
        if (rc != 0) return rc;
        if (sum != NULL) {
            float *out = sum + off;
            memcpy(out, slot(r, seq, 0), (size_t)len * sizeof(float));
            for (int64_t p = 1; p < r->world; p++) {
                const float *s = slot(r, seq, p);
                for (int64_t i = 0; i < len; i++) out[i] += s[i];
            }
        } else {
            for (int64_t p = 0; p < r->world; p++)
                memcpy(gather + p * n + off, slot(r, seq, p), (size_t)len * sizeof(float));
        }
    }
    return 0;
}

/* x (n floats) <- the sum over ranks of every rank's x, added in rank order. */
int exitlm_reduce_sum(exitlm_reduce *r, float *x, int64_t n) {
    return exchange(r, x, n, x, NULL);
}

/* out (world, n) <- every rank's x (n floats), rank-major. */
int exitlm_reduce_gather(exitlm_reduce *r, const float *x, int64_t n, float *out) {
    return exchange(r, x, n, NULL, out);
}

/* Mark this rank failed: peers waiting for it return ERR_PEER at once. */
void exitlm_reduce_abort(exitlm_reduce *r) {
    if (r != NULL) __atomic_store_n(&r->flags[r->rank * FLAG_STRIDE], (int64_t)-1, __ATOMIC_RELEASE);
}
