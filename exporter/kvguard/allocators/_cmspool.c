/* kvguard.allocators._cmspool: a C engine for MindSpore's dynamic memory pool model.
 *
 * The specification is the Python model, kvguard/allocators/mindspore_pool.py (DynamicMemPool,
 * _BufAllocator); its docstrings cite the upstream functions and lines, and the release switches
 * come from kvguard/allocators/mindspore_releases.py. This file is a second implementation of the
 * same rules with C-level buffers and keys, held equal to the model op by op by
 * tests/allocators/test_alloc_native_mindspore.py and to MindSpore's compiled pool by
 * tests/upstream/test_oracle_mindspore.py.
 *
 * The type here is a base class: kvguard/allocators/mindspore_native.py (NativeDynamicMemPool) decodes
 * the release row, and keeps in Python what runs once per block expansion (block_alloc_size, which
 * this engine calls back) and the statistics dictionaries, by reusing the Python model's own methods.
 * Everything malloc / free touch lives here: blocks, buffers, the free lists ordered by (size, addr),
 * the used-address table, the VMM pages and every counter. The device stays the Python object the
 * caller shares: it is called (malloc, free, free_bytes) exactly where the model calls it.
 */
#define KVG_ENGINE "_cmspool"
#include "_engine.h"
#include <structmember.h>

/* Constants shared with mindspore_pool.py and mindspore_native.py are exported as module attributes
 * (SHARED_CONSTANTS below); tests/allocators/test_c_engines.py holds them equal to the Python side. */
enum { IDLE = 0, USED = 1, EAGER_FREE = 2 };

#define SPLIT_MIN_BYTES 512            /* mindspore_pool.K_ALIGN: a remainder this large is split off */
#define SIZE_BEYOND ((int64_t)1 << 62) /* any request above this fits nowhere (devices are smaller) */
#define STEP_LIMIT ((int64_t)1 << 40)  /* pages, alignments (as mindspore_native.unsupported): no sum overflows */
#define SLAB_BUFS 1024

typedef struct Block {
    int64_t addr, size;
    int64_t npages, mapped_pages;
    uint8_t *pages; /* VMM: 1 byte a page, 1 when mapped */
} Block;

typedef struct Buf {
    int64_t addr, size;
    struct Buf *prev, *next; /* neighbours within the block, by address */
    Block *block;
    uint8_t status;
    uint8_t persistent; /* the allocator whose block holds it */
} Buf;

typedef struct {
    int64_t size, addr;
    Buf *buf;
} Entry;
typedef struct {
    Entry *v;
    Py_ssize_t n, cap;
} EntryList; /* sorted by (size, addr) */
typedef struct {
    Block **v;
    Py_ssize_t n, cap;
} BlockList;
typedef struct {
    BlockList blocks;
    EntryList idle, eager;
} Alloc; /* one MemBufAllocator */
typedef struct {
    int64_t *keys;
    Buf **vals;
    size_t n, mask;
    int shift;
} UsedMap;

typedef struct {
    PyObject_HEAD
    PyObject *device;
    PyObject *blocks_key; /* cached bytes of the blocks and their pages, or NULL */
    Alloc alloc[2];       /* [0] common, [1] persistent */
    UsedMap used;
    Buf *spare; /* free Buf nodes */
    void **slabs;
    Py_ssize_t nslabs, slabcap;
    int ready;
    int busy; /* inside malloc / empty_cache, which call back into Python */
    int vmm, grows_idle_into_eager_free, eager_free_on_miss, common_falls_back_to_persistent;
    int eager_free_drops_on_refused_map, reserved_is_physical, empty_cache_releases;
    long long total_mem_size, page, max_pages, align;
    long long static_bytes, next_addr, alloc_size, used_size, eager_free_size, physical_pages, cached_pages;
    long long peak_used, peak_reserved, used_at_reset, peak_increase, alloc_at_reset;
    long long window_used, window_reserved, num_ooms;
} Pool;

static PyObject *persistent_keys; /* {True: 1, False: 0}: the model's allocator dict lookup */
static PyObject *s_malloc, *s_free, *s_free_bytes, *s_block_alloc_size, *s_name;

/* ------------------------------------------------------------------ small containers */
static Buf *buf_new(Pool *p, int64_t addr, int64_t size, int status, Block *block, int persistent) {
    if (p->spare == NULL) {
        if (p->nslabs == p->slabcap) {
            Py_ssize_t cap = p->slabcap ? 2 * p->slabcap : 8;
            void **slabs = PyMem_Realloc(p->slabs, cap * sizeof(void *));
            if (slabs == NULL) {
                PyErr_NoMemory();
                return NULL;
            }
            p->slabs = slabs;
            p->slabcap = cap;
        }
        Buf *slab = PyMem_Malloc(SLAB_BUFS * sizeof(Buf));
        if (slab == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        p->slabs[p->nslabs++] = slab;
        for (int i = 0; i < SLAB_BUFS; i++) {
            slab[i].next = p->spare;
            p->spare = &slab[i];
        }
    }
    Buf *b = p->spare;
    p->spare = b->next;
    b->addr = addr;
    b->size = size;
    b->prev = b->next = NULL;
    b->block = block;
    b->status = (uint8_t)status;
    b->persistent = (uint8_t)persistent;
    return b;
}

static inline void buf_release(Pool *p, Buf *b) {
    b->next = p->spare;
    p->spare = b;
}

static inline void link_after(Buf *node, Buf *added) {
    Buf *nxt = node->next;
    added->next = nxt;
    if (nxt != NULL)
        nxt->prev = added;
    added->prev = node;
    node->next = added;
}

static inline int key_less(const Entry *e, int64_t size, int64_t addr) {
    return e->size < size || (e->size == size && e->addr < addr);
}

static inline Py_ssize_t lower_bound(const Entry *v, Py_ssize_t n, int64_t size, int64_t addr) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (key_less(&v[mid], size, addr))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int entries_reserve(EntryList *l, Py_ssize_t extra) {
    if (l->n + extra <= l->cap)
        return 0;
    Py_ssize_t cap = l->cap ? l->cap : 16;
    while (cap < l->n + extra)
        cap *= 2;
    Entry *v = PyMem_Realloc(l->v, cap * sizeof(Entry));
    if (v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    l->v = v;
    l->cap = cap;
    return 0;
}

/* insort */
static int entries_insert(EntryList *l, Buf *b) {
    if (entries_reserve(l, 1) < 0)
        return -1;
    Py_ssize_t i = lower_bound(l->v, l->n, b->size, b->addr);
    memmove(&l->v[i + 1], &l->v[i], (l->n - i) * sizeof(Entry));
    l->v[i].size = b->size;
    l->v[i].addr = b->addr;
    l->v[i].buf = b;
    l->n++;
    return 0;
}

static inline void entries_remove_at(EntryList *l, Py_ssize_t i) {
    l->n--;
    memmove(&l->v[i], &l->v[i + 1], (l->n - i) * sizeof(Entry));
}

/* del entries[bisect_left(...)] */
static inline void entries_remove(EntryList *l, Buf *b) {
    entries_remove_at(l, lower_bound(l->v, l->n, b->size, b->addr));
}

static inline EntryList *list_for(Alloc *a, int status) {
    return status == IDLE ? &a->idle : &a->eager;
}

/* The used-address table: linear probing, addresses are never 0. */
static inline size_t used_slot(const UsedMap *m, int64_t key) {
    return (size_t)((((uint64_t)key >> 9) * 0x9E3779B97F4A7C15ull) >> m->shift);
}

static int used_grow(UsedMap *m) {
    size_t cap = m->keys ? 2 * (m->mask + 1) : 64;
    int shift = 64;
    for (size_t c = cap; c > 1; c >>= 1)
        shift--;
    int64_t *keys = PyMem_Calloc(cap, sizeof(int64_t));
    Buf **vals = PyMem_Malloc(cap * sizeof(Buf *));
    if (keys == NULL || vals == NULL) {
        PyMem_Free(keys);
        PyMem_Free(vals);
        PyErr_NoMemory();
        return -1;
    }
    int64_t *old_keys = m->keys;
    Buf **old_vals = m->vals;
    size_t old_cap = old_keys ? m->mask + 1 : 0;
    m->keys = keys;
    m->vals = vals;
    m->mask = cap - 1;
    m->shift = shift;
    for (size_t i = 0; i < old_cap; i++) {
        if (old_keys[i]) {
            size_t j = used_slot(m, old_keys[i]);
            while (keys[j])
                j = (j + 1) & m->mask;
            keys[j] = old_keys[i];
            vals[j] = old_vals[i];
        }
    }
    PyMem_Free(old_keys);
    PyMem_Free(old_vals);
    return 0;
}

/* room for one more key */
static int used_reserve(UsedMap *m) {
    if (m->keys == NULL || 2 * (m->n + 1) > m->mask + 1)
        return used_grow(m);
    return 0;
}

static int used_put(UsedMap *m, int64_t key, Buf *b) {
    if (used_reserve(m) < 0)
        return -1;
    size_t i = used_slot(m, key);
    while (m->keys[i] && m->keys[i] != key)
        i = (i + 1) & m->mask;
    if (!m->keys[i])
        m->n++;
    m->keys[i] = key;
    m->vals[i] = b;
    return 0;
}

static inline Py_ssize_t used_find(const UsedMap *m, int64_t key) {
    if (m->keys == NULL || key == 0)
        return -1;
    size_t i = used_slot(m, key);
    while (m->keys[i]) {
        if (m->keys[i] == key)
            return (Py_ssize_t)i;
        i = (i + 1) & m->mask;
    }
    return -1;
}

/* backward-shift deletion */
static void used_remove_at(UsedMap *m, size_t i) {
    size_t j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        if (!m->keys[j])
            break;
        size_t home = used_slot(m, m->keys[j]);
        /* keep the entry at j when its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->keys[i] = 0;
    m->n--;
}

/* ------------------------------------------------------------------ the device (a Python object) */
/* 1 granted, 0 refused, -1 error */
static int device_malloc(Pool *p, long long size) {
    PyObject *arg = PyLong_FromLongLong(size);
    if (arg == NULL)
        return -1;
    PyObject *res = PyObject_CallMethodOneArg(p->device, s_malloc, arg);
    Py_DECREF(arg);
    if (res == NULL)
        return -1;
    int granted = PyObject_IsTrue(res);
    Py_DECREF(res);
    return granted;
}

static int device_free(Pool *p, long long size) {
    PyObject *arg = PyLong_FromLongLong(size);
    if (arg == NULL)
        return -1;
    PyObject *res = PyObject_CallMethodOneArg(p->device, s_free, arg);
    Py_DECREF(arg);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

static int device_free_bytes(Pool *p, long long *out) {
    PyObject *res = PyObject_GetAttr(p->device, s_free_bytes);
    if (res == NULL)
        return -1;
    *out = PyLong_AsLongLong(res);
    Py_DECREF(res);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* ------------------------------------------------------------------ pool bookkeeping */
/* DynamicMemPool.reserved_bytes */
static inline long long reserved_bytes(const Pool *p) {
    return p->reserved_is_physical ? p->physical_pages * p->page : p->alloc_size;
}

static inline void note_reserved(Pool *p) {
    long long reserved = reserved_bytes(p);
    if (reserved > p->peak_reserved)
        p->peak_reserved = reserved;
    if (reserved > p->window_reserved)
        p->window_reserved = reserved;
}

static inline void blocks_changed(Pool *p) {
    Py_CLEAR(p->blocks_key);
}

/* Python's //, b > 0; no negation of a */
static inline long long floor_div(long long a, long long b) {
    long long q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* The model's ints grow without bound; the engine's cells are int64. Where a sum or product would leave
 * them, the engine raises OverflowError (the cell unchanged) instead of wrapping: _engine.h's kvg_*_i64. */

/* A page count whose bytes (count * page) fit a cell: reserved_bytes and empty_cache multiply it. */
static inline int checked_pages(const Pool *p, long long a, long long b, long long *out, const char *what) {
    long long bytes;
    if (kvg_add_i64(a, b, out, what) < 0 || kvg_mul_i64(*out, p->page, &bytes, what) < 0)
        return -1;
    return 0;
}

static int64_t count_mapped(const Block *block, int64_t first, int64_t end) {
    int64_t mapped = 0;
    for (int64_t i = first; i < end; i++)
        mapped += block->pages[i];
    return mapped;
}

static int pages_in_block(const Block *block, int64_t first, int64_t end) {
    if (first < 0 || end > block->npages) {
        PyErr_SetString(PyExc_SystemError, "_cmspool: a buffer lies outside its block's pages");
        return -1;
    }
    return 0;
}

/* MmapDeviceMem (DynamicMemPool._map): 1 mapped, 0 refused, -1 error. */
static int pool_map(Pool *p, Block *block, int64_t addr, int64_t size) {
    long long dropped; /* the eager-free count less size: before (2.7.0) or after */
    if (kvg_sub_i64(p->eager_free_size, size, &dropped, "eager-free bytes") < 0)
        return -1;
    if (p->eager_free_drops_on_refused_map)
        p->eager_free_size = dropped;
    int64_t page = p->page;
    int64_t first = (addr - block->addr) / page;
    int64_t last = (addr + size - 1 - block->addr) / page;
    if (pages_in_block(block, first, last + 1) < 0)
        return -1;
    int64_t missing = (last - first + 1) - count_mapped(block, first, last + 1);
    int64_t from_cache = missing < p->cached_pages ? missing : p->cached_pages;
    int64_t fresh = missing - from_cache;
    long long free_bytes;
    if (device_free_bytes(p, &free_bytes) < 0)
        return -1;
    long long headroom = p->max_pages - p->physical_pages;
    long long possible = headroom > 0 ? headroom : 0;
    long long device_pages = floor_div(free_bytes, page);
    if (device_pages < possible)
        possible = device_pages;
    if (fresh > possible) {
        /* the handles taken before the refusal go back to the cache, still allocated */
        if (possible) {
            /* a device reporting negative free bytes makes possible negative, as in the model */
            long long bytes, physical, cached;
            if (kvg_mul_i64(possible, page, &bytes, "handle bytes") < 0
                || checked_pages(p, p->physical_pages, possible, &physical, "physical pages") < 0
                || checked_pages(p, p->cached_pages, possible, &cached, "cached pages") < 0)
                return -1;
            int granted = device_malloc(p, bytes);
            if (granted < 0)
                return -1;
            if (granted) {
                p->physical_pages = physical;
                p->cached_pages = cached;
            }
        }
        note_reserved(p);
        return 0;
    }
    long long physical;
    if (checked_pages(p, p->physical_pages, fresh, &physical, "physical pages") < 0)
        return -1;
    if (fresh) {
        int granted = device_malloc(p, fresh * page); /* fresh <= free_bytes / page */
        if (granted <= 0)
            return granted;
    }
    p->physical_pages = physical;
    p->cached_pages -= from_cache;
    memset(block->pages + first, 1, (size_t)(last - first + 1));
    blocks_changed(p);
    block->mapped_pages += missing;
    if (!p->eager_free_drops_on_refused_map)
        p->eager_free_size = dropped;
    note_reserved(p);
    return 1;
}

/* DynamicMemPool._unmap: the pages wholly inside [addr, addr + size) go to the handle cache. */
static int pool_unmap(Pool *p, Block *block, int64_t addr, int64_t size) {
    int64_t page = p->page;
    int64_t offset = addr - block->addr;
    int64_t first = (offset + page - 1) / page;
    int64_t end = (offset + size) / page;
    if (end <= first)
        return 0;
    /* the model's pages[first:end] stops at the block's last page (without VMM: no pages at all) */
    int64_t mapped = count_mapped(block, first, end < block->npages ? end : block->npages);
    if (!mapped)
        return 0;
    if (pages_in_block(block, first, end) < 0)
        return -1;
    long long cached;
    if (checked_pages(p, p->cached_pages, mapped, &cached, "cached pages") < 0)
        return -1;
    memset(block->pages + first, 0, (size_t)(end - first));
    blocks_changed(p);
    block->mapped_pages -= mapped;
    p->cached_pages = cached;
    return 0;
}

/* DynamicMemPool._expand_block: 1 with *out, 0 refused, -1 error. */
static int pool_expand_block(Pool *p, int64_t size, int persistent, Block **out) {
    PyObject *size_obj = PyLong_FromLongLong(size);
    if (size_obj == NULL)
        return -1;
    PyObject *res =
        PyObject_CallMethodObjArgs((PyObject *)p, s_block_alloc_size, size_obj, persistent ? Py_True : Py_False, NULL);
    Py_DECREF(size_obj);
    if (res == NULL)
        return -1;
    int overflow;
    long long block_size = PyLong_AsLongLongAndOverflow(res, &overflow);
    Py_DECREF(res);
    if (block_size == -1 && PyErr_Occurred())
        return -1;
    if (block_size == 0 && !overflow)
        return 0;
    /* block_alloc_size gives at most the budget (< 2**62); a subclass's override is held to 2**62, and
     * without VMM (where the device would be asked for it) to [0, 2**62]. With VMM a negative size reserves
     * the budget, as in the model (max(block, total_mem_size)). */
    if (overflow || block_size > SIZE_BEYOND || (block_size < 0 && !p->vmm)) {
        PyErr_SetString(PyExc_ValueError,
                        "_cmspool: block_alloc_size returned a size outside [0, 2**62] (negative: VMM only)");
        return -1;
    }
    /* Every sum this block makes, checked before the device is asked or a counter moves: a refusal here
     * leaves the pool and the device as they were. */
    long long size_in_pool = block_size, alloc_size, next_addr;
    long long eager_free_size = p->eager_free_size, static_bytes = p->static_bytes;
    if (p->vmm) {
        /* address space only, whole pages; pages are mapped when buffers are handed out */
        long long base = block_size > p->total_mem_size ? block_size : p->total_mem_size;
        size_in_pool = (base + p->page - 1) / p->page * p->page; /* base <= 2**62, page <= 2**40 */
        if (kvg_add_i64(eager_free_size, size_in_pool, &eager_free_size, "eager-free bytes") < 0)
            return -1;
    } else if (kvg_add_i64(static_bytes, size_in_pool, &static_bytes, "device bytes") < 0) {
        return -1;
    }
    long long step = (size_in_pool + p->page - 1) / p->page * p->page + p->page;
    if (kvg_add_i64(p->alloc_size, size_in_pool, &alloc_size, "pool bytes") < 0
        || kvg_add_i64(p->next_addr, step, &next_addr, "block addresses") < 0)
        return -1;
    Block *block = PyMem_Calloc(1, sizeof(Block));
    if (block == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    block->addr = p->next_addr;
    block->size = size_in_pool;
    if (p->vmm) {
        block->npages = size_in_pool / p->page;
        block->pages = PyMem_Calloc((size_t)(block->npages ? block->npages : 1), 1);
        if (block->pages == NULL) {
            PyMem_Free(block);
            PyErr_NoMemory();
            return -1;
        }
    } else {
        int granted = device_malloc(p, block_size);
        if (granted <= 0) {
            PyMem_Free(block);
            return granted;
        }
    }
    p->alloc_size = alloc_size;
    p->eager_free_size = eager_free_size;
    p->static_bytes = static_bytes;
    p->next_addr = next_addr;
    note_reserved(p);
    *out = block;
    return 1;
}

/* DynamicMemPool._release_block */
static int pool_release_block(Pool *p, Block *block) {
    p->alloc_size -= block->size;
    if (p->vmm) {
        p->eager_free_size -= block->size;
    } else {
        if (device_free(p, block->size) < 0)
            return -1;
        p->static_bytes -= block->size;
    }
    note_reserved(p);
    return 0;
}

/* ------------------------------------------------------------------ one allocator (_BufAllocator) */
/* free: merge with same-status neighbours */
static int alloc_free(Pool *p, Alloc *a, Buf *b, int status) {
    b->status = (uint8_t)status;
    EntryList *l = list_for(a, status);
    Buf *prev = b->prev;
    if (prev != NULL && prev->status == status) {
        entries_remove(l, prev);
        b->addr = prev->addr;
        b->prev = prev->prev;
        if (b->prev != NULL)
            b->prev->next = b;
        b->size += prev->size;
        buf_release(p, prev);
    }
    Buf *nxt = b->next;
    if (nxt != NULL && nxt->status == status) {
        entries_remove(l, nxt);
        b->next = nxt->next;
        if (b->next != NULL)
            b->next->prev = b;
        b->size += nxt->size;
        buf_release(p, nxt);
    }
    return entries_insert(l, b);
}

/* _map_and_split: 1 with *out, 0 refused (the buffer back in its list), -1 error */
static int map_and_split(Pool *p, Alloc *a, Buf *b, int64_t size, Buf **out) {
    int64_t remaining = b->size - size;
    if (b->status == EAGER_FREE) {
        int64_t map_size = remaining >= SPLIT_MIN_BYTES ? size : b->size;
        int mapped = pool_map(p, b->block, b->addr, map_size);
        if (mapped <= 0) {
            if (mapped == 0 && entries_insert(list_for(a, b->status), b) < 0)
                return -1;
            return mapped;
        }
    }
    if (remaining >= SPLIT_MIN_BYTES) {
        Buf *rest = buf_new(p, b->addr + size, remaining, b->status, b->block, b->persistent);
        if (rest == NULL)
            return -1;
        link_after(b, rest);
        b->size = size;
        if (entries_insert(list_for(a, rest->status), rest) < 0)
            return -1;
    }
    b->status = USED;
    *out = b;
    return 1;
}

/* malloc_expand_block */
static int alloc_expand(Pool *p, int persistent, int64_t size, Buf **out) {
    Alloc *a = &p->alloc[persistent];
    if (a->blocks.n == a->blocks.cap) {
        Py_ssize_t cap = a->blocks.cap ? 2 * a->blocks.cap : 8;
        Block **v = PyMem_Realloc(a->blocks.v, cap * sizeof(Block *));
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        a->blocks.v = v;
        a->blocks.cap = cap;
    }
    Buf *b = buf_new(p, 0, 0, IDLE, NULL, persistent);
    if (b == NULL)
        return -1;
    Block *block;
    int expanded = pool_expand_block(p, size, persistent, &block);
    if (expanded <= 0) {
        buf_release(p, b);
        return expanded;
    }
    a->blocks.v[a->blocks.n++] = block;
    blocks_changed(p);
    b->addr = block->addr;
    b->size = block->size;
    b->block = block;
    b->status = p->vmm ? EAGER_FREE : IDLE;
    return map_and_split(p, a, b, size, out);
}

/* SearchAvaliableMemBuf (_grow_into_eager_free): 1 with *out, 0 none (or a refused map), -1 error */
static int grow_into_eager_free(Pool *p, Alloc *a, int64_t size, Buf **out) {
    for (Py_ssize_t i = a->idle.n - 1; i >= 0; i--) {
        Buf *b = a->idle.v[i].buf;
        Buf *nxt = b->next;
        if (nxt == NULL || nxt->status != EAGER_FREE || b->size + nxt->size < size)
            continue;
        int64_t need = size - b->size;
        int mapped = pool_map(p, nxt->block, nxt->addr, need);
        if (mapped <= 0)
            return mapped;
        entries_remove_at(&a->idle, i);
        b->size = size;
        b->status = USED;
        entries_remove(&a->eager, nxt);
        nxt->addr += need;
        nxt->size -= need;
        if (nxt->size == 0) {
            b->next = nxt->next;
            if (nxt->next != NULL)
                nxt->next->prev = b;
            buf_release(p, nxt);
        } else if (entries_insert(&a->eager, nxt) < 0) {
            return -1;
        }
        *out = b;
        return 1;
    }
    return 0;
}

/* MemBufAllocator::Malloc (_BufAllocator.malloc): 1 with *out, 0 miss, -1 error */
static int alloc_malloc(Pool *p, int persistent, int64_t size, Buf **out) {
    Alloc *a = &p->alloc[persistent];
    if (a->blocks.n == 0)
        return alloc_expand(p, persistent, size, out);
    EntryList *idle = &a->idle;
    Py_ssize_t i = lower_bound(idle->v, idle->n, size, 0);
    if (i < idle->n) {
        Buf *b = idle->v[i].buf;
        int64_t remaining = b->size - size;
        if (remaining >= SPLIT_MIN_BYTES) {
            Buf *rest = buf_new(p, b->addr + size, remaining, IDLE, b->block, b->persistent);
            if (rest == NULL)
                return -1;
            link_after(b, rest);
            b->size = size;
            /* the rest sorts before the buffer it came from: one move puts it in place of that entry */
            Py_ssize_t j = lower_bound(idle->v, i, remaining, rest->addr);
            memmove(&idle->v[j + 1], &idle->v[j], (i - j) * sizeof(Entry));
            idle->v[j].size = remaining;
            idle->v[j].addr = rest->addr;
            idle->v[j].buf = rest;
        } else {
            entries_remove_at(idle, i);
        }
        b->status = USED;
        *out = b;
        return 1;
    }
    if (p->vmm && p->grows_idle_into_eager_free) {
        int grown = grow_into_eager_free(p, a, size, out);
        if (grown)
            return grown;
    }
    EntryList *eager = &a->eager;
    i = lower_bound(eager->v, eager->n, size, 0);
    if (i < eager->n) {
        Buf *b = eager->v[i].buf;
        entries_remove_at(eager, i);
        return map_and_split(p, a, b, size, out);
    }
    return 0;
}

/* eager_free_idle: every idle buffer turns eager-free, then every eager-free buffer's whole pages unmap */
static int alloc_eager_free_idle(Pool *p, Alloc *a, long long *turned) {
    Py_ssize_t n = a->idle.n;
    Entry *snapshot = a->idle.v;
    a->idle.n = 0; /* nothing is added to idle below: the array is the snapshot */
    for (Py_ssize_t k = 0; k < n; k++) {
        Buf *b = snapshot[k].buf;
        *turned += b->size;
        if (alloc_free(p, a, b, EAGER_FREE) < 0)
            return -1;
    }
    for (Py_ssize_t k = 0; k < a->eager.n; k++) {
        Buf *b = a->eager.v[k].buf;
        if (pool_unmap(p, b->block, b->addr, b->size) < 0)
            return -1;
    }
    return 0;
}

/* DynamicMemPool._eager_free_idle */
static int pool_eager_free_idle(Pool *p) {
    for (int persistent = 1; persistent >= 0; persistent--) {
        long long turned = 0;
        int status = alloc_eager_free_idle(p, &p->alloc[persistent], &turned);
        p->eager_free_size += turned;
        if (status < 0)
            return -1;
    }
    note_reserved(p);
    return 0;
}

/* ReleaseFreeBlocks (release_idle_blocks): blocks that are one idle buffer go back to the device */
static int alloc_release_idle_blocks(Pool *p, Alloc *a) {
    Py_ssize_t kept = 0, i = 0;
    int status = 0;
    for (; i < a->blocks.n; i++) {
        Block *block = a->blocks.v[i];
        Py_ssize_t j = lower_bound(a->idle.v, a->idle.n, block->size, block->addr);
        if (status == 0 && j < a->idle.n && a->idle.v[j].addr == block->addr && a->idle.v[j].size == block->size) {
            buf_release(p, a->idle.v[j].buf);
            entries_remove_at(&a->idle, j);
            blocks_changed(p);
            status = pool_release_block(p, block);
            PyMem_Free(block->pages);
            PyMem_Free(block);
        } else {
            a->blocks.v[kept++] = block;
        }
    }
    a->blocks.n = kept;
    return status;
}

/* ------------------------------------------------------------------ Python methods */
static int check_ready(Pool *p) {
    if (!p->ready) {
        PyErr_SetString(PyExc_RuntimeError, "_cmspool.Pool used before __init__");
        return -1;
    }
    return 0;
}

/* malloc and empty_cache call the device and block_alloc_size while buffers are out of their lists and
 * indexes are held: a call that changes the pool from inside them is refused, not run on that state. */
static int refuse_reentry(Pool *p) {
    return kvg_refuse_reentry(p->busy);
}

/* ready, and not inside malloc / empty_cache */
static int check_idle(Pool *p) {
    return check_ready(p) < 0 ? -1 : refuse_reentry(p);
}

static PyObject *raise_out_of_memory(Pool *p, int64_t size, PyObject *size_beyond) {
    PyObject *requested = size_beyond ? Py_NewRef(size_beyond) : PyLong_FromLongLong(size);
    PyObject *name = requested ? PyObject_GetAttr((PyObject *)p, s_name) : NULL;
    PyObject *free_bytes = name ? PyObject_GetAttr(p->device, s_free_bytes) : NULL;
    PyObject *detail =
        free_bytes ? PyUnicode_FromFormat("%lld allocated, %lld reserved", p->used_size, reserved_bytes(p)) : NULL;
    kvg_raise_out_of_memory(requested, name, free_bytes, detail);
    Py_XDECREF(requested);
    Py_XDECREF(name);
    Py_XDECREF(free_bytes);
    Py_XDECREF(detail);
    return NULL;
}

/* The request as the model reads it: -(-size // step) * step, 0 becoming one step. A size beyond
 * SIZE_BEYOND fits nowhere: *size is SIZE_BEYOND and *beyond the aligned Python int, for the message. */
static int aligned_size(Pool *p, PyObject *size_obj, int64_t *size, PyObject **beyond) {
    *beyond = NULL;
    if (PyLong_CheckExact(size_obj)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(size_obj, &overflow);
        if (!overflow && v >= 0 && v <= SIZE_BEYOND) {
            *size = v ? (v + p->align - 1) / p->align * p->align : p->align;
            return 0;
        }
    }
    PyObject *value = PyNumber_Index(size_obj); /* the model's operator.index: no floats, no None */
    if (value == NULL)
        return -1;
    PyObject *zero = PyLong_FromLong(0);
    int negative = zero ? PyObject_RichCompareBool(value, zero, Py_LT) : -1;
    Py_XDECREF(zero);
    if (negative) {
        if (negative > 0) {
            PyObject *name = PyObject_GetAttr((PyObject *)p, s_name);
            if (name != NULL)
                PyErr_Format(PyExc_ValueError, "%S: cannot allocate a negative size (%S bytes)", name, value);
            Py_XDECREF(name);
        }
        Py_DECREF(value);
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (!overflow && v <= SIZE_BEYOND) {
        Py_DECREF(value);
        *size = v ? (v + p->align - 1) / p->align * p->align : p->align;
        return 0;
    }
    PyObject *step = PyLong_FromLongLong(p->align);
    PyObject *negated = step ? PyNumber_Negative(value) : NULL;
    PyObject *quotient = negated ? PyNumber_FloorDivide(negated, step) : NULL;
    PyObject *rounded = quotient ? PyNumber_Negative(quotient) : NULL;
    *beyond = rounded ? PyNumber_Multiply(rounded, step) : NULL;
    Py_XDECREF(step);
    Py_XDECREF(negated);
    Py_XDECREF(quotient);
    Py_XDECREF(rounded);
    Py_DECREF(value);
    *size = SIZE_BEYOND;
    return *beyond ? 0 : -1;
}

/* self._allocators[persistent] */
static int which_allocator(PyObject *persistent) {
    if (persistent == Py_False)
        return 0;
    if (persistent == Py_True)
        return 1;
    PyObject *index = PyDict_GetItemWithError(persistent_keys, persistent);
    if (index == NULL) {
        if (!PyErr_Occurred()) {
            PyObject *args = PyTuple_Pack(1, persistent);
            if (args != NULL) {
                PyErr_SetObject(PyExc_KeyError, args);
                Py_DECREF(args);
            }
        }
        return -1;
    }
    return (int)PyLong_AsLong(index);
}

/* The truth of the persistent flag (the model's ``persistent and ...``): the allocator index for True and
 * False, the object's own __bool__ otherwise (an object the dict finds as True may be falsy). */
static int flag_truth(PyObject *flag, int index) {
    if (flag == Py_True || flag == Py_False)
        return index;
    return PyObject_IsTrue(flag);
}

/* DynamicMemPool.malloc (AllocMemBuf): own pool, other pool, eager free, expand, persistent fallback */
static PyObject *Pool_malloc(Pool *p, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *size_obj = nargs > 0 ? args[0] : NULL;
    PyObject *persistent_obj = nargs > 1 ? args[1] : Py_False;
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "malloc() takes from 2 to 3 positional arguments but %zd were given", nargs + 1);
        return NULL;
    }
    if (kwnames != NULL) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); k++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, k);
            PyObject **slot = NULL;
            if (PyUnicode_CompareWithASCIIString(key, "size") == 0)
                slot = &size_obj;
            else if (PyUnicode_CompareWithASCIIString(key, "persistent") == 0)
                slot = &persistent_obj;
            if (slot == NULL) {
                PyErr_Format(PyExc_TypeError, "malloc() got an unexpected keyword argument '%U'", key);
                return NULL;
            }
            if ((slot == &size_obj && nargs > 0) || (slot == &persistent_obj && nargs > 1)) {
                PyErr_Format(PyExc_TypeError, "malloc() got multiple values for argument '%U'", key);
                return NULL;
            }
            *slot = args[nargs + k];
        }
    }
    if (size_obj == NULL) {
        PyErr_SetString(PyExc_TypeError, "malloc() missing 1 required positional argument: 'size'");
        return NULL;
    }
    if (check_ready(p) < 0)
        return NULL;
    int64_t size;
    PyObject *beyond;
    if (aligned_size(p, size_obj, &size, &beyond) < 0)
        return NULL;
    int persistent = which_allocator(persistent_obj);
    if (persistent < 0) {
        Py_XDECREF(beyond);
        return NULL;
    }
    /* __index__, __hash__ and __eq__ above may have run Python (another thread, too): checked after them */
    if (refuse_reentry(p) < 0) {
        Py_XDECREF(beyond);
        return NULL;
    }
    p->busy = 1;
    int served = persistent;
    Buf *b = NULL;
    int got = alloc_malloc(p, served, size, &b);
    /* the model looks the allocator up by the flag, then tests the flag's own truth for its fallbacks */
    if (got == 0) {
        int truth = flag_truth(persistent_obj, persistent);
        if (truth < 0)
            got = -1;
        else if (truth && !p->vmm) {
            served = 0;
            got = alloc_malloc(p, served, size, &b);
        }
    }
    if (got == 0 && p->vmm && p->eager_free_on_miss) {
        got = pool_eager_free_idle(p);
        if (got == 0)
            got = alloc_malloc(p, served, size, &b);
    }
    if (got == 0)
        got = alloc_expand(p, served, size, &b);
    if (got == 0) {
        int truth = flag_truth(persistent_obj, persistent);
        if (truth < 0)
            got = -1;
        else if (!truth && p->common_falls_back_to_persistent) {
            got = alloc_malloc(p, 1, size, &b);
            if (got > 0)
                served = 1;
        }
    }
    if (got == 0) /* "try to sync all events to release memory", then the allocator once more */
        got = alloc_malloc(p, served, size, &b);
    if (got > 0 && used_reserve(&p->used) < 0)
        got = -1; /* (out of the books, as the model's failed dict insert leaves it) */
    p->busy = 0;
    if (got <= 0) {
        if (got == 0) {
            if (p->num_ooms == LLONG_MAX)
                kvg_beyond_int64("num_ooms");
            else {
                p->num_ooms++;
                raise_out_of_memory(p, size, beyond);
            }
        }
        Py_XDECREF(beyond);
        return NULL;
    }
    Py_XDECREF(beyond);
    used_put(&p->used, b->addr, b); /* room reserved above: cannot fail */
    p->used_size += b->size;
    if (p->used_size > p->peak_used)
        p->peak_used = p->used_size;
    if (p->used_size - p->used_at_reset > p->peak_increase)
        p->peak_increase = p->used_size - p->used_at_reset;
    if (p->used_size > p->window_used)
        p->window_used = p->used_size;
    return PyLong_FromLongLong(b->addr);
}

/* The used buffer at addr, as the model's dict finds it (hash, then ==); NULL when none. */
static Py_ssize_t used_lookup(Pool *p, PyObject *addr_obj) {
    if (PyLong_CheckExact(addr_obj)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(addr_obj, &overflow);
        return overflow ? -1 : used_find(&p->used, v);
    }
    Py_hash_t hash = PyObject_Hash(addr_obj);
    if (hash == -1)
        return -2;
    Py_ssize_t slot = used_find(&p->used, (int64_t)hash); /* an address below 2**61 is its own hash */
    if (slot < 0)
        return -1;
    int64_t stored = p->used.keys[slot];
    PyObject *key = PyLong_FromLongLong(stored);
    int equal = key ? PyObject_RichCompareBool(addr_obj, key, Py_EQ) : -1;
    Py_XDECREF(key);
    if (equal <= 0)
        return equal < 0 ? -2 : -1;
    /* __eq__ ran Python, which may have freed or allocated (moving entries, growing the table): find
     * the address again, as the model's dict restarts a lookup its comparison changed */
    return used_find(&p->used, stored);
}

static PyObject *key_error(PyObject *key) {
    PyObject *args = PyTuple_Pack(1, key);
    if (args != NULL) {
        PyErr_SetObject(PyExc_KeyError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static PyObject *Pool_free(Pool *p, PyObject *addr_obj) {
    if (check_ready(p) < 0)
        return NULL;
    if (p->used.n == 0) /* dict.pop of an empty dict: KeyError before hashing */
        return key_error(addr_obj);
    Py_ssize_t slot = used_lookup(p, addr_obj);
    if (slot < 0)
        return slot == -2 ? NULL : key_error(addr_obj);
    if (refuse_reentry(p) < 0) /* after the lookup: its __hash__ / __eq__ may have run Python */
        return NULL;
    Buf *b = p->used.vals[slot];
    used_remove_at(&p->used, (size_t)slot);
    p->used_size -= b->size;
    if (alloc_free(p, &p->alloc[b->persistent], b, IDLE) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Pool_buffer_size(Pool *p, PyObject *addr_obj) {
    if (check_ready(p) < 0)
        return NULL;
    Py_ssize_t slot = used_lookup(p, addr_obj);
    if (slot < 0)
        return slot == -2 ? NULL : key_error(addr_obj);
    Buf *b = p->used.vals[slot];
    return Py_BuildValue("(LL)", (long long)b->addr, (long long)b->size);
}

static PyObject *Pool_eager_free_idle(Pool *p, PyObject *unused) {
    if (check_idle(p) < 0 || pool_eager_free_idle(p) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* DynamicMemPool.empty_cache (mindspore.runtime.empty_cache of the release) */
static PyObject *Pool_empty_cache(Pool *p, PyObject *unused) {
    if (check_idle(p) < 0)
        return NULL;
    if (!p->empty_cache_releases)
        Py_RETURN_NONE;
    int status = 0;
    p->busy = 1;
    if (p->vmm) {
        /* cached_pages * page fits: checked_pages keeps every page count's bytes within a cell */
        status = pool_eager_free_idle(p);
        if (status == 0)
            status = device_free(p, p->cached_pages * p->page);
        if (status == 0) {
            p->physical_pages -= p->cached_pages;
            p->cached_pages = 0;
        }
    } else {
        for (int persistent = 1; status == 0 && persistent >= 0; persistent--)
            status = alloc_release_idle_blocks(p, &p->alloc[persistent]);
    }
    p->busy = 0;
    if (status < 0)
        return NULL;
    note_reserved(p);
    Py_RETURN_NONE;
}

static int persistent_arg(PyObject *arg) {
    int truth = PyObject_IsTrue(arg);
    return truth;
}

/* [(addr, size)] of one allocator */
static PyObject *Pool_blocks(Pool *p, PyObject *arg) {
    int persistent = persistent_arg(arg);
    if (persistent < 0)
        return NULL;
    BlockList *blocks = &p->alloc[persistent].blocks;
    PyObject *out = PyList_New(blocks->n);
    for (Py_ssize_t i = 0; out != NULL && i < blocks->n; i++) {
        PyObject *item = Py_BuildValue("(LL)", (long long)blocks->v[i]->addr, (long long)blocks->v[i]->size);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* [(size, addr)] in order */
static PyObject *entries_as_list(const EntryList *l) {
    PyObject *out = PyList_New(l->n);
    for (Py_ssize_t i = 0; out != NULL && i < l->n; i++) {
        PyObject *item = Py_BuildValue("(LL)", (long long)l->v[i].size, (long long)l->v[i].addr);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *Pool_idle(Pool *p, PyObject *arg) {
    int persistent = persistent_arg(arg);
    return persistent < 0 ? NULL : entries_as_list(&p->alloc[persistent].idle);
}

static PyObject *Pool_eager(Pool *p, PyObject *arg) {
    int persistent = persistent_arg(arg);
    return persistent < 0 ? NULL : entries_as_list(&p->alloc[persistent].eager);
}

/* The free lists and pool counters of DynamicMemPool.steady_state_key, as one bytes object: counts
 * before each variable part, so equal bytes mean equal state. */
static PyObject *Pool_free_state(Pool *p, PyObject *unused) {
    Py_ssize_t words = 4 + 9;
    for (int persistent = 0; persistent < 2; persistent++)
        words += 2 * (p->alloc[persistent].idle.n + p->alloc[persistent].eager.n);
    PyObject *out = PyBytes_FromStringAndSize(NULL, words * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL)
        return NULL;
    int64_t *w = (int64_t *)PyBytes_AS_STRING(out);
    for (int persistent = 0; persistent < 2; persistent++) {
        const EntryList *lists[2] = {&p->alloc[persistent].idle, &p->alloc[persistent].eager};
        for (int k = 0; k < 2; k++) {
            *w++ = lists[k]->n;
            for (Py_ssize_t i = 0; i < lists[k]->n; i++) {
                *w++ = lists[k]->v[i].size;
                *w++ = lists[k]->v[i].addr;
            }
        }
    }
    const long long scalars[9] = {p->next_addr,    p->static_bytes,    p->alloc_size,
                                  p->used_size,    p->eager_free_size, p->physical_pages,
                                  p->cached_pages, p->total_mem_size,  p->used_at_reset};
    for (int k = 0; k < 9; k++)
        *w++ = scalars[k];
    return out;
}

/* Each allocator's blocks with their pages, as bytes; cached until a block or a page changes. */
static PyObject *Pool_blocks_state(Pool *p, PyObject *unused) {
    if (p->blocks_key == NULL) {
        Py_ssize_t size = 0;
        for (int persistent = 0; persistent < 2; persistent++) {
            size += (Py_ssize_t)sizeof(int64_t);
            for (Py_ssize_t i = 0; i < p->alloc[persistent].blocks.n; i++)
                size += 3 * (Py_ssize_t)sizeof(int64_t) + p->alloc[persistent].blocks.v[i]->npages;
        }
        PyObject *out = PyBytes_FromStringAndSize(NULL, size);
        if (out == NULL)
            return NULL;
        char *w = PyBytes_AS_STRING(out);
        for (int persistent = 0; persistent < 2; persistent++) {
            const BlockList *blocks = &p->alloc[persistent].blocks;
            int64_t head = blocks->n;
            memcpy(w, &head, sizeof head);
            w += sizeof head;
            for (Py_ssize_t i = 0; i < blocks->n; i++) {
                const Block *block = blocks->v[i];
                int64_t fields[3] = {block->addr, block->size, block->npages};
                memcpy(w, fields, sizeof fields);
                w += sizeof fields;
                if (block->npages)
                    memcpy(w, block->pages, (size_t)block->npages);
                w += block->npages;
            }
        }
        if (p->busy) /* read from a callback, mid-change: not a key to keep */
            return out;
        p->blocks_key = out;
    }
    return Py_NewRef(p->blocks_key);
}

static PyObject *Pool_get_reserved(Pool *p, void *closure) {
    return PyLong_FromLongLong(reserved_bytes(p));
}

/* ------------------------------------------------------------------ lifetime */
static void pool_release_all(Pool *p) {
    for (int persistent = 0; persistent < 2; persistent++) {
        Alloc *a = &p->alloc[persistent];
        for (Py_ssize_t i = 0; i < a->blocks.n; i++) {
            PyMem_Free(a->blocks.v[i]->pages);
            PyMem_Free(a->blocks.v[i]);
        }
        PyMem_Free(a->blocks.v);
        PyMem_Free(a->idle.v);
        PyMem_Free(a->eager.v);
        memset(a, 0, sizeof *a);
    }
    for (Py_ssize_t i = 0; i < p->nslabs; i++)
        PyMem_Free(p->slabs[i]);
    PyMem_Free(p->slabs);
    p->slabs = NULL;
    p->nslabs = p->slabcap = 0;
    p->spare = NULL;
    PyMem_Free(p->used.keys);
    PyMem_Free(p->used.vals);
    memset(&p->used, 0, sizeof p->used);
    Py_CLEAR(p->blocks_key);
}

/* Pool(device, total_mem_size, page, align, enable_vmm, grows_idle_into_eager_free, eager_free_on_miss,
 *      common_falls_back_to_persistent, eager_free_drops_on_refused_map, reserved_is_physical,
 *      empty_cache_releases): the decoded release row (mindspore_native.NativeDynamicMemPool). */
static int Pool_init(Pool *p, PyObject *args, PyObject *kwargs) {
    PyObject *device;
    long long total, page, align;
    int vmm, grows, eager_on_miss, falls_back, drops, physical, releases;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "_cmspool.Pool takes positional arguments only");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OLLLppppppp", &device, &total, &page, &align, &vmm, &grows, &eager_on_miss,
                          &falls_back, &drops, &physical, &releases))
        return -1;
    if (refuse_reentry(p) < 0) /* (the "p" conversions above ran __bool__) */
        return -1;
    if (page <= 0 || align <= 0 || total < 0 || total > SIZE_BEYOND || page > STEP_LIMIT || align > STEP_LIMIT) {
        PyErr_SetString(PyExc_ValueError, "_cmspool.Pool: page, alignment or budget out of range");
        return -1;
    }
    pool_release_all(p);
    Py_INCREF(device);
    Py_XSETREF(p->device, device);
    p->total_mem_size = total;
    p->page = page;
    p->max_pages = total / page;
    p->align = align;
    p->vmm = vmm;
    p->grows_idle_into_eager_free = grows;
    p->eager_free_on_miss = eager_on_miss;
    p->common_falls_back_to_persistent = falls_back;
    p->eager_free_drops_on_refused_map = drops;
    p->reserved_is_physical = physical;
    p->empty_cache_releases = releases;
    p->static_bytes = 0;
    p->next_addr = (long long)1 << 44;
    p->alloc_size = p->used_size = p->eager_free_size = p->physical_pages = p->cached_pages = 0;
    p->peak_used = p->peak_reserved = p->used_at_reset = p->peak_increase = p->alloc_at_reset = 0;
    p->window_used = p->window_reserved = p->num_ooms = 0;
    p->ready = 1;
    return 0;
}

static int Pool_traverse(Pool *p, visitproc visit, void *arg) {
    Py_VISIT(p->device);
    return 0;
}

static int Pool_clear(Pool *p) {
    Py_CLEAR(p->device);
    p->ready = 0;
    return 0;
}

static void Pool_dealloc(Pool *p) {
    PyObject_GC_UnTrack(p);
    Pool_clear(p);
    pool_release_all(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

#define COUNTER(name, field, flags) {name, T_LONGLONG, offsetof(Pool, field), flags, NULL}
static PyMemberDef Pool_members[] = {
    {"device", T_OBJECT, offsetof(Pool, device), READONLY, NULL},
    COUNTER("total_mem_size", total_mem_size, READONLY),
    COUNTER("page", page, READONLY),
    COUNTER("_max_pages", max_pages, READONLY),
    COUNTER("_static_bytes", static_bytes, READONLY),
    COUNTER("_next_addr", next_addr, READONLY),
    COUNTER("alloc_size", alloc_size, READONLY),
    COUNTER("used_size", used_size, READONLY),
    COUNTER("eager_free_size", eager_free_size, READONLY),
    COUNTER("physical_pages", physical_pages, READONLY),
    COUNTER("cached_pages", cached_pages, READONLY),
    /* written by reset_peak_memory_stats, take_window_peaks and base.record_steady / replay_steady */
    COUNTER("num_ooms", num_ooms, 0),
    COUNTER("_peak_used", peak_used, 0),
    COUNTER("_peak_reserved", peak_reserved, 0),
    COUNTER("_peak_increase", peak_increase, 0),
    COUNTER("_alloc_at_reset", alloc_at_reset, 0),
    COUNTER("_window_used", window_used, 0),
    COUNTER("_window_reserved", window_reserved, 0),
    {NULL}};

/* _used_at_reset: reset_peak_memory_stats writes used_size there; malloc subtracts it from used_size, so
 * the cell holds 0 .. 2**63 - 1 (a negative mark would take that difference past 2**63). */
static PyObject *Pool_get_used_at_reset(Pool *p, void *closure) {
    return PyLong_FromLongLong(p->used_at_reset);
}

static int Pool_set_used_at_reset(Pool *p, PyObject *value, void *closure) {
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "can't delete numeric/char attribute");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_SetString(PyExc_ValueError, "_cmspool: _used_at_reset is a byte count, 0 .. 2**63 - 1");
        return -1;
    }
    p->used_at_reset = v;
    return 0;
}

static PyGetSetDef Pool_getset[] = {
    {"reserved_bytes", (getter)Pool_get_reserved, NULL, "memory_reserved() of the release", NULL},
    {"_used_at_reset", (getter)Pool_get_used_at_reset, (setter)Pool_set_used_at_reset,
     "used_size at the last reset_peak_memory_stats", NULL},
    {NULL}};

static PyMethodDef Pool_methods[] = {
    {"malloc", (PyCFunction)(void (*)(void))Pool_malloc, METH_FASTCALL | METH_KEYWORDS,
     "malloc(size, persistent=False) -> address; AllocatorOutOfMemory when the pool cannot serve it"},
    {"free", (PyCFunction)Pool_free, METH_O, "free(address)"},
    {"empty_cache", (PyCFunction)Pool_empty_cache, METH_NOARGS, "mindspore.runtime.empty_cache() of the release"},
    {"_eager_free_idle", (PyCFunction)Pool_eager_free_idle, METH_NOARGS, "eager-free every idle buffer"},
    {"_buffer_size", (PyCFunction)Pool_buffer_size, METH_O, "(addr, size) of the used buffer at addr"},
    {"_block_list", (PyCFunction)Pool_blocks, METH_O, "[(addr, size)] of one allocator's blocks"},
    {"_idle_list", (PyCFunction)Pool_idle, METH_O, "[(size, addr)] of one allocator's idle buffers, in order"},
    {"_eager_list", (PyCFunction)Pool_eager, METH_O, "[(size, addr)] of one allocator's eager-free buffers"},
    {"_free_state", (PyCFunction)Pool_free_state, METH_NOARGS, "the free lists and counters, as bytes"},
    {"_blocks_state", (PyCFunction)Pool_blocks_state, METH_NOARGS, "the blocks and their pages, as bytes"},
    {NULL}};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard.allocators._cmspool.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "MindSpore's dynamic memory pool, the C engine of kvguard.allocators.mindspore_pool.DynamicMemPool",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_traverse = (traverseproc)Pool_traverse,
    .tp_clear = (inquiry)Pool_clear,
    .tp_methods = Pool_methods,
    .tp_members = Pool_members,
    .tp_getset = Pool_getset,
};

static struct PyModuleDef cmspool_module = {
    PyModuleDef_HEAD_INIT,
    "kvguard.allocators._cmspool",
    "C engine of kvguard.allocators.mindspore_pool (see mindspore_native.py)",
    -1,
    NULL,
};

/* mindspore_pool.py's constants (and the engine's limits, which mindspore_native.py reads) */
static const KvgConstant shared_constants[] = {
    KVG_CONSTANT(IDLE),        KVG_CONSTANT(USED),       KVG_CONSTANT(EAGER_FREE), KVG_CONSTANT(SPLIT_MIN_BYTES),
    KVG_CONSTANT(SIZE_BEYOND), KVG_CONSTANT(STEP_LIMIT),
};

PyMODINIT_FUNC PyInit__cmspool(void) {
    if (PyType_Ready(&PoolType) < 0)
        return NULL;
    s_malloc = PyUnicode_InternFromString("malloc");
    s_free = PyUnicode_InternFromString("free");
    s_free_bytes = PyUnicode_InternFromString("free_bytes");
    s_block_alloc_size = PyUnicode_InternFromString("block_alloc_size");
    s_name = PyUnicode_InternFromString("name");
    persistent_keys = Py_BuildValue("{O:i,O:i}", Py_True, 1, Py_False, 0);
    if (!s_malloc || !s_free || !s_free_bytes || !s_block_alloc_size || !s_name || !persistent_keys)
        return NULL;
    if (kvg_import_out_of_memory() < 0)
        return NULL;
    PyObject *module = PyModule_Create(&cmspool_module);
    if (module == NULL)
        return NULL;
    if (kvg_add_constants(module, shared_constants, sizeof shared_constants / sizeof shared_constants[0]) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(module, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
