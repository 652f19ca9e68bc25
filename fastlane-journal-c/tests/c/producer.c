/*
 * A C producer of the journal service, driven by tests/c_producer.rs. Three modes:
 *
 *   producer run DIR N             attach as "c-producer", append "c 1" .. "c N" (retrying
 *                                  FL_JOURNAL_FULL) in 20 stretches, waiting until each is
 *                                  durable (so that the run spans many of the writer's
 *                                  batches), print "ok id=<producer id> last=<last seq>
 *                                  durable=<durable seq> full=<retries>"
 *   producer errors NOSVC DIR      the error paths: NULL pointers, no service at NOSVC, a
 *                                  record over max_record_bytes, a timeout; prints "ready",
 *                                  waits for a line on stdin (the test stops the service
 *                                  meanwhile), then expects FL_JOURNAL_CLOSED
 *   producer bench DIR ROUNDS N    ROUNDS rounds of N appends of 64 bytes, each timed with
 *                                  clock_gettime(CLOCK_MONOTONIC) and followed by a wait until
 *                                  durable (so the ring is empty when the next round starts);
 *                                  prints "bench min_ns=<..> median_ns=<..> full=<retries>"
 *
 * Exit status 0 when every check held; each failed check is printed on stderr.
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fastlane_journal.h"

static int failures;

#define EXPECT(cond, ...)                                                                    \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                 \
            fprintf(stderr, __VA_ARGS__);                                                    \
            fprintf(stderr, " (last error: %s)\n", fl_journal_last_error());                 \
            failures++;                                                                      \
        }                                                                                    \
    } while (0)

static const uint64_t SECOND_NS = 1000000000ull;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * SECOND_NS + (uint64_t)ts.tv_nsec;
}

/* Appends, retrying while the ring is full (bounded: 30 s). Counts the retries. */
static int append_retrying(fl_journal_producer *p, const void *data, size_t len, uint64_t *seq,
                           uint64_t *full) {
    uint64_t deadline = 0;
    for (;;) {
        int rc = fl_journal_append(p, data, len, seq);
        if (rc != FL_JOURNAL_FULL) {
            return rc;
        }
        (*full)++;
        if (deadline == 0) {
            deadline = now_ns() + 30 * SECOND_NS;
        } else if (now_ns() > deadline) {
            return rc;
        }
        sched_yield();
    }
}

static int run(const char *dir, uint64_t n) {
    fl_journal_producer *p = NULL;
    int rc = fl_journal_connect(dir, "c-producer", &p);
    if (rc != FL_JOURNAL_OK) {
        fprintf(stderr, "connect %s: %s: %s\n", dir, fl_journal_strerror(rc),
                fl_journal_last_error());
        return 1;
    }
    uint64_t seq = 0, full = 0;
    uint64_t stretch = n / 20 > 0 ? n / 20 : 1;
    char buf[64];
    for (uint64_t i = 1; i <= n; i++) {
        int len = snprintf(buf, sizeof buf, "c %" PRIu64, i);
        rc = append_retrying(p, buf, (size_t)len, &seq, &full);
        if (rc != FL_JOURNAL_OK) {
            fprintf(stderr, "append %" PRIu64 ": %s: %s\n", i, fl_journal_strerror(rc),
                    fl_journal_last_error());
            fl_journal_close(p);
            return 1;
        }
        EXPECT(seq == i, "record %" PRIu64 " got seq %" PRIu64, i, seq);
        if (i % stretch == 0) {
            rc = fl_journal_wait_durable(p, seq, 30 * SECOND_NS);
            EXPECT(rc == FL_JOURNAL_OK, "wait_durable(%" PRIu64 "): %s", seq,
                   fl_journal_strerror(rc));
        }
    }
    rc = fl_journal_wait_durable(p, seq, 30 * SECOND_NS);
    EXPECT(rc == FL_JOURNAL_OK, "wait_durable(%" PRIu64 "): %s", seq, fl_journal_strerror(rc));
    printf("ok id=%" PRIu32 " last=%" PRIu64 " durable=%" PRIu64 " full=%" PRIu64 "\n",
           fl_journal_producer_id(p), seq, fl_journal_durable_seq(p), full);
    fl_journal_close(p);
    return failures ? 1 : 0;
}

static int errors(const char *nosvc, const char *dir) {
    int rc;
    uint64_t seq = 0;
    fl_journal_producer *p = (fl_journal_producer *)&seq; /* any non-NULL: must be reset */

    /* NULL arguments, before any handle exists. */
    EXPECT(fl_journal_connect(NULL, "c", &p) == FL_JOURNAL_NULL, "NULL dir");
    EXPECT(p == NULL, "connect leaves *out NULL on failure");
    EXPECT(fl_journal_connect(dir, NULL, &p) == FL_JOURNAL_NULL, "NULL name");
    EXPECT(fl_journal_connect(dir, "c", NULL) == FL_JOURNAL_NULL, "NULL out");
    EXPECT(fl_journal_append(NULL, "x", 1, &seq) == FL_JOURNAL_NULL, "append NULL handle");
    EXPECT(fl_journal_append_blocking(NULL, "x", 1, SECOND_NS, &seq) == FL_JOURNAL_NULL,
           "append_blocking NULL handle");
    EXPECT(fl_journal_wait_durable(NULL, 1, 0) == FL_JOURNAL_NULL, "wait_durable NULL");
    EXPECT(fl_journal_durable_seq(NULL) == 0, "durable_seq NULL");
    EXPECT(fl_journal_producer_id(NULL) == 0, "producer_id NULL");
    EXPECT(fl_journal_max_record_bytes(NULL) == 0, "max_record_bytes NULL");
    fl_journal_close(NULL);
    printf("null: %s\n", fl_journal_last_error());

    /* Every code has its own static text; an unknown one says so. */
    for (int a = FL_JOURNAL_OTHER; a <= FL_JOURNAL_OK; a++) {
        EXPECT(fl_journal_strerror(a) != NULL && fl_journal_strerror(a)[0] != '\0', "%d", a);
        for (int b = FL_JOURNAL_OTHER; b < a; b++) {
            EXPECT(strcmp(fl_journal_strerror(a), fl_journal_strerror(b)) != 0, "%d %d", a, b);
        }
    }
    EXPECT(strcmp(fl_journal_strerror(42), "unknown fastlane journal status") == 0, "42");

    /* No service at NOSVC: an I/O error with the OS's words. */
    rc = fl_journal_connect(nosvc, "c-errors", &p);
    EXPECT(rc == FL_JOURNAL_IO, "connect without a service gave %d", rc);
    EXPECT(p == NULL, "handle after a failed connect");
    printf("nosvc: %d %s\n", rc, fl_journal_last_error());

    /* A name that is not UTF-8; a ring size the service cannot make. */
    rc = fl_journal_connect(dir, "bad \xff name", &p);
    EXPECT(rc == FL_JOURNAL_INVALID_ARGUMENT, "non-UTF-8 name gave %d", rc);
    rc = fl_journal_connect_with(dir, "c-odd-ring", 1000, &p);
    EXPECT(rc == FL_JOURNAL_REFUSED && p == NULL, "ring of 1000 bytes gave %d", rc);
    printf("refused: %s\n", fl_journal_last_error());

    rc = fl_journal_connect(dir, "c-errors", &p);
    if (rc != FL_JOURNAL_OK) {
        fprintf(stderr, "connect %s: %s: %s\n", dir, fl_journal_strerror(rc),
                fl_journal_last_error());
        return 1;
    }
    EXPECT(fl_journal_producer_id(p) > 0, "producer id");
    size_t max = fl_journal_max_record_bytes(p);
    EXPECT(max > 0, "max_record_bytes");

    /* Argument errors on a live handle append nothing. */
    EXPECT(fl_journal_append(p, NULL, 3, &seq) == FL_JOURNAL_NULL, "NULL data, len 3");
    char *big = calloc(1, max + 1);
    if (big == NULL) {
        return 1;
    }
    seq = 0;
    rc = fl_journal_append(p, big, max + 1, &seq);
    EXPECT(rc == FL_JOURNAL_TOO_LARGE && seq == 0, "max+1 bytes gave %d", rc);
    printf("too_large: %d %s\n", rc, fl_journal_last_error());
    rc = fl_journal_append_blocking(p, big, max + 1, SECOND_NS, &seq);
    EXPECT(rc == FL_JOURNAL_TOO_LARGE, "blocking max+1 bytes gave %d", rc);

    /* The limit itself, an empty record, and no seq_out are fine. */
    memset(big, 'm', max);
    EXPECT(fl_journal_append(p, big, max, &seq) == FL_JOURNAL_OK && seq == 1, "max bytes");
    EXPECT(fl_journal_append(p, NULL, 0, &seq) == FL_JOURNAL_OK && seq == 2, "empty");
    EXPECT(fl_journal_append_blocking(p, "x", 1, SECOND_NS, NULL) == FL_JOURNAL_OK, "no seq");
    rc = fl_journal_wait_durable(p, 3, 30 * SECOND_NS);
    EXPECT(rc == FL_JOURNAL_OK, "wait_durable(3) gave %d", rc);
    EXPECT(fl_journal_durable_seq(p) == 3, "durable %" PRIu64, fl_journal_durable_seq(p));
    rc = fl_journal_wait_durable(p, 1000, 1000000);
    EXPECT(rc == FL_JOURNAL_TIMEOUT, "wait for a seq never appended gave %d", rc);
    printf("timeout: %s\n", fl_journal_last_error());

    /* The test stops the service now. */
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL) {
        fprintf(stderr, "no go from the test\n");
        return 1;
    }
    rc = fl_journal_wait_durable(p, 1000, 30 * SECOND_NS);
    EXPECT(rc == FL_JOURNAL_CLOSED, "wait_durable after the stop gave %d", rc);
    /* Appends land in the ring until it is full; then the stop shows. */
    memset(big, 'a', max);
    rc = FL_JOURNAL_OK;
    for (int i = 0; i < 1000000 && rc == FL_JOURNAL_OK; i++) {
        rc = fl_journal_append(p, big, max, &seq);
    }
    EXPECT(rc == FL_JOURNAL_CLOSED, "append after the stop gave %d", rc);
    printf("closed: %d %s\n", rc, fl_journal_last_error());
    free(big);
    fl_journal_close(p);
    printf("errors=%d\n", failures);
    return failures ? 1 : 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static int bench(const char *dir, unsigned rounds, uint64_t n) {
    fl_journal_producer *p = NULL;
    int rc = fl_journal_connect(dir, "c-bench", &p);
    if (rc != FL_JOURNAL_OK) {
        fprintf(stderr, "connect %s: %s: %s\n", dir, fl_journal_strerror(rc),
                fl_journal_last_error());
        return 1;
    }
    char buf[64];
    memset(buf, 'b', sizeof buf);
    uint64_t *per = calloc(rounds, sizeof *per);
    uint64_t seq = 0, full = 0;
    if (per == NULL) {
        return 1;
    }
    for (unsigned r = 0; r < rounds; r++) {
        uint64_t t0 = now_ns();
        for (uint64_t i = 0; i < n; i++) {
            rc = append_retrying(p, buf, sizeof buf, &seq, &full);
            if (rc != FL_JOURNAL_OK) {
                fprintf(stderr, "append: %s\n", fl_journal_strerror(rc));
                return 1;
            }
        }
        per[r] = now_ns() - t0;
        rc = fl_journal_wait_durable(p, seq, 30 * SECOND_NS);
        if (rc != FL_JOURNAL_OK) {
            fprintf(stderr, "wait_durable: %s\n", fl_journal_strerror(rc));
            return 1;
        }
    }
    qsort(per, rounds, sizeof *per, cmp_u64);
    printf("bench min_ns=%.1f median_ns=%.1f full=%" PRIu64 "\n", (double)per[0] / (double)n,
           (double)per[rounds / 2] / (double)n, full);
    free(per);
    fl_journal_close(p);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "run") == 0) {
        return run(argv[2], strtoull(argv[3], NULL, 10));
    }
    if (argc == 4 && strcmp(argv[1], "errors") == 0) {
        return errors(argv[2], argv[3]);
    }
    if (argc == 5 && strcmp(argv[1], "bench") == 0) {
        unsigned rounds = (unsigned)strtoul(argv[3], NULL, 10);
        return rounds == 0 ? 2 : bench(argv[2], rounds, strtoull(argv[4], NULL, 10));
    }
    fprintf(stderr, "usage: %s run DIR N | errors NOSVC DIR | bench DIR ROUNDS N\n", argv[0]);
    return 2;
}
