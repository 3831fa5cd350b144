// Copy paths from global to shared memory, timed alone: does the path (16-byte cp.async, as the
// generated kernels copy, or cp.async.bulk) bound the DRAM throughput of a streaming decode?
// Each CTA streams its own contiguous region tile by tile through two shared buffers, as the
// dense kernel does, and reads every word of each tile once from shared memory (the consumer).
// 1.08 GB per launch (a dense 32K step), four copies rotated, events around each launch, median
// of 21 after 5 warm-ups. With 64 threads the consumer loop, not the copy, bounds the time.
//
// Modes 3-5 copy each half tile as one box of a 4-d tensor map, as the dense kernel's swizzled
// tensor copies do ([128-byte line, 2 lines, rows, half tiles], 128-byte swizzle), with L2
// promotion of 256 bytes, 128 bytes or none; mode 6 unswizzled ([256-byte row, rows, half tiles],
// 256-byte promotion).
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -o copy_paths benches/gpu/copy_paths.cu -lcuda && ./copy_paths
//
// H200, 2026-11-21 (docs/ptx-backend.md, Staging and copies): 16-byte cp.async into 272-byte
// rows peaks at 4.20 TB/s (128 threads, 3 CTAs/SM, 16-32 KB tiles); a bulk copy per 256-byte
// row at 4.04; bulk copies of contiguous half tiles at 4.40 (2-3 CTAs/SM, 32 KB tiles).
// H200, 2026-11-28: half-tile bulk copies 4.46-4.50 TB/s (3 CTAs/SM, 16-32 KB tiles); tensor
// copies with 128-byte or no L2 promotion the same, 4.43-4.50; with 256-byte promotion (mode 3,
// and mode 6) 4.31 at 16 KB tiles but 4.00-4.04 at 32 KB, 4.10 at 5 CTAs/SM. The runtime's
// tensor maps promote to 128 bytes since (dense f16 decode, batch 8 x 32K: 0.2712 -> 0.2500 ms).
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <iterator>
#include <cuda.h>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(err_)); exit(1);} } while (0)

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// mode 0: cp.async 16 B per thread (padded rows of 256 B -> 272 B). mode 1: cp.async.bulk per 256-B row (padded).
// mode 2: cp.async.bulk per contiguous half tile (unpadded).
// mode 3-6: one tensor copy (cp.async.bulk.tensor) per half tile, issued by thread 0.
template <int MODE>
__global__ void stream(const uint8_t* __restrict__ src, size_t per_cta, int tile_bytes, float* out,
                       const __grid_constant__ CUtensorMap map) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int rows = tile_bytes / 256;
  const int buf_bytes = MODE >= 2 ? tile_bytes : rows * 272;
  // The 128-byte swizzle wants 1024-byte aligned destinations.
  uint8_t* tiles_at = MODE >= 3 ? smem + ((1024 - (smem_addr(smem) & 1023)) & 1023) : smem;
  __shared__ __align__(8) uint64_t bar[2];
  const uint8_t* base = src + blockIdx.x * per_cta;
  int tiles = per_cta / tile_bytes;
  float acc = 0.f;
  if (MODE != 0 && threadIdx.x == 0) {
    for (int s = 0; s < 2; s++) asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(smem_addr(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  auto issue = [&](int t) {
    uint8_t* buf = tiles_at + (t & 1) * buf_bytes;
    const uint8_t* g = base + (size_t)t * tile_bytes;
    if (MODE == 0) {
      for (int c = threadIdx.x; c < tile_bytes / 16; c += blockDim.x) {
        int row = c / 16, part = c % 16;
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" :: "r"(smem_addr(buf + row * 272 + part * 16)), "l"(g + c * 16));
      }
      asm volatile("cp.async.commit_group;");
    } else {
      unsigned b = smem_addr(&bar[t & 1]);
      if (threadIdx.x == 0) asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(b), "r"(tile_bytes));
      __syncwarp();
      if (MODE == 1) {
        for (int r = threadIdx.x; r < rows; r += blockDim.x)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 256, [%2];" :: "r"(smem_addr(buf + r * 272)), "l"(g + r * 256), "r"(b) : "memory");
      } else if (MODE >= 3 && threadIdx.x == 0) {
        int half = tile_bytes / 2;
        int first = (int)((blockIdx.x * per_cta + (size_t)t * tile_bytes) / half);
        for (int h = 0; h < 2; h++) {
          if (MODE == 6)
            asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                         :: "r"(smem_addr(buf + h * half)), "l"(&map), "r"(0), "r"(0), "r"(first + h), "r"(b) : "memory");
          else
            asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                         :: "r"(smem_addr(buf + h * half)), "l"(&map), "r"(0), "r"(0), "r"(0), "r"(first + h), "r"(b) : "memory");
        }
      } else if (MODE == 2 && threadIdx.x == 0) {
        int half = tile_bytes / 2;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" :: "r"(smem_addr(buf)), "l"(g), "r"(half), "r"(b) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" :: "r"(smem_addr(buf + half)), "l"(g + half), "r"(half), "r"(b) : "memory");
      }
    }
  };
  // expect_tx must precede the copies' completion: issue from thread 0's warp after the arrive.
  issue(0);
  for (int t = 0; t < tiles; t++) {
    if (MODE == 0) asm volatile("cp.async.wait_group 0;");
    else {
      unsigned b = smem_addr(&bar[t & 1]);
      unsigned phase = (t >> 1) & 1;
      asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n @!p bra W;\n}" :: "r"(b), "r"(phase) : "memory");
    }
    __syncthreads();
    if (t + 1 < tiles) issue(t + 1);
    const uint8_t* buf = tiles_at + (t & 1) * buf_bytes;
    for (int i = threadIdx.x; i < buf_bytes / 4; i += blockDim.x) acc += ((const float*)buf)[i] * 1e-30f;
  }
  if (acc == 1.2345f) out[blockIdx.x] = acc;
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t total = 1078444800ull;  // dense 32K step's bytes
  const int copies = 4;
  std::vector<uint8_t*> bufs(copies);
  for (auto& b : bufs) { CK(cudaMalloc(&b, total + (1 << 20))); CK(cudaMemset(b, 0x3c, total)); }
  float* out; CK(cudaMalloc(&out, 1 << 20));
  printf("%-24s %8s %6s %9s %7s\n", "mode", "ctas", "tileKB", "ms", "TB/s");
  // One map per (copy, mode, tile): the copy's bytes as half tiles of 256-byte rows.
  auto encode = [&](uint8_t* base, int mode, int tile) {
    CUtensorMap map;
    int half = tile / 2, rows = half / 256;
    cuuint64_t halves = total / half;
    cuuint32_t ones[4] = {1, 1, 1, 1};
    CUresult r;
    if (mode == 6) {
      cuuint64_t dims[3] = {256, (cuuint64_t)rows, halves};
      cuuint64_t strides[2] = {256, (cuuint64_t)half};
      cuuint32_t box[3] = {256, (cuuint32_t)rows, 1};
      r = cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, base, dims, strides, box, ones,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    } else {
      cuuint64_t dims[4] = {128, 2, (cuuint64_t)rows, halves};
      cuuint64_t strides[3] = {128, 256, (cuuint64_t)half};
      cuuint32_t box[4] = {128, 2, (cuuint32_t)rows, 1};
      CUtensorMapL2promotion promotion = mode == 3 ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                       : mode == 4 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                   : CU_TENSOR_MAP_L2_PROMOTION_NONE;
      r = cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, base, dims, strides, box, ones,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    }
    if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", (int)r); exit(1); }
    return map;
  };
  using Kernel = void (*)(const uint8_t*, size_t, int, float*, const __grid_constant__ CUtensorMap);
  const Kernel kernels[] = {stream<0>, stream<1>, stream<2>, stream<3>, stream<4>, stream<5>, stream<6>};
  const char* names[] = {"cp.async16 padded", "bulk/row padded", "bulk/half-tile", "tensor swz128 L2:256",
                         "tensor swz128 L2:128", "tensor swz128 L2:none", "tensor unswizzled"};
  static_assert(std::size(kernels) == std::size(names), "one name per mode");
  for (Kernel k : kernels) CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  for (int mode = 0; mode < (int)std::size(kernels); mode++)
  for (int threads : {64, 128})
  for (int tile : {16384, 32768, 65536})
  for (int per_sm : {1, 2, 3, 5}) {
    int buf = mode >= 2 ? tile : tile / 256 * 272;
    int smem = 2 * buf + (mode >= 3 ? 1024 : 0);
    if (smem * per_sm > 220 * 1024) continue;
    // A box has at most 256 rows.
    if (mode >= 3 && tile / 2 / 256 > 256) continue;
    int ctas = per_sm * sms;
    size_t per_cta = total / ctas / tile * tile;
    std::vector<CUtensorMap> maps(copies);
    for (int c = 0; c < copies; c++) if (mode >= 3) maps[c] = encode(bufs[c], mode, tile);
    auto launch = [&](int r) {
      kernels[mode]<<<ctas, threads, smem>>>(bufs[r % copies], per_cta, tile, out, maps[r % copies]);
    };
    for (int r = 0; r < 5; r++) launch(r);
    CK(cudaDeviceSynchronize());
    std::vector<cudaEvent_t> ev(42);
    for (auto& e : ev) CK(cudaEventCreate(&e));
    for (int r = 0; r < 21; r++) { CK(cudaEventRecord(ev[2 * r])); launch(r); CK(cudaEventRecord(ev[2 * r + 1])); }
    CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
    std::vector<float> ms(21);
    for (int r = 0; r < 21; r++) CK(cudaEventElapsedTime(&ms[r], ev[2 * r], ev[2 * r + 1]));
    std::sort(ms.begin(), ms.end());
    double bytes = (double)per_cta * ctas;
    printf("%-18s t%-4d %4d(%d/SM) %6d %9.4f %7.2f\n", names[mode], threads, ctas, per_sm, tile / 1024, ms[10], bytes / ms[10] / 1e9);
    for (auto& e : ev) CK(cudaEventDestroy(e));
  }
}
