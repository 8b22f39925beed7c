/*
 * A fake libnvidia-ml.so.1 for gpuwatchd's tests.
 *
 * The real, unmodified pynvml loads this library through LD_LIBRARY_PATH. Every call re-reads
 * the JSON state file named by $FAKENVML_STATE, so a test changes the "GPUs" between polls by
 * writing a new file and renaming it over the old one. The state format is documented in
 * tests/fakenvml/README.md.
 *
 * Like the real driver, init opens <$FAKENVML_DEVICES_DIR>/nvidiactl, the first handle lookup of
 * a GPU opens <$FAKENVML_DEVICES_DIR>/nvidia<minor>, and both stay open until the init count
 * drops back to zero. Tests use that to see who holds "device files".
 *
 * Only the functions gpuwatchd calls exist here; any other symbol is absent, so pynvml raises
 * NVMLError_FunctionNotFound for it, as it does against an old driver.
 */

#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* NVML return codes (nvml.h). */
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 64
#define NVML_MEMORY_V2_VERSION 0x02000028u
#define VALUE_NOT_AVAILABLE ULLONG_MAX

/* ---- public structs, laid out exactly as pynvml's ctypes mirrors ---------------------------- */

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
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* nvmlValue_t and nvmlFieldValue_t (40 bytes, as pynvml's c_nvmlFieldValue_t). */
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
    unsigned int valueType;
    unsigned int nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

/* A device handle points at one of these; the slot is the GPU's position in "gpus". */
typedef struct {
    int slot;
} fake_device;

typedef fake_device *nvmlDevice_t;

/* ---- a small JSON reader ------------------------------------------------------------------ */

typedef enum { J_NULL, J_BOOL, J_NUMBER, J_STRING, J_ARRAY, J_OBJECT } jtype;

typedef struct jvalue {
    jtype type;
    int boolean;
    char *text;             /* J_STRING: the decoded string; J_NUMBER: the literal */
    size_t count;           /* J_ARRAY / J_OBJECT: number of children */
    char **keys;            /* J_OBJECT: child names */
    struct jvalue *items;   /* J_ARRAY / J_OBJECT: children */
} jvalue;

typedef struct {
    const char *at;
    const char *end;
    int depth;
} jparser;

static void json_free(jvalue *v) {
    if (v == NULL) {
        return;
    }
    free(v->text);
    for (size_t i = 0; i < v->count; i++) {
        json_free(&v->items[i]);
        if (v->keys != NULL) {
            free(v->keys[i]);
        }
    }
    free(v->items);
    free(v->keys);
    memset(v, 0, sizeof *v);
}

static void skip_space(jparser *p) {
    while (p->at < p->end && (*p->at == ' ' || *p->at == '\t' || *p->at == '\n' || *p->at == '\r')) {
        p->at++;
    }
}

static int append_byte(char **buf, size_t *len, size_t *cap, char c) {
    if (*len + 1 >= *cap) {
        size_t grown = *cap ? *cap * 2 : 32;
        char *bigger = realloc(*buf, grown);
        if (bigger == NULL) {
            return -1;
        }
        *buf = bigger;
        *cap = grown;
    }
    (*buf)[(*len)++] = c;
    (*buf)[*len] = '\0';
    return 0;
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Appends code point cp as UTF-8. */
static int append_utf8(char **buf, size_t *len, size_t *cap, unsigned long cp) {
    if (cp < 0x80) {
        return append_byte(buf, len, cap, (char)cp);
    }
    if (cp < 0x800) {
        return append_byte(buf, len, cap, (char)(0xC0 | (cp >> 6))) ||
               append_byte(buf, len, cap, (char)(0x80 | (cp & 0x3F)));
    }
    if (cp < 0x10000) {
        return append_byte(buf, len, cap, (char)(0xE0 | (cp >> 12))) ||
               append_byte(buf, len, cap, (char)(0x80 | ((cp >> 6) & 0x3F))) ||
               append_byte(buf, len, cap, (char)(0x80 | (cp & 0x3F)));
    }
    return append_byte(buf, len, cap, (char)(0xF0 | (cp >> 18))) ||
           append_byte(buf, len, cap, (char)(0x80 | ((cp >> 12) & 0x3F))) ||
           append_byte(buf, len, cap, (char)(0x80 | ((cp >> 6) & 0x3F))) ||
           append_byte(buf, len, cap, (char)(0x80 | (cp & 0x3F)));
}

static int parse_hex4(jparser *p, unsigned long *out) {
    if (p->end - p->at < 4) {
        return -1;
    }
    unsigned long v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hex_value(p->at[i]);
        if (h < 0) {
            return -1;
        }
        v = v * 16 + (unsigned long)h;
    }
    p->at += 4;
    *out = v;
    return 0;
}

/* Parses a string literal (p->at is on the opening quote) into a fresh NUL-terminated buffer. */
static char *parse_string(jparser *p) {
    char *buf = NULL;
    size_t len = 0, cap = 0;
    p->at++;
    if (append_byte(&buf, &len, &cap, '\0') != 0) {
        return NULL;
    }
    len = 0;
    while (p->at < p->end) {
        char c = *p->at++;
        if (c == '"') {
            return buf;
        }
        if ((unsigned char)c < 0x20) {
            break;
        }
        if (c != '\\') {
            if (append_byte(&buf, &len, &cap, c) != 0) break;
            continue;
        }
        if (p->at >= p->end) break;
        char e = *p->at++;
        int rc = 0;
        switch (e) {
        case '"': rc = append_byte(&buf, &len, &cap, '"'); break;
        case '\\': rc = append_byte(&buf, &len, &cap, '\\'); break;
        case '/': rc = append_byte(&buf, &len, &cap, '/'); break;
        case 'b': rc = append_byte(&buf, &len, &cap, '\b'); break;
        case 'f': rc = append_byte(&buf, &len, &cap, '\f'); break;
        case 'n': rc = append_byte(&buf, &len, &cap, '\n'); break;
        case 'r': rc = append_byte(&buf, &len, &cap, '\r'); break;
        case 't': rc = append_byte(&buf, &len, &cap, '\t'); break;
        case 'u': {
            unsigned long cp;
            if (parse_hex4(p, &cp) != 0) { rc = -1; break; }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned long low;
                if (p->end - p->at < 6 || p->at[0] != '\\' || p->at[1] != 'u') { rc = -1; break; }
                p->at += 2;
                if (parse_hex4(p, &low) != 0 || low < 0xDC00 || low > 0xDFFF) { rc = -1; break; }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            }
            rc = append_utf8(&buf, &len, &cap, cp);
            break;
        }
        default: rc = -1;
        }
        if (rc != 0) break;
    }
    free(buf);
    return NULL;
}

static int parse_value(jparser *p, jvalue *out);

static int push_child(jvalue *parent, char *key, jvalue *child) {
    jvalue *items = realloc(parent->items, (parent->count + 1) * sizeof *items);
    if (items == NULL) {
        return -1;
    }
    parent->items = items;
    if (parent->type == J_OBJECT) {
        char **keys = realloc(parent->keys, (parent->count + 1) * sizeof *keys);
        if (keys == NULL) {
            return -1;
        }
        parent->keys = keys;
        keys[parent->count] = key;
    }
    items[parent->count++] = *child;
    return 0;
}

static int parse_container(jparser *p, jvalue *out, char close) {
    out->type = close == '}' ? J_OBJECT : J_ARRAY;
    p->at++;
    skip_space(p);
    if (p->at < p->end && *p->at == close) {
        p->at++;
        return 0;
    }
    for (;;) {
        char *key = NULL;
        jvalue child;
        memset(&child, 0, sizeof child);
        skip_space(p);
        if (out->type == J_OBJECT) {
            if (p->at >= p->end || *p->at != '"' || (key = parse_string(p)) == NULL) {
                return -1;
            }
            skip_space(p);
            if (p->at >= p->end || *p->at != ':') {
                free(key);
                return -1;
            }
            p->at++;
        }
        if (parse_value(p, &child) != 0 || push_child(out, key, &child) != 0) {
            free(key);
            json_free(&child);
            return -1;
        }
        skip_space(p);
        if (p->at < p->end && *p->at == ',') {
            p->at++;
            continue;
        }
        if (p->at < p->end && *p->at == close) {
            p->at++;
            return 0;
        }
        return -1;
    }
}

static int parse_literal(jparser *p, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(p->end - p->at) < n || strncmp(p->at, word, n) != 0) {
        return -1;
    }
    p->at += n;
    return 0;
}

static int parse_number(jparser *p, jvalue *out) {
    const char *start = p->at;
    if (p->at < p->end && *p->at == '-') p->at++;
    int digits = 0;
    while (p->at < p->end && ((*p->at >= '0' && *p->at <= '9') || *p->at == '.' || *p->at == 'e' ||
                              *p->at == 'E' || *p->at == '+' || *p->at == '-')) {
        p->at++;
        digits++;
    }
    if (digits == 0) {
        return -1;
    }
    size_t n = (size_t)(p->at - start);
    out->type = J_NUMBER;
    out->text = malloc(n + 1);
    if (out->text == NULL) {
        return -1;
    }
    memcpy(out->text, start, n);
    out->text[n] = '\0';
    char *stop = NULL;
    (void)strtod(out->text, &stop);
    return (stop != NULL && *stop == '\0') ? 0 : -1;
}

static int parse_value(jparser *p, jvalue *out) {
    memset(out, 0, sizeof *out);
    if (++p->depth > 64) {
        return -1;
    }
    skip_space(p);
    int rc = -1;
    if (p->at >= p->end) {
        rc = -1;
    } else if (*p->at == '{') {
        rc = parse_container(p, out, '}');
    } else if (*p->at == '[') {
        rc = parse_container(p, out, ']');
    } else if (*p->at == '"') {
        out->type = J_STRING;
        out->text = parse_string(p);
        rc = out->text != NULL ? 0 : -1;
    } else if (*p->at == 't') {
        out->type = J_BOOL;
        out->boolean = 1;
        rc = parse_literal(p, "true");
    } else if (*p->at == 'f') {
        out->type = J_BOOL;
        rc = parse_literal(p, "false");
    } else if (*p->at == 'n') {
        out->type = J_NULL;
        rc = parse_literal(p, "null");
    } else {
        rc = parse_number(p, out);
    }
    p->depth--;
    return rc;
}

static const jvalue *json_get(const jvalue *obj, const char *key) {
    if (obj == NULL || obj->type != J_OBJECT) {
        return NULL;
    }
    for (size_t i = 0; i < obj->count; i++) {
        if (strcmp(obj->keys[i], key) == 0) {
            return &obj->items[i];
        }
    }
    return NULL;
}

static int json_is_null(const jvalue *v) { return v == NULL || v->type == J_NULL; }

/* Reads an unsigned 64-bit integer; returns 0 on success. */
static int json_u64(const jvalue *v, unsigned long long *out) {
    if (v == NULL || v->type != J_NUMBER || v->text[0] == '-') {
        return -1;
    }
    char *stop = NULL;
    errno = 0;
    unsigned long long u = strtoull(v->text, &stop, 10);
    if (errno == 0 && stop != NULL && *stop == '\0') {
        *out = u;
        return 0;
    }
    double d = strtod(v->text, NULL);
    if (d < 0 || d >= 18446744073709551616.0) {
        return -1;
    }
    *out = (unsigned long long)d;
    return 0;
}

static int json_i64(const jvalue *v, long long *out) {
    if (v == NULL || v->type != J_NUMBER) {
        return -1;
    }
    char *stop = NULL;
    errno = 0;
    long long i = strtoll(v->text, &stop, 10);
    if (errno == 0 && stop != NULL && *stop == '\0') {
        *out = i;
        return 0;
    }
    *out = (long long)strtod(v->text, NULL);
    return 0;
}

static double json_double(const jvalue *v, double fallback) {
    if (v == NULL || v->type != J_NUMBER) {
        return fallback;
    }
    return strtod(v->text, NULL);
}

static int json_truthy(const jvalue *v, int fallback) {
    if (v == NULL || v->type == J_NULL) return fallback;
    if (v->type == J_BOOL) return v->boolean;
    if (v->type == J_NUMBER) return strtod(v->text, NULL) != 0.0;
    return fallback;
}

/* ---- library state ------------------------------------------------------------------------ */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count = 0;
static int ctl_fd = -1;
static int gpu_fds[MAX_GPUS];
static int gpu_fds_ready = 0;
static fake_device devices[MAX_GPUS];

/*
 * MIG: a MIG device handle points into mig_handles (slot = parent position * MAX_MIG + MIG
 * device index), a GPU instance handle into gi_handles. Functions that know nothing of MIG take
 * a MIG handle for an invalid device (slot_of answers BAD_DEVICE), as NVML refuses most
 * whole-GPU queries on MIG handles.
 */
#define MAX_MIG 8
static fake_device mig_handles[MAX_GPUS * MAX_MIG];
typedef struct {
    int slot;
    unsigned int id;
} fake_gpu_instance;
static fake_gpu_instance gi_handles[MAX_GPUS * MAX_MIG];
typedef fake_gpu_instance *nvmlGpuInstance_t;

/*
 * FAKENVML_STATE and FAKENVML_DEVICES_DIR, from the environment; unset there, from defaults a
 * build may compile in (-DFAKENVML_DEFAULT_STATE="..." -DFAKENVML_DEFAULT_DEVICES_DIR="...").
 * tests/system/test_systemd_slurm.py builds such a copy: slurmd runs the prolog and epilog with an
 * environment of its own making, as a real driver needs none.
 */
static const char *setting(const char *name) {
    const char *value = getenv(name);
    if (value != NULL && *value != '\0') {
        return value;
    }
#ifdef FAKENVML_DEFAULT_STATE
    if (strcmp(name, "FAKENVML_STATE") == 0) {
        return FAKENVML_DEFAULT_STATE;
    }
#endif
#ifdef FAKENVML_DEFAULT_DEVICES_DIR
    if (strcmp(name, "FAKENVML_DEVICES_DIR") == 0) {
        return FAKENVML_DEFAULT_DEVICES_DIR;
    }
#endif
    return value;
}

static void complain(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fakenvml: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void reset_fds(void) {
    if (!gpu_fds_ready) {
        for (int i = 0; i < MAX_GPUS; i++) {
            gpu_fds[i] = -1;
            devices[i].slot = i;
        }
        for (int i = 0; i < MAX_GPUS * MAX_MIG; i++) {
            mig_handles[i].slot = i;
        }
        gpu_fds_ready = 1;
    }
}

/*
 * The last parsed state and the identity of the file it came from. The file is still looked at
 * on every call (stat), and parsed again whenever it changed: tests replace it atomically
 * (a new inode), so every change is seen at the next call, without re-parsing an unchanged
 * file ten times per GPU per poll. Only ever used under `lock`.
 */
static jvalue cached_state;
static int cached_valid = 0;
static struct stat cached_stat;

static int same_file(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec &&
           a->st_ctim.tv_sec == b->st_ctim.tv_sec && a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

/* A state from load_state() is the shared cached tree: callers release it, never free it. */
static void release_state(jvalue *state) {
    memset(state, 0, sizeof *state);
}

static int parse_state_file(const char *path, jvalue *state);

/* Loads the state (parsing the file only when it changed); on failure says why, returns -1. */
static int load_state(jvalue *state) {
    memset(state, 0, sizeof *state);
    const char *path = setting("FAKENVML_STATE");
    if (path == NULL || *path == '\0') {
        complain("FAKENVML_STATE is not set");
        return -1;
    }
    struct stat st;
    memset(&st, 0, sizeof st);
    if (stat(path, &st) == 0 && cached_valid && same_file(&st, &cached_stat)) {
        *state = cached_state;
        return 0;
    }
    jvalue parsed;
    if (parse_state_file(path, &parsed) != 0) {
        return -1;
    }
    if (cached_valid) {
        json_free(&cached_state);
    }
    cached_state = parsed;
    cached_stat = st;
    cached_valid = 1;
    *state = cached_state;
    return 0;
}

static int parse_state_file(const char *path, jvalue *state) {
    memset(state, 0, sizeof *state);
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        complain("cannot open state file %s: %s", path, strerror(errno));
        return -1;
    }
    char *text = NULL;
    size_t len = 0, cap = 0;
    char chunk[4096];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (len + n + 1 > cap) {
            size_t grown = (len + n + 1) * 2;
            char *bigger = realloc(text, grown);
            if (bigger == NULL) {
                free(text);
                fclose(f);
                complain("out of memory reading %s", path);
                return -1;
            }
            text = bigger;
            cap = grown;
        }
        memcpy(text + len, chunk, n);
        len += n;
    }
    fclose(f);
    if (text == NULL) {
        complain("state file %s is empty", path);
        return -1;
    }
    jparser p = {text, text + len, 0};
    int rc = parse_value(&p, state);
    skip_space(&p);
    if (rc != 0 || p.at != p.end || state->type != J_OBJECT) {
        complain("state file %s is not a JSON object (error near byte %ld)", path,
                 (long)(p.at - text));
        json_free(state);
        free(text);
        return -1;
    }
    free(text);
    return 0;
}

static const jvalue *gpus_of(const jvalue *state) {
    const jvalue *gpus = json_get(state, "gpus");
    return (gpus != NULL && gpus->type == J_ARRAY) ? gpus : NULL;
}

static size_t gpu_count(const jvalue *state) {
    const jvalue *gpus = gpus_of(state);
    size_t n = gpus ? gpus->count : 0;
    return n > MAX_GPUS ? MAX_GPUS : n;
}

static const jvalue *gpu_at(const jvalue *state, size_t slot) {
    const jvalue *gpus = gpus_of(state);
    if (gpus == NULL || slot >= gpus->count || slot >= MAX_GPUS) {
        return NULL;
    }
    return &gpus->items[slot];
}

/* A forced return code for function `fn` in map `errors`, or -1 when none. */
static int forced_error(const jvalue *errors, const char *fn) {
    long long code;
    const jvalue *v = json_get(errors, fn);
    if (v == NULL || json_i64(v, &code) != 0) {
        return -1;
    }
    return (int)code;
}

static double delay_for(const jvalue *state, const jvalue *gpu, const char *fn) {
    double d = json_double(json_get(json_get(gpu, "delays"), fn), -1.0);
    if (d < 0) {
        d = json_double(json_get(json_get(state, "delays"), fn), 0.0);
    }
    return d;
}

static void sleep_seconds(double seconds) {
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* What "lost" and the forced errors make of a call to `fn` on `gpu`: a code, or -1 for none. */
static int verdict(const jvalue *state, const jvalue *gpu, const char *fn) {
    int code = -1;
    if (gpu != NULL && json_truthy(json_get(gpu, "lost"), 0)) {
        code = NVML_ERROR_GPU_IS_LOST;
    }
    if (code < 0 && gpu != NULL) {
        code = forced_error(json_get(gpu, "errors"), fn);
    }
    if (code < 0) {
        code = forced_error(json_get(state, "errors"), fn);
    }
    return code == NVML_SUCCESS ? -1 : code;
}

#define NO_DEVICE (-1L)
#define BAD_DEVICE (-2L)

static long slot_of(nvmlDevice_t device) {
    if (device == NULL || device < &devices[0] || device >= &devices[MAX_GPUS]) {
        return BAD_DEVICE;
    }
    return device->slot;
}

/*
 * Every entry point starts here: takes the lock, checks init, loads the state, finds the GPU in
 * `slot` (unless NO_DEVICE), applies the function's delay, the GPU's "lost" flag and any forced
 * error. On NVML_SUCCESS the caller owns the lock and `state` and must call finish().
 */
static int begin(const char *fn, long slot, jvalue *state, const jvalue **gpu) {
    pthread_mutex_lock(&lock);
    reset_fds();
    if (init_count == 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    if (load_state(state) != 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNKNOWN;
    }
    const jvalue *g = NULL;
    if (slot != NO_DEVICE && (slot < 0 || (g = gpu_at(state, (size_t)slot)) == NULL)) {
        release_state(state);
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    double delay = delay_for(state, g, fn);
    if (delay > 0) {
        /* Hang without holding the lock, then answer from the state as it is by then. */
        release_state(state);
        pthread_mutex_unlock(&lock);
        sleep_seconds(delay);
        pthread_mutex_lock(&lock);
        if (init_count == 0) {
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_UNINITIALIZED;
        }
        if (load_state(state) != 0) {
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_UNKNOWN;
        }
        if (slot != NO_DEVICE && (g = gpu_at(state, (size_t)slot)) == NULL) {
            release_state(state);
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_INVALID_ARGUMENT;
        }
    }
    int code = verdict(state, g, fn);
    if (code >= 0) {
        release_state(state);
        pthread_mutex_unlock(&lock);
        return code;
    }
    if (gpu != NULL) {
        *gpu = g;
    }
    return NVML_SUCCESS;
}

static int finish(jvalue *state, int rc) {
    release_state(state);
    pthread_mutex_unlock(&lock);
    return rc;
}

static int copy_string(char *dst, unsigned int length, const char *src) {
    if (dst == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    size_t n = strlen(src);
    if (n + 1 > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

static const char *gpu_string(const jvalue *gpu, const char *key, const char *fallback) {
    const jvalue *v = json_get(gpu, key);
    return (v != NULL && v->type == J_STRING) ? v->text : fallback;
}

static unsigned int gpu_minor(const jvalue *gpu, size_t slot) {
    unsigned long long minor;
    if (json_u64(json_get(gpu, "minor"), &minor) == 0) {
        return (unsigned int)minor;
    }
    return (unsigned int)slot;
}

static void open_device_file(const char *name, int *fd) {
    const char *dir = setting("FAKENVML_DEVICES_DIR");
    if (dir == NULL || *dir == '\0' || *fd >= 0) {
        return;
    }
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    *fd = open(path, O_RDWR | O_CLOEXEC);
    if (*fd < 0) {
        *fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    if (*fd < 0) {
        complain("cannot open %s: %s", path, strerror(errno));
    }
}

/* The first handle lookup of a GPU "attaches" it, as the real driver does. */
static void attach_gpu(const jvalue *gpu, size_t slot) {
    char name[64];
    snprintf(name, sizeof name, "nvidia%u", gpu_minor(gpu, slot));
    open_device_file(name, &gpu_fds[slot]);
}

/* ---- init and shutdown -------------------------------------------------------------------- */

static int do_init(const char *fn) {
    pthread_mutex_lock(&lock);
    reset_fds();
    jvalue state;
    if (load_state(&state) != 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNKNOWN;
    }
    long long code;
    int rc = NVML_SUCCESS;
    if (!json_is_null(json_get(&state, "init_error")) &&
        json_i64(json_get(&state, "init_error"), &code) == 0 && code != 0) {
        rc = (int)code;
    } else if ((rc = forced_error(json_get(&state, "errors"), fn)) < 0) {
        rc = NVML_SUCCESS;
    }
    double delay = delay_for(&state, NULL, fn);
    release_state(&state);
    if (delay > 0) {
        pthread_mutex_unlock(&lock);
        sleep_seconds(delay);
        pthread_mutex_lock(&lock);
    }
    if (rc == NVML_SUCCESS) {
        if (init_count++ == 0) {
            open_device_file("nvidiactl", &ctl_fd);
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

EXPORT int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init("nvmlInitWithFlags");
}

EXPORT int nvmlInit_v2(void) { return do_init("nvmlInit_v2"); }

EXPORT int nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    reset_fds();
    if (init_count == 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    if (--init_count == 0) {
        if (ctl_fd >= 0) {
            close(ctl_fd);
            ctl_fd = -1;
        }
        for (int i = 0; i < MAX_GPUS; i++) {
            if (gpu_fds[i] >= 0) {
                close(gpu_fds[i]);
                gpu_fds[i] = -1;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(int result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 25: return "Struct version mismatch";
    case 29: return "Invalid state";
    default: return "Unknown Error";
    }
}

/* ---- system and enumeration --------------------------------------------------------------- */

EXPORT int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    jvalue state;
    int rc = begin("nvmlSystemGetDriverVersion", NO_DEVICE, &state, NULL);
    if (rc != NVML_SUCCESS) return rc;
    return finish(&state, copy_string(version, length, gpu_string(&state, "driver_version",
                                                                   "550.54.15")));
}

EXPORT int nvmlDeviceGetCount_v2(unsigned int *count) {
    jvalue state;
    int rc = begin("nvmlDeviceGetCount_v2", NO_DEVICE, &state, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (count == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned int)gpu_count(&state);
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    jvalue state;
    const jvalue *gpu;
    if (device == NULL || index >= MAX_GPUS) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = begin("nvmlDeviceGetHandleByIndex_v2", (long)index, &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    attach_gpu(gpu, index);
    *device = &devices[index];
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    const char *fn = "nvmlDeviceGetHandleByUUID";
    jvalue state;
    int rc = begin(fn, NO_DEVICE, &state, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (uuid == NULL || device == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    size_t n = gpu_count(&state);
    for (size_t i = 0; i < n; i++) {
        const jvalue *gpu = gpu_at(&state, i);
        if (strcmp(gpu_string(gpu, "uuid", ""), uuid) == 0) {
            int code = verdict(&state, gpu, fn);
            if (code >= 0) return finish(&state, code);
            attach_gpu(gpu, i);
            *device = &devices[i];
            return finish(&state, NVML_SUCCESS);
        }
    }
    return finish(&state, NVML_ERROR_NOT_FOUND);
}

/* ---- MIG: instances, their handles and what they answer ------------------------------------ */

/* The GPU's current MIG mode: missing 0, null or not a number -1 (no MIG support). */
static int mig_mode_of(const jvalue *gpu) {
    long long mode = 0;
    const jvalue *v = json_get(gpu, "mig_mode");
    if (v == NULL) return 0;
    if (json_i64(v, &mode) != 0) return -1;
    return (int)mode;
}

static const jvalue *mig_list(const jvalue *gpu) {
    const jvalue *list = json_get(gpu, "mig_devices");
    return (list != NULL && list->type == J_ARRAY) ? list : NULL;
}

/* The MIG device at `index` of `gpu`; NULL when MIG is off, past the list, or a hole (null). */
static const jvalue *mig_entry(const jvalue *gpu, size_t index) {
    if (mig_mode_of(gpu) != 1) return NULL;
    const jvalue *list = mig_list(gpu);
    if (list == NULL || index >= list->count || index >= MAX_MIG) return NULL;
    const jvalue *entry = &list->items[index];
    return entry->type == J_OBJECT ? entry : NULL;
}

static unsigned int mig_id(const jvalue *entry, const char *key, unsigned int fallback) {
    unsigned long long value;
    if (json_u64(json_get(entry, key), &value) == 0) return (unsigned int)value;
    return fallback;
}

static int is_mig_handle(nvmlDevice_t device) {
    return device != NULL && device >= &mig_handles[0] && device < &mig_handles[MAX_GPUS * MAX_MIG];
}

/*
 * begin() for any device handle. A MIG handle answers with its parent's "lost" and forced
 * errors, then its own "errors"; a handle whose MIG device is gone since (destroyed, MIG off)
 * is INVALID_ARGUMENT. `*mig` is the MIG device's entry, or NULL for a whole-GPU handle.
 */
static int begin_device(const char *fn, nvmlDevice_t device, jvalue *state, const jvalue **gpu,
                        const jvalue **mig) {
    *mig = NULL;
    if (!is_mig_handle(device)) return begin(fn, slot_of(device), state, gpu);
    int rc = begin(fn, device->slot / MAX_MIG, state, gpu);
    if (rc != NVML_SUCCESS) return rc;
    const jvalue *entry = mig_entry(*gpu, (size_t)(device->slot % MAX_MIG));
    if (entry == NULL) return finish(state, NVML_ERROR_INVALID_ARGUMENT);
    int code = forced_error(json_get(entry, "errors"), fn);
    if (code > 0) return finish(state, code);
    *mig = entry;
    return NVML_SUCCESS;
}

/* Whether `entry` is the first MIG device of its GPU instance (its memory counts once). */
static int first_of_gi(const jvalue *gpu, const jvalue *entry) {
    const jvalue *list = mig_list(gpu);
    unsigned int gi = mig_id(entry, "gi", 0);
    for (size_t i = 0; list != NULL && i < list->count && i < MAX_MIG; i++) {
        const jvalue *other = &list->items[i];
        if (other->type != J_OBJECT) continue;
        if (other == entry) return 1;
        if (mig_id(other, "gi", 0) == gi) return 0;
    }
    return 1;
}

/* ---- per-device queries ------------------------------------------------------------------- */

EXPORT int nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    jvalue state;
    const jvalue *gpu;
    const jvalue *mig;
    int rc = begin_device("nvmlDeviceGetUUID", device, &state, &gpu, &mig);
    if (rc != NVML_SUCCESS) return rc;
    char fallback[64];
    if (mig != NULL) {
        snprintf(fallback, sizeof fallback, "MIG-%08x-0000-4000-8000-%012x",
                 (unsigned int)(device->slot / MAX_MIG), (unsigned int)(device->slot % MAX_MIG));
        return finish(&state, copy_string(uuid, length, gpu_string(mig, "uuid", fallback)));
    }
    snprintf(fallback, sizeof fallback, "GPU-00000000-0000-0000-0000-%012d", device->slot);
    return finish(&state, copy_string(uuid, length, gpu_string(gpu, "uuid", fallback)));
}

EXPORT int nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    jvalue state;
    const jvalue *gpu;
    const jvalue *mig;
    int rc = begin_device("nvmlDeviceGetName", device, &state, &gpu, &mig);
    if (rc != NVML_SUCCESS) return rc;
    const char *whole = gpu_string(gpu, "name", "NVIDIA H100 80GB HBM3");
    if (mig != NULL) {
        /* As the real driver names a MIG device: "<GPU name> MIG <profile>". */
        char text[160];
        snprintf(text, sizeof text, "%s MIG %s", whole, gpu_string(mig, "profile", "1g.10gb"));
        return finish(&state, copy_string(name, length, text));
    }
    return finish(&state, copy_string(name, length, whole));
}

EXPORT int nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetMinorNumber", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (minor == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    *minor = gpu_minor(gpu, (size_t)device->slot);
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetPciInfo_v3", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (pci == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    char fallback[32];
    snprintf(fallback, sizeof fallback, "00000000:%02X:00.0", 0x10 + device->slot);
    const char *bus_id = gpu_string(gpu, "pci_bus_id", fallback);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", bus_id);
    unsigned int domain = 0, bus = 0, dev = 0, function = 0;
    if (sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &function) == 4) {
        pci->domain = domain;
        pci->bus = bus;
        pci->device = dev;
    }
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain & 0xFFFF,
             bus & 0xFF, dev & 0xFF, function & 0xF);
    pci->pciDeviceId = 0x233010DEu;
    pci->pciSubSystemId = 0x16C110DEu;
    return finish(&state, NVML_SUCCESS);
}

/*
 * Memory as the state gives it: allocated ("used") and reserved default to 0, free to the rest.
 * `holder` is a GPU or a MIG device entry. A MIG device answers its GPU instance's memory (its
 * own "memory"; compute instances of one GPU instance share it). A whole GPU with MIG on answers
 * the aggregate, as NVML does for a privileged caller: its own "used" (what belongs to no
 * instance) plus each GPU instance's, counted once.
 */
static void gpu_memory(const jvalue *gpu, const jvalue *holder, unsigned long long *total,
                       unsigned long long *free_, unsigned long long *reserved,
                       unsigned long long *allocated) {
    const jvalue *memory = json_get(holder, "memory");
    *total = holder == gpu ? 80ULL << 30 : 10ULL << 30;
    *reserved = 0;
    *allocated = 0;
    (void)json_u64(json_get(memory, "total"), total);
    (void)json_u64(json_get(memory, "reserved"), reserved);
    (void)json_u64(json_get(memory, "used"), allocated);
    const jvalue *list = holder == gpu && mig_mode_of(gpu) == 1 ? mig_list(gpu) : NULL;
    for (size_t i = 0; list != NULL && i < list->count && i < MAX_MIG; i++) {
        const jvalue *entry = &list->items[i];
        unsigned long long used = 0;
        if (entry->type != J_OBJECT || !first_of_gi(gpu, entry)) continue;
        (void)json_u64(json_get(json_get(entry, "memory"), "used"), &used);
        *allocated += used;
    }
    unsigned long long taken = *reserved + *allocated;
    *free_ = taken < *total ? *total - taken : 0;
    (void)json_u64(json_get(memory, "free"), free_);
}

EXPORT int nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    jvalue state;
    const jvalue *gpu, *mig;
    int rc = begin_device("nvmlDeviceGetMemoryInfo", device, &state, &gpu, &mig);
    if (rc != NVML_SUCCESS) return rc;
    if (memory == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long total, free_, reserved, allocated;
    gpu_memory(gpu, mig != NULL ? mig : gpu, &total, &free_, &reserved, &allocated);
    memory->total = total;
    memory->free = free_;
    /* v1 "used" is everything not free: the driver's reservation included. */
    memory->used = total > free_ ? total - free_ : 0;
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    jvalue state;
    const jvalue *gpu, *mig;
    int rc = begin_device("nvmlDeviceGetMemoryInfo_v2", device, &state, &gpu, &mig);
    if (rc != NVML_SUCCESS) return rc;
    if (memory == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    if (!json_truthy(json_get(gpu, "v2_memory"), 1)) return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    if (memory->version != NVML_MEMORY_V2_VERSION) {
        return finish(&state, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    unsigned long long total, free_, reserved, allocated;
    gpu_memory(gpu, mig != NULL ? mig : gpu, &total, &free_, &reserved, &allocated);
    memory->total = total;
    memory->reserved = reserved;
    memory->free = free_;
    memory->used = allocated;
    return finish(&state, NVML_SUCCESS);
}

/* Appends the `kind` list of `holder` with instance ids gi/ci; returns the new count. */
static size_t add_processes(const jvalue *holder, const char *kind, unsigned int gi,
                            unsigned int ci, nvmlProcessInfo_t *infos, size_t at, size_t room) {
    const jvalue *list = json_get(json_get(holder, "processes"), kind);
    size_t n = (list != NULL && list->type == J_ARRAY) ? list->count : 0;
    for (size_t i = 0; i < n; i++, at++) {
        if (infos == NULL || at >= room) continue;
        const jvalue *entry = &list->items[i];
        unsigned long long pid = 0, used = VALUE_NOT_AVAILABLE;
        (void)json_u64(json_get(entry, "pid"), &pid);
        const jvalue *memory = json_get(entry, "used_memory");
        if (!json_is_null(memory)) {
            (void)json_u64(memory, &used);
        }
        infos[at].pid = (unsigned int)pid;
        infos[at].usedGpuMemory = used;
        infos[at].gpuInstanceId = gi;
        infos[at].computeInstanceId = ci;
    }
    return at;
}

/*
 * Every entry of the list: a MIG device's own processes carry its GPU and compute instance
 * ids; a whole GPU with MIG on lists every instance's processes (the aggregate a privileged
 * caller gets), each with its instance's ids; without MIG both ids are 0xFFFFFFFF.
 */
static size_t fill_processes(const jvalue *gpu, const jvalue *mig, const char *kind,
                             nvmlProcessInfo_t *infos, size_t room) {
    if (mig != NULL) {
        return add_processes(mig, kind, mig_id(mig, "gi", 0), mig_id(mig, "ci", 0), infos, 0,
                             room);
    }
    const jvalue *list = mig_mode_of(gpu) == 1 ? mig_list(gpu) : NULL;
    if (list == NULL) return add_processes(gpu, kind, 0xFFFFFFFFu, 0xFFFFFFFFu, infos, 0, room);
    size_t at = 0;
    for (size_t i = 0; i < list->count && i < MAX_MIG; i++) {
        const jvalue *entry = &list->items[i];
        if (entry->type != J_OBJECT) continue;
        at = add_processes(entry, kind, mig_id(entry, "gi", 0), mig_id(entry, "ci", 0), infos,
                           at, room);
    }
    return at;
}

/* The size-probe-then-fill protocol shared by all process-list functions. */
static int list_processes(const char *fn, const char *kind, nvmlDevice_t device,
                          unsigned int *count, nvmlProcessInfo_t *infos) {
    jvalue state;
    const jvalue *gpu, *mig;
    int rc = begin_device(fn, device, &state, &gpu, &mig);
    if (rc != NVML_SUCCESS) return rc;
    if (count == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    size_t n = fill_processes(gpu, mig, kind, NULL, 0);
    if (n == 0) {
        *count = 0;
        return finish(&state, NVML_SUCCESS);
    }
    if (infos == NULL || *count < n) {
        *count = (unsigned int)n;
        return finish(&state, NVML_ERROR_INSUFFICIENT_SIZE);
    }
    *count = (unsigned int)fill_processes(gpu, mig, kind, infos, n);
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c,
                                                   nvmlProcessInfo_t *p) {
    return list_processes("nvmlDeviceGetComputeRunningProcesses_v3", "compute", d, c, p);
}

EXPORT int nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c,
                                                   nvmlProcessInfo_t *p) {
    return list_processes("nvmlDeviceGetComputeRunningProcesses_v2", "compute", d, c, p);
}

EXPORT int nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *c,
                                                    nvmlProcessInfo_t *p) {
    return list_processes("nvmlDeviceGetGraphicsRunningProcesses_v3", "graphics", d, c, p);
}

EXPORT int nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *c,
                                                    nvmlProcessInfo_t *p) {
    return list_processes("nvmlDeviceGetGraphicsRunningProcesses_v2", "graphics", d, c, p);
}

EXPORT int nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c,
                                                      nvmlProcessInfo_t *p) {
    return list_processes("nvmlDeviceGetMPSComputeRunningProcesses_v3", "mps", d, c, p);
}

EXPORT int nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c,
                                                      nvmlProcessInfo_t *p) {
    return list_processes("nvmlDeviceGetMPSComputeRunningProcesses_v2", "mps", d, c, p);
}

/* Reads an unsigned setting of the GPU; a null or missing value means NOT_SUPPORTED. */
static int gpu_setting(const char *fn, const char *key, long long fallback, nvmlDevice_t device,
                       long long *out) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin(fn, slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    const jvalue *v = json_get(gpu, key);
    if (v == NULL && fallback >= 0) {
        *out = fallback;
        return finish(&state, NVML_SUCCESS);
    }
    if (json_is_null(v) || json_i64(v, out) != 0) return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch) {
    long long value = 0;
    if (arch == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    /* Missing means 9 (NVML_DEVICE_ARCH_HOPPER), like the H100s the fake describes. */
    int rc = gpu_setting("nvmlDeviceGetArchitecture", "architecture", 9, device, &value);
    if (rc == NVML_SUCCESS) *arch = (unsigned int)value;
    return rc;
}

/*
 * "nvlink_links": N (links 0..N-1 exist; missing means the GPU has no NVLink: NOT_SUPPORTED)
 * and "nvlink_active": M (the first M of them are active).
 */
EXPORT int nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                    unsigned int *isActive) {
    long long links = 0, active = 0;
    if (isActive == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = gpu_setting("nvmlDeviceGetNvLinkState", "nvlink_links", -1, device, &links);
    if (rc != NVML_SUCCESS) return rc;
    if ((long long)link >= links) return NVML_ERROR_INVALID_ARGUMENT;
    if (gpu_setting("nvmlDeviceGetNvLinkState", "nvlink_active", 0, device, &active) !=
        NVML_SUCCESS) {
        active = 0;
    }
    *isActive = (long long)link < active ? 1u : 0u;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    long long mode = 0, next;
    if (current == NULL || pending == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = gpu_setting("nvmlDeviceGetMigMode", "mig_mode", 0, device, &mode);
    if (rc != NVML_SUCCESS) return rc;
    if (gpu_setting("nvmlDeviceGetMigMode", "mig_pending", mode, device, &next) != NVML_SUCCESS) {
        next = mode;
    }
    *current = (unsigned int)mode;
    *pending = (unsigned int)next;
    return NVML_SUCCESS;
}

/* nvmlGpuInstancePlacement_t and nvmlGpuInstanceInfo_t, as nvml.h and pynvml lay them out. */
typedef struct {
    unsigned int start;
    unsigned int size;
} nvmlGpuInstancePlacement_t;

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

EXPORT int nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetMaxMigDeviceCount", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (count == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    if (mig_mode_of(gpu) != 1) {
        *count = 0; /* "zero if MIG is not supported or enabled" */
        return finish(&state, NVML_SUCCESS);
    }
    unsigned int most = 7; /* the most MIG devices of an A100/H100/H200 */
    const jvalue *list = mig_list(gpu);
    if (list != NULL && list->count > most) most = list->count > MAX_MIG ? MAX_MIG : list->count;
    *count = most;
    return finish(&state, NVML_SUCCESS);
}

/*
 * The MIG device at `index` (0 .. max count - 1): NOT_FOUND when none is there (MIG off, a
 * hole in the list, past its end), INVALID_ARGUMENT past the max count, NOT_SUPPORTED without
 * MIG support.
 */
EXPORT int nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                               nvmlDevice_t *migDevice) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetMigDeviceHandleByIndex", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (migDevice == NULL || index >= MAX_MIG) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    if (mig_mode_of(gpu) < 0) return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    if (mig_entry(gpu, index) == NULL) return finish(&state, NVML_ERROR_NOT_FOUND);
    *migDevice = &mig_handles[device->slot * MAX_MIG + (int)index];
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    if (isMigDevice == NULL || (!is_mig_handle(device) && slot_of(device) < 0)) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *isMigDevice = is_mig_handle(device) ? 1u : 0u;
    return NVML_SUCCESS;
}

/* The GPU instance id ("gi") or compute instance id ("ci") of a MIG device handle. */
static int instance_id(const char *fn, const char *key, nvmlDevice_t device, unsigned int *id) {
    jvalue state;
    const jvalue *gpu, *mig;
    if (id == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!is_mig_handle(device)) {
        /* A whole GPU's handle has no instance id: NOT_SUPPORTED, as nvml.h says. */
        if (slot_of(device) < 0) return NVML_ERROR_INVALID_ARGUMENT;
        int rc = begin(fn, slot_of(device), &state, &gpu);
        if (rc != NVML_SUCCESS) return rc;
        return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    }
    int rc = begin_device(fn, device, &state, &gpu, &mig);
    if (rc != NVML_SUCCESS) return rc;
    *id = mig_id(mig, key, 0);
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    return instance_id("nvmlDeviceGetGpuInstanceId", "gi", device, id);
}

EXPORT int nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    return instance_id("nvmlDeviceGetComputeInstanceId", "ci", device, id);
}

EXPORT int nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                        nvmlDevice_t *device) {
    jvalue state;
    const jvalue *gpu, *mig;
    if (device == NULL || !is_mig_handle(migDevice)) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = begin_device("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice, &state, &gpu,
                          &mig);
    if (rc != NVML_SUCCESS) return rc;
    *device = &devices[migDevice->slot / MAX_MIG];
    return finish(&state, NVML_SUCCESS);
}

/* A GPU instance by id: NOT_FOUND when no MIG device of the GPU has that "gi". */
EXPORT int nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                        nvmlGpuInstance_t *gpuInstance) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetGpuInstanceById", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (gpuInstance == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    if (mig_mode_of(gpu) != 1) return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    for (size_t i = 0; i < MAX_MIG; i++) {
        const jvalue *entry = mig_entry(gpu, i);
        if (entry != NULL && mig_id(entry, "gi", 0) == id) {
            fake_gpu_instance *gi = &gi_handles[device->slot * MAX_MIG + (int)i];
            gi->slot = device->slot * MAX_MIG + (int)i;
            gi->id = id;
            *gpuInstance = gi;
            return finish(&state, NVML_SUCCESS);
        }
    }
    return finish(&state, NVML_ERROR_NOT_FOUND);
}

/* Its profile id ("gi_profile_id", default 0) and placement ("placement": {start, size}). */
EXPORT int nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    jvalue state;
    const jvalue *gpu;
    if (info == NULL || gpuInstance == NULL || gpuInstance < &gi_handles[0] ||
        gpuInstance >= &gi_handles[MAX_GPUS * MAX_MIG]) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    int slot = gpuInstance->slot / MAX_MIG;
    int rc = begin("nvmlGpuInstanceGetInfo", slot, &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    const jvalue *entry = mig_entry(gpu, (size_t)(gpuInstance->slot % MAX_MIG));
    if (entry == NULL || mig_id(entry, "gi", 0) != gpuInstance->id) {
        return finish(&state, NVML_ERROR_INVALID_ARGUMENT); /* destroyed since */
    }
    const jvalue *placement = json_get(entry, "placement");
    info->device = &devices[slot];
    info->id = gpuInstance->id;
    info->profileId = mig_id(entry, "gi_profile_id", 0);
    info->placement.start = mig_id(placement, "start", 0);
    info->placement.size = mig_id(placement, "size", 1);
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceGetPersistenceMode(nvmlDevice_t device, unsigned int *mode) {
    long long value = 0;
    if (mode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = gpu_setting("nvmlDeviceGetPersistenceMode", "persistence_mode", 1, device, &value);
    if (rc == NVML_SUCCESS) *mode = (unsigned int)value;
    return rc;
}

EXPORT int nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    long long value = 0;
    if (node == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    /* Missing means NOT_SUPPORTED: only coherent-memory systems have GPU NUMA nodes. */
    int rc = gpu_setting("nvmlDeviceGetNumaNodeId", "numa_node", -1, device, &value);
    if (rc == NVML_SUCCESS) *node = (unsigned int)value;
    return rc;
}

/* ---- health: field values, row remapping, retired pages ----------------------------------- */

#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230u
#define NVML_VALUE_TYPE_UNSIGNED_INT 1u

/*
 * "recovery_action": N answers field 230 (missing or null: NOT_SUPPORTED in that value's
 * nvmlReturn, as a driver before R570 does); "field_errors": {"230": code} forces one field's
 * nvmlReturn. Any other field id answers NOT_SUPPORTED. The call itself succeeds.
 */
EXPORT int nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetFieldValues", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (values == NULL || count < 0) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        char id[16];
        snprintf(id, sizeof id, "%u", v->fieldId);
        v->timestamp = (long long)now.tv_sec * 1000000LL + now.tv_nsec / 1000;
        v->latencyUsec = 0;
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        memset(&v->value, 0, sizeof v->value);
        int forced = forced_error(json_get(gpu, "field_errors"), id);
        const jvalue *action = json_get(gpu, "recovery_action");
        unsigned long long number = 0;
        if (forced >= 0) {
            v->nvmlReturn = (unsigned int)forced;
        } else if (v->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION && !json_is_null(action) &&
                   json_u64(action, &number) == 0) {
            v->nvmlReturn = NVML_SUCCESS;
            v->value.uiVal = (unsigned int)number;
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return finish(&state, NVML_SUCCESS);
}

/* "remapped_rows": {"correctable", "uncorrectable", "pending", "failure"}; missing/null: NOT_SUPPORTED. */
EXPORT int nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corr, unsigned int *unc,
                                     unsigned int *pending, unsigned int *failure) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetRemappedRows", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (corr == NULL || unc == NULL || pending == NULL || failure == NULL) {
        return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    }
    const jvalue *rows = json_get(gpu, "remapped_rows");
    if (rows == NULL || rows->type != J_OBJECT) return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    unsigned long long c = 0, u = 0;
    (void)json_u64(json_get(rows, "correctable"), &c);
    (void)json_u64(json_get(rows, "uncorrectable"), &u);
    *corr = (unsigned int)c;
    *unc = (unsigned int)u;
    *pending = (unsigned int)json_truthy(json_get(rows, "pending"), 0);
    *failure = (unsigned int)json_truthy(json_get(rows, "failure"), 0);
    return finish(&state, NVML_SUCCESS);
}

/*
 * "retired_pages": {"single_bit": [addresses], "double_bit": [addresses], "pending": bool};
 * missing/null: NOT_SUPPORTED (Ampere and later use row remapping instead). Cause 0 is
 * multiple single-bit ECC errors, 1 a double-bit ECC error. Size probe as the process lists.
 */
EXPORT int nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, unsigned int cause,
                                        unsigned int *count, unsigned long long *addresses,
                                        unsigned long long *timestamps) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetRetiredPages_v2", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (count == NULL || cause > 1) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    const jvalue *pages = json_get(gpu, "retired_pages");
    if (pages == NULL || pages->type != J_OBJECT) return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    const jvalue *list = json_get(pages, cause == 0 ? "single_bit" : "double_bit");
    size_t n = (list != NULL && list->type == J_ARRAY) ? list->count : 0;
    if (n == 0) {
        *count = 0;
        return finish(&state, NVML_SUCCESS);
    }
    if (addresses == NULL || *count < n) {
        *count = (unsigned int)n;
        return finish(&state, NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (size_t i = 0; i < n; i++) {
        unsigned long long address = 0;
        (void)json_u64(&list->items[i], &address);
        addresses[i] = address;
        if (timestamps != NULL) timestamps[i] = 1700000000ULL + i;
    }
    *count = (unsigned int)n;
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, unsigned int *pending) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetRetiredPagesPendingStatus", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (pending == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    const jvalue *pages = json_get(gpu, "retired_pages");
    if (pages == NULL || pages->type != J_OBJECT) return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    *pending = (unsigned int)json_truthy(json_get(pages, "pending"), 0);
    return finish(&state, NVML_SUCCESS);
}

/* ---- the NVLink fabric (NVSwitch systems) ------------------------------------------------ */

/*
 * nvmlGpuFabricInfo_v2_t / _v3_t as nvml.h and pynvml lay them out: version, clusterUuid[16],
 * status (nvmlReturn_t), cliqueId, state (nvmlGpuFabricState_t), healthMask, and in v3 one more
 * byte, healthSummary. The version word is NVML_STRUCT_VERSION: the struct's size | (n << 24).
 */
typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    int status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
    unsigned char healthSummary; /* v3 only */
} nvmlGpuFabricInfo_v3_t;

#define NVML_GPU_FABRIC_INFO_V2 (0x02000000u | 36u)
#define NVML_GPU_FABRIC_INFO_V3 (0x03000000u | (unsigned int)sizeof(nvmlGpuFabricInfo_v3_t))
_Static_assert(sizeof(nvmlGpuFabricInfo_v3_t) == 40, "nvmlGpuFabricInfo_v3_t is 40 bytes");

/*
 * "fabric": {"state": 0-3, "status": NVML code of the probe, "health_mask": N,
 * "health_summary": N, "clique_id": N, "max_version": 2 or 3 (default 3)}; missing or null:
 * NOT_SUPPORTED (no NVSwitch fabric). A struct version above max_version, or one this library
 * does not know, answers NVML_ERROR_ARGUMENT_VERSION_MISMATCH, as an older driver does; a v2
 * caller gets nothing written past its 36 bytes.
 */
EXPORT int nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfo_v3_t *info) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetGpuFabricInfoV", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (info == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    const jvalue *fabric = json_get(gpu, "fabric");
    if (fabric == NULL || fabric->type != J_OBJECT) return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    unsigned long long max_version = 3, value = 0;
    (void)json_u64(json_get(fabric, "max_version"), &max_version);
    unsigned int version = info->version;
    int v3 = version == NVML_GPU_FABRIC_INFO_V3;
    if (!(v3 || version == NVML_GPU_FABRIC_INFO_V2) || (v3 && max_version < 3)) {
        return finish(&state, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    memset(info->clusterUuid, 0xab, sizeof info->clusterUuid);
    long long status = 0;
    (void)json_i64(json_get(fabric, "status"), &status);
    info->status = (int)status;
    value = 0;
    (void)json_u64(json_get(fabric, "clique_id"), &value);
    info->cliqueId = (unsigned int)value;
    value = 0;
    (void)json_u64(json_get(fabric, "state"), &value);
    info->state = (unsigned int)value;
    value = 0;
    (void)json_u64(json_get(fabric, "health_mask"), &value);
    info->healthMask = (unsigned int)value;
    if (v3) {
        value = 0;
        (void)json_u64(json_get(fabric, "health_summary"), &value);
        info->healthSummary = (unsigned char)value;
    }
    return finish(&state, NVML_SUCCESS);
}

/* ---- events ------------------------------------------------------------------------------- */

#define EVENT_XID 0x8ULL
#define EVENT_RECOVERY_ACTION 0x8000ULL
#define MAX_EVENT_SETS 8
#define MAX_CONSUMED 4096

typedef struct {
    void *device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/* An event set: which event types each GPU slot is registered for. */
typedef struct {
    int used;
    unsigned long long registered[MAX_GPUS];
} fake_event_set;

typedef fake_event_set *nvmlEventSet_t;

static fake_event_set event_sets[MAX_EVENT_SETS];

/*
 * Scripted events are delivered once: the "id" of each delivered event is appended to
 * $FAKENVML_EVENTS_CONSUMED (default: the state file's path + ".consumed"), which survives a
 * restart of the process that loaded the library, as an event read by one worker is gone for
 * the next one.
 */
static void consumed_path(char *out, size_t size) {
    const char *path = getenv("FAKENVML_EVENTS_CONSUMED");
    if (path != NULL && *path != '\0') {
        snprintf(out, size, "%s", path);
        return;
    }
    const char *stateful = setting("FAKENVML_STATE");
    snprintf(out, size, "%s.consumed", stateful ? stateful : "fakenvml-state");
}

static int event_consumed(const char *id) {
    char path[PATH_MAX];
    consumed_path(path, sizeof path);
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    char line[256];
    int found = 0;
    while (!found && fgets(line, sizeof line, f) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        found = strcmp(line, id) == 0;
    }
    fclose(f);
    return found;
}

static void consume_event(const char *id) {
    char path[PATH_MAX];
    consumed_path(path, sizeof path);
    FILE *f = fopen(path, "a");
    if (f == NULL) {
        complain("cannot record consumed event in %s: %s", path, strerror(errno));
        return;
    }
    fprintf(f, "%s\n", id);
    fclose(f);
}

EXPORT int nvmlEventSetCreate(nvmlEventSet_t *set) {
    jvalue state;
    int rc = begin("nvmlEventSetCreate", NO_DEVICE, &state, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (set == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < MAX_EVENT_SETS; i++) {
        if (!event_sets[i].used) {
            memset(&event_sets[i], 0, sizeof event_sets[i]);
            event_sets[i].used = 1;
            *set = &event_sets[i];
            return finish(&state, NVML_SUCCESS);
        }
    }
    return finish(&state, NVML_ERROR_UNKNOWN);
}

static int valid_set(nvmlEventSet_t set) {
    return set != NULL && set >= &event_sets[0] && set < &event_sets[MAX_EVENT_SETS] && set->used;
}

EXPORT int nvmlEventSetFree(nvmlEventSet_t set) {
    jvalue state;
    int rc = begin("nvmlEventSetFree", NO_DEVICE, &state, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!valid_set(set)) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    set->used = 0;
    return finish(&state, NVML_SUCCESS);
}

/* "event_types": the mask of supported event types (default: Xid | GPU recovery action). */
static unsigned long long supported_events(const jvalue *gpu) {
    unsigned long long mask = EVENT_XID | EVENT_RECOVERY_ACTION;
    (void)json_u64(json_get(gpu, "event_types"), &mask);
    return mask;
}

EXPORT int nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceGetSupportedEventTypes", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (types == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    *types = supported_events(gpu);
    return finish(&state, NVML_SUCCESS);
}

EXPORT int nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                    nvmlEventSet_t set) {
    jvalue state;
    const jvalue *gpu;
    int rc = begin("nvmlDeviceRegisterEvents", slot_of(device), &state, &gpu);
    if (rc != NVML_SUCCESS) return rc;
    if (!valid_set(set)) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    if ((types & ~supported_events(gpu)) != 0) return finish(&state, NVML_ERROR_NOT_SUPPORTED);
    set->registered[device->slot] |= types;
    return finish(&state, NVML_SUCCESS);
}

/*
 * "events": [{"id": "e1", "gpu": 0, "type": 8, "data": 95}, ...] at the top of the state: the
 * first one not yet consumed whose GPU (by position) is registered for its type is delivered.
 * A lost GPU registered in the set makes every wait answer GPU_IS_LOST, the others' events too.
 * With none, the call sleeps for the timeout (the lock released) and answers TIMEOUT, like the
 * real library; a test that writes an event meanwhile has it seen at the next call.
 */
EXPORT int nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms) {
    jvalue state;
    int rc = begin("nvmlEventSetWait_v2", NO_DEVICE, &state, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!valid_set(set) || data == NULL) return finish(&state, NVML_ERROR_INVALID_ARGUMENT);
    for (size_t slot = 0; slot < gpu_count(&state); slot++) {
        if (set->registered[slot] != 0 && json_truthy(json_get(gpu_at(&state, slot), "lost"), 0)) {
            return finish(&state, NVML_ERROR_GPU_IS_LOST);
        }
    }
    const jvalue *events = json_get(&state, "events");
    size_t n = (events != NULL && events->type == J_ARRAY) ? events->count : 0;
    for (size_t i = 0; i < n && i < MAX_CONSUMED; i++) {
        const jvalue *event = &events->items[i];
        unsigned long long slot = 0, type = EVENT_XID, payload = 0;
        (void)json_u64(json_get(event, "gpu"), &slot);
        (void)json_u64(json_get(event, "type"), &type);
        (void)json_u64(json_get(event, "data"), &payload);
        char fallback[32];
        snprintf(fallback, sizeof fallback, "event-%zu", i);
        const char *id = gpu_string(event, "id", fallback);
        if (slot >= gpu_count(&state) || (set->registered[slot] & type) == 0) continue;
        if (event_consumed(id)) continue;
        consume_event(id);
        memset(data, 0, sizeof *data);
        data->device = &devices[slot];
        data->eventType = type;
        data->eventData = payload;
        data->gpuInstanceId = 0xFFFFFFFFu;
        data->computeInstanceId = 0xFFFFFFFFu;
        return finish(&state, NVML_SUCCESS);
    }
    release_state(&state);
    pthread_mutex_unlock(&lock);
    sleep_seconds((double)timeout_ms / 1000.0);
    return NVML_ERROR_TIMEOUT;
}
