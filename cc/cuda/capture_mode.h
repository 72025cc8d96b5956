#ifndef KVOFFLOAD_CC_CUDA_CAPTURE_MODE_H_
#define KVOFFLOAD_CC_CUDA_CAPTURE_MODE_H_

// RelaxedCaptureMode: this thread's stream-capture mode relaxed for a scope (RAII), for the
// calls that must not break another thread's graph capture.

#include <cuda_runtime_api.h>

#include "cc/cuda/cuda_check.h"

namespace kvoffload {

// This thread's stream-capture mode relaxed for the scope: its calls (event queries,
// waits, frees, unregistrations) are not refused because another thread captures a graph
// in global mode (torch.cuda.graph's default), and so do not invalidate that capture.
// The mode it had comes back at the end of the scope, however the scope ends.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() {
    CheckCuda(cudaThreadExchangeStreamCaptureMode(&mode_), "cudaThreadExchangeStreamCaptureMode");
  }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_CUDA_CAPTURE_MODE_H_
