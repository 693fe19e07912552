/* A libcuda.so.1 for machines without the NVIDIA driver, so that SGLang runs on CPU there.
 *
 * SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports sgl_kernel, whose common_ops links against
 * libcuda.so.1; without a driver that import fails. This library is found first (its directory leads
 * LD_LIBRARY_PATH) and answers every call with CUDA_ERROR_NO_DEVICE, so torch.cuda.is_available() is
 * False and SGLang picks its CPU paths. Never use it on a host that has the driver. */

#define CUDA_ERROR_NO_DEVICE 100

typedef int CUresult;

static const char message[] = "no CUDA driver on this machine (hotweights' stand-in libcuda.so.1)";

CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDriverGetVersion(int *version) { (void)version; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGetCount(int *count) { (void)count; return CUDA_ERROR_NO_DEVICE; }

CUresult cuGetProcAddress(const char *symbol, void **fn, int version, unsigned long long flags) {
    (void)symbol; (void)version; (void)flags;
    if (fn) *fn = 0;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, unsigned long long flags, int *status) {
    (void)symbol; (void)version; (void)flags; (void)status;
    if (fn) *fn = 0;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long pointer) {
    (void)data; (void)attribute; (void)pointer;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetErrorString(CUresult error, const char **text) { (void)error; if (text) *text = message; return 0; }
CUresult cuGetErrorName(CUresult error, const char **text) {
    (void)error;
    if (text) *text = "CUDA_ERROR_NO_DEVICE";
    return 0;
}
