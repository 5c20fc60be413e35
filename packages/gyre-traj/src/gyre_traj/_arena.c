/* gyre_traj._arena: where an `ExecutionTree`'s token ids live once they outgrow its first array
 * (`ExecutionTree._reserve`; `gyre_traj.native.arena_type`). POSIX only: the build leaves it out
 * elsewhere, and the tree then grows a numpy array.
 *
 * An `Arena` is one reserved range of address space, made readable and writable as the tree grows, so
 * that growing never moves or copies what is stored (views of it stay valid); when its tree is dropped
 * it is kept for the next tree, which then writes into pages that are already mapped rather than taking
 * a page fault for each.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

/* Address space reserved per arena: 4 GiB, a billion token ids. It costs no memory: the range is
 * mapped inaccessible (and so not counted against the system's commit limit) except for the part made
 * writable as the tree grows. A tree that outgrows it moves to a larger arena (`ExecutionTree._reserve`
 * copies it then). */
#define ARENA_RESERVE ((size_t)1 << 32)
/* Recycled arenas kept for the next trees: at most this many, each with at most this many bytes
 * written (a larger one is unmapped when its tree is dropped). */
#define ARENA_CACHE_SLOTS 4
#define ARENA_CACHE_MAX_BYTES ((size_t)64 << 20)
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
    .tp_name = "gyre_traj._arena.Arena",
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

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "gyre_traj._arena",
    "Arenas for a tree's token ids: reserved address space grown in place (see gyre_traj.native).", -1,
    NULL,
};

PyMODINIT_FUNC
PyInit__arena(void)
{
    page_size = (size_t)sysconf(_SC_PAGESIZE);
    if (PyType_Ready(&ArenaType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Arena", (PyObject *)&ArenaType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
