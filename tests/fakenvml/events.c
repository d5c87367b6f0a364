/*
 * Event sets: create, register, supported types, wait (both versions), free.
 *
 * An event goes to every set registered for its type on its GPU, as NVML delivers it; the event
 * names the physical GPU, and on a MIG device the GPU and compute instance ids (else 0xFFFFFFFF).
 * A wait blocks in poll() on two descriptors, without spinning: the set's eventfd (written when
 * another thread delivers an event, frees the set or shuts NVML down) and the control file's
 * inotify watch (written by the test). Whoever wakes first drains the watch and reads the control
 * file under the lock, delivering to every set, so no wake-up is lost between two waiters.
 */
#define _GNU_SOURCE
#include "fakenvml.h"

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

static void wake(FakeEventSet *s)
{
    uint64_t one = 1;
    if (s->wakeFd >= 0 && write(s->wakeFd, &one, sizeof one) < 0 && errno != EAGAIN)
        fake_warn("cannot wake an event wait: %s", strerror(errno));
}

void fake_wake_all_sets(void)
{
    for (int i = 0; i < FAKE_MAX_SETS; i++)
        if (fake.sets[i].used)
            wake(&fake.sets[i]);
}

void fake_deliver(FakeGpu *gpu, unsigned long long type, unsigned long long data, unsigned int gi, unsigned int ci)
{
    int index = (int)(gpu - fake.gpus);
    for (int i = 0; i < FAKE_MAX_SETS; i++) {
        FakeEventSet *s = &fake.sets[i];
        if (!s->used || s->freed || !(s->registered[index] & type))
            continue;
        if (s->count == FAKE_QUEUE) {
            if (s->dropped++ == 0)
                fake_warn("an event set holds %d events: further ones are dropped", FAKE_QUEUE);
            continue;
        }
        nvmlEventData_t *e = &s->queue[(s->head + s->count) % FAKE_QUEUE];
        e->device = &gpu->handle;
        e->eventType = type;
        e->eventData = data;
        e->gpuInstanceId = gi;
        e->computeInstanceId = ci;
        s->count++;
        wake(s);
    }
}

static FakeEventSet *event_set(nvmlEventSet_t set)
{
    if (set == NULL || set->magic != FAKE_MAGIC_SET || set->slot < 0 || set->slot >= FAKE_MAX_SETS ||
        set != &fake.setHandles[set->slot])
        return NULL;
    FakeEventSet *s = &fake.sets[set->slot];
    return s->used && !s->freed ? s : NULL;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    ENTER("nvmlEventSetCreate", 1);
    if (set == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    /* Slots are taken round-robin so that a freed set's slot (and eventfd, which a late waiter
     * may still poll) is reused as late as possible. */
    for (int k = 0; k < FAKE_MAX_SETS; k++) {
        int slot = (int)((fake.nextSet + (unsigned int)k) % FAKE_MAX_SETS);
        FakeEventSet *s = &fake.sets[slot];
        if (s->used && !s->freed)
            continue;
        if (s->used && s->wakeFd >= 0)
            close(s->wakeFd);
        memset(s, 0, sizeof *s);
        s->wakeFd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (s->wakeFd < 0)
            LEAVE(NVML_ERROR_MEMORY);
        s->used = 1;
        fake.setHandles[slot] = (struct nvmlEventSet_st){FAKE_MAGIC_SET, slot};
        fake.nextSet = (unsigned int)slot + 1;
        *set = &fake.setHandles[slot];
        LEAVE(NVML_SUCCESS);
    }
    LEAVE(NVML_ERROR_MEMORY);
}

static unsigned long long supported(FakeGpu *g)
{
    return g->supportedEvents;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    ENTER("nvmlDeviceGetSupportedEventTypes", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_full_gpu(device, &g);
    if (rc == NVML_SUCCESS && eventTypes == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *eventTypes = supported(g);
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    ENTER("nvmlDeviceRegisterEvents", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_full_gpu(device, &g);
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    FakeEventSet *s = event_set(set);
    if (s == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~supported(g))
        LEAVE(NVML_ERROR_NOT_SUPPORTED);
    s->registered[g - fake.gpus] |= eventTypes;
    LEAVE(NVML_SUCCESS);
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void drain(int fd)
{
    char buf[4096];
    while (fd >= 0 && read(fd, buf, sizeof buf) > 0) {
    }
}

static nvmlReturn_t wait_event(const char *function, nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    ENTER(function, 1);
    FakeEventSet *s = event_set(set);
    if (s == NULL || data == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    long long deadline = now_ms() + timeoutms;
    for (;;) {
        if (s->count) {
            *data = s->queue[s->head];
            s->head = (s->head + 1) % FAKE_QUEUE;
            s->count--;
            LEAVE(NVML_SUCCESS);
        }
        long long remaining = deadline - now_ms();
        if (remaining <= 0)
            LEAVE(NVML_ERROR_TIMEOUT);
        struct pollfd fds[2] = {{s->wakeFd, POLLIN, 0}, {fake.notifyFd, POLLIN, 0}};
        pthread_mutex_unlock(&fake_lock);
        int ready = poll(fds, 2, remaining > 60000 ? 60000 : (int)remaining);
        pthread_mutex_lock(&fake_lock);
        if (ready < 0 && errno != EINTR) {
            fake_warn("poll in an event wait failed: %s", strerror(errno));
            LEAVE(NVML_ERROR_UNKNOWN);
        }
        drain(s->wakeFd);
        drain(fake.notifyFd);
        fake_sync_control();
        /* What woke us may have changed the rules: shutdown, a freed set, an injected failure. */
        if (fake.initCount == 0)
            LEAVE(NVML_ERROR_UNINITIALIZED);
        if (event_set(set) != s)
            LEAVE(NVML_ERROR_INVALID_ARGUMENT);
        nvmlReturn_t failed = fake_failure(function);
        if (failed != NVML_SUCCESS)
            LEAVE(failed);
    }
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return wait_event("nvmlEventSetWait_v2", set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return wait_event("nvmlEventSetWait", set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    ENTER("nvmlEventSetFree", 1);
    FakeEventSet *s = event_set(set);
    if (s == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    s->freed = 1;
    wake(s); /* its eventfd stays open until the slot is reused, for a waiter still in poll() */
    LEAVE(NVML_SUCCESS);
}
