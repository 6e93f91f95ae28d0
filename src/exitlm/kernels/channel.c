/* One-way byte channels between two processes of one machine through shared memory.
 *
 * Pipeline-based early-exit inference (exitlm.parallel.infer.pipeline_ee, EE-LLM Sec. 4)
 * sends a few small messages per token between its stage processes: the next command and
 * the hidden state down the pipeline, the decision (and the deciding logits) back to stage 0.
 * Through gloo over 127.0.0.1 each transfer cost 0.1-0.5 ms of both processes' time here,
 * ~1-2 ms per token - as much as the 8 layers of a small model. A channel here is a ring of
 * `cap` bytes with two counters: `written` (bytes the sender has published) and `read`
 * (bytes the receiver has consumed). The sender copies into the free part of the ring and
 * publishes (release store); the receiver copies out what is published and gives the room
 * back. One sender, one receiver, messages in order (the protocol of the pipeline knows
 * every message's size at both ends, so no framing is needed).
 *
 * Waiting: spin with PAUSE for ~40 us (a reply that is nearly there), then sleep on the
 * counter with a futex (Linux; elsewhere short sleeps) so that an idle stage - a server's
 * pipeline waits hours for its next request - costs no CPU. A sleeping side announces itself
 * in its `waiting` word; the other side wakes it after publishing when it sees that word set.
 * Both the announcement and the publication are sequentially consistent, so either the
 * waker sees the waiter or the waiter sees the new count (no lost wake-up).
 *
 * Failure: a wait ends with an error after its timeout (a negative timeout: never), when the
 * peer marked the channel aborted (exitlm_chan_abort), or - with `watch` - when the peer's
 * process is gone (its pid is in its header line), so a killed stage never hangs the others.
 */

#define _GNU_SOURCE
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "exitlm_native.h"
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

/* Header: four 128-byte lines of int64, then the ring. Line 0 belongs to the sender, line 1
 * to the receiver (each writes only its own line). */
#define LINE 16
#define H_WRITTEN 0                 /* sender: bytes published (futex word: its low half) */
#define H_SENDER_PID 1
#define H_SENDER_ABORT 2
#define H_SENDER_WAITING 3          /* sender sleeps until `read` changes */
#define H_READ (LINE + 0)           /* receiver: bytes consumed */
#define H_RECEIVER_PID (LINE + 1)
#define H_RECEIVER_ABORT (LINE + 2)
#define H_RECEIVER_WAITING (LINE + 3)
#define HEADER_WORDS (4 * LINE)

#define ERR_TIMEOUT (-20)
#define ERR_PEER (-21)
#define ERR_ARGS (-22)
#define ERR_DEAD (-23)

#define SPIN_S 40e-6   /* busy-wait this long before sleeping */
#define NAP_S 2e-3     /* a sleep lasts at most this long: deadline and peer checks between */
#define CHECK_S 20e-3  /* how often a sleeping wait looks at the peer's process */

static void nap(int64_t *word, int64_t seen, double max_s) {
#ifdef __linux__
    struct timespec ts = {(time_t)max_s, (long)((max_s - (double)(time_t)max_s) * 1e9)};
    /* the low half of a little-endian int64 counter: it changes with every publication */
    syscall(SYS_futex, (int32_t *)word, FUTEX_WAIT, (int32_t)seen, &ts, NULL, 0);
#else
    (void)word;
    (void)seen;
    struct timespec ts = {0, (long)(max_s * 1e9 / 20)};
    nanosleep(&ts, NULL);
#endif
}

static void wake(int64_t *word) {
#ifdef __linux__
    syscall(SYS_futex, (int32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* Wait until header[word] > target, the peer writing it. */
static int wait_above(exitlm_chan *c, int word, int64_t target, double timeout_s) {
    int64_t *h = c->header, *w = &h[word];
    const int peer_abort = c->sender ? H_RECEIVER_ABORT : H_SENDER_ABORT;
    const int peer_pid = c->sender ? H_RECEIVER_PID : H_SENDER_PID;
    int64_t *waiting = &h[c->sender ? H_SENDER_WAITING : H_RECEIVER_WAITING];
    const double start = exitlm_now_s();
    for (int64_t spins = 0;; spins++) {
        if (__atomic_load_n(w, __ATOMIC_ACQUIRE) > target) return 0;
        if (__atomic_load_n(&h[peer_abort], __ATOMIC_RELAXED)) return ERR_PEER;
        RELAX();
        if ((spins & 255) == 255 && exitlm_now_s() - start > SPIN_S) break;
    }
    double checked = exitlm_now_s();
    for (;;) {
        __atomic_store_n(waiting, 1, __ATOMIC_SEQ_CST);
        const int64_t v = __atomic_load_n(w, __ATOMIC_SEQ_CST);
        if (v > target) break;
        if (__atomic_load_n(&h[peer_abort], __ATOMIC_RELAXED)) {
            __atomic_store_n(waiting, 0, __ATOMIC_RELAXED);
            return ERR_PEER;
        }
        const double t = exitlm_now_s();
        if (timeout_s >= 0 && t - start > timeout_s) {
            __atomic_store_n(waiting, 0, __ATOMIC_RELAXED);
            return ERR_TIMEOUT;
        }
        if (c->watch && t - checked > CHECK_S) {
            checked = t;
            if (!exitlm_process_alive(__atomic_load_n(&h[peer_pid], __ATOMIC_RELAXED))) {
                __atomic_store_n(waiting, 0, __ATOMIC_RELAXED);
                return ERR_DEAD;
            }
        }
        nap(w, v, NAP_S);
    }
    __atomic_store_n(waiting, 0, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return 0;
}

/* Publish header[word] = value and wake the peer if it sleeps on it. */
static void publish(exitlm_chan *c, int word, int64_t value) {
    int64_t *h = c->header;
    __atomic_store_n(&h[word], value, __ATOMIC_SEQ_CST);
    int64_t *peer_waiting = &h[c->sender ? H_RECEIVER_WAITING : H_SENDER_WAITING];
    if (__atomic_load_n(peer_waiting, __ATOMIC_SEQ_CST)) wake(&h[word]);
}

/* Send n bytes (blocks while the ring is full). */
int exitlm_chan_send(exitlm_chan *c, const void *buf, int64_t n, double timeout_s) {
    if (c == NULL || !c->sender || n < 0 || c->cap <= 0) return ERR_ARGS;
    const uint8_t *src = buf;
    int64_t *h = c->header;
    int64_t w = __atomic_load_n(&h[H_WRITTEN], __ATOMIC_RELAXED);
    while (n > 0) {
        int rc = wait_above(c, H_READ, w - c->cap, timeout_s); /* some room */
        if (rc != 0) return rc;
        const int64_t r = __atomic_load_n(&h[H_READ], __ATOMIC_ACQUIRE);
        int64_t len = c->cap - (w - r);
        if (len > n) len = n;
        const int64_t at = w % c->cap;
        const int64_t first = len < c->cap - at ? len : c->cap - at;
        memcpy(c->ring + at, src, (size_t)first);
        memcpy(c->ring, src + first, (size_t)(len - first));
        w += len;
        src += len;
        n -= len;
        publish(c, H_WRITTEN, w);
    }
    return 0;
}

/* Receive exactly n bytes (blocks until they are all published). */
int exitlm_chan_recv(exitlm_chan *c, void *buf, int64_t n, double timeout_s) {
    if (c == NULL || c->sender || n < 0 || c->cap <= 0) return ERR_ARGS;
    uint8_t *dst = buf;
    int64_t *h = c->header;
    int64_t r = __atomic_load_n(&h[H_READ], __ATOMIC_RELAXED);
    while (n > 0) {
        int rc = wait_above(c, H_WRITTEN, r, timeout_s); /* something published */
        if (rc != 0) return rc;
        const int64_t w = __atomic_load_n(&h[H_WRITTEN], __ATOMIC_ACQUIRE);
        int64_t len = w - r;
        if (len > n) len = n;
        const int64_t at = r % c->cap;
        const int64_t first = len < c->cap - at ? len : c->cap - at;
        memcpy(dst, c->ring + at, (size_t)first);
        memcpy(dst + first, c->ring, (size_t)(len - first));
        r += len;
        dst += len;
        n -= len;
        publish(c, H_READ, r);
    }
    return 0;
}

/* Sender: wait until the receiver has taken every byte sent. */
int exitlm_chan_drain(exitlm_chan *c, double timeout_s) {
    if (c == NULL || !c->sender) return ERR_ARGS;
    const int64_t w = __atomic_load_n(&c->header[H_WRITTEN], __ATOMIC_RELAXED);
    return wait_above(c, H_READ, w - 1, timeout_s);
}

/* Mark this end failed: the peer's waits on this channel end with ERR_PEER. */
void exitlm_chan_abort(exitlm_chan *c) {
    if (c == NULL) return;
    int64_t *h = c->header;
    __atomic_store_n(&h[c->sender ? H_SENDER_ABORT : H_RECEIVER_ABORT], 1, __ATOMIC_SEQ_CST);
    wake(&h[H_WRITTEN]);
    wake(&h[H_READ]);
}

/* Header size in bytes (the ring follows it). */
int64_t exitlm_chan_header_bytes(void) { return (int64_t)HEADER_WORDS * 8; }
