/* gyre_traj._ingest: the native half of the live ingest path (`Forest.ingest_frame`).
 *
 * Two things live here:
 *
 *   TreeState      the base class of `ExecutionTree`: the part of a tree's state that an agent's next
 *                  call writes (the arena's length and array, the logprob array, the policy segment
 *                  tables, the call table, the ingest counters), held in a C struct so that the fast
 *                  path below reads and writes it directly. Python code reads and writes the same
 *                  fields as ordinary attributes (`tree.n`, `tree._ids`, ...). `gyre_traj.native`
 *                  holds the pure-Python twin (a class with the same slots) used when this module
 *                  was not built.
 *
 *   Arena          where a tree's token ids live once it outgrows its first array (POSIX only): one
 *                  reserved range of address space, made readable and writable as the tree grows, so
 *                  that growing never moves or copies what is stored (views of it stay valid), and
 *                  recycled when its tree is dropped, so that the next tree writes into pages that are
 *                  already mapped rather than taking a page fault for each.
 *
 *   extend_next    one msgpack call message (as the proxy sends it) placed into its tree when it is an
 *                  agent's next call whose parent ends at the arena's last token: the message is parsed
 *                  here (no msgspec decode), its ids copied into the arena and its logprobs into the
 *                  tree's logprob array, each checked in the copy loop, and the call registered.
 *                  It returns the call's `CallInfo`, or None, leaving the tree as it was, for anything
 *                  it is not sure about (another kind of record, a field it does not know, a value out
 *                  of range, another array encoding, a parent it cannot extend in place, ...): the
 *                  Python path then takes the message and merges it or raises the RecordError it
 *                  always raised. It never raises for a bad message; only for a failure of Python
 *                  itself (memory).
 *
 * Everything here mirrors `ExecutionTree.extend_next` (tree.py) and the checks `CallView` / `Call`
 * make (io.py, records.py); tests/test_native_ingest.py compares the two on mutated messages.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define HAVE_ARENA 1
#endif

/* A string inside a message (UTF-8, not checked yet). */
typedef struct {
    const char *s;
    Py_ssize_t len;
} Str;

/* ------------------------------------------------------------------------------------------------ */
/* Configuration handed over once by gyre_traj.tree (`setup`).                                       */

#define MAX_ROLES 16

typedef struct {
    PyObject *call_info;    /* the CallInfo type */
    int n_roles;            /* the Role members, and their values as UTF-8 */
    PyObject *role[MAX_ROLES];
    Str role_value[MAX_ROLES];
    PyObject *stop;         /* "stop": finish_reason's default */
    PyObject *zero;         /* 0 */
    long long schema_version;
    long long max_weight_version;
    long long no_pending;   /* `_pend_lo` outside `add_batch` */
    int ready;
} Config;

static Config cfg;

/* Attribute names looked up per message, interned once. */
static PyObject *s_has_children, *s_end, *s_n_input, *s_n_output, *s_reserve,
    *s_grow_lps;

/* ------------------------------------------------------------------------------------------------ */
/* Arena                                                                                            */

#ifdef HAVE_ARENA

/* Address space reserved per arena: 4 GiB, a billion token ids. It costs no memory: the range is
 * mapped inaccessible (and so not counted against the system's commit limit) except for the part made
 * writable as the tree grows. A tree that outgrows it moves to a larger arena (`ExecutionTree._reserve`
 * copies it then). */
#define ARENA_RESERVE ((size_t)1 << 32)
/* Recycled arenas kept for the next trees: at most this many, each with at most this many bytes
 * written (a larger one is unmapped when its tree is dropped). */
#define ARENA_CACHE_SLOTS 4
#define ARENA_CACHE_MAX_BYTES ((size_t)256 << 20)
/* The tracemalloc domain the arenas' writable bytes are reported in (so that a memory measurement
 * with tracemalloc counts them, as it counts numpy's arrays). */
#define ARENA_TRACE_DOMAIN 0x67797265u

typedef struct {
    PyObject_HEAD
    char *base;
    size_t reserved;   /* bytes of address space */
    size_t size;       /* bytes readable and writable from `base`: the buffer it exports */
    size_t writable;   /* bytes made writable so far (>= size: a recycled arena's earlier extent) */
} Arena;

typedef struct {
    char *base;
    size_t reserved, writable;
} ArenaSlot;

static ArenaSlot arena_cache[ARENA_CACHE_SLOTS];
static int arena_cached;
static size_t page_size;

static size_t
round_pages(size_t n)
{
    return (n + page_size - 1) / page_size * page_size;
}

/* Make [0, nbytes) of `a` writable (and exported); 0, or -1 with OSError set. */
static int
arena_extend(Arena *a, size_t nbytes)
{
    if (nbytes > a->reserved) {
        PyErr_SetString(PyExc_ValueError, "past the arena's reserved range");
        return -1;
    }
    size_t want = round_pages(nbytes);
    if (want > a->writable) {
        if (mprotect(a->base + a->writable, want - a->writable, PROT_READ | PROT_WRITE) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        a->writable = want;
    }
    PyTraceMalloc_Untrack(ARENA_TRACE_DOMAIN, (uintptr_t)a->base);
    a->size = nbytes;
    PyTraceMalloc_Track(ARENA_TRACE_DOMAIN, (uintptr_t)a->base, nbytes);
    return 0;
}

static PyObject *
Arena_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nbytes", NULL};
    Py_ssize_t nbytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &nbytes))
        return NULL;
    if (nbytes < 0 || (size_t)nbytes > ARENA_RESERVE) {
        PyErr_Format(PyExc_ValueError, "an arena holds 0 to %zu bytes, not %zd", ARENA_RESERVE, nbytes);
        return NULL;
    }
    Arena *a = (Arena *)type->tp_alloc(type, 0);
    if (a == NULL)
        return NULL;
    if (arena_cached > 0) {
        ArenaSlot slot = arena_cache[--arena_cached];
        a->base = slot.base;
        a->reserved = slot.reserved;
        a->writable = slot.writable;
    } else {
        void *p = mmap(NULL, ARENA_RESERVE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS
#ifdef MAP_NORESERVE
                                                          | MAP_NORESERVE
#endif
                       , -1, 0);
        if (p == MAP_FAILED) {
            Py_DECREF(a);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        a->base = p;
        a->reserved = ARENA_RESERVE;
#ifdef MADV_HUGEPAGE
        /* (large pages where the kernel has them: fewer page faults and TLB misses as it fills) */
        (void)madvise(p, ARENA_RESERVE, MADV_HUGEPAGE);
#endif
    }
    if (arena_extend(a, (size_t)nbytes) < 0) {
        Py_DECREF(a);
        return NULL;
    }
    return (PyObject *)a;
}

static void
Arena_dealloc(Arena *a)
{
    if (a->base != NULL) {
        PyTraceMalloc_Untrack(ARENA_TRACE_DOMAIN, (uintptr_t)a->base);
        if (arena_cached < ARENA_CACHE_SLOTS && a->writable <= ARENA_CACHE_MAX_BYTES) {
            arena_cache[arena_cached++] = (ArenaSlot){a->base, a->reserved, a->writable};
        } else {
            munmap(a->base, a->reserved);
        }
    }
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *
Arena_grow(Arena *a, PyObject *arg)
{
    Py_ssize_t nbytes = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return NULL;
    }
    if ((size_t)nbytes <= a->size)
        Py_RETURN_TRUE;
    if ((size_t)nbytes > a->reserved)
        Py_RETURN_FALSE;
    if (arena_extend(a, (size_t)nbytes) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *
Arena_len_get(Arena *a, void *closure)
{
    return PyLong_FromSize_t(a->size);
}

static PyObject *
Arena_reserved_get(Arena *a, void *closure)
{
    return PyLong_FromSize_t(a->reserved);
}

static int
Arena_getbuffer(Arena *a, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)a, a->base, (Py_ssize_t)a->size, 0, flags);
}

static PyBufferProcs Arena_as_buffer = {
    .bf_getbuffer = (getbufferproc)Arena_getbuffer,
};

static PyMethodDef Arena_methods[] = {
    {"grow", (PyCFunction)Arena_grow, METH_O,
     "grow(nbytes) -> bool\n\nMake the first `nbytes` bytes readable and writable (what is stored stays "
     "where it is: views taken before stay valid and see the first bytes; a new view sees them all). "
     "False when `nbytes` is past the reserved range (nothing changed)."},
    {NULL},
};

static PyGetSetDef Arena_getset[] = {
    {"nbytes", (getter)Arena_len_get, NULL, "Bytes readable and writable (the buffer's length).", NULL},
    {"reserved", (getter)Arena_reserved_get, NULL, "Bytes of address space it may grow to.", NULL},
    {NULL},
};

static PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gyre_traj._ingest.Arena",
    .tp_basicsize = sizeof(Arena),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Arena(nbytes): a writable buffer of `nbytes` bytes that grows in place (`grow`), never "
              "moving what it holds; its contents start undefined, as numpy.empty's.",
    .tp_new = Arena_new,
    .tp_dealloc = (destructor)Arena_dealloc,
    .tp_as_buffer = &Arena_as_buffer,
    .tp_methods = Arena_methods,
    .tp_getset = Arena_getset,
};

#endif /* HAVE_ARENA */

/* ------------------------------------------------------------------------------------------------ */
/* TreeState                                                                                        */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;             /* tokens in the arena */
    long long pend_lo;        /* first pending node inside `add_batch`, else cfg.no_pending */
    Py_ssize_t lps_n;         /* logprobs written into `lps` */
    Py_ssize_t policy_count;  /* policy tokens */
    PyObject *execution_id;
    PyObject *ids;            /* the arena: int32 numpy array, capacity = its length */
    PyObject *lps;            /* the logprobs of the calls `extend_next` took: float32 numpy array */
    PyObject *calls;          /* dict: call id -> CallInfo */
    PyObject *order;          /* list of call ids */
    PyObject *seg_lo, *seg_hi, *seg_groups;  /* policy segments (lists) */
    PyObject *stats;          /* IngestStats */
    /* Counts of the calls `extend_next` took that are not in `stats` yet: added to it when `stats` is
     * next read (its getter), so that a call costs no attribute writes. */
    Py_ssize_t new_calls, new_call_tokens;
    /* The CallInfo of the last call `extend_next` took, with its end and length: the next call's
     * parent, most often (a CallInfo is immutable: when the parent is this object, these hold). */
    PyObject *last_info;
    Py_ssize_t last_end, last_length;
} TreeState;

static PyObject *s_calls, *s_call_tokens, *s_delta_calls;

static int
TreeState_traverse(TreeState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->execution_id);
    Py_VISIT(self->ids);
    Py_VISIT(self->lps);
    Py_VISIT(self->calls);
    Py_VISIT(self->order);
    Py_VISIT(self->seg_lo);
    Py_VISIT(self->seg_hi);
    Py_VISIT(self->seg_groups);
    Py_VISIT(self->stats);
    Py_VISIT(self->last_info);
    return 0;
}

static int
TreeState_clear(TreeState *self)
{
    Py_CLEAR(self->execution_id);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->lps);
    Py_CLEAR(self->calls);
    Py_CLEAR(self->order);
    Py_CLEAR(self->seg_lo);
    Py_CLEAR(self->seg_hi);
    Py_CLEAR(self->seg_groups);
    Py_CLEAR(self->stats);
    Py_CLEAR(self->last_info);
    return 0;
}

static void
TreeState_dealloc(TreeState *self)
{
    PyObject_GC_UnTrack(self);
    TreeState_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
TreeState_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    TreeState *self = (TreeState *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->pend_lo = cfg.no_pending;
    return (PyObject *)self;
}

/* The integer fields as Python ints: any int-like value is taken (numpy integers included). */
static PyObject *
int_get(TreeState *self, void *offset)
{
    char *field = (char *)self + (size_t)offset;
    if ((size_t)offset == offsetof(TreeState, pend_lo))
        return PyLong_FromLongLong(*(long long *)field);
    return PyLong_FromSsize_t(*(Py_ssize_t *)field);
}

static int
int_set(TreeState *self, PyObject *value, void *offset)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "this field cannot be deleted");
        return -1;
    }
    char *field = (char *)self + (size_t)offset;
    if ((size_t)offset == offsetof(TreeState, pend_lo)) {
        PyObject *idx = PyNumber_Index(value);
        if (idx == NULL)
            return -1;
        long long v = PyLong_AsLongLong(idx);
        Py_DECREF(idx);
        if (v == -1 && PyErr_Occurred())
            return -1;
        *(long long *)field = v;
        return 0;
    }
    Py_ssize_t v = PyNumber_AsSsize_t(value, PyExc_OverflowError);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *(Py_ssize_t *)field = v;
    return 0;
}

/* counter += by, on the IngestStats object. */
static int
bump(PyObject *stats, PyObject *name, Py_ssize_t by)
{
    PyObject *v = PyObject_GetAttr(stats, name);
    if (v == NULL)
        return -1;
    Py_ssize_t x = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    PyObject *s = PyLong_FromSsize_t(x + by);
    if (s == NULL)
        return -1;
    int rc = PyObject_SetAttr(stats, name, s);
    Py_DECREF(s);
    return rc;
}

/* `stats`, with the counts of the calls `extend_next` took since it was last read added in. (Every
 * call `extend_next` takes is a delta call.) */
static PyObject *
stats_get(TreeState *self, void *closure)
{
    if (self->stats == NULL) {
        PyErr_SetString(PyExc_AttributeError, "stats");
        return NULL;
    }
    if (self->new_calls) {
        if (bump(self->stats, s_calls, self->new_calls) < 0 ||
            bump(self->stats, s_call_tokens, self->new_call_tokens) < 0 ||
            bump(self->stats, s_delta_calls, self->new_calls) < 0)
            return NULL;
        self->new_calls = self->new_call_tokens = 0;
    }
    return Py_NewRef(self->stats);
}

static int
stats_set(TreeState *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "stats cannot be deleted");
        return -1;
    }
    Py_XSETREF(self->stats, Py_NewRef(value));
    self->new_calls = self->new_call_tokens = 0;
    return 0;
}

#define INT_FIELD(name, member, doc) \
    {name, (getter)int_get, (setter)int_set, doc, (void *)offsetof(TreeState, member)}

static PyGetSetDef TreeState_getset[] = {
    INT_FIELD("n", n, "Tokens in the arena."),
    INT_FIELD("_pend_lo", pend_lo, "First pending node inside add_batch."),
    INT_FIELD("_lps_n", lps_n, "Logprobs written into _lps."),
    INT_FIELD("_policy_count", policy_count, "Policy tokens."),
    {"stats", (getter)stats_get, (setter)stats_set,
     "Ingest counters (IngestStats), brought up to date when read: read them through this attribute.",
     NULL},
    {NULL},
};

static PyMemberDef TreeState_members[] = {
    {"execution_id", T_OBJECT_EX, offsetof(TreeState, execution_id), 0, "The execution's id."},
    {"_ids", T_OBJECT_EX, offsetof(TreeState, ids), 0, "The arena of token ids."},
    {"_lps", T_OBJECT_EX, offsetof(TreeState, lps), 0, "The logprob array of extend_next."},
    {"calls", T_OBJECT_EX, offsetof(TreeState, calls), 0, "Call id -> CallInfo."},
    {"order", T_OBJECT_EX, offsetof(TreeState, order), 0, "Call ids in the order they came."},
    {"_seg_lo", T_OBJECT_EX, offsetof(TreeState, seg_lo), 0, "First node of each policy segment."},
    {"_seg_hi", T_OBJECT_EX, offsetof(TreeState, seg_hi), 0, "End node of each policy segment."},
    {"_seg_groups", T_OBJECT_EX, offsetof(TreeState, seg_groups), 0, "Policy segments by group."},
    {NULL},
};

static PyTypeObject TreeStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gyre_traj._ingest.TreeState",
    .tp_basicsize = sizeof(TreeState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The state of an ExecutionTree that an agent's next call writes (its base class).",
    .tp_new = TreeState_new,
    .tp_dealloc = (destructor)TreeState_dealloc,
    .tp_traverse = (traverseproc)TreeState_traverse,
    .tp_clear = (inquiry)TreeState_clear,
    .tp_members = TreeState_members,
    .tp_getset = TreeState_getset,
};

/* ------------------------------------------------------------------------------------------------ */
/* A msgpack reader for the few shapes a call message holds. Each read_* returns 0 when the next   */
/* value has the expected type (and advances past it), -1 otherwise (anything else, or truncated). */

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

typedef struct {
    int8_t code;
    const uint8_t *data;
    Py_ssize_t len;
} Ext;

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const uint8_t *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }

/* Take `k` bytes, or fail when fewer are left. */
static inline const uint8_t *
take(Reader *r, Py_ssize_t k)
{
    if (k < 0 || r->end - r->p < k)
        return NULL;
    const uint8_t *at = r->p;
    r->p += k;
    return at;
}

static int
read_map(Reader *r, uint32_t *n)
{
    const uint8_t *b = take(r, 1), *q;
    if (b == NULL)
        return -1;
    if ((*b & 0xf0) == 0x80) {
        *n = *b & 0x0f;
        return 0;
    }
    if (*b == 0xde && (q = take(r, 2)) != NULL) {
        *n = be16(q);
        return 0;
    }
    if (*b == 0xdf && (q = take(r, 4)) != NULL) {
        *n = be32(q);
        return 0;
    }
    return -1;
}

static int
read_str(Reader *r, Str *out)
{
    const uint8_t *b = take(r, 1), *q;
    Py_ssize_t len;
    if (b == NULL)
        return -1;
    if ((*b & 0xe0) == 0xa0)
        len = *b & 0x1f;
    else if (*b == 0xd9 && (q = take(r, 1)) != NULL)
        len = q[0];
    else if (*b == 0xda && (q = take(r, 2)) != NULL)
        len = be16(q);
    else if (*b == 0xdb && (q = take(r, 4)) != NULL)
        len = be32(q);
    else
        return -1;
    if ((q = take(r, len)) == NULL)
        return -1;
    out->s = (const char *)q;
    out->len = len;
    return 0;
}

/* An integer; *big is set for a uint64 above int64's range (its value is then not kept). */
static int
read_int(Reader *r, int64_t *v, int *big)
{
    const uint8_t *b = take(r, 1), *q;
    *big = 0;
    if (b == NULL)
        return -1;
    if (*b <= 0x7f) { *v = *b; return 0; }                    /* positive fixint */
    if (*b >= 0xe0) { *v = (int8_t)*b; return 0; }            /* negative fixint */
    switch (*b) {
    case 0xcc: if ((q = take(r, 1)) == NULL) return -1; *v = q[0]; return 0;
    case 0xcd: if ((q = take(r, 2)) == NULL) return -1; *v = be16(q); return 0;
    case 0xce: if ((q = take(r, 4)) == NULL) return -1; *v = be32(q); return 0;
    case 0xcf:
        if ((q = take(r, 8)) == NULL) return -1;
        if (be64(q) > (uint64_t)INT64_MAX) { *big = 1; *v = 0; }
        else *v = (int64_t)be64(q);
        return 0;
    case 0xd0: if ((q = take(r, 1)) == NULL) return -1; *v = (int8_t)q[0]; return 0;
    case 0xd1: if ((q = take(r, 2)) == NULL) return -1; *v = (int16_t)be16(q); return 0;
    case 0xd2: if ((q = take(r, 4)) == NULL) return -1; *v = (int32_t)be32(q); return 0;
    case 0xd3: if ((q = take(r, 8)) == NULL) return -1; *v = (int64_t)be64(q); return 0;
    }
    return -1;
}

/* A number for a float field: float32, float64, or an integer that float64 holds exactly (msgspec
 * takes any integer there; a larger one is left to it). */
static int
read_float(Reader *r, double *v)
{
    const uint8_t *b, *q;
    if (r->p >= r->end)
        return -1;
    b = r->p;
    if (*b == 0xca || *b == 0xcb) {
        r->p++;
        if (*b == 0xca) {
            if ((q = take(r, 4)) == NULL) return -1;
            uint32_t u = be32(q);
            float f;
            memcpy(&f, &u, 4);
            *v = f;
        } else {
            if ((q = take(r, 8)) == NULL) return -1;
            uint64_t u = be64(q);
            memcpy(v, &u, 8);
        }
        return 0;
    }
    int64_t i;
    int big;
    if (read_int(r, &i, &big) < 0 || big || i > (1LL << 53) || i < -(1LL << 53))
        return -1;
    *v = (double)i;
    return 0;
}

static int
read_ext(Reader *r, Ext *out)
{
    const uint8_t *b = take(r, 1), *q;
    Py_ssize_t len;
    if (b == NULL)
        return -1;
    switch (*b) {
    case 0xd4: len = 1; break;
    case 0xd5: len = 2; break;
    case 0xd6: len = 4; break;
    case 0xd7: len = 8; break;
    case 0xd8: len = 16; break;
    case 0xc7: if ((q = take(r, 1)) == NULL) return -1; len = q[0]; break;
    case 0xc8: if ((q = take(r, 2)) == NULL) return -1; len = be16(q); break;
    case 0xc9: if ((q = take(r, 4)) == NULL) return -1; len = be32(q); break;
    default: return -1;
    }
    if ((q = take(r, 1)) == NULL)
        return -1;
    out->code = (int8_t)q[0];
    if ((q = take(r, len)) == NULL)
        return -1;
    out->data = q;
    out->len = len;
    return 0;
}

static int
read_nil(Reader *r)
{
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 0;
    }
    return -1;
}

/* Whether `s` is valid UTF-8 as Python (and msgspec) decode it strictly. */
static int
utf8_ok(const Str *s)
{
    for (Py_ssize_t i = 0; i < s->len; i++) {
        if ((unsigned char)s->s[i] & 0x80) {
            PyObject *u = PyUnicode_DecodeUTF8(s->s, s->len, NULL);
            if (u == NULL) {
                PyErr_Clear();
                return 0;
            }
            Py_DECREF(u);
            return 1;
        }
    }
    return 1;
}

/* A str object of `s`, or NULL with no exception set when it is not valid UTF-8. */
static PyObject *
to_str(const Str *s)
{
    PyObject *u = PyUnicode_DecodeUTF8(s->s, s->len, NULL);
    if (u == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        PyErr_Clear();
    return u;
}

/* The last str made for one field (the same execution, agent and finish reason come again and again):
 * its object is reused when the next message holds the same bytes. */
typedef struct {
    PyObject *obj;
    const char *utf8;
    Py_ssize_t len;
} StrCache;

static StrCache eid_cache, agent_cache, finish_cache;
static StrCache cid_cache;  /* the last call id taken: the next call's parent, most often */

/* Make `u` (a str) the object `cache` holds. */
static int
cache_set(StrCache *cache, PyObject *u)
{
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(u, &len);  /* (kept by the object itself) */
    if (utf8 == NULL)
        return -1;
    Py_XSETREF(cache->obj, Py_NewRef(u));
    cache->utf8 = utf8;
    cache->len = len;
    return 0;
}

/* A str object of `s` (a new reference), through `cache`; NULL with no exception set when it is not
 * valid UTF-8. */
static PyObject *
cached_str(StrCache *cache, const Str *s)
{
    if (cache->obj != NULL && cache->len == s->len && memcmp(cache->utf8, s->s, (size_t)s->len) == 0)
        return Py_NewRef(cache->obj);
    PyObject *u = to_str(s);
    if (u != NULL && cache_set(cache, u) < 0)
        Py_CLEAR(u);
    return u;
}

static inline int
is_key(const Str *k, const char *name, size_t len)
{
    return (size_t)k->len == len && memcmp(k->s, name, len) == 0;
}
#define KEY(k, lit) is_key(k, lit, sizeof(lit) - 1)

/* ------------------------------------------------------------------------------------------------ */
/* A call message, read.                                                                            */

enum {
    F_KIND = 1 << 0, F_EXECUTION = 1 << 1, F_CALL = 1 << 2, F_AGENT = 1 << 3, F_ROLE = 1 << 4,
    F_OUT = 1 << 5, F_LPS = 1 << 6, F_VERSION = 1 << 7, F_FINISH = 1 << 8, F_INPUT_IDS = 1 << 9,
    F_DELTA = 1 << 10, F_T_START = 1 << 11, F_T_END = 1 << 12, F_V = 1 << 13, F_METADATA = 1 << 14,
};
/* What an agent's next call must carry (`kind` included: a message without it is left to Python). */
#define F_REQUIRED (F_KIND | F_EXECUTION | F_CALL | F_AGENT | F_ROLE | F_OUT | F_LPS | F_VERSION | F_DELTA)

typedef struct {
    Str execution_id, call_id, agent_id, role, finish_reason, parent;
    int64_t weight_version, v, keep;
    double t_start, t_end;
    Ext out, lps, append;
} Msg;

/* `input_delta`: a map of exactly parent, keep and append (each once), append an extension value. */
static int
read_delta(Reader *r, Msg *m)
{
    uint32_t n;
    int seen = 0, big;
    if (read_map(r, &n) < 0 || n != 3)
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        Str k;
        int bit;
        if (read_str(r, &k) < 0)
            return -1;
        if (KEY(&k, "parent")) {
            bit = 1;
            if (read_str(r, &m->parent) < 0) return -1;
        } else if (KEY(&k, "keep")) {
            bit = 2;
            if (read_int(r, &m->keep, &big) < 0 || big) return -1;
        } else if (KEY(&k, "append")) {
            bit = 4;
            if (read_ext(r, &m->append) < 0) return -1;
        } else {
            return -1;
        }
        if (seen & bit)
            return -1;
        seen |= bit;
    }
    return seen == 7 ? 0 : -1;
}

/* `metadata`: a map of str to str, each valid UTF-8 (nothing of it is kept). */
static int
read_metadata(Reader *r)
{
    uint32_t n;
    if (read_map(r, &n) < 0)
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        Str k, v;
        if (read_str(r, &k) < 0 || read_str(r, &v) < 0 || !utf8_ok(&k) || !utf8_ok(&v))
            return -1;
    }
    return 0;
}

/* The whole message as a call record that names an input delta, keys in any order, each at most once,
 * every key known, every value of the type `CallView` declares, nothing after it. 0 or -1. */
static int
read_call(const uint8_t *data, Py_ssize_t size, Msg *m)
{
    Reader r = {data, data + size};
    uint32_t n;
    int seen = 0, big;
    memset(m, 0, sizeof(*m));
    m->v = cfg.schema_version;
    if (read_map(&r, &n) < 0)
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        Str k, kind;
        int bit;
        if (read_str(&r, &k) < 0)
            return -1;
        switch (k.len) {  /* (the key's length picks the few names it can be) */
        case 1:
            if (!KEY(&k, "v")) return -1;
            bit = F_V;
            if (read_int(&r, &m->v, &big) < 0 || big) return -1;
            break;
        case 4:
            if (KEY(&k, "kind")) {
                bit = F_KIND;
                if (read_str(&r, &kind) < 0 || !KEY(&kind, "call")) return -1;
            } else if (KEY(&k, "role")) {
                bit = F_ROLE;
                if (read_str(&r, &m->role) < 0) return -1;
            } else {
                return -1;
            }
            break;
        case 5:
            if (KEY(&k, "t_end")) {
                bit = F_T_END;
                if (read_float(&r, &m->t_end) < 0) return -1;
            } else {
                return -1;
            }
            break;
        case 7:
            if (KEY(&k, "call_id")) {
                bit = F_CALL;
                if (read_str(&r, &m->call_id) < 0) return -1;
            } else if (KEY(&k, "t_start")) {
                bit = F_T_START;
                if (read_float(&r, &m->t_start) < 0) return -1;
            } else {
                return -1;
            }
            break;
        case 8:
            if (KEY(&k, "agent_id")) {
                bit = F_AGENT;
                if (read_str(&r, &m->agent_id) < 0) return -1;
            } else if (KEY(&k, "metadata")) {
                bit = F_METADATA;
                if (read_metadata(&r) < 0) return -1;
            } else {
                return -1;
            }
            break;
        case 9:
            if (KEY(&k, "input_ids")) {
                bit = F_INPUT_IDS;  /* only nil: a full input is not an agent's next call */
                if (read_nil(&r) < 0) return -1;
            } else {
                return -1;
            }
            break;
        case 10:
            if (KEY(&k, "output_ids")) {
                bit = F_OUT;
                if (read_ext(&r, &m->out) < 0) return -1;
            } else {
                return -1;
            }
            break;
        case 11:
            if (KEY(&k, "input_delta")) {
                bit = F_DELTA;
                if (read_delta(&r, m) < 0) return -1;
            } else {
                return -1;
            }
            break;
        case 12:
            if (KEY(&k, "execution_id")) {
                bit = F_EXECUTION;
                if (read_str(&r, &m->execution_id) < 0) return -1;
            } else {
                return -1;
            }
            break;
        case 13:
            if (KEY(&k, "finish_reason")) {
                bit = F_FINISH;
                if (read_str(&r, &m->finish_reason) < 0) return -1;
            } else {
                return -1;
            }
            break;
        case 14:
            if (KEY(&k, "weight_version")) {
                bit = F_VERSION;
                if (read_int(&r, &m->weight_version, &big) < 0 || big) return -1;
            } else {
                return -1;
            }
            break;
        case 15:
            if (KEY(&k, "output_logprobs")) {
                bit = F_LPS;
                if (read_ext(&r, &m->lps) < 0) return -1;
            } else {
                return -1;
            }
            break;
        default:
            return -1;
        }
        if (seen & bit)
            return -1;  /* a key twice */
        seen |= bit;
    }
    if (r.p != r.end || (seen & F_REQUIRED) != F_REQUIRED)
        return -1;
    return 0;
}

/* The checks `Call` and `extend_next` make of the scalar fields and the arrays' encoding. */
static int
fields_ok(const Msg *m)
{
    return m->execution_id.len > 0 && m->call_id.len > 0 && m->v <= cfg.schema_version &&
           m->weight_version >= 0 && m->weight_version <= cfg.max_weight_version &&
           m->t_start == m->t_start && m->t_end == m->t_end &&  /* not NaN */
           m->append.code == 1 && m->out.code == 1 && m->lps.code == 2 &&
           (m->append.len & 3) == 0 && (m->out.len & 3) == 0 && m->lps.len == m->out.len;
}

/* ------------------------------------------------------------------------------------------------ */
/* Copies, each checked in its loop.                                                                 */

/* Each copy checks what it copies in the same loop (the message is read once, the arena written once);
 * the loops are written so that the compiler vectorizes them (`restrict`: the message and the tree's
 * arrays never overlap). */

/* (Kept out of line: inlined into its caller, where the compiler cannot tell that the message and
 * the arena do not overlap, the loops are not vectorized.) */
#if defined(__GNUC__)
#define NOINLINE __attribute__((noinline))
#else
#define NOINLINE
#endif
/* On x86-64 with GCC, each loop is also compiled for AVX2 and AVX-512, picked at load time by the CPU
 * (the baseline build has SSE2 only: 16-byte vectors). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Copy `n` int32 ids from `src` (any alignment) to `dst`; nonzero when one of them is negative. */
static NOINLINE VECTOR_CLONES int
copy_ids(int32_t *restrict dst, const uint8_t *restrict src, Py_ssize_t n)
{
    uint32_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + 4 * i, 4);
        dst[i] = (int32_t)u;
        any |= u;  /* a negative id sets the sign bit */
    }
    return (any >> 31) != 0;
}

/* Copy `n` float32 logprobs; nonzero when one is above 1e-4 or NaN (`check_logprobs`, which compares
 * the float32 maximum, as a double, with 1e-4). Checked on the bits, which vectorizes: a float32 whose
 * sign bit is clear is above 1e-4 (or a NaN) exactly when its bits, as an unsigned int, are above
 * those of 1e-4f (0x38d1b717: the largest float32 not above 1e-4); one whose sign bit is set is a NaN
 * exactly when its bits are above 0xff800000 (-inf). */
#define LOGPROB_MAX_BITS 0x38d1b717u
#define MINUS_INF_BITS 0xff800000u

static NOINLINE VECTOR_CLONES int
copy_logprobs(float *restrict dst, const uint8_t *restrict src, Py_ssize_t n)
{
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + 4 * i, 4);
        memcpy(dst + i, &u, 4);
        bad |= (u > MINUS_INF_BITS) | ((u < 0x80000000u) & (u > LOGPROB_MAX_BITS));
    }
    return bad != 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* extend_next                                                                                      */

static Py_ssize_t
info_field(PyObject *info, PyObject *name, int *err)
{
    PyObject *v = PyObject_GetAttr(info, name);
    if (v == NULL) {
        *err = 1;
        return 0;
    }
    Py_ssize_t x = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred())
        *err = 1;
    return x;
}

/* A writable buffer of the array in `slot` (a field of `t`) holding at least `need` 4-byte items,
 * after calling the tree's `grow` method (with `arg`) once when it holds fewer, which puts a larger
 * array there. 1: got it; 0: not there, or not a buffer of 4-byte items (left to Python); -1: an
 * error. `need` is read again after growing: it may point into the field it depends on. */
static int
items_buffer(TreeState *t, PyObject **slot, const Py_ssize_t *base, Py_ssize_t extra, PyObject *grow,
             Py_ssize_t arg, Py_buffer *buf)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        if (*slot == NULL)
            return 0;
        if (PyObject_GetBuffer(*slot, buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            return 0;
        }
        if (buf->itemsize != 4) {
            PyBuffer_Release(buf);
            return 0;
        }
        if (buf->len / 4 >= *base + extra)
            return 1;
        PyBuffer_Release(buf);  /* (an exported buffer would keep numpy from resizing in place) */
        if (attempt)
            return 0;
        PyObject *size = PyLong_FromSsize_t(arg);
        if (size == NULL)
            return -1;
        PyObject *r = PyObject_CallMethodObjArgs((PyObject *)t, grow, size, NULL);
        Py_DECREF(size);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* Ask for the whole message to be brought into cache now: it is rarely there (messages come from the
 * network), and its lines then arrive while the fields are read and the tree is looked up, rather
 * than one after the other as the copy reaches them. */
static inline void
prefetch(const void *data, Py_ssize_t len)
{
#if defined(__GNUC__)
    const char *p = (const char *)data;
    for (Py_ssize_t off = 0; off < len; off += 64)
        __builtin_prefetch(p + off, 0, 1);
#else
    (void)data;
    (void)len;
#endif
}

static PyObject *
extend_next(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "extend_next(data, trees)");
        return NULL;
    }
    if (!cfg.ready) {
        PyErr_SetString(PyExc_RuntimeError, "gyre_traj._ingest.setup was not called");
        return NULL;
    }
    PyObject *data = args[0], *trees = args[1];
    if (!PyDict_Check(trees)) {
        PyErr_SetString(PyExc_TypeError, "trees must be a dict");
        return NULL;
    }
    Py_buffer msg_buf;  /* (bytes, the usual message, are read in place) */
    int is_bytes = PyBytes_CheckExact(data);
    if (is_bytes) {
        msg_buf.buf = PyBytes_AS_STRING(data);
        msg_buf.len = PyBytes_GET_SIZE(data);
    } else if (PyObject_GetBuffer(data, &msg_buf, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *eid = NULL, *cid = NULL, *parent = NULL, *agent = NULL, *finish = NULL;
    PyObject *info = NULL, *tree = NULL, *par_info = NULL;
    Msg m;
    prefetch(msg_buf.buf, msg_buf.len);

    /* 1. The message: a call record with an input delta, each field as `CallView` types it and in the
     *    range `Call` requires. */
    if (read_call((const uint8_t *)msg_buf.buf, msg_buf.len, &m) < 0 || !fields_ok(&m))
        goto decline;
    PyObject *role = NULL;  /* borrowed from cfg.role */
    for (int i = 0; i < cfg.n_roles; i++)
        if (m.role.len == cfg.role_value[i].len &&
            memcmp(m.role.s, cfg.role_value[i].s, (size_t)m.role.len) == 0)
            role = cfg.role[i];
    if (role == NULL)
        goto decline;  /* not a Role's value */
    if ((eid = cached_str(&eid_cache, &m.execution_id)) == NULL)
        goto fail_or_decline;

    /* 2. Its tree, and the tree-side conditions of `extend_next`: the parent is known, the call
     *    keeps the whole of it, the call id is new, no batch is in progress, and the parent ends at
     *    the arena's last token (other placements are left to Python). */
    PyObject *obj = PyDict_GetItemWithError(trees, eid);
    if (obj == NULL || !PyObject_TypeCheck(obj, &TreeStateType))
        goto fail_or_decline;
    /* (held while the tree's methods are called back, which may let another thread change `trees`) */
    tree = Py_NewRef(obj);
    TreeState *t = (TreeState *)obj;
    if (t->execution_id == NULL || t->calls == NULL || !PyDict_Check(t->calls) || t->order == NULL ||
        !PyList_Check(t->order) || t->seg_lo == NULL || !PyList_Check(t->seg_lo) || t->seg_hi == NULL ||
        !PyList_Check(t->seg_hi) || t->seg_groups == NULL || !PyList_Check(t->seg_groups) ||
        t->stats == NULL || t->pend_lo != cfg.no_pending)
        goto decline;
    int same = PyObject_RichCompareBool(t->execution_id, eid, Py_EQ);
    if (same <= 0)
        goto fail_or_decline;
    if ((parent = cached_str(&cid_cache, &m.parent)) == NULL)
        goto fail_or_decline;
    PyObject *par = PyDict_GetItemWithError(t->calls, parent);
    if (par == NULL || Py_TYPE(par) != (PyTypeObject *)cfg.call_info)
        goto fail_or_decline;
    par_info = Py_NewRef(par);
    Py_ssize_t par_end, par_len;
    if (par == t->last_info) {
        par_end = t->last_end;
        par_len = t->last_length;
    } else {
        int err = 0;
        par_end = info_field(par, s_end, &err);
        par_len = info_field(par, s_n_input, &err);
        par_len += info_field(par, s_n_output, &err);
        if (err)
            goto fail;
    }
    if (m.keep != par_len)
        goto decline;
    if ((cid = to_str(&m.call_id)) == NULL)
        goto fail_or_decline;
    int known = PyDict_Contains(t->calls, cid);
    if (known != 0)
        goto fail_or_decline;
    Py_ssize_t lo = t->n;
    if (par_end < 0)
        goto decline;  /* a parent with no tokens */
    if (par_end != lo - 1) {
        /* The parent ends inside the arena: taken when nothing hangs below its last token. */
        PyObject *end_obj = PyObject_GetAttr(par, s_end);
        if (end_obj == NULL)
            goto fail;
        PyObject *below = PyObject_CallMethodOneArg((PyObject *)t, s_has_children, end_obj);
        Py_DECREF(end_obj);
        if (below == NULL)
            goto fail;
        int truth = PyObject_IsTrue(below);
        Py_DECREF(below);
        if (truth != 0)
            goto fail_or_decline;
    }
    if ((agent = cached_str(&agent_cache, &m.agent_id)) == NULL)
        goto fail_or_decline;
    if (m.finish_reason.s == NULL) {
        finish = Py_NewRef(cfg.stop);
    } else if ((finish = cached_str(&finish_cache, &m.finish_reason)) == NULL) {
        goto fail_or_decline;
    }

    /* 3. The tokens: input then output ids copied into the arena after its last token, checked for
     *    negative ids as they are copied; then the logprobs into the tree's logprob array. Nothing is
     *    counted until both checks passed, so a refusal leaves the tree as it was. */
    Py_ssize_t k_in = m.append.len / 4, k_out = m.out.len / 4;
    Py_ssize_t mid = lo + k_in, hi = mid + k_out;
    Py_buffer ids_buf;
    int got = items_buffer(t, &t->ids, &t->n, hi - lo, s_reserve, hi - lo, &ids_buf);
    if (got < 0)
        goto fail;
    if (got == 0)
        goto decline;
    int32_t *arena = (int32_t *)ids_buf.buf;
    int negative = copy_ids(arena + lo, m.append.data, k_in) | copy_ids(arena + mid, m.out.data, k_out);
    int32_t first_id = hi > lo ? arena[lo] : 0;
    PyBuffer_Release(&ids_buf);
    if (negative)
        goto decline;
    Py_ssize_t a = t->lps_n, b = a + k_out;
    if (k_out) {
        Py_buffer lps_buf;
        /* (when the array is full, `_grow_lps` puts a fresh one in, written from its start) */
        got = items_buffer(t, &t->lps, &t->lps_n, k_out, s_grow_lps, k_out, &lps_buf);
        if (got < 0)
            goto fail;
        if (got == 0)
            goto decline;
        a = t->lps_n;
        b = a + k_out;
        int bad = copy_logprobs((float *)lps_buf.buf + a, m.lps.data, k_out);
        PyBuffer_Release(&lps_buf);
        if (bad)
            goto decline;
    }

    /* 4. The bookkeeping: a new run below the parent when it ends inside the arena (the tree's
     *    `_new_run`), its output as a policy segment, its CallInfo, the counters. */
    Py_ssize_t end = hi - 1;
    if (par_end != lo - 1) {
        if (hi > lo) {
            PyObject *r = PyObject_CallMethod((PyObject *)t, "_new_run", "nnl", par_end, lo,
                                              (long)first_id);
            if (r == NULL)
                goto fail;
            Py_DECREF(r);
        } else {
            end = par_end;  /* no tokens: it ends where its parent does */
        }
    }
    Py_ssize_t length = m.keep + (hi - lo);
    if (k_out) {
        /* (first node, end node, logprob offset, version, logprob array, shift), as `extend_next` */
        PyObject *o_mid = PyLong_FromSsize_t(mid), *o_hi = PyLong_FromSsize_t(hi);
        PyObject *o_a = PyLong_FromSsize_t(a), *o_v = PyLong_FromLongLong(m.weight_version);
        PyObject *group = NULL;
        if (o_mid && o_hi && o_a && o_v)
            group = PyTuple_Pack(6, o_mid, o_hi, o_a, o_v, t->lps, cfg.zero);
        int rc = (group == NULL || PyList_Append(t->seg_lo, o_mid) < 0 ||
                  PyList_Append(t->seg_hi, o_hi) < 0 || PyList_Append(t->seg_groups, group) < 0);
        Py_XDECREF(o_mid);
        Py_XDECREF(o_hi);
        Py_XDECREF(o_a);
        Py_XDECREF(o_v);
        Py_XDECREF(group);
        if (rc)
            goto fail;
        t->lps_n = b;
        t->policy_count += k_out;
    }
    t->n = hi;
    {
        PyObject *cargs[10] = {cid, agent, role, NULL, NULL, NULL, NULL, finish, NULL, NULL};
        cargs[3] = PyLong_FromSsize_t(end);
        cargs[4] = PyLong_FromSsize_t(length - k_out);
        cargs[5] = PyLong_FromSsize_t(k_out);
        cargs[6] = PyLong_FromLongLong(m.weight_version);
        cargs[8] = PyFloat_FromDouble(m.t_start);
        cargs[9] = PyFloat_FromDouble(m.t_end);
        if (cargs[3] && cargs[4] && cargs[5] && cargs[6] && cargs[8] && cargs[9])
            info = PyObject_Vectorcall(cfg.call_info, cargs, 10, NULL);
        for (int i = 3; i < 10; i++)
            if (i != 7)
                Py_XDECREF(cargs[i]);
    }
    if (info == NULL || PyDict_SetItem(t->calls, cid, info) < 0 || PyList_Append(t->order, cid) < 0)
        goto fail;
    t->new_calls += 1;  /* (added to `stats` when it is next read) */
    t->new_call_tokens += length;
    if (cache_set(&cid_cache, cid) < 0)
        goto fail;
    Py_XSETREF(t->last_info, Py_NewRef(info));
    t->last_end = end;
    t->last_length = length;
    result = info;
    info = NULL;
    goto done;

fail_or_decline:
    if (PyErr_Occurred())
        goto fail;
decline:
    result = Py_NewRef(Py_None);
    goto done;
fail:
    result = NULL;
done:
    Py_XDECREF(info);
    Py_XDECREF(tree);
    Py_XDECREF(par_info);
    Py_XDECREF(eid);
    Py_XDECREF(cid);
    Py_XDECREF(parent);
    Py_XDECREF(agent);
    Py_XDECREF(finish);
    if (!is_bytes)
        PyBuffer_Release(&msg_buf);
    return result;
}

/* ------------------------------------------------------------------------------------------------ */

static PyObject *
setup(PyObject *module, PyObject *args)
{
    PyObject *call_info, *roles;
    long long schema_version, max_weight_version, no_pending;
    if (!PyArg_ParseTuple(args, "OO!LLL", &call_info, &PyDict_Type, &roles, &schema_version,
                          &max_weight_version, &no_pending))
        return NULL;
    if (!PyType_Check(call_info)) {
        PyErr_SetString(PyExc_TypeError, "call_info must be the CallInfo type");
        return NULL;
    }
    if (PyDict_GET_SIZE(roles) > MAX_ROLES) {
        PyErr_SetString(PyExc_ValueError, "too many roles");
        return NULL;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    int n = 0;
    while (PyDict_Next(roles, &pos, &key, &value)) {
        const char *utf8 = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &cfg.role_value[n].len) : NULL;
        if (utf8 == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "role values must be str");
            return NULL;
        }
        Py_INCREF(key);  /* (keeps its UTF-8 alive) */
        cfg.role_value[n].s = utf8;
        Py_XSETREF(cfg.role[n], Py_NewRef(value));
        n++;
    }
    cfg.n_roles = n;
    Py_XSETREF(cfg.call_info, Py_NewRef(call_info));
    cfg.schema_version = schema_version;
    cfg.max_weight_version = max_weight_version;
    cfg.no_pending = no_pending;
    cfg.ready = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"extend_next", (PyCFunction)(void (*)(void))extend_next, METH_FASTCALL,
     "extend_next(data, trees) -> CallInfo | None\n\n"
     "Place the call of msgpack message `data` into its tree (`trees[execution_id]`) when it is an "
     "agent's next call whose parent ends at the arena's last token; its CallInfo, or None (the tree "
     "unchanged) for anything else."},
    {"setup", setup, METH_VARARGS,
     "setup(CallInfo, roles, schema_version, max_weight_version, no_pending): what extend_next needs "
     "from gyre_traj (called once, by gyre_traj.tree)."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "gyre_traj._ingest",
    "The native half of gyre_traj's live ingest path (see gyre_traj.native).", -1, methods,
};

PyMODINIT_FUNC
PyInit__ingest(void)
{
    if (PyType_Ready(&TreeStateType) < 0)
        return NULL;
#ifdef HAVE_ARENA
    page_size = (size_t)sysconf(_SC_PAGESIZE);
    if (PyType_Ready(&ArenaType) < 0)
        return NULL;
#endif
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_has_children, "has_children");
    INTERN(s_end, "end");
    INTERN(s_n_input, "n_input");
    INTERN(s_n_output, "n_output");
    INTERN(s_calls, "calls");
    INTERN(s_call_tokens, "call_tokens");
    INTERN(s_delta_calls, "delta_calls");
    INTERN(s_reserve, "_reserve");
    INTERN(s_grow_lps, "_grow_lps");
    INTERN(cfg.stop, "stop");
    cfg.zero = PyLong_FromLong(0);
#undef INTERN
    cfg.no_pending = (long long)1 << 62;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "TreeState", (PyObject *)&TreeStateType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef HAVE_ARENA
    if (PyModule_AddObjectRef(m, "Arena", (PyObject *)&ArenaType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
