// Library identification and error strings.
#include <cuda_runtime.h>

#include "fmoe_native.h"

extern "C" const char *fmoe_native_version(void) { return "fmoe_native 0.3.0"; }

extern "C" const char *fmoe_native_error_string(int code) {
  switch (code) {
    case 0: return "ok";
    case FMOE_ERR_BAD_SHAPE: return "fmoe_native: invalid shape";
    case FMOE_ERR_BAD_DTYPE: return "fmoe_native: unsupported dtype";
    case FMOE_ERR_BAD_FORMAT: return "fmoe_native: unsupported weight format";
    case FMOE_ERR_BAD_ARGUMENT: return "fmoe_native: invalid argument (a NULL data pointer)";
    case FMOE_ERR_MISALIGNED: return "fmoe_native: a pointer is not 16-byte aligned";
    default: return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}
