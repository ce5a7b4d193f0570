"""How a model splits across tensor-parallel ranks: the one place for the arithmetic.

The layers take their per-rank sizes from here and the weight loader takes the checkpoint slices
each rank reads, so the two cannot disagree.

- Attention heads split evenly (num_attention_heads % tp == 0).
- KV heads split evenly when there are at least tp of them (kv_heads % tp == 0). With fewer, each
  is replicated: rank r holds the single KV head r // (tp // kv_heads), which is the one its query
  heads read under GQA (query head j reads KV head j // (heads / kv_heads)).
- The MLP's intermediate size splits evenly, and so does each routed expert's and the shared experts'
  (every rank holds a slice of every expert; expert parallelism, whole experts per rank, is not
  implemented yet).
- The vocabulary splits in ceil(vocab / tp) rows per rank; the last rank's missing rows are zero
  padding that the LM head's gather cuts away, so no vocabulary size is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from fdlite.models.model_config import ModelConfig


@dataclass(frozen=True)
class TPPartition:
    rank: int
    size: int
    head_dim: int
    num_heads: int           # attention heads on this rank
    num_kv_heads: int        # KV heads on this rank
    kv_head_start: int       # first checkpoint KV head this rank holds
    intermediate_size: int   # MLP columns on this rank
    vocab_size: int          # the model's full vocabulary
    vocab_per_rank: int      # embedding / LM-head rows on this rank (with padding)

    @classmethod
    def single(cls, cfg: ModelConfig) -> TPPartition:
        return cls.of(cfg, 0, 1)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> TPPartition:
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        problems = []
        if heads % size:
            problems.append(f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({size})")
        if kv >= size and kv % size:
            problems.append(f"num_key_value_heads ({kv}) is not divisible by tensor_parallel_size ({size})")
        if kv < size and size % kv:
            problems.append(f"tensor_parallel_size ({size}) is not a multiple of num_key_value_heads ({kv}), "
                            "so KV heads cannot be replicated evenly")
        if cfg.intermediate_size % size:
            problems.append(f"intermediate_size ({cfg.intermediate_size}) is not divisible by "
                            f"tensor_parallel_size ({size})")
        if cfg.moe_intermediate_size % size:
            problems.append(f"moe_intermediate_size ({cfg.moe_intermediate_size}) is not divisible by "
                            f"tensor_parallel_size ({size})")
        if problems:
            raise ValueError(f"{cfg.architecture} cannot be split across {size} ranks: " + "; ".join(problems))
        if kv >= size:
            num_kv, kv_start = kv // size, rank * (kv // size)
        else:
            num_kv, kv_start = 1, rank // (size // kv)
        return cls(rank=rank, size=size, head_dim=cfg.head_dim, num_heads=heads // size, num_kv_heads=num_kv,
                   kv_head_start=kv_start, intermediate_size=cfg.intermediate_size // size,
                   vocab_size=cfg.vocab_size, vocab_per_rank=-(-cfg.vocab_size // size))

    @property
    def q_range(self) -> tuple[int, int]:
        """This rank's rows of q_proj (columns of o_proj) in the checkpoint."""
        n = self.num_heads * self.head_dim
        return self.rank * n, (self.rank + 1) * n

    @property
    def kv_range(self) -> tuple[int, int]:
        """This rank's rows of k_proj / v_proj in the checkpoint."""
        return self.kv_head_start * self.head_dim, (self.kv_head_start + self.num_kv_heads) * self.head_dim

    @property
    def intermediate_range(self) -> tuple[int, int]:
        return self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size

    def shard(self, full: int) -> tuple[int, int]:
        """This rank's even share [start, stop) of a dimension of `full` (checked divisible in `of`)."""
        n = full // self.size
        return self.rank * n, (self.rank + 1) * n

    @property
    def vocab_range(self) -> tuple[int, int]:
        """This rank's embedding rows in the checkpoint (the last rank's may be short of vocab_per_rank)."""
        start = self.rank * self.vocab_per_rank
        return min(start, self.vocab_size), min(start + self.vocab_per_rank, self.vocab_size)
