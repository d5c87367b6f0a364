/*
 * The fake libnvidia-ml's internals, shared by its source files.
 *
 * nvml.h is NVIDIA's own header (from the PyPI package nvidia-nvml-dev), included with default
 * visibility so that every NVML function defined in these files is exported and nothing else is:
 * a function not defined here is an absent symbol, and the binding answers FUNCTION_NOT_FOUND for
 * it, as an old driver does. NVML_NO_UNVERSIONED_FUNC_DEFS (set on the command line) makes nvml.h
 * declare the old unversioned entry points too, so both versions of a call can be defined.
 *
 * One mutex guards all state. Every exported function starts with ENTER(name), which takes the
 * mutex, reads what the test appended to the control file since the last call (faults, events),
 * applies an injected failure of `name` and checks nvmlInit, and leaves through LEAVE(rc).
 */
#ifndef FAKENVML_H
#define FAKENVML_H

#pragma GCC visibility push(default)
#include <nvml.h>
#pragma GCC visibility pop

#include <pthread.h>
#include <stddef.h>

#define FAKE_MAX_GPUS 64
#define FAKE_MAX_MIG 7                       /* MIG devices per GPU: NVML's maximum */
#define FAKE_MAX_LINKS NVML_NVLINK_MAX_LINKS
#define FAKE_MAX_GI_PROFILES NVML_GPU_INSTANCE_PROFILE_COUNT
#define FAKE_MAX_STARTS 8                    /* memory slices of a MIG-capable GPU */
#define FAKE_MAX_SETS 64                     /* event sets alive at once */
#define FAKE_QUEUE 8192                      /* events pending per set; more are dropped, counted */
#define FAKE_MAX_FAILURES 64                 /* functions failing at once */
#define FAKE_TEXT 96                         /* names, UUIDs, versions: NVML's v2 buffer size */
#define FAKE_NO_INSTANCE 0xFFFFFFFFu
#define FAKE_RING 32 /* handles per GPU and kind, by creation serial: a destroyed instance's handle
                        stays stale until 32 more instances have been made on its GPU */

/* Device handles: one per GPU, and one per MIG device (compute instance), found again by the
 * creation serial it carries: a handle whose instance is gone names no instance. */
struct nvmlDevice_st {
    unsigned int magic;
    int gpu;
    int mig; /* -1: the physical GPU, else 1 */
    unsigned int serial; /* the compute instance's (FakeMig.ciSerial) */
};

struct nvmlGpuInstance_st {
    unsigned int magic;
    int gpu;
    unsigned int id;
    unsigned int serial; /* FakeMig.giSerial */
};

struct nvmlComputeInstance_st {
    unsigned int magic;
    int gpu;
    unsigned int gi;
    unsigned int id;
    unsigned int serial; /* FakeMig.ciSerial */
};

typedef struct {
    unsigned int enumValue; /* NVML_GPU_INSTANCE_PROFILE_*: the `profile` argument */
    nvmlGpuInstanceProfileInfo_v2_t info;
    unsigned int memorySlices;
    unsigned int starts[FAKE_MAX_STARTS];
    unsigned int nStarts;
} FakeGiProfile;

/* One GPU instance, and the compute instance spanning it when `hasCi` (then it is a MIG device). */
typedef struct {
    int hasCi;
    unsigned int giSerial, ciSerial;
    unsigned int processes; /* running on the MIG device: its destroy is IN_USE */
    char uuid[FAKE_TEXT];
    char name[FAKE_TEXT];
    unsigned int gi, ci, profileId;
    nvmlGpuInstancePlacement_t placement;
    nvmlDeviceAttributes_t attrs;
    unsigned long long memoryTotal;
} FakeMig;

typedef struct {
    int isGpu;              /* the remote is a peer GPU (else an NVSwitch) */
    nvmlPciInfo_t remote;
} FakeLink;

typedef struct {
    int present;
    nvmlGpuFabricInfo_t info;
} FakeFabric;

typedef struct {
    /* what the node file describes */
    struct nvmlDevice_st handle;
    struct nvmlDevice_st migHandles[FAKE_RING];
    char uuid[FAKE_TEXT];
    char name[FAKE_TEXT];
    unsigned int brand, arch, minor;
    nvmlPciInfo_t pci;
    unsigned int pciBaseClass, pciSubClass;
    nvmlMemory_v2_t memory;
    int numa; /* -1: NOT_SUPPORTED */
    int addressing; /* nvmlDeviceAddressingModeType_t; -1: NOT_SUPPORTED */
    int ccMajor, ccMinor;
    nvmlDeviceAttributes_t attrs;
    unsigned long long supportedEvents;
    int retiredPagesSupported, remappedRowsSupported;
    FakeFabric fabric;
    FakeLink links[FAKE_MAX_LINKS];
    unsigned int nLinks;
    int migCapable, migEnabled, migPending;
    unsigned int maxMigDevices;
    FakeGiProfile giProfiles[FAKE_MAX_GI_PROFILES];
    unsigned int nGiProfiles;
    FakeMig migs[FAKE_MAX_MIG]; /* GPU instances in creation order; MIG devices are those with a CI */
    unsigned int nMigs;
    unsigned int serial;    /* the last creation serial given on this GPU */
    unsigned int created;   /* compute instances created at run time (their UUIDs) */
    unsigned int processes; /* running on the GPU itself */
    unsigned int computeMode;
    /* what changes at run time */
    int lost, pendingRetirement, remappedRowsPending, rowRemapFailure;
    unsigned int correctedRows, uncorrectedRows;
} FakeGpu;

typedef struct {
    int used, freed;
    int wakeFd;                              /* eventfd: written when an event arrives or the set goes */
    unsigned long long registered[FAKE_MAX_GPUS];
    nvmlEventData_t queue[FAKE_QUEUE];
    unsigned int head, count;
    unsigned long long dropped;
} FakeEventSet;

struct nvmlEventSet_st {
    unsigned int magic;
    int slot;
};

typedef struct {
    char function[64];
    nvmlReturn_t code;
    long remaining; /* -1: until cleared */
} FakeFailure;

typedef struct {
    int loaded, loadTried;
    nvmlReturn_t loadResult; /* what nvmlInit answers when the node file could not be read */
    int initCount;
    char driver[FAKE_TEXT], nvmlVersion[FAKE_TEXT];
    int cuda;
    FakeGpu gpus[FAKE_MAX_GPUS];
    unsigned int nGpus;
    unsigned int ancestor[FAKE_MAX_GPUS][FAKE_MAX_GPUS];
    struct nvmlGpuInstance_st giHandles[FAKE_MAX_GPUS][FAKE_RING];
    struct nvmlComputeInstance_st ciHandles[FAKE_MAX_GPUS][FAKE_RING];
    FakeEventSet sets[FAKE_MAX_SETS];
    struct nvmlEventSet_st setHandles[FAKE_MAX_SETS];
    unsigned int nextSet;
    FakeFailure failures[FAKE_MAX_FAILURES];
    /* the control file: a log the test appends to, read from `controlOffset` on */
    char controlPath[4096];
    int controlFd, notifyFd;
    long long controlOffset;
    unsigned long long controlLine;
    char pending[4096];
    size_t pendingLen;
    int skippingLine; /* a line longer than `pending` was reported: the rest of it is skipped */
} FakeState;

extern FakeState fake;
extern pthread_mutex_t fake_lock; /* held by every exported function between ENTER and LEAVE */

#define FAKE_MAGIC_DEVICE 0x6e766d6cu
#define FAKE_MAGIC_GI 0x6e76676au
#define FAKE_MAGIC_CI 0x6e766369u
#define FAKE_MAGIC_SET 0x6e766573u

/* entry and exit of every exported function (state.c) */
nvmlReturn_t fake_enter(const char *function, int needsInit);
nvmlReturn_t fake_leave(nvmlReturn_t rc);
#define ENTER(name, needsInit)                                    \
    do {                                                          \
        nvmlReturn_t enter_rc_ = fake_enter((name), (needsInit)); \
        if (enter_rc_ != NVML_SUCCESS)                            \
            return enter_rc_;                                     \
    } while (0)
#define LEAVE(rc) return fake_leave(rc)

/* state.c */
nvmlReturn_t fake_load_node(void);
void fake_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
nvmlReturn_t fake_device(nvmlDevice_t device, int allowLost, FakeGpu **gpu, FakeMig **mig);
nvmlReturn_t fake_full_gpu(nvmlDevice_t device, FakeGpu **gpu);
nvmlReturn_t fake_copy_text(char *out, unsigned int length, const char *text);
FakeGpu *fake_gpu_by_uuid(const char *uuid, FakeMig **mig);
nvmlDevice_t fake_mig_handle(FakeGpu *g, FakeMig *m);

/* mig.c */
FakeGiProfile *fake_profile_by_id(FakeGpu *g, unsigned int id);
int fake_ci_profile_for(unsigned int slices);
nvmlGpuInstance_t fake_gi_handle(FakeGpu *g, FakeMig *m);
nvmlComputeInstance_t fake_ci_handle(FakeGpu *g, FakeMig *m);
nvmlReturn_t fake_gi_of(nvmlGpuInstance_t gi, FakeGpu **gpu, FakeMig **mig);
nvmlReturn_t fake_ci_of(nvmlComputeInstance_t ci, FakeGpu **gpu, FakeMig **mig);

/* migcreate.c */
int fake_gpu_busy(const FakeGpu *g);
void fake_activate_mig_mode(FakeGpu *g);

/* control.c */
void fake_sync_control(void);
nvmlReturn_t fake_failure(const char *function);
void fake_open_control(void);

/* events.c */
void fake_deliver(FakeGpu *gpu, unsigned long long type, unsigned long long data, unsigned int gi, unsigned int ci);
void fake_wake_all_sets(void);

#endif
