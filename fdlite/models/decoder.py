"""The decoder-only transformer that Qwen2/2.5, Qwen3, Llama 3, ERNIE 4.5 and the MoE models share, as Paddle layers.

The families differ in a few switches (`DecoderSpec`): bias on q/k/v, RMSNorm on q and k per head,
ERNIE's interleaved rotary layout (handled by the loader, see `rope_interleaved`), and the rope
scaling (read from config); and in each layer's MLP (`DecoderForCausalLM.make_mlp`: dense, or a
mixture of experts, `models/moe.py`). Linear weights use Paddle's [in, out] layout (the
loader transposes the Hugging Face [out, in] tensors once), because Paddle's CPU matmul pays a
full copy for `transpose_y`; q/k/v and gate/up are fused into one matrix each (fewer kernel
launches per layer).

`forward(ids_remove_padding, forward_meta)` takes the flat token batch (FastDeploy's argument
names, which `support_graph_optimization` relies on) and returns hidden states per token.

With tensor parallelism (`TPPartition`) each rank builds the same layers at its own sizes: its
attention and KV heads, its MLP columns, its vocabulary rows (parallel_linear.py, vocab_parallel.py).
With one rank they are the whole model and no collective runs.

The model never branches on the device: every op it calls (`fdlite/layers/`: linear, embedding, norms,
attention, activation, logits) chose its CPU or GPU implementation when it was built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import paddle
from paddle import nn

from fdlite.graph.decorator import support_graph_optimization
from fdlite.models.model_config import ModelConfig
from fdlite.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from fdlite.models.tp_partition import TPPartition
from fdlite.models.vocab_parallel import ParallelLMHead
from fdlite.layers.activation import SiluAndMul
from fdlite.layers.attention_layer import Attention
from fdlite.layers.embedding import VocabParallelEmbedding
from fdlite.layers.forward_meta import ForwardMeta
from fdlite.layers.logits import LogitsProcessor
from fdlite.layers.norm import RMSNorm
from fdlite.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class DecoderSpec:
    qkv_bias: bool = False
    qk_norm: bool = False
    # ERNIE rotates pairs (0, 1), (2, 3), ... of each head rather than halves (0, d/2), ... . The loader
    # permutes q_proj/k_proj's output rows within each head so that the halves layout computes the same
    # thing (q.k is unchanged by one permutation applied to both), and the attention op, CPU and GPU
    # kernels alike, keeps one rotary layout.
    rope_interleaved: bool = False


class DecoderAttention(nn.Layer):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, layer_id: int, dtype: str, rotary: RotaryEmbedding,
                 tp: TPPartition):
        super().__init__()
        num_heads, num_kv_heads, head_dim = tp.num_heads, tp.num_kv_heads, cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, (num_heads + 2 * num_kv_heads) * head_dim,
                                             spec.qkv_bias or cfg.attention_bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, cfg.hidden_size, cfg.attention_bias, dtype, tp)
        if spec.qk_norm:
            self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(num_heads, num_kv_heads, head_dim, layer_id, rotary, self.q_norm, self.k_norm)

    def forward(self, positions: paddle.Tensor, hidden: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(hidden), positions, meta))


class DecoderMLP(nn.Layer):
    """SwiGLU MLP; `intermediate_size`: this rank's columns (default: the config's dense MLP split over ranks)."""

    def __init__(self, cfg: ModelConfig, dtype: str, tp: TPPartition, intermediate_size: int | None = None):
        super().__init__()
        inter = tp.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * inter, cfg.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, dtype, tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Layer):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, layer_id: int, dtype: str, rotary: RotaryEmbedding,
                 tp: TPPartition, mlp: nn.Layer):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DecoderAttention(cfg, spec, layer_id, dtype, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp

    def forward(self, positions, hidden, residual, meta):
        """(hidden, residual) -> (hidden, residual): the residual add is fused into the next norm (vLLM's
        layout), so the stream of residual sums is carried between layers instead of added in each."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


@support_graph_optimization
class DecoderModel(nn.Layer):
    """Embedding, layers, final norm: the part a graph backend translates and captures."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, dtype: str, max_positions: int, tp: TPPartition,
                 make_mlp: Callable[[int], nn.Layer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.hidden_size, dtype, tp.vocab_per_rank, tp.rank, tp.size)
        # One cos/sin table for every layer, for the positions the engine can reach (max_model_len).
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.LayerList([DecoderLayer(cfg, spec, i, dtype, self.rotary_emb, tp, make_mlp(i))
                                    for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, ids_remove_padding: paddle.Tensor, positions: paddle.Tensor, forward_meta: ForwardMeta):
        hidden = self.embed_tokens(ids_remove_padding)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Layer):
    """A decoder plus its LM head (tied to the embedding when the config says so)."""

    spec = DecoderSpec()

    def __init__(self, cfg: ModelConfig, dtype: str, max_positions: int, tp: TPPartition | None = None):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.tp = tp or TPPartition.single(cfg)
        # Parameters are created empty: `load_weights` fills every one from the checkpoint (drawing random
        # initial values first took 8 of Qwen3-0.6B's 13 s of loading on CPU).
        with paddle.LazyGuard():
            self.model = DecoderModel(cfg, self.spec, dtype, max_positions, self.tp, self.make_mlp)
            self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, dtype, self.tp)
        self.logits_processor = LogitsProcessor(self.lm_head, self.model.embed_tokens, self.tp.vocab_size, self.tp.size)

    def make_mlp(self, layer_id: int) -> nn.Layer:
        """The MLP of layer `layer_id`: dense here; MoE families override it."""
        return DecoderMLP(self.config, self.dtype, self.tp)

    def forward(self, ids_remove_padding, positions, forward_meta):
        return self.model(ids_remove_padding=ids_remove_padding, positions=positions, forward_meta=forward_meta)

    def compute_logits(self, hidden: paddle.Tensor, logits_indices: paddle.Tensor) -> paddle.Tensor:
        """Float32 logits over the whole vocabulary for the rows `logits_indices` of `hidden` (every rank
        takes part in the gather)."""
        return self.logits_processor(hidden, logits_indices)
