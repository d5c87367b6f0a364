/*
 * The node the fake library describes: loaded from the flat node file named by FAKENVML_NODE at
 * the first nvmlInit, then kept for the life of the process; and the entry/exit of every call.
 *
 * The node file is written by tests/fakenvml/__init__.py from a simulator description (it records
 * the Python simulator's own answers), so both doubles describe one node. Its format: one record a
 * line, a keyword then fields separated by single spaces, text that may hold spaces last:
 *
 *   fakenvml 1 | driver <text> | nvml <text> | cuda <int>
 *   gpu <index>                       (GPUs in index order; the lines below belong to the last one)
 *   uuid <text> | name <text> | brand <int> | arch <int> | minor <int> | numa <int> | cc <maj> <min>
 *   addressing <nvmlDeviceAddressingModeType_t>   (absent: nvmlDeviceGetAddressingMode is NOT_SUPPORTED)
 *   pci <domain> <bus> <device> <deviceId> <subsystemId> <baseClass> <subClass> <busId> <legacyBusId>
 *   memory <total> <reserved> <free> <used> | events <mask> | computemode <int> | rows <corr> <unc>
 *   attrs <sms> <ce> <dec> <enc> <jpeg> <ofa> <giSlices> <ciSlices> <memMiB>
 *   retired-pages-supported <0|1> | remapped-rows-supported <0|1>
 *   fabric <status> <cliqueId> <state> <cluster uuid as 32 hex digits>
 *   link <gpu|switch> <domain> <bus> <device> <deviceId> <subsystemId> <busId> <legacyBusId>
 *   mig <capable> <enabled> <max MIG devices>
 *   giprofile <enum> <id> <p2p> <slices> <instances> <sms> <ce> <dec> <enc> <jpeg> <ofa> <memMiB>
 *             <memSlices> <starts, comma-separated> <name>
 *   migdev <gi> <ci> <profileId> <start> <size> <sms> <ce> <dec> <enc> <jpeg> <ofa> <giSlices>
 *          <ciSlices> <memMiB> <memory bytes> <uuid> <name>
 *   fault lost|pending-retirement|remapped-rows-pending|row-remap-failure
 *   ancestor <a> <b> <nvmlGpuTopologyLevel_t>
 *
 * Numbers are decimal or 0x-hex. Anything else is an error naming the file and line: nvmlInit then
 * fails with NVML_ERROR_UNKNOWN and the reason is on stderr.
 */
#define _GNU_SOURCE
#include "fakenvml.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Zero-initialised, so the 17 MB of room for 64 GPUs lies in .bss: only the pages a node
 * uses are ever made resident (an initialiser would put all of it in .data, in the file and,
 * as it is read, in the memory of the process under test). What must not start at zero is set
 * at the first call (fake_enter), under the lock, which is therefore kept apart. */
FakeState fake;
pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;

void fake_warn(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("fakenvml: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

nvmlReturn_t fake_enter(const char *function, int needsInit)
{
    pthread_mutex_lock(&fake_lock);
    if (!fake.loadTried) { /* the node first, so that the control file's faults find its GPUs */
        fake.controlFd = fake.notifyFd = -1;
        fake.loadResult = fake_load_node();
    }
    fake_sync_control();
    nvmlReturn_t rc = fake_failure(function);
    if (rc == NVML_SUCCESS && needsInit && fake.initCount == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    if (rc != NVML_SUCCESS)
        pthread_mutex_unlock(&fake_lock);
    return rc;
}

nvmlReturn_t fake_leave(nvmlReturn_t rc)
{
    pthread_mutex_unlock(&fake_lock);
    return rc;
}

nvmlReturn_t fake_copy_text(char *out, unsigned int length, const char *text)
{
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t need = strlen(text) + 1;
    if (length < need)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, text, need);
    return NVML_SUCCESS;
}

/* The MIG device handle of a GPU instance's compute instance (its ring slot set up for it). */
nvmlDevice_t fake_mig_handle(FakeGpu *g, FakeMig *m)
{
    struct nvmlDevice_st *h = &g->migHandles[m->ciSerial % FAKE_RING];
    *h = (struct nvmlDevice_st){FAKE_MAGIC_DEVICE, (int)(g - fake.gpus), 1, m->ciSerial};
    return h;
}

/* The GPU (and MIG device) behind a handle: INVALID_ARGUMENT for what is not a handle of ours,
 * GPU_IS_LOST for a lost GPU (unless allowed), NOT_FOUND for a MIG device no longer there. */
nvmlReturn_t fake_device(nvmlDevice_t device, int allowLost, FakeGpu **gpu, FakeMig **mig)
{
    if (device == NULL || device->magic != FAKE_MAGIC_DEVICE || device->gpu < 0 ||
        (unsigned int)device->gpu >= fake.nGpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    FakeGpu *g = &fake.gpus[device->gpu];
    if (device != &g->handle && (device->mig < 0 || device != &g->migHandles[device->serial % FAKE_RING]))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g->lost && !allowLost)
        return NVML_ERROR_GPU_IS_LOST;
    FakeMig *m = NULL;
    if (device->mig >= 0) {
        for (unsigned int j = 0; g->migEnabled && j < g->nMigs; j++)
            if (g->migs[j].hasCi && g->migs[j].ciSerial == device->serial)
                m = &g->migs[j];
        if (m == NULL)
            return NVML_ERROR_NOT_FOUND; /* destroyed: a stale handle */
    }
    *gpu = g;
    if (mig != NULL)
        *mig = m;
    return NVML_SUCCESS;
}

/* Like fake_device, for calls NVML answers only for a physical GPU (NOT_SUPPORTED on a MIG device). */
nvmlReturn_t fake_full_gpu(nvmlDevice_t device, FakeGpu **gpu)
{
    FakeMig *m = NULL;
    nvmlReturn_t rc = fake_device(device, 0, gpu, &m);
    if (rc == NVML_SUCCESS && m != NULL)
        rc = NVML_ERROR_NOT_SUPPORTED;
    return rc;
}

FakeGpu *fake_gpu_by_uuid(const char *uuid, FakeMig **mig)
{
    for (unsigned int i = 0; i < fake.nGpus; i++) {
        FakeGpu *g = &fake.gpus[i];
        if (strcasecmp(g->uuid, uuid) == 0) {
            *mig = NULL;
            return g;
        }
        for (unsigned int j = 0; g->migEnabled && j < g->nMigs; j++) {
            if (g->migs[j].hasCi && strcasecmp(g->migs[j].uuid, uuid) == 0) {
                *mig = &g->migs[j];
                return g;
            }
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ the node file */

#define MAX_TOKENS 24

typedef struct {
    const char *path;
    unsigned long long line;
    char *tok[MAX_TOKENS];
    char *rest[MAX_TOKENS]; /* the line from token k on */
    int n;
} Line;

static int bad(Line *l, const char *why)
{
    fake_warn("%s:%llu: %s", l->path, l->line, why);
    return -1;
}

/* Splits `text` (a copy of `orig`) into tokens; rest[k] is `orig` from token k on, spaces kept. */
static void split(Line *l, char *text, char *orig)
{
    l->n = 0;
    char *p = text;
    while (*p && l->n < MAX_TOKENS) {
        while (*p == ' ')
            p++;
        if (!*p)
            break;
        l->rest[l->n] = orig + (p - text);
        l->tok[l->n] = p;
        while (*p && *p != ' ')
            p++;
        l->n++;
        if (*p)
            *p++ = '\0';
    }
}

static int number(Line *l, int k, unsigned long long *out)
{
    if (k >= l->n)
        return bad(l, "a field is missing");
    char *end = NULL;
    errno = 0;
    *out = strtoull(l->tok[k], &end, 0);
    if (errno || end == l->tok[k] || *end)
        return bad(l, "a field is not a number");
    return 0;
}

static int uint_at(Line *l, int k, unsigned int *out)
{
    unsigned long long v;
    if (number(l, k, &v))
        return -1;
    if (v > 0xFFFFFFFFull)
        return bad(l, "a field does not fit 32 bits");
    *out = (unsigned int)v;
    return 0;
}

static int uints(Line *l, int first, unsigned int *out[], int count)
{
    for (int k = 0; k < count; k++)
        if (uint_at(l, first + k, out[k]))
            return -1;
    return 0;
}

static int text_at(Line *l, int k, char *out, size_t size, int rest)
{
    if (k >= l->n)
        return bad(l, "a text field is missing");
    const char *src = rest ? l->rest[k] : l->tok[k];
    if (strlen(src) >= size)
        return bad(l, "a text field is too long");
    strcpy(out, src);
    return 0;
}

static int pci_fields(Line *l, int k, nvmlPciInfo_t *pci)
{
    unsigned int *f[] = {&pci->domain, &pci->bus, &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId};
    if (uints(l, k, f, 5))
        return -1;
    int off = k + 5;
    if (off + 1 >= l->n)
        return bad(l, "a PCI bus id is missing");
    if (text_at(l, off, pci->busId, sizeof pci->busId, 0) ||
        text_at(l, off + 1, pci->busIdLegacy, sizeof pci->busIdLegacy, 0))
        return -1;
    return 0;
}

static int attrs_fields(Line *l, int k, nvmlDeviceAttributes_t *a)
{
    unsigned int *f[] = {&a->multiprocessorCount, &a->sharedCopyEngineCount, &a->sharedDecoderCount,
                         &a->sharedEncoderCount,   &a->sharedJpegCount,       &a->sharedOfaCount,
                         &a->gpuInstanceSliceCount, &a->computeInstanceSliceCount};
    if (uints(l, k, f, 8))
        return -1;
    return number(l, k + 8, &a->memorySizeMB);
}

static int hex_uuid(Line *l, int k, unsigned char out[NVML_GPU_FABRIC_UUID_LEN])
{
    if (k >= l->n || strlen(l->tok[k]) != 2 * NVML_GPU_FABRIC_UUID_LEN)
        return bad(l, "a fabric cluster UUID is 32 hex digits");
    for (int i = 0; i < NVML_GPU_FABRIC_UUID_LEN; i++) {
        char byte[3] = {l->tok[k][2 * i], l->tok[k][2 * i + 1], 0};
        char *end = NULL;
        out[i] = (unsigned char)strtoul(byte, &end, 16);
        if (*end)
            return bad(l, "a fabric cluster UUID is 32 hex digits");
    }
    return 0;
}

static int gpu_line(Line *l, FakeGpu *g)
{
    const char *key = l->tok[0];
    if (!strcmp(key, "uuid"))
        return text_at(l, 1, g->uuid, sizeof g->uuid, 0);
    if (!strcmp(key, "name"))
        return text_at(l, 1, g->name, sizeof g->name, 1);
    if (!strcmp(key, "brand"))
        return uint_at(l, 1, &g->brand);
    if (!strcmp(key, "arch"))
        return uint_at(l, 1, &g->arch);
    if (!strcmp(key, "minor"))
        return uint_at(l, 1, &g->minor);
    if (!strcmp(key, "numa")) {
        unsigned int v;
        if (uint_at(l, 1, &v))
            return -1;
        g->numa = (int)v;
        return 0;
    }
    if (!strcmp(key, "addressing")) {
        unsigned int v;
        if (uint_at(l, 1, &v))
            return -1;
        if (v > NVML_DEVICE_ADDRESSING_MODE_ATS)
            return bad(l, "an addressing mode is 0 (none), 1 (HMM) or 2 (ATS)");
        g->addressing = (int)v;
        return 0;
    }
    if (!strcmp(key, "cc")) {
        unsigned int a, b;
        if (uint_at(l, 1, &a) || uint_at(l, 2, &b))
            return -1;
        g->ccMajor = (int)a;
        g->ccMinor = (int)b;
        return 0;
    }
    if (!strcmp(key, "pci")) {
        unsigned int *f[] = {&g->pci.domain, &g->pci.bus, &g->pci.device, &g->pci.pciDeviceId,
                             &g->pci.pciSubSystemId, &g->pciBaseClass, &g->pciSubClass};
        if (uints(l, 1, f, 7))
            return -1;
        return text_at(l, 8, g->pci.busId, sizeof g->pci.busId, 0) ||
               text_at(l, 9, g->pci.busIdLegacy, sizeof g->pci.busIdLegacy, 0);
    }
    if (!strcmp(key, "memory"))
        return number(l, 1, &g->memory.total) || number(l, 2, &g->memory.reserved) ||
               number(l, 3, &g->memory.free) || number(l, 4, &g->memory.used);
    if (!strcmp(key, "attrs"))
        return attrs_fields(l, 1, &g->attrs);
    if (!strcmp(key, "events"))
        return number(l, 1, &g->supportedEvents);
    if (!strcmp(key, "computemode"))
        return uint_at(l, 1, &g->computeMode);
    if (!strcmp(key, "rows"))
        return uint_at(l, 1, &g->correctedRows) || uint_at(l, 2, &g->uncorrectedRows);
    if (!strcmp(key, "retired-pages-supported")) {
        unsigned int v;
        if (uint_at(l, 1, &v))
            return -1;
        g->retiredPagesSupported = v != 0;
        return 0;
    }
    if (!strcmp(key, "remapped-rows-supported")) {
        unsigned int v;
        if (uint_at(l, 1, &v))
            return -1;
        g->remappedRowsSupported = v != 0;
        return 0;
    }
    if (!strcmp(key, "fabric")) {
        unsigned int status, clique, state;
        if (uint_at(l, 1, &status) || uint_at(l, 2, &clique) || uint_at(l, 3, &state) ||
            hex_uuid(l, 4, g->fabric.info.clusterUuid))
            return -1;
        g->fabric.present = 1;
        g->fabric.info.status = (nvmlReturn_t)status;
        g->fabric.info.cliqueId = clique;
        g->fabric.info.state = (nvmlGpuFabricState_t)state;
        return 0;
    }
    if (!strcmp(key, "link")) {
        if (g->nLinks >= FAKE_MAX_LINKS)
            return bad(l, "more NVLinks than NVML_NVLINK_MAX_LINKS");
        FakeLink *link = &g->links[g->nLinks];
        if (l->n < 2 || (strcmp(l->tok[1], "gpu") && strcmp(l->tok[1], "switch")))
            return bad(l, "a link is to a gpu or a switch");
        link->isGpu = !strcmp(l->tok[1], "gpu");
        if (pci_fields(l, 2, &link->remote))
            return -1;
        g->nLinks++;
        return 0;
    }
    if (!strcmp(key, "mig")) {
        unsigned int cap, en, max;
        if (uint_at(l, 1, &cap) || uint_at(l, 2, &en) || uint_at(l, 3, &max))
            return -1;
        if (max > FAKE_MAX_MIG)
            return bad(l, "more MIG devices than NVML allows");
        g->migCapable = cap != 0;
        g->migEnabled = g->migPending = en != 0;
        g->maxMigDevices = max;
        return 0;
    }
    if (!strcmp(key, "giprofile")) {
        if (g->nGiProfiles >= FAKE_MAX_GI_PROFILES)
            return bad(l, "more GPU instance profiles than NVML_GPU_INSTANCE_PROFILE_COUNT");
        FakeGiProfile *p = &g->giProfiles[g->nGiProfiles];
        memset(p, 0, sizeof *p);
        p->info.version = nvmlGpuInstanceProfileInfo_v2;
        unsigned int *f[] = {&p->enumValue, &p->info.id, &p->info.isP2pSupported, &p->info.sliceCount,
                             &p->info.instanceCount, &p->info.multiprocessorCount, &p->info.copyEngineCount,
                             &p->info.decoderCount, &p->info.encoderCount, &p->info.jpegCount,
                             &p->info.ofaCount};
        if (uints(l, 1, f, 11) || number(l, 12, &p->info.memorySizeMB) || uint_at(l, 13, &p->memorySlices))
            return -1;
        if (p->enumValue >= NVML_GPU_INSTANCE_PROFILE_COUNT)
            return bad(l, "a GPU instance profile enum is past NVML_GPU_INSTANCE_PROFILE_COUNT");
        if (l->n < 16)
            return bad(l, "a GPU instance profile needs its placements and name");
        char *save = NULL;
        for (char *s = strtok_r(l->tok[14], ",", &save); s; s = strtok_r(NULL, ",", &save)) {
            if (p->nStarts >= FAKE_MAX_STARTS)
                return bad(l, "more placements than memory slices");
            p->starts[p->nStarts++] = (unsigned int)strtoul(s, NULL, 10);
        }
        if (text_at(l, 15, p->info.name, sizeof p->info.name, 1))
            return -1;
        g->nGiProfiles++;
        return 0;
    }
    if (!strcmp(key, "migdev")) {
        if (g->nMigs >= FAKE_MAX_MIG)
            return bad(l, "more MIG devices than NVML allows");
        FakeMig *m = &g->migs[g->nMigs];
        unsigned int *f[] = {&m->gi, &m->ci, &m->profileId, &m->placement.start, &m->placement.size};
        if (uints(l, 1, f, 5) || attrs_fields(l, 6, &m->attrs) || number(l, 15, &m->memoryTotal) ||
            text_at(l, 16, m->uuid, sizeof m->uuid, 0))
            return -1;
        if (text_at(l, 17, m->name, sizeof m->name, 1))
            return -1;
        m->hasCi = 1;
        g->nMigs++;
        return 0;
    }
    if (!strcmp(key, "fault")) {
        if (l->n < 2)
            return bad(l, "which fault?");
        if (!strcmp(l->tok[1], "lost"))
            g->lost = 1;
        else if (!strcmp(l->tok[1], "pending-retirement"))
            g->pendingRetirement = 1;
        else if (!strcmp(l->tok[1], "remapped-rows-pending"))
            g->remappedRowsPending = 1;
        else if (!strcmp(l->tok[1], "row-remap-failure"))
            g->rowRemapFailure = 1;
        else
            return bad(l, "unknown fault");
        return 0;
    }
    return bad(l, "unknown keyword");
}

static int node_line(Line *l, FakeGpu **current)
{
    const char *key = l->tok[0];
    if (!strcmp(key, "fakenvml")) {
        unsigned int v;
        if (uint_at(l, 1, &v))
            return -1;
        return v == 1 ? 0 : bad(l, "this library reads node files of version 1");
    }
    if (!strcmp(key, "driver"))
        return text_at(l, 1, fake.driver, sizeof fake.driver, 0);
    if (!strcmp(key, "nvml"))
        return text_at(l, 1, fake.nvmlVersion, sizeof fake.nvmlVersion, 0);
    if (!strcmp(key, "cuda")) {
        unsigned int v;
        if (uint_at(l, 1, &v))
            return -1;
        fake.cuda = (int)v;
        return 0;
    }
    if (!strcmp(key, "gpu")) {
        unsigned int index;
        if (uint_at(l, 1, &index))
            return -1;
        if (index != fake.nGpus)
            return bad(l, "GPUs are listed in index order");
        if (fake.nGpus >= FAKE_MAX_GPUS)
            return bad(l, "more GPUs than this library holds (64)");
        FakeGpu *g = &fake.gpus[fake.nGpus++];
        g->numa = -1;
        g->addressing = -1;
        *current = g;
        return 0;
    }
    if (!strcmp(key, "ancestor")) {
        unsigned int a, b, level;
        if (uint_at(l, 1, &a) || uint_at(l, 2, &b) || uint_at(l, 3, &level))
            return -1;
        if (a >= fake.nGpus || b >= fake.nGpus)
            return bad(l, "an ancestor names a GPU not listed before it");
        fake.ancestor[a][b] = fake.ancestor[b][a] = level;
        return 0;
    }
    if (*current == NULL)
        return bad(l, "a GPU field before the first gpu line");
    return gpu_line(l, *current);
}

static void number_handles(void)
{
    for (unsigned int i = 0; i < fake.nGpus; i++) {
        FakeGpu *g = &fake.gpus[i];
        g->handle = (struct nvmlDevice_st){FAKE_MAGIC_DEVICE, (int)i, -1, 0};
        for (unsigned int j = 0; j < g->nMigs; j++) { /* creation serials: GI, then its CI */
            g->migs[j].giSerial = ++g->serial;
            g->migs[j].ciSerial = ++g->serial;
        }
        for (unsigned int a = 0; a < fake.nGpus; a++)
            if (a == i)
                fake.ancestor[i][a] = NVML_TOPOLOGY_INTERNAL;
    }
}

/* Reads the node file once per process (lock held), at its first NVML call. */
nvmlReturn_t fake_load_node(void)
{
    fake.loadTried = 1;
    const char *path = getenv("FAKENVML_NODE");
    if (path == NULL || !*path) {
        fake_warn("FAKENVML_NODE names no node file: there is no GPU to describe");
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    FILE *fh = fopen(path, "r");
    if (fh == NULL) {
        fake_warn("%s: %s", path, strerror(errno));
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    /* No memset of fake.gpus: it is static storage, zero until this one read fills it, and
     * writing zeros over all of it would make every page of it resident (a megabyte the
     * process under test would be charged for, though a node uses a few GPUs of the 64). */
    fake.nGpus = 0;
    Line l = {.path = path};
    FakeGpu *current = NULL;
    char buf[1024], work[1024];
    int failed = 0;
    while (!failed && fgets(buf, sizeof buf, fh)) {
        l.line++;
        size_t len = strlen(buf);
        if (len && buf[len - 1] != '\n' && !feof(fh)) {
            failed = bad(&l, "a line longer than 1023 characters");
            break;
        }
        while (len && (buf[len - 1] == '\n' || buf[len - 1] == '\r'))
            buf[--len] = '\0';
        memcpy(work, buf, len + 1);
        split(&l, work, buf);
        if (l.n == 0 || l.tok[0][0] == '#')
            continue;
        failed = node_line(&l, &current) != 0;
    }
    fclose(fh);
    if (failed || fake.nGpus == 0) {
        if (!failed)
            fake_warn("%s: describes no GPU", path);
        fake.nGpus = 0;
        return NVML_ERROR_UNKNOWN;
    }
    number_handles();
    fake.loaded = 1;
    return NVML_SUCCESS;
}
