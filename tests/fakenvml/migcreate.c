/*
 * MIG on demand: remaining capacity, creating and destroying GPU and compute instances, and MIG
 * mode changes, with the rules and return codes of the Python simulator (supervisor/sim/nvml/
 * migcreate.py, whose docstrings cite nvml.h and NVIDIA's DRA driver for each):
 *
 *   - a GPU instance is created at one of its profile's placements (INVALID_ARGUMENT otherwise)
 *     where it overlaps no instance and the GPU's compute slices and the profile's instance count
 *     allow it (INSUFFICIENT_RESOURCES otherwise); NOT_SUPPORTED while MIG mode is disabled;
 *   - a GPU instance holds at most one compute instance, the one spanning it (another profile:
 *     NOT_SUPPORTED; a second: INSUFFICIENT_RESOURCES); a created one is a MIG device with a new
 *     UUID (created_uuid, the simulator's mig.created_mig_uuid);
 *   - a GPU instance with a compute instance, and a compute instance with processes, answer
 *     IN_USE to their destroy; destroyed instances' handles answer INVALID_ARGUMENT;
 *   - nvmlDeviceSetMigMode sets the pending mode; it is activated at once on Hopper or newer when
 *     no process runs, else stays pending until a `reset` control command (activationStatus
 *     IN_USE while processes run, RESET_REQUIRED on an older GPU); disabling while GPU instances
 *     exist answers IN_USE and changes nothing.
 */
#define _GNU_SOURCE
#include "fakenvml.h"

#include <stdio.h>
#include <string.h>

#define COMPUTE_SLICES FAKE_MAX_MIG /* 7 */
#define MEMORY_SLICES FAKE_MAX_STARTS /* 8 */

static nvmlReturn_t mig_on(nvmlDevice_t device, FakeGpu **gpu)
{
    nvmlReturn_t rc = fake_full_gpu(device, gpu);
    if (rc == NVML_SUCCESS && (!(*gpu)->migCapable || !(*gpu)->migEnabled))
        rc = NVML_ERROR_NOT_SUPPORTED;
    return rc;
}

/* Whether a GPU instance of `p` at `start` fits beside the GPU's instances. */
static int fits(FakeGpu *g, const FakeGiProfile *p, unsigned int start)
{
    unsigned int used = 0, compute = p->info.sliceCount, memory = p->memorySlices, same = 1;
    for (unsigned int j = 0; j < g->nMigs; j++) {
        const FakeMig *m = &g->migs[j];
        const FakeGiProfile *q = fake_profile_by_id(g, m->profileId);
        for (unsigned int s = m->placement.start; s < m->placement.start + m->placement.size && s < 32; s++)
            used |= 1u << s;
        compute += q != NULL ? q->info.sliceCount : 0;
        memory += m->placement.size;
        same += q == p;
    }
    if (start + p->memorySlices > MEMORY_SLICES)
        return 0;
    for (unsigned int s = start; s < start + p->memorySlices; s++)
        if (used & (1u << s))
            return 0;
    return compute <= COMPUTE_SLICES && memory <= MEMORY_SLICES && same <= p->info.instanceCount &&
           g->nMigs < FAKE_MAX_MIG;
}

static int possible(const FakeGiProfile *p, unsigned int start)
{
    for (unsigned int k = 0; k < p->nStarts; k++)
        if (p->starts[k] == start)
            return 1;
    return 0;
}

/* Appends a GPU instance (no compute instance yet); the caller checked that it fits. */
static FakeMig *add_gi(FakeGpu *g, const FakeGiProfile *p, unsigned int start)
{
    FakeMig *m = &g->migs[g->nMigs++];
    memset(m, 0, sizeof *m);
    static const unsigned int base[MEMORY_SLICES + 1] = {0, 7, 3, 0, 1, 0, 0, 0, 0};
    m->gi = base[p->memorySlices] + start / p->memorySlices;
    m->profileId = p->info.id;
    m->placement = (nvmlGpuInstancePlacement_t){start, p->memorySlices};
    m->attrs = (nvmlDeviceAttributes_t){
        .multiprocessorCount = p->info.multiprocessorCount,
        .sharedCopyEngineCount = p->info.copyEngineCount,
        .sharedDecoderCount = p->info.decoderCount,
        .sharedEncoderCount = p->info.encoderCount,
        .sharedJpegCount = p->info.jpegCount,
        .sharedOfaCount = p->info.ofaCount,
        .gpuInstanceSliceCount = p->info.sliceCount,
        .computeInstanceSliceCount = p->info.sliceCount,
        .memorySizeMB = p->info.memorySizeMB,
    };
    m->memoryTotal = p->info.memorySizeMB * 1024ull * 1024ull;
    m->giSerial = ++g->serial;
    return m;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device, unsigned int profileId,
                                                       unsigned int *count)
{
    ENTER("nvmlDeviceGetGpuInstanceRemainingCapacity", 1);
    FakeGpu *g;
    nvmlReturn_t rc = mig_on(device, &g);
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    FakeGiProfile *p = fake_profile_by_id(g, profileId);
    if (p == NULL || count == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    /* The most that fit at once, lowest free placement first: placed for the count, then undone. */
    unsigned int before = g->nMigs;
    for (unsigned int k = 0; k < p->nStarts; k++)
        if (fits(g, p, p->starts[k]))
            add_gi(g, p, p->starts[k]);
    *count = g->nMigs - before;
    g->nMigs = before;
    g->serial -= *count;
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t create_gi(const char *function, nvmlDevice_t device, unsigned int profileId,
                              const nvmlGpuInstancePlacement_t *placement, int placed, nvmlGpuInstance_t *out)
{
    ENTER(function, 1);
    FakeGpu *g;
    nvmlReturn_t rc = mig_on(device, &g);
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    FakeGiProfile *p = fake_profile_by_id(g, profileId);
    if (p == NULL || out == NULL || (placed && placement == NULL))
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (placed) {
        if (!possible(p, placement->start) || placement->size != p->memorySlices)
            LEAVE(NVML_ERROR_INVALID_ARGUMENT);
        if (!fits(g, p, placement->start))
            LEAVE(NVML_ERROR_INSUFFICIENT_RESOURCES);
        *out = fake_gi_handle(g, add_gi(g, p, placement->start));
        LEAVE(NVML_SUCCESS);
    }
    for (unsigned int k = 0; k < p->nStarts; k++) {
        if (fits(g, p, p->starts[k])) {
            *out = fake_gi_handle(g, add_gi(g, p, p->starts[k]));
            LEAVE(NVML_SUCCESS);
        }
    }
    LEAVE(NVML_ERROR_INSUFFICIENT_RESOURCES);
}

nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                      const nvmlGpuInstancePlacement_t *placement,
                                                      nvmlGpuInstance_t *gpuInstance)
{
    return create_gi("nvmlDeviceCreateGpuInstanceWithPlacement", device, profileId, placement, 1, gpuInstance);
}

nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId, nvmlGpuInstance_t *gpuInstance)
{
    return create_gi("nvmlDeviceCreateGpuInstance", device, profileId, NULL, 0, gpuInstance);
}

nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance)
{
    ENTER("nvmlGpuInstanceDestroy", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_gi_of(gpuInstance, &g, &m);
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    if (m->hasCi)
        LEAVE(NVML_ERROR_IN_USE);
    size_t slot = (size_t)(m - g->migs);
    memmove(m, m + 1, (g->nMigs - slot - 1) * sizeof *m);
    g->nMigs--;
    LEAVE(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ compute instances */

/* FNV-1a, 64 bit, of `prefix` then `text`. */
static unsigned long long fnv1a64(char prefix, const char *text)
{
    unsigned long long h = 0xcbf29ce484222325ull;
    h = (h ^ (unsigned char)prefix) * 0x100000001b3ull;
    for (const unsigned char *c = (const unsigned char *)text; *c; c++)
        h = (h ^ *c) * 0x100000001b3ull;
    return h;
}

/* The UUID of the `created`-th compute instance made on a GPU: the simulator's
 * mig.created_mig_uuid, so both doubles name it alike. */
static void created_uuid(char *out, size_t size, const FakeGpu *g, const FakeMig *m, const char *profile)
{
    char key[3 * FAKE_TEXT];
    snprintf(key, sizeof key, "%s/%u/%u/%u/%s", g->uuid, g->created, m->gi, m->ci, profile);
    char hex[33];
    snprintf(hex, sizeof hex, "%016llx%016llx", fnv1a64('A', key), fnv1a64('B', key));
    snprintf(out, size, "MIG-%.8s-%.4s-%.4s-%.4s-%.12s", hex, hex + 8, hex + 12, hex + 16, hex + 20);
}

/* The compute-instance profile of a GPU instance: INVALID_ARGUMENT past the count, NOT_SUPPORTED
 * for any but the one spanning it. */
static nvmlReturn_t spanning(const FakeMig *m, unsigned int profileId)
{
    if (profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((int)profileId != fake_ci_profile_for(m->attrs.computeInstanceSliceCount))
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(nvmlGpuInstance_t gpuInstance,
                                                                unsigned int profileId, unsigned int *count)
{
    ENTER("nvmlGpuInstanceGetComputeInstanceRemainingCapacity", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_gi_of(gpuInstance, &g, &m);
    if (rc == NVML_SUCCESS)
        rc = spanning(m, profileId);
    if (rc == NVML_SUCCESS && count == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *count = m->hasCi ? 0 : 1;
    LEAVE(rc);
}

nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                  nvmlComputeInstance_t *computeInstance)
{
    ENTER("nvmlGpuInstanceCreateComputeInstance", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_gi_of(gpuInstance, &g, &m);
    if (rc == NVML_SUCCESS && computeInstance == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        rc = spanning(m, profileId);
    if (rc == NVML_SUCCESS && m->hasCi)
        rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    const FakeGiProfile *p = fake_profile_by_id(g, m->profileId);
    const char *profile = p != NULL ? p->info.name : "";
    if (!strncmp(profile, "MIG ", 4))
        profile += 4;
    g->created++;
    m->ci = 0;
    created_uuid(m->uuid, sizeof m->uuid, g, m, profile);
    if (snprintf(m->name, sizeof m->name, "%s MIG %s", g->name, profile) >= (int)sizeof m->name)
        fake_warn("the name of a MIG device of %s is cut short", g->uuid);
    m->hasCi = 1;
    m->processes = 0;
    m->ciSerial = ++g->serial;
    *computeInstance = fake_ci_handle(g, m);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance)
{
    ENTER("nvmlComputeInstanceDestroy", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_ci_of(computeInstance, &g, &m);
    if (rc == NVML_SUCCESS && m->processes > 0)
        rc = NVML_ERROR_IN_USE;
    if (rc == NVML_SUCCESS) {
        m->hasCi = 0;
        m->uuid[0] = '\0';
    }
    LEAVE(rc);
}

/* ------------------------------------------------------------------ MIG mode */

int fake_gpu_busy(const FakeGpu *g)
{
    if (g->processes > 0)
        return 1;
    for (unsigned int j = 0; j < g->nMigs; j++)
        if (g->migs[j].hasCi && g->migs[j].processes > 0)
            return 1;
    return 0;
}

/* The pending MIG mode becomes current; every instance is gone. */
void fake_activate_mig_mode(FakeGpu *g)
{
    g->migEnabled = g->migPending;
    g->nMigs = 0;
}

nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus)
{
    ENTER("nvmlDeviceSetMigMode", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_full_gpu(device, &g);
    if (rc == NVML_SUCCESS && !g->migCapable)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS &&
        (activationStatus == NULL || (mode != NVML_DEVICE_MIG_DISABLE && mode != NVML_DEVICE_MIG_ENABLE)))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && mode == NVML_DEVICE_MIG_DISABLE && g->migEnabled && g->nMigs > 0)
        rc = NVML_ERROR_IN_USE;
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    g->migPending = mode == NVML_DEVICE_MIG_ENABLE;
    if (g->migPending == g->migEnabled) {
        *activationStatus = NVML_SUCCESS;
    } else if (fake_gpu_busy(g)) {
        *activationStatus = NVML_ERROR_IN_USE;
    } else if (g->arch < NVML_DEVICE_ARCH_HOPPER) {
        *activationStatus = NVML_ERROR_RESET_REQUIRED;
    } else {
        fake_activate_mig_mode(g);
        *activationStatus = NVML_SUCCESS;
    }
    LEAVE(NVML_SUCCESS);
}
