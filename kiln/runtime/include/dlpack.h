/* dlpack.h - DLPack tensor exchange structs, written for kiln.
 *
 * Layout-compatible with the DLPack specification v0.8 (the legacy, unversioned
 * DLManagedTensor that torch.utils.dlpack.to_dlpack / torch.from_dlpack exchange through a
 * PyCapsule named "dltensor", renamed "used_dltensor" once consumed). The include guard is the
 * one the reference header uses so that both can never be defined twice in one translation unit.
 *
 * Invariants (checked by static assertions in libkiln on LP64 platforms):
 *   sizeof(DLDevice) == 8, sizeof(DLDataType) == 4, sizeof(DLTensor) == 48,
 *   sizeof(DLManagedTensor) == 64.
 * shape/strides count elements (not bytes); strides == NULL means compact row-major.
 */
#ifndef DLPACK_DLPACK_H_
#define DLPACK_DLPACK_H_

#include <stddef.h>
#include <stdint.h>

#define DLPACK_VERSION 80
#define DLPACK_ABI_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

/* Kind of memory a tensor lives in. */
typedef enum {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13,
  kDLOneAPI = 14,
  kDLWebGPU = 15,
  kDLHexagon = 16
} DLDeviceType;

/* A device: its type and its ordinal (0 for the CPU). */
typedef struct {
  DLDeviceType device_type;
  int32_t device_id;
} DLDevice;

/* Type code of DLDataType.code. */
typedef enum {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLOpaqueHandle = 3,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
  /* 8-bit floats, from DLPack v1.1 (the codes kiln uses; bits = 8) */
  kDLFloat8_e4m3fn = 10,
  kDLFloat8_e4m3fnuz = 11,
  kDLFloat8_e5m2 = 12,
  kDLFloat8_e5m2fnuz = 13
} DLDataTypeCode;

/* Element type: code (a DLDataTypeCode), bits per lane, number of lanes (1 for scalars). */
typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

/* A borrowed view of a strided tensor. The first element is at (char*)data + byte_offset. */
typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} DLTensor;

/* A tensor together with its owner: whoever holds it calls deleter(self) exactly once. */
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#ifdef __cplusplus
}
#endif
#endif /* DLPACK_DLPACK_H_ */
