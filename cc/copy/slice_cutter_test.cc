// SliceCutter against a reference that lays the copies end to end in host order and cuts
// that stream at every slot edge, on random batches of both directions.

#include "cc/copy/slice_cutter.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "cc/copy/copy_batch.h"
#include "cc/util/test_checks.h"

namespace kvoffload {

// In kvoffload, where std::vector<Slice>'s == finds it.
bool operator==(const Slice& a, const Slice& b) {
  return a.dma_src == b.dma_src && a.dma_dst == b.dma_dst && a.dma_size == b.dma_size &&
         a.piece_src == b.piece_src && a.piece_dst == b.piece_dst && a.piece_size == b.piece_size;
}

namespace {

struct Batch {
  std::vector<int64_t> src, dst, size;
  CopyBatch View() const {
    return CopyBatch{src.data(), dst.data(), size.data(), static_cast<int64_t>(size.size())};
  }
};

// Host memory registered in ranges of `edge` bytes (0: one range).
SliceCutter::RangeEnd Ranges(int64_t edge) {
  if (edge == 0) return nullptr;
  return [edge](int64_t address) { return (address / edge + 1) * edge; };
}

std::vector<Slice> Cut(const Batch& b, bool load, int64_t slot_bytes, int64_t piece_bytes,
                       int64_t edge = 0) {
  SliceCutter cutter(b.View(), load ? Direction::kLoad : Direction::kStore, slot_bytes, piece_bytes, Ranges(edge));
  std::vector<Slice> slices;
  Slice s;
  s.dma_size = {123};  // stale entries must go
  s.piece_size = {456};
  while (cutter.Next(s)) slices.push_back(s);
  EXPECT(s == Slice{});   // the last call leaves no stale slice behind
  EXPECT(!cutter.Next(s));  // and the cutter stays done
  return slices;
}

// Stream byte p (in 128 bits: the copies may add up past INT64_MAX) lies in slice
// p / slot_bytes at slot offset p % slot_bytes. Within a slice, a copy's bytes are cut
// into piece_bytes from where the copy (or the slice) starts; host-contiguous neighbours
// in a slice share a host run, unless a new copy would take the run past the end
// of the `edge`-byte range where the run starts.
std::vector<Slice> ReferenceSlices(const Batch& b, bool load, int64_t slot_bytes,
                                   int64_t piece_bytes, int64_t edge = 0) {
  const std::vector<int64_t>& host = load ? b.src : b.dst;
  const std::vector<int64_t>& device = load ? b.dst : b.src;
  std::vector<size_t> order(b.size.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return host[x] < host[y]; });
  struct Piece {
    int64_t host, device, slot, size;
    bool copy_start;
  };
  std::vector<std::vector<Piece>> pieces;
  __int128 at = 0;
  for (size_t i : order) {
    const __int128 end = at + b.size[i];
    for (__int128 start = at; start < end;) {
      const __int128 slice = start / slot_bytes;
      const __int128 run_end = std::min(end, (slice + 1) * slot_bytes);
      if (pieces.size() <= slice) pieces.resize(static_cast<size_t>(slice) + 1);
      for (__int128 p = start; p < run_end; p += piece_bytes) {
        const int64_t offset = static_cast<int64_t>(p - at);
        pieces[slice].push_back({host[i] + offset, device[i] + offset,
                                 static_cast<int64_t>(p - slice * slot_bytes),
                                 static_cast<int64_t>(std::min<__int128>(piece_bytes, run_end - p)),
                                 offset == 0});
      }
      start = run_end;
    }
    at = end;
  }
  std::vector<Slice> slices;
  for (const std::vector<Piece>& in : pieces) {
    Slice s;
    std::vector<int64_t> dma_host, dma_slot;
    for (const Piece& p : in) {
      if (!dma_host.empty() && dma_host.back() + s.dma_size.back() == p.host &&
          (edge == 0 || !p.copy_start || p.host / edge == dma_host.back() / edge)) {
        s.dma_size.back() += p.size;
      } else {
        dma_host.push_back(p.host);
        dma_slot.push_back(p.slot);
        s.dma_size.push_back(p.size);
      }
      (load ? s.piece_src : s.piece_dst).push_back(p.slot);
      (load ? s.piece_dst : s.piece_src).push_back(p.device);
      s.piece_size.push_back(p.size);
    }
    (load ? s.dma_src : s.dma_dst) = dma_host;
    (load ? s.dma_dst : s.dma_src) = dma_slot;
    slices.push_back(s);
  }
  return slices;
}

// What holds however copies with the same host address are ordered: slices are full but
// the last, pieces fill the slot in order, host runs are maximal and say where each
// piece's host bytes are, and every byte of every copy moves exactly once.
void CheckProperties(const Batch& b, bool load, int64_t slot_bytes, int64_t piece_bytes,
                     const std::vector<Slice>& slices) {
  const std::vector<int64_t>& host = load ? b.src : b.dst;
  const std::vector<int64_t>& device = load ? b.dst : b.src;
  std::vector<int64_t> moved(b.size.size(), 0);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> covered(b.size.size());
  int64_t last_copy_host = INT64_MIN;
  for (size_t k = 0; k < slices.size(); ++k) {
    const Slice& s = slices[k];
    const std::vector<int64_t>& dma_host = load ? s.dma_src : s.dma_dst;
    const std::vector<int64_t>& dma_slot = load ? s.dma_dst : s.dma_src;
    const std::vector<int64_t>& piece_slot = load ? s.piece_src : s.piece_dst;
    const std::vector<int64_t>& piece_device = load ? s.piece_dst : s.piece_src;
    EXPECT(dma_host.size() == s.dma_size.size() && dma_slot.size() == s.dma_size.size());
    EXPECT(piece_slot.size() == s.piece_size.size() && piece_device.size() == s.piece_size.size());
    int64_t used = 0;
    for (size_t j = 0; j < s.piece_size.size(); ++j) {
      EXPECT(piece_slot[j] == used);
      EXPECT(s.piece_size[j] > 0 && s.piece_size[j] <= piece_bytes);
      used += s.piece_size[j];
    }
    EXPECT(used > 0 && used <= slot_bytes);
    if (k + 1 < slices.size()) EXPECT(used == slot_bytes);
    int64_t dma_at = 0;
    for (size_t r = 0; r < s.dma_size.size(); ++r) {
      EXPECT(dma_slot[r] == dma_at && s.dma_size[r] > 0);
      if (r > 0) EXPECT(dma_host[r - 1] + s.dma_size[r - 1] != dma_host[r]);  // maximal
      dma_at += s.dma_size[r];
    }
    EXPECT(dma_at == used);
    size_t r = 0;
    for (size_t j = 0; j < s.piece_size.size() && r < s.dma_size.size(); ++j) {
      while (r < s.dma_size.size() && dma_slot[r] + s.dma_size[r] <= piece_slot[j]) ++r;
      if (r == s.dma_size.size()) break;
      EXPECT(piece_slot[j] + s.piece_size[j] <= dma_slot[r] + s.dma_size[r]);
      const int64_t piece_host = dma_host[r] + (piece_slot[j] - dma_slot[r]);
      // The copy the piece belongs to: device blocks do not overlap, so one fits.
      size_t owner = b.size.size();
      for (size_t i = 0; i < b.size.size(); ++i) {
        const int64_t offset = piece_host - host[i];
        if (offset >= 0 && offset <= b.size[i] - s.piece_size[j] &&
            piece_device[j] == device[i] + offset) {
          owner = i;
        }
      }
      EXPECT(owner < b.size.size());
      if (owner == b.size.size()) continue;
      moved[owner] += s.piece_size[j];
      covered[owner].push_back({piece_host - host[owner], s.piece_size[j]});
      if (piece_host == host[owner]) {
        EXPECT(host[owner] >= last_copy_host);  // copies go in host order
        last_copy_host = host[owner];
      }
    }
  }
  for (size_t i = 0; i < b.size.size(); ++i) {
    std::sort(covered[i].begin(), covered[i].end());
    int64_t at = 0;
    for (const auto& [offset, size] : covered[i]) {
      EXPECT(offset == at);
      at = offset + size;
    }
    EXPECT(at == b.size[i] && moved[i] == b.size[i]);
  }
}

// Copies in host runs (neighbours contiguous or not, sometimes sharing a host address)
// onto disjoint device blocks, listed in host order or shuffled.
Batch MakeBatch(std::mt19937_64& rng, int64_t piece_bytes, bool ties, bool shuffle) {
  Batch b;
  const int count = rng() % 30;
  int64_t host_at = 4096 * (1 + rng() % 1000), device_at = int64_t{1} << 40;
  for (int i = 0; i < count; ++i) {
    const int64_t k = rng() % 3;
    int64_t size;
    switch (rng() % 3) {
      case 0:
        size = std::max<int64_t>(1, k * piece_bytes + static_cast<int64_t>(rng() % 3) - 1);
        break;
      default:
        size = 1 + rng() % (3 * piece_bytes);
    }
    if (ties && i > 0 && rng() % 3 == 0) {
      host_at = b.src[rng() % i];
    } else if (rng() % 3 == 0) {
      host_at += rng() % 512;  // a gap
    }
    b.src.push_back(host_at);  // the host side; swapped below for stores
    b.dst.push_back(device_at);
    b.size.push_back(size);
    host_at += size;
    device_at += size + 16 * (rng() % 8);
  }
  if (shuffle) {
    std::vector<size_t> order(b.size.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    Batch shuffled;
    for (size_t i : order) {
      shuffled.src.push_back(b.src[i]);
      shuffled.dst.push_back(b.dst[i]);
      shuffled.size.push_back(b.size[i]);
    }
    b = shuffled;
  }
  return b;
}

void TestRandomBatchesMatchReference(std::mt19937_64& rng) {
  int exact = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const int64_t piece_bytes = rng() % 4 == 0 ? 64 << 10 : 1 + rng() % 200;
    int64_t slot_bytes;
    switch (rng() % 4) {
      case 0:
        slot_bytes = piece_bytes * (1 + rng() % 4);  // slot edges on piece edges
        break;
      case 1:
        slot_bytes = 256 * (16 + rng() % 64);  // as StagedCopy allows
        break;
      default:
        slot_bytes = 1 + rng() % 700;
    }
    const bool ties = rng() % 3 == 0, shuffle = rng() % 2 == 0, load = rng() % 2 == 0;
    Batch b = MakeBatch(rng, piece_bytes, ties, shuffle);
    if (!load) std::swap(b.src, b.dst);
    ValidateCopyBatch(b.View());
    const int64_t edge = rng() % 2 == 0 ? 0 : 1 + rng() % 300;
    const std::vector<Slice> got = Cut(b, load, slot_bytes, piece_bytes, edge);
    if (edge == 0) CheckProperties(b, load, slot_bytes, piece_bytes, got);
    // With equal host addresses in a shuffled batch their order is unspecified.
    const std::vector<int64_t>& host = load ? b.src : b.dst;
    std::vector<int64_t> sorted(host);
    std::sort(sorted.begin(), sorted.end());
    const bool distinct = std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
    if (distinct || std::is_sorted(host.begin(), host.end())) {
      ++exact;
      EXPECT(got == ReferenceSlices(b, load, slot_bytes, piece_bytes, edge));
    }
  }
  EXPECT(exact > 2500);  // most trials are compared exactly
}

void TestExamples() {
  // A load: copy 0 fills slice 0 in three pieces and one host run; copies 1 and 2 share
  // slice 1, in two host runs since their host bytes do not touch.
  Batch b{{1000, 1100, 2000}, {5000, 9000, 7000}, {100, 30, 50}};
  std::vector<Slice> s = Cut(b, true, 100, 40);
  EXPECT(s.size() == 2);
  if (s.size() == 2) {
    EXPECT((s[0].dma_src == std::vector<int64_t>{1000} && s[0].dma_dst == std::vector<int64_t>{0} &&
            s[0].dma_size == std::vector<int64_t>{100}));
    EXPECT((s[0].piece_src == std::vector<int64_t>{0, 40, 80} &&
            s[0].piece_dst == std::vector<int64_t>{5000, 5040, 5080} &&
            s[0].piece_size == std::vector<int64_t>{40, 40, 20}));
    EXPECT((s[1].dma_src == std::vector<int64_t>{1100, 2000} &&
            s[1].dma_dst == std::vector<int64_t>{0, 30} && s[1].dma_size == std::vector<int64_t>{30, 50}));
    EXPECT((s[1].piece_src == std::vector<int64_t>{0, 30, 70} &&
            s[1].piece_dst == std::vector<int64_t>{9000, 7000, 7040} &&
            s[1].piece_size == std::vector<int64_t>{30, 40, 10}));
  }
  // The same as a store, listed backwards: host order still decides, the arrays swap.
  b = Batch{{7000, 9000, 5000}, {2000, 1100, 1000}, {50, 30, 100}};
  const std::vector<Slice> stored = Cut(b, false, 100, 40);
  EXPECT(stored.size() == 2);
  if (stored.size() == 2) {
    EXPECT((stored[0].dma_dst == std::vector<int64_t>{1000} && stored[0].dma_src == std::vector<int64_t>{0}));
    EXPECT((stored[0].piece_dst == std::vector<int64_t>{0, 40, 80} &&
            stored[0].piece_src == std::vector<int64_t>{5000, 5040, 5080}));
    EXPECT((stored[1].dma_dst == std::vector<int64_t>{1100, 2000} &&
            stored[1].piece_src == std::vector<int64_t>{9000, 7000, 7040}));
  }
  // Host-contiguous copies in one slice: one host run, a piece each.
  b = Batch{{0x10000, 0x10000 + 1000}, {1 << 30, 1 << 20}, {1000, 500}};
  s = Cut(b, true, 4096, 1024);
  EXPECT(s.size() == 1 && s[0].dma_size == std::vector<int64_t>{1500} &&
         s[0].piece_size == (std::vector<int64_t>{1000, 500}));
  // A copy exactly one slot long, then one exactly two: slices end on the copies' ends.
  b = Batch{{4096, 8192}, {1 << 20, 1 << 21}, {4096, 8192}};
  s = Cut(b, true, 4096, 1 << 16);
  EXPECT(s.size() == 3);
  for (const Slice& x : s) EXPECT(x.piece_size == std::vector<int64_t>{4096});
  // Nothing to cut.
  EXPECT(Cut(Batch{}, true, 4096, 1024).empty());
}

void TestNearInt64Max() {
  // One copy of INT64_MAX - 1 bytes in a slot and piece that large.
  Batch b{{1}, {1}, {INT64_MAX - 1}};
  std::vector<Slice> s = Cut(b, true, INT64_MAX, INT64_MAX);
  EXPECT(s.size() == 1 && s[0].piece_size == std::vector<int64_t>{INT64_MAX - 1} &&
         s[0].dma_size == std::vector<int64_t>{INT64_MAX - 1});
  // Two copies that together pass INT64_MAX bytes, in half-range pieces and slots.
  const int64_t half = INT64_MAX / 2;
  b = Batch{{2, 1}, {1, 2}, {INT64_MAX - 2, INT64_MAX - 2}};
  for (bool load : {true, false}) {
    s = Cut(b, load, half, half);
    EXPECT(s == ReferenceSlices(b, load, half, half));
    CheckProperties(b, load, half, half, s);
    EXPECT(s.size() == 4);  // 2 * (INT64_MAX - 2) bytes in slots of INT64_MAX / 2
  }
  // Host runs that end at INT64_MAX merge, in host order.
  b = Batch{{INT64_MAX - 10, INT64_MAX - 30}, {100, 200}, {10, 20}};
  s = Cut(b, true, 4096, 1024);
  EXPECT(s.size() == 1 && s[0].dma_src == std::vector<int64_t>{INT64_MAX - 30} &&
         s[0].dma_size == std::vector<int64_t>{30} &&
         s[0].piece_dst == (std::vector<int64_t>{200, 100}));
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(31337);
  kvoffload::TestRandomBatchesMatchReference(rng);
  kvoffload::TestExamples();
  kvoffload::TestNearInt64Max();
  return kvoffload::TestResult("slice_cutter_test");
}
