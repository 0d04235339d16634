// A CPU allocator for large blocks that keeps the pages of freed blocks and builds later blocks from them, for
// exact BPTT in chunks (train.bptt_chunk: each chunk allocates and frees the same few hundred MiB again) and FSDP
// (each unit's parameters gathered and freed in turn).
//
// Why our own: glibc either keeps freed blocks in its heap, where the small blocks that outlive a chunk (boundary
// states, losses) split the large free ones and the heap grows with the window (under FSDP past DDP's whole
// state), or maps large blocks and unmaps them when freed, so every chunk page-faults its memory in again (half
// again the time a token; FSDP at less than half DDP's speed); torch has no CPU
// caching allocator that can be switched on from Python, and jemalloc or tcmalloc must be preloaded before the
// process starts (figures: benchmarks/RESULTS.md, "Long sequences"). Here blocks of `threshold` bytes and more are
// whole 2 MiB pages of their own mappings. A freed block's pages stay mapped and held; a request takes the
// smallest held range that fits, and where none does, a fresh mapping is filled with held pages moved into it by
// mremap (page-table entries move; no page is touched or zeroed), fresh pages only for what the held ones lack.
// So the pool never holds more than the most its blocks ever had in use at once, whatever their sizes, and a
// chunk's blocks page-fault only in the first chunk. Smaller blocks go to the allocator it replaced. Linux only.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace rpt_native {
namespace {

constexpr size_t PAGE = size_t(2) << 20;  // a huge page: mappings aligned to it keep (and move) huge pages

struct Range {
  char* at;
  size_t size;
};

#ifdef __linux__
class PagePool final : public c10::Allocator {
 public:
  PagePool(c10::Allocator* small, size_t threshold) : small_(small), threshold_(threshold) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < threshold_) return small_->allocate(n);
    size_t size = (n + PAGE - 1) & ~(PAGE - 1);
    std::lock_guard<std::mutex> hold(lock_);
    char* p = take_whole(size);
    if (p == nullptr) p = assemble(size);
    in_use_[p] = size;
    used_ += size;
    high_water_ = std::max(high_water_, used_);
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void release(void* p);

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> hold(lock_);
    return {int64_t(used_), int64_t(held_), int64_t(high_water_), moved_};
  }

 private:
  // The smallest held range of at least `size` bytes, cut to it (the rest stays held); nullptr if none.
  char* take_whole(size_t size) {
    auto best = free_.end();
    for (auto r = free_.begin(); r != free_.end(); ++r)
      if (r->size >= size && (best == free_.end() || r->size < best->size)) best = r;
    if (best == free_.end()) return nullptr;
    char* p = best->at;
    best->at += size;
    best->size -= size;
    if (best->size == 0) free_.erase(best);
    return p;
  }

  // A fresh mapping of `size` bytes whose pages are the held ones, largest ranges first, and new ones after them.
  char* assemble(size_t size) {
    char* p = reserve(size);
    size_t filled = 0;
    while (filled < size && !free_.empty()) {
      auto r = std::max_element(free_.begin(), free_.end(),
                                [](const Range& a, const Range& b) { return a.size < b.size; });
      size_t piece = std::min(r->size, size - filled);
      if (mremap(r->at, piece, piece, MREMAP_MAYMOVE | MREMAP_FIXED, p + filled) == MAP_FAILED) break;
      r->at += piece;
      r->size -= piece;
      filled += piece;
      moved_++;
      if (r->size == 0) free_.erase(r);
    }
    held_ += size - filled;
    return p;
  }

  // `size` bytes of address space aligned to PAGE, readable and writable, not yet touched (no memory behind them).
  static char* reserve(size_t size) {
    void* got = mmap(nullptr, size + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(got != MAP_FAILED, "rpt page pool: could not map ", size, " bytes");
    char* start = static_cast<char*>(got);
    char* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(start) + PAGE - 1) & ~uintptr_t(PAGE - 1));
    if (p > start) munmap(start, p - start);
    munmap(p + size, start + size + PAGE - (p + size));
    return p;
  }

  // Hold a freed block's pages, joined to a held range that it extends.
  void hold_pages(char* p, size_t size) {
    used_ -= size;
    for (auto r = free_.begin(); r != free_.end(); ++r) {
      if (p + size == r->at) {
        r->at = p;
        r->size += size;
        return;
      }
      if (r->at + r->size == p) {
        r->size += size;
        for (auto s = free_.begin(); s != free_.end(); ++s)
          if (s->at == r->at + r->size) {
            r->size += s->size;
            free_.erase(s);
            break;
          }
        return;
      }
    }
    free_.push_back({p, size});
  }

  c10::Allocator* small_;
  size_t threshold_;
  std::mutex lock_;
  std::vector<Range> free_;                   // held pages no block uses (a few dozen ranges)
  std::unordered_map<void*, size_t> in_use_;  // block -> its bytes
  size_t used_ = 0, held_ = 0, high_water_ = 0;
  int64_t moved_ = 0;  // held ranges moved into fresh mappings
};

PagePool* pool = nullptr;  // never deleted: blocks may be freed until the process ends

void PagePool::release(void* p) {
  std::unique_lock<std::mutex> hold(pool->lock_);
  auto found = pool->in_use_.find(p);
  if (found == pool->in_use_.end()) {  // a small block given out by raw_allocate: the replaced allocator's
    hold.unlock();
    pool->small_->raw_deleter()(p);
    return;
  }
  size_t size = found->second;
  pool->in_use_.erase(found);
  pool->hold_pages(static_cast<char*>(p), size);
}
#endif

// Make the pool the CPU allocator of this process for blocks of `threshold` bytes and more (once; later calls keep
// the first threshold). False where there is no pool (not Linux).
bool use_page_pool(int64_t threshold) {
#ifdef __linux__
  static std::mutex once;
  std::lock_guard<std::mutex> hold(once);
  if (pool == nullptr) {
    pool = new PagePool(c10::GetCPUAllocator(), size_t(threshold));
    c10::SetCPUAllocator(pool, /*priority=*/100);
  }
  return true;
#else
  return false;
#endif
}

// [bytes in use, bytes held, most bytes ever in use, held ranges moved into fresh mappings]; empty before
// use_page_pool.
std::vector<int64_t> page_pool_stats() {
#ifdef __linux__
  if (pool != nullptr) return pool->stats();
#endif
  return {};
}

}  // namespace
}  // namespace rpt_native

TORCH_LIBRARY_FRAGMENT(rpt_loops, m) {
  m.def("use_page_pool(int threshold) -> bool", &rpt_native::use_page_pool);
  m.def("page_pool_stats() -> int[]", &rpt_native::page_pool_stats);
}
