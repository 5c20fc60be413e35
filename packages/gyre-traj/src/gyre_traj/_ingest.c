/* gyre_traj._ingest: the native half of the live ingest path (`Forest.ingest_frame`).
 *
 * Two things live here:
 *
 *   TreeState      the base class of `ExecutionTree`: the part of a tree's state that a call placed
 *                  here writes (the arena's length and array, the logprob array, the policy segment
 *                  tables, the call table, the ingest counters), held in a C struct so that the fast
 *                  path below reads and writes it directly. Python code reads and writes the same
 *                  fields as ordinary attributes (`tree.n`, `tree._ids`, ...). `gyre_traj.native`
 *                  holds the pure-Python twin (a class with the same slots) used when this module
 *                  was not built.
 *
 *   extend_next    one msgpack call message (as the proxy sends it) placed into its tree: the message
 *                  is parsed here (no msgspec decode), and the call placed. An agent's next call (its
 *                  parent's last token has nothing below it) costs a copy of its ids into the arena and
 *                  of its logprobs into the tree's logprob array, each checked in the copy loop. Any
 *                  other call of a tree that exists (a full input, a retry, a call after a compaction,
 *                  a branch) is merged as `ExecutionTree._add` merges it: followed down the tree while
 *                  the tree agrees, the rest appended as a new run. It returns the call's `CallInfo`,
 *                  or None, leaving the tree as it was, for anything it is not sure about (another kind
 *                  of record, a field it does not know, a value out of range, another array encoding,
 *                  an execution's first call, an output that repeats the tree's tokens, ...): the Python
 *                  path then takes the message and merges it or raises the RecordError it always
 *                  raised. It never raises for a bad message; only for a failure of Python itself
 *                  (memory).
 *
 * Everything here mirrors `ExecutionTree.extend_next` and `ExecutionTree._add` (tree.py) and the checks
 * `CallView` / `Call` make (io.py, records.py); tests/test_native_ingest.py compares the two on mutated
 * messages and on random sequences of calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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
    Py_ssize_t root;        /* ROOT: the node above a tree's first tokens (NO_NODE is ROOT - 1) */
    int ready;
} Config;

static Config cfg;

/* Attribute names looked up per message, interned once. */
static PyObject *s_has_children, *s_end, *s_n_input, *s_n_output, *s_reserve,
    *s_grow_lps;

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
/* What a call must carry (`kind` included: a message without it is left to Python), besides its input:
 * a delta or full input ids. */
#define F_REQUIRED (F_KIND | F_EXECUTION | F_CALL | F_AGENT | F_ROLE | F_OUT | F_LPS | F_VERSION)

typedef struct {
    Str execution_id, call_id, agent_id, role, finish_reason, parent;
    int64_t weight_version, v, keep;
    double t_start, t_end;
    Ext out, lps, append;  /* `append`: the delta's new tokens, or the full input */
    Ext input;
    int full;              /* a full input (no delta: `parent` and `keep` unset) */
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

/* The whole message as a call record with an input delta or full input ids, keys in any order, each at
 * most once, every key known, every value of the type `CallView` declares, nothing after it. 0 or -1. */
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
                bit = F_INPUT_IDS;  /* nil, or a full input (an agent's first call) */
                if (read_nil(&r) == 0) break;
                if (read_ext(&r, &m->input) < 0) return -1;
                m->full = 1;
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
    /* exactly one input: a delta, or full input ids */
    if (m->full == ((seen & F_DELTA) != 0))
        return -1;
    if (m->full)
        m->append = m->input;
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

/* A call being placed: its message, its tree, and the objects its CallInfo is made of. */
typedef struct {
    TreeState *t;
    const Msg *m;
    PyObject *cid, *agent, *role, *finish;
    PyObject *par;         /* the delta parent's CallInfo (NULL for a full input) */
    Py_ssize_t par_end;    /* its last node (ROOT for a full input) */
} Call;

/* The tree's `_new_run(after, lo, first_token)`: a run of new nodes from `lo` below node `after`. */
static int
new_run(TreeState *t, Py_ssize_t after, Py_ssize_t lo, int32_t first)
{
    PyObject *r = PyObject_CallMethod((PyObject *)t, "_new_run", "nnl", after, lo, (long)first);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The call's `k` logprobs copied into the tree's logprob array from its offset `*a` (`lps_n` is not
 * advanced yet: `add_segment` does). 1, 0 (a logprob above 1e-4 or NaN, or no array to write: left to
 * Python) or -1. */
static int
copy_call_logprobs(TreeState *t, const Msg *m, Py_ssize_t k, Py_ssize_t *a)
{
    *a = t->lps_n;
    if (k == 0)
        return 1;
    Py_buffer buf;
    /* (when the array is full, `_grow_lps` puts a fresh one in, written from its start) */
    int got = items_buffer(t, &t->lps, &t->lps_n, k, s_grow_lps, k, &buf);
    if (got <= 0)
        return got;
    *a = t->lps_n;
    int bad = copy_logprobs((float *)buf.buf + *a, m->lps.data, k);
    PyBuffer_Release(&buf);
    return bad ? 0 : 1;
}

/* Nodes [lo, hi) as a policy segment, their logprobs at [a, a + hi - lo) of the tree's logprob array:
 * (first node, end node, logprob offset, version, logprob array, shift), as `ExecutionTree`'s. */
static int
add_segment(TreeState *t, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t a, long long version)
{
    PyObject *o_lo = PyLong_FromSsize_t(lo), *o_hi = PyLong_FromSsize_t(hi);
    PyObject *o_a = PyLong_FromSsize_t(a), *o_v = PyLong_FromLongLong(version);
    PyObject *group = NULL;
    if (o_lo && o_hi && o_a && o_v)
        group = PyTuple_Pack(6, o_lo, o_hi, o_a, o_v, t->lps, cfg.zero);
    int rc = (group == NULL || PyList_Append(t->seg_lo, o_lo) < 0 || PyList_Append(t->seg_hi, o_hi) < 0 ||
              PyList_Append(t->seg_groups, group) < 0);
    Py_XDECREF(o_lo);
    Py_XDECREF(o_hi);
    Py_XDECREF(o_a);
    Py_XDECREF(o_v);
    Py_XDECREF(group);
    if (rc)
        return -1;
    t->lps_n = a + (hi - lo);
    t->policy_count += hi - lo;
    return 0;
}

/* The call's CallInfo (a new reference), entered in the call table and counted; NULL on an error. */
static PyObject *
register_call(const Call *c, Py_ssize_t end, Py_ssize_t length)
{
    TreeState *t = c->t;
    const Msg *m = c->m;
    Py_ssize_t k_out = m->out.len / 4;
    PyObject *info = NULL;
    PyObject *cargs[10] = {c->cid, c->agent, c->role, NULL, NULL, NULL, NULL, c->finish, NULL, NULL};
    cargs[3] = PyLong_FromSsize_t(end);
    cargs[4] = PyLong_FromSsize_t(length - k_out);
    cargs[5] = PyLong_FromSsize_t(k_out);
    cargs[6] = PyLong_FromLongLong(m->weight_version);
    cargs[8] = PyFloat_FromDouble(m->t_start);
    cargs[9] = PyFloat_FromDouble(m->t_end);
    if (cargs[3] && cargs[4] && cargs[5] && cargs[6] && cargs[8] && cargs[9])
        info = PyObject_Vectorcall(cfg.call_info, cargs, 10, NULL);
    for (int i = 3; i < 10; i++)
        if (i != 7)
            Py_XDECREF(cargs[i]);
    if (info == NULL || PyDict_SetItem(t->calls, c->cid, info) < 0 ||
        PyList_Append(t->order, c->cid) < 0 || cache_set(&cid_cache, c->cid) < 0) {
        Py_XDECREF(info);
        return NULL;
    }
    if (m->full) {  /* (not a delta call: counted now, not with the delta calls below) */
        if (bump(t->stats, s_calls, 1) < 0 || bump(t->stats, s_call_tokens, length) < 0) {
            Py_DECREF(info);
            return NULL;
        }
    } else {
        t->new_calls += 1;  /* (added to `stats` when it is next read) */
        t->new_call_tokens += length;
    }
    Py_XSETREF(t->last_info, Py_NewRef(info));
    t->last_end = end;
    t->last_length = length;
    return info;
}

/* An agent's next call: its input's new tokens, then its output, copied after the arena's last token
 * (checked for negative ids as they are copied), its logprobs into the tree's logprob array, a new run
 * below the parent when the parent ends inside the arena, its output a policy segment. Nothing is
 * counted until every check passed, so a refusal leaves the tree as it was. 1 (`*end`: its last node),
 * 0 (left to Python) or -1. */
static int
place_next(const Call *c, Py_ssize_t *end)
{
    TreeState *t = c->t;
    const Msg *m = c->m;
    Py_ssize_t k_in = m->append.len / 4, k_out = m->out.len / 4;
    Py_ssize_t lo = t->n, mid = lo + k_in, hi = mid + k_out;
    Py_buffer ids_buf;
    int got = items_buffer(t, &t->ids, &t->n, hi - lo, s_reserve, hi - lo, &ids_buf);
    if (got <= 0)
        return got;
    int32_t *arena = (int32_t *)ids_buf.buf;
    int negative = copy_ids(arena + lo, m->append.data, k_in) | copy_ids(arena + mid, m->out.data, k_out);
    int32_t first_id = hi > lo ? arena[lo] : 0;
    PyBuffer_Release(&ids_buf);
    if (negative)
        return 0;
    Py_ssize_t a;
    if ((got = copy_call_logprobs(t, m, k_out, &a)) <= 0)
        return got;
    *end = hi - 1;
    if (c->par_end != lo - 1) {
        if (hi > lo) {
            if (new_run(t, c->par_end, lo, first_id) < 0)
                return -1;
        } else {
            *end = c->par_end;  /* no tokens: it ends where its parent does */
        }
    }
    if (k_out && add_segment(t, mid, hi, a, m->weight_version) < 0)
        return -1;
    t->n = hi;
    return 1;
}

/* ------------------------------------------------------------------------------------------------ */
/* merge: any other call (a full input, a retry, a call after a compaction, a branch), as
 * `ExecutionTree._add` merges it: its input followed down the tree from where its delta cuts its
 * parent while the tree agrees, the rest appended there as a new run (drift noted by the tree's
 * `_note_drift`), its output appended below. Left to Python (0, nothing changed): an output that
 * follows tokens already in the tree (they become policy tokens: `_promote`), a negative id or a bad
 * logprob (Python says which), a tree whose tables are not as `ExecutionTree` keeps them. */

/* The run tables of an `ExecutionTree` (its attributes) and a view of its arena. */
typedef struct {
    PyObject *starts, *rdep, *rpar, *start_set, *branches;
    Py_buffer buf;
    const int32_t *ids;
    Py_ssize_t n;
} Runs;

static PyObject *s_starts, *s_rdep, *s_rpar, *s_start_set, *s_branches;

static void
runs_release(Runs *R)
{
    Py_CLEAR(R->starts);
    Py_CLEAR(R->rdep);
    Py_CLEAR(R->rpar);
    Py_CLEAR(R->start_set);
    Py_CLEAR(R->branches);
    if (R->ids != NULL) {
        PyBuffer_Release(&R->buf);
        R->ids = NULL;
    }
}

/* 1, 0 (not as expected: left to Python) or -1. Release with `runs_release` either way. */
static int
runs_get(TreeState *t, Runs *R)
{
    memset(R, 0, sizeof(*R));
    PyObject *o = (PyObject *)t;
    if ((R->starts = PyObject_GetAttr(o, s_starts)) == NULL ||
        (R->rdep = PyObject_GetAttr(o, s_rdep)) == NULL || (R->rpar = PyObject_GetAttr(o, s_rpar)) == NULL ||
        (R->start_set = PyObject_GetAttr(o, s_start_set)) == NULL ||
        (R->branches = PyObject_GetAttr(o, s_branches)) == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();  /* (not an `ExecutionTree`'s tables) */
        return 0;
    }
    if (!PyList_CheckExact(R->starts) || !PyList_CheckExact(R->rdep) || !PyList_CheckExact(R->rpar) ||
        !PySet_CheckExact(R->start_set) || !PyDict_CheckExact(R->branches) ||
        PyList_GET_SIZE(R->rdep) != PyList_GET_SIZE(R->starts) ||
        PyList_GET_SIZE(R->rpar) != PyList_GET_SIZE(R->starts) || t->ids == NULL)
        return 0;
    if (PyObject_GetBuffer(t->ids, &R->buf, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (R->buf.itemsize != 4 || R->buf.len / 4 < t->n) {
        PyBuffer_Release(&R->buf);
        return 0;
    }
    R->ids = (const int32_t *)R->buf.buf;
    R->n = t->n;
    return 1;
}

/* Item `i` of a list of ints; -1 with an error set when it is not one (`PyErr_Occurred`). */
static inline Py_ssize_t
list_int(PyObject *list, Py_ssize_t i)
{
    return PyLong_AsSsize_t(PyList_GET_ITEM(list, i));
}

/* bisect.bisect_right of `x` in an ascending list of ints; -1 with an error set. */
static Py_ssize_t
bisect_right(PyObject *list, Py_ssize_t x)
{
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(list);
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        Py_ssize_t v = list_int(list, mid);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (x < v)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* `ExecutionTree.node_at_depth`: the ancestor of `end` at `depth` (ROOT for -1). 1, 0 (none) or -1. */
static int
node_at_depth(const Runs *R, Py_ssize_t end, Py_ssize_t depth, Py_ssize_t *out)
{
    if (depth < 0) {
        *out = cfg.root;
        return 1;
    }
    Py_ssize_t node = end;
    for (Py_ssize_t hops = 0; node != cfg.root && hops <= PyList_GET_SIZE(R->starts); hops++) {
        Py_ssize_t r = bisect_right(R->starts, node) - 1;
        if (r < -1)
            return -1;
        if (r < 0)
            return 0;
        Py_ssize_t d = list_int(R->rdep, r), start = list_int(R->starts, r);
        if (PyErr_Occurred())
            return -1;
        if (d <= depth) {
            *out = start + (depth - d);
            return 1;
        }
        node = list_int(R->rpar, r);
        if (node == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* `ExecutionTree._child`: the child of `node` holding `tok`, or NO_NODE. 1, 0 (the tables hold
 * something else) or -1. */
static int
child_of(const Runs *R, Py_ssize_t node, int32_t tok, Py_ssize_t *out)
{
    *out = cfg.root - 1;  /* NO_NODE */
    if (node == cfg.root) {
        if (R->n > 0 && R->ids[0] == tok) {
            *out = 0;
            return 1;
        }
    } else if (node + 1 < R->n && R->ids[node + 1] == tok) {
        PyObject *c = PyLong_FromSsize_t(node + 1);
        if (c == NULL)
            return -1;
        int starts_run = PySet_Contains(R->start_set, c);
        Py_DECREF(c);
        if (starts_run < 0)
            return -1;
        if (!starts_run) {
            *out = node + 1;
            return 1;
        }
    }
    PyObject *key = PyLong_FromSsize_t(node);
    if (key == NULL)
        return -1;
    PyObject *below = PyDict_GetItemWithError(R->branches, key);  /* borrowed */
    Py_DECREF(key);
    if (below == NULL)
        return PyErr_Occurred() ? -1 : 1;
    if (!PyDict_CheckExact(below))
        return 0;
    PyObject *t = PyLong_FromLong(tok);
    if (t == NULL)
        return -1;
    PyObject *v = PyDict_GetItemWithError(below, t);
    Py_DECREF(t);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 1;
    Py_ssize_t x = PyLong_AsSsize_t(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (x < 0 || x >= R->n)
        return 0;
    *out = x;
    return 1;
}

static inline int32_t
load_id(const uint8_t *seq, Py_ssize_t i)
{
    int32_t v;
    memcpy(&v, seq + 4 * i, 4);
    return v;
}

/* `ExecutionTree._descend`: follow the `n_seq` ids at `seq` down from `node` while the tree agrees;
 * `*node_out` is the last matched node, `*i_out` the ids matched. 1, 0 or -1. */
static int
descend(const Runs *R, Py_ssize_t node, const uint8_t *seq, Py_ssize_t n_seq, Py_ssize_t *node_out,
        Py_ssize_t *i_out)
{
    Py_ssize_t i = 0;
    while (i < n_seq) {
        Py_ssize_t nxt;
        int got = child_of(R, node, load_id(seq, i), &nxt);
        if (got <= 0)
            return got;
        if (nxt == cfg.root - 1)
            break;
        Py_ssize_t r = bisect_right(R->starts, nxt);
        if (r < 0)
            return -1;
        Py_ssize_t run_end = r < PyList_GET_SIZE(R->starts) ? list_int(R->starts, r) : R->n;
        if (run_end == -1 && PyErr_Occurred())
            return -1;
        if (run_end <= nxt || run_end > R->n)
            return 0;
        Py_ssize_t span = run_end - nxt < n_seq - i ? run_end - nxt : n_seq - i, k = 1;
        while (k < span && R->ids[nxt + k] == load_id(seq, i + k))
            k++;
        node = nxt + k - 1;
        i += k;
    }
    *node_out = node;
    *i_out = i;
    return 1;
}

static int
merge(const Call *c, Py_ssize_t *end)
{
    TreeState *t = c->t;
    const Msg *m = c->m;
    Py_ssize_t k_in = m->append.len / 4, k_out = m->out.len / 4, keep = m->keep;
    Runs R;
    int got = runs_get(t, &R);
    Py_ssize_t start, node, i, j = 0, out_node;
    if (got > 0)
        got = node_at_depth(&R, c->par_end, keep - 1, &start);
    if (got > 0)
        got = descend(&R, start, m->append.data, k_in, &node, &i);
    if (got > 0 && i == k_in && k_out)  /* (after new input tokens, the output starts a new leaf) */
        got = descend(&R, node, m->out.data, k_out, &out_node, &j);
    runs_release(&R);
    if (got <= 0)
        return got;
    if (j > 0)
        return 0;  /* its output follows tokens already in the tree: `_promote`, in Python */

    /* The new tokens: the input's from its `i`-th, then the output, copied after the arena's last token
     * and checked; then the logprobs. */
    Py_ssize_t lo = t->n, r = k_in - i, mid = lo + r, hi = mid + k_out;
    Py_buffer ids_buf;
    got = items_buffer(t, &t->ids, &t->n, hi - lo, s_reserve, hi - lo, &ids_buf);
    if (got <= 0)
        return got;
    int32_t *arena = (int32_t *)ids_buf.buf;
    int negative = copy_ids(arena + lo, m->append.data + 4 * i, r) |
                   copy_ids(arena + mid, m->out.data, k_out);
    int32_t first_in = r ? arena[lo] : 0, first_out = k_out ? arena[mid] : 0;
    PyBuffer_Release(&ids_buf);
    if (negative)
        return 0;
    Py_ssize_t a;
    if ((got = copy_call_logprobs(t, m, k_out, &a)) <= 0)
        return got;

    /* The tree's bookkeeping, as `_add` does it: drift, new runs, the output's policy segment. */
    Py_ssize_t in_end = node;
    if (r) {
        PyObject *res = PyObject_CallMethod((PyObject *)t, "_note_drift", "OnlnO", c->cid, node,
                                            (long)first_in, keep + i, c->par ? c->par : Py_None);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
        if ((node != lo - 1 || node == cfg.root) && new_run(t, node, lo, first_in) < 0)
            return -1;
        in_end = mid - 1;
    }
    *end = in_end;
    if (k_out) {
        if ((in_end != mid - 1 || in_end == cfg.root) && new_run(t, in_end, mid, first_out) < 0)
            return -1;
        if (add_segment(t, mid, hi, a, m->weight_version) < 0)
            return -1;
        *end = hi - 1;
    }
    t->n = hi;
    return 1;
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
    Py_ssize_t par_end = cfg.root, par_len = 0;
    if (!m.full) {
        if ((parent = cached_str(&cid_cache, &m.parent)) == NULL)
            goto fail_or_decline;
        PyObject *par = PyDict_GetItemWithError(t->calls, parent);
        if (par == NULL || Py_TYPE(par) != (PyTypeObject *)cfg.call_info)
            goto fail_or_decline;
        par_info = Py_NewRef(par);
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
        if (m.keep < 0 || m.keep > par_len)
            goto decline;
    }
    if ((cid = to_str(&m.call_id)) == NULL)
        goto fail_or_decline;
    int known = PyDict_Contains(t->calls, cid);
    if (known != 0)
        goto fail_or_decline;
    Py_ssize_t lo = t->n;
    /* An agent's next call: it keeps the whole of its parent, and nothing hangs below the parent's last
     * token yet (it is the arena's last token, or the tree says so), so that every token it carries is
     * new. Anything else is merged (`merge`). */
    int next = !m.full && m.keep == par_len && par_end >= 0;
    if (next && par_end != lo - 1) {
        PyObject *end_obj = PyLong_FromSsize_t(par_end);
        if (end_obj == NULL)
            goto fail;
        PyObject *below = PyObject_CallMethodOneArg((PyObject *)t, s_has_children, end_obj);
        Py_DECREF(end_obj);
        if (below == NULL)
            goto fail;
        int truth = PyObject_IsTrue(below);
        Py_DECREF(below);
        if (truth < 0)
            goto fail;
        next = !truth;
    }
    if ((agent = cached_str(&agent_cache, &m.agent_id)) == NULL)
        goto fail_or_decline;
    if (m.finish_reason.s == NULL) {
        finish = Py_NewRef(cfg.stop);
    } else if ((finish = cached_str(&finish_cache, &m.finish_reason)) == NULL) {
        goto fail_or_decline;
    }
    Call c = {t, &m, cid, agent, role, finish, par_info, par_end};
    Py_ssize_t end, length;
    int got = next ? place_next(&c, &end) : merge(&c, &end);
    if (got < 0)
        goto fail;
    if (got == 0)
        goto decline;
    length = m.keep + (m.append.len + m.out.len) / 4;
    info = register_call(&c, end, length);
    if (info == NULL)
        goto fail;
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
    Py_ssize_t root;
    if (!PyArg_ParseTuple(args, "OO!LLLn", &call_info, &PyDict_Type, &roles, &schema_version,
                          &max_weight_version, &no_pending, &root))
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
    cfg.root = root;
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
    INTERN(s_starts, "_starts");
    INTERN(s_rdep, "_rdep");
    INTERN(s_rpar, "_rpar");
    INTERN(s_start_set, "_start_set");
    INTERN(s_branches, "_branches");
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
    return m;
}
