#ifndef KVOFFLOAD_CC_KEYS_KEY_TABLES_H_
#define KVOFFLOAD_CC_KEYS_KEY_TABLES_H_

// Tables of int64 values indexed by keys, as kvoffload.jobs.accesses keeps them (per key,
// the job that last touched it). Work over kThreadedKeys keys or more is split over up to
// max_threads threads: at most 4; 0 picks up to 4 and no more than the machine's cores.

#include <cstdint>
#include <vector>

namespace kvoffload {

constexpr int64_t kThreadedKeys = int64_t{1} << 16;

// Borrowed arrays: a table values[0, size) and keys[0, count) into it.
struct KeyedTable {
  int64_t* values = nullptr;
  int64_t size = 0;
  const int64_t* keys = nullptr;
  int64_t count = 0;
  const char* name = "keys";  // in errors
};

// The index of the first key outside [0, t.size), or -1 when there is none.
int64_t FirstKeyOutside(const KeyedTable& t, int max_threads = 0);

// a.values[a.keys] = value and b.values[b.keys] = value (b may be {}): both or, when a key
// is outside its table, neither: throws std::out_of_range naming the first such key, of
// a before b.
void FillTables(const KeyedTable& a, const KeyedTable& b, int64_t value, int max_threads = 0);

// The distinct values >= since of t.values[t.keys], ascending. Throws std::out_of_range
// as FillTables does.
std::vector<int64_t> ValuesSince(const KeyedTable& t, int64_t since, int max_threads = 0);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_KEYS_KEY_TABLES_H_
