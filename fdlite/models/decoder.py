"""The decoder-only transformer that Qwen2/2.5, Qwen3 and Llama 3 share, as Paddle layers.

The families differ in three switches (`DecoderSpec`): bias on q/k/v, RMSNorm on q and k per
head, and the rope scaling (read from config). Linear weights use Paddle's [in, out] layout (the
loader transposes the Hugging Face [out, in] tensors once), because Paddle's CPU matmul pays a
full copy for `transpose_y`; q/k/v and gate/up are fused into one matrix each (fewer kernel
launches per layer).

`forward(ids_remove_padding, forward_meta)` takes the flat token batch (FastDeploy's argument
names, which `support_graph_optimization` relies on) and returns hidden states per token.

With tensor parallelism (`TPPartition`) each rank builds the same layers at its own sizes: its
attention and KV heads, its MLP columns, its vocabulary rows (parallel_linear.py, vocab_parallel.py).
With one rank they are the whole model and no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
from paddle import nn

from fdlite.graph.decorator import support_graph_optimization
from fdlite.graph.graph_break import opaque_to_sot
from fdlite.models.model_config import ModelConfig
from fdlite.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from fdlite.models.tp_partition import TPPartition
from fdlite.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, gather_vocab
from fdlite.ops.activation import silu_and_mul
from fdlite.ops.attention import paged_attention as _paged_attention
from fdlite.ops.forward_meta import ForwardMeta
from fdlite.ops.norm import RMSNorm
from fdlite.ops.rotary import RotaryEmbedding

# Attention reads per-step Python batch structure; SOT must not translate it (see graph_break.py).
paged_attention = opaque_to_sot(_paged_attention)


@dataclass(frozen=True)
class DecoderSpec:
    qkv_bias: bool = False
    qk_norm: bool = False


class DecoderAttention(nn.Layer):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, layer_id: int, dtype: str, max_positions: int,
                 tp: TPPartition):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = tp.num_heads, tp.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                             spec.qkv_bias or cfg.attention_bias, dtype)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.attention_bias, dtype, tp.size)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = RotaryEmbedding(self.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)

    def forward(self, positions: paddle.Tensor, hidden: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = paddle.split(qkv, [self.q_size, self.kv_size, self.kv_size], axis=-1)
        q = q.reshape([-1, self.num_heads, self.head_dim])
        k = k.reshape([-1, self.num_kv_heads, self.head_dim])
        v = v.reshape([-1, self.num_kv_heads, self.head_dim])
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = meta.caches[self.layer_id]
        return self.o_proj(paged_attention(q, k, v, k_cache, v_cache, meta, self.scale))


class DecoderMLP(nn.Layer):
    def __init__(self, cfg: ModelConfig, dtype: str, tp: TPPartition):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * tp.intermediate_size, cfg.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(tp.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, tp.size)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Layer):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, layer_id: int, dtype: str, max_positions: int,
                 tp: TPPartition):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DecoderAttention(cfg, spec, layer_id, dtype, max_positions, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = DecoderMLP(cfg, dtype, tp)

    def forward(self, positions, hidden, meta):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@support_graph_optimization
class DecoderModel(nn.Layer):
    """Embedding, layers, final norm: the part a graph backend translates and captures."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, dtype: str, max_positions: int, tp: TPPartition):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.hidden_size, dtype, tp)
        self.layers = nn.LayerList([DecoderLayer(cfg, spec, i, dtype, max_positions, tp)
                                    for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, ids_remove_padding: paddle.Tensor, positions: paddle.Tensor, forward_meta: ForwardMeta):
        hidden = self.embed_tokens(ids_remove_padding)
        for layer in self.layers:
            hidden = layer(positions, hidden, forward_meta)
        return self.norm(hidden)


class DecoderForCausalLM(nn.Layer):
    """A decoder plus its LM head (tied to the embedding when the config says so)."""

    spec = DecoderSpec()

    def __init__(self, cfg: ModelConfig, dtype: str, max_positions: int, tp: TPPartition | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp or TPPartition.single(cfg)
        # Parameters are created empty: `load_weights` fills every one from the checkpoint (drawing random
        # initial values first took 8 of Qwen3-0.6B's 13 s of loading on CPU).
        with paddle.LazyGuard():
            self.model = DecoderModel(cfg, self.spec, dtype, max_positions, self.tp)
            self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, dtype, self.tp)
        # Tied head on CPU: a transposed copy of the embedding (see module docstring); on GPU the
        # matmul reads the embedding transposed for free.
        self._tied_head_t: paddle.Tensor | None = None

    def finalize_weights(self) -> None:
        """Called once after loading."""
        if self.lm_head is None and paddle.get_device() == "cpu":
            self._tied_head_t = self.model.embed_tokens.weight.t().contiguous()

    def forward(self, ids_remove_padding, positions, forward_meta):
        return self.model(ids_remove_padding=ids_remove_padding, positions=positions, forward_meta=forward_meta)

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Logits over the whole vocabulary, float32 (every rank takes part in the gather)."""
        return gather_vocab(self._local_logits(hidden), self.tp).astype("float32")

    def _local_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self._tied_head_t is not None:
            logits = paddle.matmul(hidden, self._tied_head_t)
        else:
            logits = paddle.matmul(hidden, self.model.embed_tokens.weight, transpose_y=True)
        return logits
