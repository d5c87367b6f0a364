/*
 * Init and shutdown, error strings, system versions, and the queries of a GPU: identity, PCI in
 * every variant, memory in both struct versions, compute capability, architecture, brand, NUMA,
 * addressing mode, topology, NVLinks, attributes, fabric (IMEX), retired pages, remapped rows, compute mode.
 *
 * What each call answers on a MIG device, a lost GPU or a GPU without the feature follows the
 * Python simulator (supervisor/sim/nvml), which the differential test holds the two to.
 */
#define _GNU_SOURCE
#include "fakenvml.h"

#include <string.h>

/* ------------------------------------------------------------------ init, shutdown, errors */

static nvmlReturn_t init(const char *function)
{
    ENTER(function, 0);
    if (!fake.loaded)
        LEAVE(fake.loadResult);
    fake.initCount++;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return init("nvmlInitWithFlags");
}

nvmlReturn_t nvmlInit_v2(void)
{
    return init("nvmlInit_v2");
}

nvmlReturn_t nvmlInit(void)
{
    return init("nvmlInit");
}

nvmlReturn_t nvmlShutdown(void)
{
    ENTER("nvmlShutdown", 1);
    if (--fake.initCount == 0)
        fake_wake_all_sets(); /* blocked waits must not sleep on */
    LEAVE(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    /* The wording of the binding's own table (nvidia-ml-py's NVMLError) where it has one. */
    switch ((int)result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

/* ------------------------------------------------------------------ system */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    ENTER("nvmlSystemGetDriverVersion", 1);
    LEAVE(fake_copy_text(version, length, fake.driver));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    ENTER("nvmlSystemGetNVMLVersion", 1);
    LEAVE(fake_copy_text(version, length, fake.nvmlVersion));
}

static nvmlReturn_t cuda_version(const char *function, int *out)
{
    ENTER(function, 1);
    if (out == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *out = fake.cuda;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    return cuda_version("nvmlSystemGetCudaDriverVersion", cudaDriverVersion);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return cuda_version("nvmlSystemGetCudaDriverVersion_v2", cudaDriverVersion);
}

/* ------------------------------------------------------------------ finding devices */

static nvmlReturn_t count(const char *function, unsigned int *deviceCount)
{
    ENTER(function, 1);
    if (deviceCount == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    /* A GPU that fell off the bus stays counted until the driver is reloaded. */
    *deviceCount = fake.nGpus;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    return count("nvmlDeviceGetCount_v2", deviceCount);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return count("nvmlDeviceGetCount", deviceCount);
}

static nvmlReturn_t by_index(const char *function, unsigned int index, nvmlDevice_t *device)
{
    ENTER(function, 1);
    if (device == NULL || index >= fake.nGpus)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (fake.gpus[index].lost)
        LEAVE(NVML_ERROR_GPU_IS_LOST);
    *device = &fake.gpus[index].handle;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    return by_index("nvmlDeviceGetHandleByIndex_v2", index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return by_index("nvmlDeviceGetHandleByIndex", index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetHandleByUUID", 1);
    if (uuid == NULL || device == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    FakeMig *m = NULL;
    FakeGpu *g = fake_gpu_by_uuid(uuid, &m);
    if (g == NULL)
        LEAVE(NVML_ERROR_NOT_FOUND);
    if (g->lost)
        LEAVE(NVML_ERROR_GPU_IS_LOST);
    *device = m == NULL ? &g->handle : fake_mig_handle(g, m);
    LEAVE(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ identity */

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    ENTER("nvmlDeviceGetUUID", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_device(device, 0, &g, &m);
    if (rc == NVML_SUCCESS)
        rc = fake_copy_text(uuid, length, m != NULL ? m->uuid : g->uuid);
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    ENTER("nvmlDeviceGetName", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_device(device, 0, &g, &m);
    if (rc == NVML_SUCCESS)
        rc = fake_copy_text(name, length, m != NULL ? m->name : g->name);
    LEAVE(rc);
}

#define FULL_GPU_UINT(fn, type, field)                      \
    nvmlReturn_t fn(nvmlDevice_t device, type *out)         \
    {                                                       \
        ENTER(#fn, 1);                                      \
        FakeGpu *g;                                         \
        nvmlReturn_t rc = fake_full_gpu(device, &g);        \
        if (rc == NVML_SUCCESS && out == NULL)              \
            rc = NVML_ERROR_INVALID_ARGUMENT;               \
        if (rc == NVML_SUCCESS)                             \
            *out = (type)(field);                           \
        LEAVE(rc);                                          \
    }

FULL_GPU_UINT(nvmlDeviceGetIndex, unsigned int, g - fake.gpus)
FULL_GPU_UINT(nvmlDeviceGetMinorNumber, unsigned int, g->minor)
FULL_GPU_UINT(nvmlDeviceGetComputeMode, nvmlComputeMode_t, g->computeMode)

#define ANY_DEVICE_UINT(fn, type, field)                    \
    nvmlReturn_t fn(nvmlDevice_t device, type *out)         \
    {                                                       \
        ENTER(#fn, 1);                                      \
        FakeGpu *g;                                         \
        nvmlReturn_t rc = fake_device(device, 0, &g, NULL); \
        if (rc == NVML_SUCCESS && out == NULL)              \
            rc = NVML_ERROR_INVALID_ARGUMENT;               \
        if (rc == NVML_SUCCESS)                             \
            *out = (type)(field);                           \
        LEAVE(rc);                                          \
    }

ANY_DEVICE_UINT(nvmlDeviceGetBrand, nvmlBrandType_t, g->brand)
ANY_DEVICE_UINT(nvmlDeviceGetArchitecture, nvmlDeviceArchitecture_t, g->arch)

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    ENTER("nvmlDeviceGetCudaComputeCapability", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_device(device, 0, &g, NULL);
    if (rc == NVML_SUCCESS && (major == NULL || minor == NULL))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        *major = g->ccMajor;
        *minor = g->ccMinor;
    }
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    ENTER("nvmlDeviceGetNumaNodeId", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_full_gpu(device, &g);
    if (rc == NVML_SUCCESS && node == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && g->numa < 0)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        *node = (unsigned int)g->numa;
    LEAVE(rc);
}

/* Coherent-memory systems only: NOT_SUPPORTED elsewhere, and on a MIG device. */
nvmlReturn_t nvmlDeviceGetAddressingMode(nvmlDevice_t device, nvmlDeviceAddressingMode_t *mode)
{
    ENTER("nvmlDeviceGetAddressingMode", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_full_gpu(device, &g);
    if (rc == NVML_SUCCESS && mode == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && mode->version != nvmlDeviceAddressingMode_v1)
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (rc == NVML_SUCCESS && g->addressing < 0)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        mode->value = (unsigned int)g->addressing;
    LEAVE(rc);
}

/* ------------------------------------------------------------------ PCI */

static nvmlReturn_t pci_info(const char *function, nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    ENTER(function, 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_device(device, 0, &g, NULL); /* a MIG device answers with its GPU's */
    if (rc == NVML_SUCCESS && pci == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *pci = g->pci;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return pci_info("nvmlDeviceGetPciInfo_v3", device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return pci_info("nvmlDeviceGetPciInfo_v2", device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return pci_info("nvmlDeviceGetPciInfo", device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_t *pci)
{
    ENTER("nvmlDeviceGetPciInfoExt", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_full_gpu(device, &g);
    if (rc == NVML_SUCCESS && pci == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && pci->version != nvmlPciInfoExt_v1)
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (rc == NVML_SUCCESS) {
        pci->domain = g->pci.domain;
        pci->bus = g->pci.bus;
        pci->device = g->pci.device;
        pci->pciDeviceId = g->pci.pciDeviceId;
        pci->pciSubSystemId = g->pci.pciSubSystemId;
        pci->baseClass = g->pciBaseClass;
        pci->subClass = g->pciSubClass;
        memcpy(pci->busId, g->pci.busId, sizeof pci->busId);
    }
    LEAVE(rc);
}

/* ------------------------------------------------------------------ memory, attributes */

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    ENTER("nvmlDeviceGetMemoryInfo", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_device(device, 0, &g, &m);
    if (rc == NVML_SUCCESS && memory == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        memory->total = m != NULL ? m->memoryTotal : g->memory.total;
        memory->free = m != NULL ? m->memoryTotal : g->memory.free;
        memory->used = m != NULL ? 0 : g->memory.used;
    }
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    ENTER("nvmlDeviceGetMemoryInfo_v2", 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_device(device, 0, &g, &m);
    if (rc == NVML_SUCCESS && memory == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && memory->version != nvmlMemory_v2)
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (rc == NVML_SUCCESS) {
        memory->total = m != NULL ? m->memoryTotal : g->memory.total;
        memory->reserved = m != NULL ? 0 : g->memory.reserved;
        memory->free = m != NULL ? m->memoryTotal : g->memory.free;
        memory->used = m != NULL ? 0 : g->memory.used;
    }
    LEAVE(rc);
}

static nvmlReturn_t attributes(const char *function, nvmlDevice_t device, nvmlDeviceAttributes_t *out)
{
    ENTER(function, 1);
    FakeGpu *g;
    FakeMig *m;
    nvmlReturn_t rc = fake_device(device, 0, &g, &m);
    if (rc == NVML_SUCCESS && out == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *out = m != NULL ? m->attrs : g->attrs;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes_)
{
    return attributes("nvmlDeviceGetAttributes_v2", device, attributes_);
}

nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes_)
{
    return attributes("nvmlDeviceGetAttributes", device, attributes_);
}

/* ------------------------------------------------------------------ topology, NVLink */

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                 nvmlGpuTopologyLevel_t *pathInfo)
{
    ENTER("nvmlDeviceGetTopologyCommonAncestor", 1);
    FakeGpu *a, *b;
    nvmlReturn_t rc = fake_full_gpu(device1, &a);
    if (rc == NVML_SUCCESS)
        rc = fake_full_gpu(device2, &b);
    if (rc == NVML_SUCCESS && pathInfo == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *pathInfo = (nvmlGpuTopologyLevel_t)fake.ancestor[a - fake.gpus][b - fake.gpus];
    LEAVE(rc);
}

static nvmlReturn_t link_of(nvmlDevice_t device, unsigned int link, FakeLink **out)
{
    FakeGpu *g;
    nvmlReturn_t rc = fake_full_gpu(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (link >= NVML_NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= g->nLinks) /* no NVLink, or a link number past the GPU's last */
        return NVML_ERROR_NOT_SUPPORTED;
    *out = &g->links[link];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    ENTER("nvmlDeviceGetNvLinkState", 1);
    FakeLink *l;
    nvmlReturn_t rc = link_of(device, link, &l);
    if (rc == NVML_SUCCESS && isActive == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *isActive = NVML_FEATURE_ENABLED;
    LEAVE(rc);
}

static nvmlReturn_t remote_pci(const char *function, nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    ENTER(function, 1);
    FakeLink *l;
    nvmlReturn_t rc = link_of(device, link, &l);
    if (rc == NVML_SUCCESS && pci == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *pci = l->remote;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    return remote_pci("nvmlDeviceGetNvLinkRemotePciInfo_v2", device, link, pci);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    return remote_pci("nvmlDeviceGetNvLinkRemotePciInfo", device, link, pci);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                 nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType)
{
    ENTER("nvmlDeviceGetNvLinkRemoteDeviceType", 1);
    FakeLink *l;
    nvmlReturn_t rc = link_of(device, link, &l);
    if (rc == NVML_SUCCESS && pNvLinkDeviceType == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *pNvLinkDeviceType = l->isGpu ? NVML_NVLINK_DEVICE_TYPE_GPU : NVML_NVLINK_DEVICE_TYPE_SWITCH;
    LEAVE(rc);
}

/* ------------------------------------------------------------------ fabric (IMEX) */

static nvmlReturn_t fabric(const char *function, nvmlDevice_t device, FakeGpu **out)
{
    nvmlReturn_t rc = fake_full_gpu(device, out);
    if (rc == NVML_SUCCESS && !(*out)->fabric.present)
        rc = NVML_ERROR_NOT_SUPPORTED; /* no NVLink fabric: a PCIe or pre-Hopper GPU */
    (void)function;
    return rc;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *gpuFabricInfo)
{
    ENTER("nvmlDeviceGetGpuFabricInfo", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fabric("nvmlDeviceGetGpuFabricInfo", device, &g);
    if (rc == NVML_SUCCESS && gpuFabricInfo == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *gpuFabricInfo = g->fabric.info;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *gpuFabricInfo)
{
    ENTER("nvmlDeviceGetGpuFabricInfoV", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fabric("nvmlDeviceGetGpuFabricInfoV", device, &g);
    if (rc == NVML_SUCCESS && gpuFabricInfo == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc != NVML_SUCCESS)
        LEAVE(rc);
    /* The caller's `version` says which struct it passed: v2 lacks v3's trailing healthSummary. */
    const nvmlGpuFabricInfo_t *src = &g->fabric.info;
    if (gpuFabricInfo->version == nvmlGpuFabricInfo_v2) {
        nvmlGpuFabricInfo_v2_t *v2 = (nvmlGpuFabricInfo_v2_t *)gpuFabricInfo;
        memcpy(v2->clusterUuid, src->clusterUuid, sizeof v2->clusterUuid);
        v2->status = src->status;
        v2->cliqueId = src->cliqueId;
        v2->state = src->state;
        v2->healthMask = 0;
    } else if (gpuFabricInfo->version == nvmlGpuFabricInfo_v3) {
        memcpy(gpuFabricInfo->clusterUuid, src->clusterUuid, sizeof gpuFabricInfo->clusterUuid);
        gpuFabricInfo->status = src->status;
        gpuFabricInfo->cliqueId = src->cliqueId;
        gpuFabricInfo->state = src->state;
        gpuFabricInfo->healthMask = 0;
        gpuFabricInfo->healthSummary = NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY;
    } else {
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    LEAVE(rc);
}

/* ------------------------------------------------------------------ memory health */

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending)
{
    ENTER("nvmlDeviceGetRetiredPagesPendingStatus", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_full_gpu(device, &g);
    if (rc == NVML_SUCCESS && isPending == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && !g->retiredPagesSupported)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        *isPending = g->pendingRetirement ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    ENTER("nvmlDeviceGetRemappedRows", 1);
    FakeGpu *g;
    nvmlReturn_t rc = fake_full_gpu(device, &g);
    if (rc == NVML_SUCCESS && (!corrRows || !uncRows || !isPending || !failureOccurred))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && !g->remappedRowsSupported)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS) {
        *corrRows = g->correctedRows;
        *uncRows = g->uncorrectedRows;
        *isPending = (unsigned int)g->remappedRowsPending;
        *failureOccurred = (unsigned int)g->rowRemapFailure;
    }
    LEAVE(rc);
}
