// Single-bit tensor-core mma (`m16n8k256 .b1 .and.popc`) as a rank engine for bitmap formats:
// is it as fast as the f16 and int8 mma, and does it give a group's byte offset in one step?
// With a row's 64-bit mask in the A operand (word 0 in registers a0/a1, word 1 in a2/a3, so each
// word fills four of the eight 32-bit reduction ranges) and a column's "bits below group p" in B,
// D = C + 4 · popcount(mask & below(p)): the packed group's byte offset past C.
//
//   nvcc -O3 -arch=sm_90 -o rank_mma benches/gpu/rank_mma.cu && ./rank_mma
//
// H200, 2026-11-22: all three mma kinds issue at the same rate (0.60 per cycle and SM) and
// latency (about 30 cycles in a dependent chain); the rank check matches. As MosaicKV's rank step
// it needs 143 registers (3 CTAs/SM), which costs more than the instructions it saves.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(err_)); exit(1);} } while (0)

constexpr int ITERS = 4096;

// KIND 0: b1 and.popc, 1: s8, 2: f16 -> f32. CHAINS independent accumulators per warp.
template <int KIND, int CHAINS>
__global__ void issue(uint32_t* out, uint32_t seed) {
  uint32_t a0 = seed ^ threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 * 11u, b1 = a0 * 13u;
  uint32_t d[CHAINS][4];
  for (int c = 0; c < CHAINS; ++c) for (int j = 0; j < 4; ++j) d[c][j] = c + j;
  for (int i = 0; i < ITERS; ++i) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      if (KIND == 0)
        asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+r"(d[c][0]), "+r"(d[c][1]), "+r"(d[c][2]), "+r"(d[c][3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      else if (KIND == 1)
        asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+r"(d[c][0]), "+r"(d[c][1]), "+r"(d[c][2]), "+r"(d[c][3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      else  // finite f16 operands (1.0 or 0.0 halves)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+r"(d[c][0]), "+r"(d[c][1]), "+r"(d[c][2]), "+r"(d[c][3])
                     : "r"(a0 & 0x3c003c00u), "r"(a1 & 0x3c003c00u), "r"(a2 & 0x3c003c00u), "r"(a3 & 0x3c003c00u),
                       "r"(b0 & 0x3c003c00u), "r"(b1 & 0x3c003c00u));
    }
  }
  uint32_t s = 0;
  for (int c = 0; c < CHAINS; ++c) for (int j = 0; j < 4; ++j) s += d[c][j];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// Ranks of 16 rows' masks at 8 columns' groups: lane (g, q) holds rows g and g + 8 and column g.
__global__ void ranks(const uint64_t* masks, const int* groups, const uint32_t* bases, uint32_t* out) {
  int lane = threadIdx.x, g = lane >> 2, q = lane & 3;
  uint64_t m0 = masks[blockIdx.x * 16 + g], m8 = masks[blockIdx.x * 16 + g + 8];
  int p = groups[blockIdx.x * 8 + g];
  uint64_t below = p == 0 ? 0 : (~0ull >> (64 - p));
  uint32_t c0 = bases[blockIdx.x * 16 + g], c8 = bases[blockIdx.x * 16 + g + 8];
  uint32_t d0 = c0, d1 = c0, d2 = c8, d3 = c8;
  asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3)
               : "r"((uint32_t)m0), "r"((uint32_t)m8), "r"((uint32_t)(m0 >> 32)), "r"((uint32_t)(m8 >> 32)),
                 "r"((uint32_t)below), "r"((uint32_t)(below >> 32)));
  uint32_t* o = out + blockIdx.x * 128;
  o[g * 8 + 2 * q] = d0; o[g * 8 + 2 * q + 1] = d1; o[(g + 8) * 8 + 2 * q] = d2; o[(g + 8) * 8 + 2 * q + 1] = d3;
}

template <int KIND, int CHAINS>
float median_ms(uint32_t* buf, int blocks, int threads) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int w = 0; w < 3; ++w) issue<KIND, CHAINS><<<blocks, threads>>>(buf, w);
  std::vector<float> t;
  for (int r = 0; r < 11; ++r) {
    CK(cudaEventRecord(e0));
    issue<KIND, CHAINS><<<blocks, threads>>>(buf, 100 + r);
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <int KIND>
void report(const char* name, uint32_t* buf, int sms, double khz) {
  float chain = median_ms<KIND, 1>(buf, sms, 32);          // one warp per SM, one dependent chain
  float full = median_ms<KIND, 4>(buf, sms * 4, 512);      // 64 warps per SM, four chains each
  double latency = chain * 1e-3 * khz * 1e3 / ITERS;
  double rate = 64.0 * 4 * ITERS / (full * 1e-3) / (khz * 1e3);
  printf("%-30s latency %5.1f cycles   issue %.3f mma/cycle/SM\n", name, latency, rate);
}

int main() {
  int sms, khz;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs, %d MHz\n", prop.name, sms, khz / 1000);
  uint32_t* buf; CK(cudaMalloc(&buf, sizeof(uint32_t) * sms * 4 * 512));
  report<0>("m16n8k256 b1 and.popc", buf, sms, khz);
  report<1>("m16n8k32 s8", buf, sms, khz);
  report<2>("m16n8k16 f16 -> f32", buf, sms, khz);

  // Rank check: 1024 tiles of random masks (a quarter of the bits set, as MosaicKV keeps),
  // groups 0..63, row bases a multiple of 72 bytes.
  const int tiles = 1024;
  std::vector<uint64_t> masks(tiles * 16); std::vector<int> groups(tiles * 8); std::vector<uint32_t> bases(tiles * 16);
  srand(7);
  for (auto& m : masks) { m = 0; for (int b = 0; b < 64; ++b) if (rand() % 4 == 0) m |= 1ull << b; }
  for (auto& p : groups) p = rand() % 64;
  for (int i = 0; i < tiles * 16; ++i) bases[i] = 72u * (rand() % 512);
  uint64_t* dm; int* dp; uint32_t *db, *dout;
  CK(cudaMalloc(&dm, masks.size() * 8)); CK(cudaMalloc(&dp, groups.size() * 4));
  CK(cudaMalloc(&db, bases.size() * 4)); CK(cudaMalloc(&dout, tiles * 128 * 4));
  CK(cudaMemcpy(dm, masks.data(), masks.size() * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dp, groups.data(), groups.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db, bases.data(), bases.size() * 4, cudaMemcpyHostToDevice));
  ranks<<<tiles, 32>>>(dm, dp, db, dout);
  std::vector<uint32_t> got(tiles * 128);
  CK(cudaMemcpy(got.data(), dout, got.size() * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int t = 0; t < tiles; ++t)
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 8; ++c) {
        int p = groups[t * 8 + c];
        uint64_t below = p == 0 ? 0 : (~0ull >> (64 - p));
        uint32_t want = bases[t * 16 + r] + 4 * __builtin_popcountll(masks[t * 16 + r] & below);
        bad += got[t * 128 + r * 8 + c] != want;
      }
  printf("rank check: %d of %d offsets differ\n", bad, tiles * 128);
  return bad != 0;
}
