#ifndef KVOFFLOAD_CC_CUDA_CUDA_ERROR_H_
#define KVOFFLOAD_CC_CUDA_CUDA_ERROR_H_

// The core's CUDA failures as exceptions that carry the error's name (kvoffload.CudaError,
// kvoffload.NoCudaDeviceError).

#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvoffload {

// A failed CUDA call. what() reads "<call>: <error name> (<code>)[ at copy <i>]: <text>".
class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& call, const std::string& name, int code, int64_t copy_index = -1,
            const std::string& text = "")
      : std::runtime_error(call + ": " + name + " (" + std::to_string(code) + ")" +
                           (copy_index >= 0 ? " at copy " + std::to_string(copy_index) : "") +
                           (text.empty() ? "" : ": " + text)),
        name_(name),
        code_(code),
        copy_index_(copy_index) {}

  const std::string& name() const { return name_; }
  int code() const { return code_; }
  int64_t copy_index() const { return copy_index_; }

 private:
  std::string name_;
  int code_;
  int64_t copy_index_;
};

// No GPU or no driver: a CudaError whose message starts with "no CUDA device".
class NoCudaDeviceError : public CudaError {
 public:
  using CudaError::CudaError;
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_CUDA_CUDA_ERROR_H_
