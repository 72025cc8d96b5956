#ifndef KVOFFLOAD_CC_MEMORY_MEMORY_MAP_H_
#define KVOFFLOAD_CC_MEMORY_MEMORY_MAP_H_

// What memory an address is to the driver (MemoryKind), remembered per range for one batch
// (MemoryMap), so the driver is asked once per allocation.

#include <cstdint>
#include <functional>
#include <map>

namespace kvoffload {

// What memory an address is, as far as a kernel is concerned.
enum class MemoryKind : uint8_t {
  kUnknown,  // the driver does not know it: pageable host memory, or nothing
  kHost,     // page-locked host memory
  kDevice,   // device or managed memory
};

// What the driver says of one address: its kind, the device of device memory, and the
// allocation holding it (range_size 0 where it gives no range).
struct PointerAttributes {
  MemoryKind kind = MemoryKind::kUnknown;
  int ordinal = -1;
  int64_t range_start = 0;
  int64_t range_size = 0;
};

// Addresses up to `end` (exclusive), from a first address the map keeps, are this memory.
struct Memory {
  int64_t end = 0;
  MemoryKind kind = MemoryKind::kUnknown;
  int ordinal = -1;  // the device of device memory
};

// What the driver says of addresses, remembered per range for the length of one batch:
// `query` runs once per allocation, or once per 4 KiB host page where it gives no range.
class MemoryMap {
 public:
  using Query = std::function<PointerAttributes(int64_t address)>;

  explicit MemoryMap(Query query);

  // The memory holding `address` (valid until the next call).
  const Memory& At(int64_t address);

 private:
  std::map<int64_t, Memory>::iterator Learn(int64_t address);

  Query query_;
  std::map<int64_t, Memory> known_;  // by first address
  const Memory* last_ = nullptr;     // the range found last, and its first address
  int64_t last_start_ = 0;
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_MEMORY_MEMORY_MAP_H_
