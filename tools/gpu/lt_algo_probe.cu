// Standalone probe (no Paddle): how far is the algorithm cuBLASLt's heuristic ranks first (what fdl_linear runs for
// M > 4) from the fastest of its top candidates, for the decode projections of the dense models fdlite measures?
//
// For each model (Qwen3-0.6B: 28 layers; Llama-3.1-8B: 32), projection (qkv, o_proj, gate_up, down; weights [N, K],
// fdlite's layout, run as cuBLASLt TN) and M (the decode batch): the layers' projections as one CUDA graph (distinct
// weights per layer, so nothing is served from L2), median of 10 replays, for every algorithm of the heuristic's top
// 32 and the first four of them with their K split forced to 2-8 (index >= heuristic_candidates); prints the first's
// time, the fastest's, and the fastest's configuration (tile, split-K, reduction, stages, cluster ids);
// the weight-read roofline at 3.0 TB/s beside them.
// Build: nvcc -O3 -std=c++20 -gencode=arch=compute_90,code=sm_90 lt_algo_probe.cu -lcublasLt -o b
#include "probe_util.cuh"

const Model kModels[2] = {kQwen3_06b, kLlama31_8b};
constexpr size_t kWs = 32u << 20;
constexpr int kCandidates = 32;



int cfg(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t v = 0;
  size_t got = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &got) != CUBLAS_STATUS_SUCCESS) return -1;
  return (int)v;
}

int main() {
  auto [s, h, ws, ws_bytes, x, y] = LtProbe(kWs, (size_t)256 * 28672);
  for (const Model& md : kModels) {
    const std::vector<bf16*> w = layer_weights(md.layers, md.shapes, 4, s);
    CK(cudaStreamSynchronize(s));
    for (int M : {8, 16, 32, 64, 128, 192, 256}) {
      float sum_first = 0, sum_best = 0, sum_roof = 0;
      for (int j = 0; j < 4; ++j) {
        const Shape& sh = md.shapes[j];
        TnGemm g(sh.K, sh.N, M);
        cublasLtMatmulHeuristicResult_t res[kCandidates + 24];
        int n = g.heuristics(h, kWs, kCandidates, res);
        float first = -1, best = 1e30f;
        int best_i = -1;
        // Beside the heuristic's own candidates: each of the first four with its K split forced to 2..8 (the
        // heuristic seldom splits K, and a small N leaves most SMs idle), the reduction in the workspace.
        const int n_heur = n;
        for (int i = 0; i < std::min(n_heur, 4); ++i)
          for (uint32_t sk : {2u, 3u, 4u, 6u, 8u}) {
            if (n >= kCandidates + 24) break;
            cublasLtMatmulHeuristicResult_t r = res[i];
            uint32_t red = CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
            if (cublasLtMatmulAlgoConfigSetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof(sk)) !=
                    CUBLAS_STATUS_SUCCESS ||
                cublasLtMatmulAlgoConfigSetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red,
                                                     sizeof(red)) != CUBLAS_STATUS_SUCCESS)
              continue;
            cublasLtMatmulHeuristicResult_t chk{};
            if (cublasLtMatmulAlgoCheck(h, g.op, g.a, g.b, g.d, g.d, &r.algo, &chk) != CUBLAS_STATUS_SUCCESS ||
                chk.workspaceSize > kWs)
              continue;
            r.state = CUBLAS_STATUS_SUCCESS;
            res[n++] = r;
          }
        for (int i = 0; i < n; ++i) {
          if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
          bool ok = true;
          for (int l = 0; l < md.layers && ok; ++l)  // eager once: some candidates refuse at run time
            ok = g.run(h, res[i].algo, w[l * 4 + j], x, y, ws, kWs, s) == CUBLAS_STATUS_SUCCESS;
          if (!ok) continue;
          CK(cudaStreamSynchronize(s));
          const float us = 1e3f * graph_ms(s, [&] {
            for (int l = 0; l < md.layers; ++l) g.run(h, res[i].algo, w[l * 4 + j], x, y, ws, kWs, s);
          }, 10, 2) / md.layers;
          if (i == 0) first = us;
          if (us < best) best = us, best_i = i;
        }
        const double bytes = 2.0 * ((double)sh.K * sh.N + (double)M * sh.K + (double)M * sh.N);
        const double roof = bytes / 3.0e12 * 1e6;
        sum_first += first, sum_best += best, sum_roof += roof;
        const cublasLtMatmulAlgo_t& b = res[best_i].algo;
        printf("{\"model\":\"%s\",\"shape\":\"%s\",\"M\":%d,\"K\":%d,\"N\":%d,\"candidates\":%d,\"first_us\":%.2f,"
               "\"best_us\":%.2f,\"best_index\":%d,\"heuristic_candidates\":%d,\"roofline_us\":%.2f,\"best_algo_id\":%d,\"tile\":%d,\"splitk\":%d,"
               "\"reduction\":%d,\"stages\":%d,\"cluster\":%d,\"first_tile\":%d,\"first_splitk\":%d}\n",
               md.name, sh.name, M, sh.K, sh.N, n, first, best, best_i, n_heur, roof, cfg(b, CUBLASLT_ALGO_CONFIG_ID),
               cfg(b, CUBLASLT_ALGO_CONFIG_TILE_ID), cfg(b, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
               cfg(b, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), cfg(b, CUBLASLT_ALGO_CONFIG_STAGES_ID),
               cfg(b, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), cfg(res[0].algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
               cfg(res[0].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM));
        fflush(stdout);
        g.destroy();
      }
      printf("{\"model\":\"%s\",\"M\":%d,\"layer_first_us\":%.2f,\"layer_best_us\":%.2f,\"layer_roofline_us\":%.2f}\n",
             md.name, M, sum_first, sum_best, sum_roof);
    }
    for (bf16* p : w) CK(cudaFree(p));
  }
  return 0;
}
