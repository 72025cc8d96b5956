#include "cc/keys/key_tables.h"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>

#include "cc/util/worker_pool.h"

namespace kvoffload {
namespace {

// Runs work(s, begin, end) on each of `slices` slices s of [0, length).
template <typename Work>
void InSlices(int slices, int64_t length, const Work& work) {
  RunSlices(slices, [&](int s) {
    const SliceBounds bounds = SliceOf(length, slices, s);
    work(s, bounds.begin, bounds.end);
  });
}

int Slices(int64_t keys, int max_threads) { return SlicesFor(keys, kThreadedKeys, max_threads); }

void RequireInside(const KeyedTable& t, int max_threads) {
  const int64_t i = FirstKeyOutside(t, max_threads);
  if (i < 0) return;
  throw std::out_of_range(std::string(t.name) + "[" + std::to_string(i) + "] = " + std::to_string(t.keys[i]) +
                          " is outside the table of " + std::to_string(t.size));
}

// t.values[k] = value for the keys k in [begin, end), clamped to the table. Keys are
// checked again as they are read: the caller's arrays may change after RequireInside
// (the GIL is released, and a table may be another call's keys).
void FillRange(const KeyedTable& t, int64_t begin, int64_t end, int64_t value) {
  begin = std::max<int64_t>(begin, 0);
  end = std::min(end, t.size);
  if (begin >= end) return;
  // Locals: with t's fields reloaded after every store, GCC 12 branches instead of cmov.
  int64_t* values = t.values;
  const int64_t* keys = t.keys;
  const int64_t count = t.count;
  int64_t elsewhere;  // where keys outside the range are written: no branch to mispredict
  const uint64_t width = end - begin;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t k = keys[i];
    *(static_cast<uint64_t>(k - begin) < width ? values + k : &elsewhere) = value;
  }
}

void SortUnique(std::vector<int64_t>& values) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
}

std::vector<int64_t> DistinctSince(const KeyedTable& t, int64_t begin, int64_t end, int64_t since) {
  // Values seen lately, one slot each by their low bits: job numbers near one another
  // get slots of their own, so `found` stays about as short as the answer. Slot i starts
  // with a value of another slot, which no value can match.
  std::array<int64_t, 256> seen;
  for (size_t i = 0; i < seen.size(); ++i) seen[i] = static_cast<int64_t>(i) + 1;
  std::vector<int64_t> found;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t k = t.keys[i];
    if (static_cast<uint64_t>(k) >= static_cast<uint64_t>(t.size)) continue;  // as in FillRange
    const int64_t v = t.values[k];
    int64_t& slot = seen[static_cast<uint64_t>(v) % seen.size()];
    if (v < since || slot == v) continue;
    slot = v;
    found.push_back(v);
  }
  SortUnique(found);
  return found;
}

}  // namespace

int64_t FirstKeyOutside(const KeyedTable& t, int max_threads) {
  std::array<int64_t, kMaxSlices> first;
  first.fill(-1);
  InSlices(Slices(t.count, max_threads), t.count, [&](int s, int64_t begin, int64_t end) {
    int64_t i = begin;
    while (i < end && static_cast<uint64_t>(t.keys[i]) < static_cast<uint64_t>(t.size)) ++i;
    if (i < end) first[s] = i;
  });
  for (int64_t i : first) {
    if (i >= 0) return i;
  }
  return -1;
}

void FillTables(const KeyedTable& a, const KeyedTable& b, int64_t value, int max_threads) {
  RequireInside(a, max_threads);
  RequireInside(b, max_threads);
  // Each slice owns a range of the entries of a then b, and writes the keys that fall in
  // it. Slicing the keys instead has threads write the same cache lines, about twice as
  // slow.
  InSlices(Slices(a.count + b.count, max_threads), a.size + b.size,
           [&](int, int64_t begin, int64_t end) {
             FillRange(a, begin, end, value);
             FillRange(b, begin - a.size, end - a.size, value);
           });
}

std::vector<int64_t> ValuesSince(const KeyedTable& t, int64_t since, int max_threads) {
  RequireInside(t, max_threads);
  std::array<std::vector<int64_t>, kMaxSlices> found;
  InSlices(Slices(t.count, max_threads), t.count, [&](int s, int64_t begin, int64_t end) {
    found[s] = DistinctSince(t, begin, end, since);
  });
  for (int s = 1; s < kMaxSlices; ++s) {
    found[0].insert(found[0].end(), found[s].begin(), found[s].end());
  }
  SortUnique(found[0]);
  return std::move(found[0]);
}

}  // namespace kvoffload
