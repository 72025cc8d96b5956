#ifndef KVOFFLOAD_CC_UTIL_RECYCLED_BUFFER_H_
#define KVOFFLOAD_CC_UTIL_RECYCLED_BUFFER_H_

// int64 arrays whose memory is kept for the next one. A job's ids and keys are
// megabytes, and fresh memory from the system costs a page fault per 4 KiB: for a 1 GiB
// job of 4 KiB pages that was three times the work of checking and keying its ids.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace kvoffload {

// Freed arrays, kept up to kKeptBytes; taking one picks the smallest that is large enough
// and at most twice the size asked for (a small array must not hold a large one).
class BufferRecycler {
 public:
  static constexpr size_t kMinBytes = size_t{64} << 10;  // smaller ones: malloc reuses them
  static constexpr size_t kKeptBytes = size_t{128} << 20;

  static BufferRecycler& Instance() {
    static BufferRecycler* recycler = new BufferRecycler();  // never destroyed: outlives every buffer
    return *recycler;
  }

  // An array of at least `size` elements (its capacity).
  std::pair<std::unique_ptr<int64_t[]>, size_t> Take(size_t size) {
    if (size * sizeof(int64_t) >= kMinBytes) {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        const bool fits = free_[i].second >= size && free_[i].second <= 2 * size;
        if (fits && (best == free_.size() || free_[i].second < free_[best].second)) {
          best = i;
        }
      }
      if (best != free_.size()) {
        auto taken = std::move(free_[best]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        kept_bytes_ -= taken.second * sizeof(int64_t);
        return taken;
      }
    }
    return {std::unique_ptr<int64_t[]>(new int64_t[size == 0 ? 1 : size]), size};
  }

  // Runs in destructors: never throws (an array it cannot keep is freed).
  void Give(std::unique_ptr<int64_t[]> data, size_t capacity) noexcept {
    const size_t bytes = capacity * sizeof(int64_t);
    if (data == nullptr || bytes < kMinBytes || bytes > kKeptBytes) return;
    std::lock_guard<std::mutex> lock(mu_);
    while (!free_.empty() && kept_bytes_ + bytes > kKeptBytes) {  // the oldest go first
      kept_bytes_ -= free_.front().second * sizeof(int64_t);
      free_.erase(free_.begin());
    }
    try {
      free_.emplace_back(std::move(data), capacity);
    } catch (const std::bad_alloc&) {
      return;  // data, still ours unless moved in, is freed
    }
    kept_bytes_ += bytes;
  }

  size_t kept_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return kept_bytes_;
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<std::unique_ptr<int64_t[]>, size_t>> free_;
  size_t kept_bytes_ = 0;
};

// `size` int64s, uninitialised, from the recycler and back to it.
class RecycledBuffer {
 public:
  RecycledBuffer() = default;
  explicit RecycledBuffer(size_t size) : size_(size) {
    std::tie(data_, capacity_) = BufferRecycler::Instance().Take(size);
  }
  RecycledBuffer(const int64_t* values, size_t size) : RecycledBuffer(size) {
    std::copy(values, values + size, data_.get());
  }
  RecycledBuffer(RecycledBuffer&& other) noexcept
      : data_(std::move(other.data_)),
        size_(std::exchange(other.size_, 0)),
        capacity_(std::exchange(other.capacity_, 0)) {}
  RecycledBuffer& operator=(RecycledBuffer&& other) noexcept {
    if (this == &other) return *this;
    Release();
    data_ = std::move(other.data_);
    size_ = std::exchange(other.size_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
    return *this;
  }
  ~RecycledBuffer() { Release(); }

  int64_t* data() { return data_.get(); }
  const int64_t* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  void Release() {
    if (data_ != nullptr) BufferRecycler::Instance().Give(std::move(data_), capacity_);
    size_ = capacity_ = 0;
  }

  std::unique_ptr<int64_t[]> data_;
  size_t size_ = 0, capacity_ = 0;
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_UTIL_RECYCLED_BUFFER_H_
