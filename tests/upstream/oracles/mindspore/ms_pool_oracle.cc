// kvguard's MindSpore pool oracle: MindSpore's own Ascend memory pool, compiled, on a fake ACL device.
//
// The PyPI wheel ships lib/plugin/ascend/libmindspore_ascend_res_manager.so. That library reaches the ACL
// runtime only through exported std::function globals (dlopen_macro.h ORIGIN_METHOD_WITH_SIMU:
// `extern name##FunObj name##_`), which it normally fills by dlopen'ing libascendcl.so. This program fills
// them with a fake device instead, creates the pool MindSpore uses on Ascend
// (AscendMemoryPool::GetInstance(): a DefaultAscendMemoryPool) and drives it. Everything above the driver
// calls (block sizing, best fit, split and merge, eager free, the VMM adapter, the memory adapter's budget)
// is MindSpore's machine code; only the device is fake.
//
// stdin: the op stream of `kvguard simulate --ops`, one JSON object per line:
//   {"op": "malloc", "size": N, "persistent": false}
//   {"op": "free", "index": K}      K: 0-based line of the malloc whose buffer is freed (an OOM'd one: no-op)
//   {"op": "empty_cache"}
//   {"op": "dump"}       DumpDynamicMemPoolDebugInfo(): MemoryDebugInfo<k>.txt in the working directory
//                        (KVGUARD_ORACLE_CWD)
//   {"op": "defrag"}     DefragMemory(), as DataPrepareActor calls it every defrag_memory_step_freq graph runs: a
//                        file when that value holds "dump", and (VMM) the eager free of idle memory
//   Both answer with the pool's own lists (pool_lists(): per allocator, and the 2 MiB pages used buffers touch),
//   read from its members, to hold the file against.
// One line that is not an op, for streams recorded across a compile (the serving scenario's):
//   {"op": "jit_o0_compile"}       clears MS_CTX_ENABLE_TASK_SINK, as a jit_level O0 compile does; no output
// stdout: one JSON object first ({"init": ...}: what the pool started with), then one per op.
// MindSpore's own prints go to stderr, so stdout carries JSON only.
//
// env: KVGUARD_ORACLE_DEVICE_FREE / KVGUARD_ORACLE_DEVICE_TOTAL (bytes; total defaults to free);
//      KVGUARD_ORACLE_TASK_SINK=0|1 (MsContext enable_task_sink; unset keeps MindSpore's default, on);
//      KVGUARD_ORACLE_MEMPOOL_BLOCK_GB (context mempool_block_size); MS_ALLOC_CONF, read by MindSpore itself;
//      KVGUARD_ORACLE_OUTPUT=compact: after the init line, "oom reserved allocated address" per op instead;
//      KVGUARD_ORACLE_CWD: the working directory, where the dump ops' files go;
//      KVGUARD_ORACLE_SERVE=1: many streams from one process, each in a forked child (serve() below;
//      tests/upstream/oracles/mindspore/client.py speaks it).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

// 2.7.0 keeps the pool's headers under include/backend/mem_reuse/, 2.7.1+ under include/runtime/memory/mem_pool/.
#if __has_include("include/runtime/memory/mem_pool/dynamic_mem_pool.h")
#include "include/runtime/memory/mem_pool/dynamic_mem_pool.h"
#else
#include "include/backend/mem_reuse/dynamic_mem_pool.h"
#endif
#if __has_include("include/runtime/memory/mem_pool/abstract_dynamic_mem_pool.h")
#include "include/runtime/memory/mem_pool/abstract_dynamic_mem_pool.h"
#else
#include "include/backend/mem_reuse/abstract_dynamic_mem_pool.h"
#endif
#if __has_include("plugin/ascend/res_manager/mem_manager/abstract_ascend_memory_pool_support.h")
#include "plugin/ascend/res_manager/mem_manager/abstract_ascend_memory_pool_support.h"
#else
#include "plugin/res_manager/ascend/mem_manager/abstract_ascend_memory_pool_support.h"
#endif
#include "utils/ms_context.h"

namespace mindspore::device::ascend {
// Declared here because their headers pull in CANN's: only the symbols are needed, and a non-template
// function's mangled name does not carry its return type.
class AscendMemAdapter {
 public:
  static std::shared_ptr<AscendMemAdapter> GetInstance();
  bool Initialize();
};
class AscendMemoryPool {
 public:
  static AbstractAscendMemoryPoolSupport &GetInstance();
};
// The ACL entry points the pool path calls. ACL enums are ints at the ABI level; a variable's mangled
// name carries no type, so these bind to the library's globals by name alone.
extern std::function<int(int, size_t *, size_t *)> aclrtGetMemInfo_;
extern std::function<int(void **, size_t, int)> aclrtMalloc_;
extern std::function<int(void *)> aclrtFree_;
extern std::function<int(void **, size_t, size_t, void *, uint64_t)> aclrtReserveMemAddress_;
extern std::function<int(void *)> aclrtReleaseMemAddress_;
extern std::function<int(void **, size_t, const void *, uint64_t)> aclrtMallocPhysical_;
extern std::function<int(void *)> aclrtFreePhysical_;
extern std::function<int(void *, size_t, size_t, void *, uint64_t)> aclrtMapMem_;
extern std::function<int(void *)> aclrtUnmapMem_;
extern std::function<int(void *)> aclrtSynchronizeStream_;
// AscendStreamMng::SyncAllStreams, which the pool calls before it eager-frees idle buffers on a miss.
extern std::function<int(int32_t)> aclrtSynchronizeDeviceWithTimeout_;
}  // namespace mindspore::device::ascend

namespace {
constexpr int kAclMemoryAllocationError = 207001;  // ACL_ERROR_RT_MEMORY_ALLOCATION
constexpr uintptr_t kPage = 2ULL << 20;

// ------------------------------------------------------------------------------------------ the fake device
// Physical memory is a byte count; addresses are handed out upwards from 1 << 44 with a 2 MiB gap after each
// range (kvguard's model places its blocks the same way, so addresses compare one to one). Nothing is touched.
struct FakeDevice {
  size_t total = 64ULL << 30;
  size_t free_at_start = 64ULL << 30;
  size_t malloc_bytes = 0;    // aclrtMalloc'd
  size_t physical_bytes = 0;  // aclrtMallocPhysical'd (VMM handles)
  uintptr_t next_address = uintptr_t{1} << 44;
  uintptr_t next_handle = 1;
  std::map<uintptr_t, size_t> blocks;
  std::map<uintptr_t, size_t> handles;

  size_t free() const { return free_at_start - malloc_bytes - physical_bytes; }
  uintptr_t take_address(size_t size) {
    uintptr_t address = next_address;
    next_address += ((size + kPage - 1) / kPage + 1) * kPage;
    return address;
  }
};
FakeDevice device;

void install_fake_acl() {
  using namespace mindspore::device::ascend;
  aclrtGetMemInfo_ = [](int, size_t *free, size_t *total) {
    *free = device.free();
    *total = device.total;
    return 0;
  };
  aclrtMalloc_ = [](void **ptr, size_t size, int) {
    if (size > device.free()) {
      *ptr = nullptr;
      return kAclMemoryAllocationError;
    }
    uintptr_t address = device.take_address(size);
    device.blocks[address] = size;
    device.malloc_bytes += size;
    *ptr = reinterpret_cast<void *>(address);
    return 0;
  };
  aclrtFree_ = [](void *ptr) {
    auto it = device.blocks.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != device.blocks.end()) {
      device.malloc_bytes -= it->second;
      device.blocks.erase(it);
    }
    return 0;
  };
  // Address space is not limited, as on the device (`// Virtual address is unlimited.` in the pool).
  aclrtReserveMemAddress_ = [](void **ptr, size_t size, size_t, void *, uint64_t) {
    *ptr = reinterpret_cast<void *>(device.take_address(size));
    return 0;
  };
  aclrtReleaseMemAddress_ = [](void *) { return 0; };
  aclrtMallocPhysical_ = [](void **handle, size_t size, const void *, uint64_t) {
    if (size > device.free()) return kAclMemoryAllocationError;
    uintptr_t id = device.next_handle++;
    device.handles[id] = size;
    device.physical_bytes += size;
    *handle = reinterpret_cast<void *>(id);
    return 0;
  };
  aclrtFreePhysical_ = [](void *handle) {
    auto it = device.handles.find(reinterpret_cast<uintptr_t>(handle));
    if (it != device.handles.end()) {
      device.physical_bytes -= it->second;
      device.handles.erase(it);
    }
    return 0;
  };
  aclrtMapMem_ = [](void *, size_t, size_t, void *, uint64_t) { return 0; };
  aclrtUnmapMem_ = [](void *) { return 0; };
  aclrtSynchronizeStream_ = [](void *) { return 0; };
  aclrtSynchronizeDeviceWithTimeout_ = [](int32_t) { return 0; };
}

// ------------------------------------------------------------------------------------------ the pool's lists
// The members that hold the buffers are protected. A pointer to a member named through a derived class is
// ordinary C++ (no layout assumption beyond the release's own header, which the harness is compiled against).
using mindspore::device::AbstractDynamicMemPool;
using mindspore::device::MemBufAllocator;
struct PoolMembers : AbstractDynamicMemPool {
  static constexpr auto allocators = &PoolMembers::stream_id_allocators_;
  static constexpr auto used = &PoolMembers::addr_mem_buf_allocators_;
};
struct AllocatorMembers : MemBufAllocator {
  static constexpr auto idle = &AllocatorMembers::free_mem_bufs_;
  static constexpr auto eager = &AllocatorMembers::eager_free_mem_bufs_;
  static constexpr auto blocks = &AllocatorMembers::mem_blocks_;
};

std::string json_text(std::string text) {
  for (auto &c : text) {
    if (c == '"' || c == '\\' || c < ' ') c = ' ';
  }
  return text;
}

// ,"pool_lists":{...}: per allocator (its BriefInfo, as the file heads its sections) the idle buffers (count,
// bytes, largest), the eager-free ones, the blocks and the used buffers; and over all used buffers their bytes
// and the distinct 2 MiB pages they touch (VMM: what stays mapped after an eager free).
std::string pool_lists(mindspore::device::DynamicMemPool &pool) {
  auto *abstract = dynamic_cast<AbstractDynamicMemPool *>(&pool);
  if (abstract == nullptr) return ",\"pool_lists\":null";
  std::map<MemBufAllocator *, std::pair<size_t, size_t>> used_by;  // allocator -> (count, bytes)
  std::set<uintptr_t> pages;
  size_t used_bytes = 0;
  for (const auto &[address, buf_allocator] : abstract->*PoolMembers::used) {
    auto *buf = buf_allocator.first;
    auto &entry = used_by[buf_allocator.second];
    entry.first += 1;
    entry.second += buf->size_;
    used_bytes += buf->size_;
    const auto start = reinterpret_cast<uintptr_t>(buf->addr_);
    for (uintptr_t page = start / kPage; page <= (start + buf->size_ - 1) / kPage; ++page) pages.insert(page);
  }
  std::ostringstream out;
  out << ",\"pool_lists\":{\"used_bytes\":" << used_bytes << ",\"pages_touched_by_used\":" << pages.size()
      << ",\"allocators\":[";
  bool first = true;
  for (auto &entry : abstract->*PoolMembers::allocators) {
    MemBufAllocator *allocator = &*entry.second;
    size_t idle_bytes = 0, largest = 0, eager_bytes = 0;
    const auto &idle = allocator->*AllocatorMembers::idle;
    for (const auto *buf : idle) {
      idle_bytes += buf->size_;
      largest = std::max(largest, buf->size_);
    }
    const auto &eager = allocator->*AllocatorMembers::eager;
    for (const auto *buf : eager) eager_bytes += buf->size_;
    const auto used = used_by[allocator];
    out << (first ? "" : ",") << "{\"brief\":\"" << json_text(allocator->BriefInfo()) << "\",\"persistent\":"
        << (allocator->is_persistent() ? 1 : 0) << ",\"stream\":" << allocator->stream_id()
        << ",\"idle_count\":" << idle.size() << ",\"idle_bytes\":" << idle_bytes << ",\"largest_idle\":" << largest
        << ",\"eager_free_count\":" << eager.size() << ",\"eager_free_bytes\":" << eager_bytes
        << ",\"blocks\":" << (allocator->*AllocatorMembers::blocks).size() << ",\"used_count\":" << used.first
        << ",\"used_bytes\":" << used.second << "}";
    first = false;
  }
  out << "]}";
  return out.str();
}

// ------------------------------------------------------------------------------------------ input
// The op stream is flat JSON objects with string, integer and boolean values: a small scanner suffices.
bool find_value(const std::string &line, const std::string &key, std::string *value) {
  auto at = line.find("\"" + key + "\"");
  if (at == std::string::npos) return false;
  at = line.find(':', at + key.size() + 2);
  if (at == std::string::npos) return false;
  at = line.find_first_not_of(" \t", at + 1);
  if (at == std::string::npos) return false;
  if (line[at] == '"') {
    auto end = line.find('"', at + 1);
    *value = line.substr(at + 1, end - at - 1);
  } else {
    auto end = line.find_first_of(",} \t", at);
    *value = line.substr(at, end == std::string::npos ? std::string::npos : end - at);
  }
  return true;
}

// ------------------------------------------------------------------------------------------ output
std::string blocks_json(const std::unordered_map<void *, std::unordered_map<std::string, size_t>> &info) {
  std::vector<std::pair<uintptr_t, size_t>> blocks;
  for (const auto &[address, fields] : info) {
    auto size = fields.find("block_memory_size");
    blocks.emplace_back(reinterpret_cast<uintptr_t>(address), size == fields.end() ? 0 : size->second);
  }
  std::sort(blocks.begin(), blocks.end());
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < blocks.size(); ++i) out << (i ? "," : "") << "[" << blocks[i].first << "," << blocks[i].second << "]";
  out << "]";
  return out.str();
}
// One stream: the pool created fresh for the device and context the environment names, then every op of `in`.
int run_stream(std::istream &in, FILE *json) {
  // The pool writes its MemoryDebugInfo files into the working directory unless MS_ALLOC_CONF names a
  // memory_tracker_path, and naming one switches MindSpore to its enhanced pool (ascend_memory_pool.cc:616-630
  // @ r2.7.rc1), whose lists pool_lists() cannot reach: a stream that dumps names its folder here instead.
  if (const char *v = getenv("KVGUARD_ORACLE_CWD")) {
    if (chdir(v) != 0) {
      fprintf(json, "{\"error\":\"cannot enter KVGUARD_ORACLE_CWD\"}\n");
      return 2;
    }
  }
  if (const char *v = getenv("KVGUARD_ORACLE_DEVICE_FREE")) device.free_at_start = strtoull(v, nullptr, 10);
  device.total = device.free_at_start;
  if (const char *v = getenv("KVGUARD_ORACLE_DEVICE_TOTAL")) device.total = strtoull(v, nullptr, 10);
  install_fake_acl();

  auto context = mindspore::MsContext::GetInstance();
  if (const char *v = getenv("KVGUARD_ORACLE_TASK_SINK")) {
    context->set_param<bool>(mindspore::MS_CTX_ENABLE_TASK_SINK, atoi(v) != 0);
  }
  if (const char *v = getenv("KVGUARD_ORACLE_MEMPOOL_BLOCK_GB")) {
    context->set_param<float>(mindspore::MS_CTX_MEMPOOL_BLOCK_SIZE, strtof(v, nullptr));
  }
  // The pool's budget (total_mem_size) is computed here from aclrtGetMemInfo (ascend_memory_adapter.cc).
  mindspore::device::ascend::AscendMemAdapter::GetInstance()->Initialize();
  mindspore::device::DynamicMemPool &pool = mindspore::device::ascend::AscendMemoryPool::GetInstance();

  fprintf(json,
          "{\"init\":{\"vmm\":%d,\"eager_free\":%d,\"task_sink\":%d,\"device_free_bytes\":%zu,"
          "\"total_mem_size\":%zu,\"free_mem_size\":%zu}}\n",
          pool.IsEnableVmm() ? 1 : 0, pool.IsEnableEagerFree() ? 1 : 0,
          context->get_param<bool>(mindspore::MS_CTX_ENABLE_TASK_SINK) ? 1 : 0, device.free(),
          static_cast<size_t>(pool.total_mem_size()), static_cast<size_t>(pool.free_mem_size()));
  fflush(json);

  // KVGUARD_ORACLE_OUTPUT=compact: one line "oom reserved allocated address" per op (address 0: none), without
  // the block lists, for long streams replayed in one batch (bench/real_pool.py); JSON otherwise.
  const char *output = getenv("KVGUARD_ORACLE_OUTPUT");
  const bool compact = output != nullptr && std::string(output) == "compact";
  std::vector<void *> address_of_line;  // per input line: the malloc's address (nullptr: not a malloc, or OOM)
  std::string line;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::string op, value;
    find_value(line, "op", &op);
    if (op == "jit_o0_compile") {
      context->set_param<bool>(mindspore::MS_CTX_ENABLE_TASK_SINK, false);
      continue;
    }
    const size_t step = address_of_line.size();
    address_of_line.push_back(nullptr);
    std::ostringstream extra;
    try {
      if (op == "malloc") {
        find_value(line, "size", &value);
        size_t size = strtoull(value.c_str(), nullptr, 10);
        bool persistent = find_value(line, "persistent", &value) && value == "true";
        void *address = pool.AllocTensorMem(size, persistent, false, 0);
        address_of_line[step] = address;
        if (address == nullptr) {
          extra << ",\"address\":null,\"oom\":true";
        } else {
          extra << ",\"address\":" << reinterpret_cast<uintptr_t>(address) << ",\"oom\":false";
        }
      } else if (op == "free") {
        find_value(line, "index", &value);
        size_t index = strtoull(value.c_str(), nullptr, 10);
        if (index < step && address_of_line[index] != nullptr) {
          pool.FreeTensorMem(address_of_line[index]);
          address_of_line[index] = nullptr;
        }
        extra << ",\"oom\":false";
      } else if (op == "empty_cache") {
        extra << ",\"released_bytes\":" << pool.EmptyCache() << ",\"oom\":false";
      } else if (op == "dump" || op == "defrag") {
        const auto start = std::chrono::steady_clock::now();
        if (op == "dump") {
          pool.DumpDynamicMemPoolDebugInfo();
        } else {
          pool.DefragMemory();
        }
        const long long call_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
        // One JSON line whatever the output mode: the file's figures are held against these; call_ns is the
        // pool call's own time (the dump's cost on the thread that runs it).
        fprintf(json,
                "{\"step\":%zu,\"op\":\"%s\",\"oom\":false,\"call_ns\":%lld,\"reserved_bytes\":%zu,"
                "\"allocated_bytes\":%zu%s}\n",
                step, op.c_str(), call_ns, static_cast<size_t>(pool.TotalMemStatistics()),
                static_cast<size_t>(pool.TotalUsedMemStatistics()), pool_lists(pool).c_str());
        fflush(json);
        continue;
      } else {
        extra << ",\"error\":\"unknown op\"";
      }
    } catch (const std::exception &e) {
      std::string message = e.what();
      for (auto &c : message) {
        if (c == '"' || c == '\\' || c < ' ') c = ' ';
      }
      extra << ",\"error\":\"" << message.substr(0, 300) << "\"";
    }
    if (compact) {
      const std::string text = extra.str();
      if (text.find("\"error\"") != std::string::npos) {
        fprintf(json, "error %zu%s\n", step, text.c_str());
      } else {
        fprintf(json, "%d %zu %zu %zu\n", text.find("\"oom\":true") != std::string::npos ? 1 : 0,
                static_cast<size_t>(pool.TotalMemStatistics()), static_cast<size_t>(pool.TotalUsedMemStatistics()),
                static_cast<size_t>(reinterpret_cast<uintptr_t>(address_of_line[step])));
      }
      continue;
    }
    auto units = pool.BlockUnitSizeStatistics();
    std::ostringstream out;
    out << "{\"step\":" << step << ",\"op\":\"" << op << "\"" << extra.str()
        << ",\"reserved_bytes\":" << pool.TotalMemStatistics() << ",\"allocated_bytes\":" << pool.TotalUsedMemStatistics()
        << ",\"peak_allocated_bytes\":" << pool.MaxMemAllocatedStatistics()
        << ",\"peak_reserved_bytes\":" << pool.MaxMemReservedStatistics()
        << ",\"used_peak_bytes\":" << pool.UsedMemPeakStatistics() << ",\"idle_bytes\":" << pool.TotalIdleMemStatistics()
        << ",\"eager_free_bytes\":" << pool.TotalEagerFreeMemStatistics()
        << ",\"total_mem_size\":" << pool.total_mem_size() << ",\"unit_common\":" << units["common_mem_pool"]
        << ",\"unit_persistent\":" << units["persistent_mem_pool"]
        << ",\"common_blocks\":" << blocks_json(pool.CommonMemBlocksInfoStatistics())
        << ",\"persistent_blocks\":" << blocks_json(pool.PersistentMemBlocksInfoStatistics())
        << ",\"device_free_bytes\":" << device.free() << "}";
    fprintf(json, "%s\n", out.str().c_str());
    fflush(json);
  }
  fflush(json);
  return 0;
}

// KVGUARD_ORACLE_SERVE=1: many streams from one process. Loading MindSpore's libraries is most of a short
// stream's cost (~0.35 s), and the pool is a process-wide singleton, so each stream runs in a child forked
// after the libraries are loaded and before any pool exists. stdin, per stream: a header line
//   {"stream": N, "KVGUARD_ORACLE_DEVICE_FREE": "...", "MS_ALLOC_CONF": "...", ...}
// (the environment of a one-stream run, as strings; a variable not named is unset), then the stream's N lines.
// stdout, per stream: what a one-stream run prints, then {"end": STATUS} (the child's wait status; 0: clean).
const char *const kStreamVariables[] = {"KVGUARD_ORACLE_DEVICE_FREE", "KVGUARD_ORACLE_DEVICE_TOTAL",
                                        "KVGUARD_ORACLE_TASK_SINK", "KVGUARD_ORACLE_MEMPOOL_BLOCK_GB",
                                        "KVGUARD_ORACLE_OUTPUT", "MS_ALLOC_CONF", "KVGUARD_ORACLE_CWD"};

int serve(FILE *json) {
  std::string header;
  while (std::getline(std::cin, header)) {
    if (header.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::string value;
    if (!find_value(header, "stream", &value)) {
      fprintf(json, "{\"end\":-1,\"error\":\"a stream header must name its line count\"}\n");
      fflush(json);
      return 2;
    }
    const size_t count = strtoull(value.c_str(), nullptr, 10);
    std::string body, line;
    for (size_t i = 0; i < count && std::getline(std::cin, line); ++i) body += line + "\n";
    fflush(json);
    fflush(stderr);
    const pid_t child = fork();
    if (child == 0) {
      for (const char *name : kStreamVariables) {
        if (find_value(header, name, &value)) {
          setenv(name, value.c_str(), 1);
        } else {
          unsetenv(name);
        }
      }
      std::istringstream in(body);
      run_stream(in, json);
      fflush(json);
      _exit(0);
    }
    int status = -1;
    if (child < 0 || waitpid(child, &status, 0) != child) status = -1;
    fprintf(json, "{\"end\":%d}\n", status);
    fflush(json);
  }
  return 0;
}
}  // namespace

int main() {
  // MindSpore prints a few plain lines on stdout ("[MS_ALLOC_CONF]..."): keep stdout for JSON only.
  FILE *json = fdopen(dup(1), "w");
  dup2(2, 1);
  const char *serving = getenv("KVGUARD_ORACLE_SERVE");
  if (serving != nullptr && std::string(serving) == "1") return serve(json);
  return run_stream(std::cin, json);
}
