#ifndef KVOFFLOAD_CC_COPY_DIRECTION_H_
#define KVOFFLOAD_CC_COPY_DIRECTION_H_

// Which way a copy goes, in every layer of the core.

#include <cstdint>

namespace kvoffload {

// Which way a copy moves bytes between host and device memory (kvoffload.Direction).
enum class Direction : uint8_t {
  kStore = 0,  // device -> host
  kLoad = 1,   // host -> device
};

// The host side of a copy's (src, dst) this way; DeviceOf the other.
template <typename T>
constexpr T& HostOf(Direction direction, T& src, T& dst) {
  return direction == Direction::kLoad ? src : dst;
}

template <typename T>
constexpr T& DeviceOf(Direction direction, T& src, T& dst) {
  return direction == Direction::kLoad ? dst : src;
}

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_DIRECTION_H_
