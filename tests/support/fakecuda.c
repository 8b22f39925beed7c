/* A stand-in for libcuda.so.1: just the calls tests/support/cuda_launcher.py makes, so that the
 * launcher and the real-GPU test's scenario (tests/support/gpucoreloop.py) run where no GPU is.
 *
 * The primary context "opens" the device files a CUDA process holds: nvidiactl, nvidia-uvm and
 * nvidia0 under $FAKECUDA_DEVICES (nothing when unset), and maps nvidia0, as the driver does;
 * a forked child inherits them. $FAKECUDA_FAIL names one call that returns $FAKECUDA_ERROR
 * (default 999, CUDA_ERROR_UNKNOWN); $FAKECUDA_BUS_ID is the PCI bus id reported. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int fail(const char *name) {
    const char *which = getenv("FAKECUDA_FAIL");
    if (which == NULL || strcmp(which, name) != 0) return 0;
    const char *code = getenv("FAKECUDA_ERROR");
    return code ? atoi(code) : 999;
}

static void open_devices(void) {
    const char *dir = getenv("FAKECUDA_DEVICES");
    static const char *names[] = {"nvidiactl", "nvidia-uvm", "nvidia0"};
    char path[4096];
    if (dir == NULL) return;
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd >= 0 && i == 2) mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
    }
}

int cuInit(unsigned flags) { (void)flags; return fail("cuInit"); }

int cuDeviceGet(int *device, int ordinal) {
    if (ordinal != 0) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *device = 0;
    return fail("cuDeviceGet");
}

int cuDevicePrimaryCtxRetain(void **context, int device) {
    (void)device;
    int err = fail("cuDevicePrimaryCtxRetain");
    if (err) return err;
    open_devices();
    *context = (void *)0x1;
    return 0;
}

int cuCtxSetCurrent(void *context) { (void)context; return fail("cuCtxSetCurrent"); }

int cuMemAlloc_v2(unsigned long long *pointer, size_t bytes) {
    (void)bytes;
    *pointer = 0x100000;
    return fail("cuMemAlloc_v2");
}

int cuMemsetD8_v2(unsigned long long pointer, unsigned char value, size_t count) {
    (void)pointer; (void)value; (void)count;
    return fail("cuMemsetD8_v2");
}

int cuCtxSynchronize(void) { return fail("cuCtxSynchronize"); }

int cuDeviceGetPCIBusId(char *bus, int length, int device) {
    const char *given = getenv("FAKECUDA_BUS_ID");
    (void)device;
    snprintf(bus, (size_t)length, "%s", given ? given : "0000:18:00.0");
    return fail("cuDeviceGetPCIBusId");
}

int cuDeviceGetUuid(unsigned char uuid[16], int device) {
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xA0 + i + device);
    return fail("cuDeviceGetUuid");
}

int cuGetErrorName(int error, const char **name) {
    *name = error == 999 ? "CUDA_ERROR_UNKNOWN" : error == 2 ? "CUDA_ERROR_OUT_OF_MEMORY"
          : error == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_OTHER";
    return 0;
}
