// Standalone probe (no Paddle): how fast can a kernel read HBM, and does reading it the way the decode attention
// does (chunks of one KV head's cache block, scattered over a cache of tens of GB) cost bandwidth?
//
// The decode attention is 75-80% of a large decode step, and docs/benchmarks.md measures it against 3.0 TB/s, what a
// device-to-device copy gives. In the engine it reads its bytes at ~2.6 TB/s (the protocol's fit), in the ops harness
// at 2.8 (rows of protocol-like lengths, batch 256, a cache of ~256 MB). Rows, one JSON line each (GB/s of bytes
// read; 1 GB read per call, median of graph replays):
//   copy        : cudaMemcpyAsync device to device (GB/s counting read + write, as the 3.0 TB/s figure)
//   linear      : every byte of 1 GB once, 16-byte loads, `unroll` loads in flight a thread, `bpsm` blocks of 256
//                 threads a SM (load: plain ld.global, or ld.global.nc.L1::no_allocate)
//   chunks      : 1 GB as chunks of `chunk` bytes (a block's rows of one KV head: 64 x 256 B = 16 KB for a bf16
//                 cache, block size 64, head_dim 128) at random distinct places of a pool of `pool_gb` GB, one warp a
//                 chunk at a time: is there a cost to the span (TLB reach) or the order?
//   bulk        : the same chunks by cp.async.bulk (TMA, 1-D) into a ring of `stages` shared-memory buffers a block,
//                 one thread issuing, an mbarrier a stage: bytes in flight without registers
// Build: nvcc -O3 -std=c++20 -gencode=arch=compute_90,code=sm_90 hbm_read_probe.cu -lcublasLt -o b
#include <random>

#include "probe_util.cuh"

constexpr size_t kRead = (size_t)1 << 30;  // bytes read per call

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <bool STREAM>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
  if constexpr (STREAM) return ld_stream(p);
  else return *p;
}

// Folds what was read into one word that is stored only if impossible, so no load is dead.
__device__ __forceinline__ void sink_if(unsigned acc, unsigned* sink) {
  if (acc == 0x9e3779b9u) sink[threadIdx.x] = acc;
}

template <int UNR, bool STREAM>
__global__ void __launch_bounds__(256) read_linear(const uint4* p, size_t n16, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += stride * UNR) {
    uint4 v[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const size_t k = i + u * stride;
      v[u] = k < n16 ? ld16<STREAM>(p + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNR; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  sink_if(acc, sink);
}

// One warp per chunk; each lane UNR 16-byte loads in flight.
template <int UNR, bool STREAM>
__global__ void __launch_bounds__(256) read_chunks(const uint4* base, const long long* offs, int n, int ch16,
                                                   unsigned* sink) {
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
  unsigned acc = 0;
  for (int c = warp; c < n; c += nw) {
    const uint4* q = base + offs[c];
    for (int i = lane; i < ch16; i += 32 * UNR) {
      uint4 v[UNR];
#pragma unroll
      for (int u = 0; u < UNR; ++u) v[u] = i + 32 * u < ch16 ? ld16<STREAM>(q + i + 32 * u) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < UNR; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  sink_if(acc, sink);
}

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// One block a chunk at a time per stage: thread 0 issues cp.async.bulk of the whole chunk into stage s, the block
// waits on the stage's mbarrier and folds a word a thread (the bytes were read; touching them all is not needed).
__global__ void __launch_bounds__(128) read_bulk(const uint8_t* base, const long long* offs, int n, int chunk,
                                                 int stages, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ __align__(8) unsigned long long bar[8];
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s)
      asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_u32(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  const int first = blockIdx.x, step = gridDim.x;
  auto issue = [&](int c, int s) {
    if (c >= n) return;
    const unsigned b = smem_u32(&bar[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(b), "r"(chunk));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(sm + (size_t)s * chunk)), "l"(base + offs[c] * 16), "r"(chunk), "r"(b)
                 : "memory");
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < stages; ++s) issue(first + s * step, s);
  unsigned acc = 0;
  int it = 0;
  for (int c = first; c < n; c += step, ++it) {
    const int s = it % stages;
    const unsigned phase = (it / stages) & 1;
    const unsigned b = smem_u32(&bar[s]);
    asm volatile(
        "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(b),
        "r"(phase));
    acc ^= reinterpret_cast<const unsigned*>(sm + (size_t)s * chunk)[threadIdx.x];
    __syncthreads();  // every thread read stage s before it is refilled
    if (threadIdx.x == 0) issue(c + stages * step, s);
  }
  sink_if(acc, sink);
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  size_t free_b, total_b;
  CK(cudaMemGetInfo(&free_b, &total_b));
  const size_t pool_max = std::min((size_t)64 << 30, (free_b - ((size_t)4 << 30)) / ((size_t)1 << 30) << 30);
  printf("{\"device\":\"%s\",\"sms\":%d,\"l2_bytes\":%d,\"pool_max_gb\":%zu}\n", prop.name, sms,
         prop.l2CacheSize, pool_max >> 30);
  uint8_t* buf;  // the pools are its first pool_gb GB
  CK(cudaMalloc(&buf, pool_max));
  CK(cudaMemsetAsync(buf, 1, pool_max, s));
  uint8_t* dst;
  CK(cudaMalloc(&dst, kRead));
  unsigned* sink;
  CK(cudaMalloc(&sink, 1 << 16));
  long long* doffs;
  CK(cudaMalloc(&doffs, (kRead / 4096) * sizeof(long long)));
  CK(cudaStreamSynchronize(s));
  const uint4* p16 = reinterpret_cast<const uint4*>(buf);
  const size_t n16 = kRead / 16;

  {
    const float ms = graph_ms(s, [&] { CK(cudaMemcpyAsync(dst, buf, kRead, cudaMemcpyDeviceToDevice, s)); });
    printf("{\"row\":\"copy\",\"us\":%.1f,\"GB_s\":%.0f}\n", ms * 1e3, 2.0 * kRead / (ms * 1e-3) / 1e9);
  }
  auto lin = [&](auto kern, int unr, bool stream, int bpsm) {
    const float ms = graph_ms(s, [&] { kern<<<sms * bpsm, 256, 0, s>>>(p16, n16, sink); });
    printf("{\"row\":\"linear\",\"load\":\"%s\",\"unroll\":%d,\"bpsm\":%d,\"us\":%.1f,\"GB_s\":%.0f}\n",
           stream ? "nc_no_allocate" : "plain", unr, bpsm, ms * 1e3, kRead / (ms * 1e-3) / 1e9);
  };
  for (int bpsm : {1, 2, 4, 8}) {
    lin(read_linear<1, false>, 1, false, bpsm);
    lin(read_linear<4, false>, 4, false, bpsm);
    lin(read_linear<8, false>, 8, false, bpsm);
    lin(read_linear<8, true>, 8, true, bpsm);
  }

  std::mt19937_64 rng(7);
  for (const int chunk : {4096, 16384, 65536}) {
    const int n = (int)(kRead / chunk);
    for (const size_t pool_gb : {(size_t)1, (size_t)4, (size_t)16, (size_t)64}) {
      const size_t pool = pool_gb << 30;
      if (pool > pool_max) continue;
      for (const bool shuffled : {true, false}) {
        // n distinct chunk slots of the pool: every (pool / kRead)-th slot, then shuffled (or kept in order)
        const size_t slots = pool / chunk, every = slots / n;
        std::vector<long long> offs(n);
        for (int i = 0; i < n; ++i) offs[i] = (long long)((size_t)i * every * chunk / 16);
        if (shuffled) std::shuffle(offs.begin(), offs.end(), rng);
        CK(cudaMemcpy(doffs, offs.data(), n * sizeof(long long), cudaMemcpyHostToDevice));
        const char* order = shuffled ? "random" : "in_order";
        for (int bpsm : {4, 8}) {
          const float ms = graph_ms(s, [&] {
            read_chunks<8, true><<<sms * bpsm, 256, 0, s>>>(p16, doffs, n, chunk / 16, sink);
          });
          printf("{\"row\":\"chunks\",\"chunk\":%d,\"pool_gb\":%zu,\"order\":\"%s\",\"bpsm\":%d,\"us\":%.1f,"
                 "\"GB_s\":%.0f}\n", chunk, pool_gb, order, bpsm, ms * 1e3, kRead / (ms * 1e-3) / 1e9);
        }
        if (chunk > 16384) continue;
        for (const int stages : {2, 4, 8}) {
          const int smem = stages * chunk;
          if (smem > 200 * 1024) continue;
          CK(cudaFuncSetAttribute(read_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
          int per_sm = 0;
          CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_bulk, 128, smem));
          const float ms = graph_ms(s, [&] {
            read_bulk<<<sms * per_sm, 128, smem, s>>>(buf, doffs, n, chunk, stages, sink);
          });
          printf("{\"row\":\"bulk\",\"chunk\":%d,\"pool_gb\":%zu,\"order\":\"%s\",\"stages\":%d,\"bpsm\":%d,"
                 "\"us\":%.1f,\"GB_s\":%.0f}\n", chunk, pool_gb, order, stages, per_sm, ms * 1e3,
                 kRead / (ms * 1e-3) / 1e9);
        }
      }
    }
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}
