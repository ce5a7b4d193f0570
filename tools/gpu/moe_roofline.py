"""The step roofline of issue 26's MoE measurement: what a step must read and compute, at the H100's peaks.

Used by tools/gpu/e2e_harness.py's `moe_bench` section, beside each measured job. A model's sizes come from its
config.json read by fdlite itself (`ModelConfig`, and `MoESpec` for which layers are MoE and how many experts
each token picks), so the model the roofline prices is the model the engine built.

One step of T tokens (decode rows and prefill chunks together) at least:
- reads every dense weight once: attention (q, k, v, o) of every layer, the dense MLPs (`intermediate_size`) of
  the layers that are not MoE, each MoE layer's router and shared experts, and the LM head when a row samples;
- reads the experts its tokens touch, once each: with uniform routing a token picks k of E experts, so T tokens
  touch E * (1 - (1 - k/E)^T) distinct experts per MoE layer in expectation (T = 1: k; T = 256 at k/E = 1/16:
  all of them). A random-weight router is close to uniform;
- reads each row's KV up to its last token (a decode row: its whole context; a prefill chunk: its prefix and
  itself) and writes the KV of its T tokens;
- computes 2 FLOPs per weight per token on what the token uses (k experts, not the touched set), the LM head
  for the rows that sample, and causal attention: 4 * heads * head_dim FLOPs per (query, key) pair.

The step's roofline time is max(bytes / HBM bandwidth, FLOPs / bf16 GEMM peak); a job's roofline is the sum over
its steps, as the engine scheduled them (`StepLog`, from `Engine.schedule_listeners`: the real batch sizes and
contexts, preemptions and KV-limited batches included). Peaks: 3.0 TB/s (H100 SXM HBM3, the figure the dense
decode step roofline in docs/benchmarks.md uses) and 790 TFLOP/s (bf16 dense GEMM measured on the lent H100).
"""

from __future__ import annotations

from dataclasses import dataclass, field

HBM_BYTES_PER_S = 3.0e12
BF16_FLOPS_PER_S = 790e12


def expected_experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts T tokens touch under uniform routing: E * (1 - (1 - k/E)^T)."""
    if tokens <= 0 or num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class ModelCosts:
    """Bytes and FLOP counts of one model in `dtype_bytes` (2: bf16), per layer kind; from `from_dir`."""

    num_layers: int
    num_dense_layers: int
    num_moe_layers: int
    attn_params: int          # one layer's q, k, v, o weights
    dense_mlp_params: int     # one dense layer's gate, up, down
    expert_params: int        # one routed expert's gate, up, down
    shared_params: int        # one MoE layer's shared experts
    router_params: int        # one MoE layer's router
    router_bytes: int         # its bytes (ERNIE keeps it in float32)
    num_experts: int
    top_k: int
    lm_head_params: int
    embed_params: int         # the embedding table (its T rows are read; tied: the LM head's too)
    kv_bytes_per_token: int   # K and V, every layer
    q_dim: int                # heads * head_dim, for attention FLOPs
    hidden: int
    tied: bool                # the LM head is the embedding table
    dtype_bytes: int = 2

    @classmethod
    def from_dir(cls, path: str, dtype_bytes: int = 2) -> ModelCosts:
        from fdlite.models.model_config import ModelConfig  # noqa: PLC0415
        from fdlite.models.moe import MoESpec  # noqa: PLC0415

        cfg = ModelConfig.from_dir(path)
        spec = None
        if cfg.architecture.startswith("Ernie4_5_Moe"):
            spec = MoESpec.ernie(cfg)
        elif cfg.architecture.startswith("Qwen3Moe"):
            spec = MoESpec.qwen3(cfg)
        moe_layers = len(spec.moe_layers) if spec else 0
        h, hd = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        experts = spec.num_experts if spec else 0
        return cls(
            num_layers=cfg.num_hidden_layers, num_dense_layers=cfg.num_hidden_layers - moe_layers,
            num_moe_layers=moe_layers, attn_params=h * (q + 2 * kv) + q * h,
            dense_mlp_params=3 * h * cfg.intermediate_size,
            expert_params=3 * h * cfg.moe_intermediate_size,
            shared_params=3 * h * cfg.moe_intermediate_size * (spec.num_shared_experts if spec else 0),
            router_params=h * experts,
            router_bytes=h * experts * (4 if spec and spec.gate_dtype == "float32" else dtype_bytes),
            num_experts=experts, top_k=spec.top_k if spec else 0,
            lm_head_params=cfg.vocab_size * h, embed_params=cfg.vocab_size * h,
            kv_bytes_per_token=2 * cfg.num_hidden_layers * kv * dtype_bytes, q_dim=q, hidden=h,
            tied=cfg.tie_word_embeddings, dtype_bytes=dtype_bytes)

    @property
    def total_params(self) -> int:
        """Every weight (norms aside): what the GPU holds; a tied LM head is the embedding table."""
        untied_head = 0 if self.tied else self.lm_head_params
        return (self.num_layers * self.attn_params + self.num_dense_layers * self.dense_mlp_params
                + self.num_moe_layers * (self.num_experts * self.expert_params + self.shared_params
                                         + self.router_params) + self.embed_params + untied_head)

    @property
    def active_params(self) -> int:
        """Weights one token computes with (k experts of each MoE layer), embedding aside, LM head included."""
        return (self.num_layers * self.attn_params + self.num_dense_layers * self.dense_mlp_params
                + self.num_moe_layers * (self.top_k * self.expert_params + self.shared_params + self.router_params)
                + self.lm_head_params)

    def step(self, rows: list[tuple[int, int, bool]]) -> tuple[float, float]:
        """(bytes, FLOPs) of one step; rows: (tokens before this step, tokens this step, samples) per row."""
        t = sum(n for _, n, _ in rows)
        sampled = sum(1 for _, _, s in rows if s)
        b = self.dtype_bytes
        touched = expected_experts_touched(self.num_experts, self.top_k, t)
        weights = (self.num_layers * self.attn_params + self.num_dense_layers * self.dense_mlp_params
                   + self.num_moe_layers * (self.shared_params + touched * self.expert_params)) * b
        weights += self.num_moe_layers * self.router_bytes + t * self.hidden * b  # routers, embedding rows
        weights += self.lm_head_params * b if sampled else 0
        kv = sum(c + n for c, n, _ in rows) * self.kv_bytes_per_token + t * self.kv_bytes_per_token
        per_token = 2 * (self.num_layers * self.attn_params + self.num_dense_layers * self.dense_mlp_params
                         + self.num_moe_layers * (self.top_k * self.expert_params + self.shared_params
                                                  + self.router_params))
        pairs = sum(n * c + n * (n + 1) // 2 for c, n, _ in rows)  # causal (query, key) pairs
        flops = t * per_token + 2 * sampled * self.lm_head_params + 4 * self.q_dim * self.num_layers * pairs
        return weights + kv, flops


@dataclass
class StepLog:
    """A schedule listener (`llm.engine.schedule_listeners.append(log)`) keeping each step's rows as `step` takes
    them. Each row's tokens before the step are counted from what was scheduled for it (a prefix-cache hit would be
    counted as computed; a preempted row that comes back starts again from 0). prompt_lens[request index]: a
    prefill row samples when its chunk reaches the end of the prompt."""

    prompt_lens: list[int]
    steps: list[list[tuple[int, int, bool]]] = field(default_factory=list)
    _done: dict = field(default_factory=dict)

    def __call__(self, rows) -> None:
        step = []
        for r in rows:
            key = (r.request_index, r.child_index)
            before = 0 if (r.joined and not r.decode) else self._done.get(key, 0)
            after = before + r.num_tokens
            samples = r.decode or after >= self.prompt_lens[r.request_index]
            step.append((before, r.num_tokens, samples))
            self._done[key] = after
        self.steps.append(step)


def _sig(x: float) -> float:
    """x to 4 significant digits (toy CPU shapes give numbers far below the full-size ones)."""
    return float(f"{x:.4g}")


def job_roofline(costs: ModelCosts, steps: list[list[tuple[int, int, bool]]], measured_s: float) -> dict:
    """A job's roofline over its steps, and the measured time's share of it (1.0 = at the roofline)."""
    mem_s = flop_s = roof_s = 0.0
    total_bytes = total_flops = 0.0
    for rows in steps:
        nbytes, flops = costs.step(rows)
        total_bytes += nbytes
        total_flops += flops
        mem_s += nbytes / HBM_BYTES_PER_S
        flop_s += flops / BF16_FLOPS_PER_S
        roof_s += max(nbytes / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S)
    decode_rows = [len(rows) for rows in steps if all(n == 1 for _, n, _ in rows)]
    return {"steps_logged": len(steps), "decode_only_steps": len(decode_rows),
            "mean_decode_batch": round(sum(decode_rows) / len(decode_rows), 1) if decode_rows else 0,
            "bytes_TB": _sig(total_bytes / 1e12), "TFLOP": _sig(total_flops / 1e12),
            "bytes_roofline_s": _sig(mem_s), "flop_roofline_s": _sig(flop_s), "step_roofline_s": _sig(roof_s),
            "fraction_of_step_roofline": _sig(roof_s / measured_s) if measured_s else None,
            "fraction_of_flop_roofline": _sig(flop_s / measured_s) if measured_s else None}
