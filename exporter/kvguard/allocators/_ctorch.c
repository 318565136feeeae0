/* kvguard.allocators._ctorch: a C engine for PyTorch's caching allocator model (torch and torch_npu).
 *
 * A second implementation of kvguard/allocators/torch_alloc.py's CachingAllocator, which is the
 * specification: its docstrings cite the upstream functions and lines each rule follows. This file
 * keeps the model's order of operations step for step, so that every address, out-of-memory error,
 * counter, peak and device call comes out as the model's. torch_native.py wraps it
 * (NativeCachingAllocator); tests/allocators/test_alloc_native_torch.py holds the two equal, and
 * tests/upstream/test_oracle_torch_npu.py runs it against torch_npu's compiled allocator.
 *
 * Data layout: blocks are C structs from a slab pool; free blocks per pool are a treap ordered by
 * (stream, size, address) (the model's packed sort key), unmapped blocks per pool a treap ordered by
 * (stream, address); allocated blocks are found by address in an open-addressing hash map; every
 * statistic is a 128-bit cell of one Cells object, which steady_cells() hands to base.record_steady.
 * The model's statistics are Python ints: 128 bits keep sums of 64-bit sizes exact (a "freed" total
 * grows without bound; int64 cells wrapped after a few frees on a 2**61-byte device), and a cell
 * written from Python is kept within +-2**100, so that no sequence of operations can wrap one.
 *
 * Sizes are uint64. A rounded request of 2**64 bytes or more is kept as HUGE (UINT64_MAX): larger than
 * any block, segment or device (the wrapper refuses devices of 2**62 bytes or more), so it takes the
 * model's out-of-memory path. Trace replay (seed_segment(s), release_segment_at, unmap_range) stays
 * with the Python model.
 */
#define KVG_ENGINE "_ctorch"
#include "_engine.h"

/* Constants shared with torch_alloc.py (and torch_native.py) are exported as module attributes
 * (SHARED_CONSTANTS below); tests/allocators/test_c_engines.py holds them equal to the Python side. */
#define K_MIN_BLOCK_SIZE 512ULL
#define K_SMALL_SIZE (1ULL << 20)
#define K_SMALL_BUFFER (2ULL << 20)
#define K_MIN_LARGE_ALLOC (10ULL << 20)
#define K_ROUND_LARGE (2ULL << 20)
#define K_EXTRA_LARGE_BUFFER (1ULL << 30)
#define K_ROUNDUP_INTERVALS 16
#define K_ROUNDUP_START_LOG2 20       /* log2(kRoundUpPowerOfTwoStart), 1 MiB */
#define HUGE_SIZE UINT64_MAX          /* a size of 2**64 or more */
#define UNLIMITED UINT64_MAX          /* max_split_size unset (the model's _UNLIMITED) */
#define STREAM_BIAS (1ULL << 63)      /* streams are signed: biased, they order as uint64 */
#define MAX_DEVICE_BYTES (1ULL << 62) /* devices and address spaces the engine takes are smaller */

/* ------------------------------------------------------------------ statistics cells */
/* The model's stat arrays (STAT_ARRAYS x STAT_POOLS x [current, peak, allocated, freed]), then the
 * oversize stats, the num_* counters and the window peaks. */
enum {
    S_ALLOCATION,
    S_SEGMENT,
    S_ACTIVE,
    S_INACTIVE_SPLIT,
    S_ALLOCATED_BYTES,
    S_RESERVED_BYTES,
    S_ACTIVE_BYTES,
    S_INACTIVE_SPLIT_BYTES,
    S_REQUESTED_BYTES,
    N_STAT_ARRAYS
};
enum { P_ALL, P_SMALL, P_LARGE, N_STAT_POOLS };
enum { F_CURRENT, F_PEAK, F_ALLOCATED, F_FREED, N_STAT_FIELDS };
#define C_OVERSIZE_ALLOCATIONS (N_STAT_ARRAYS * N_STAT_POOLS * N_STAT_FIELDS)
#define C_OVERSIZE_SEGMENTS (C_OVERSIZE_ALLOCATIONS + N_STAT_FIELDS)
#define C_NUM_ALLOC_RETRIES (C_OVERSIZE_SEGMENTS + N_STAT_FIELDS)
#define C_NUM_OOMS (C_NUM_ALLOC_RETRIES + 1)
#define C_NUM_SYNC_ALL_STREAMS (C_NUM_ALLOC_RETRIES + 2)
#define C_NUM_DEVICE_ALLOC (C_NUM_ALLOC_RETRIES + 3)
#define C_NUM_DEVICE_FREE (C_NUM_ALLOC_RETRIES + 4)
#define C_WINDOW_ALLOC (C_NUM_ALLOC_RETRIES + 5)
#define C_WINDOW_RESERVED (C_NUM_ALLOC_RETRIES + 6)
#define N_CELLS (C_WINDOW_RESERVED + 1)

typedef struct {
    PyObject_HEAD
    i128 v[N_CELLS];
} CellsObject;

/* A cell as a Python int. */
static PyObject *cell_to_py(i128 x) {
    if (x >= INT64_MIN && x <= INT64_MAX)
        return PyLong_FromLongLong((long long)x);
    PyObject *high = PyLong_FromLongLong((long long)(x >> 64)), *low = PyLong_FromUnsignedLongLong((uint64_t)x);
    PyObject *shift = PyLong_FromLong(64), *shifted = NULL, *out = NULL;
    if (high != NULL && low != NULL && shift != NULL && (shifted = PyNumber_Lshift(high, shift)) != NULL)
        out = PyNumber_Add(shifted, low);
    Py_XDECREF(high);
    Py_XDECREF(low);
    Py_XDECREF(shift);
    Py_XDECREF(shifted);
    return out;
}

/* A Python int (or __index__) as a cell: OverflowError beyond +-2**100, so that adding the 64-bit
 * amounts of any realistic number of operations to a cell can never wrap it. */
#define CELL_HIGH_LIMIT (1LL << 36) /* the high 64 bits of a cell written from Python */
static int cell_from_py(PyObject *value, i128 *out) {
    PyObject *v = PyNumber_Index(value);
    if (v == NULL)
        return -1;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow == 0) {
        Py_DECREF(v);
        if (x == -1 && PyErr_Occurred())
            return -1;
        *out = x;
        return 0;
    }
    PyObject *shift = PyLong_FromLong(64), *high_obj = shift ? PyNumber_Rshift(v, shift) : NULL;
    Py_XDECREF(shift);
    long long high = 0;
    if (high_obj != NULL) {
        high = PyLong_AsLongLongAndOverflow(high_obj, &overflow);
        Py_DECREF(high_obj);
    }
    if (high_obj == NULL || (high == -1 && PyErr_Occurred())) {
        Py_DECREF(v);
        return -1;
    }
    if (overflow || high >= CELL_HIGH_LIMIT || high < -CELL_HIGH_LIMIT) {
        Py_DECREF(v);
        PyErr_SetString(PyExc_OverflowError, "a statistic beyond the engine's range (+-2**100)");
        return -1;
    }
    uint64_t low = PyLong_AsUnsignedLongLongMask(v);
    Py_DECREF(v);
    if (low == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    *out = (i128)(((u128)(uint64_t)high << 64) | low);
    return 0;
}

static Py_ssize_t Cells_len(PyObject *self) {
    (void)self;
    return N_CELLS;
}

static PyObject *Cells_item(PyObject *self, Py_ssize_t i) {
    if (i < 0 || i >= N_CELLS) {
        PyErr_SetString(PyExc_IndexError, "cell index out of range");
        return NULL;
    }
    return cell_to_py(((CellsObject *)self)->v[i]);
}

static int Cells_ass_item(PyObject *self, Py_ssize_t i, PyObject *value) {
    if (i < 0 || i >= N_CELLS) {
        PyErr_SetString(PyExc_IndexError, "cell index out of range");
        return -1;
    }
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "cells cannot be deleted");
        return -1;
    }
    i128 x;
    if (cell_from_py(value, &x) < 0)
        return -1;
    ((CellsObject *)self)->v[i] = x;
    return 0;
}

static PySequenceMethods Cells_as_sequence = {
    .sq_length = Cells_len,
    .sq_item = Cells_item,
    .sq_ass_item = Cells_ass_item,
};

static PyTypeObject CellsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard.allocators._ctorch.Cells",
    .tp_doc = "An engine's counters and peaks as 128-bit cells (base.record_steady / replay_steady index them).",
    .tp_basicsize = sizeof(CellsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_as_sequence = &Cells_as_sequence,
};

/* ------------------------------------------------------------------ blocks, segments, trees */
typedef struct Segment {
    uint64_t base, size, page_size;
    int64_t stream;
    uint8_t small, expandable;
    struct Segment *lprev, *lnext; /* the model's _segments list, in its order */
    struct Block *scan_head;       /* scratch for _mapped_ranges */
} Segment;

enum { IN_NONE, IN_FREE, IN_UNMAPPED };

typedef struct Block {
    i128 requested; /* the request's bytes (negative for a negative request) */
    uint64_t addr, size;
    int64_t stream, gc_base;
    struct Block *prev, *next; /* neighbours in the segment (the model's prev / next) */
    Segment *segment;
    struct Block *left, *right, *parent; /* treap links while in a tree */
    uint64_t k1, k2, k3;                 /* the tree key as inserted (the model's Block.key) */
    uint32_t prio;
    uint8_t small, allocated, mapped, tree;
} Block;

typedef struct {
    Block *root;
    Py_ssize_t count;
} Tree;

#define SLAB_BLOCKS 256
typedef struct Slab {
    struct Slab *next;
    Block blocks[SLAB_BLOCKS];
} Slab;

typedef struct {
    uint64_t key;
    Block *block; /* NULL: empty slot */
} MapSlot;

typedef struct {
    MapSlot *slots;
    size_t mask, count;
    int shift;
} AddrMap;

typedef struct {
    PyObject_HEAD
    CellsObject *cells;
    i128 *st;
    PyObject *device, *name, *odd_size, *segment_address, *on_map, *address_space_total;
    PyObject *segments_key, *steady_cells;
    int initialized, busy;
    /* configuration (from the Python model's constructor) */
    uint64_t pad, base_addr_aligned, large_segment_size, max_non_split_rounding_size, large_page_size;
    uint64_t max_split_size, rejection_limit;
    uint64_t divisions[K_ROUNDUP_INTERVALS];
    int null_for_zero, page_size_1g, expandable, aligns_base, rounds_power2, throw_on_npumalloc_oom;
    double garbage_collection_threshold;
    /* state */
    int set_fraction, gc_enabled, rejected;
    uint64_t allowed_memory_maximum, next_addr;
    int64_t gc_calls[2];
    Tree free_blocks[2]; /* index: Block.small (0 large pool, 1 small pool) */
    Tree unmapped[2];
    AddrMap active;
    Segment *seg_first, *seg_last;
    Slab *slabs;
    Block *spare;
    Py_ssize_t live_blocks, spare_count;
    uint32_t rng;
} Engine;

static inline i128 *cell_stat(Engine *e, int array, int pool) {
    return e->st + (array * N_STAT_POOLS + pool) * N_STAT_FIELDS;
}

/* _inc / _dec / _bump / _drop */
static inline void inc(Engine *e, int array, int pool, i128 amount) {
    i128 *s = cell_stat(e, array, P_ALL);
    if ((s[F_CURRENT] += amount) > s[F_PEAK])
        s[F_PEAK] = s[F_CURRENT];
    s = cell_stat(e, array, pool);
    if ((s[F_CURRENT] += amount) > s[F_PEAK])
        s[F_PEAK] = s[F_CURRENT];
}

static inline void dec(Engine *e, int array, int pool, i128 amount) {
    cell_stat(e, array, P_ALL)[F_CURRENT] -= amount;
    i128 *s = cell_stat(e, array, pool);
    s[F_CURRENT] -= amount;
    s[F_FREED] += amount;
}

static inline void bump(i128 *s, i128 amount) {
    if ((s[F_CURRENT] += amount) > s[F_PEAK])
        s[F_PEAK] = s[F_CURRENT];
}

static inline void drop(i128 *s, i128 amount) {
    s[F_CURRENT] -= amount;
    s[F_FREED] += amount;
}

static inline i128 reserved_bytes(Engine *e) {
    return cell_stat(e, S_RESERVED_BYTES, P_ALL)[F_CURRENT];
}
static inline i128 allocated_bytes(Engine *e) {
    return cell_stat(e, S_ALLOCATED_BYTES, P_ALL)[F_CURRENT];
}

/* _note_reserved */
static inline void note_reserved(Engine *e) {
    i128 reserved = reserved_bytes(e);
    if (reserved > e->st[C_WINDOW_RESERVED])
        e->st[C_WINDOW_RESERVED] = reserved;
}

/* ---- block pool: a failed allocation is reported before an operation changes anything */
/* Every step reserves what it takes plus two: malloc's last step (alignment, split) needs two. */
static int reserve_blocks(Engine *e, Py_ssize_t n) {
    n += 2;
    while (e->spare_count < n) {
        Slab *slab = PyMem_RawMalloc(sizeof(Slab));
        if (slab == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        slab->next = e->slabs;
        e->slabs = slab;
        for (int i = 0; i < SLAB_BLOCKS; i++) {
            slab->blocks[i].next = e->spare;
            e->spare = &slab->blocks[i];
        }
        e->spare_count += SLAB_BLOCKS;
    }
    return 0;
}

static Block *new_block(Engine *e, uint64_t addr, uint64_t size, int small, Segment *segment, int64_t stream) {
    Block *b = e->spare; /* reserve_blocks ran first */
    e->spare = b->next;
    e->spare_count--;
    e->live_blocks++;
    memset(b, 0, sizeof *b);
    b->addr = addr;
    b->size = size;
    b->small = (uint8_t)small;
    b->segment = segment;
    b->stream = stream;
    b->mapped = 1;
    return b;
}

static void del_block(Engine *e, Block *b) {
    b->next = e->spare;
    e->spare = b;
    e->spare_count++;
    e->live_blocks--;
}

/* ---- treap */
static inline int key_less(const Block *b, uint64_t k1, uint64_t k2, uint64_t k3) {
    if (b->k1 != k1)
        return b->k1 < k1;
    if (b->k2 != k2)
        return b->k2 < k2;
    return b->k3 < k3;
}

static void rotate_up(Tree *t, Block *x) {
    Block *p = x->parent, *g = p->parent;
    if (p->left == x) {
        p->left = x->right;
        if (x->right)
            x->right->parent = p;
        x->right = p;
    } else {
        p->right = x->left;
        if (x->left)
            x->left->parent = p;
        x->left = p;
    }
    p->parent = x;
    x->parent = g;
    if (g == NULL)
        t->root = x;
    else if (g->left == p)
        g->left = x;
    else
        g->right = x;
}

static void tree_insert(Engine *e, Tree *t, Block *b, uint64_t k1, uint64_t k2, uint64_t k3) {
    b->k1 = k1;
    b->k2 = k2;
    b->k3 = k3;
    uint32_t r = e->rng; /* xorshift32 */
    r ^= r << 13;
    r ^= r >> 17;
    r ^= r << 5;
    e->rng = r;
    b->prio = r;
    b->left = b->right = NULL;
    Block *parent = NULL, **link = &t->root;
    while (*link) {
        parent = *link;
        link = key_less(b, parent->k1, parent->k2, parent->k3) ? &parent->left : &parent->right;
    }
    b->parent = parent;
    *link = b;
    while (b->parent && b->parent->prio > b->prio)
        rotate_up(t, b);
    t->count++;
}

static void tree_remove(Tree *t, Block *b) {
    while (b->left && b->right)
        rotate_up(t, b->left->prio < b->right->prio ? b->left : b->right);
    Block *child = b->left ? b->left : b->right, *p = b->parent;
    if (child)
        child->parent = p;
    if (p == NULL)
        t->root = child;
    else if (p->left == b)
        p->left = child;
    else
        p->right = child;
    t->count--;
}

static Block *tree_lower_bound(const Tree *t, uint64_t k1, uint64_t k2, uint64_t k3) {
    Block *node = t->root, *best = NULL;
    while (node) {
        if (key_less(node, k1, k2, k3)) {
            node = node->right;
        } else {
            best = node;
            node = node->left;
        }
    }
    return best;
}

static Block *tree_first(const Tree *t) {
    Block *b = t->root;
    while (b && b->left)
        b = b->left;
    return b;
}

static Block *tree_last(const Tree *t) {
    Block *b = t->root;
    while (b && b->right)
        b = b->right;
    return b;
}

static Block *tree_next(Block *b) {
    if (b->right) {
        b = b->right;
        while (b->left)
            b = b->left;
        return b;
    }
    while (b->parent && b->parent->right == b)
        b = b->parent;
    return b->parent;
}

static Block *tree_prev(Block *b) {
    if (b->left) {
        b = b->left;
        while (b->right)
            b = b->right;
        return b;
    }
    while (b->parent && b->parent->left == b)
        b = b->parent;
    return b->parent;
}

/* The blocks of a tree in order, as a malloc'd array (the model's `for key in list(entries)`). */
static Block **tree_snapshot(const Tree *t) {
    Block **out = PyMem_RawMalloc(sizeof(Block *) * (size_t)(t->count ? t->count : 1));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t n = 0;
    for (Block *b = tree_first(t); b; b = tree_next(b))
        out[n++] = b;
    return out;
}

/* _insert_free / _remove_free / _insert_unmapped / _remove_unmapped */
static inline void insert_free(Engine *e, Block *b) {
    if (e->gc_enabled)
        b->gc_base = e->gc_calls[b->small];
    tree_insert(e, &e->free_blocks[b->small], b, (uint64_t)b->stream ^ STREAM_BIAS, b->size, b->addr);
    b->tree = IN_FREE;
}

static inline void remove_free(Engine *e, Block *b) {
    tree_remove(&e->free_blocks[b->small], b);
    b->tree = IN_NONE;
}

static inline void insert_unmapped(Engine *e, Block *b) {
    tree_insert(e, &e->unmapped[b->small], b, (uint64_t)b->stream ^ STREAM_BIAS, b->addr, 0);
    b->tree = IN_UNMAPPED;
}

static inline void remove_unmapped(Engine *e, Block *b) {
    tree_remove(&e->unmapped[b->small], b);
    b->tree = IN_NONE;
}

/* ---- address -> allocated block */
static inline size_t map_hash(const AddrMap *m, uint64_t key) {
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> m->shift);
}

static int map_init(AddrMap *m, int bits) {
    m->slots = PyMem_RawCalloc((size_t)1 << bits, sizeof(MapSlot));
    if (m->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->mask = ((size_t)1 << bits) - 1;
    m->shift = 64 - bits;
    m->count = 0;
    return 0;
}

static inline Block *map_get(const AddrMap *m, uint64_t key) {
    for (size_t i = map_hash(m, key);; i = (i + 1) & m->mask) {
        MapSlot *slot = &m->slots[i];
        if (slot->block == NULL || slot->key == key)
            return slot->block;
    }
}

static inline void map_put(AddrMap *m, uint64_t key, Block *b) { /* map_reserve ran first */
    size_t i = map_hash(m, key);
    while (m->slots[i].block != NULL && m->slots[i].key != key)
        i = (i + 1) & m->mask;
    if (m->slots[i].block == NULL)
        m->count++;
    m->slots[i].key = key;
    m->slots[i].block = b;
}

static int map_reserve(AddrMap *m) {
    if ((m->count + 1) * 2 <= m->mask + 1)
        return 0;
    AddrMap bigger;
    if (map_init(&bigger, 64 - m->shift + 1) < 0)
        return -1;
    for (size_t i = 0; i <= m->mask; i++)
        if (m->slots[i].block)
            map_put(&bigger, m->slots[i].key, m->slots[i].block);
    PyMem_RawFree(m->slots);
    *m = bigger;
    return 0;
}

static void map_del(AddrMap *m, uint64_t key) { /* linear probing: shift the cluster back */
    size_t i = map_hash(m, key);
    while (m->slots[i].key != key || m->slots[i].block == NULL) {
        if (m->slots[i].block == NULL)
            return;
        i = (i + 1) & m->mask;
    }
    size_t j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        if (m->slots[j].block == NULL)
            break;
        size_t home = map_hash(m, m->slots[j].key);
        int movable = (j > i) ? (home <= i || home > j) : (home <= i && home > j);
        if (movable) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].block = NULL;
    m->count--;
}

/* ---- segments */
static void segment_append(Engine *e, Segment *s) {
    s->lnext = NULL;
    s->lprev = e->seg_last;
    if (e->seg_last)
        e->seg_last->lnext = s;
    else
        e->seg_first = s;
    e->seg_last = s;
    Py_CLEAR(e->segments_key);
}

static void segment_unlink(Engine *e, Segment *s) {
    if (s->lprev)
        s->lprev->lnext = s->lnext;
    else
        e->seg_first = s->lnext;
    if (s->lnext)
        s->lnext->lprev = s->lprev;
    else
        e->seg_last = s->lprev;
    Py_CLEAR(e->segments_key);
}

/* base.link_after */
static inline void link_after(Block *node, Block *b) {
    Block *nxt = node->next;
    b->next = nxt;
    if (nxt)
        nxt->prev = b;
    b->prev = node;
    node->next = b;
}

/* base.absorb: src's bytes and place go to dst; src is freed */
static void absorb(Engine *e, Block *dst, Block *src) {
    if (dst->prev == src) {
        dst->addr = src->addr;
        Block *prev = dst->prev = src->prev;
        if (prev)
            prev->next = dst;
    } else {
        Block *nxt = dst->next = src->next;
        if (nxt)
            nxt->prev = dst;
    }
    dst->size += src->size;
    del_block(e, src);
}

/* ------------------------------------------------------------------ device calls */
static int device_malloc(Engine *e, uint64_t size) {
    PyObject *n = PyLong_FromUnsignedLongLong(size);
    if (n == NULL)
        return -1;
    PyObject *r = PyObject_CallMethod(e->device, "malloc", "O", n);
    Py_DECREF(n);
    if (r == NULL)
        return -1;
    int ok = PyObject_IsTrue(r);
    Py_DECREF(r);
    return ok;
}

static int device_free(Engine *e, uint64_t size) {
    PyObject *r = PyObject_CallMethod(e->device, "free", "K", (unsigned long long)size);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* An int attribute of the device as uint64 (capacity_bytes for expandable_reservation). */
static int device_uint(Engine *e, const char *name, uint64_t *out) {
    PyObject *v = PyObject_GetAttrString(e->device, name);
    if (v == NULL)
        return -1;
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* ------------------------------------------------------------------ sizes */
/* _roundup_power2_next_division */
static uint64_t next_division(uint64_t size, uint64_t divisions) {
    if ((size & (size - 1)) == 0)
        return size;
    uint64_t floor = 1ULL << (kvg_bit_length(size) - 1);
    uint64_t step = floor >> (kvg_bit_length(divisions) - 1);
    if (step == 0)
        return floor == (1ULL << 63) ? HUGE_SIZE : floor << 1;
    uint64_t low = size & ~(step - 1);
    if (low == size)
        return size;
    return kvg_saturating_add_u64(low, step);
}

/* round_size (and malloc's plain rounding, the same with no pad and no divisions) */
static uint64_t round_size(Engine *e, uint64_t size) {
    size = kvg_saturating_add_u64(size, e->pad);
    if (size == HUGE_SIZE)
        return HUGE_SIZE;
    if (size < K_MIN_BLOCK_SIZE)
        return K_MIN_BLOCK_SIZE;
    if (e->rounds_power2) {
        int index = kvg_bit_length(size) - 1 - K_ROUNDUP_START_LOG2;
        index = index < 0 ? 0 : index > K_ROUNDUP_INTERVALS - 1 ? K_ROUNDUP_INTERVALS - 1 : index;
        uint64_t divisions = e->divisions[index];
        if (divisions > 1 && (u128)K_MIN_BLOCK_SIZE * divisions < size)
            return next_division(size, divisions);
    }
    return kvg_round_up_u64(size, K_MIN_BLOCK_SIZE);
}

/* segment_size */
static uint64_t segment_size(Engine *e, uint64_t size) {
    if (size <= K_SMALL_SIZE)
        return K_SMALL_BUFFER;
    if (e->page_size_1g)
        return kvg_round_up_u64(size, K_EXTRA_LARGE_BUFFER);
    if (size < K_MIN_LARGE_ALLOC)
        return e->large_segment_size;
    return kvg_round_up_u64(size, K_ROUND_LARGE);
}

/* expandable_reservation: (page size, address space) of a new expandable segment */
static int expandable_reservation(Engine *e, int small, uint64_t *page, uint64_t *space) {
    uint64_t total = 0;
    if (e->address_space_total != Py_None) {
        int truth = PyObject_IsTrue(e->address_space_total);
        if (truth < 0)
            return -1;
        if (truth) {
            total = PyLong_AsUnsignedLongLong(e->address_space_total);
            if (total == (uint64_t)-1 && PyErr_Occurred())
                return -1;
        }
    }
    if (total == 0 && device_uint(e, "capacity_bytes", &total) < 0)
        return -1;
    *page = small ? K_SMALL_BUFFER : e->large_page_size;
    u128 space_wanted = (u128)total + total / 8; /* saturating: new_segment_base refuses it */
    *space = space_wanted > UINT64_MAX ? HUGE_SIZE : kvg_round_up_u64((uint64_t)space_wanted, *page);
    return 0;
}

/* ------------------------------------------------------------------ the model's steps */
static int release_block(Engine *e, Block *b);

/* _new_segment_base: the segment_address callback's base, else the next free address */
static int new_segment_base(Engine *e, uint64_t size, int small, uint64_t *base) {
    int from_callback = 0;
    if (e->segment_address != NULL) {
        PyObject *r =
            PyObject_CallFunction(e->segment_address, "KO", (unsigned long long)size, small ? Py_True : Py_False);
        if (r == NULL)
            return -1;
        if (r != Py_None) {
            if (!PyLong_Check(r)) {
                PyErr_Format(PyExc_TypeError, "segment_address must return an int or None, not %.100s",
                             Py_TYPE(r)->tp_name);
                Py_DECREF(r);
                return -1;
            }
            *base = PyLong_AsUnsignedLongLong(r);
            if (*base == (uint64_t)-1 && PyErr_Occurred()) {
                Py_DECREF(r);
                return -1;
            }
            from_callback = 1;
        }
        Py_DECREF(r);
    }
    if (!from_callback) /* read after the callback, which may have moved it */
        *base = e->next_addr;
    uint64_t end;
    if (kvg_add_u64(*base, size, &end, "the end of a new segment (the 64-bit address space)") < 0)
        return -1;
    if (end > e->next_addr)
        e->next_addr = end;
    return 0;
}

/* expandable_size in _get_free_block: a block's size with the unmapped room after it */
static inline uint64_t expandable_size(const Block *b) {
    return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
}

/* _get_free_block (and malloc's inlined copy of it) */
static Block *get_free_block(Engine *e, uint64_t size, int small, int64_t stream) {
    if (e->gc_enabled)
        e->gc_calls[small]++;
    Tree *t = &e->free_blocks[small];
    uint64_t k1 = (uint64_t)stream ^ STREAM_BIAS;
    Block *b = tree_lower_bound(t, k1, size, 0);
    if (b == NULL || b->k1 != k1)
        return NULL;
    if (e->expandable && b->segment->expandable) {
        while (b->segment->expandable) {
            Block *n = tree_next(b);
            if (n == NULL || n->k1 != k1 || expandable_size(n) >= expandable_size(b))
                break;
            b = n;
        }
    }
    uint64_t block_size = b->size;
    if (size < e->max_split_size && block_size >= e->max_split_size)
        return NULL;
    if (size >= e->max_split_size && block_size - size >= e->max_non_split_rounding_size)
        return NULL;
    remove_free(e, b);
    return b;
}

/* _release_block: device-free a whole cached segment */
static int release_block(Engine *e, Block *b) {
    remove_free(e, b);
    Segment *s = b->segment;
    segment_unlink(e, s);
    int pool = b->small ? P_SMALL : P_LARGE;
    uint64_t size = s->size;
    del_block(e, b);
    PyMem_RawFree(s);
    if (device_free(e, size) < 0)
        return -1;
    e->st[C_NUM_DEVICE_FREE]++;
    dec(e, S_SEGMENT, pool, 1);
    dec(e, S_RESERVED_BYTES, pool, size);
    if (size >= e->max_split_size)
        drop(e->st + C_OVERSIZE_SEGMENTS, 1);
    return 0;
}

/* _try_merge: merge src into dst when both are free and equally mapped */
static void try_merge(Engine *e, Block *dst, Block *src) {
    if (src == NULL || src->allocated || src->mapped != dst->mapped)
        return;
    if (src->mapped)
        remove_free(e, src);
    else
        remove_unmapped(e, src);
    absorb(e, dst, src);
}

/* _map_block: map whole pages covering the first `size` bytes of an unmapped block.
 * 1 mapped, 0 the device refused, -1 error. */
static int map_block(Engine *e, Block *b, uint64_t size) {
    Segment *s = b->segment;
    uint64_t mapped = kvg_round_up_u64(size, s->page_size);
    if (mapped > b->size)
        mapped = b->size;
    if (reserve_blocks(e, 1) < 0)
        return -1;
    int ok = device_malloc(e, mapped);
    if (ok <= 0)
        return ok;
    e->st[C_NUM_DEVICE_ALLOC]++;
    remove_unmapped(e, b);
    if (mapped < b->size) {
        Block *rest = new_block(e, b->addr + mapped, b->size - mapped, b->small, s, b->stream);
        rest->mapped = 0;
        link_after(b, rest);
        b->size = mapped;
        insert_unmapped(e, rest);
    }
    b->mapped = 1;
    uint64_t map_addr = b->addr;
    try_merge(e, b, b->prev);
    try_merge(e, b, b->next);
    insert_free(e, b);
    inc(e, S_RESERVED_BYTES, b->small ? P_SMALL : P_LARGE, mapped);
    note_reserved(e);
    if (e->on_map != NULL) {
        PyObject *r = PyObject_CallFunction(e->on_map, "KK", (unsigned long long)map_addr, (unsigned long long)mapped);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 1;
}

/* _unmap_block (whole pages inside a free mapped block); -1 on error, else 0 */
static int unmap_block(Engine *e, Block *b) {
    Segment *s = b->segment;
    uint64_t page = s->page_size;
    uint64_t start = s->base + (b->addr - s->base + page - 1) / page * page;
    uint64_t end = s->base + (b->addr + b->size - s->base) / page * page;
    if (end <= start)
        return 0;
    if (reserve_blocks(e, 2) < 0)
        return -1;
    remove_free(e, b);
    uint64_t before = start - b->addr, after = b->addr + b->size - end;
    if (before) {
        Block *head = new_block(e, b->addr, before, b->small, s, b->stream);
        head->prev = b->prev;
        if (head->prev)
            head->prev->next = head;
        head->next = b;
        b->prev = head;
        insert_free(e, head);
    }
    if (after) {
        Block *tail = new_block(e, end, after, b->small, s, b->stream);
        link_after(b, tail);
        insert_free(e, tail);
    }
    b->addr = start;
    b->size = end - start;
    b->mapped = 0;
    try_merge(e, b, b->prev);
    try_merge(e, b, b->next);
    insert_unmapped(e, b);
    uint64_t unmapped = end - start;
    if (device_free(e, unmapped) < 0)
        return -1;
    e->st[C_NUM_DEVICE_FREE]++;
    dec(e, S_RESERVED_BYTES, b->small ? P_SMALL : P_LARGE, unmapped);
    return 0;
}

/* _release_if_unmapped (release_expandable_segment): drop a segment whose one block is unmapped */
static void release_if_unmapped(Engine *e, Block *b) {
    if (b->mapped || b->prev || b->next || b->allocated)
        return;
    Segment *s = b->segment;
    remove_unmapped(e, b);
    segment_unlink(e, s);
    del_block(e, b);
    PyMem_RawFree(s);
}

/* _find_expandable_block */
static int find_expandable_block(Engine *e, uint64_t size, int small, int64_t stream, Block **out) {
    uint64_t k1 = (uint64_t)stream ^ STREAM_BIAS;
    for (Block *u = tree_lower_bound(&e->unmapped[small], k1, 0, 0); u && u->k1 == k1; u = tree_next(u)) {
        Block *candidate = u;
        if (candidate->prev && !candidate->prev->allocated)
            candidate = candidate->prev;
        uint64_t room = 0;
        for (Block *w = candidate; room < size && w && !w->allocated; w = w->next)
            room += w->size;
        if (room >= size) {
            *out = candidate;
            return 0;
        }
    }
    uint64_t page, space, base;
    if (expandable_reservation(e, small, &page, &space) < 0 || reserve_blocks(e, 1) < 0)
        return -1;
    Segment *s = PyMem_RawCalloc(1, sizeof(Segment));
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (new_segment_base(e, space, small, &base) < 0) {
        PyMem_RawFree(s);
        return -1;
    }
    s->base = base;
    s->size = space;
    s->small = (uint8_t)small;
    s->expandable = 1;
    s->page_size = page;
    s->stream = stream;
    segment_append(e, s);
    Block *b = new_block(e, base, space, small, s, stream);
    b->mapped = 0;
    insert_unmapped(e, b);
    *out = b;
    return 0;
}

/* _try_allocate_expandable_block */
static int try_allocate_expandable_block(Engine *e, uint64_t size, int small, int64_t stream, Block **out) {
    Block *candidate;
    if (find_expandable_block(e, size, small, stream, &candidate) < 0)
        return -1;
    if (!candidate->mapped) {
        int r = map_block(e, candidate, candidate->size < size ? candidate->size : size);
        if (r <= 0)
            return r;
    }
    while (candidate->size < size) {
        Block *following = candidate->next;
        if (following == NULL || following->mapped || following->allocated)
            return 0;
        uint64_t need = size - candidate->size;
        /* mapping `following` merges the free block before it (candidate) into it */
        int r = map_block(e, following, need < following->size ? need : following->size);
        if (r <= 0)
            return r;
        candidate = following;
    }
    remove_free(e, candidate);
    *out = candidate;
    return 0;
}

/* _alloc_block; *out stays NULL when refused */
static int alloc_block(Engine *e, uint64_t size, int small, int64_t stream, int retry, Block **out) {
    *out = NULL;
    if (retry)
        e->st[C_NUM_ALLOC_RETRIES]++;
    uint64_t alloc_size = segment_size(e, size);
    i128 after = (i128)reserved_bytes(e) + (i128)alloc_size;
    if (e->set_fraction && after > (i128)e->allowed_memory_maximum)
        return 0;
    if (e->throw_on_npumalloc_oom && after > (i128)e->rejection_limit) {
        e->rejected = 1;
        return 0;
    }
    if (e->expandable)
        return try_allocate_expandable_block(e, size, small, stream, out);
    if (reserve_blocks(e, 1) < 0)
        return -1;
    Segment *s = PyMem_RawCalloc(1, sizeof(Segment));
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int ok = device_malloc(e, alloc_size);
    if (ok <= 0) {
        PyMem_RawFree(s);
        return ok;
    }
    e->st[C_NUM_DEVICE_ALLOC]++;
    uint64_t base;
    if (new_segment_base(e, alloc_size, small, &base) < 0) {
        PyMem_RawFree(s);
        return -1;
    }
    s->base = base;
    s->size = alloc_size;
    s->small = (uint8_t)small;
    s->stream = stream;
    segment_append(e, s);
    int pool = small ? P_SMALL : P_LARGE;
    inc(e, S_SEGMENT, pool, 1);
    inc(e, S_RESERVED_BYTES, pool, alloc_size);
    if (alloc_size >= e->max_split_size)
        bump(e->st + C_OVERSIZE_SEGMENTS, 1);
    note_reserved(e);
    *out = new_block(e, base, alloc_size, small, s, stream);
    return 0;
}

/* _release_available_cached_blocks: 1 released enough, 0 not, -1 error */
static int release_available_cached_blocks(Engine *e, uint64_t size, int small, int64_t stream) {
    if (e->max_split_size == UNLIMITED)
        return 0;
    uint64_t key = size > e->max_split_size ? size : e->max_split_size;
    uint64_t k1 = (uint64_t)stream ^ STREAM_BIAS;
    Tree *t = &e->free_blocks[small];
    Block *b = tree_lower_bound(t, k1, key, 0);
    if (b && b->k1 == k1) {
        if (b->prev || b->next || b->segment->expandable)
            return 0;
        return release_block(e, b) < 0 ? -1 : 1;
    }
    uint64_t released = 0;
    Block *cur = b ? tree_prev(b) : tree_last(t);
    while (released < key && cur && cur->k2 >= e->max_split_size && cur->k1 == k1) {
        Block *before = tree_prev(cur);
        if (!cur->prev && !cur->next && !cur->segment->expandable) {
            released += cur->size;
            if (release_block(e, cur) < 0)
                return -1;
        }
        cur = before;
    }
    return released >= key;
}

/* _release_cached_blocks: free every cached unsplit segment; expandable: unmap free pages */
static int release_cached_blocks(Engine *e) {
    e->st[C_NUM_SYNC_ALL_STREAMS]++;
    for (int small = 0; small < 2; small++) { /* large pool first */
        Py_ssize_t n = e->free_blocks[small].count, unmap_count = 0;
        Block **blocks = tree_snapshot(&e->free_blocks[small]);
        if (blocks == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            Block *b = blocks[i];
            if (b->segment->expandable) {
                blocks[unmap_count++] = b;
            } else if (!b->prev && !b->next) {
                if (release_block(e, b) < 0) {
                    PyMem_RawFree(blocks);
                    return -1;
                }
            }
        }
        for (Py_ssize_t i = 0; i < unmap_count; i++) {
            Block *b = blocks[i];
            if (b->tree == IN_FREE && unmap_block(e, b) < 0) {
                PyMem_RawFree(blocks);
                return -1;
            }
            release_if_unmapped(e, b);
        }
        PyMem_RawFree(blocks);
    }
    return 0;
}

/* _garbage_collect_cached_blocks */
static int garbage_collect_cached_blocks(Engine *e) {
    i128 threshold = (i128)(e->garbage_collection_threshold * (double)e->allowed_memory_maximum);
    i128 reserved = reserved_bytes(e);
    if (reserved <= threshold)
        return 0;
    i128 target = reserved - threshold;
    int64_t calls = e->gc_calls[0], total_age = 0, count = 0;
    Tree *t = &e->free_blocks[0];
    for (Block *b = tree_first(t); b; b = tree_next(b)) {
        if (!b->prev && !b->next && !b->segment->expandable) {
            total_age += calls - b->gc_base;
            count++;
        }
    }
    if (count == 0)
        return 0;
    i128 reclaimed = 0;
    int freed = 1;
    while (reclaimed < target && freed && count > 0) {
        double age_threshold = (double)total_age / (double)count;
        freed = 0;
        Py_ssize_t n = t->count;
        Block **blocks = tree_snapshot(t);
        if (blocks == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            Block *b = blocks[i];
            if (b->prev || b->next || b->segment->expandable)
                continue;
            int64_t age = calls - b->gc_base;
            if ((double)age >= age_threshold) {
                freed = 1;
                reclaimed += b->size;
                total_age -= age;
                count--;
                if (release_block(e, b) < 0) {
                    PyMem_RawFree(blocks);
                    return -1;
                }
            }
        }
        PyMem_RawFree(blocks);
    }
    return 0;
}

/* AllocatorOutOfMemory(requested, name, device.free_bytes, "... allocated, ... reserved") */
static void raise_out_of_memory(Engine *e, PyObject *requested) {
    PyObject *free_bytes = PyObject_GetAttrString(e->device, "free_bytes");
    PyObject *allocated = NULL, *reserved = NULL, *detail = NULL;
    if (free_bytes != NULL && (allocated = cell_to_py(allocated_bytes(e))) != NULL
        && (reserved = cell_to_py(reserved_bytes(e))) != NULL)
        detail = PyUnicode_FromFormat("%S allocated, %S reserved", allocated, reserved);
    kvg_raise_out_of_memory(requested, e->name, free_bytes, detail);
    Py_XDECREF(free_bytes);
    Py_XDECREF(allocated);
    Py_XDECREF(reserved);
    Py_XDECREF(detail);
}

/* malloc's miss path: garbage collection, a new segment, the two releases and retries, or OOM */
static Block *allocate_new_block(Engine *e, uint64_t size, int small, int64_t stream, PyObject *requested) {
    Block *b = NULL;
    if (e->gc_enabled && garbage_collect_cached_blocks(e) < 0)
        return NULL;
    e->rejected = 0;
    if (alloc_block(e, size, small, stream, 0, &b) < 0)
        return NULL;
    if (b == NULL && !e->rejected) {
        int released = release_available_cached_blocks(e, size, small, stream);
        if (released < 0 || (released && alloc_block(e, size, small, stream, 0, &b) < 0))
            return NULL;
    }
    if (b == NULL && !e->rejected) {
        if (release_cached_blocks(e) < 0 || alloc_block(e, size, small, stream, 1, &b) < 0)
            return NULL;
    }
    if (b == NULL) {
        if (!e->rejected)
            e->st[C_NUM_OOMS]++;
        raise_out_of_memory(e, requested);
    }
    return b;
}

/* _align_base: torch_npu moves a large request up to the base_addr_aligned boundary */
static Block *align_base(Engine *e, Block *b, uint64_t size) {
    uint64_t offset = e->base_addr_aligned - b->addr % e->base_addr_aligned;
    if (offset + size > b->size)
        return b;
    Block *aligned = new_block(e, b->addr + offset, b->size - offset, b->small, b->segment, b->stream);
    link_after(b, aligned);
    b->size = offset;
    insert_free(e, b);
    return aligned;
}

static PyObject *busy_error(void) {
    kvg_refuse_reentry(1);
    return NULL;
}

static int ready(Engine *e) {
    if (!e->initialized) {
        PyErr_SetString(PyExc_RuntimeError, "the allocator engine is not initialised");
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------ malloc */
/* `requested_known` is 0 for a request of 2**64 bytes or more (kept as HUGE_SIZE): no device the
 * engine takes can serve it, but a device that grants such a segment anyway (its capacity raised
 * after construction) gets an OverflowError, the block staying cached, not a wrong statistic. */
static PyObject *malloc_rounded(Engine *e, PyObject *size_obj, uint64_t size, i128 requested, int requested_known,
                                int64_t stream) {
    int small = size <= K_SMALL_SIZE, pool = small ? P_SMALL : P_LARGE;
    if (reserve_blocks(e, 0) < 0 || map_reserve(&e->active) < 0)
        return NULL;
    Block *b = get_free_block(e, size, small, stream);
    if (b == NULL) {
        b = allocate_new_block(e, size, small, stream, size_obj);
        if (b == NULL)
            return NULL;
    }
    if (!requested_known) {
        insert_free(e, b);
        PyErr_SetString(PyExc_OverflowError, "a request of 2**64 bytes or more was granted: beyond the C engine");
        return NULL;
    }
    if (e->aligns_base && size >= K_ROUND_LARGE && b->addr % e->base_addr_aligned)
        b = align_base(e, b, size);
    /* Split off the remainder (should_split) and activate the block (alloc_found_block). */
    uint64_t addr = b->addr, remaining_size = b->size - size;
    int split = (small || e->expandable) ? remaining_size >= K_MIN_BLOCK_SIZE
                                         : size < e->max_split_size && remaining_size > K_SMALL_SIZE;
    Segment *s = b->segment;
    if (split) {
        Block *remaining = new_block(e, addr + size, remaining_size, small, s, b->stream);
        int already_split = b->next != NULL || b->prev != NULL;
        link_after(b, remaining);
        b->size = size;
        insert_free(e, remaining);
        if (!s->expandable) {
            if (already_split) {
                dec(e, S_INACTIVE_SPLIT_BYTES, pool, size);
            } else {
                inc(e, S_INACTIVE_SPLIT_BYTES, pool, remaining_size);
                inc(e, S_INACTIVE_SPLIT, pool, 1);
            }
        }
    } else if ((b->prev || b->next) && !s->expandable) {
        dec(e, S_INACTIVE_SPLIT_BYTES, pool, b->size);
        dec(e, S_INACTIVE_SPLIT, pool, 1);
    }
    b->allocated = 1;
    b->requested = requested;
    map_put(&e->active, addr, b);
    i128 block_size = b->size;
    inc(e, S_ALLOCATION, pool, 1);
    inc(e, S_ALLOCATED_BYTES, pool, block_size);
    if (allocated_bytes(e) > e->st[C_WINDOW_ALLOC])
        e->st[C_WINDOW_ALLOC] = allocated_bytes(e);
    if (requested)
        inc(e, S_REQUESTED_BYTES, pool, requested);
    if (b->size >= e->max_split_size)
        bump(e->st + C_OVERSIZE_ALLOCATIONS, 1);
    return PyLong_FromUnsignedLongLong(addr);
}

static int parse_stream(PyObject *obj, int64_t *stream) {
    if (obj == NULL)
        return 0;
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "stream must be an int, not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *stream = v;
    return 0;
}

static PyObject *Engine_malloc(Engine *e, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *size_obj = NULL, *stream_obj = NULL;
    if (kwnames == NULL && nargs == 1) {
        size_obj = args[0];
    } else {
        static const char *const names[] = {"size", "persistent", "stream"};
        PyObject *slots[3] = {NULL, NULL, NULL};
        if (nargs > 3) {
            PyErr_Format(PyExc_TypeError, "malloc() takes at most 3 arguments (%zd given)", nargs);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < nargs; i++)
            slots[i] = args[i];
        Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
        for (Py_ssize_t i = 0; i < nkw; i++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, i);
            int found = 0;
            for (int j = 0; j < 3; j++) {
                if (PyUnicode_CompareWithASCIIString(key, names[j]) == 0) {
                    if (slots[j] != NULL) {
                        PyErr_Format(PyExc_TypeError, "malloc() got multiple values for argument '%s'", names[j]);
                        return NULL;
                    }
                    slots[j] = args[nargs + i];
                    found = 1;
                }
            }
            if (!found) {
                PyErr_Format(PyExc_TypeError, "malloc() got an unexpected keyword argument '%U'", key);
                return NULL;
            }
        }
        if (slots[0] == NULL) {
            PyErr_SetString(PyExc_TypeError, "malloc() missing 1 required positional argument: 'size'");
            return NULL;
        }
        size_obj = slots[0];
        stream_obj = slots[2];
    }
    if (!ready(e))
        return NULL;
    if (e->busy)
        return busy_error();
    uint64_t size;
    i128 requested = 0;
    int requested_known = 1;
    int64_t stream = 0;
    if (PyLong_Check(size_obj)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(size_obj, &overflow);
        if (overflow == 0) {
            if (v == -1 && PyErr_Occurred())
                return NULL;
            if (v == 0 && e->null_for_zero)
                return PyLong_FromLong(0);
            requested = v;
            size = v < 0 ? K_MIN_BLOCK_SIZE : round_size(e, (uint64_t)v); /* size + pad < 512 */
        } else if (overflow > 0) {
            /* 2**63 bytes or more: more than the device holds */
            unsigned long long u = PyLong_AsUnsignedLongLong(size_obj);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                size = HUGE_SIZE;
                requested_known = 0;
            } else {
                size = round_size(e, u);
                requested = u;
            }
        } else {
            PyErr_SetString(PyExc_OverflowError, "malloc size below the int64 range");
            return NULL;
        }
    } else {
        /* not an int: the model's own steps, up to where they fail (torch_native._odd_size) */
        PyObject *r = PyObject_CallOneArg(e->odd_size, size_obj);
        return r;
    }
    if (parse_stream(stream_obj, &stream) < 0)
        return NULL;
    e->busy = 1;
    PyObject *result = malloc_rounded(e, size_obj, size, requested, requested_known, stream);
    e->busy = 0;
    return result;
}

/* ------------------------------------------------------------------ free */
static void key_error(PyObject *key) {
    PyObject *args = PyTuple_Pack(1, key);
    if (args != NULL) {
        PyErr_SetObject(PyExc_KeyError, args);
        Py_DECREF(args);
    }
}

#ifndef _PyHASH_MODULUS
#define _PyHASH_MODULUS (((size_t)1 << 61) - 1)
#endif

/* The allocated block a non-int key finds in the model's dict of allocated blocks: one whose
 * address has the key's hash and compares equal to it (a float 2.0 ** 40 finds 1 << 40). */
static Block *find_by_equal_key(Engine *e, PyObject *key) {
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1 && PyErr_Occurred())
        return NULL;
    /* A non-negative int's hash is below the modulus: a dict of addresses holds no other hash. */
    if (h < 0 || (size_t)h >= _PyHASH_MODULUS) {
        key_error(key);
        return NULL;
    }
    for (u128 a = (u128)h; a <= UINT64_MAX; a += _PyHASH_MODULUS) {
        Block *b = map_get(&e->active, (uint64_t)a);
        if (b == NULL)
            continue;
        PyObject *addr = PyLong_FromUnsignedLongLong((uint64_t)a);
        if (addr == NULL)
            return NULL;
        /* key.__eq__ is Python code: the engine is busy while it runs, so that it cannot free or
         * split the block found (which would leave `b` stale: freed twice, the trees corrupted). */
        e->busy = 1;
        int equal = PyObject_RichCompareBool(key, addr, Py_EQ);
        e->busy = 0;
        Py_DECREF(addr);
        if (equal < 0)
            return NULL;
        if (equal)
            return b;
    }
    key_error(key);
    return NULL;
}

static int free_block(Engine *e, Block *b) {
    map_del(&e->active, b->addr);
    int small = b->small, pool = small ? P_SMALL : P_LARGE;
    uint64_t original_size = b->size;
    dec(e, S_ALLOCATION, pool, 1);
    dec(e, S_ALLOCATED_BYTES, pool, original_size);
    if (b->requested) {
        dec(e, S_REQUESTED_BYTES, pool, b->requested);
        b->requested = 0;
    }
    if (original_size >= e->max_split_size)
        drop(e->st + C_OVERSIZE_ALLOCATIONS, 1);
    b->allocated = 0;
    /* free_block -> try_merge_blocks with free mapped neighbours */
    int64_t merged_blocks = 0;
    i128 merged_bytes = 0;
    Block *prev = b->prev, *nxt = b->next;
    if (prev && !prev->allocated && prev->mapped) {
        merged_blocks++;
        merged_bytes += prev->size;
        remove_free(e, prev);
        absorb(e, b, prev);
    }
    if (nxt && !nxt->allocated && nxt->mapped) {
        merged_blocks++;
        merged_bytes += nxt->size;
        remove_free(e, nxt);
        absorb(e, b, nxt);
    }
    insert_free(e, b);
    if (!b->segment->expandable) {
        int64_t inactive_blocks;
        i128 inactive_bytes;
        if (b->prev || b->next) {
            inactive_blocks = 1 - merged_blocks;
            inactive_bytes = (i128)b->size - merged_bytes;
        } else {
            inactive_blocks = -merged_blocks;
            inactive_bytes = -merged_bytes;
        }
        if (inactive_blocks > 0)
            inc(e, S_INACTIVE_SPLIT, pool, inactive_blocks);
        else if (inactive_blocks < 0)
            dec(e, S_INACTIVE_SPLIT, pool, -inactive_blocks);
        if (inactive_bytes > 0)
            inc(e, S_INACTIVE_SPLIT_BYTES, pool, inactive_bytes);
        else if (inactive_bytes < 0)
            dec(e, S_INACTIVE_SPLIT_BYTES, pool, -inactive_bytes);
    }
    return 0;
}

static PyObject *Engine_free(Engine *e, PyObject *addr_obj) {
    if (!ready(e))
        return NULL;
    if (e->busy)
        return busy_error();
    Block *b;
    if (PyLong_Check(addr_obj)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(addr_obj, &overflow);
        if (overflow == 0 && v == -1 && PyErr_Occurred())
            return NULL;
        if (overflow == 0 && v == 0) /* null, as torch_npu hands out for 0 bytes */
            Py_RETURN_NONE;
        b = NULL;
        if (overflow == 0 && v > 0) {
            b = map_get(&e->active, (uint64_t)v);
        } else if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(addr_obj);
            if (u == (unsigned long long)-1 && PyErr_Occurred())
                PyErr_Clear();
            else
                b = map_get(&e->active, u);
        }
        if (b == NULL) {
            key_error(addr_obj);
            return NULL;
        }
    } else {
        int falsy = PyObject_Not(addr_obj);
        if (falsy < 0)
            return NULL;
        if (falsy)
            Py_RETURN_NONE;
        b = find_by_equal_key(e, addr_obj);
        if (b == NULL)
            return NULL;
    }
    e->busy = 1;
    int r = free_block(e, b);
    e->busy = 0;
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the rest of the API */
static PyObject *Engine_empty_cache(Engine *e, PyObject *unused) {
    (void)unused;
    if (!ready(e))
        return NULL;
    if (e->busy)
        return busy_error();
    e->busy = 1;
    int r = release_cached_blocks(e);
    e->busy = 0;
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Engine_reset_peak_memory_stats(Engine *e, PyObject *unused) {
    (void)unused;
    for (int i = 0; i < N_STAT_ARRAYS * N_STAT_POOLS; i++)
        e->st[i * N_STAT_FIELDS + F_PEAK] = e->st[i * N_STAT_FIELDS + F_CURRENT];
    e->st[C_OVERSIZE_ALLOCATIONS + 1] = e->st[C_OVERSIZE_ALLOCATIONS];
    e->st[C_OVERSIZE_SEGMENTS + 1] = e->st[C_OVERSIZE_SEGMENTS];
    Py_RETURN_NONE;
}

static PyObject *Engine_take_window_peaks(Engine *e, PyObject *unused) {
    (void)unused;
    i128 allocated = allocated_bytes(e), reserved = reserved_bytes(e);
    i128 peak_allocated = e->st[C_WINDOW_ALLOC] > allocated ? e->st[C_WINDOW_ALLOC] : allocated;
    i128 peak_reserved = e->st[C_WINDOW_RESERVED] > reserved ? e->st[C_WINDOW_RESERVED] : reserved;
    PyObject *first = cell_to_py(peak_allocated), *second = cell_to_py(peak_reserved);
    if (first == NULL || second == NULL) {
        Py_XDECREF(first);
        Py_XDECREF(second);
        return NULL;
    }
    e->st[C_WINDOW_ALLOC] = allocated;
    e->st[C_WINDOW_RESERVED] = reserved;
    return Py_BuildValue("(NN)", first, second);
}

static PyObject *tree_key_bytes(const Tree *t, int unmapped) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, t->count * 24);
    if (out == NULL)
        return NULL;
    uint64_t *p = (uint64_t *)PyBytes_AS_STRING(out);
    for (Block *b = tree_first(t); b; b = tree_next(b)) {
        *p++ = b->k1;
        *p++ = b->k2;
        *p++ = unmapped ? b->size : b->k3;
    }
    return out;
}

/* steady_state_key: the free and unmapped blocks, the segments, the next segment address, the
 * device's memory and the limits; None with garbage collection or trace-replay callbacks. */
static PyObject *Engine_steady_state_key(Engine *e, PyObject *unused) {
    (void)unused;
    if (!ready(e))
        return NULL;
    if (e->gc_enabled || e->segment_address != NULL || e->on_map != NULL)
        Py_RETURN_NONE;
    if (e->segments_key == NULL) {
        Py_ssize_t n = 0;
        for (Segment *s = e->seg_first; s; s = s->lnext)
            n++;
        PyObject *key = PyBytes_FromStringAndSize(NULL, n * 48);
        if (key == NULL)
            return NULL;
        uint64_t *p = (uint64_t *)PyBytes_AS_STRING(key);
        for (Segment *s = e->seg_first; s; s = s->lnext) {
            *p++ = s->base;
            *p++ = s->size;
            *p++ = s->small;
            *p++ = s->expandable;
            *p++ = s->page_size;
            *p++ = (uint64_t)s->stream;
        }
        e->segments_key = key;
    }
    /* Held: the device's attributes below are Python code, which may add a segment (clearing the cache). */
    PyObject *segments = Py_NewRef(e->segments_key);
    PyObject *large = tree_key_bytes(&e->free_blocks[0], 0), *small = tree_key_bytes(&e->free_blocks[1], 0);
    PyObject *unmapped = NULL;
    if (e->unmapped[0].count || e->unmapped[1].count) {
        PyObject *u0 = tree_key_bytes(&e->unmapped[0], 1), *u1 = tree_key_bytes(&e->unmapped[1], 1);
        if (u0 && u1)
            unmapped = PyTuple_Pack(2, u0, u1);
        Py_XDECREF(u0);
        Py_XDECREF(u1);
    } else {
        unmapped = Py_NewRef(Py_None);
    }
    uint64_t next_addr = e->next_addr; /* read before the device's attributes, as the model does */
    PyObject *allocator_bytes = PyObject_GetAttrString(e->device, "allocator_bytes");
    PyObject *non_allocator_bytes = PyObject_GetAttrString(e->device, "non_allocator_bytes");
    PyObject *capacity_bytes = PyObject_GetAttrString(e->device, "capacity_bytes");
    PyObject *key = NULL;
    if (large && small && unmapped && allocator_bytes && non_allocator_bytes && capacity_bytes)
        key = Py_BuildValue("(OOOOKOOOKOO)", large, small, unmapped, segments, (unsigned long long)next_addr,
                            allocator_bytes, non_allocator_bytes, capacity_bytes,
                            (unsigned long long)e->allowed_memory_maximum, e->set_fraction ? Py_True : Py_False,
                            e->address_space_total);
    Py_DECREF(segments);
    Py_XDECREF(large);
    Py_XDECREF(small);
    Py_XDECREF(unmapped);
    Py_XDECREF(allocator_bytes);
    Py_XDECREF(non_allocator_bytes);
    Py_XDECREF(capacity_bytes);
    return key;
}

static PyObject *cell_pair(PyObject *container, Py_ssize_t index) {
    PyObject *i = PyLong_FromSsize_t(index);
    if (i == NULL)
        return NULL;
    PyObject *pair = PyTuple_Pack(2, container, i);
    Py_DECREF(i);
    return pair;
}

/* Append (container, index) to list; -1 with an exception set on failure. */
static int append_cell(PyObject *list, PyObject *container, Py_ssize_t index) {
    PyObject *pair = cell_pair(container, index);
    if (pair == NULL)
        return -1;
    int failed = PyList_Append(list, pair);
    Py_DECREF(pair);
    return failed;
}

/* steady_cells: (counters, peaks) as (container, index) pairs, the model's order */
static PyObject *Engine_steady_cells(Engine *e, PyObject *unused) {
    (void)unused;
    if (!ready(e))
        return NULL;
    if (e->steady_cells != NULL)
        return Py_NewRef(e->steady_cells);
    PyObject *counters = PyList_New(0), *peaks = PyList_New(0), *cells = (PyObject *)e->cells;
    if (counters == NULL || peaks == NULL)
        goto error;
    static const int fields[] = {F_CURRENT, F_ALLOCATED, F_FREED};
    for (int stat_index = 0; stat_index < N_STAT_ARRAYS * N_STAT_POOLS + 2; stat_index++) {
        Py_ssize_t base = stat_index * N_STAT_FIELDS; /* the oversize stats follow the arrays, 4 cells each */
        for (int f = 0; f < 3; f++) {
            if (append_cell(counters, cells, base + fields[f]) < 0)
                goto error;
        }
        if (append_cell(peaks, cells, base + F_PEAK) < 0)
            goto error;
    }
    for (Py_ssize_t i = C_NUM_ALLOC_RETRIES; i <= C_NUM_DEVICE_FREE; i++) {
        if (append_cell(counters, cells, i) < 0)
            goto error;
    }
    for (Py_ssize_t i = C_WINDOW_ALLOC; i <= C_WINDOW_RESERVED; i++) {
        if (append_cell(peaks, cells, i) < 0)
            goto error;
    }
    PyObject *device_peak = Py_BuildValue("(Os)", e->device, "peak_used_bytes");
    if (device_peak == NULL || PyList_Append(peaks, device_peak) < 0) {
        Py_XDECREF(device_peak);
        goto error;
    }
    Py_DECREF(device_peak);
    e->steady_cells = PyTuple_Pack(2, counters, peaks);
    Py_DECREF(counters);
    Py_DECREF(peaks);
    return e->steady_cells ? Py_NewRef(e->steady_cells) : NULL;
error:
    Py_XDECREF(counters);
    Py_XDECREF(peaks);
    return NULL;
}

/* fits_in_cache: whether a request of `size` (already rounded) would be served from cached blocks */
static PyObject *Engine_fits_in_cache(Engine *e, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"size", "stream", NULL};
    PyObject *size_obj;
    long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|L:fits_in_cache", names, &size_obj, &stream))
        return NULL;
    uint64_t size = PyLong_AsUnsignedLongLong(size_obj); /* OverflowError below 0 or from 2**64 */
    if (size == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    uint64_t k1 = (uint64_t)stream ^ STREAM_BIAS;
    Block *b = tree_lower_bound(&e->free_blocks[size <= K_SMALL_SIZE], k1, size, 0);
    if (b == NULL || b->k1 != k1)
        Py_RETURN_FALSE;
    if (size < e->max_split_size && b->k2 >= e->max_split_size)
        Py_RETURN_FALSE;
    return PyBool_FromLong(!(size >= e->max_split_size && b->k2 - size >= e->max_non_split_rounding_size));
}

/* free_block_sizes(small): the model's signature, keyword included */
static PyObject *Engine_free_block_sizes(Engine *e, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"small", NULL};
    PyObject *small;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:free_block_sizes", names, &small))
        return NULL;
    int truth = PyObject_IsTrue(small);
    if (truth < 0)
        return NULL;
    const Tree *t = &e->free_blocks[truth];
    PyObject *out = PyList_New(t->count);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (Block *b = tree_first(t); b; b = tree_next(b)) {
        PyObject *size = PyLong_FromUnsignedLongLong(b->k2);
        if (size == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i++, size);
    }
    return out;
}

/* The introspection calls below copy what they report into a C array first, then build Python
 * objects from the copy: building them can start a garbage collection, whose finalizers may call
 * malloc / free / empty_cache, which free blocks and segments a walk would still be reading. */
typedef struct {
    uint64_t addr, size; /* a block, or a segment (base, size) */
    int64_t stream;
    uint8_t end_of_range, allocated, small, expandable;
} Row;

static PyObject *Engine_segments(Engine *e, PyObject *unused) {
    (void)unused;
    Py_ssize_t n = 0;
    for (Segment *s = e->seg_first; s; s = s->lnext)
        n++;
    Row *rows = PyMem_RawMalloc(sizeof(Row) * (size_t)(n ? n : 1));
    if (rows == NULL)
        return PyErr_NoMemory();
    Py_ssize_t i = 0;
    for (Segment *s = e->seg_first; s; s = s->lnext, i++) {
        rows[i].addr = s->base;
        rows[i].size = s->size;
        rows[i].small = s->small;
    }
    PyObject *out = PyList_New(n);
    for (i = 0; out != NULL && i < n; i++) {
        PyObject *item = Py_BuildValue("(KKO)", (unsigned long long)rows[i].addr, (unsigned long long)rows[i].size,
                                       rows[i].small ? Py_True : Py_False);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, item);
    }
    PyMem_RawFree(rows);
    if (out != NULL && PyList_Sort(out) < 0)
        Py_CLEAR(out);
    return out;
}

static void note_head(Block *b) {
    if (b->prev == NULL)
        b->segment->scan_head = b;
}

/* (small, expandable, stream, ((address, size, allocated), ...)) per contiguous mapped range of
 * each segment, in the segments' order (the model's _mapped_ranges) */
static PyObject *Engine_mapped_ranges(Engine *e, PyObject *unused) {
    (void)unused;
    Py_ssize_t segments = 0;
    for (Segment *s = e->seg_first; s; s = s->lnext, segments++)
        s->scan_head = NULL;
    for (size_t i = 0; i <= e->active.mask; i++)
        if (e->active.slots[i].block)
            note_head(e->active.slots[i].block);
    for (int k = 0; k < 2; k++) {
        for (Block *b = tree_first(&e->free_blocks[k]); b; b = tree_next(b))
            note_head(b);
        for (Block *b = tree_first(&e->unmapped[k]); b; b = tree_next(b))
            note_head(b);
    }
    /* Each block gives at most one row and ends at most one range. */
    size_t capacity = 2 * (size_t)e->live_blocks + (size_t)segments + 1, n = 0;
    Row *rows = PyMem_RawMalloc(sizeof(Row) * capacity);
    if (rows == NULL)
        return PyErr_NoMemory();
    for (Segment *s = e->seg_first; s; s = s->lnext) {
        int open = 0;
        for (Block *b = s->scan_head;; b = b->next) {
            if (n + 2 > capacity) /* only blocks in broken lists (hostile segment addresses) */
                break;
            if (b != NULL && b->mapped) {
                rows[n++] = (Row){.addr = b->addr, .size = b->size, .allocated = b->allocated};
                open = 1;
                continue;
            }
            if (open) {
                rows[n++] =
                    (Row){.stream = s->stream, .end_of_range = 1, .small = s->small, .expandable = s->expandable};
                open = 0;
            }
            if (b == NULL)
                break;
        }
    }
    PyObject *out = PyList_New(0), *current = NULL;
    if (out == NULL)
        goto error;
    for (size_t i = 0; i < n; i++) {
        Row *r = &rows[i];
        if (!r->end_of_range) {
            if (current == NULL && (current = PyList_New(0)) == NULL)
                goto error;
            PyObject *item = Py_BuildValue("(KKO)", (unsigned long long)r->addr, (unsigned long long)r->size,
                                           r->allocated ? Py_True : Py_False);
            if (item == NULL || PyList_Append(current, item) < 0) {
                Py_XDECREF(item);
                goto error;
            }
            Py_DECREF(item);
            continue;
        }
        PyObject *blocks = current ? PyList_AsTuple(current) : PyTuple_New(0);
        Py_CLEAR(current);
        if (blocks == NULL)
            goto error;
        PyObject *range = Py_BuildValue("(OOLN)", r->small ? Py_True : Py_False, r->expandable ? Py_True : Py_False,
                                        (long long)r->stream, blocks);
        if (range == NULL || PyList_Append(out, range) < 0) {
            Py_XDECREF(range);
            goto error;
        }
        Py_DECREF(range);
    }
    PyMem_RawFree(rows);
    return out;
error:
    PyMem_RawFree(rows);
    Py_XDECREF(current);
    Py_XDECREF(out);
    return NULL;
}

/* (addr, size, requested, small, allocated, mapped, stream) of the allocated or free block at addr */
static PyObject *Engine_block_info(Engine *e, PyObject *addr_obj) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(addr_obj);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Block *found = map_get(&e->active, addr);
    for (int k = 0; found == NULL && k < 2; k++)
        for (Block *b = tree_first(&e->free_blocks[k]); b && found == NULL; b = tree_next(b))
            if (b->addr == addr)
                found = b;
    if (found == NULL)
        Py_RETURN_NONE;
    PyObject *requested = cell_to_py(found->requested);
    if (requested == NULL)
        return NULL;
    return Py_BuildValue("(KKNOOOL)", (unsigned long long)found->addr, (unsigned long long)found->size, requested,
                         found->small ? Py_True : Py_False, found->allocated ? Py_True : Py_False,
                         found->mapped ? Py_True : Py_False, (long long)found->stream);
}

/* An "O&" converter: a Python int in 0 .. 2**64 - 1 (PyArg's "K" would wrap a negative or larger one). */
static int u64_converter(PyObject *obj, void *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "expected an int, not %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(unsigned long long *)out = v;
    return 1;
}

static PyObject *Engine_set_fraction(Engine *e, PyObject *args) {
    unsigned long long allowed;
    int gc_enabled;
    if (!PyArg_ParseTuple(args, "O&p:_set_fraction", u64_converter, &allowed, &gc_enabled))
        return NULL;
    e->allowed_memory_maximum = allowed;
    e->set_fraction = 1;
    e->gc_enabled = gc_enabled;
    Py_RETURN_NONE;
}

static PyObject *Engine_round_size(Engine *e, PyObject *size_obj) {
    unsigned long long size = PyLong_AsUnsignedLongLong(size_obj);
    if (size == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLongLong(round_size(e, size));
}

/* ---- _check(): the engine's own invariants, for tests */
#define CHECK(cond, ...)                                                                                               \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            PyErr_Format(PyExc_AssertionError, __VA_ARGS__);                                                           \
            return -1;                                                                                                 \
        }                                                                                                              \
    } while (0)

static int check_tree(const Tree *t, int kind, int small) {
    Py_ssize_t n = 0;
    const Block *last = NULL;
    for (Block *b = tree_first(t); b; b = tree_next(b)) {
        n++;
        CHECK(b->tree == kind && b->small == small && !b->allocated, "block %llu: wrong tree", b->addr);
        CHECK(b->mapped == (kind == IN_FREE), "block %llu: mapped %d in tree %d", b->addr, b->mapped, kind);
        CHECK(b->k1 == ((uint64_t)b->stream ^ STREAM_BIAS), "block %llu: stale key", b->addr);
        CHECK(kind == IN_FREE ? (b->k2 == b->size && b->k3 == b->addr) : (b->k2 == b->addr && b->k3 == 0),
              "block %llu: stale key", b->addr);
        CHECK(last == NULL || key_less(last, b->k1, b->k2, b->k3), "tree out of order at %llu", b->addr);
        CHECK(b->left == NULL || (b->left->parent == b && b->left->prio >= b->prio), "treap links at %llu", b->addr);
        CHECK(b->right == NULL || (b->right->parent == b && b->right->prio >= b->prio), "treap links at %llu", b->addr);
        last = b;
    }
    CHECK(n == t->count, "tree count %zd, %zd blocks", t->count, n);
    CHECK(t->root == NULL || t->root->parent == NULL, "tree root has a parent");
    return 0;
}

static int check_engine(Engine *e) {
    for (int k = 0; k < 2; k++) {
        if (check_tree(&e->free_blocks[k], IN_FREE, k) < 0 || check_tree(&e->unmapped[k], IN_UNMAPPED, k) < 0)
            return -1;
    }
    i128 allocations[3] = {0}, allocated[3] = {0}, requested[3] = {0}, reserved[3] = {0}, segments[3] = {0};
    i128 inactive[3] = {0}, inactive_bytes[3] = {0};
    Py_ssize_t active = 0, blocks = 0, in_trees = 0;
    for (size_t i = 0; i <= e->active.mask; i++) {
        Block *b = e->active.slots[i].block;
        if (b == NULL)
            continue;
        active++;
        CHECK(b->allocated && b->mapped && b->tree == IN_NONE && e->active.slots[i].key == b->addr,
              "allocated block %llu", b->addr);
        CHECK(map_get(&e->active, b->addr) == b, "address map cannot find %llu", b->addr);
    }
    CHECK((size_t)active == e->active.count, "address map count");
    for (int k = 0; k < 2; k++)
        in_trees += e->free_blocks[k].count + e->unmapped[k].count;
    for (Segment *s = e->seg_first; s; s = s->lnext)
        s->scan_head = NULL;
    for (size_t i = 0; i <= e->active.mask; i++)
        if (e->active.slots[i].block)
            note_head(e->active.slots[i].block);
    for (int k = 0; k < 2; k++) {
        for (Block *b = tree_first(&e->free_blocks[k]); b; b = tree_next(b))
            note_head(b);
        for (Block *b = tree_first(&e->unmapped[k]); b; b = tree_next(b))
            note_head(b);
    }
    for (Segment *s = e->seg_first; s; s = s->lnext) {
        int pool = s->small ? P_SMALL : P_LARGE;
        CHECK(s->scan_head != NULL && s->scan_head->addr == s->base, "segment %llu has no first block", s->base);
        uint64_t cursor = s->base;
        int pieces = 0;
        for (Block *b = s->scan_head; b; b = b->next) {
            pieces++;
            blocks++;
            CHECK(b->segment == s && b->addr == cursor && b->small == s->small && b->stream == s->stream,
                  "block %llu breaks segment %llu", b->addr, s->base);
            CHECK(b->next == NULL || b->next->prev == b, "block links at %llu", b->addr);
            CHECK(b->allocated ? b->tree == IN_NONE : b->tree == (b->mapped ? IN_FREE : IN_UNMAPPED),
                  "block %llu is in the wrong place", b->addr);
            CHECK(!(b->tree == IN_FREE && b->next && b->next->tree == IN_FREE), "unmerged free blocks at %llu",
                  b->addr);
            cursor += b->size;
            if (b->allocated) {
                allocations[pool]++;
                allocated[pool] += b->size;
                requested[pool] += b->requested;
            }
            if (b->mapped && s->expandable)
                reserved[pool] += b->size;
        }
        CHECK(cursor == s->base + s->size, "segment %llu: blocks cover %llu of %llu bytes", s->base, cursor - s->base,
              s->size);
        if (!s->expandable) {
            reserved[pool] += s->size;
            segments[pool]++;
            if (pieces > 1) {
                for (Block *b = s->scan_head; b; b = b->next) {
                    if (!b->allocated) {
                        inactive[pool]++;
                        inactive_bytes[pool] += b->size;
                    }
                }
            }
        }
    }
    CHECK(blocks == active + in_trees && blocks == e->live_blocks,
          "%zd blocks in segments, %zd allocated, "
          "%zd cached, %zd live",
          blocks, active, in_trees, e->live_blocks);
    struct {
        int array;
        i128 *expect;
        const char *name;
    } stats[] = {{S_ALLOCATION, allocations, "allocation"},
                 {S_ALLOCATED_BYTES, allocated, "allocated_bytes"},
                 {S_REQUESTED_BYTES, requested, "requested_bytes"},
                 {S_RESERVED_BYTES, reserved, "reserved_bytes"},
                 {S_SEGMENT, segments, "segment"},
                 {S_INACTIVE_SPLIT, inactive, "inactive_split"},
                 {S_INACTIVE_SPLIT_BYTES, inactive_bytes, "inactive_split_bytes"}};
    for (size_t i = 0; i < sizeof stats / sizeof stats[0]; i++) {
        for (int pool = P_SMALL; pool <= P_LARGE; pool++)
            CHECK(cell_stat(e, stats[i].array, pool)[F_CURRENT] == stats[i].expect[pool],
                  "%s: %lld counted, %lld found", stats[i].name,
                  (long long)cell_stat(e, stats[i].array, pool)[F_CURRENT], (long long)stats[i].expect[pool]);
        CHECK(cell_stat(e, stats[i].array, P_ALL)[F_CURRENT] == stats[i].expect[P_SMALL] + stats[i].expect[P_LARGE],
              "%s: all pools", stats[i].name);
    }
    return 0;
}

static PyObject *Engine_check(Engine *e, PyObject *unused) {
    (void)unused;
    if (!ready(e) || check_engine(e) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ attributes */
static PyObject *get_cell(Engine *e, void *index) {
    return cell_to_py(e->st[(intptr_t)index]);
}

static int set_cell(Engine *e, PyObject *value, void *index) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete a counter");
        return -1;
    }
    i128 x;
    if (cell_from_py(value, &x) < 0)
        return -1;
    e->st[(intptr_t)index] = x;
    return 0;
}

static PyObject *get_stat(Engine *e, void *which) {
    intptr_t w = (intptr_t)which; /* array * 2 + (0 current, 1 peak) */
    return cell_to_py(cell_stat(e, (int)(w / 2), P_ALL)[w % 2]);
}

static PyObject *get_callback(Engine *e, void *which) {
    PyObject *f = which ? e->on_map : e->segment_address;
    return Py_NewRef(f ? f : Py_None);
}

static int set_callback(Engine *e, PyObject *value, void *which) {
    if (e->busy) {
        busy_error();
        return -1;
    }
    PyObject **slot = which ? &e->on_map : &e->segment_address;
    Py_CLEAR(*slot);
    if (value != NULL && value != Py_None)
        *slot = Py_NewRef(value);
    return 0;
}

static PyObject *get_address_space_total(Engine *e, void *unused) {
    (void)unused;
    return Py_NewRef(e->address_space_total);
}

static int set_address_space_total(Engine *e, PyObject *value, void *unused) {
    (void)unused;
    if (value == NULL)
        value = Py_None;
    if (value != Py_None) {
        if (!PyLong_Check(value)) {
            PyErr_Format(PyExc_TypeError, "address_space_total must be an int or None, not %.100s",
                         Py_TYPE(value)->tp_name);
            return -1;
        }
        unsigned long long v = PyLong_AsUnsignedLongLong(value);
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        if (v >= MAX_DEVICE_BYTES) {
            PyErr_SetString(PyExc_OverflowError, "address_space_total must be below 2**62");
            return -1;
        }
    }
    Py_SETREF(e->address_space_total, Py_NewRef(value));
    return 0;
}

static PyObject *get_device(Engine *e, void *unused) {
    (void)unused;
    return Py_NewRef(e->device ? e->device : Py_None);
}

static PyObject *get_name(Engine *e, void *unused) {
    (void)unused;
    return Py_NewRef(e->name ? e->name : Py_None);
}

static PyObject *get_next_addr(Engine *e, void *unused) {
    (void)unused;
    return PyLong_FromUnsignedLongLong(e->next_addr);
}

static int set_next_addr(Engine *e, PyObject *value, void *unused) {
    (void)unused;
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete _next_addr");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    e->next_addr = v;
    return 0;
}

static PyObject *get_flag(Engine *e, void *which) {
    switch ((intptr_t)which) {
    case 0:
        return PyBool_FromLong(e->set_fraction);
    case 1:
        return PyBool_FromLong(e->gc_enabled);
    default:
        return PyLong_FromUnsignedLongLong(e->allowed_memory_maximum);
    }
}

#define CELL(name, index) {name, (getter)get_cell, (setter)set_cell, NULL, (void *)(intptr_t)(index)}
#define STAT(name, array, peak) {name, (getter)get_stat, NULL, NULL, (void *)(intptr_t)((array) * 2 + (peak))}

static PyGetSetDef Engine_getset[] = {
    CELL("num_alloc_retries", C_NUM_ALLOC_RETRIES),
    CELL("num_ooms", C_NUM_OOMS),
    CELL("num_sync_all_streams", C_NUM_SYNC_ALL_STREAMS),
    CELL("num_device_alloc", C_NUM_DEVICE_ALLOC),
    CELL("num_device_free", C_NUM_DEVICE_FREE),
    CELL("_window_alloc", C_WINDOW_ALLOC),
    CELL("_window_reserved", C_WINDOW_RESERVED),
    STAT("allocated_bytes", S_ALLOCATED_BYTES, 0),
    STAT("reserved_bytes", S_RESERVED_BYTES, 0),
    STAT("peak_allocated_bytes", S_ALLOCATED_BYTES, 1),
    STAT("peak_reserved_bytes", S_RESERVED_BYTES, 1),
    {"segment_address", (getter)get_callback, (setter)set_callback, "where a new segment goes (trace replay)", NULL},
    {"on_map", (getter)get_callback, (setter)set_callback, "called with (address, bytes) per mapping", (void *)1},
    {"address_space_total", (getter)get_address_space_total, (setter)set_address_space_total, NULL, NULL},
    {"device", (getter)get_device, NULL, NULL, NULL},
    {"name", (getter)get_name, NULL, NULL, NULL},
    {"_next_addr", (getter)get_next_addr, (setter)set_next_addr, NULL, NULL},
    {"set_fraction", (getter)get_flag, NULL, NULL, (void *)0},
    {"_gc_enabled", (getter)get_flag, NULL, NULL, (void *)1},
    {"allowed_memory_maximum", (getter)get_flag, NULL, NULL, (void *)2},
    {NULL}};

static PyObject *Engine_cells(Engine *e, PyObject *unused) {
    (void)unused;
    return Py_NewRef((PyObject *)e->cells);
}

static PyMethodDef Engine_methods[] = {
    {"malloc", (PyCFunction)(void (*)(void))Engine_malloc, METH_FASTCALL | METH_KEYWORDS,
     "malloc(size, persistent=False, stream=0) -> address"},
    {"free", (PyCFunction)Engine_free, METH_O, "free(address)"},
    {"empty_cache", (PyCFunction)Engine_empty_cache, METH_NOARGS, NULL},
    {"reset_peak_memory_stats", (PyCFunction)Engine_reset_peak_memory_stats, METH_NOARGS, NULL},
    {"take_window_peaks", (PyCFunction)Engine_take_window_peaks, METH_NOARGS, NULL},
    {"steady_state_key", (PyCFunction)Engine_steady_state_key, METH_NOARGS, NULL},
    {"steady_cells", (PyCFunction)Engine_steady_cells, METH_NOARGS, NULL},
    {"fits_in_cache", (PyCFunction)(void (*)(void))Engine_fits_in_cache, METH_VARARGS | METH_KEYWORDS, NULL},
    {"free_block_sizes", (PyCFunction)(void (*)(void))Engine_free_block_sizes, METH_VARARGS | METH_KEYWORDS, NULL},
    {"segments", (PyCFunction)Engine_segments, METH_NOARGS, NULL},
    {"_engine_ranges", (PyCFunction)Engine_mapped_ranges, METH_NOARGS, NULL},
    {"_block_info", (PyCFunction)Engine_block_info, METH_O, NULL},
    {"_set_fraction", (PyCFunction)Engine_set_fraction, METH_VARARGS, NULL},
    {"_engine_round_size", (PyCFunction)Engine_round_size, METH_O, NULL},
    {"_check", (PyCFunction)Engine_check, METH_NOARGS, "verify the engine's invariants (AssertionError)"},
    {"_stat_cells", (PyCFunction)Engine_cells, METH_NOARGS, "the Cells object holding every statistic"},
    {NULL}};

/* ------------------------------------------------------------------ life cycle */
static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    Engine *e = (Engine *)type->tp_alloc(type, 0);
    if (e == NULL)
        return NULL;
    e->cells = PyObject_New(CellsObject, &CellsType);
    if (e->cells == NULL) {
        Py_DECREF(e);
        return NULL;
    }
    memset(e->cells->v, 0, sizeof e->cells->v);
    e->st = e->cells->v;
    e->address_space_total = Py_NewRef(Py_None);
    e->rng = 2463534242u;
    if (map_init(&e->active, 6) < 0) {
        Py_DECREF(e);
        return NULL;
    }
    return (PyObject *)e;
}

/* Engine(device, name, odd_size, pad, null_for_zero, base_addr_aligned, large_segment_size,
 *        max_non_split_rounding_size, page_size_1g, large_page_size, max_split_size,
 *        expandable_segments, divisions, garbage_collection_threshold, throw_on_npumalloc_oom,
 *        rejection_limit): the Python model's derived settings, as torch_native passes them. */
static int Engine_init(Engine *e, PyObject *args, PyObject *kwargs) {
    PyObject *device, *name, *odd_size, *divisions;
    unsigned long long pad, aligned, large_segment, non_split, large_page, max_split, rejection;
    int null_for_zero, page_1g, expandable, throw_oom;
    double threshold;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Engine() takes positional arguments only");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OUOO&pO&O&O&pO&O&pOdpO&:Engine", &device, &name, &odd_size, u64_converter, &pad,
                          &null_for_zero, u64_converter, &aligned, u64_converter, &large_segment, u64_converter,
                          &non_split, &page_1g, u64_converter, &large_page, u64_converter, &max_split, &expandable,
                          &divisions, &threshold, &throw_oom, u64_converter, &rejection))
        return -1;
    if (e->initialized) {
        PyErr_SetString(PyExc_RuntimeError, "the allocator engine is initialised once");
        return -1;
    }
    PyObject *table = PySequence_Tuple(divisions);
    if (table == NULL)
        return -1;
    if (PyTuple_GET_SIZE(table) != K_ROUNDUP_INTERVALS) {
        Py_DECREF(table);
        PyErr_SetString(PyExc_ValueError, "divisions needs 16 values");
        return -1;
    }
    int rounds_power2 = 0;
    for (int i = 0; i < K_ROUNDUP_INTERVALS; i++) {
        /* a power of two; one past 2**63 never rounds a 64-bit size (512 x it exceeds 2**64) */
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(table, i), &overflow);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(table);
            return -1;
        }
        e->divisions[i] = overflow > 0 ? (1ULL << 63) : v < 0 ? 0 : (uint64_t)v;
        rounds_power2 |= e->divisions[i] != 0;
    }
    Py_DECREF(table);
    if (large_page == 0 || !PyCallable_Check(odd_size)) {
        PyErr_SetString(PyExc_ValueError, "a page size and a callable odd_size are needed");
        return -1;
    }
    if (e->initialized) { /* again: the divisions' iteration or __index__ ran Python code */
        PyErr_SetString(PyExc_RuntimeError, "the allocator engine is initialised once");
        return -1;
    }
    e->device = Py_NewRef(device);
    e->name = Py_NewRef(name);
    e->odd_size = Py_NewRef(odd_size);
    e->pad = pad;
    e->null_for_zero = null_for_zero;
    e->base_addr_aligned = aligned;
    e->large_segment_size = large_segment;
    e->max_non_split_rounding_size = non_split;
    e->page_size_1g = page_1g;
    e->large_page_size = large_page;
    e->max_split_size = max_split;
    e->expandable = expandable;
    e->aligns_base = aligned && expandable;
    e->rounds_power2 = rounds_power2;
    e->garbage_collection_threshold = threshold;
    e->throw_on_npumalloc_oom = throw_oom;
    e->rejection_limit = rejection;
    e->next_addr = 1ULL << 40;
    e->initialized = 1;
    return 0;
}

static int Engine_traverse(Engine *e, visitproc visit, void *arg) {
    Py_VISIT(e->cells);
    Py_VISIT(e->device);
    Py_VISIT(e->name);
    Py_VISIT(e->odd_size);
    Py_VISIT(e->segment_address);
    Py_VISIT(e->on_map);
    Py_VISIT(e->address_space_total);
    Py_VISIT(e->segments_key);
    Py_VISIT(e->steady_cells);
    return 0;
}

static int Engine_clear(Engine *e) {
    Py_CLEAR(e->device);
    Py_CLEAR(e->name);
    Py_CLEAR(e->odd_size);
    Py_CLEAR(e->segment_address);
    Py_CLEAR(e->on_map);
    Py_CLEAR(e->address_space_total);
    Py_CLEAR(e->segments_key);
    Py_CLEAR(e->steady_cells);
    return 0;
}

static void Engine_dealloc(Engine *e) {
    PyObject_GC_UnTrack(e);
    Engine_clear(e);
    Py_CLEAR(e->cells);
    while (e->seg_first) {
        Segment *s = e->seg_first;
        e->seg_first = s->lnext;
        PyMem_RawFree(s);
    }
    while (e->slabs) {
        Slab *slab = e->slabs;
        e->slabs = slab->next;
        PyMem_RawFree(slab);
    }
    PyMem_RawFree(e->active.slots);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard.allocators._ctorch.Engine",
    .tp_doc = "The caching-allocator model's state and steps in C (see torch_native.NativeCachingAllocator).",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = Engine_new,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_traverse = (traverseproc)Engine_traverse,
    .tp_clear = (inquiry)Engine_clear,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

static struct PyModuleDef ctorch_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvguard.allocators._ctorch",
    .m_doc = "C engine for kvguard.allocators.torch_alloc.CachingAllocator (wrapped by torch_native).",
    .m_size = -1,
};

/* torch_alloc.py's constants (and the engine's limits and cell layout, which torch_native.py reads) */
static const KvgConstant shared_constants[] = {
    KVG_CONSTANT(K_MIN_BLOCK_SIZE),    KVG_CONSTANT(K_SMALL_SIZE),
    KVG_CONSTANT(K_SMALL_BUFFER),      KVG_CONSTANT(K_MIN_LARGE_ALLOC),
    KVG_CONSTANT(K_ROUND_LARGE),       KVG_CONSTANT(K_EXTRA_LARGE_BUFFER),
    KVG_CONSTANT(K_ROUNDUP_INTERVALS), KVG_CONSTANT(K_ROUNDUP_START_LOG2),
    KVG_CONSTANT(UNLIMITED),           KVG_CONSTANT(MAX_DEVICE_BYTES),
    KVG_CONSTANT(N_STAT_ARRAYS),       KVG_CONSTANT(N_STAT_POOLS),
    KVG_CONSTANT(N_STAT_FIELDS),       KVG_CONSTANT(C_OVERSIZE_ALLOCATIONS),
    KVG_CONSTANT(C_OVERSIZE_SEGMENTS), KVG_CONSTANT(N_CELLS),
};

PyMODINIT_FUNC PyInit__ctorch(void) {
    if (PyType_Ready(&CellsType) < 0 || PyType_Ready(&EngineType) < 0)
        return NULL;
    if (kvg_import_out_of_memory() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&ctorch_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Engine", (PyObject *)&EngineType) < 0
        || PyModule_AddObjectRef(m, "Cells", (PyObject *)&CellsType) < 0
        || kvg_add_constants(m, shared_constants, sizeof shared_constants / sizeof shared_constants[0]) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
