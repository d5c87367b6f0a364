/*
 * Faults at run time: the control file named by FAKENVML_CONTROL, a log the test appends lines to
 * while the process under test runs. Every NVML call first reads what was appended since the last
 * call (so a fault is seen by the next call, not after a probe period), and an inotify watch on
 * the file wakes an nvmlEventSetWait blocked meanwhile. Each process that loads the library reads
 * the log from its start: state changes apply to it too, events (which go only to event sets that
 * exist) do not. The commands mirror the Python simulator's fault injection:
 *
 *   xid <GPU or MIG uuid> <xid> [<gi> <ci>]     an XID event (a MIG device's own GI/CI ids)
 *   ecc <GPU or MIG uuid> single|double [<gi> <ci>]
 *   lose <GPU uuid>                              every call on it answers GPU_IS_LOST; XID 79 is sent
 *   restore <GPU uuid>                           it answers again
 *   reset <GPU uuid>                             answers again, pending retirement/remapping cleared,
 *                                                a pending MIG mode made current (its instances gone);
 *                                                refused (reported, skipped) while processes run on it
 *   processes <GPU or MIG uuid> <count>          processes running there: destroying its compute
 *                                                instance and activating a MIG mode are IN_USE
 *   pending-retirement | remapped-rows-pending | row-remap-failure <GPU uuid> 0|1
 *   fail <function> <nvmlReturn_t> [count]       the function fails (count times, or until cleared)
 *   clear [function]                             ends injected failures (of one function)
 *
 * A line that is not one of these is reported on stderr with its line number and skipped, and so
 * is a line of 4095 characters or more (with its newline it does not fit the 4 KiB buffer).
 */
#define _GNU_SOURCE
#include "fakenvml.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <unistd.h>

void fake_open_control(void)
{
    if (fake.controlFd >= 0)
        return;
    if (!fake.controlPath[0]) {
        const char *path = getenv("FAKENVML_CONTROL");
        if (path == NULL || !*path || strlen(path) >= sizeof fake.controlPath)
            return;
        strcpy(fake.controlPath, path);
    }
    fake.controlFd = open(fake.controlPath, O_RDONLY | O_CLOEXEC);
    if (fake.controlFd < 0)
        return; /* not made yet: tried again at the next call */
    fake.notifyFd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fake.notifyFd >= 0 && inotify_add_watch(fake.notifyFd, fake.controlPath, IN_MODIFY) < 0) {
        fake_warn("%s: cannot watch: %s (a blocked event wait sees faults only when it times out)",
                  fake.controlPath, strerror(errno));
        close(fake.notifyFd);
        fake.notifyFd = -1;
    }
}

static void complain(const char *why)
{
    fake_warn("%s:%llu: %s (line skipped)", fake.controlPath, fake.controlLine, why);
}

static int parse_uint(const char *text, unsigned long *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long v = strtoul(text, &end, 0);
    if (errno || end == text || *end)
        return -1;
    *out = v;
    return 0;
}

static void set_failure(const char *function, nvmlReturn_t code, long count)
{
    FakeFailure *slot = NULL;
    for (int i = 0; i < FAKE_MAX_FAILURES; i++) {
        FakeFailure *f = &fake.failures[i];
        if (f->function[0] && !strcmp(f->function, function)) {
            slot = f;
            break;
        }
        if (!f->function[0] && slot == NULL)
            slot = f;
    }
    if (slot == NULL) {
        complain("too many functions failing at once");
        return;
    }
    snprintf(slot->function, sizeof slot->function, "%s", function);
    slot->code = code;
    slot->remaining = count;
}

nvmlReturn_t fake_failure(const char *function)
{
    for (int i = 0; i < FAKE_MAX_FAILURES; i++) {
        FakeFailure *f = &fake.failures[i];
        if (!f->function[0] || strcmp(f->function, function))
            continue;
        nvmlReturn_t code = f->code;
        if (f->remaining > 0 && --f->remaining == 0)
            f->function[0] = '\0';
        return code;
    }
    return NVML_SUCCESS;
}

static FakeGpu *gpu_only(const char *uuid)
{
    FakeMig *m = NULL;
    FakeGpu *g = fake_gpu_by_uuid(uuid, &m);
    if (g == NULL || m != NULL) {
        complain("needs the UUID of a GPU of this node");
        return NULL;
    }
    return g;
}

static void instance_ids(FakeMig *m, char **tok, int n, int at, unsigned int *gi, unsigned int *ci)
{
    *gi = *ci = FAKE_NO_INSTANCE;
    if (m != NULL) {
        *gi = m->gi;
        *ci = m->ci;
        return;
    }
    unsigned long a, b;
    if (n > at + 1 && !parse_uint(tok[at], &a) && !parse_uint(tok[at + 1], &b)) {
        *gi = (unsigned int)a;
        *ci = (unsigned int)b;
    }
}

static void command(char *line)
{
    char *tok[8];
    int n = 0;
    char *save = NULL;
    for (char *s = strtok_r(line, " \t", &save); s && n < 8; s = strtok_r(NULL, " \t", &save))
        tok[n++] = s;
    if (n == 0 || tok[0][0] == '#')
        return;
    const char *verb = tok[0];
    unsigned long value = 0;
    static const char *const verbs[] = {"xid", "ecc", "lose", "restore", "reset", "pending-retirement",
                                        "remapped-rows-pending", "row-remap-failure", "fail", "clear",
                                        "processes"};
    size_t known = 0;
    while (known < sizeof verbs / sizeof verbs[0] && strcmp(verbs[known], verb))
        known++;
    if (known == sizeof verbs / sizeof verbs[0]) {
        complain("unknown command");
        return;
    }

    if (!strcmp(verb, "fail")) {
        long count = -1;
        unsigned long c;
        if (n < 3 || parse_uint(tok[2], &value) || value == NVML_SUCCESS) {
            complain("fail <function> <non-zero nvmlReturn_t> [count]");
            return;
        }
        if (n > 3) {
            if (parse_uint(tok[3], &c) || c == 0) {
                complain("a failure count is a positive number");
                return;
            }
            count = (long)c;
        }
        set_failure(tok[1], (nvmlReturn_t)value, count);
        fake_wake_all_sets(); /* a blocked wait should see a failure of its own */
        return;
    }
    if (!strcmp(verb, "clear")) {
        for (int i = 0; i < FAKE_MAX_FAILURES; i++)
            if (n < 2 || !strcmp(fake.failures[i].function, tok[1]))
                fake.failures[i].function[0] = '\0';
        return;
    }
    if (n < 2) {
        complain("a command needs a UUID");
        return;
    }
    if (!fake.loaded)
        return; /* before nvmlInit there is no node: faults apply when it is read */
    if (!strcmp(verb, "xid") || !strcmp(verb, "ecc")) {
        FakeMig *m = NULL;
        FakeGpu *g = fake_gpu_by_uuid(tok[1], &m);
        if (g == NULL) {
            complain("no GPU or MIG device of this node has that UUID");
            return;
        }
        unsigned int gi, ci;
        instance_ids(m, tok, n, 3, &gi, &ci);
        if (!strcmp(verb, "xid")) {
            if (n < 3 || parse_uint(tok[2], &value)) {
                complain("xid <uuid> <xid> [<gi> <ci>]");
                return;
            }
            fake_deliver(g, nvmlEventTypeXidCriticalError, value, gi, ci);
        } else if (n >= 3 && !strcmp(tok[2], "single")) {
            fake_deliver(g, nvmlEventTypeSingleBitEccError, 0, gi, ci);
        } else if (n >= 3 && !strcmp(tok[2], "double")) {
            fake_deliver(g, nvmlEventTypeDoubleBitEccError, 0, gi, ci);
        } else {
            complain("ecc <uuid> single|double [<gi> <ci>]");
        }
        return;
    }
    if (!strcmp(verb, "processes")) {
        FakeMig *m = NULL;
        FakeGpu *pg = fake_gpu_by_uuid(tok[1], &m);
        if (pg == NULL || n < 3 || parse_uint(tok[2], &value) || value > 0xFFFFFFFFul) {
            complain("processes <GPU or MIG uuid of this node> <count>");
            return;
        }
        if (m != NULL)
            m->processes = (unsigned int)value;
        else
            pg->processes = (unsigned int)value;
        return;
    }
    FakeGpu *g = gpu_only(tok[1]);
    if (g == NULL)
        return;
    if (!strcmp(verb, "lose")) {
        g->lost = 1;
        fake_deliver(g, nvmlEventTypeXidCriticalError, 79, FAKE_NO_INSTANCE, FAKE_NO_INSTANCE);
        return;
    }
    if (!strcmp(verb, "restore")) {
        g->lost = 0;
        return;
    }
    if (!strcmp(verb, "reset")) {
        if (fake_gpu_busy(g)) {
            complain("the GPU is in use (processes run on it): a reset is refused");
            return;
        }
        g->lost = g->pendingRetirement = g->remappedRowsPending = 0;
        if (g->migPending != g->migEnabled)
            fake_activate_mig_mode(g);
        return;
    }
    int on = n >= 3 && !strcmp(tok[2], "1");
    if (n < 3 || (!on && strcmp(tok[2], "0"))) {
        complain("the flag is 0 or 1");
        return;
    }
    if (!strcmp(verb, "pending-retirement")) {
        g->pendingRetirement = on;
    } else if (!strcmp(verb, "remapped-rows-pending")) {
        if (on && !g->remappedRowsPending)
            g->uncorrectedRows++;
        g->remappedRowsPending = on;
    } else {
        g->rowRemapFailure = on;
    }
}

/* Reads and applies whatever was appended since the last call (lock held). */
void fake_sync_control(void)
{
    fake_open_control();
    if (fake.controlFd < 0)
        return;
    for (;;) {
        /* What is kept of a line is always shorter than the buffer (a full one is dropped
         * below); said again here, locally, so that the read's bound is plain to the compiler
         * too: newer GCCs, which cannot see that invariant of a global, reject the read
         * (-Wstringop-overflow) otherwise. */
        size_t used = fake.pendingLen < sizeof fake.pending - 1 ? fake.pendingLen : 0;
        size_t room = sizeof fake.pending - 1 - used;
        ssize_t got = pread(fake.controlFd, &fake.pending[used], room, fake.controlOffset);
        if (got <= 0 || (size_t)got > room)
            return;
        fake.controlOffset += got;
        fake.pendingLen = used + (size_t)got;
        fake.pending[fake.pendingLen] = '\0';
        char *start = fake.pending;
        char *nl;
        if (fake.skippingLine) { /* the rest of a line already reported as too long */
            nl = memchr(start, '\n', fake.pendingLen);
            if (nl == NULL) {
                fake.pendingLen = 0;
                continue;
            }
            start = nl + 1;
            fake.skippingLine = 0;
        }
        while ((nl = memchr(start, '\n', fake.pendingLen - (size_t)(start - fake.pending))) != NULL) {
            *nl = '\0';
            fake.controlLine++;
            command(start);
            start = nl + 1;
        }
        size_t left = fake.pendingLen - (size_t)(start - fake.pending);
        if (left == sizeof fake.pending - 1) { /* a line longer than the buffer: drop it */
            fake.controlLine++;
            complain("a line of 4095 characters or more");
            fake.skippingLine = 1;
            left = 0;
        }
        memmove(fake.pending, start, left);
        fake.pendingLen = left;
    }
}
