/*
 * fake_nvml.c -- a stand-in for libnvidia-ml.so.1 whose GPUs are described by
 * a text file.  It implements the subset of the NVML C API that gpuid-agent
 * reaches through pynvml (nvidia-ml-py), with the same symbol names, argument
 * lists and structure layouts that pynvml passes.
 *
 * Build:
 *   gcc -shared -fPIC -O1 -Wall -Werror -Wl,-soname,libnvidia-ml.so.1 \
 *       -o <dir>/libnvidia-ml.so.1 fake_nvml.c
 * Add -DOMIT_<symbol> (for example -DOMIT_nvmlDeviceGetPlatformInfo) to build a
 * library that lacks that export; pynvml then raises NVMLError_FunctionNotFound.
 *
 * Configuration
 * -------------
 * The environment variable FAKE_NVML_CONFIG names the file.  It is read at
 * every nvmlInit/nvmlInit_v2/nvmlInitWithFlags call and, at the start of every
 * exported call, re-read whenever stat() reports a different path, device,
 * inode, mtime (ns) or size.  Write it with temp file + rename.  An unset
 * variable or a missing file means: no GPUs, init succeeds.
 *
 * One statement per line; blank lines and lines whose first non-blank
 * character is '#' are ignored, as are unknown keys and malformed lines.
 * Numbers are decimal or 0x-prefixed hex.  For string keys the value is the
 * rest of the line with surrounding blanks removed (it may contain spaces).
 * A key given twice keeps the last value.
 *
 *   init_error <nvmlReturn>          nvmlInit* returns this code
 *   driver_version <str>             default 570.86.15
 *   cuda_driver_version <int>        default 12080
 *   nvml_version <str>               default "12." + driver_version
 *   gpu <i> <key> <value...>         a property of GPU i (0-based)
 *   gpu <i> error <field-key> <nvmlReturn>
 *   gpu <i> xid <code> <after_n_waits> [<gpu_instance_id> <compute_instance_id>]
 *   gpu <i> field <id>[:<scope>] <value> a value nvmlDeviceGetFieldValues reads
 *                   (see the field values block at the end of this file)
 *   gpu <i> mig <j> <key> <value...> a property of MIG device j of GPU i
 *   gpu <i> mig <j> error <field-key> <nvmlReturn>
 *   block <symbol> <seconds>         every call of that exported function hangs
 *   gpu <i> block <field-key> <seconds>   calls on GPU i matching <field-key> hang
 *
 * The GPU count is (highest i mentioned) + 1; GPU i has index i.
 *
 * GPU keys (an unset key makes its getter return NVML_ERROR_NOT_SUPPORTED,
 * except uuid, name, pci_bus_id and minor, which have defaults):
 *   uuid, serial, name, board_part_number       strings
 *   pci_bus_id      "00000000:18:00.0" (domain:bus:device.function, hex)
 *   pci_device_id, pci_subsystem_id             numbers (default 0)
 *   minor, module_id                            numbers
 *   chassis_serial  string, up to 16 bytes      (nvmlDeviceGetPlatformInfo)
 *   slot, tray, host_id, peer_type, platform_module_id   0..255
 *                   (platform_module_id falls back to module_id when unset)
 *   ib_guid         up to 32 hex digits (":" and "-" allowed), stored in
 *                   order into the 16-byte array, rest zero
 *   rack_guid       same, only for the v1 platform structure
 *   mig_mode, mig_mode_pending (default = mig_mode), max_mig_devices
 *                   (default 7 when mig_mode is set, else 0)
 *   persistence_mode, retired_pending           0/1
 *   util_gpu, util_mem, util_enc, util_dec      percent
 *   mem_total, mem_used, mem_free, mem_reserved bytes (free defaults to
 *                                               total - used)
 *   temperature     degrees C
 *   power_mw        milliwatts
 *   energy_mj       millijoules (64 bit)
 *   clock_sm, clock_mem, clock_graphics (default clock_sm), clock_video   MHz
 *   pcie_replay
 *   ecc_vol_corr, ecc_vol_uncorr, ecc_agg_corr, ecc_agg_uncorr
 *   remap_corr, remap_unc, remap_pending, remap_failure
 *   clocks_event_reasons                        64-bit mask
 *   fabric_state, fabric_status, fabric_health_mask, fabric_clique_id,
 *   fabric_health_summary
 *   fabric_max_version  highest nvmlGpuFabricInfo structure version the V call
 *                   accepts (default 3); 2 rejects v3 with ARGUMENT_VERSION_MISMATCH,
 *                   as drivers that predate the health summary do
 *   fabric_cluster_uuid  UUID text (dashes allowed) -> 16 bytes
 *   supported_events     64-bit mask, default 0x1f
 *   lost            1: every call taking a handle of this GPU (or of one of
 *                   its MIG devices) returns NVML_ERROR_GPU_IS_LOST (15)
 * A call that returns several values (utilization, memory, remapped rows,
 * platform info, fabric info) is supported when at least one of its keys is
 * set; the unset ones read as 0.
 *
 * MIG keys: uuid, name, gi_id, ci_id, mem_total, mem_used, mem_free.  Any
 * line for slot j (even an unknown key such as "defined 1") creates it.
 * MIG devices are returned by nvmlDeviceGetMigDeviceHandleByIndex only while
 * the parent's mig_mode is 1; an undefined slot j gives NVML_ERROR_NOT_FOUND.
 * Calls other than UUID/name/memory/instance ids/parent lookups return
 * NVML_ERROR_NOT_SUPPORTED for MIG handles.
 *
 * Error keys ("gpu <i> error <field-key> <rc>"): a call fails with rc when
 * <field-key> is the exported function name (e.g. nvmlDeviceGetPowerUsage),
 * one of the keys it reads (e.g. power_mw), or its group name:
 *   handle (nvmlDeviceGetHandleBy*), index, pci_info, platform_info,
 *   utilization (also util_enc/util_dec), memory, power, energy, clock, ecc,
 *   remapped_rows, clocks_event_reasons, fabric_info, events, mig,
 *   field_values.
 * An error on a GPU does not apply to its MIG devices and vice versa.
 *
 * Events: nvmlDeviceRegisterEvents records the mask per GPU in the set; each
 * nvmlEventSetWait_v2 call counts one wait on its set.  An xid line is
 * delivered once per event set (which must have nvmlEventTypeXidCriticalError
 * registered for that GPU) by the first wait that has at least after_n_waits
 * earlier waits on that set.  A wait with nothing due sleeps in short steps,
 * re-checking the file, and returns NVML_ERROR_TIMEOUT after timeoutms.
 *
 * Hanging calls ("block", as a driver stuck in the kernel does): the call
 * sleeps for <seconds> (decimal, fractions allowed) and then proceeds as usual.
 * It sleeps without holding the library's lock, in short steps re-reading the
 * file, so other threads' calls go on, and the call returns early once the
 * statement is gone (or its seconds have passed since the call began).  A GPU
 * block matches <field-key> the way error keys do (function name, key or group);
 * "block" without a GPU names an exported function: nvmlInit/nvmlInit_v2,
 * nvmlShutdown, nvmlSystemGetDriverVersion, nvmlDeviceGetCount(_v2) or any call
 * taking a device handle.  A blocked call that finds NVML shut down when it wakes
 * returns NVML_ERROR_UNINITIALIZED.
 *
 * A handle whose GPU index is no longer below the count (after the file
 * shrank) behaves like a lost GPU.
 *
 * Running processes (see the block at the end of this file):
 *   gpu <i> process <pid> <used_bytes> [<gi> <ci>]      a compute process
 *   gpu <i> mps_process <pid> <used_bytes> [<gi> <ci>]  a process under MPS
 *   gpu <i> process_util <pid> <sm> [<mem> <enc> <dec> [<timestamp_us>]]
 * used_bytes "-" reads as NVML_VALUE_NOT_AVAILABLE; gi/ci default to
 * 0xFFFFFFFF (no MIG).  Samples default to the call's own time, so every call
 * sees them; an explicit timestamp older than the caller's lastSeenTimeStamp
 * is not returned.  With no sample newer than lastSeen the utilization calls
 * answer NVML_ERROR_NOT_FOUND, as drivers do.  Error and block keys: the
 * function name or the group "processes" (lists) / "process_util" (samples).
 */

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>

/* Builds with -DOMIT_<symbol> leave some static helpers without callers. */
#pragma GCC diagnostic ignored "-Wunused-function"

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_ALREADY_INITIALIZED 5
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_INSUFFICIENT_POWER 8
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_IRQ_ISSUE 11
#define NVML_ERROR_LIBRARY_NOT_FOUND 12
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_CORRUPTED_INFOROM 14
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_RESET_REQUIRED 16
#define NVML_ERROR_OPERATING_SYSTEM 17
#define NVML_ERROR_LIB_RM_VERSION_MISMATCH 18
#define NVML_ERROR_IN_USE 19
#define NVML_ERROR_MEMORY 20
#define NVML_ERROR_NO_DATA 21
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define NVML_EVENT_XID_CRITICAL 0x8ULL
#define INVALID_INSTANCE_ID 0xFFFFFFFFu

/* ------------------------------------------------------------------------ */
/* ABI structures (layouts as declared by pynvml)                           */

struct fake_handle {
    unsigned int magic;
    int gpu;
    int mig; /* -1 for a full GPU */
};
typedef struct fake_handle *nvmlDevice_t;

struct fake_event_set;
typedef struct fake_event_set *nvmlEventSet_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int version;
    unsigned int sensorType;
    int temperature;
} nvmlTemperature_t;

/* v1 and v2 share one layout; v2 renamed rackGuid and the slot fields. */
typedef struct {
    unsigned int version;
    unsigned char ibGuid[16];
    unsigned char chassisSerialNumber[16]; /* v1: rackGuid */
    unsigned char slotNumber;              /* v1: chassisPhysicalSlotNumber */
    unsigned char trayIndex;               /* v1: computeSlotIndex */
    unsigned char hostId;                  /* v1: nodeIndex */
    unsigned char peerType;
    unsigned char moduleId;
} nvmlPlatformInfo_t;

typedef struct {
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
} nvmlGpuFabricInfo_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
    unsigned char healthSummary; /* v3 only */
} nvmlGpuFabricInfoV_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

#define NVML_MEMORY_V2 0x02000028u
#define NVML_TEMPERATURE_V1 0x0100000Cu
#define NVML_PLATFORM_INFO_V1 0x0100002Cu
#define NVML_PLATFORM_INFO_V2 0x0200002Cu
#define NVML_FABRIC_INFO_V2 0x02000024u
#define NVML_FABRIC_INFO_V3 0x03000028u

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");
_Static_assert(sizeof(nvmlMemory_v2_t) == (NVML_MEMORY_V2 & 0xFFFFFF), "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlTemperature_t) == (NVML_TEMPERATURE_V1 & 0xFFFFFF), "nvmlTemperature_t");
_Static_assert(sizeof(nvmlPlatformInfo_t) == (NVML_PLATFORM_INFO_V2 & 0xFFFFFF), "platform");
_Static_assert(sizeof(nvmlGpuFabricInfo_t) == 28, "nvmlGpuFabricInfo_t");
_Static_assert(offsetof(nvmlGpuFabricInfoV_t, healthSummary) == (NVML_FABRIC_INFO_V2 & 0xFFFFFF),
               "fabric v2");
_Static_assert(sizeof(nvmlGpuFabricInfoV_t) == (NVML_FABRIC_INFO_V3 & 0xFFFFFF), "fabric v3");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t");

/* ------------------------------------------------------------------------ */
/* Configuration state                                                      */

#define MAX_GPUS 64
#define MAX_MIG 16
#define MAX_KV 96
#define MIG_KV 16
#define MAX_ERR 32
#define MIG_ERR 8
#define MAX_XID 32
#define MAX_BLOCK 16
#define KEY_LEN 48
#define VAL_LEN 160
#define HANDLE_MAGIC 0x4e564d4cu
#define SET_MAX_DELIVERED 256

struct kv {
    char key[KEY_LEN];
    char val[VAL_LEN];
};

struct err_entry {
    char key[KEY_LEN];
    nvmlReturn_t rc;
};

struct block_entry {
    char key[KEY_LEN];
    double seconds;
};

struct xid_entry {
    unsigned long long code;
    unsigned long long after;
    unsigned int gi;
    unsigned int ci;
};

struct fake_mig {
    int defined;
    int nkv;
    struct kv kv[MIG_KV];
    int nerr;
    struct err_entry err[MIG_ERR];
};

struct fake_gpu {
    int nkv;
    struct kv kv[MAX_KV];
    int nerr;
    struct err_entry err[MAX_ERR];
    int nxid;
    struct xid_entry xid[MAX_XID];
    int nblock;
    struct block_entry block[MAX_BLOCK];
    struct fake_mig mig[MAX_MIG];
};

struct fake_config {
    int has_init_error;
    nvmlReturn_t init_error;
    char driver_version[VAL_LEN];
    char nvml_version[VAL_LEN];
    int cuda_driver_version;
    int gpu_count;
    int nblock;
    struct block_entry block[MAX_BLOCK];
    struct fake_gpu gpu[MAX_GPUS];
};

struct delivered {
    int gpu;
    unsigned long long code;
    unsigned long long after;
    int ordinal;
};

struct fake_event_set {
    unsigned int magic;
    unsigned long long mask[MAX_GPUS];
    unsigned long long waits;
    int ndelivered;
    struct delivered delivered[SET_MAX_DELIVERED];
    struct fake_event_set *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_refcount;
static struct fake_config g_cfg;
static struct fake_handle g_gpu_handles[MAX_GPUS];
static struct fake_handle g_mig_handles[MAX_GPUS][MAX_MIG];
static struct fake_event_set *g_sets;

static struct {
    int loaded;
    int exists;
    char path[4096];
    dev_t dev;
    ino_t ino;
    long long mtime_sec;
    long long mtime_nsec;
    long long size;
} g_src;

/* ------------------------------------------------------------------------ */
/* Small string helpers                                                     */

static int is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

static char *trim(char *s) {
    while (*s && is_blank(*s)) s++;
    size_t n = strlen(s);
    while (n > 0 && is_blank(s[n - 1])) s[--n] = '\0';
    return s;
}

static char *next_token(char **cursor) {
    char *s = *cursor;
    while (*s && is_blank(*s)) s++;
    if (!*s) {
        *cursor = s;
        return NULL;
    }
    char *start = s;
    while (*s && !is_blank(*s)) s++;
    if (*s) *s++ = '\0';
    *cursor = s;
    return start;
}

static void copy_bounded(char *dst, size_t cap, const char *src) {
    size_t n = strlen(src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

static int parse_u64(const char *s, unsigned long long *out) {
    if (!s) return 0;
    while (*s && is_blank(*s)) s++;
    if (!*s || *s == '-') return 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 0);
    if (end == s) return 0;
    while (*end && is_blank(*end)) end++;
    if (*end) return 0;
    *out = v;
    return 1;
}

static int parse_i64(const char *s, long long *out) {
    if (!s) return 0;
    char *end = NULL;
    long long v = strtoll(s, &end, 0);
    if (end == s) return 0;
    while (*end && is_blank(*end)) end++;
    if (*end) return 0;
    *out = v;
    return 1;
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Hex digits (":" / "-" separators and a 0x prefix allowed) into 16 bytes. */
static int parse_hex16(const char *s, unsigned char out[16]) {
    memset(out, 0, 16);
    if (!s) return 0;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) s += 2;
    int nibbles = 0;
    for (; *s; s++) {
        if (*s == ':' || *s == '-') continue;
        int v = hex_value(*s);
        if (v < 0) return 0;
        if (nibbles >= 32) return 0;
        if (nibbles % 2 == 0)
            out[nibbles / 2] = (unsigned char)(v << 4);
        else
            out[nibbles / 2] |= (unsigned char)v;
        nibbles++;
    }
    return nibbles > 0;
}

/* ------------------------------------------------------------------------ */
/* Config parsing                                                           */

static void kv_set(struct kv *arr, int *n, int cap, const char *key, const char *val) {
    for (int i = 0; i < *n; i++) {
        if (strcmp(arr[i].key, key) == 0) {
            copy_bounded(arr[i].val, VAL_LEN, val);
            return;
        }
    }
    if (*n >= cap) return;
    copy_bounded(arr[*n].key, KEY_LEN, key);
    copy_bounded(arr[*n].val, VAL_LEN, val);
    (*n)++;
}

static const char *kv_get(const struct kv *arr, int n, const char *key) {
    for (int i = 0; i < n; i++)
        if (strcmp(arr[i].key, key) == 0) return arr[i].val;
    return NULL;
}

static void err_set(struct err_entry *arr, int *n, int cap, const char *key, nvmlReturn_t rc) {
    for (int i = 0; i < *n; i++) {
        if (strcmp(arr[i].key, key) == 0) {
            arr[i].rc = rc;
            return;
        }
    }
    if (*n >= cap) return;
    copy_bounded(arr[*n].key, KEY_LEN, key);
    arr[*n].rc = rc;
    (*n)++;
}

static void block_set(struct block_entry *arr, int *n, const char *key, const char *secs) {
    char *end;
    double v = strtod(secs, &end);
    if (end == secs || *trim(end) || !(v >= 0.0) || v > 1e6) return;
    for (int i = 0; i < *n; i++) {
        if (strcmp(arr[i].key, key) == 0) {
            arr[i].seconds = v;
            return;
        }
    }
    if (*n >= MAX_BLOCK) return;
    copy_bounded(arr[*n].key, KEY_LEN, key);
    arr[*n].seconds = v;
    (*n)++;
}

/* Running processes and their utilization samples (block at the end of the file). */
static void procs_reset(void);
static int procs_parse_gpu_key(int gi, const char *key, char *rest);

static void parse_gpu_line(char *rest) {
    unsigned long long idx;
    char *tok = next_token(&rest);
    if (!tok || !parse_u64(tok, &idx) || idx >= MAX_GPUS) return;
    char *key = next_token(&rest);
    if (!key) return;
    struct fake_gpu *g = &g_cfg.gpu[idx];
    if ((int)idx + 1 > g_cfg.gpu_count) g_cfg.gpu_count = (int)idx + 1;

    if (strcmp(key, "error") == 0) {
        char *field = next_token(&rest);
        long long rc;
        if (!field || !parse_i64(trim(rest), &rc)) return;
        err_set(g->err, &g->nerr, MAX_ERR, field, (nvmlReturn_t)rc);
    } else if (strcmp(key, "block") == 0) {
        char *field = next_token(&rest);
        if (field) block_set(g->block, &g->nblock, field, trim(rest));
    } else if (strcmp(key, "xid") == 0) {
        unsigned long long code, after, gi = INVALID_INSTANCE_ID, ci = INVALID_INSTANCE_ID;
        if (!parse_u64(next_token(&rest), &code)) return;
        if (!parse_u64(next_token(&rest), &after)) return;
        char *t = next_token(&rest);
        if (t) {
            if (!parse_u64(t, &gi) || !parse_u64(next_token(&rest), &ci)) return;
        }
        if (g->nxid >= MAX_XID) return;
        g->xid[g->nxid].code = code;
        g->xid[g->nxid].after = after;
        g->xid[g->nxid].gi = (unsigned int)gi;
        g->xid[g->nxid].ci = (unsigned int)ci;
        g->nxid++;
    } else if (strcmp(key, "field") == 0) {
        /* stored as the key "field.<id>" or "field.<id>.<scope>" */
        char *id = next_token(&rest), name[KEY_LEN];
        if (!id) return;
        snprintf(name, sizeof name, "field.%s", id);
        for (char *c = name; *c; c++)
            if (*c == ':') *c = '.';
        kv_set(g->kv, &g->nkv, MAX_KV, name, trim(rest));
    } else if (strcmp(key, "mig") == 0) {
        unsigned long long j;
        if (!parse_u64(next_token(&rest), &j) || j >= MAX_MIG) return;
        char *mkey = next_token(&rest);
        if (!mkey) return;
        struct fake_mig *m = &g->mig[j];
        m->defined = 1;
        if (strcmp(mkey, "error") == 0) {
            char *field = next_token(&rest);
            long long rc;
            if (!field || !parse_i64(trim(rest), &rc)) return;
            err_set(m->err, &m->nerr, MIG_ERR, field, (nvmlReturn_t)rc);
        } else {
            kv_set(m->kv, &m->nkv, MIG_KV, mkey, trim(rest));
        }
    } else if (procs_parse_gpu_key((int)idx, key, rest)) {
        /* a process statement */
    } else {
        kv_set(g->kv, &g->nkv, MAX_KV, key, trim(rest));
    }
}

static void parse_line(char *line) {
    char *s = trim(line);
    if (!*s || *s == '#') return;
    char *kw = next_token(&s);
    if (!kw) return;
    if (strcmp(kw, "gpu") == 0) {
        parse_gpu_line(s);
    } else if (strcmp(kw, "init_error") == 0) {
        long long rc;
        if (parse_i64(trim(s), &rc)) {
            g_cfg.has_init_error = 1;
            g_cfg.init_error = (nvmlReturn_t)rc;
        }
    } else if (strcmp(kw, "block") == 0) {
        char *sym = next_token(&s);
        if (sym) block_set(g_cfg.block, &g_cfg.nblock, sym, trim(s));
    } else if (strcmp(kw, "driver_version") == 0) {
        copy_bounded(g_cfg.driver_version, VAL_LEN, trim(s));
    } else if (strcmp(kw, "nvml_version") == 0) {
        copy_bounded(g_cfg.nvml_version, VAL_LEN, trim(s));
    } else if (strcmp(kw, "cuda_driver_version") == 0) {
        long long v;
        if (parse_i64(trim(s), &v)) g_cfg.cuda_driver_version = (int)v;
    }
}

static void load_config(const char *path) {
    memset(&g_cfg, 0, sizeof(g_cfg));
    procs_reset();
    copy_bounded(g_cfg.driver_version, VAL_LEN, "570.86.15");
    g_cfg.cuda_driver_version = 12080;
    if (path) {
        FILE *f = fopen(path, "r");
        if (f) {
            struct stat st;
            if (fstat(fileno(f), &st) == 0) {
                g_src.dev = st.st_dev;
                g_src.ino = st.st_ino;
                g_src.mtime_sec = (long long)st.st_mtim.tv_sec;
                g_src.mtime_nsec = (long long)st.st_mtim.tv_nsec;
                g_src.size = (long long)st.st_size;
            }
            char line[2048];
            while (fgets(line, sizeof(line), f)) {
                size_t n = strlen(line);
                if (n == sizeof(line) - 1 && line[n - 1] != '\n') {
                    int c; /* drop the remainder of an over-long line */
                    while ((c = fgetc(f)) != EOF && c != '\n') {
                    }
                }
                parse_line(line);
            }
            fclose(f);
        }
    }
    if (!g_cfg.nvml_version[0]) {
        char buf[VAL_LEN + 8];
        snprintf(buf, sizeof(buf), "12.%s", g_cfg.driver_version);
        copy_bounded(g_cfg.nvml_version, VAL_LEN, buf);
    }
}

/* Caller holds g_lock. */
static void maybe_reload(int force) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (path && !*path) path = NULL;
    struct stat st;
    int exists = path && stat(path, &st) == 0;
    if (!force && g_src.loaded) {
        int same_path = path ? strncmp(g_src.path, path, sizeof(g_src.path) - 1) == 0
                             : g_src.path[0] == '\0';
        if (same_path && exists == g_src.exists &&
            (!exists ||
             (st.st_dev == g_src.dev && st.st_ino == g_src.ino &&
              (long long)st.st_mtim.tv_sec == g_src.mtime_sec &&
              (long long)st.st_mtim.tv_nsec == g_src.mtime_nsec &&
              (long long)st.st_size == g_src.size)))
            return;
    }
    g_src.loaded = 1;
    g_src.exists = exists;
    copy_bounded(g_src.path, sizeof(g_src.path), path ? path : "");
    if (exists) {
        g_src.dev = st.st_dev;
        g_src.ino = st.st_ino;
        g_src.mtime_sec = (long long)st.st_mtim.tv_sec;
        g_src.mtime_nsec = (long long)st.st_mtim.tv_nsec;
        g_src.size = (long long)st.st_size;
    }
    load_config(exists ? path : NULL);
}

/* ------------------------------------------------------------------------ */
/* Call framing                                                             */

static void api_lock(void) {
    pthread_mutex_lock(&g_lock);
    maybe_reload(0);
}

static nvmlReturn_t api_leave(nvmlReturn_t rc) {
    pthread_mutex_unlock(&g_lock);
    return rc;
}

#define API_ENTER()                                                        \
    do {                                                                   \
        api_lock();                                                        \
        if (g_refcount <= 0) return api_leave(NVML_ERROR_UNINITIALIZED);   \
    } while (0)

#define RET(x) return api_leave(x)
#define KEYS(...) ((const char *const[]){__VA_ARGS__, NULL})

static nvmlDevice_t gpu_handle(int i) {
    struct fake_handle *h = &g_gpu_handles[i];
    h->magic = HANDLE_MAGIC;
    h->gpu = i;
    h->mig = -1;
    return h;
}

static nvmlDevice_t mig_handle(int i, int j) {
    struct fake_handle *h = &g_mig_handles[i][j];
    h->magic = HANDLE_MAGIC;
    h->gpu = i;
    h->mig = j;
    return h;
}

static int decode_handle(nvmlDevice_t h, int *gi, int *mi) {
    uintptr_t p = (uintptr_t)h;
    uintptr_t g0 = (uintptr_t)&g_gpu_handles[0];
    uintptr_t g1 = g0 + sizeof(g_gpu_handles);
    uintptr_t m0 = (uintptr_t)&g_mig_handles[0][0];
    uintptr_t m1 = m0 + sizeof(g_mig_handles);
    if (p >= g0 && p < g1 && (p - g0) % sizeof(struct fake_handle) == 0) {
        *gi = (int)((p - g0) / sizeof(struct fake_handle));
        *mi = -1;
    } else if (p >= m0 && p < m1 && (p - m0) % sizeof(struct fake_handle) == 0) {
        size_t k = (p - m0) / sizeof(struct fake_handle);
        *gi = (int)(k / MAX_MIG);
        *mi = (int)(k % MAX_MIG);
    } else {
        return 0;
    }
    return h->magic == HANDLE_MAGIC;
}

static int key_listed(const char *key, const char *fn, const char *const *keys) {
    if (fn && strcmp(key, fn) == 0) return 1;
    for (; keys && *keys; keys++)
        if (strcmp(key, *keys) == 0) return 1;
    return 0;
}

static nvmlReturn_t find_error(const struct err_entry *arr, int n, const char *fn,
                               const char *const *keys) {
    for (int i = 0; i < n; i++)
        if (key_listed(arr[i].key, fn, keys)) return arr[i].rc;
    return NVML_SUCCESS;
}

static int gpu_lost(const struct fake_gpu *g) {
    const char *v = kv_get(g->kv, g->nkv, "lost");
    unsigned long long x;
    return v && parse_u64(v, &x) && x != 0;
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000LL;
}

/* The seconds a call of fn on GPU gi (-1: none) must hang, or a negative number.
 * Caller holds g_lock. */
static double block_seconds(int gi, const char *fn, const char *const *keys) {
    for (int i = 0; i < g_cfg.nblock; i++)
        if (fn && strcmp(g_cfg.block[i].key, fn) == 0) return g_cfg.block[i].seconds;
    if (gi < 0 || gi >= g_cfg.gpu_count) return -1.0;
    const struct fake_gpu *g = &g_cfg.gpu[gi];
    for (int i = 0; i < g->nblock; i++)
        if (key_listed(g->block[i].key, fn, keys)) return g->block[i].seconds;
    return -1.0;
}

/* Hang while a block statement matches, without the lock, re-reading the file every
 * step.  Caller holds g_lock and still does on return; 0 when NVML was shut down
 * meanwhile. */
static int hold_if_blocked(int gi, const char *fn, const char *const *keys) {
    long long start = now_ms();
    for (;;) {
        double secs = block_seconds(gi, fn, keys);
        if (secs < 0.0 || now_ms() - start >= (long long)(secs * 1000.0)) break;
        pthread_mutex_unlock(&g_lock);
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&g_lock);
        maybe_reload(0);
    }
    return g_refcount > 0;
}

#define ALLOW_GPU 1
#define ALLOW_MIG 2

/* Validate a device handle and apply lost/error rules.  Caller holds g_lock. */
static nvmlReturn_t resolve(nvmlDevice_t h, int allow, const char *fn, const char *const *keys,
                            struct fake_gpu **gp, struct fake_mig **mp, int *gindex) {
    int gi, mi;
    if (!h || !decode_handle(h, &gi, &mi)) return NVML_ERROR_INVALID_ARGUMENT;
    if (!hold_if_blocked(gi, fn, keys)) return NVML_ERROR_UNINITIALIZED;
    if (gi >= g_cfg.gpu_count) return NVML_ERROR_GPU_IS_LOST;
    struct fake_gpu *g = &g_cfg.gpu[gi];
    if (gpu_lost(g)) return NVML_ERROR_GPU_IS_LOST;
    struct fake_mig *m = NULL;
    nvmlReturn_t rc;
    if (mi >= 0) {
        m = &g->mig[mi];
        if (!m->defined) return NVML_ERROR_INVALID_ARGUMENT;
        if (!(allow & ALLOW_MIG)) return NVML_ERROR_NOT_SUPPORTED;
        rc = find_error(m->err, m->nerr, fn, keys);
    } else {
        if (!(allow & ALLOW_GPU)) return NVML_ERROR_NOT_SUPPORTED;
        rc = find_error(g->err, g->nerr, fn, keys);
    }
    if (rc != NVML_SUCCESS) return rc;
    if (gp) *gp = g;
    if (mp) *mp = m;
    if (gindex) *gindex = gi;
    return NVML_SUCCESS;
}

static const char *gpu_str(const struct fake_gpu *g, const char *key) {
    return kv_get(g->kv, g->nkv, key);
}

static int gpu_u64(const struct fake_gpu *g, const char *key, unsigned long long *out) {
    return parse_u64(kv_get(g->kv, g->nkv, key), out);
}

static int mig_u64(const struct fake_mig *m, const char *key, unsigned long long *out) {
    return parse_u64(kv_get(m->kv, m->nkv, key), out);
}

static unsigned long long gpu_u64_or(const struct fake_gpu *g, const char *key,
                                     unsigned long long dflt, int *any) {
    unsigned long long v;
    if (gpu_u64(g, key, &v)) {
        if (any) *any = 1;
        return v;
    }
    return dflt;
}

static nvmlReturn_t copy_out_str(char *dst, unsigned int len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if ((size_t)len < n + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

static void default_uuid(int i, char *buf, size_t cap) {
    snprintf(buf, cap, "GPU-fa4e0000-0000-4000-8000-%012x", (unsigned int)i);
}

static const char *gpu_uuid(const struct fake_gpu *g, int i, char *buf, size_t cap) {
    const char *v = gpu_str(g, "uuid");
    if (v) return v;
    default_uuid(i, buf, cap);
    return buf;
}

static const char *gpu_pci_bus_id(const struct fake_gpu *g, int i, char *buf, size_t cap) {
    const char *v = gpu_str(g, "pci_bus_id");
    if (v) return v;
    snprintf(buf, cap, "00000000:%02X:00.0", (unsigned int)(0x10 + i) & 0xFFu);
    return buf;
}

/* Shared body for getters of a single unsigned number. */
static nvmlReturn_t get_u32(nvmlDevice_t h, const char *fn, const char *key, const char *group,
                            unsigned int *out) {
    struct fake_gpu *g;
    unsigned long long v;
    API_ENTER();
    nvmlReturn_t rc = resolve(h, ALLOW_GPU, fn, KEYS(key, group), &g, NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!out) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!gpu_u64(g, key, &v)) RET(NVML_ERROR_NOT_SUPPORTED);
    *out = (unsigned int)v;
    RET(NVML_SUCCESS);
}

static nvmlReturn_t get_u64(nvmlDevice_t h, const char *fn, const char *key, const char *group,
                            unsigned long long *out) {
    struct fake_gpu *g;
    unsigned long long v;
    API_ENTER();
    nvmlReturn_t rc = resolve(h, ALLOW_GPU, fn, KEYS(key, group), &g, NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!out) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!gpu_u64(g, key, &v)) RET(NVML_ERROR_NOT_SUPPORTED);
    *out = v;
    RET(NVML_SUCCESS);
}

static nvmlReturn_t get_string(nvmlDevice_t h, const char *fn, const char *key, char *buf,
                               unsigned int len) {
    struct fake_gpu *g;
    API_ENTER();
    nvmlReturn_t rc = resolve(h, ALLOW_GPU, fn, KEYS(key), &g, NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    const char *v = gpu_str(g, key);
    if (!v) RET(NVML_ERROR_NOT_SUPPORTED);
    RET(copy_out_str(buf, len, v));
}

/* ------------------------------------------------------------------------ */
/* Initialisation and system queries                                        */

static nvmlReturn_t do_init(const char *fn) {
    pthread_mutex_lock(&g_lock);
    maybe_reload(1);
    hold_if_blocked(-1, fn, NULL);
    if (g_cfg.has_init_error && g_cfg.init_error != NVML_SUCCESS)
        return api_leave(g_cfg.init_error);
    g_refcount++;
    return api_leave(NVML_SUCCESS);
}

#ifndef OMIT_nvmlInit
EXPORT nvmlReturn_t nvmlInit(void) { return do_init(__func__); }
#endif

#ifndef OMIT_nvmlInit_v2
EXPORT nvmlReturn_t nvmlInit_v2(void) { return do_init(__func__); }
#endif

#ifndef OMIT_nvmlInitWithFlags
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init(__func__);
}
#endif

#ifndef OMIT_nvmlShutdown
EXPORT nvmlReturn_t nvmlShutdown(void) {
    API_ENTER();
    if (!hold_if_blocked(-1, __func__, NULL)) RET(NVML_ERROR_UNINITIALIZED);
    g_refcount--;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlErrorString
EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
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
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return "Unknown Error";
    }
}
#endif

#ifndef OMIT_nvmlSystemGetDriverVersion
EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    API_ENTER();
    if (!hold_if_blocked(-1, __func__, NULL)) RET(NVML_ERROR_UNINITIALIZED);
    RET(copy_out_str(version, length, g_cfg.driver_version));
}
#endif

#ifndef OMIT_nvmlSystemGetNVMLVersion
EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    API_ENTER();
    RET(copy_out_str(version, length, g_cfg.nvml_version));
}
#endif

static nvmlReturn_t cuda_version(int *out) {
    API_ENTER();
    if (!out) RET(NVML_ERROR_INVALID_ARGUMENT);
    *out = g_cfg.cuda_driver_version;
    RET(NVML_SUCCESS);
}

#ifndef OMIT_nvmlSystemGetCudaDriverVersion
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    return cuda_version(cudaDriverVersion);
}
#endif

#ifndef OMIT_nvmlSystemGetCudaDriverVersion_v2
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return cuda_version(cudaDriverVersion);
}
#endif

/* ------------------------------------------------------------------------ */
/* Enumeration                                                              */

static nvmlReturn_t device_count(const char *fn, unsigned int *count) {
    API_ENTER();
    if (!hold_if_blocked(-1, fn, NULL)) RET(NVML_ERROR_UNINITIALIZED);
    if (!count) RET(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned int)g_cfg.gpu_count;
    RET(NVML_SUCCESS);
}

#ifndef OMIT_nvmlDeviceGetCount
EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) {
    return device_count(__func__, deviceCount);
}
#endif

#ifndef OMIT_nvmlDeviceGetCount_v2
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    return device_count(__func__, deviceCount);
}
#endif

static nvmlReturn_t handle_by_index(const char *fn, unsigned int index, nvmlDevice_t *device) {
    API_ENTER();
    if (!device || index >= (unsigned int)g_cfg.gpu_count) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!hold_if_blocked((int)index, fn, KEYS("handle", "nvmlDeviceGetHandleByIndex")))
        RET(NVML_ERROR_UNINITIALIZED);
    if (index >= (unsigned int)g_cfg.gpu_count) RET(NVML_ERROR_INVALID_ARGUMENT);
    struct fake_gpu *g = &g_cfg.gpu[index];
    nvmlReturn_t rc = find_error(g->err, g->nerr, fn, KEYS("handle", "nvmlDeviceGetHandleByIndex"));
    if (rc != NVML_SUCCESS) RET(rc);
    *device = gpu_handle((int)index);
    RET(NVML_SUCCESS);
}

#ifndef OMIT_nvmlDeviceGetHandleByIndex
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return handle_by_index(__func__, index, device);
}
#endif

#ifndef OMIT_nvmlDeviceGetHandleByIndex_v2
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    return handle_by_index(__func__, index, device);
}
#endif

#ifndef OMIT_nvmlDeviceGetHandleByUUID
EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    char buf[64];
    API_ENTER();
    if (!uuid || !device) RET(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < g_cfg.gpu_count; i++) {
        struct fake_gpu *g = &g_cfg.gpu[i];
        if (strcmp(gpu_uuid(g, i, buf, sizeof(buf)), uuid) == 0) {
            nvmlReturn_t rc = find_error(g->err, g->nerr, __func__, KEYS("handle"));
            if (rc != NVML_SUCCESS) RET(rc);
            *device = gpu_handle(i);
            RET(NVML_SUCCESS);
        }
        for (int j = 0; j < MAX_MIG; j++) {
            const struct fake_mig *m = &g->mig[j];
            const char *mu = m->defined ? kv_get(m->kv, m->nkv, "uuid") : NULL;
            if (mu && strcmp(mu, uuid) == 0) {
                *device = mig_handle(i, j);
                RET(NVML_SUCCESS);
            }
        }
    }
    RET(NVML_ERROR_NOT_FOUND);
}
#endif

#ifndef OMIT_nvmlDeviceGetHandleByPciBusId_v2
EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    char buf[64];
    API_ENTER();
    if (!pciBusId || !device) RET(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < g_cfg.gpu_count; i++) {
        struct fake_gpu *g = &g_cfg.gpu[i];
        if (strcasecmp(gpu_pci_bus_id(g, i, buf, sizeof(buf)), pciBusId) == 0) {
            nvmlReturn_t rc = find_error(g->err, g->nerr, __func__, KEYS("handle"));
            if (rc != NVML_SUCCESS) RET(rc);
            *device = gpu_handle(i);
            RET(NVML_SUCCESS);
        }
    }
    RET(NVML_ERROR_NOT_FOUND);
}
#endif

#ifndef OMIT_nvmlDeviceGetIndex
EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    int gi;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__, KEYS("index"), NULL, NULL, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!index) RET(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)gi;
    RET(NVML_SUCCESS);
}
#endif

/* ------------------------------------------------------------------------ */
/* Identity                                                                 */

#ifndef OMIT_nvmlDeviceGetUUID
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    struct fake_gpu *g;
    struct fake_mig *m;
    int gi;
    char buf[64];
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU | ALLOW_MIG, __func__, KEYS("uuid"), &g, &m, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (m) {
        const char *v = kv_get(m->kv, m->nkv, "uuid");
        if (!v) RET(NVML_ERROR_NOT_SUPPORTED);
        RET(copy_out_str(uuid, length, v));
    }
    RET(copy_out_str(uuid, length, gpu_uuid(g, gi, buf, sizeof(buf))));
}
#endif

#ifndef OMIT_nvmlDeviceGetName
EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    struct fake_gpu *g;
    struct fake_mig *m;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU | ALLOW_MIG, __func__, KEYS("name"), &g, &m, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    const char *v = m ? kv_get(m->kv, m->nkv, "name") : gpu_str(g, "name");
    if (!v) v = m ? "NVIDIA Fake GPU MIG" : "NVIDIA Fake GPU";
    RET(copy_out_str(name, length, v));
}
#endif

#ifndef OMIT_nvmlDeviceGetSerial
EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    return get_string(device, __func__, "serial", serial, length);
}
#endif

#ifndef OMIT_nvmlDeviceGetBoardPartNumber
EXPORT nvmlReturn_t nvmlDeviceGetBoardPartNumber(nvmlDevice_t device, char *partNumber,
                                                 unsigned int length) {
    return get_string(device, __func__, "board_part_number", partNumber, length);
}
#endif

static nvmlReturn_t pci_info(nvmlDevice_t device, const char *fn, nvmlPciInfo_t *pci) {
    struct fake_gpu *g;
    int gi;
    char buf[64];
    API_ENTER();
    nvmlReturn_t rc =
        resolve(device, ALLOW_GPU, fn, KEYS("pci_info", "pci_bus_id", "nvmlDeviceGetPciInfo"), &g,
                NULL, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!pci) RET(NVML_ERROR_INVALID_ARGUMENT);
    const char *bus_id = gpu_pci_bus_id(g, gi, buf, sizeof(buf));
    unsigned int domain = 0, bus = 0, dev = 0, func = 0;
    if (sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &func) < 3) {
        domain = bus = dev = 0;
    }
    memset(pci, 0, sizeof(*pci));
    copy_bounded(pci->busId, sizeof(pci->busId), bus_id);
    char legacy[64];
    snprintf(legacy, sizeof(legacy), "%04X:%02X:%02X.%X", domain, bus, dev, func);
    copy_bounded(pci->busIdLegacy, sizeof(pci->busIdLegacy), legacy);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = (unsigned int)gpu_u64_or(g, "pci_device_id", 0, NULL);
    pci->pciSubSystemId = (unsigned int)gpu_u64_or(g, "pci_subsystem_id", 0, NULL);
    RET(NVML_SUCCESS);
}

#ifndef OMIT_nvmlDeviceGetPciInfo
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return pci_info(device, __func__, pci);
}
#endif

#ifndef OMIT_nvmlDeviceGetPciInfo_v2
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return pci_info(device, __func__, pci);
}
#endif

#ifndef OMIT_nvmlDeviceGetPciInfo_v3
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return pci_info(device, __func__, pci);
}
#endif

#ifndef OMIT_nvmlDeviceGetMinorNumber
EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    struct fake_gpu *g;
    int gi;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__, KEYS("minor"), &g, NULL, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!minorNumber) RET(NVML_ERROR_INVALID_ARGUMENT);
    *minorNumber = (unsigned int)gpu_u64_or(g, "minor", (unsigned long long)gi, NULL);
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetModuleId
EXPORT nvmlReturn_t nvmlDeviceGetModuleId(nvmlDevice_t device, unsigned int *moduleId) {
    return get_u32(device, __func__, "module_id", NULL, moduleId);
}
#endif

#ifndef OMIT_nvmlDeviceGetPlatformInfo
EXPORT nvmlReturn_t nvmlDeviceGetPlatformInfo(nvmlDevice_t device, nvmlPlatformInfo_t *info) {
    struct fake_gpu *g;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__,
                              KEYS("platform_info", "ib_guid", "rack_guid", "chassis_serial",
                                   "slot", "tray", "host_id", "peer_type", "platform_module_id"),
                              &g, NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!info) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (info->version != NVML_PLATFORM_INFO_V1 && info->version != NVML_PLATFORM_INFO_V2)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    int v1 = info->version == NVML_PLATFORM_INFO_V1;
    int any = 0;
    unsigned char guid[16];
    const char *ib = gpu_str(g, "ib_guid");
    const char *chassis = gpu_str(g, "chassis_serial");
    const char *rack = gpu_str(g, "rack_guid");
    unsigned int version = info->version;
    memset(info, 0, sizeof(*info));
    info->version = version;
    if (ib) {
        any = 1;
        parse_hex16(ib, guid);
        memcpy(info->ibGuid, guid, 16);
    }
    if (v1) {
        if (rack) {
            any = 1;
            parse_hex16(rack, guid);
            memcpy(info->chassisSerialNumber, guid, 16);
        }
    } else if (chassis) {
        any = 1;
        size_t n = strlen(chassis);
        memcpy(info->chassisSerialNumber, chassis, n > 16 ? 16 : n);
    }
    info->slotNumber = (unsigned char)gpu_u64_or(g, "slot", 0, &any);
    info->trayIndex = (unsigned char)gpu_u64_or(g, "tray", 0, &any);
    info->hostId = (unsigned char)gpu_u64_or(g, "host_id", 0, &any);
    info->peerType = (unsigned char)gpu_u64_or(g, "peer_type", 0, &any);
    info->moduleId = (unsigned char)gpu_u64_or(g, "platform_module_id", 0, &any);
    if (!any) RET(NVML_ERROR_NOT_SUPPORTED);
    if (!gpu_str(g, "platform_module_id"))
        info->moduleId = (unsigned char)gpu_u64_or(g, "module_id", 0, NULL);
    RET(NVML_SUCCESS);
}
#endif

/* ------------------------------------------------------------------------ */
/* MIG                                                                      */

#ifndef OMIT_nvmlDeviceGetMigMode
EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                         unsigned int *pendingMode) {
    struct fake_gpu *g;
    unsigned long long cur;
    API_ENTER();
    nvmlReturn_t rc =
        resolve(device, ALLOW_GPU, __func__, KEYS("mig_mode", "mig_mode_pending", "mig"), &g,
                NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!currentMode || !pendingMode) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!gpu_u64(g, "mig_mode", &cur)) RET(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = (unsigned int)cur;
    *pendingMode = (unsigned int)gpu_u64_or(g, "mig_mode_pending", cur, NULL);
    RET(NVML_SUCCESS);
}
#endif

static unsigned int max_mig(const struct fake_gpu *g) {
    unsigned long long v;
    if (gpu_u64(g, "max_mig_devices", &v)) return v > MAX_MIG ? MAX_MIG : (unsigned int)v;
    return gpu_u64(g, "mig_mode", &v) ? 7u : 0u;
}

#ifndef OMIT_nvmlDeviceGetMaxMigDeviceCount
EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    struct fake_gpu *g;
    API_ENTER();
    nvmlReturn_t rc =
        resolve(device, ALLOW_GPU, __func__, KEYS("max_mig_devices", "mig"), &g, NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!count) RET(NVML_ERROR_INVALID_ARGUMENT);
    *count = max_mig(g);
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetMigDeviceHandleByIndex
EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice) {
    struct fake_gpu *g;
    int gi;
    unsigned long long mode;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__, KEYS("mig"), &g, NULL, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!migDevice || index >= max_mig(g) || index >= MAX_MIG) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!gpu_u64(g, "mig_mode", &mode) || mode != 1 || !g->mig[index].defined)
        RET(NVML_ERROR_NOT_FOUND);
    *migDevice = mig_handle(gi, (int)index);
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceIsMigDeviceHandle
EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    struct fake_mig *m;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU | ALLOW_MIG, __func__, NULL, NULL, &m, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!isMigDevice) RET(NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = m != NULL;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetDeviceHandleFromMigDeviceHandle
EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                                 nvmlDevice_t *device) {
    struct fake_mig *m;
    int gi;
    API_ENTER();
    nvmlReturn_t rc = resolve(migDevice, ALLOW_GPU | ALLOW_MIG, __func__, NULL, NULL, &m, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!device || !m) RET(NVML_ERROR_INVALID_ARGUMENT);
    *device = gpu_handle(gi);
    RET(NVML_SUCCESS);
}
#endif

static nvmlReturn_t mig_id(nvmlDevice_t device, const char *fn, const char *key, unsigned int *out) {
    struct fake_mig *m;
    unsigned long long v;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU | ALLOW_MIG, fn, KEYS(key), NULL, &m, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!m) RET(NVML_ERROR_NOT_SUPPORTED);
    if (!out) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!mig_u64(m, key, &v)) RET(NVML_ERROR_NOT_SUPPORTED);
    *out = (unsigned int)v;
    RET(NVML_SUCCESS);
}

#ifndef OMIT_nvmlDeviceGetGpuInstanceId
EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    return mig_id(device, __func__, "gi_id", id);
}
#endif

#ifndef OMIT_nvmlDeviceGetComputeInstanceId
EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    return mig_id(device, __func__, "ci_id", id);
}
#endif

/* ------------------------------------------------------------------------ */
/* State and telemetry                                                      */

#ifndef OMIT_nvmlDeviceGetPersistenceMode
EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, unsigned int *mode) {
    return get_u32(device, __func__, "persistence_mode", NULL, mode);
}
#endif

#ifndef OMIT_nvmlDeviceGetUtilizationRates
EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                  nvmlUtilization_t *utilization) {
    struct fake_gpu *g;
    int any = 0;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__,
                              KEYS("utilization", "util_gpu", "util_mem"), &g, NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!utilization) RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int gpu = (unsigned int)gpu_u64_or(g, "util_gpu", 0, &any);
    unsigned int mem = (unsigned int)gpu_u64_or(g, "util_mem", 0, &any);
    if (!any) RET(NVML_ERROR_NOT_SUPPORTED);
    utilization->gpu = gpu;
    utilization->memory = mem;
    RET(NVML_SUCCESS);
}
#endif

static nvmlReturn_t codec_util(nvmlDevice_t device, const char *fn, const char *key,
                               unsigned int *util, unsigned int *period) {
    nvmlReturn_t rc = get_u32(device, fn, key, "utilization", util);
    if (rc == NVML_SUCCESS && period) *period = 1000000u;
    return rc;
}

#ifndef OMIT_nvmlDeviceGetEncoderUtilization
EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs) {
    return codec_util(device, __func__, "util_enc", utilization, samplingPeriodUs);
}
#endif

#ifndef OMIT_nvmlDeviceGetDecoderUtilization
EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs) {
    return codec_util(device, __func__, "util_dec", utilization, samplingPeriodUs);
}
#endif

struct mem_values {
    unsigned long long total, reserved, free, used;
};

/* Caller holds g_lock. */
static nvmlReturn_t memory_values(nvmlDevice_t device, const char *fn, struct mem_values *out) {
    struct fake_gpu *g;
    struct fake_mig *m;
    int any = 0;
    unsigned long long v;
    nvmlReturn_t rc = resolve(device, ALLOW_GPU | ALLOW_MIG, fn,
                              KEYS("memory", "mem_total", "mem_used", "mem_free", "mem_reserved",
                                   "nvmlDeviceGetMemoryInfo"),
                              &g, &m, NULL);
    if (rc != NVML_SUCCESS) return rc;
    memset(out, 0, sizeof(*out));
    if (m) {
        if (mig_u64(m, "mem_total", &v)) any = 1, out->total = v;
        if (mig_u64(m, "mem_used", &v)) any = 1, out->used = v;
        out->free = out->total > out->used ? out->total - out->used : 0;
        if (mig_u64(m, "mem_free", &v)) any = 1, out->free = v;
    } else {
        out->total = gpu_u64_or(g, "mem_total", 0, &any);
        out->used = gpu_u64_or(g, "mem_used", 0, &any);
        out->reserved = gpu_u64_or(g, "mem_reserved", 0, &any);
        out->free = gpu_u64_or(g, "mem_free", out->total > out->used ? out->total - out->used : 0,
                               &any);
    }
    return any ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

#ifndef OMIT_nvmlDeviceGetMemoryInfo
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    struct mem_values mv;
    API_ENTER();
    nvmlReturn_t rc = memory_values(device, __func__, &mv);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!memory) RET(NVML_ERROR_INVALID_ARGUMENT);
    memory->total = mv.total;
    memory->free = mv.free;
    memory->used = mv.used;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetMemoryInfo_v2
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    struct mem_values mv;
    API_ENTER();
    nvmlReturn_t rc = memory_values(device, __func__, &mv);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!memory) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != NVML_MEMORY_V2) RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = mv.total;
    memory->reserved = mv.reserved;
    memory->free = mv.free;
    memory->used = mv.used;
    RET(NVML_SUCCESS);
}
#endif

/* Caller holds g_lock. */
static nvmlReturn_t temperature_value(nvmlDevice_t device, const char *fn, unsigned int sensor,
                                      long long *out) {
    struct fake_gpu *g;
    nvmlReturn_t rc =
        resolve(device, ALLOW_GPU, fn, KEYS("temperature", "nvmlDeviceGetTemperature"), &g, NULL,
                NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (!parse_i64(gpu_str(g, "temperature"), out)) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

#ifndef OMIT_nvmlDeviceGetTemperature
EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensorType,
                                             unsigned int *temp) {
    long long t;
    API_ENTER();
    if (!temp) RET(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t rc = temperature_value(device, __func__, sensorType, &t);
    if (rc != NVML_SUCCESS) RET(rc);
    *temp = (unsigned int)t;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetTemperatureV
EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature) {
    long long t;
    API_ENTER();
    if (!temperature) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (temperature->version != NVML_TEMPERATURE_V1) RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    nvmlReturn_t rc = temperature_value(device, __func__, temperature->sensorType, &t);
    if (rc != NVML_SUCCESS) RET(rc);
    temperature->temperature = (int)t;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetPowerUsage
EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    return get_u32(device, __func__, "power_mw", "power", power);
}
#endif

#ifndef OMIT_nvmlDeviceGetTotalEnergyConsumption
EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                        unsigned long long *energy) {
    return get_u64(device, __func__, "energy_mj", "energy", energy);
}
#endif

#ifndef OMIT_nvmlDeviceGetClockInfo
EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, unsigned int type,
                                           unsigned int *clock) {
    static const char *const names[] = {"clock_graphics", "clock_sm", "clock_mem", "clock_video"};
    struct fake_gpu *g;
    unsigned long long v;
    API_ENTER();
    if (type > 3) RET(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__, KEYS(names[type], "clock"), &g, NULL,
                              NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!clock) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!gpu_u64(g, names[type], &v) && !(type == 0 && gpu_u64(g, "clock_sm", &v)))
        RET(NVML_ERROR_NOT_SUPPORTED);
    *clock = (unsigned int)v;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetPcieReplayCounter
EXPORT nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value) {
    return get_u32(device, __func__, "pcie_replay", NULL, value);
}
#endif

#ifndef OMIT_nvmlDeviceGetTotalEccErrors
EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                                unsigned int counterType,
                                                unsigned long long *eccCounts) {
    static const char *const names[2][2] = {{"ecc_vol_corr", "ecc_agg_corr"},
                                            {"ecc_vol_uncorr", "ecc_agg_uncorr"}};
    API_ENTER();
    if (errorType > 1 || counterType > 1) RET(NVML_ERROR_INVALID_ARGUMENT);
    api_leave(NVML_SUCCESS);
    return get_u64(device, __func__, names[errorType][counterType], "ecc", eccCounts);
}
#endif

#ifndef OMIT_nvmlDeviceGetRetiredPagesPendingStatus
EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                           unsigned int *isPending) {
    return get_u32(device, __func__, "retired_pending", NULL, isPending);
}
#endif

#ifndef OMIT_nvmlDeviceGetRemappedRows
EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                              unsigned int *uncRows, unsigned int *isPending,
                                              unsigned int *failureOccurred) {
    struct fake_gpu *g;
    int any = 0;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__,
                              KEYS("remapped_rows", "remap_corr", "remap_unc", "remap_pending",
                                   "remap_failure"),
                              &g, NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int c = (unsigned int)gpu_u64_or(g, "remap_corr", 0, &any);
    unsigned int u = (unsigned int)gpu_u64_or(g, "remap_unc", 0, &any);
    unsigned int p = (unsigned int)gpu_u64_or(g, "remap_pending", 0, &any);
    unsigned int f = (unsigned int)gpu_u64_or(g, "remap_failure", 0, &any);
    if (!any) RET(NVML_ERROR_NOT_SUPPORTED);
    *corrRows = c;
    *uncRows = u;
    *isPending = p;
    *failureOccurred = f;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetCurrentClocksEventReasons
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                           unsigned long long *reasons) {
    return get_u64(device, __func__, "clocks_event_reasons", "clocks_event_reasons", reasons);
}
#endif

#ifndef OMIT_nvmlDeviceGetCurrentClocksThrottleReasons
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                              unsigned long long *reasons) {
    return get_u64(device, __func__, "clocks_event_reasons", "clocks_event_reasons", reasons);
}
#endif

struct fabric_values {
    unsigned char uuid[16];
    nvmlReturn_t status;
    unsigned int clique, state, health_mask, health_summary, max_version;
};

/* Caller holds g_lock. */
static nvmlReturn_t fabric_values(nvmlDevice_t device, const char *fn, struct fabric_values *out) {
    struct fake_gpu *g;
    int any = 0;
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, fn,
                              KEYS("fabric_info", "fabric_state", "fabric_status",
                                   "fabric_health_mask", "fabric_clique_id", "fabric_cluster_uuid",
                                   "fabric_health_summary"),
                              &g, NULL, NULL);
    if (rc != NVML_SUCCESS) return rc;
    memset(out, 0, sizeof(*out));
    const char *uuid = gpu_str(g, "fabric_cluster_uuid");
    if (uuid) {
        any = 1;
        parse_hex16(uuid, out->uuid);
    }
    out->state = (unsigned int)gpu_u64_or(g, "fabric_state", 0, &any);
    long long status = 0;
    if (parse_i64(gpu_str(g, "fabric_status"), &status)) any = 1;
    out->status = (nvmlReturn_t)status;
    out->clique = (unsigned int)gpu_u64_or(g, "fabric_clique_id", 0, &any);
    out->health_mask = (unsigned int)gpu_u64_or(g, "fabric_health_mask", 0, &any);
    out->health_summary = (unsigned int)gpu_u64_or(g, "fabric_health_summary", 0, &any);
    out->max_version = (unsigned int)gpu_u64_or(g, "fabric_max_version", 3, NULL);
    return any ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

#ifndef OMIT_nvmlDeviceGetGpuFabricInfo
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device,
                                               nvmlGpuFabricInfo_t *gpuFabricInfo) {
    struct fabric_values fv;
    API_ENTER();
    nvmlReturn_t rc = fabric_values(device, __func__, &fv);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!gpuFabricInfo) RET(NVML_ERROR_INVALID_ARGUMENT);
    memcpy(gpuFabricInfo->clusterUuid, fv.uuid, 16);
    gpuFabricInfo->status = fv.status;
    gpuFabricInfo->cliqueId = fv.clique;
    gpuFabricInfo->state = fv.state;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetGpuFabricInfoV
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device,
                                                nvmlGpuFabricInfoV_t *gpuFabricInfo) {
    struct fabric_values fv;
    API_ENTER();
    nvmlReturn_t rc = fabric_values(device, __func__, &fv);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!gpuFabricInfo) RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int version = gpuFabricInfo->version;
    if (version != NVML_FABRIC_INFO_V2 && version != NVML_FABRIC_INFO_V3)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (version == NVML_FABRIC_INFO_V3 && fv.max_version < 3)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memcpy(gpuFabricInfo->clusterUuid, fv.uuid, 16);
    gpuFabricInfo->status = fv.status;
    gpuFabricInfo->cliqueId = fv.clique;
    gpuFabricInfo->state = fv.state;
    gpuFabricInfo->healthMask = fv.health_mask;
    if (version == NVML_FABRIC_INFO_V3) gpuFabricInfo->healthSummary = (unsigned char)fv.health_summary;
    RET(NVML_SUCCESS);
}
#endif

/* ------------------------------------------------------------------------ */
/* Events                                                                   */

static int set_valid(const struct fake_event_set *set) {
    for (const struct fake_event_set *s = g_sets; s; s = s->next)
        if (s == set) return 1;
    return 0;
}

#ifndef OMIT_nvmlEventSetCreate
EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    API_ENTER();
    if (!set) RET(NVML_ERROR_INVALID_ARGUMENT);
    struct fake_event_set *s = calloc(1, sizeof(*s));
    if (!s) RET(NVML_ERROR_MEMORY);
    s->magic = HANDLE_MAGIC;
    s->next = g_sets;
    g_sets = s;
    *set = s;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlEventSetFree
EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    API_ENTER();
    if (!set || !set_valid(set)) RET(NVML_ERROR_INVALID_ARGUMENT);
    for (struct fake_event_set **pp = &g_sets; *pp; pp = &(*pp)->next) {
        if (*pp == set) {
            *pp = set->next;
            break;
        }
    }
    set->magic = 0;
    free(set);
    RET(NVML_SUCCESS);
}
#endif

static unsigned long long supported_events(const struct fake_gpu *g) {
    return gpu_u64_or(g, "supported_events", 0x1fULL, NULL);
}

#ifndef OMIT_nvmlDeviceGetSupportedEventTypes
EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                     unsigned long long *eventTypes) {
    struct fake_gpu *g;
    API_ENTER();
    nvmlReturn_t rc =
        resolve(device, ALLOW_GPU, __func__, KEYS("supported_events", "events"), &g, NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!eventTypes) RET(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = supported_events(g);
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceRegisterEvents
EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set) {
    struct fake_gpu *g;
    int gi;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__, KEYS("events"), &g, NULL, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!set || !set_valid(set)) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~supported_events(g)) RET(NVML_ERROR_NOT_SUPPORTED);
    set->mask[gi] |= eventTypes;
    RET(NVML_SUCCESS);
}
#endif

/* Find an XID due on this set; caller holds g_lock. */
static int take_due_event(struct fake_event_set *set, unsigned long long earlier_waits,
                          nvmlEventData_t *data, int with_instance_ids) {
    for (int gi = 0; gi < g_cfg.gpu_count; gi++) {
        if (!(set->mask[gi] & NVML_EVENT_XID_CRITICAL)) continue;
        const struct fake_gpu *g = &g_cfg.gpu[gi];
        for (int k = 0; k < g->nxid; k++) {
            const struct xid_entry *x = &g->xid[k];
            if (x->after > earlier_waits) continue;
            int ordinal = 0;
            for (int p = 0; p < k; p++)
                if (g->xid[p].code == x->code && g->xid[p].after == x->after) ordinal++;
            int seen = 0;
            for (int d = 0; d < set->ndelivered && !seen; d++) {
                const struct delivered *dv = &set->delivered[d];
                seen = dv->gpu == gi && dv->code == x->code && dv->after == x->after &&
                       dv->ordinal == ordinal;
            }
            if (seen) continue;
            if (set->ndelivered < SET_MAX_DELIVERED) {
                struct delivered *dv = &set->delivered[set->ndelivered++];
                dv->gpu = gi;
                dv->code = x->code;
                dv->after = x->after;
                dv->ordinal = ordinal;
            }
            data->device = gpu_handle(gi);
            data->eventType = NVML_EVENT_XID_CRITICAL;
            data->eventData = x->code;
            if (with_instance_ids) {
                data->gpuInstanceId = x->gi;
                data->computeInstanceId = x->ci;
            }
            return 1;
        }
    }
    return 0;
}

static nvmlReturn_t event_wait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms,
                               int with_instance_ids) {
    API_ENTER();
    if (!set || !set_valid(set) || !data) RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long earlier = set->waits++;
    long long deadline = now_ms() + (long long)timeoutms;
    for (;;) {
        if (take_due_event(set, earlier, data, with_instance_ids)) RET(NVML_SUCCESS);
        long long left = deadline - now_ms();
        if (left <= 0) RET(NVML_ERROR_TIMEOUT);
        pthread_mutex_unlock(&g_lock);
        struct timespec ts = {0, (left < 5 ? left : 5) * 1000000L};
        nanosleep(&ts, NULL);
        API_ENTER();
        if (!set_valid(set)) RET(NVML_ERROR_INVALID_ARGUMENT);
    }
}

#ifndef OMIT_nvmlEventSetWait_v2
EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                        unsigned int timeoutms) {
    return event_wait(set, data, timeoutms, 1);
}
#endif

#ifndef OMIT_nvmlEventSetWait
EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data,
                                     unsigned int timeoutms) {
    return event_wait(set, data, timeoutms, 0);
}
#endif

/* ------------------------------------------------------------------------ */
/* Running processes and per-process utilization samples                    */

#define MAX_PROCS 512
#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t; /* v2 and v3 share this layout */

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    unsigned long long timeStamp;
    unsigned int pid;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
    unsigned int jpgUtil;
    unsigned int ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;

typedef struct {
    unsigned int version;
    unsigned int processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_t;

#define NVML_PROCESSES_UTILIZATION_INFO_V1 0x01000018u

_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");
_Static_assert(sizeof(nvmlProcessUtilizationInfo_v1_t) == 40, "process util info v1");
_Static_assert(sizeof(nvmlProcessesUtilizationInfo_t) ==
                   (NVML_PROCESSES_UTILIZATION_INFO_V1 & 0xFFFFFF),
               "processes util info");

struct fake_proc {
    unsigned int pid;
    unsigned long long used;
    unsigned int gi, ci;
};

struct fake_proc_util {
    unsigned int pid;
    unsigned int sm, mem, enc, dec;
    unsigned long long ts; /* 0: the time of the call */
};

struct fake_procs {
    int ncompute, nmps, nutil;
    struct fake_proc compute[MAX_PROCS];
    struct fake_proc mps[MAX_PROCS];
    struct fake_proc_util util[MAX_PROCS];
};

static struct fake_procs g_procs[MAX_GPUS];

static void procs_reset(void) { memset(g_procs, 0, sizeof(g_procs)); }

static int parse_proc(char *rest, struct fake_proc *out) {
    unsigned long long pid, used, gi = INVALID_INSTANCE_ID, ci = INVALID_INSTANCE_ID;
    if (!parse_u64(next_token(&rest), &pid)) return 0;
    char *u = next_token(&rest);
    if (u && strcmp(u, "-") == 0)
        used = NVML_VALUE_NOT_AVAILABLE_ULL;
    else if (!parse_u64(u, &used))
        return 0;
    char *t = next_token(&rest);
    if (t && (!parse_u64(t, &gi) || !parse_u64(next_token(&rest), &ci))) return 0;
    out->pid = (unsigned int)pid;
    out->used = used;
    out->gi = (unsigned int)gi;
    out->ci = (unsigned int)ci;
    return 1;
}

static int parse_proc_util(char *rest, struct fake_proc_util *out) {
    unsigned long long v[6] = {0, 0, 0, 0, 0, 0};
    int n = 0;
    char *t;
    while (n < 6 && (t = next_token(&rest)) != NULL) {
        if (!parse_u64(t, &v[n])) return 0;
        n++;
    }
    if (n < 2) return 0;
    out->pid = (unsigned int)v[0];
    out->sm = (unsigned int)v[1];
    out->mem = (unsigned int)v[2];
    out->enc = (unsigned int)v[3];
    out->dec = (unsigned int)v[4];
    out->ts = v[5];
    return 1;
}

/* 1 when key is a process statement (consumed, valid or not). */
static int procs_parse_gpu_key(int gi, const char *key, char *rest) {
    struct fake_procs *p = &g_procs[gi];
    if (strcmp(key, "process") == 0) {
        if (p->ncompute < MAX_PROCS && parse_proc(rest, &p->compute[p->ncompute])) p->ncompute++;
        return 1;
    }
    if (strcmp(key, "mps_process") == 0) {
        if (p->nmps < MAX_PROCS && parse_proc(rest, &p->mps[p->nmps])) p->nmps++;
        return 1;
    }
    if (strcmp(key, "process_util") == 0) {
        if (p->nutil < MAX_PROCS && parse_proc_util(rest, &p->util[p->nutil])) p->nutil++;
        return 1;
    }
    return 0;
}

static unsigned long long now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
}

/* The list calls: NVML's two-call protocol (count with a NULL array first). */
static nvmlReturn_t process_list(nvmlDevice_t device, const char *fn, int mps,
                                 unsigned int *count, nvmlProcessInfo_t *infos) {
    int gi;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, fn, KEYS("processes"), NULL, NULL, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!count) RET(NVML_ERROR_INVALID_ARGUMENT);
    const struct fake_procs *p = &g_procs[gi];
    int n = mps ? p->nmps : p->ncompute;
    const struct fake_proc *src = mps ? p->mps : p->compute;
    if (*count < (unsigned int)n || (n > 0 && !infos)) {
        *count = (unsigned int)n;
        RET(n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (int i = 0; i < n; i++) {
        infos[i].pid = src[i].pid;
        infos[i].usedGpuMemory = src[i].used;
        infos[i].gpuInstanceId = src[i].gi;
        infos[i].computeInstanceId = src[i].ci;
    }
    *count = (unsigned int)n;
    RET(NVML_SUCCESS);
}

#ifndef OMIT_nvmlDeviceGetComputeRunningProcesses_v3
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos) {
    return process_list(device, __func__, 0, infoCount, infos);
}
#endif

#ifndef OMIT_nvmlDeviceGetMPSComputeRunningProcesses_v3
EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device,
                                                               unsigned int *infoCount,
                                                               nvmlProcessInfo_t *infos) {
    return process_list(device, __func__, 1, infoCount, infos);
}
#endif

/* Samples newer than last_seen, their timestamps filled in.  Caller holds g_lock. */
static int due_samples(int gi, unsigned long long last_seen, struct fake_proc_util *out) {
    const struct fake_procs *p = &g_procs[gi];
    unsigned long long now = now_us();
    int n = 0;
    for (int i = 0; i < p->nutil; i++) {
        struct fake_proc_util s = p->util[i];
        if (!s.ts) s.ts = now;
        if (s.ts > last_seen) out[n++] = s;
    }
    return n;
}

#ifndef OMIT_nvmlDeviceGetProcessUtilization
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                    nvmlProcessUtilizationSample_t *utilization,
                                                    unsigned int *processSamplesCount,
                                                    unsigned long long lastSeenTimeStamp) {
    static struct fake_proc_util due[MAX_PROCS];
    int gi;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__, KEYS("process_util"), NULL, NULL, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!processSamplesCount) RET(NVML_ERROR_INVALID_ARGUMENT);
    int n = due_samples(gi, lastSeenTimeStamp, due);
    if (n == 0) RET(NVML_ERROR_NOT_FOUND);
    if (!utilization || *processSamplesCount < (unsigned int)n) {
        *processSamplesCount = (unsigned int)n;
        RET(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (int i = 0; i < n; i++) {
        utilization[i].pid = due[i].pid;
        utilization[i].timeStamp = due[i].ts;
        utilization[i].smUtil = due[i].sm;
        utilization[i].memUtil = due[i].mem;
        utilization[i].encUtil = due[i].enc;
        utilization[i].decUtil = due[i].dec;
    }
    *processSamplesCount = (unsigned int)n;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetProcessesUtilizationInfo
EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                          nvmlProcessesUtilizationInfo_t *info) {
    static struct fake_proc_util due[MAX_PROCS];
    int gi;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__, KEYS("process_util"), NULL, NULL, &gi);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!info) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (info->version != NVML_PROCESSES_UTILIZATION_INFO_V1)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    int n = due_samples(gi, info->lastSeenTimeStamp, due);
    if (n == 0) RET(NVML_ERROR_NOT_FOUND);
    if (!info->procUtilArray || info->processSamplesCount < (unsigned int)n) {
        info->processSamplesCount = (unsigned int)n;
        RET(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (int i = 0; i < n; i++) {
        nvmlProcessUtilizationInfo_v1_t *o = &info->procUtilArray[i];
        memset(o, 0, sizeof(*o));
        o->timeStamp = due[i].ts;
        o->pid = due[i].pid;
        o->smUtil = due[i].sm;
        o->memUtil = due[i].mem;
        o->encUtil = due[i].enc;
        o->decUtil = due[i].dec;
    }
    info->processSamplesCount = (unsigned int)n;
    RET(NVML_SUCCESS);
}
#endif

/* ======================================================================== */
/* Link health: PCIe link training and NVLink                               */
/*                                                                          */
/* GPU keys (each getter NOT_SUPPORTED while its key is unset):             */
/*   pcie_gen, pcie_max_gen, pcie_gpu_max_gen    link generation (1..6)     */
/*   pcie_width, pcie_max_width                  lanes (1..16)              */
/*   nvlink_links <n>    links 0..n-1 exist; a link >= n is                 */
/*                       INVALID_ARGUMENT; unset: NVLink NOT_SUPPORTED      */
/*   nvlink_down <mask>  bit l set: link l is inactive                      */
/*   nvlink_replay, nvlink_recovery, nvlink_crc_flit, nvlink_crc_data       */
/*                       comma lists, the counter of link l at position l   */
/*                       (missing positions read 0); an unset list makes   */
/*                       that counter NOT_SUPPORTED                        */
/* Error and block keys: the function name, the key, or the group "pcie"   */
/* (PCIe getters) or "nvlink" (NVLink getters).                             */
/* Rewriting the file changes any of them for the next call.               */

#ifndef OMIT_nvmlDeviceGetCurrPcieLinkGeneration
EXPORT nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen) {
    return get_u32(device, __func__, "pcie_gen", "pcie", gen);
}
#endif

#ifndef OMIT_nvmlDeviceGetMaxPcieLinkGeneration
EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen) {
    return get_u32(device, __func__, "pcie_max_gen", "pcie", gen);
}
#endif

#ifndef OMIT_nvmlDeviceGetGpuMaxPcieLinkGeneration
EXPORT nvmlReturn_t nvmlDeviceGetGpuMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen) {
    return get_u32(device, __func__, "pcie_gpu_max_gen", "pcie", gen);
}
#endif

#ifndef OMIT_nvmlDeviceGetCurrPcieLinkWidth
EXPORT nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *width) {
    return get_u32(device, __func__, "pcie_width", "pcie", width);
}
#endif

#ifndef OMIT_nvmlDeviceGetMaxPcieLinkWidth
EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *width) {
    return get_u32(device, __func__, "pcie_max_width", "pcie", width);
}
#endif

#define NVLINK_MAX 18

/* The link-th number of a comma list; 0 when the list is shorter. */
static unsigned long long list_item(const char *list, unsigned int link) {
    unsigned int i = 0;
    const char *p = list;
    while (i < link && p) {
        p = strchr(p, ',');
        if (p) p++;
        i++;
    }
    if (!p) return 0;
    return strtoull(p, NULL, 0);
}

/* Resolve an NVLink call: the GPU and whether `link` exists. Caller holds g_lock. */
static nvmlReturn_t nvlink_resolve(nvmlDevice_t device, const char *fn, const char *key,
                                   unsigned int link, struct fake_gpu **gp) {
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, fn, KEYS(key, "nvlink"), gp, NULL, NULL);
    if (rc != NVML_SUCCESS) return rc;
    unsigned long long links;
    if (!gpu_u64(*gp, "nvlink_links", &links) || links == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= links || link >= NVLINK_MAX) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

#ifndef OMIT_nvmlDeviceGetNvLinkState
EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                             unsigned int *isActive) {
    struct fake_gpu *g;
    API_ENTER();
    nvmlReturn_t rc = nvlink_resolve(device, __func__, "nvlink_down", link, &g);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!isActive) RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long down = gpu_u64_or(g, "nvlink_down", 0, NULL);
    *isActive = (down >> link) & 1ULL ? 0u : 1u;
    RET(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetNvLinkErrorCounter
EXPORT nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link,
                                                    unsigned int counter,
                                                    unsigned long long *value) {
    /* NVML_NVLINK_ERROR_DL_REPLAY, _RECOVERY, _CRC_FLIT, _CRC_DATA */
    static const char *const names[4] = {"nvlink_replay", "nvlink_recovery", "nvlink_crc_flit",
                                         "nvlink_crc_data"};
    struct fake_gpu *g;
    API_ENTER();
    if (counter > 3) RET(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t rc = nvlink_resolve(device, __func__, names[counter], link, &g);
    if (rc != NVML_SUCCESS) RET(rc);
    if (!value) RET(NVML_ERROR_INVALID_ARGUMENT);
    const char *list = gpu_str(g, names[counter]);
    if (!list) RET(NVML_ERROR_NOT_SUPPORTED);
    *value = list_item(list, link);
    RET(NVML_SUCCESS);
}
#endif

/* ======================================================================== */
/* Field values (nvmlDeviceGetFieldValues)                                  */
/*                                                                          */
/* "gpu <i> field <id>[:<scope>] <value>" sets a field (FakeGpu.fields; its  */
/* recovery_action is field 230); a scoped statement wins over the unscoped */
/* one for its scope.  Field 230 (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: 0    */
/* none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset) reads  */
/* as an unsigned int, as drivers give it; any other field as an unsigned   */
/* long long.  An entry not set has its nvmlReturn at                      */
/* NVML_ERROR_NOT_SUPPORTED while the call itself succeeds, as drivers do.  */
/* Error keys: the function name or the group "field_values" fail the whole */
/* call; "field.<id>" or "field.<id>.<scope>" fail only that entry (its     */
/* nvmlReturn).  Block keys: the function name or "field_values".           */

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    unsigned int valueType; /* NVML_VALUE_TYPE_*: 1 unsigned int, 3 unsigned long long */
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

#define FIELD_RECOVERY_ACTION 230u
#define VALUE_TYPE_UNSIGNED_INT 1u
#define VALUE_TYPE_UNSIGNED_LONG_LONG 3u

#ifndef OMIT_nvmlDeviceGetFieldValues
EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                             nvmlFieldValue_t *values) {
    struct fake_gpu *g;
    API_ENTER();
    nvmlReturn_t rc = resolve(device, ALLOW_GPU, __func__, KEYS("field_values"), &g, NULL, NULL);
    if (rc != NVML_SUCCESS) RET(rc);
    if (valuesCount < 0 || (valuesCount > 0 && !values)) RET(NVML_ERROR_INVALID_ARGUMENT);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long now_us = (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000LL;
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *f = &values[i];
        char scoped[KEY_LEN], plain[KEY_LEN];
        snprintf(scoped, sizeof scoped, "field.%u.%u", f->fieldId, f->scopeId);
        snprintf(plain, sizeof plain, "field.%u", f->fieldId);
        unsigned long long v;
        f->timestamp = now_us;
        f->latencyUsec = 0;
        memset(&f->value, 0, sizeof(f->value));
        f->nvmlReturn = find_error(g->err, g->nerr, NULL, KEYS(scoped, plain));
        if (f->nvmlReturn != NVML_SUCCESS) continue;
        if (!gpu_u64(g, scoped, &v) && !gpu_u64(g, plain, &v)) {
            f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        } else if (f->fieldId == FIELD_RECOVERY_ACTION) {
            f->valueType = VALUE_TYPE_UNSIGNED_INT;
            f->value.uiVal = (unsigned int)v;
        } else {
            f->valueType = VALUE_TYPE_UNSIGNED_LONG_LONG;
            f->value.ullVal = v;
        }
    }
    RET(NVML_SUCCESS);
}
#endif
