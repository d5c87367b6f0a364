/*
 * MIG: mode, MIG device handles and their parent, GPU and compute instances, profiles, placements.
 * Creating and destroying instances and changing MIG mode are in migcreate.c.
 *
 * Each MIG device of the node file is one GPU instance holding one compute instance that spans it
 * (the layout `nvidia-smi mig -cgi <profiles> -C` makes, and the one the simulator models); one
 * made at run time may have no compute instance yet. Handles are found again by the creation
 * serial they carry (fakenvml.h, FAKE_RING), so a destroyed instance's handle is stale.
 */
#define _GNU_SOURCE
#include "fakenvml.h"

#include <stdio.h>
#include <string.h>

static nvmlReturn_t mig_capable(nvmlDevice_t device, FakeGpu **gpu)
{
    nvmlReturn_t rc = fake_full_gpu(device, gpu);
    if (rc == NVML_SUCCESS && !(*gpu)->migCapable)
        rc = NVML_ERROR_NOT_SUPPORTED;
    return rc;
}

static nvmlReturn_t mig_enabled(nvmlDevice_t device, FakeGpu **gpu)
{
    nvmlReturn_t rc = mig_capable(device, gpu);
    if (rc == NVML_SUCCESS && !(*gpu)->migEnabled)
        rc = NVML_ERROR_NOT_SUPPORTED;
    return rc;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    ENTER("nvmlDeviceGetMigMode", 1);
    FakeGpu *g;
    nvmlReturn_t rc = mig_capable(device, &g);
    if (rc == NVML_SUCCESS && (currentMode == NULL || pendingMode == NULL))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        *currentMode = g->migEnabled ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
        *pendingMode = g->migPending ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    }
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    ENTER("nvmlDeviceGetMaxMigDeviceCount", 1);
    FakeGpu *g;
    nvmlReturn_t rc = mig_capable(device, &g);
    if (rc == NVML_SUCCESS && count == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *count = g->maxMigDevices;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice)
{
    ENTER("nvmlDeviceGetMigDeviceHandleByIndex", 1);
    FakeGpu *g;
    nvmlReturn_t rc = mig_enabled(device, &g);
    if (rc == NVML_SUCCESS && (migDevice == NULL || index >= g->maxMigDevices))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    unsigned int seen = 0; /* MIG devices: the GPU instances with a compute instance, in order */
    for (unsigned int j = 0; j < g->nMigs; j++) {
        if (g->migs[j].hasCi && seen++ == index) {
            *migDevice = fake_mig_handle(g, &g->migs[j]);
            LEAVE(NVML_SUCCESS);
        }
    }
    LEAVE(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    ENTER("nvmlDeviceIsMigDeviceHandle", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_device(device, 1, &g, &m); /* answers for a lost GPU too */
    if (rc == NVML_SUCCESS && isMigDevice == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *isMigDevice = m != NULL;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_device(migDevice, 0, &g, &m);
    if (rc == NVML_SUCCESS && (m == NULL || device == NULL))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *device = &g->handle;
    LEAVE(rc);
}

static nvmlReturn_t instance_id(const char *function, nvmlDevice_t device, unsigned int *id, int compute)
{
    ENTER(function, 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_device(device, 0, &g, &m);
    if (rc == NVML_SUCCESS && m == NULL)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS && id == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *id = compute ? m->ci : m->gi;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return instance_id("nvmlDeviceGetGpuInstanceId", device, id, 0);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return instance_id("nvmlDeviceGetComputeInstanceId", device, id, 1);
}

/* ------------------------------------------------------------------ GPU instance profiles */

static FakeGiProfile *profile_by_enum(FakeGpu *g, unsigned int value)
{
    for (unsigned int i = 0; i < g->nGiProfiles; i++)
        if (g->giProfiles[i].enumValue == value)
            return &g->giProfiles[i];
    return NULL;
}

FakeGiProfile *fake_profile_by_id(FakeGpu *g, unsigned int id)
{
    for (unsigned int i = 0; i < g->nGiProfiles; i++)
        if (g->giProfiles[i].info.id == id)
            return &g->giProfiles[i];
    return NULL;
}

static nvmlReturn_t gi_profile(nvmlDevice_t device, unsigned int profile, FakeGiProfile **out)
{
    FakeGpu *g;
    nvmlReturn_t rc = mig_capable(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = profile_by_enum(g, profile);
    return *out == NULL ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                 nvmlGpuInstanceProfileInfo_t *info)
{
    ENTER("nvmlDeviceGetGpuInstanceProfileInfo", 1);
    FakeGiProfile *p;
    nvmlReturn_t rc = gi_profile(device, profile, &p);
    if (rc == NVML_SUCCESS && info == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        info->id = p->info.id;
        info->isP2pSupported = p->info.isP2pSupported;
        info->sliceCount = p->info.sliceCount;
        info->instanceCount = p->info.instanceCount;
        info->multiprocessorCount = p->info.multiprocessorCount;
        info->copyEngineCount = p->info.copyEngineCount;
        info->decoderCount = p->info.decoderCount;
        info->encoderCount = p->info.encoderCount;
        info->jpegCount = p->info.jpegCount;
        info->ofaCount = p->info.ofaCount;
        info->memorySizeMB = p->info.memorySizeMB;
    }
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                  nvmlGpuInstanceProfileInfo_v2_t *info)
{
    ENTER("nvmlDeviceGetGpuInstanceProfileInfoV", 1);
    FakeGiProfile *p;
    nvmlReturn_t rc = gi_profile(device, profile, &p);
    if (rc == NVML_SUCCESS && info == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && info->version != nvmlGpuInstanceProfileInfo_v2)
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (rc == NVML_SUCCESS)
        *info = p->info;
    LEAVE(rc);
}

static nvmlReturn_t placements(const char *function, nvmlDevice_t device, unsigned int profileId,
                               nvmlGpuInstancePlacement_t *out, unsigned int *count)
{
    ENTER(function, 1);
    FakeGpu *g;
    nvmlReturn_t rc = mig_capable(device, &g);
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    FakeGiProfile *p = fake_profile_by_id(g, profileId);
    if (p == NULL || count == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (out == NULL) { /* a query of how many there are */
        *count = p->nStarts;
        LEAVE(NVML_SUCCESS);
    }
    if (*count < p->nStarts) {
        *count = p->nStarts;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int i = 0; i < p->nStarts; i++)
        out[i] = (nvmlGpuInstancePlacement_t){p->starts[i], p->memorySlices};
    *count = p->nStarts;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                           nvmlGpuInstancePlacement_t *placements_,
                                                           unsigned int *count)
{
    return placements("nvmlDeviceGetGpuInstancePossiblePlacements_v2", device, profileId, placements_, count);
}

nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements(nvmlDevice_t device, unsigned int profileId,
                                                        nvmlGpuInstancePlacement_t *placements_,
                                                        unsigned int *count)
{
    return placements("nvmlDeviceGetGpuInstancePossiblePlacements", device, profileId, placements_, count);
}

/* ------------------------------------------------------------------ GPU instances */

nvmlGpuInstance_t fake_gi_handle(FakeGpu *g, FakeMig *m)
{
    struct nvmlGpuInstance_st *h = &fake.giHandles[g - fake.gpus][m->giSerial % FAKE_RING];
    *h = (struct nvmlGpuInstance_st){FAKE_MAGIC_GI, (int)(g - fake.gpus), m->gi, m->giSerial};
    return h;
}

nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                       nvmlGpuInstance_t *gpuInstances, unsigned int *count)
{
    ENTER("nvmlDeviceGetGpuInstances", 1);
    FakeGpu *g;
    nvmlReturn_t rc = mig_enabled(device, &g);
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    if (fake_profile_by_id(g, profileId) == NULL || gpuInstances == NULL || count == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n = 0;
    for (unsigned int j = 0; j < g->nMigs; j++)
        if (g->migs[j].profileId == profileId)
            gpuInstances[n++] = fake_gi_handle(g, &g->migs[j]);
    *count = n;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance)
{
    ENTER("nvmlDeviceGetGpuInstanceById", 1);
    FakeGpu *g;
    nvmlReturn_t rc = mig_enabled(device, &g);
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    if (gpuInstance == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned int j = 0; j < g->nMigs; j++) {
        if (g->migs[j].gi == id) {
            *gpuInstance = fake_gi_handle(g, &g->migs[j]);
            LEAVE(NVML_SUCCESS);
        }
    }
    LEAVE(NVML_ERROR_NOT_FOUND);
}

/* The GPU and GPU instance behind a GPU instance handle. */
nvmlReturn_t fake_gi_of(nvmlGpuInstance_t gi, FakeGpu **gpu, FakeMig **mig)
{
    if (gi == NULL || gi->magic != FAKE_MAGIC_GI || gi->gpu < 0 || (unsigned int)gi->gpu >= fake.nGpus ||
        gi != &fake.giHandles[gi->gpu][gi->serial % FAKE_RING])
        return NVML_ERROR_INVALID_ARGUMENT;
    FakeGpu *g = &fake.gpus[gi->gpu];
    if (g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    for (unsigned int j = 0; g->migEnabled && j < g->nMigs; j++) {
        if (g->migs[j].giSerial == gi->serial) {
            *gpu = g;
            *mig = &g->migs[j];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT; /* the instance is gone: a stale handle */
}

nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    ENTER("nvmlGpuInstanceGetInfo", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_gi_of(gpuInstance, &g, &m);
    if (rc == NVML_SUCCESS && info == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        info->device = &g->handle;
        info->id = m->gi;
        info->profileId = m->profileId;
        info->placement = m->placement;
    }
    LEAVE(rc);
}

/* ------------------------------------------------------------------ compute instances */

/* NVML_COMPUTE_INSTANCE_PROFILE_* of a compute instance of `slices` compute slices. */
int fake_ci_profile_for(unsigned int slices)
{
    switch (slices) {
    case 1: return NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE;
    case 2: return NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE;
    case 3: return NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE;
    case 4: return NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE;
    case 6: return NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE;
    case 7: return NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE;
    case 8: return NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE;
    default: return -1;
    }
}

static nvmlReturn_t ci_profile(nvmlGpuInstance_t gpuInstance, unsigned int profile, unsigned int engProfile,
                               FakeGpu **gpu, FakeMig **mig)
{
    nvmlReturn_t rc = fake_gi_of(gpuInstance, gpu, mig);
    if (rc != NVML_SUCCESS)
        return rc;
    if (profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT ||
        engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((int)profile != fake_ci_profile_for((*mig)->attrs.computeInstanceSliceCount))
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

static void fill_ci_profile(FakeGpu *g, FakeMig *m, unsigned int profile, nvmlComputeInstanceProfileInfo_v2_t *out)
{
    out->id = profile;
    out->sliceCount = m->attrs.computeInstanceSliceCount;
    out->instanceCount = 1;
    out->multiprocessorCount = m->attrs.multiprocessorCount;
    out->sharedCopyEngineCount = m->attrs.sharedCopyEngineCount;
    out->sharedDecoderCount = m->attrs.sharedDecoderCount;
    out->sharedEncoderCount = m->attrs.sharedEncoderCount;
    out->sharedJpegCount = m->attrs.sharedJpegCount;
    out->sharedOfaCount = m->attrs.sharedOfaCount;
    /* A compute instance spanning its GPU instance carries the GPU instance's profile name. */
    FakeGiProfile *p = fake_profile_by_id(g, m->profileId);
    snprintf(out->name, sizeof out->name, "%s", p != NULL ? p->info.name : "");
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                          unsigned int engProfile,
                                                          nvmlComputeInstanceProfileInfo_t *info)
{
    ENTER("nvmlGpuInstanceGetComputeInstanceProfileInfo", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = ci_profile(gpuInstance, profile, engProfile, &g, &m);
    if (rc == NVML_SUCCESS && info == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        nvmlComputeInstanceProfileInfo_v2_t full;
        fill_ci_profile(g, m, profile, &full);
        info->id = full.id;
        info->sliceCount = full.sliceCount;
        info->instanceCount = full.instanceCount;
        info->multiprocessorCount = full.multiprocessorCount;
        info->sharedCopyEngineCount = full.sharedCopyEngineCount;
        info->sharedDecoderCount = full.sharedDecoderCount;
        info->sharedEncoderCount = full.sharedEncoderCount;
        info->sharedJpegCount = full.sharedJpegCount;
        info->sharedOfaCount = full.sharedOfaCount;
    }
    LEAVE(rc);
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                           unsigned int engProfile,
                                                           nvmlComputeInstanceProfileInfo_v2_t *info)
{
    ENTER("nvmlGpuInstanceGetComputeInstanceProfileInfoV", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = ci_profile(gpuInstance, profile, engProfile, &g, &m);
    if (rc == NVML_SUCCESS && info == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && info->version != nvmlComputeInstanceProfileInfo_v2)
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (rc == NVML_SUCCESS)
        fill_ci_profile(g, m, profile, info);
    LEAVE(rc);
}

nvmlComputeInstance_t fake_ci_handle(FakeGpu *g, FakeMig *m)
{
    struct nvmlComputeInstance_st *h = &fake.ciHandles[g - fake.gpus][m->ciSerial % FAKE_RING];
    *h = (struct nvmlComputeInstance_st){FAKE_MAGIC_CI, (int)(g - fake.gpus), m->gi, m->ci, m->ciSerial};
    return h;
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                nvmlComputeInstance_t *computeInstances, unsigned int *count)
{
    ENTER("nvmlGpuInstanceGetComputeInstances", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_gi_of(gpuInstance, &g, &m);
    if (rc == NVML_SUCCESS && (computeInstances == NULL || count == NULL ||
                               profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        *count = 0;
        if (m->hasCi && (int)profileId == fake_ci_profile_for(m->attrs.computeInstanceSliceCount)) {
            computeInstances[0] = fake_ci_handle(g, m);
            *count = 1;
        }
    }
    LEAVE(rc);
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                   nvmlComputeInstance_t *computeInstance)
{
    ENTER("nvmlGpuInstanceGetComputeInstanceById", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_gi_of(gpuInstance, &g, &m);
    if (rc == NVML_SUCCESS && computeInstance == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && (!m->hasCi || id != m->ci))
        rc = NVML_ERROR_NOT_FOUND;
    if (rc == NVML_SUCCESS)
        *computeInstance = fake_ci_handle(g, m);
    LEAVE(rc);
}

/* The GPU and GPU instance behind a compute instance handle. */
nvmlReturn_t fake_ci_of(nvmlComputeInstance_t ci, FakeGpu **gpu, FakeMig **mig)
{
    if (ci == NULL || ci->magic != FAKE_MAGIC_CI || ci->gpu < 0 || (unsigned int)ci->gpu >= fake.nGpus ||
        ci != &fake.ciHandles[ci->gpu][ci->serial % FAKE_RING])
        return NVML_ERROR_INVALID_ARGUMENT;
    FakeGpu *g = &fake.gpus[ci->gpu];
    if (g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    for (unsigned int j = 0; g->migEnabled && j < g->nMigs; j++) {
        if (g->migs[j].hasCi && g->migs[j].ciSerial == ci->serial) {
            *gpu = g;
            *mig = &g->migs[j];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT; /* the instance is gone: a stale handle */
}

static nvmlReturn_t ci_info(const char *function, nvmlComputeInstance_t ci, nvmlComputeInstanceInfo_t *info)
{
    ENTER(function, 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_ci_of(ci, &g, &m);
    if (rc == NVML_SUCCESS && info == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    /* The MIG device of the compute instance, as NVIDIA's DRA driver (v0.4.1 nvlib.go) reads its
     * UUID from it: "A MIG device handle maps 1:1 to a CI in NVML". */
    info->device = fake_mig_handle(g, m);
    info->gpuInstance = fake_gi_handle(g, m);
    info->id = m->ci;
    info->profileId = (unsigned int)fake_ci_profile_for(m->attrs.computeInstanceSliceCount);
    info->placement = (nvmlComputeInstancePlacement_t){0, m->attrs.computeInstanceSliceCount};
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info)
{
    return ci_info("nvmlComputeInstanceGetInfo_v2", computeInstance, info);
}

nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info)
{
    return ci_info("nvmlComputeInstanceGetInfo", computeInstance, info);
}
