/* The thread pool of the products: N is split into contiguous chunks, each output element
 * computed by exactly one thread (so results do not depend on the thread count); a small
 * persistent pool, created lazily, whose workers spin briefly then sleep on a condition
 * variable; the calling thread runs the first chunk. */
#include "gemm.h"

#define MAX_WORKERS 63
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one pooled call at a time */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static int n_workers = 0;
static atomic_uint_fast64_t pool_gen = 0;
static atomic_int pool_pending = 0;
static const job_t *pool_job = NULL;
static int64_t pool_chunk = 0;
static int pool_parts = 0;
static int atfork_done = 0;
static int spin_iters = 2000; /* ~50-100 us of PAUSE before a worker sleeps */
static uint_fast64_t worker_gen0[MAX_WORKERS + 1];

static inline void cpu_relax(void) {
#ifdef __AVX2__
    _mm_pause();
#endif
}

/* Items n0 .. n1 - 1 of j: a product's output rows, or a task's items. */
static void run_items(const job_t *j, int64_t n0, int64_t n1, int part) {
    if (j->task != NULL)
        j->task(j->ctx, n0, n1, part);
    else
        run_range(j, n0, n1);
}

static void run_part(const job_t *j, int64_t chunk, int part) {
    int64_t n0 = part * chunk, n1 = n0 + chunk;
    if (n1 > j->N) n1 = j->N;
    if (n0 < n1) run_items(j, n0, n1, part);
}

static void *worker_main(void *arg) {
    int idx = (int)(intptr_t)arg;
    /* the generation current when this worker was created (under call_mu, before the
     * dispatch that needed it), not the one when it starts running */
    uint_fast64_t seen = worker_gen0[idx];
    for (;;) {
        uint_fast64_t g = seen;
        for (int it = 0; it < spin_iters; it++) {
            g = atomic_load_explicit(&pool_gen, memory_order_acquire);
            if (g != seen) break;
            cpu_relax();
        }
        if (g == seen) {
            pthread_mutex_lock(&wake_mu);
            while ((g = atomic_load_explicit(&pool_gen, memory_order_acquire)) == seen)
                pthread_cond_wait(&wake_cv, &wake_mu);
            pthread_mutex_unlock(&wake_mu);
        }
        seen = g;
        if (idx < pool_parts) run_part(pool_job, pool_chunk, idx);
        atomic_fetch_sub_explicit(&pool_pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void pool_after_fork_child(void) {
    /* The workers do not exist in a forked child: start from an empty pool. */
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER, w = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    call_mu = m;
    wake_mu = w;
    wake_cv = c;
    n_workers = 0;
    atomic_store(&pool_pending, 0);
}

/* Called with call_mu held.  Returns the number of workers available (>= 0). */
static int pool_ensure(int want) {
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, pool_after_fork_child);
        atfork_done = 1;
    }
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    while (n_workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        worker_gen0[n_workers + 1] = atomic_load(&pool_gen);
        int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(n_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        n_workers++;
    }
    return n_workers;
}

void run_job(const job_t *j, int nthreads) {
    /* Below ~32 output rows per thread the hand-off costs more than it saves (a task's items
     * are each worth a part). */
    int64_t maxparts = j->task != NULL ? j->N : j->N / 32;
    int parts = nthreads;
    if (parts > maxparts) parts = (int)maxparts;
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    if (parts <= 1 || pthread_mutex_trylock(&call_mu) != 0) {
        /* single thread, or another thread holds the pool: same arithmetic, run here */
        run_items(j, 0, j->N, 0);
        return;
    }
    int have = pool_ensure(parts - 1);
    if (parts > have + 1) parts = have + 1;
    int64_t chunk = (j->N + parts - 1) / parts;
    if (j->task == NULL) chunk = (chunk + 15) & ~(int64_t)15; /* whole int8-activation tiles */
    if (parts <= 1) {
        pthread_mutex_unlock(&call_mu);
        run_items(j, 0, j->N, 0);
        return;
    }
    pool_job = j;
    pool_chunk = chunk;
    pool_parts = parts;
    atomic_store_explicit(&pool_pending, n_workers, memory_order_release);
    pthread_mutex_lock(&wake_mu);
    atomic_fetch_add_explicit(&pool_gen, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&wake_cv);
    pthread_mutex_unlock(&wake_mu);
    run_part(j, chunk, 0);
    for (long it = 0; atomic_load_explicit(&pool_pending, memory_order_acquire) > 0; it++) {
        if (it < spin_iters)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&call_mu);
}


void run_tasks(void (*task)(const void *, int64_t, int64_t, int), const void *ctx, int64_t n,
               int max_parts, int nthreads) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.N = n;
    j.task = task;
    j.ctx = ctx;
    run_job(&j, nthreads < max_parts ? nthreads : max_parts);
}

int exitlm_pool_workers(void) { return n_workers; }

void exitlm_set_spin(int iters) { spin_iters = iters < 0 ? 0 : iters; }
