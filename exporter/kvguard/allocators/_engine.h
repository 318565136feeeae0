/* What kvguard's two C engines share (_ctorch.c, PyTorch's caching allocator; _cmspool.c, MindSpore's
 * memory pool): the Python headers, 128-bit integer types, checked and saturating arithmetic on sizes and
 * counters, the model's out-of-memory error, the re-entry guard's error, and the table by which each engine
 * exports the constants it shares with its Python model (tests/allocators/test_c_engines.py compares them).
 *
 * An engine defines KVG_ENGINE (its module's short name, for messages) before including this file. Everything
 * here is static: each engine gets its own copy, and an unused helper costs nothing.
 */
#ifndef KVGUARD_ENGINE_H
#define KVGUARD_ENGINE_H

#ifndef KVG_ENGINE
#error "define KVG_ENGINE (the engine's module name) before including _engine.h"
#endif

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__SIZEOF_INT128__)
#error "kvguard's C engines need 128-bit integers (GCC or Clang on a 64-bit target)"
#endif
typedef unsigned __int128 u128;
typedef __int128 i128;

/* ------------------------------------------------------------------ checked arithmetic */
/* The models' sizes and counters are Python ints, which never overflow; the engines' are 64-bit (or 128-bit)
 * cells. Where a sum or product would leave a cell, an engine raises OverflowError and leaves the cell as it
 * was; where a size past 64 bits means "larger than any device", it saturates at UINT64_MAX instead. */
static inline int kvg_beyond_int64(const char *what) {
    PyErr_Format(PyExc_OverflowError, "%s: %s beyond 2**63", KVG_ENGINE, what);
    return -1;
}

static inline int kvg_add_i64(long long a, long long b, long long *out, const char *what) {
    return __builtin_add_overflow(a, b, out) ? kvg_beyond_int64(what) : 0;
}

static inline int kvg_sub_i64(long long a, long long b, long long *out, const char *what) {
    return __builtin_sub_overflow(a, b, out) ? kvg_beyond_int64(what) : 0;
}

static inline int kvg_mul_i64(long long a, long long b, long long *out, const char *what) {
    return __builtin_mul_overflow(a, b, out) ? kvg_beyond_int64(what) : 0;
}

/* a + b, or OverflowError (naming `what`) where the sum passes 2**64 - 1 */
static inline int kvg_add_u64(uint64_t a, uint64_t b, uint64_t *out, const char *what) {
    if (__builtin_add_overflow(a, b, out)) {
        PyErr_Format(PyExc_OverflowError, "%s: %s beyond the 64-bit range", KVG_ENGINE, what);
        return -1;
    }
    return 0;
}

/* a + b, UINT64_MAX where the sum passes it */
static inline uint64_t kvg_saturating_add_u64(uint64_t a, uint64_t b) {
    uint64_t sum;
    return __builtin_add_overflow(a, b, &sum) ? UINT64_MAX : sum;
}

/* x rounded up to a multiple of step (> 0), UINT64_MAX where that passes it */
static inline uint64_t kvg_round_up_u64(uint64_t x, uint64_t step) {
    u128 r = ((u128)x + step - 1) / step * step;
    return r > UINT64_MAX ? UINT64_MAX : (uint64_t)r;
}

static inline int kvg_bit_length(uint64_t x) {
    return x ? 64 - __builtin_clzll(x) : 0;
}

/* ------------------------------------------------------------------ errors the models raise */
/* kvguard.allocators.base.AllocatorOutOfMemory, imported once by the engine's module init. */
static PyObject *kvg_out_of_memory;

static inline int kvg_import_out_of_memory(void) {
    if (kvg_out_of_memory != NULL)
        return 0;
    PyObject *base = PyImport_ImportModule("kvguard.allocators.base");
    if (base == NULL)
        return -1;
    kvg_out_of_memory = PyObject_GetAttrString(base, "AllocatorOutOfMemory");
    Py_DECREF(base);
    return kvg_out_of_memory == NULL ? -1 : 0;
}

/* Raises AllocatorOutOfMemory(requested, name, free_bytes, detail), as the models do; returns NULL. Borrows
 * its arguments; an error building them (a NULL among them) is left set. */
static inline PyObject *kvg_raise_out_of_memory(PyObject *requested, PyObject *name, PyObject *free_bytes,
                                                PyObject *detail) {
    if (requested == NULL || name == NULL || free_bytes == NULL || detail == NULL)
        return NULL;
    PyObject *error = PyObject_CallFunctionObjArgs(kvg_out_of_memory, requested, name, free_bytes, detail, NULL);
    if (error != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(error), error);
        Py_DECREF(error);
    }
    return NULL;
}

/* malloc, free and empty_cache call back into Python (the device, callbacks, a key's __eq__) with the
 * engine's state half changed: a call that would change the engine from inside them is refused. */
static inline int kvg_refuse_reentry(int busy) {
    if (busy) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: the allocator engine was called from inside one of its own calls (a device or model "
                     "callback)",
                     KVG_ENGINE);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ constants shared with the models */
/* Each engine lists the constants it shares with its Python model (and its wrapper) in a table of
 * KVG_CONSTANT(NAME) rows; kvg_add_constants makes each a module attribute of that name and the tuple
 * SHARED_CONSTANTS of their names, which tests/allocators/test_c_engines.py compares with the Python side. */
typedef struct {
    const char *name;
    unsigned long long value;
} KvgConstant;

#define KVG_CONSTANT(name) {#name, (unsigned long long)(name)}

static inline int kvg_add_constants(PyObject *module, const KvgConstant *table, Py_ssize_t n) {
    PyObject *names = PyTuple_New(n);
    if (names == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(table[i].value);
        PyObject *name = PyUnicode_FromString(table[i].name);
        if (value == NULL || name == NULL || PyModule_AddObjectRef(module, table[i].name, value) < 0) {
            Py_XDECREF(value);
            Py_XDECREF(name);
            Py_DECREF(names);
            return -1;
        }
        Py_DECREF(value);
        PyTuple_SET_ITEM(names, i, name);
    }
    int rc = PyModule_AddObjectRef(module, "SHARED_CONSTANTS", names);
    Py_DECREF(names);
    return rc;
}

#endif /* KVGUARD_ENGINE_H */
