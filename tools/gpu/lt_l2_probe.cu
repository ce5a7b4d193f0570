// Standalone probe (no Paddle): do the decode projections of Qwen3-0.6B get faster when their weights are already in
// L2, and can an L2 prefetch issued during the layer's attention (an HBM-bound kernel) put them there?
//
// A decode layer on the H100 is the attention (reading the KV cache at HBM speed) followed by cuBLASLt GEMMs that sit
// at a floor of 5-6 us each (docs/benchmarks.md, "cuBLASLt's first heuristic vs its fastest candidate"), well above
// their weights' read time. Emulated here per layer: a streaming kernel reading `stream_mb` of a buffer much larger
// than L2 (the attention's KV), then the layer's four projections (qkv, o_proj, gate_up, down; weights [N, K], run as
// cuBLASLt TN with the heuristic's first algorithm, as fdl_linear does), 28 layers, one CUDA graph, median of 10.
// Variants of the same graph:
//   gemm_cold   : the GEMMs alone, each layer its own weights (nothing served from L2)
//   gemm_hot    : the GEMMs alone, every layer layer 0's weights (31 MB: held in the 50 MB L2)
//   stream      : the streaming kernels alone (stream_evict_first: their loads with the evict_first policy)
//   base        : stream + GEMMs, cold weights (base_evict_first: as above)
//   pf_kernel   : base, and the streaming kernel's block 0 issues cp.async.bulk.prefetch.L2 for the layer's weights
//                 (evict_last, 64 KB pieces) before streaming; its own loads evict_first (pf_kernel_normal_loads: not)
//   pf_side     : base, and a prefetch kernel (4 blocks) on a side stream forked at the layer's start
//   *_persist   : base and the prefetch variants with cudaLimitPersistingL2CacheSize at the device's maximum
// then the floor: 112 dependent launches of an empty kernel, and of GEMMs on one small weight in L2.
// Build: nvcc -O3 -std=c++20 -gencode=arch=compute_90,code=sm_90 lt_l2_probe.cu -lcublasLt -o b
#include "probe_util.cuh"

constexpr int kLayers = kQwen3_06b.layers;
constexpr const Shape* kShapes = kQwen3_06b.shapes;
constexpr size_t kWs = 32u << 20;

struct Prefetch {  // up to 4 regions of one layer's weights
  const void* p[4];
  unsigned bytes[4];
};

__device__ __forceinline__ uint64_t policy_evict_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t policy_evict_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// Thread t of the first `nthreads` issues bulk L2 prefetches of 64 KB pieces of the regions, round robin.
__device__ __forceinline__ void issue_prefetch(const Prefetch& pf, int t, int nthreads) {
  const uint64_t pol = policy_evict_last();
  constexpr unsigned kPiece = 64u << 10;
  int idx = 0;
  for (int r = 0; r < 4; ++r) {
    if (pf.p[r] == nullptr) continue;
    const char* base = static_cast<const char*>(pf.p[r]);
    for (unsigned off = 0; off < pf.bytes[r]; off += kPiece, ++idx) {
      if (idx % nthreads != t) continue;
      const unsigned n = min(kPiece, pf.bytes[r] - off);
      asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(base + off), "r"(n),
                   "l"(pol)
                   : "memory");
    }
  }
}

// Reads n uint4 of src (streaming, once) and writes one sum per block (so nothing is optimized away).
// prefetch: block 0's threads issue the layer's weight prefetches first; evict_first: the loads carry that policy.
__global__ void stream_kernel(const uint4* __restrict__ src, size_t n, unsigned* __restrict__ sink, Prefetch pf,
                              bool prefetch, bool evict_first) {
  if (prefetch && blockIdx.x == 0) issue_prefetch(pf, threadIdx.x, blockDim.x);
  unsigned acc = 0;
  if (evict_first) {
    const uint64_t pol = policy_evict_first();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
      uint4 v;
      asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "l"(src + i), "l"(pol));
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  } else {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
      uint4 v;
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "l"(src + i));
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;
}

__global__ void empty_kernel() {}

__global__ void prefetch_kernel(Prefetch pf) { issue_prefetch(pf, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x); }

int main(int argc, char** argv) {
  const double stream_mb = argc > 1 ? atof(argv[1]) : 200.0;
  auto [s, h, ws, ws_bytes, x, y] = LtProbe(kWs, (size_t)256 * 6144);
  cudaStream_t side;
  CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("{\"device\":\"%s\",\"l2_bytes\":%d,\"persisting_l2_max\":%d,\"sms\":%d,\"stream_mb\":%.0f}\n", prop.name,
         prop.l2CacheSize, prop.persistingL2CacheMaxSize, prop.multiProcessorCount, stream_mb);
  const std::vector<bf16*> w = layer_weights(kLayers, kShapes, 4, s);
  const size_t stream_bytes = (size_t)(stream_mb * 1e6) / 16 * 16;
  const size_t big = std::max(stream_bytes, (size_t)512 << 20);  // the streamed buffer: far larger than L2
  uint4* kv;
  unsigned* sink;
  CK(cudaMalloc(&kv, big));
  CK(cudaMalloc(&sink, 1 << 20));
  CK(cudaMemsetAsync(kv, 1, big, s));
  CK(cudaStreamSynchronize(s));
  const int sblocks = prop.multiProcessorCount * 8;
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));

  for (int M : {16, 64, 128, 256}) {
    std::vector<TnGemm> g;
    cublasLtMatmulAlgo_t algo[4];
    for (int j = 0; j < 4; ++j) {
      g.emplace_back(kShapes[j].K, kShapes[j].N, M);
      cublasLtMatmulHeuristicResult_t res;
      if (g[j].heuristics(h, kWs, 1, &res) < 1) {
        printf("no algorithm\n");
        return 1;
      }
      algo[j] = res.algo;
    }
    auto gemms = [&](int l) {
      for (int j = 0; j < 4; ++j) g[j].run(h, algo[j], w[l * 4 + j], x, y, ws, kWs, s);
    };
    auto pf_of = [&](int l) {
      Prefetch pf{};
      for (int j = 0; j < 4; ++j) {
        pf.p[j] = w[l * 4 + j];
        pf.bytes[j] = (unsigned)((size_t)kShapes[j].K * kShapes[j].N * 2);
      }
      return pf;
    };
    auto stream = [&](int l, bool pf, bool ef) {
      const size_t off = (size_t)l * (stream_bytes / 4) % (big - stream_bytes + 1) / 16;  // layers read different bytes
      stream_kernel<<<sblocks, 256, 0, s>>>(kv + off, stream_bytes / 16, sink, pf_of(l), pf, ef);
    };
    for (int persist = 0; persist < 2; ++persist) {
      CK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, persist ? (size_t)prop.persistingL2CacheMaxSize : 0));
      const char* tag = persist ? "_persist" : "";
      auto report = [&](const char* name, float ms) {
        printf("{\"M\":%d,\"variant\":\"%s%s\",\"step_us\":%.1f,\"layer_us\":%.2f}\n", M, name, tag, ms * 1e3,
               ms * 1e3 / kLayers);
        fflush(stdout);
      };
      if (!persist) {
        report("gemm_cold", graph_ms(s, [&] { for (int l = 0; l < kLayers; ++l) gemms(l); }, 10, 2));
        report("gemm_hot", graph_ms(s, [&] { for (int l = 0; l < kLayers; ++l) gemms(0); }, 10, 2));
        report("stream", graph_ms(s, [&] { for (int l = 0; l < kLayers; ++l) stream(l, false, false); }, 10, 2));
        report("stream_evict_first", graph_ms(s, [&] { for (int l = 0; l < kLayers; ++l) stream(l, false, true); }, 10, 2));
      }
      // each layer: the streaming kernel (pf: its block 0 prefetches the layer's weights; ef: evict_first loads), then
      // the layer's GEMMs
      auto layers = [&](bool pf, bool ef) {
        return graph_ms(s, [&] {
          for (int l = 0; l < kLayers; ++l) {
            stream(l, pf, ef);
            gemms(l);
          }
        }, 10, 2);
      };
      report("base", layers(false, false));
      report("base_evict_first", layers(false, true));
      report("pf_kernel", layers(true, true));
      report("pf_kernel_normal_loads", layers(true, false));
      report("pf_side", graph_ms(s, [&] {
               for (int l = 0; l < kLayers; ++l) {
                 CK(cudaEventRecord(fork, s));
                 CK(cudaStreamWaitEvent(side, fork, 0));
                 prefetch_kernel<<<4, 128, 0, side>>>(pf_of(l));
                 stream(l, false, true);
                 gemms(l);
               }
               CK(cudaEventRecord(join, side));
               CK(cudaStreamWaitEvent(s, join, 0));
             }, 10, 2));
    }
    CK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0));
    for (TnGemm& gm : g) gm.destroy();
  }
  // The floor: 112 dependent launches in one graph (a step's 28 layers x 4 projections) of an empty kernel, and of
  // cuBLASLt GEMMs on one small weight held in L2 (K = N = 128, and K = N = 1024): what a launch and a GEMM cost with
  // almost no bytes to move.
  printf("{\"floor\":\"empty_kernel\",\"us_per_launch\":%.2f}\n",
         1e3f * graph_ms(s, [&] { for (int i = 0; i < 4 * kLayers; ++i) empty_kernel<<<1, 32, 0, s>>>(); }, 10, 2) /
             (4 * kLayers));
  for (int KN : {128, 1024})
    for (int M : {16, 64, 128, 256}) {
      TnGemm f(KN, KN, M);
      cublasLtMatmulHeuristicResult_t res;
      if (f.heuristics(h, kWs, 1, &res) > 0) {
        const float ms = graph_ms(s, [&] {
          for (int i = 0; i < 4 * kLayers; ++i) f.run(h, res.algo, w[0], x, y, ws, kWs, s);
        }, 10, 2);
        printf("{\"floor\":\"gemm\",\"K\":%d,\"N\":%d,\"M\":%d,\"us_per_gemm\":%.2f}\n", KN, KN, M,
               1e3f * ms / (4 * kLayers));
        fflush(stdout);
      }
      f.destroy();
    }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}
