/*
 * fakenvml.c - a fake libnvidia-ml.so.1 for gpuguard's tests.
 *
 * It implements the small part of NVML that gpuguard uses, with NVML's real
 * signatures, return codes and struct layouts, so the real pynvml module can
 * load it with CDLL("libnvidia-ml.so.1").  What the "GPUs" report comes from
 * a text file named by $FAKE_NVML_STATE, which tests may edit at any time;
 * the format and the exact semantics are documented in README.md next to
 * this file (that document is the contract, keep them in sync).
 *
 * Concurrency model: one global mutex protects all state.  Every entry point
 * takes it, re-checks the state file (cheap: one stat() plus one
 * non-blocking read() of an inotify fd) and answers.  The only call that
 * blocks, nvmlEventSetWait, drops the mutex while it sleeps in poll().
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* NVML types: NVIDIA's nvml.h (package nvidia-nvml-dev), built with        */
/* NVML_NO_UNVERSIONED_FUNC_DEFS so the legacy names are real functions.    */
/* -Wmissing-prototypes: every exported function must be declared there,    */
/* and the compiler rejects any definition that differs from its prototype. */
/* ------------------------------------------------------------------------ */

#include <nvml.h>

/* Opaque handles.  Device handles point into a static array, so they stay
 * valid (and comparable) for the life of the process. */
struct nvmlDevice_st {
    unsigned int index;
};

/* The layout the legacy nvmlDeviceGetPciInfo and _v2 wrote (pynvml.nvmlPciInfo_v2_t):
 * nvml.h declares them with nvmlPciInfo_t, the library fills the old 16-byte busId form. */
typedef struct {
    char busId[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0, reserved1, reserved2, reserved3;
} legacy_pci_info_t;

/* The legacy nvmlEventSetWait (v1) wrote only the first three fields of nvmlEventData_t. */
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
} legacy_event_data_t;

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(legacy_pci_info_t) == 52, "nvmlPciInfo_v2_t layout");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout");
_Static_assert(offsetof(nvmlFieldValue_t, value) == 32, "nvmlFieldValue_t layout");
_Static_assert(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION == 230, "recovery action field id");
_Static_assert(nvmlEventTypeGpuRecoveryAction == 0x8000, "recovery action event type");
_Static_assert(offsetof(nvmlEventData_t, gpuInstanceId) == 24, "nvmlEventData_t layout");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t layout");

/* ------------------------------------------------------------------------ */
/* Constants of the fake.                                                   */
/* ------------------------------------------------------------------------ */

#define MAX_GPUS 1024 /* more than any node has: benchmarks go to 256 */
#define UUID_BUF 96   /* NVML_DEVICE_UUID_V2_BUFFER_SIZE */
#define NAME_BUF 96   /* NVML_DEVICE_NAME_V2_BUFFER_SIZE */
#define DRIVER_BUF 80 /* NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE */
#define DEFAULT_DRIVER "550.54.15"
#define DEFAULT_NAME "NVIDIA Fake GPU"
#define MAX_STATE_BYTES (1 << 20)
#define FIRST_PCI_BUS 0x3B
#define PCI_DEVICE_ID 0x233010DEu    /* H100 80GB HBM3, vendor 0x10DE */
#define PCI_SUBSYSTEM_ID 0x16C110DEu
#define NO_INSTANCE 0xFFFFFFFFu      /* gpuInstanceId/computeInstanceId: not MIG */
#define FALLBACK_POLL_MS 5           /* wait granularity when inotify is unavailable */
#define WATCH_MASK (IN_CLOSE_WRITE | IN_MOVED_TO | IN_MODIFY | IN_CREATE | IN_DELETE | \
                    IN_MOVED_FROM | IN_ATTRIB)

/* Event types the fake claims to support; Xid, double-bit ECC and recovery-action events are produced. */
#define SUPPORTED_EVENTS (nvmlEventTypeXidCriticalError | nvmlEventTypePState | nvmlEventTypeClock)
#define MAX_FAIL_RULES 64
#define MAX_HANG_RULES 64
#define HANG_POLL_MS 5               /* how often a hung call looks whether its `hang` line is gone */
#define ECC_EVENTS (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError)

static const struct {
    const char *name; /* NVML_ERROR_<name>, as used in the state file */
    nvmlReturn_t code;
    const char *text; /* nvmlErrorString(); strings of the real library where known */
} k_errors[] = {
    {"SUCCESS", NVML_SUCCESS, "Success"},
    {"UNINITIALIZED", NVML_ERROR_UNINITIALIZED, "Uninitialized"},
    {"INVALID_ARGUMENT", NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument"},
    {"NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED, "Not Supported"},
    {"NO_PERMISSION", NVML_ERROR_NO_PERMISSION, "Insufficient Permissions"},
    {"ALREADY_INITIALIZED", NVML_ERROR_ALREADY_INITIALIZED, "Already Initialized"},
    {"NOT_FOUND", NVML_ERROR_NOT_FOUND, "Not Found"},
    {"INSUFFICIENT_SIZE", NVML_ERROR_INSUFFICIENT_SIZE, "Insufficient Size"},
    {"INSUFFICIENT_POWER", NVML_ERROR_INSUFFICIENT_POWER, "Insufficient External Power"},
    {"DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"},
    {"TIMEOUT", NVML_ERROR_TIMEOUT, "Timeout"},
    {"IRQ_ISSUE", NVML_ERROR_IRQ_ISSUE, "Interrupt Request Issue"},
    {"LIBRARY_NOT_FOUND", NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"},
    {"FUNCTION_NOT_FOUND", NVML_ERROR_FUNCTION_NOT_FOUND, "Function Not Found"},
    {"CORRUPTED_INFOROM", NVML_ERROR_CORRUPTED_INFOROM, "Corrupted infoROM"},
    {"GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST, "GPU is lost"},
    {"RESET_REQUIRED", NVML_ERROR_RESET_REQUIRED, "GPU requires reset"},
    {"OPERATING_SYSTEM", NVML_ERROR_OPERATING_SYSTEM, "GPU access blocked by the operating system"},
    {"LIB_RM_VERSION_MISMATCH", NVML_ERROR_LIB_RM_VERSION_MISMATCH, "Driver/library version mismatch"},
    {"IN_USE", NVML_ERROR_IN_USE, "In use by another client"},
    {"MEMORY", NVML_ERROR_MEMORY, "Insufficient Memory"},
    {"NO_DATA", NVML_ERROR_NO_DATA, "No data"},
    {"VGPU_ECC_NOT_SUPPORTED", NVML_ERROR_VGPU_ECC_NOT_SUPPORTED,
     "The requested vgpu operation is not available on target device, because ECC is enabled"},
    {"INSUFFICIENT_RESOURCES", NVML_ERROR_INSUFFICIENT_RESOURCES, "Insufficient Resources"},
    {"FREQ_NOT_SUPPORTED", NVML_ERROR_FREQ_NOT_SUPPORTED, "The requested frequency is not supported"},
    {"ARGUMENT_VERSION_MISMATCH", NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
     "The provided version is invalid/unsupported"},
    {"DEPRECATED", NVML_ERROR_DEPRECATED, "The requested functionality has been deprecated"},
    {"NOT_READY", NVML_ERROR_NOT_READY, "The system is not ready for the request"},
    {"GPU_NOT_FOUND", NVML_ERROR_GPU_NOT_FOUND, "The GPU was not found"},
    {"INVALID_STATE", NVML_ERROR_INVALID_STATE, "The GPU is in an invalid state"},
    {"RESET_TYPE_NOT_SUPPORTED", NVML_ERROR_RESET_TYPE_NOT_SUPPORTED,
     "The requested reset type is not supported"},
    {"UNKNOWN", NVML_ERROR_UNKNOWN, "Unknown Error"},
};
#define N_ERRORS (sizeof(k_errors) / sizeof(k_errors[0]))

/* ------------------------------------------------------------------------ */
/* Parsed state file.                                                       */
/* ------------------------------------------------------------------------ */

struct gpu_cfg {
    bool present;
    char uuid[UUID_BUF];
    char name[NAME_BUF];
    unsigned long long ecc; /* uncorrected ECC errors (volatile == aggregate) */
    bool ecc_supported;
    bool ecc_enabled;        /* ECC supported but switched off: mode DISABLED, counts N/A */
    bool remap_supported;    /* 0: nvmlDeviceGetRemappedRows NOT_SUPPORTED (pre-Ampere, some vGPU) */
    bool recovery_supported; /* 0: field 230 and its event NOT_SUPPORTED (drivers before R565) */
    unsigned int recovery_action; /* NVML_FI_DEV_GET_GPU_RECOVERY_ACTION */
    bool lost;
    bool remap_failure;
    bool remap_pending;
    unsigned int remap_corr;
    unsigned int remap_unc;
    bool retired_supported;    /* 1: page retirement (pre-Ampere); 0: NOT_SUPPORTED (the default) */
    unsigned int retired_sbe;  /* pages retired for multiple single-bit errors */
    unsigned int retired_dbe;  /* pages retired for a double-bit error */
    bool retired_pending;      /* nvmlDeviceGetRetiredPagesPendingStatus */
    /* Issue 29's signals. */
    bool fabric_supported;          /* 0: nvmlDeviceGetGpuFabricInfoV NOT_SUPPORTED (the default) */
    unsigned int fabric_state;      /* NVML_GPU_FABRIC_STATE_* */
    nvmlReturn_t fabric_status;     /* the registration's status */
    unsigned int fabric_health;     /* healthMask */
    unsigned int nvlink_links;      /* 0: no NVLink (NvLinkState and its fields NOT_SUPPORTED) */
    unsigned long long nvlink_down; /* bit n: link n inactive */
    unsigned long long nvlink_crc, nvlink_replay, nvlink_recovery; /* *_ERROR_COUNT_TOTAL */
    unsigned int pcie_width, pcie_max_width, pcie_gen, pcie_max_gen;
    unsigned long long pcie_replays; /* NVML_FI_DEV_PCIE_REPLAY_COUNTER */
    unsigned long long clock_events; /* nvmlDeviceGetCurrentClocksEventReasons */
    bool inforom_valid;              /* 0: nvmlDeviceValidateInforom answers CORRUPTED_INFOROM */
    unsigned int processes;          /* compute processes running on the GPU (pids 1000 + i) */
    nvmlReturn_t error; /* NVML_SUCCESS: no injected error */
    unsigned int line;  /* where it was defined, for diagnostics */
    size_t text_off, text_len;
};

struct xid_line {
    unsigned int gpu;
    unsigned long long code;
    unsigned int gi, ci; /* MIG GPU / compute instance, NO_INSTANCE when not given */
    unsigned int line;
    size_t text_off, text_len;
};

struct config {
    char driver[DRIVER_BUF];
    nvmlReturn_t init_error; /* NVML_SUCCESS: nvmlInit works */
    unsigned int ngpu;
    struct gpu_cfg gpu[MAX_GPUS];
    size_t nxid;
    struct xid_line *xid;
    unsigned int nfail;
    struct fail_rule {
        char fn[48];       /* NVML function, without a _vN suffix */
        nvmlReturn_t code;
        int gpu;           /* -1: any */
        long long count;   /* calls that fail; -1: every call */
        unsigned long sig; /* hash of the line: a rewritten file keeps the rule's progress */
    } fail[MAX_FAIL_RULES];
    unsigned int nhang;
    struct hang_rule {
        char fn[48]; /* NVML function, without a _vN suffix */
        int gpu;     /* -1: any */
    } hang[MAX_HANG_RULES];
};

/* Identity of one version of the state file, to notice edits cheaply. */
struct file_id {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime, ctime;
};

/* Queued Xid events. */
struct event {
    struct event *next;
    unsigned int gpu;
    unsigned long long type; /* Xid, double-bit ECC or recovery action (nvmlEventType*) */
    unsigned long long code; /* eventData: the Xid; 0 for other events (nvml.h) */
    unsigned int gi, ci;
};
struct event_queue {
    struct event *head, *tail;
};

struct nvmlEventSet_st {
    struct nvmlEventSet_st *next;       /* in g_sets while the set is live */
    unsigned long long mask[MAX_GPUS];  /* registered event types per GPU */
    struct event_queue queue;
    int ino_fd;    /* this set's own inotify instance: only its waiters drain it,
                      so a change can never be consumed by another thread */
    unsigned int busy; /* threads inside nvmlEventSetWait on this set */
    bool freed;    /* unlinked by nvmlEventSetFree or the final nvmlShutdown */
    bool broken;   /* a registration failed with UNKNOWN: "undefined state" (nvml.h) */
};

/* ------------------------------------------------------------------------ */
/* Global state, all protected by g_mu.                                     */
/* ------------------------------------------------------------------------ */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned int g_refcount;          /* nvmlInit calls minus nvmlShutdown calls */
static char *g_path, *g_dir, *g_base;    /* the state file, split for inotify */
static struct config *g_cfg;             /* last good state (NULL: none yet) */
static struct file_id g_seen;            /* version last read */
static bool g_seen_valid;
static struct file_id g_bad;             /* version whose error was already printed */
static bool g_bad_valid;
static bool g_missing_warned;
static size_t g_xid_seen;                /* xid lines already turned into events */
static int g_ino_fd = -1;                /* tells refresh() the file was written */
static long long g_fail_used[MAX_FAIL_RULES]; /* calls each fail rule has failed */
static unsigned long g_fail_sig[MAX_FAIL_RULES];
static struct nvmlEventSet_st *g_sets;   /* live event sets */
static struct nvmlDevice_st g_dev[MAX_GPUS];

/* ------------------------------------------------------------------------ */
/* Small helpers.                                                           */
/* ------------------------------------------------------------------------ */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static const char *error_text(nvmlReturn_t code)
{
    for (size_t i = 0; i < N_ERRORS; i++)
        if (k_errors[i].code == code)
            return k_errors[i].text;
    return "Unknown Error";
}

static bool error_by_name(const char *name, nvmlReturn_t *out)
{
    for (size_t i = 0; i < N_ERRORS; i++) {
        if (strcmp(k_errors[i].name, name) == 0) {
            *out = k_errors[i].code;
            return true;
        }
    }
    return false;
}

static struct file_id file_id_of(const struct stat *st)
{
    struct file_id id = {st->st_dev, st->st_ino, st->st_size, st->st_mtim, st->st_ctim};
    return id;
}

static bool same_file_id(const struct file_id *a, const struct file_id *b)
{
    return a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
           a->mtime.tv_sec == b->mtime.tv_sec && a->mtime.tv_nsec == b->mtime.tv_nsec &&
           a->ctime.tv_sec == b->ctime.tv_sec && a->ctime.tv_nsec == b->ctime.tv_nsec;
}

/* Copies src into a caller's buffer the way NVML does. */
static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src)
{
    size_t n = strlen(src);
    if (n + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

static bool queue_push(struct event_queue *q, const struct event *ev)
{
    struct event *e = malloc(sizeof(*e));
    if (!e) {
        fprintf(stderr, "fakenvml: out of memory, dropping event %llu for gpu %u\n", ev->code,
                ev->gpu);
        return false;
    }
    *e = *ev;
    e->next = NULL;
    if (q->tail)
        q->tail->next = e;
    else
        q->head = e;
    q->tail = e;
    return true;
}

static void queue_clear(struct event_queue *q)
{
    while (q->head) {
        struct event *e = q->head;
        q->head = e->next;
        free(e);
    }
    q->tail = NULL;
}

static void config_free(struct config *c)
{
    if (c) {
        free(c->xid);
        free(c);
    }
}

/* ------------------------------------------------------------------------ */
/* State file parser.                                                       */
/* ------------------------------------------------------------------------ */

struct parse_error {
    unsigned int line;
    size_t text_off, text_len;
    char msg[200];
};

__attribute__((format(printf, 5, 6))) static bool
parse_fail(struct parse_error *e, unsigned int line, size_t off, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
    va_end(ap);
    e->line = line;
    e->text_off = off;
    e->text_len = len;
    return false;
}

/* Decimal only, no sign, no overflow. */
static bool parse_uint(const char *s, unsigned long long max, unsigned long long *out)
{
    unsigned long long v = 0;
    if (*s == '\0')
        return false;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return false;
        unsigned int d = (unsigned int)(*s - '0');
        if (v > (max - d) / 10)
            return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

/*
 * Splits a line into whitespace-separated tokens in place.  '#' outside
 * double quotes starts a comment; double quotes group text containing blanks
 * (name="NVIDIA H100 80GB HBM3") and are removed.  Returns the token count,
 * or -1 with *why set.
 */
static int tokenize(char *s, char **tok, int max, const char **why)
{
    int n = 0;
    char *r = s;
    for (;;) {
        while (*r == ' ' || *r == '\t')
            r++;
        if (*r == '\0' || *r == '#')
            return n;
        if (n == max) {
            *why = "too many fields";
            return -1;
        }
        char *w = r;
        bool quoted = false;
        tok[n++] = w;
        for (;;) {
            char c = *r;
            if (c == '\0') {
                if (quoted) {
                    *why = "unterminated quote";
                    return -1;
                }
                break;
            }
            if (!quoted && (c == ' ' || c == '\t' || c == '#'))
                break;
            r++;
            if (c == '"')
                quoted = !quoted;
            else
                *w++ = c;
        }
        char stop = *r; /* read before the NUL below may overwrite it */
        *w = '\0';
        if (stop == '\0' || stop == '#')
            return n;
        r++;
    }
}

static bool parse_bool(const char *v, bool *out)
{
    if (strcmp(v, "0") == 0 || strcmp(v, "1") == 0) {
        *out = v[0] == '1';
        return true;
    }
    return false;
}

/* "3,4,17" -> bits 3, 4 and 17; "none" -> 0. Links are < NVML_NVLINK_MAX_LINKS. */
static bool parse_links(const char *v, unsigned long long *out)
{
    unsigned long long mask = 0;
    if (strcmp(v, "none") != 0) {
        char buf[256];
        if (strlen(v) >= sizeof(buf))
            return false;
        memcpy(buf, v, strlen(v) + 1);
        char *save = NULL;
        for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            unsigned long long n;
            if (!parse_uint(t, NVML_NVLINK_MAX_LINKS - 1, &n))
                return false;
            mask |= 1ull << n;
        }
    }
    *out = mask;
    return true;
}

static void gpu_defaults(struct gpu_cfg *g, unsigned int index)
{
    memset(g, 0, sizeof(*g));
    /* Shaped like a real UUID (GPU-8-4-4-4-12, 40 chars) but obviously fake. */
    snprintf(g->uuid, sizeof(g->uuid), "GPU-00000000-fake-0000-0000-%012u", index);
    snprintf(g->name, sizeof(g->name), "%s", DEFAULT_NAME);
    g->ecc_supported = true;
    g->ecc_enabled = true;
    g->remap_supported = true;
    g->recovery_supported = true;
    g->recovery_action = NVML_GPU_RECOVERY_ACTION_NONE;
    g->fabric_status = NVML_SUCCESS;
    g->pcie_width = g->pcie_max_width = 16;
    g->pcie_gen = g->pcie_max_gen = 4;
    g->inforom_valid = true;
    g->error = NVML_SUCCESS;
}

/* One "key=value" of a gpu line. */
static bool parse_gpu_key(struct gpu_cfg *g, char *kv, unsigned long long *seen, const char **why,
                          char *whybuf, size_t whylen)
{
    static const char *const keys[] = {"uuid", "name", "ecc", "ecc_supported", "lost",
                                       "remap_failure", "remap_pending", "remap_corr",
                                       "remap_unc", "error", "ecc_enabled", "remap_supported",
                                       "recovery_supported", "recovery_action", "retired_supported",
                                       "retired_sbe", "retired_dbe", "retired_pending",
                                       "fabric_state", "fabric_status", "fabric_health",
                                       "nvlink_links", "nvlink_down", "nvlink_crc", "nvlink_replay",
                                       "nvlink_recovery", "pcie_width", "pcie_max_width", "pcie_gen",
                                       "pcie_max_gen", "pcie_replays", "clock_events", "inforom_valid",
                                       "processes"};
    char *eq = strchr(kv, '=');
    if (!eq) {
        snprintf(whybuf, whylen, "expected key=value, got '%s'", kv);
        *why = whybuf;
        return false;
    }
    *eq = '\0';
    const char *key = kv, *val = eq + 1;
    size_t k;
    for (k = 0; k < sizeof(keys) / sizeof(keys[0]); k++)
        if (strcmp(key, keys[k]) == 0)
            break;
    if (k == sizeof(keys) / sizeof(keys[0])) {
        snprintf(whybuf, whylen, "unknown key '%s'", key);
        *why = whybuf;
        return false;
    }
    if (*seen & (1ull << k)) {
        snprintf(whybuf, whylen, "duplicate key '%s'", key);
        *why = whybuf;
        return false;
    }
    *seen |= 1ull << k;
    if (*val == '\0') {
        snprintf(whybuf, whylen, "empty value for '%s'", key);
        *why = whybuf;
        return false;
    }

    unsigned long long n;
    bool ok = true;
    switch (k) {
    case 0: /* uuid */
        ok = strlen(val) < sizeof(g->uuid);
        if (ok)
            memcpy(g->uuid, val, strlen(val) + 1);
        break;
    case 1: /* name */
        ok = strlen(val) < sizeof(g->name);
        if (ok)
            memcpy(g->name, val, strlen(val) + 1);
        break;
    case 2:
        ok = parse_uint(val, ULLONG_MAX, &g->ecc);
        break;
    case 3:
        ok = parse_bool(val, &g->ecc_supported);
        break;
    case 4:
        ok = parse_bool(val, &g->lost);
        break;
    case 5:
        ok = parse_bool(val, &g->remap_failure);
        break;
    case 6:
        ok = parse_bool(val, &g->remap_pending);
        break;
    case 7:
    case 8:
        ok = parse_uint(val, UINT_MAX, &n);
        if (ok)
            *(k == 7 ? &g->remap_corr : &g->remap_unc) = (unsigned int)n;
        break;
    case 9:
        ok = error_by_name(val, &g->error) && g->error != NVML_SUCCESS;
        if (!ok) {
            snprintf(whybuf, whylen, "unknown error name '%s'", val);
            *why = whybuf;
            return false;
        }
        break;
    case 10:
        ok = parse_bool(val, &g->ecc_enabled);
        break;
    case 11:
        ok = parse_bool(val, &g->remap_supported);
        break;
    case 12:
        ok = parse_bool(val, &g->recovery_supported);
        break;
    case 13:
        ok = parse_uint(val, UINT_MAX, &n);
        if (ok)
            g->recovery_action = (unsigned int)n;
        break;
    case 14:
        ok = parse_bool(val, &g->retired_supported);
        break;
    case 15:
    case 16:
        ok = parse_uint(val, 4096, &n);
        if (ok)
            *(k == 15 ? &g->retired_sbe : &g->retired_dbe) = (unsigned int)n;
        break;
    case 17:
        ok = parse_bool(val, &g->retired_pending);
        break;
    case 18: /* fabric_state: 0..3, and the call answers */
        ok = parse_uint(val, NVML_GPU_FABRIC_STATE_COMPLETED, &n);
        if (ok) {
            g->fabric_state = (unsigned int)n;
            g->fabric_supported = true;
        }
        break;
    case 19: /* fabric_status: an error name, or SUCCESS */
        if (strcmp(val, "SUCCESS") == 0)
            g->fabric_status = NVML_SUCCESS;
        else
            ok = error_by_name(val, &g->fabric_status);
        g->fabric_supported = true;
        break;
    case 20:
        ok = parse_uint(val, UINT_MAX, &n);
        if (ok) {
            g->fabric_health = (unsigned int)n;
            g->fabric_supported = true;
        }
        break;
    case 21:
        ok = parse_uint(val, NVML_NVLINK_MAX_LINKS, &n);
        if (ok)
            g->nvlink_links = (unsigned int)n;
        break;
    case 22: /* nvlink_down: comma-separated link numbers, or "none" */
        ok = parse_links(val, &g->nvlink_down);
        break;
    case 23:
        ok = parse_uint(val, ULLONG_MAX, &g->nvlink_crc);
        break;
    case 24:
        ok = parse_uint(val, ULLONG_MAX, &g->nvlink_replay);
        break;
    case 25:
        ok = parse_uint(val, ULLONG_MAX, &g->nvlink_recovery);
        break;
    case 26:
    case 27:
    case 28:
    case 29:
        ok = parse_uint(val, 64, &n);
        if (ok) {
            unsigned int *slot[] = {&g->pcie_width, &g->pcie_max_width, &g->pcie_gen, &g->pcie_max_gen};
            *slot[k - 26] = (unsigned int)n;
        }
        break;
    case 30:
        ok = parse_uint(val, ULLONG_MAX, &g->pcie_replays);
        break;
    case 31:
        ok = parse_uint(val, ULLONG_MAX, &g->clock_events);
        break;
    case 32:
        ok = parse_bool(val, &g->inforom_valid);
        break;
    case 33:
        ok = parse_uint(val, 64, &n);
        if (ok)
            g->processes = (unsigned int)n;
        break;
    }
    if (!ok) {
        snprintf(whybuf, whylen, "bad value '%s' for '%s'", val, key);
        *why = whybuf;
    }
    return ok;
}

/* The calls a `fail` line may name (the base name: _v2/_v3 variants included). */
static const char *const k_fail_functions[] = {
    "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo", "nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows", "nvmlDeviceGetFieldValues", "nvmlDeviceGetSupportedEventTypes",
    "nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait",
    "nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceValidateInforom",
};

static bool fail_function_known(const char *fn)
{
    for (size_t i = 0; i < sizeof(k_fail_functions) / sizeof(k_fail_functions[0]); i++)
        if (strcmp(fn, k_fail_functions[i]) == 0)
            return true;
    return false;
}

static bool hang_function_known(const char *fn)
{
    return fail_function_known(fn) || strcmp(fn, "nvmlInit") == 0;
}

/* Whether a `hang` line names this call (caller holds g_mu). */
static bool hang_matches_locked(const char *fn, int gpu)
{
    if (!g_cfg)
        return false;
    for (unsigned int i = 0; i < g_cfg->nhang; i++) {
        const struct hang_rule *h = &g_cfg->hang[i];
        if (strcmp(h->fn, fn) == 0 && (h->gpu < 0 || h->gpu == gpu))
            return true;
    }
    return false;
}

static void refresh_locked(bool force);

/*
 * A call a `hang` line names blocks here, without the lock (other calls and
 * other GPUs go on), until the line is removed: like a driver call that
 * never returns. Signals do not end it (a hung ioctl does not return on one).
 */
static void hang_point(const char *fn, int gpu)
{
    for (;;) {
        pthread_mutex_lock(&g_mu);
        bool hang = false;
        if (g_refcount > 0 && g_cfg) {
            refresh_locked(false);
            hang = hang_matches_locked(fn, gpu);
        }
        pthread_mutex_unlock(&g_mu);
        if (!hang)
            return;
        struct timespec ts = {0, HANG_POLL_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* The GPU index a device handle stands for (-1: not one of ours); no lock needed. */
static int handle_gpu(nvmlDevice_t device)
{
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)g_dev;
    if (p < base || p >= base + sizeof(g_dev) || (p - base) % sizeof(g_dev[0]) != 0)
        return -1;
    return (int)((p - base) / sizeof(g_dev[0]));
}

/* An injected error for this call (caller holds g_mu and g_cfg is set), or NVML_SUCCESS. */
static nvmlReturn_t injected_locked(const char *fn, int gpu)
{
    for (unsigned int i = 0; i < g_cfg->nfail; i++) {
        const struct fail_rule *f = &g_cfg->fail[i];
        if (strcmp(f->fn, fn) != 0 || (f->gpu >= 0 && f->gpu != gpu))
            continue;
        if (f->count >= 0 && g_fail_used[i] >= f->count)
            continue;
        g_fail_used[i]++;
        return f->code;
    }
    return NVML_SUCCESS;
}

static bool parse_state(const char *buf, size_t len, struct config *c, struct parse_error *e)
{
    enum { MAX_TOKENS = 32 };
    char *work = malloc(len + 1);
    char whybuf[160];
    size_t xid_cap = 0;
    unsigned int line = 0;
    bool ok = true;

    if (!work)
        return parse_fail(e, 0, 0, 0, "out of memory");
    memset(c, 0, sizeof(*c));
    snprintf(c->driver, sizeof(c->driver), "%s", DEFAULT_DRIVER);

    for (size_t pos = 0; ok && pos < len;) {
        size_t end = pos;
        while (end < len && buf[end] != '\n')
            end++;
        size_t off = pos, l = end - pos;
        pos = end + 1;
        line++;
        if (l > 0 && buf[off + l - 1] == '\r')
            l--;
        memcpy(work, buf + off, l);
        work[l] = '\0';
        if (strlen(work) != l) {
            ok = parse_fail(e, line, off, l, "NUL byte in line");
            break;
        }

        char *tok[MAX_TOKENS];
        const char *why = NULL;
        int n = tokenize(work, tok, MAX_TOKENS, &why);
        if (n < 0) {
            ok = parse_fail(e, line, off, l, "%s", why);
        } else if (n == 0) {
            continue;
        } else if (strcmp(tok[0], "driver") == 0) {
            if (n != 2)
                ok = parse_fail(e, line, off, l, "expected: driver <version>");
            else if (strlen(tok[1]) >= sizeof(c->driver))
                ok = parse_fail(e, line, off, l, "driver version too long");
            else
                snprintf(c->driver, sizeof(c->driver), "%s", tok[1]);
        } else if (strcmp(tok[0], "init_error") == 0) {
            if (n != 2)
                ok = parse_fail(e, line, off, l, "expected: init_error <NAME>");
            else if (!error_by_name(tok[1], &c->init_error) || c->init_error == NVML_SUCCESS)
                ok = parse_fail(e, line, off, l, "unknown error name '%s'", tok[1]);
        } else if (strcmp(tok[0], "gpu") == 0) {
            unsigned long long idx;
            unsigned long long seen = 0;
            if (n < 2 || !parse_uint(tok[1], MAX_GPUS - 1, &idx)) {
                ok = parse_fail(e, line, off, l, "expected: gpu <index 0..%d> [key=value...]",
                                MAX_GPUS - 1);
                continue;
            }
            struct gpu_cfg *g = &c->gpu[idx];
            if (g->present) {
                ok = parse_fail(e, line, off, l, "duplicate gpu %llu (first on line %u)", idx,
                                g->line);
                continue;
            }
            gpu_defaults(g, (unsigned int)idx);
            g->present = true;
            g->line = line;
            g->text_off = off;
            g->text_len = l;
            for (int i = 2; ok && i < n; i++)
                if (!parse_gpu_key(g, tok[i], &seen, &why, whybuf, sizeof(whybuf)))
                    ok = parse_fail(e, line, off, l, "%s", why);
            if (idx + 1 > c->ngpu)
                c->ngpu = (unsigned int)idx + 1;
        } else if (strcmp(tok[0], "xid") == 0) {
            unsigned long long gpu, code, gi = NO_INSTANCE, ci = NO_INSTANCE;
            bool args_ok = n >= 3 && n <= 5 && parse_uint(tok[1], MAX_GPUS - 1, &gpu) &&
                           parse_uint(tok[2], ULLONG_MAX, &code);
            for (int i = 3; args_ok && i < n; i++) {
                if (strncmp(tok[i], "gi=", 3) == 0)
                    args_ok = parse_uint(tok[i] + 3, UINT_MAX, &gi);
                else if (strncmp(tok[i], "ci=", 3) == 0)
                    args_ok = parse_uint(tok[i] + 3, UINT_MAX, &ci);
                else
                    args_ok = false;
            }
            if (!args_ok) {
                ok = parse_fail(e, line, off, l,
                                "expected: xid <gpu index> <xid code> [gi=<n>] [ci=<n>]");
                continue;
            }
            if (c->nxid == xid_cap) {
                size_t cap = xid_cap ? xid_cap * 2 : 16;
                struct xid_line *x = realloc(c->xid, cap * sizeof(*x));
                if (!x) {
                    ok = parse_fail(e, line, off, l, "out of memory");
                    continue;
                }
                c->xid = x;
                xid_cap = cap;
            }
            c->xid[c->nxid++] = (struct xid_line){(unsigned int)gpu, code, (unsigned int)gi,
                                                  (unsigned int)ci, line, off, l};
        } else if (strcmp(tok[0], "fail") == 0) {
            struct fail_rule *f = &c->fail[c->nfail];
            if (c->nfail == MAX_FAIL_RULES) {
                ok = parse_fail(e, line, off, l, "more than %d fail lines", MAX_FAIL_RULES);
                continue;
            }
            if (n < 3 || !fail_function_known(tok[1])) {
                ok = parse_fail(e, line, off, l,
                                "expected: fail <NVML function> <ERROR NAME> [gpu=<n>] [count=<n>]");
                continue;
            }
            snprintf(f->fn, sizeof(f->fn), "%s", tok[1]);
            if (!error_by_name(tok[2], &f->code) || f->code == NVML_SUCCESS) {
                ok = parse_fail(e, line, off, l, "unknown error name '%s'", tok[2]);
                continue;
            }
            f->gpu = -1;
            f->count = -1;
            for (int i = 3; ok && i < n; i++) {
                unsigned long long v;
                if (strncmp(tok[i], "gpu=", 4) == 0 && parse_uint(tok[i] + 4, MAX_GPUS - 1, &v))
                    f->gpu = (int)v;
                else if (strncmp(tok[i], "count=", 6) == 0 &&
                         parse_uint(tok[i] + 6, LLONG_MAX, &v))
                    f->count = (long long)v;
                else
                    ok = parse_fail(e, line, off, l, "bad fail option '%s'", tok[i]);
            }
            f->sig = 5381;
            for (size_t i = 0; i < l; i++)
                f->sig = f->sig * 33 + (unsigned char)buf[off + i];
            c->nfail++;
        } else if (strcmp(tok[0], "hang") == 0) {
            struct hang_rule *h = &c->hang[c->nhang];
            if (c->nhang == MAX_HANG_RULES) {
                ok = parse_fail(e, line, off, l, "more than %d hang lines", MAX_HANG_RULES);
                continue;
            }
            if (n < 2 || n > 3 || !hang_function_known(tok[1])) {
                ok = parse_fail(e, line, off, l, "expected: hang <NVML function> [gpu=<n>]");
                continue;
            }
            snprintf(h->fn, sizeof(h->fn), "%s", tok[1]);
            h->gpu = -1;
            unsigned long long v;
            if (n == 3) {
                if (strncmp(tok[2], "gpu=", 4) == 0 && parse_uint(tok[2] + 4, MAX_GPUS - 1, &v))
                    h->gpu = (int)v;
                else {
                    ok = parse_fail(e, line, off, l, "bad hang option '%s'", tok[2]);
                    continue;
                }
            }
            c->nhang++;
        } else {
            ok = parse_fail(e, line, off, l, "unknown keyword '%s'", tok[0]);
        }
    }
    free(work);

    /* Checks that need the whole file: no gaps in indices, xids name real GPUs. */
    for (unsigned int i = 0; ok && i < c->ngpu; i++) {
        if (c->gpu[i].present)
            continue;
        unsigned int j = i + 1;
        while (!c->gpu[j].present) /* terminates: gpu[ngpu - 1] is present */
            j++;
        ok = parse_fail(e, c->gpu[j].line, c->gpu[j].text_off, c->gpu[j].text_len,
                        "gpu %u is missing (gpu indices must be 0..n-1 without gaps)", i);
    }
    for (unsigned int i = 0; ok && i < c->ngpu; i++)
        for (unsigned int j = 0; ok && j < i; j++)
            if (strcmp(c->gpu[i].uuid, c->gpu[j].uuid) == 0)
                ok = parse_fail(e, c->gpu[i].line, c->gpu[i].text_off, c->gpu[i].text_len,
                                "duplicate uuid '%s' (also gpu %u)", c->gpu[i].uuid, j);
    for (size_t i = 0; ok && i < c->nxid; i++)
        if (c->xid[i].gpu >= c->ngpu)
            ok = parse_fail(e, c->xid[i].line, c->xid[i].text_off, c->xid[i].text_len,
                            "xid for gpu %u, but there is no such gpu line", c->xid[i].gpu);
    if (!ok) {
        free(c->xid);
        c->xid = NULL;
        c->nxid = 0;
    }
    return ok;
}

/* ------------------------------------------------------------------------ */
/* Loading and reloading the state file (caller holds g_mu).                */
/* ------------------------------------------------------------------------ */

/*
 * Hands a new event to every set registered for its type on that GPU.  A set
 * that registers later does not get it: nvml.h, nvmlDeviceRegisterEvents,
 * "All events that occurred before this call are not recorded".
 */
static void deliver_locked(const struct event *ev)
{
    for (struct nvmlEventSet_st *s = g_sets; s; s = s->next)
        if ((s->mask[ev->gpu] & ev->type) && !s->broken)
            queue_push(&s->queue, ev);
}

static void report_parse_error(const char *buf, const struct parse_error *pe)
{
    if (pe->line == 0)
        fprintf(stderr, "fakenvml: %s: %s\n", g_path, pe->msg);
    else
        fprintf(stderr, "fakenvml: %s:%u: %s: %.*s\n", g_path, pe->line, pe->msg,
                (int)pe->text_len, buf + pe->text_off);
}

/*
 * The driver logs each Xid in the kernel log as it posts the event: with
 * $FAKE_NVML_KMSG naming a stand-in file, a new `xid` line also appends the
 * record /dev/kmsg would return for it (`3,SEQ,USEC,-;NVRM: Xid (PCI:...)`,
 * timestamps and sequence numbers from CLOCK_MONOTONIC, so that they rise
 * across processes of one boot).  Lines present at the first read are not
 * logged again: whoever ran then logged them.
 */
static void log_xid(const struct xid_line *x)
{
    static unsigned long long last_seq;
    const char *path = getenv("FAKE_NVML_KMSG");
    if (!path || !*path)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    unsigned long long usec = (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000;
    unsigned long long seq = usec > last_seq ? usec : last_seq + 1;
    last_seq = seq;
    char rec[256];
    int n = snprintf(rec, sizeof(rec),
                     "3,%llu,%llu,-;NVRM: Xid (PCI:0000:%02x:00): %llu, pid=1234, name=python, "
                     "fakenvml xid line %u\n SUBSYSTEM=pci\n",
                     seq, usec, FIRST_PCI_BUS + x->gpu, x->code, x->line);
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || n <= 0) {
        fprintf(stderr, "fakenvml: cannot append to FAKE_NVML_KMSG %s\n", path);
        if (fd >= 0)
            close(fd);
        return;
    }
    if (write(fd, rec, (size_t)n) != n)
        fprintf(stderr, "fakenvml: short write to FAKE_NVML_KMSG %s\n", path);
    close(fd);
}

/*
 * Reads and applies the state file.  At init (initializing == true) problems
 * are returned as NVML errors and always printed; later they keep the last
 * good state and are printed once per file version.
 */
static nvmlReturn_t load_locked(bool initializing)
{
    int fd = open(g_path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        if (initializing || !g_missing_warned)
            fprintf(stderr, "fakenvml: cannot read FAKE_NVML_STATE file %s: %s%s\n", g_path,
                    strerror(err),
                    initializing ? "; nvmlInit fails with NVML_ERROR_DRIVER_NOT_LOADED"
                                 : "; keeping the last good state");
        g_missing_warned = true;
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    g_missing_warned = false;

    struct file_id id = file_id_of(&st);
    g_seen = id;
    g_seen_valid = true;
    /* A writer that rewrites the file in place truncates it first; don't let
     * that instant wipe all GPUs.  Zero GPUs can be described by a comment. */
    if (st.st_size == 0 && g_cfg) {
        close(fd);
        return NVML_SUCCESS;
    }
    if (st.st_size > MAX_STATE_BYTES) {
        close(fd);
        if (initializing || !g_bad_valid || !same_file_id(&id, &g_bad))
            fprintf(stderr, "fakenvml: %s: file larger than %d bytes\n", g_path, MAX_STATE_BYTES);
        g_bad = id;
        g_bad_valid = true;
        return NVML_ERROR_UNKNOWN;
    }

    char *buf = malloc((size_t)st.st_size + 1);
    size_t len = 0;
    if (!buf) {
        close(fd);
        return NVML_ERROR_MEMORY;
    }
    for (;;) { /* read to EOF; the file may have grown since fstat */
        ssize_t r = read(fd, buf + len, (size_t)st.st_size + 1 - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        len += (size_t)r;
        if (len == (size_t)st.st_size + 1)
            break; /* grew meanwhile: the next call sees a new version */
    }
    close(fd);

    struct config *c = malloc(sizeof(*c));
    struct parse_error pe = {0, 0, 0, ""};
    if (!c) {
        free(buf);
        return NVML_ERROR_MEMORY;
    }
    if (!parse_state(buf, len, c, &pe)) {
        if (initializing || !g_bad_valid || !same_file_id(&id, &g_bad))
            report_parse_error(buf, &pe);
        g_bad = id;
        g_bad_valid = true;
        free(buf);
        free(c);
        return NVML_ERROR_UNKNOWN;
    }
    free(buf);
    g_bad_valid = false;

    /* Fail rules keep how many calls they have failed across rewrites of the
     * file, as long as the rule at that position is the same line. */
    for (unsigned int i = 0; i < MAX_FAIL_RULES; i++) {
        unsigned long sig = i < c->nfail ? c->fail[i].sig : 0;
        if (sig != g_fail_sig[i])
            g_fail_used[i] = 0;
        g_fail_sig[i] = sig;
    }
    /* More uncorrected ECC errors is one double-bit ECC event (nvml.h: "Event
     * about double bit ECC errors", eventData 0) to the sets registered for it
     * on that GPU; ECC events exist only where ECC is supported and enabled. */
    if (g_cfg)
        for (unsigned int i = 0; i < c->ngpu && i < g_cfg->ngpu; i++)
            if (c->gpu[i].ecc_supported && c->gpu[i].ecc_enabled &&
                c->gpu[i].ecc > g_cfg->gpu[i].ecc) {
                struct event ev = {NULL, i, nvmlEventTypeDoubleBitEccError, 0, NO_INSTANCE,
                                   NO_INSTANCE};
                deliver_locked(&ev);
            }
    /* A changed recovery action is an event (nvmlEventTypeGpuRecoveryAction). */
    if (g_cfg)
        for (unsigned int i = 0; i < c->ngpu && i < g_cfg->ngpu; i++)
            if (c->gpu[i].recovery_supported &&
                c->gpu[i].recovery_action != g_cfg->gpu[i].recovery_action) {
                struct event ev = {NULL, i, nvmlEventTypeGpuRecoveryAction, 0, NO_INSTANCE,
                                   NO_INSTANCE};
                deliver_locked(&ev);
            }
    bool first = g_cfg == NULL;
    config_free(g_cfg);
    g_cfg = c;
    /* Xid lines are events, numbered by position: only lines beyond the
     * high-water mark are new.  The mark never goes down, so a reader that
     * catches a half-rewritten file cannot make old lines fire again. */
    for (size_t i = g_xid_seen; i < c->nxid; i++) {
        struct event ev = {NULL, c->xid[i].gpu, nvmlEventTypeXidCriticalError, c->xid[i].code,
                           c->xid[i].gi, c->xid[i].ci};
        deliver_locked(&ev);
        if (!first)
            log_xid(&c->xid[i]);
    }
    if (c->nxid > g_xid_seen)
        g_xid_seen = c->nxid;
    return NVML_SUCCESS;
}

/*
 * Drains an inotify fd without blocking.  Returns true if the state file
 * itself may have changed (an event named it, or the queue overflowed).
 * Sets *dead when the watch went away (directory deleted).
 */
static bool drain_inotify(int fd, bool *dead)
{
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    bool hit = false;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof(buf));
        if (n <= 0)
            return hit; /* EAGAIN: drained */
        for (char *p = buf; p < buf + n;) {
            const struct inotify_event *ev = (const struct inotify_event *)p;
            if (ev->mask & IN_Q_OVERFLOW)
                hit = true;
            if (ev->mask & IN_IGNORED) {
                hit = true;
                *dead = true;
            }
            if (ev->len > 0 && strcmp(ev->name, g_base) == 0)
                hit = true;
            p += sizeof(*ev) + ev->len;
        }
    }
}

static int watch_dir(void)
{
    /* FAKE_NVML_NO_INOTIFY=1 forces the polling fallback, to test it. */
    const char *off = getenv("FAKE_NVML_NO_INOTIFY");
    if (off && strcmp(off, "1") == 0)
        return -1;
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0)
        return -1;
    if (inotify_add_watch(fd, g_dir, WATCH_MASK) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/*
 * Called at the top of every entry point: reloads the state file if it
 * changed.  stat() catches renames and most edits; the inotify fd also
 * catches same-size in-place rewrites within one timestamp tick.
 */
static void refresh_locked(bool force)
{
    if (g_ino_fd >= 0) {
        bool dead = false;
        if (drain_inotify(g_ino_fd, &dead))
            force = true;
        if (dead) {
            close(g_ino_fd);
            g_ino_fd = -1;
        }
    }
    struct stat st;
    if (stat(g_path, &st) != 0) {
        if (!g_missing_warned)
            fprintf(stderr, "fakenvml: cannot stat FAKE_NVML_STATE file %s: %s; keeping the "
                            "last good state\n", g_path, strerror(errno));
        g_missing_warned = true;
        return;
    }
    struct file_id id = file_id_of(&st);
    if (!force && g_seen_valid && same_file_id(&id, &g_seen))
        return;
    (void)load_locked(false);
}

/* Points g_path/g_dir/g_base at $FAKE_NVML_STATE; resets the state on change. */
static nvmlReturn_t set_path_locked(void)
{
    const char *env = getenv("FAKE_NVML_STATE");
    if (!env || !*env) {
        fprintf(stderr, "fakenvml: FAKE_NVML_STATE is not set; nvmlInit fails with "
                        "NVML_ERROR_DRIVER_NOT_LOADED (point it at a state file, see "
                        "tests/fakenvml/README.md)\n");
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    char *path;
    if (env[0] == '/') {
        path = strdup(env);
    } else {
        /* Relative to the cwd at init, so a later chdir() doesn't matter. */
        char cwd[PATH_MAX];
        if (!getcwd(cwd, sizeof(cwd)) || asprintf(&path, "%s/%s", cwd, env) < 0)
            path = NULL;
    }
    if (!path)
        return NVML_ERROR_MEMORY;
    if (g_path && strcmp(g_path, path) == 0) {
        free(path);
        return NVML_SUCCESS;
    }

    /* A different file: forget everything learnt from the old one. */
    free(g_path);
    free(g_dir);
    config_free(g_cfg);
    g_cfg = NULL;
    g_seen_valid = g_bad_valid = g_missing_warned = false;
    g_xid_seen = 0;
    memset(g_fail_used, 0, sizeof(g_fail_used));
    memset(g_fail_sig, 0, sizeof(g_fail_sig));

    g_path = path;
    char *slash = strrchr(g_path, '/');
    g_dir = strndup(g_path, slash == g_path ? 1 : (size_t)(slash - g_path));
    g_base = slash + 1;
    return g_dir ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}

/* ------------------------------------------------------------------------ */
/* Event set bookkeeping (caller holds g_mu).                               */
/* ------------------------------------------------------------------------ */

static struct nvmlEventSet_st *find_set_locked(nvmlEventSet_t set)
{
    /* Compare addresses only: a stale handle is never dereferenced. */
    for (struct nvmlEventSet_st *s = g_sets; s; s = s->next)
        if (s == set)
            return s;
    return NULL;
}

static void destroy_set(struct nvmlEventSet_st *s)
{
    if (s->ino_fd >= 0)
        close(s->ino_fd);
    queue_clear(&s->queue);
    free(s);
}

/*
 * Unlinks a set; a thread still waiting on it frees it on the way out.  That
 * thread is not woken: nvml.h does not say that nvmlEventSetFree or
 * nvmlShutdown wakes a waiter (a set is not to be used from two threads at
 * once), so the fake does not promise it either.  The waiter returns at its
 * timeout, at an interrupt (a signal), or when the state file changes.
 */
static void kill_set_locked(struct nvmlEventSet_st *s, const char *by)
{
    struct nvmlEventSet_st **pp = &g_sets;
    while (*pp != s)
        pp = &(*pp)->next;
    *pp = s->next;
    s->next = NULL;
    s->freed = true;
    if (s->busy == 0)
        destroy_set(s);
    else
        fprintf(stderr,
                "fakenvml: %s on an event set another thread waits on: nvml.h does not define "
                "this; the waiter is not woken\n",
                by);
}

/* ------------------------------------------------------------------------ */
/* Common checks for device queries (caller holds g_mu).                    */
/* ------------------------------------------------------------------------ */

enum query_kind {
    BOOKKEEPING, /* answered from the handle alone: ignores lost= and error= */
    HW_QUERY     /* talks to the "GPU": fails with lost= and error= */
};

static nvmlReturn_t begin_locked(void)
{
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    refresh_locked(false);
    return NVML_SUCCESS;
}

static nvmlReturn_t device_locked(const char *fn, nvmlDevice_t device, enum query_kind kind,
                                  const struct gpu_cfg **out)
{
    nvmlReturn_t r = begin_locked();
    if (r != NVML_SUCCESS)
        return r;
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)g_dev;
    if (p < base || p >= base + sizeof(g_dev) || (p - base) % sizeof(g_dev[0]) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t idx = (p - base) / sizeof(g_dev[0]);
    if (idx >= g_cfg->ngpu)
        return NVML_ERROR_INVALID_ARGUMENT; /* the GPU's line was removed */
    const struct gpu_cfg *g = &g_cfg->gpu[idx];
    r = injected_locked(fn, (int)idx);
    if (r != NVML_SUCCESS)
        return r;
    if (kind == HW_QUERY && g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    if (kind == HW_QUERY && g->error != NVML_SUCCESS)
        return g->error;
    *out = g;
    return NVML_SUCCESS;
}

#define LOCKED(expr)                  \
    do {                              \
        pthread_mutex_lock(&g_mu);    \
        nvmlReturn_t r_ = (expr);     \
        pthread_mutex_unlock(&g_mu);  \
        return r_;                    \
    } while (0)

static unsigned int gpu_index(const struct gpu_cfg *g)
{
    return (unsigned int)(g - g_cfg->gpu);
}

/* ------------------------------------------------------------------------ */
/* Init and shutdown.                                                       */
/* ------------------------------------------------------------------------ */

static nvmlReturn_t init_locked(void)
{
    nvmlReturn_t r;
    if (g_refcount == 0) {
        r = set_path_locked();
        if (r != NVML_SUCCESS)
            return r;
        /* Watch before reading, so no write can slip in between. */
        if (g_ino_fd < 0)
            g_ino_fd = watch_dir();
    } else {
        bool dead = false;
        if (g_ino_fd >= 0)
            drain_inotify(g_ino_fd, &dead); /* the load below reads everything anyway */
    }
    r = load_locked(true);
    if (r == NVML_SUCCESS && g_cfg->init_error != NVML_SUCCESS)
        r = g_cfg->init_error;
    if (r != NVML_SUCCESS) {
        if (g_refcount == 0 && g_ino_fd >= 0) {
            close(g_ino_fd);
            g_ino_fd = -1;
        }
        return r;
    }
    for (unsigned int i = 0; i < MAX_GPUS; i++)
        g_dev[i].index = i;
    g_refcount++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NO_GPUS/NO_ATTACH/FORCE_INIT change nothing here */
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = init_locked();
    pthread_mutex_unlock(&g_mu);
    if (r == NVML_SUCCESS)
        hang_point("nvmlInit", -1);
    return r;
}

nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

static nvmlReturn_t shutdown_locked(void)
{
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (--g_refcount > 0)
        return NVML_SUCCESS;
    /* Final shutdown: event sets die (waiters are not woken), the watch goes.
     * The parsed state, the Xid high-water mark and parked Xids stay, so a
     * re-init does not replay old events. */
    while (g_sets)
        kill_set_locked(g_sets, "nvmlShutdown");
    if (g_ino_fd >= 0) {
        close(g_ino_fd);
        g_ino_fd = -1;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void)
{
    LOCKED(shutdown_locked());
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    return error_text(result);
}

/* ------------------------------------------------------------------------ */
/* System and device queries.                                               */
/* ------------------------------------------------------------------------ */

static nvmlReturn_t driver_version_locked(char *version, unsigned int length)
{
    nvmlReturn_t r = begin_locked();
    if (r != NVML_SUCCESS)
        return r;
    if (!version)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = injected_locked("nvmlSystemGetDriverVersion", -1);
    if (r != NVML_SUCCESS)
        return r;
    return copy_out(version, length, g_cfg->driver);
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    hang_point("nvmlSystemGetDriverVersion", -1);
    LOCKED(driver_version_locked(version, length));
}

static nvmlReturn_t count_locked(unsigned int *deviceCount)
{
    nvmlReturn_t r = begin_locked();
    if (r != NVML_SUCCESS)
        return r;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = injected_locked("nvmlDeviceGetCount", -1);
    if (r != NVML_SUCCESS)
        return r;
    *deviceCount = g_cfg->ngpu;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    hang_point("nvmlDeviceGetCount", -1);
    LOCKED(count_locked(deviceCount));
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

static nvmlReturn_t handle_by_index_locked(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t r = begin_locked();
    if (r != NVML_SUCCESS)
        return r;
    if (!device || index >= g_cfg->ngpu)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = injected_locked("nvmlDeviceGetHandleByIndex", (int)index);
    if (r != NVML_SUCCESS)
        return r;
    /* Like the real driver (nvidia-smi: "Unable to determine the device
     * handle for GPU ...: GPU is lost"); error= does not apply here. */
    if (g_cfg->gpu[index].lost)
        return NVML_ERROR_GPU_IS_LOST;
    *device = &g_dev[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    hang_point("nvmlDeviceGetHandleByIndex", index < MAX_GPUS ? (int)index : -1);
    LOCKED(handle_by_index_locked(index, device));
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

static nvmlReturn_t handle_by_uuid_locked(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t r = begin_locked();
    if (r != NVML_SUCCESS)
        return r;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < g_cfg->ngpu; i++) {
        if (strcmp(g_cfg->gpu[i].uuid, uuid) == 0) {
            r = injected_locked("nvmlDeviceGetHandleByUUID", (int)i);
            if (r != NVML_SUCCESS)
                return r;
            if (g_cfg->gpu[i].lost)
                return NVML_ERROR_GPU_IS_LOST;
            *device = &g_dev[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    hang_point("nvmlDeviceGetHandleByUUID", -1);
    LOCKED(handle_by_uuid_locked(uuid, device));
}

static nvmlReturn_t index_locked(nvmlDevice_t device, unsigned int *index)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetIndex", device, BOOKKEEPING, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = gpu_index(g);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    hang_point("nvmlDeviceGetIndex", handle_gpu(device));
    LOCKED(index_locked(device, index));
}

static nvmlReturn_t string_query_locked(nvmlDevice_t device, char *buf, unsigned int length,
                                        bool uuid)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked(uuid ? "nvmlDeviceGetUUID" : "nvmlDeviceGetName", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    return copy_out(buf, length, uuid ? g->uuid : g->name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    hang_point("nvmlDeviceGetUUID", handle_gpu(device));
    LOCKED(string_query_locked(device, uuid, length, true));
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    hang_point("nvmlDeviceGetName", handle_gpu(device));
    LOCKED(string_query_locked(device, name, length, false));
}

/* Fills either PCI struct layout; bus numbers start at 0x3B and follow the index. */
static nvmlReturn_t pci_locked(nvmlDevice_t device, void *out, bool v3)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetPciInfo", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int bus = FIRST_PCI_BUS + gpu_index(g);
    if (v3) {
        nvmlPciInfo_t *pci = out;
        memset(pci, 0, sizeof(*pci));
        pci->domain = 0;
        pci->bus = bus;
        pci->device = 0;
        pci->pciDeviceId = PCI_DEVICE_ID;
        pci->pciSubSystemId = PCI_SUBSYSTEM_ID;
        snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.0", 0u, bus, 0u);
        snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0", 0u, bus, 0u);
    } else {
        /* The old layout has only 16 bytes for busId: legacy format. */
        legacy_pci_info_t *pci = out;
        memset(pci, 0, sizeof(*pci));
        pci->bus = bus;
        pci->pciDeviceId = PCI_DEVICE_ID;
        pci->pciSubSystemId = PCI_SUBSYSTEM_ID;
        snprintf(pci->busId, sizeof(pci->busId), "%04X:%02X:%02X.0", 0u, bus, 0u);
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    hang_point("nvmlDeviceGetPciInfo", handle_gpu(device));
    LOCKED(pci_locked(device, pci, true));
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    hang_point("nvmlDeviceGetPciInfo", handle_gpu(device));
    LOCKED(pci_locked(device, pci, false));
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v2(device, pci);
}

static nvmlReturn_t ecc_mode_locked(nvmlDevice_t device, nvmlEnableState_t *current,
                                    nvmlEnableState_t *pending)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetEccMode", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->ecc_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    *current = g->ecc_enabled ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    *pending = *current;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, nvmlEnableState_t *current,
                                  nvmlEnableState_t *pending)
{
    hang_point("nvmlDeviceGetEccMode", handle_gpu(device));
    LOCKED(ecc_mode_locked(device, current, pending));
}

static nvmlReturn_t total_ecc_locked(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                     nvmlEccCounterType_t counterType,
                                     unsigned long long *eccCounts)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetTotalEccErrors", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!eccCounts || (unsigned int)errorType >= NVML_MEMORY_ERROR_TYPE_COUNT ||
        (unsigned int)counterType >= NVML_ECC_COUNTER_TYPE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->ecc_supported || !g->ecc_enabled)
        return NVML_ERROR_NOT_SUPPORTED; /* the counters need ECC mode enabled (nvml.h) */
    /* The file has one number: uncorrected errors, volatile == aggregate. */
    *eccCounts = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? g->ecc : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType,
                                         unsigned long long *eccCounts)
{
    hang_point("nvmlDeviceGetTotalEccErrors", handle_gpu(device));
    LOCKED(total_ecc_locked(device, errorType, counterType, eccCounts));
}

static nvmlReturn_t remapped_locked(nvmlDevice_t device, unsigned int *corrRows,
                                    unsigned int *uncRows, unsigned int *isPending,
                                    unsigned int *failureOccurred)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetRemappedRows", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->remap_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    *corrRows = g->remap_corr;
    *uncRows = g->remap_unc;
    *isPending = g->remap_pending;
    *failureOccurred = g->remap_failure;
    return NVML_SUCCESS;
}

/* The compute processes on a GPU (the repair's idle proof): `processes` of them, pids 1000, 1001, ... */
static nvmlReturn_t processes_locked(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetComputeRunningProcesses", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!infoCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (*infoCount < g->processes || (g->processes && !infos)) {
        *infoCount = g->processes;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < g->processes; i++) {
        memset(&infos[i], 0, sizeof(infos[i]));
        infos[i].pid = 1000 + i;
        infos[i].usedGpuMemory = 1ULL << 30;
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFF;
    }
    *infoCount = g->processes;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    hang_point("nvmlDeviceGetComputeRunningProcesses", handle_gpu(device));
    LOCKED(processes_locked(device, infoCount, infos));
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                       unsigned int *uncRows, unsigned int *isPending,
                                       unsigned int *failureOccurred)
{
    hang_point("nvmlDeviceGetRemappedRows", handle_gpu(device));
    LOCKED(remapped_locked(device, corrRows, uncRows, isPending, failureOccurred));
}

/* Page retirement (pre-Ampere GPUs; NOT_SUPPORTED unless retired_supported=1). Addresses are made up from
 * the cause and the page's number. nvml.h: pageCount 0 asks for the size only. */
static nvmlReturn_t retired_pages_locked(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                         unsigned int *pageCount, unsigned long long *addresses)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetRetiredPages", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!pageCount || (unsigned int)cause >= NVML_PAGE_RETIREMENT_CAUSE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->retired_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned int n = cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR ? g->retired_dbe
                                                                              : g->retired_sbe;
    if (*pageCount == 0 || *pageCount < n) {
        *pageCount = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    if (!addresses)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < n; i++)
        addresses[i] = ((unsigned long long)cause << 40) | ((unsigned long long)(i + 1) << 12);
    *pageCount = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                       unsigned int *pageCount, unsigned long long *addresses)
{
    hang_point("nvmlDeviceGetRetiredPages", handle_gpu(device));
    LOCKED(retired_pages_locked(device, cause, pageCount, addresses));
}

static nvmlReturn_t retired_pending_locked(nvmlDevice_t device, nvmlEnableState_t *isPending)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetRetiredPagesPendingStatus", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!isPending)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->retired_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    *isPending = g->retired_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending)
{
    hang_point("nvmlDeviceGetRetiredPagesPendingStatus", handle_gpu(device));
    LOCKED(retired_pending_locked(device, isPending));
}

/* Only NVML_FI_DEV_GET_GPU_RECOVERY_ACTION is answered; any other field's
 * nvmlReturn is NOT_SUPPORTED, as NVML does for a field a device lacks. */
static nvmlReturn_t field_values_locked(nvmlDevice_t device, int valuesCount,
                                        nvmlFieldValue_t *values)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetFieldValues", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!values || valuesCount <= 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (long long)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
        v->latencyUsec = 0;
        memset(&v->value, 0, sizeof(v->value));
        bool nvlink = g->nvlink_links > 0;
        if (v->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION && g->recovery_supported) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = g->recovery_action;
            v->nvmlReturn = NVML_SUCCESS;
        } else if (v->fieldId == NVML_FI_DEV_NVLINK_LINK_COUNT && nvlink) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = g->nvlink_links;
            v->nvmlReturn = NVML_SUCCESS;
        } else if ((v->fieldId == NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL ||
                    v->fieldId == NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL ||
                    v->fieldId == NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL) && nvlink) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
            v->value.ullVal = v->fieldId == NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL ? g->nvlink_crc
                              : v->fieldId == NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
                                  ? g->nvlink_replay
                                  : g->nvlink_recovery;
            v->nvmlReturn = NVML_SUCCESS;
        } else if (v->fieldId == NVML_FI_DEV_PCIE_REPLAY_COUNTER) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
            v->value.ullVal = g->pcie_replays;
            v->nvmlReturn = NVML_SUCCESS;
        } else {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                      nvmlFieldValue_t *values)
{
    hang_point("nvmlDeviceGetFieldValues", handle_gpu(device));
    LOCKED(field_values_locked(device, valuesCount, values));
}

/* ------------------------------------------------------------------------ */
/* Issue 29's signals: fabric, NVLink state, PCIe link, clock events,       */
/* InfoROM.                                                                 */
/* ------------------------------------------------------------------------ */

/* nvml.h: the caller sets .version; v2 and v3 share their first fields (v3 adds healthSummary). */
static nvmlReturn_t fabric_locked(nvmlDevice_t device, nvmlGpuFabricInfoV_t *info)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetGpuFabricInfoV", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlGpuFabricInfo_v2 && info->version != nvmlGpuFabricInfo_v3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (!g->fabric_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(info->clusterUuid, 0, sizeof(info->clusterUuid));
    info->status = g->fabric_status;
    info->cliqueId = 0;
    info->state = g->fabric_state;
    info->healthMask = g->fabric_health;
    if (info->version == nvmlGpuFabricInfo_v3)
        info->healthSummary = NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *gpuFabricInfo)
{
    hang_point("nvmlDeviceGetGpuFabricInfoV", handle_gpu(device));
    LOCKED(fabric_locked(device, gpuFabricInfo));
}

static nvmlReturn_t nvlink_state_locked(nvmlDevice_t device, unsigned int link,
                                        nvmlEnableState_t *isActive)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetNvLinkState", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!isActive || link >= NVML_NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= g->nvlink_links)
        return NVML_ERROR_NOT_SUPPORTED;
    *isActive = (g->nvlink_down >> link) & 1 ? NVML_FEATURE_DISABLED : NVML_FEATURE_ENABLED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    hang_point("nvmlDeviceGetNvLinkState", handle_gpu(device));
    LOCKED(nvlink_state_locked(device, link, isActive));
}

/* The four PCIe link queries: which = 0 current width, 1 max width, 2 current gen, 3 max gen. */
static nvmlReturn_t pcie_locked(const char *fn, nvmlDevice_t device, int which, unsigned int *out)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked(fn, device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    const unsigned int values[] = {g->pcie_width, g->pcie_max_width, g->pcie_gen, g->pcie_max_gen};
    *out = values[which];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *currLinkWidth)
{
    hang_point("nvmlDeviceGetCurrPcieLinkWidth", handle_gpu(device));
    LOCKED(pcie_locked("nvmlDeviceGetCurrPcieLinkWidth", device, 0, currLinkWidth));
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *maxLinkWidth)
{
    hang_point("nvmlDeviceGetMaxPcieLinkWidth", handle_gpu(device));
    LOCKED(pcie_locked("nvmlDeviceGetMaxPcieLinkWidth", device, 1, maxLinkWidth));
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *currLinkGen)
{
    hang_point("nvmlDeviceGetCurrPcieLinkGeneration", handle_gpu(device));
    LOCKED(pcie_locked("nvmlDeviceGetCurrPcieLinkGeneration", device, 2, currLinkGen));
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *maxLinkGen)
{
    hang_point("nvmlDeviceGetMaxPcieLinkGeneration", handle_gpu(device));
    LOCKED(pcie_locked("nvmlDeviceGetMaxPcieLinkGeneration", device, 3, maxLinkGen));
}

static nvmlReturn_t clocks_locked(nvmlDevice_t device, unsigned long long *reasons)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetCurrentClocksEventReasons", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!reasons)
        return NVML_ERROR_INVALID_ARGUMENT;
    *reasons = g->clock_events;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                   unsigned long long *clocksEventReasons)
{
    hang_point("nvmlDeviceGetCurrentClocksEventReasons", handle_gpu(device));
    LOCKED(clocks_locked(device, clocksEventReasons));
}

static nvmlReturn_t inforom_locked(nvmlDevice_t device)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceValidateInforom", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    return g->inforom_valid ? NVML_SUCCESS : NVML_ERROR_CORRUPTED_INFOROM;
}

nvmlReturn_t nvmlDeviceValidateInforom(nvmlDevice_t device)
{
    hang_point("nvmlDeviceValidateInforom", handle_gpu(device));
    LOCKED(inforom_locked(device));
}

/* ------------------------------------------------------------------------ */
/* Events.                                                                  */
/* ------------------------------------------------------------------------ */

static unsigned long long supported_events(const struct gpu_cfg *g)
{
    return SUPPORTED_EVENTS | (g->ecc_supported && g->ecc_enabled ? ECC_EVENTS : 0) |
           (g->recovery_supported ? nvmlEventTypeGpuRecoveryAction : 0);
}

static nvmlReturn_t supported_events_locked(nvmlDevice_t device, unsigned long long *eventTypes)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceGetSupportedEventTypes", device, HW_QUERY, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!eventTypes)
        return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = supported_events(g);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    hang_point("nvmlDeviceGetSupportedEventTypes", handle_gpu(device));
    LOCKED(supported_events_locked(device, eventTypes));
}

static nvmlReturn_t set_create_locked(nvmlEventSet_t *set)
{
    nvmlReturn_t r = begin_locked();
    if (r != NVML_SUCCESS)
        return r;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = injected_locked("nvmlEventSetCreate", -1);
    if (r != NVML_SUCCESS)
        return r;
    struct nvmlEventSet_st *s = calloc(1, sizeof(*s));
    if (!s)
        return NVML_ERROR_MEMORY;
    s->ino_fd = watch_dir(); /* -1: fall back to polling in nvmlEventSetWait */
    s->next = g_sets;
    g_sets = s;
    *set = s;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    hang_point("nvmlEventSetCreate", -1);
    LOCKED(set_create_locked(set));
}

static nvmlReturn_t register_locked(nvmlDevice_t device, unsigned long long eventTypes,
                                    nvmlEventSet_t set)
{
    const struct gpu_cfg *g;
    nvmlReturn_t r = device_locked("nvmlDeviceRegisterEvents", device, HW_QUERY, &g);
    struct nvmlEventSet_st *s = g_refcount ? find_set_locked(set) : NULL;
    /* nvml.h: "If function reports NVML_ERROR_UNKNOWN, event set is in
     * undefined state and should be freed": ours then never delivers again
     * and every wait on it answers UNKNOWN. */
    if (r == NVML_ERROR_UNKNOWN && s)
        s->broken = true;
    if (r != NVML_SUCCESS)
        return r;
    if (!s || eventTypes == 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~supported_events(g))
        return NVML_ERROR_NOT_SUPPORTED; /* as NVML: mask with the supported types first */
    s->mask[gpu_index(g)] |= eventTypes;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                      nvmlEventSet_t set)
{
    hang_point("nvmlDeviceRegisterEvents", handle_gpu(device));
    LOCKED(register_locked(device, eventTypes, set));
}

/*
 * Blocks until an Xid is queued for the set or the timeout expires.  The
 * set's own inotify fd wakes us as soon as the state file is written; any
 * thread's refresh may be the one that queues the event, and since nobody
 * else drains this fd, the write that queued it leaves it readable.
 */
static nvmlReturn_t wait_impl(nvmlEventSet_t set, nvmlEventData_t *data, legacy_event_data_t *v1,
                              unsigned int timeoutms)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = begin_locked();
    struct nvmlEventSet_st *s = r == NVML_SUCCESS ? find_set_locked(set) : NULL;
    if (r == NVML_SUCCESS && (!s || (!data && !v1)))
        r = NVML_ERROR_INVALID_ARGUMENT;
    if (r != NVML_SUCCESS) {
        pthread_mutex_unlock(&g_mu);
        return r;
    }

    const int64_t deadline = now_ns() + (int64_t)timeoutms * 1000000;
    s->busy++;
    for (;;) {
        if (s->freed) {
            r = g_refcount ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
            break;
        }
        bool force = false, dead = false;
        if (s->ino_fd >= 0 && drain_inotify(s->ino_fd, &dead))
            force = true;
        if (dead) {
            close(s->ino_fd);
            s->ino_fd = -1;
        }
        refresh_locked(force);
        if (s->broken) {
            r = NVML_ERROR_UNKNOWN;
            break;
        }
        r = injected_locked("nvmlEventSetWait", -1);
        if (r != NVML_SUCCESS)
            break;
        if (hang_matches_locked("nvmlEventSetWait", -1)) {
            /* A wait that hangs ignores its timeout and signals, as a stuck driver would. */
            pthread_mutex_unlock(&g_mu);
            hang_point("nvmlEventSetWait", -1);
            pthread_mutex_lock(&g_mu);
            continue;
        }

        struct event *e = s->queue.head;
        if (e) {
            s->queue.head = e->next;
            if (!s->queue.head)
                s->queue.tail = NULL;
            if (data) {
                data->device = &g_dev[e->gpu];
                data->eventType = e->type;
                data->eventData = e->code;
                data->gpuInstanceId = e->gi;
                data->computeInstanceId = e->ci;
            } else {
                v1->device = &g_dev[e->gpu];
                v1->eventType = e->type;
                v1->eventData = e->code;
            }
            free(e);
            r = NVML_SUCCESS;
            break;
        }

        int64_t left = deadline - now_ns();
        if (left <= 0) {
            r = NVML_ERROR_TIMEOUT;
            break;
        }
        int ms = (int)((left + 999999) / 1000000); /* round up: no busy spinning */
        struct pollfd pfd[1];
        nfds_t n = 0;
        if (s->ino_fd >= 0)
            pfd[n++] = (struct pollfd){.fd = s->ino_fd, .events = POLLIN};
        else if (ms > FALLBACK_POLL_MS)
            ms = FALLBACK_POLL_MS;
        /* busy > 0 keeps the fd open while we sleep without the lock. */
        pthread_mutex_unlock(&g_mu);
        int woke = poll(pfd, n, ms);
        int poll_errno = errno;
        pthread_mutex_lock(&g_mu);
        if (woke < 0 && poll_errno == EINTR) {
            /* nvml.h: TIMEOUT "if no event arrived in specified timeout or
             * interrupt arrived": a signal ends the wait. */
            r = NVML_ERROR_TIMEOUT;
            break;
        }
    }
    s->busy--;
    if (s->freed && s->busy == 0)
        destroy_set(s);
    pthread_mutex_unlock(&g_mu);
    return r;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return wait_impl(set, data, NULL, timeoutms);
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    /* nvml.h declares it with nvmlEventData_t; the v1 library wrote only the old fields. */
    return wait_impl(set, NULL, (legacy_event_data_t *)data, timeoutms);
}

static nvmlReturn_t set_free_locked(nvmlEventSet_t set)
{
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    struct nvmlEventSet_st *s = find_set_locked(set);
    if (!s)
        return NVML_ERROR_INVALID_ARGUMENT;
    kill_set_locked(s, "nvmlEventSetFree");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    LOCKED(set_free_locked(set));
}
