// Standalone probe (no Paddle): does cuBLASLt have a faster kernel for the decode projections than any its heuristic
// offers? lt_algo_probe timed the heuristic's candidates (it returns 8 at these shapes) and found the first within 5% of
// the best; this one searches the algorithm space itself: every algorithm id cuBLASLt lists for bf16 in, bf16 out,
// fp32 accumulation (cublasLtMatmulAlgoGetIds), each tile, stages, K split (1, 2, 4; the reduction in the workspace)
// and CTA swizzle its capabilities admit, as cublasLtMatmulAlgoCheck accepts them. Each configuration is timed as
// lt_algo_probe does (the model's layers' own weights, one graph, fdl_linear's TN form) with few replays; the five
// fastest again with more. Prints one JSON line per (model, projection, M): the heuristic's first, the search's best
// and its configuration, how many configurations ran.
// Build: nvcc -O3 -std=c++20 -gencode=arch=compute_90,code=sm_90 lt_search_probe.cu -lcublasLt -o b
#include <random>

#include "probe_util.cuh"

struct Target {
  const Model& md;
  int ms[2];  // decode batches searched
};
const Target kTargets[2] = {{kQwen3_06b, {64, 256}}, {kLlama31_8b, {128, 256}}};
constexpr size_t kWs = 32u << 20;
constexpr int kMaxTimed = 500;  // configurations timed per (projection, M), sampled at random beyond this

template <typename V>
std::vector<V> cap_list(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr, V undefined) {
  size_t bytes = 0;
  std::vector<V> v;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) == CUBLAS_STATUS_SUCCESS && bytes > 0) {
    v.resize(bytes / sizeof(V));
    LK(cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), bytes, &bytes));
  }
  if (v.empty()) v.push_back(undefined);
  return v;
}

uint32_t cap_u32(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  uint32_t v = 0;
  size_t got = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, attr, &v, sizeof(v), &got);
  return v;
}

struct Cfg {
  cublasLtMatmulAlgo_t algo;
  int id, tile, stages, splitk, swizzle;
  float us;
};

int main() {
  auto [s, h, ws, ws_bytes, x, y] = LtProbe(kWs, (size_t)256 * 28672);
  int ids[256], n_ids = 0;
  LK(cublasLtMatmulAlgoGetIds(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                              256, ids, &n_ids));
  printf("{\"algo_ids\":%d}\n", n_ids);
  std::mt19937 rng(3);
  for (const Target& tg : kTargets) {
    const Model& md = tg.md;
    const std::vector<bf16*> w = layer_weights(md.layers, md.shapes, 4, s);
    CK(cudaStreamSynchronize(s));
    for (int M : tg.ms) {
      for (int j = 0; j < 4; ++j) {
        const Shape& sh = md.shapes[j];
        TnGemm g(sh.K, sh.N, M);
        auto time_us = [&](const cublasLtMatmulAlgo_t& algo, int reps) -> float {
          for (int l = 0; l < md.layers; ++l)  // eager once: a configuration may refuse at run time
            if (g.run(h, algo, w[l * 4 + j], x, y, ws, kWs, s) != CUBLAS_STATUS_SUCCESS) {
              cudaGetLastError();
              return -1.f;
            }
          if (cudaStreamSynchronize(s) != cudaSuccess) {
            printf("{\"error\":\"%s\"}\n", cudaGetErrorString(cudaGetLastError()));
            exit(1);
          }
          return 1e3f * graph_ms(s, [&] {
            for (int l = 0; l < md.layers; ++l) g.run(h, algo, w[l * 4 + j], x, y, ws, kWs, s);
          }, reps, 1) / md.layers;
        };
        cublasLtMatmulHeuristicResult_t first;
        LK(g.heuristics(h, kWs, 1, &first) == 1 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED);
        const float first_us = time_us(first.algo, 10);
        // every configuration the capabilities admit and the check accepts
        std::vector<Cfg> cfgs;
        for (int a = 0; a < n_ids; ++a) {
          cublasLtMatmulAlgo_t algo;
          if (cublasLtMatmulAlgoInit(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                                     CUDA_R_16BF, ids[a], &algo) != CUBLAS_STATUS_SUCCESS)
            continue;
          const auto tiles = cap_list<uint32_t>(algo, CUBLASLT_ALGO_CAP_TILE_IDS, CUBLASLT_MATMUL_TILE_UNDEFINED);
          const auto stages = cap_list<uint32_t>(algo, CUBLASLT_ALGO_CAP_STAGES_IDS, CUBLASLT_MATMUL_STAGES_UNDEFINED);
          const bool splitk_ok = cap_u32(algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) != 0;
          const uint32_t red_mask = cap_u32(algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
          const bool swz_ok = cap_u32(algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT) != 0;
          for (uint32_t tile : tiles)
            for (uint32_t st : stages)
              for (uint32_t sk : {1u, 2u, 4u}) {
                if (sk > 1 && !splitk_ok) continue;
                for (uint32_t swz : {0u, 1u}) {
                  if (swz && !swz_ok) continue;
                  cublasLtMatmulAlgo_t c = algo;
                  uint32_t red = CUBLASLT_REDUCTION_SCHEME_NONE;
                  if (sk > 1) {
                    red = (red_mask & CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE) ? CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE
                        : (red_mask & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE) ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                                                                              : CUBLASLT_REDUCTION_SCHEME_INPLACE;
                  }
                  if (cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile)) ||
                      cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_STAGES_ID, &st, sizeof(st)) ||
                      cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof(sk)) ||
                      cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof(red)) ||
                      cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz)))
                    continue;
                  cublasLtMatmulHeuristicResult_t chk{};
                  if (cublasLtMatmulAlgoCheck(h, g.op, g.a, g.b, g.d, g.d, &c, &chk) != CUBLAS_STATUS_SUCCESS ||
                      chk.workspaceSize > kWs)
                    continue;
                  cfgs.push_back({c, ids[a], (int)tile, (int)st, (int)sk, (int)swz, 0.f});
                }
              }
        }
        const int admitted = (int)cfgs.size();
        if ((int)cfgs.size() > kMaxTimed) {
          std::shuffle(cfgs.begin(), cfgs.end(), rng);
          cfgs.resize(kMaxTimed);
        }
        std::vector<Cfg> ran;
        for (Cfg& c : cfgs) {
          c.us = time_us(c.algo, 3);
          if (c.us > 0) ran.push_back(c);
        }
        std::sort(ran.begin(), ran.end(), [](const Cfg& p, const Cfg& q) { return p.us < q.us; });
        for (size_t i = 0; i < std::min<size_t>(5, ran.size()); ++i) ran[i].us = time_us(ran[i].algo, 10);
        std::sort(ran.begin(), ran.begin() + std::min<size_t>(5, ran.size()),
                  [](const Cfg& p, const Cfg& q) { return p.us < q.us; });
        const double bytes = 2.0 * ((double)sh.K * sh.N + (double)M * sh.K + (double)M * sh.N);
        if (ran.empty()) {
          printf("{\"model\":\"%s\",\"shape\":\"%s\",\"M\":%d,\"first_us\":%.2f,\"admitted\":%d,\"ran\":0}\n", md.name,
                 sh.name, M, first_us, admitted);
        } else {
          const Cfg& b = ran[0];
          printf("{\"model\":\"%s\",\"shape\":\"%s\",\"M\":%d,\"K\":%d,\"N\":%d,\"first_us\":%.2f,\"best_us\":%.2f,"
                 "\"roofline_us\":%.2f,\"admitted\":%d,\"ran\":%d,\"best_algo_id\":%d,\"tile\":%d,\"stages\":%d,"
                 "\"splitk\":%d,\"swizzle\":%d}\n",
                 md.name, sh.name, M, sh.K, sh.N, first_us, b.us, bytes / 3.0e12 * 1e6, admitted, (int)ran.size(),
                 b.id, b.tile, b.stages, b.splitk, b.swizzle);
        }
        fflush(stdout);
        g.destroy();
      }
    }
    for (bf16* p : w) CK(cudaFree(p));
  }
  return 0;
}
