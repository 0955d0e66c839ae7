/*
 * A pull between two engines in one process through the C ABI (kvpoll.h),
 * over real UCX (tcp): a producer lends blocks, a consumer reads them, and
 * every byte is checked. Then the error paths: status codes and messages.
 *
 * Prints one line per check and closes with "pull.c: N passed, M failed";
 * exits non-zero when a check failed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpoll.h"

#define BS 4096
#define BLOCKS 64
#define REGIONS 2

static int passed, failed;
static char err[256];

#define CHECK(cond, ...)                                  \
    do {                                                  \
        if (cond) {                                       \
            passed++;                                     \
            printf("ok - ");                              \
        } else {                                          \
            failed++;                                     \
            printf("FAILED - ");                          \
        }                                                 \
        printf(__VA_ARGS__);                              \
        printf("\n");                                     \
    } while (0)

/* A call that must succeed; the test cannot go on otherwise. */
#define MUST(call)                                                             \
    do {                                                                       \
        int32_t s_ = (call);                                                   \
        if (s_ != KVPOLL_OK) {                                                 \
            printf("FAILED - %s: %s (%s)\n", #call, kvpoll_status_name(s_), err); \
            printf("pull.c: %d passed, %d failed\n", passed, failed + 1);      \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

static unsigned char pattern(int region, uint32_t block, size_t i) {
    return (unsigned char)(region * 71 + block * 13 + i * 7 + (i >> 8));
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void nap(void) {
    struct timespec t = {0, 1000000};
    nanosleep(&t, NULL);
}

/* Polls until a report of `kind` for `id` arrives (copied to *out), or 30 s. */
static int wait_report(kvpoll_engine *e, uint64_t id, uint32_t kind, kvpoll_report *out,
                       uint32_t *blocks, size_t *n_blocks) {
    double until = now() + 30;
    while (now() < until) {
        const kvpoll_report *r;
        const uint32_t *b;
        size_t n, nb;
        MUST(kvpoll_poll(e, &r, &n, &b, &nb, err, sizeof err));
        for (size_t i = 0; i < n; i++) {
            if (r[i].id == id && r[i].kind == kind) {
                *out = r[i];
                if (blocks && n_blocks) {
                    *n_blocks = r[i].n_blocks;
                    memcpy(blocks, b + r[i].blocks_offset, r[i].n_blocks * sizeof *blocks);
                }
                return 1;
            }
        }
        nap();
    }
    return 0;
}

static kvpoll_engine *engine(void) {
    kvpoll_config c = kvpoll_config_default();
    c.block_size = BS;
    c.tls = "tcp";
    kvpoll_engine *e = NULL;
    MUST(kvpoll_engine_new(&c, &e, err, sizeof err));
    for (int r = 0; r < REGIONS; r++) {
        size_t region;
        MUST(kvpoll_register(e, BLOCKS, &region, err, sizeof err));
    }
    return e;
}

int main(void) {
    CHECK(kvpoll_version() == KVPOLL_VERSION, "the library is the header's version (%u)",
          (unsigned)KVPOLL_VERSION);
    kvpoll_engine *producer = engine(), *consumer = engine();
    unsigned char buf[BS];

    for (int r = 0; r < REGIONS; r++)
        for (uint32_t b = 10; b < 14; b++) {
            for (size_t i = 0; i < BS; i++) buf[i] = pattern(r, b, i);
            MUST(kvpoll_write_block(producer, r, b, buf, BS, err, sizeof err));
        }

    /* Metadata: ask for the size, then fetch. */
    size_t len = 0;
    int32_t s = kvpoll_local_metadata(producer, NULL, 0, &len, err, sizeof err);
    CHECK(s == KVPOLL_ERR_BUFFER_TOO_SMALL && len > 0,
          "metadata size query gives KVPOLL_ERR_BUFFER_TOO_SMALL and the size (%zu)", len);
    unsigned char *meta = malloc(len);
    MUST(kvpoll_local_metadata(producer, meta, len, &len, err, sizeof err));
    uint32_t peer;
    MUST(kvpoll_add_peer(consumer, meta, len, &peer, err, sizeof err));

    /* The pull: lend 10..13, read them into 0..3. */
    uint32_t lent[4] = {10, 11, 12, 13}, local[4] = {0, 1, 2, 3};
    uint64_t lend = 0;
    MUST(kvpoll_lend(producer, 7, lent, 4, 1, 30000000000ull, &lend, err,
                     sizeof err));
    CHECK(lend != 0, "the lend gives its incarnation");
    kvpoll_transfer h = {peer, local, lent, 4, lend};
    MUST(kvpoll_read(consumer, 7, &h, 1, err, sizeof err));
    kvpoll_report rep;
    CHECK(wait_report(consumer, 7, KVPOLL_FINISHED_RECVING, &rep, NULL, NULL),
          "the read is reported finished");
    int same = 1;
    for (int r = 0; r < REGIONS; r++)
        for (int k = 0; k < 4; k++) {
            MUST(kvpoll_read_block(consumer, r, local[k], buf, BS, err, sizeof err));
            for (size_t i = 0; i < BS; i++) same &= buf[i] == pattern(r, lent[k], i);
        }
    CHECK(same, "every byte of the 4 blocks x %d regions arrived", REGIONS);
    CHECK(wait_report(producer, 7, KVPOLL_FINISHED_SENDING, &rep, NULL, NULL),
          "the producer's lend is released by the read's notification");
    size_t n;
    MUST(kvpoll_in_flight(consumer, &n, err, sizeof err));
    CHECK(n == 0, "nothing is left in flight");

    /* A handle to an unknown peer fails at setup, with its blocks. */
    uint32_t l2[2] = {5, 6}, r2[2] = {1, 2}, bad_blocks[8];
    size_t nb = 0;
    kvpoll_transfer bad = {peer + 40, l2, r2, 2, lend};
    MUST(kvpoll_read(consumer, 8, &bad, 1, err, sizeof err));
    int got = wait_report(consumer, 8, KVPOLL_FAILED_RECVING, &rep, bad_blocks, &nb);
    CHECK(got && rep.cause == KVPOLL_CAUSE_SETUP && nb == 2 && bad_blocks[0] == 5 &&
              bad_blocks[1] == 6,
          "a read from an unknown peer fails (cause setup) with blocks 5 and 6");

    /* Errors: status codes and messages. */
    err[0] = 0;
    s = kvpoll_add_peer(consumer, (const uint8_t *)"junk", 4, &peer, err, sizeof err);
    CHECK(s == KVPOLL_ERR_PEER && strlen(err) > 0, "junk metadata: KVPOLL_ERR_PEER (\"%s\")", err);
    uint32_t l3[2] = {0, 1};
    kvpoll_transfer unpaired = {peer, l3, r2, 2, lend};
    unpaired.n_blocks = 0;
    s = kvpoll_read(consumer, 9, &unpaired, 1, err, sizeof err);
    CHECK(s == KVPOLL_ERR_REQUEST, "an empty handle: KVPOLL_ERR_REQUEST (\"%s\")", err);
    s = kvpoll_read(NULL, 9, &h, 1, err, sizeof err);
    CHECK(s == KVPOLL_ERR_ARGUMENT, "a NULL engine: KVPOLL_ERR_ARGUMENT (\"%s\")", err);
    s = kvpoll_read(consumer, 9, NULL, 1, err, sizeof err);
    CHECK(s == KVPOLL_ERR_ARGUMENT, "NULL handles: KVPOLL_ERR_ARGUMENT (\"%s\")", err);
    uint32_t far[1] = {BLOCKS};
    kvpoll_transfer out_of_range = {peer, far, far, 1, lend};
    s = kvpoll_read(consumer, 9, &out_of_range, 1, err, sizeof err);
    CHECK(s == KVPOLL_ERR_REQUEST, "a block out of range: KVPOLL_ERR_REQUEST (\"%s\")", err);
    CHECK(strstr(err, "block 64 ") && strstr(err, "64 blocks"),
          "a block out of range names the block and the region's block count (\"%s\")", err);
    char tiny[8];
    s = kvpoll_add_peer(consumer, (const uint8_t *)"junk", 4, &peer, tiny, sizeof tiny);
    CHECK(s == KVPOLL_ERR_PEER && strlen(tiny) == sizeof tiny - 1,
          "a message is truncated to the caller's buffer and NUL-terminated");
    s = kvpoll_abort(consumer, 12345, err, sizeof err);
    CHECK(s == KVPOLL_ERR_REQUEST, "aborting an unknown request: KVPOLL_ERR_REQUEST");
    CHECK(strstr(err, "request 12345 ") != NULL, "the unknown request is named by its id (\"%s\")",
          err);

    /* A keyed engine refuses the unkeyed producer (in a keyed run of the
     * suites, KVPOLL_TEST_AUTH_KEY, the producer holds the suite's key: it is
     * refused for holding another); a short secret is refused. */
    const char *suite_key = getenv("KVPOLL_TEST_AUTH_KEY");
    const char *why = suite_key != NULL && suite_key[0] != '\0' ? "another key" : "no key";
    kvpoll_config keyed = kvpoll_config_default();
    keyed.block_size = BS;
    keyed.tls = "tcp";
    keyed.auth_key = (const uint8_t *)"the deployment's shared secret";
    keyed.auth_key_len = strlen((const char *)keyed.auth_key);
    kvpoll_engine *guarded = NULL;
    MUST(kvpoll_engine_new(&keyed, &guarded, err, sizeof err));
    s = kvpoll_add_peer(guarded, meta, len, &peer, err, sizeof err);
    CHECK(s == KVPOLL_ERR_PEER && strstr(err, why) != NULL,
          "a keyed engine refuses an unkeyed peer: KVPOLL_ERR_PEER (\"%s\")", err);
    kvpoll_engine_free(guarded);
    guarded = NULL;
    keyed.auth_key_len = 5;
    s = kvpoll_engine_new(&keyed, &guarded, err, sizeof err);
    CHECK(s == KVPOLL_ERR_CONFIG && guarded == NULL && strstr(err, "at least 16") != NULL,
          "a secret under 16 bytes: KVPOLL_ERR_CONFIG (\"%s\")", err);

    /* Settings the machine cannot meet name what was asked. */
    kvpoll_config unmet = kvpoll_config_default();
    unmet.block_size = BS;
    unmet.tls = "nonsense_tl";
    kvpoll_engine *none = NULL;
    s = kvpoll_engine_new(&unmet, &none, err, sizeof err);
    CHECK(s == KVPOLL_ERR_TRANSPORT && none == NULL && strstr(err, "nonsense_tl") &&
              strstr(err, "tcp"),
          "an unusable transport list: KVPOLL_ERR_TRANSPORT naming it and what UCX offers (\"%s\")",
          err);
    unmet.tls = "tcp";
    unmet.core = 999999;
    s = kvpoll_engine_new(&unmet, &none, err, sizeof err);
    CHECK(s == KVPOLL_ERR_CONFIG && none == NULL && strstr(err, "CPU 999999"),
          "a CPU the machine does not have: KVPOLL_ERR_CONFIG naming it (\"%s\")", err);

    MUST(kvpoll_shutdown(consumer, err, sizeof err));
    s = kvpoll_read(consumer, 10, &h, 1, err, sizeof err);
    CHECK(s == KVPOLL_ERR_SHUTDOWN, "a read after shutdown: KVPOLL_ERR_SHUTDOWN (\"%s\")", err);

    kvpoll_engine_free(consumer);
    kvpoll_engine_free(producer);
    kvpoll_engine_free(NULL);
    free(meta);
    printf("pull.c: %d passed, %d failed\n", passed, failed);
    return failed != 0;
}
