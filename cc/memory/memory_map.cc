#include "cc/memory/memory_map.h"

#include <cstdint>
#include <iterator>
#include <map>
#include <utility>

namespace kvoffload {
namespace {

constexpr int64_t kHostPage = 4096;

}  // namespace

MemoryMap::MemoryMap(Query query) : query_(std::move(query)) {}

const Memory& MemoryMap::At(int64_t address) {
  if (last_ != nullptr && last_start_ <= address && address < last_->end) return *last_;
  auto it = known_.upper_bound(address);
  if (it == known_.begin() || address >= std::prev(it)->second.end) it = Learn(address);
  else --it;
  last_start_ = it->first;
  last_ = &it->second;
  return *last_;
}

std::map<int64_t, Memory>::iterator MemoryMap::Learn(int64_t address) {
  const PointerAttributes answer = query_(address);
  Memory memory;
  memory.kind = answer.kind;
  memory.ordinal = answer.ordinal;
  int64_t first = address & ~(kHostPage - 1);
  // The last page of the address space ends at INT64_MAX rather than past it.
  memory.end = first <= INT64_MAX - kHostPage ? first + kHostPage : INT64_MAX;
  if (answer.range_size > 0 && answer.range_start <= address &&
      address - answer.range_start < answer.range_size) {
    first = answer.range_start;
    memory.end = answer.range_start + answer.range_size;
  }
  return known_.insert_or_assign(first, memory).first;
}

}  // namespace kvoffload
