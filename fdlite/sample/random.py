"""Counter-based random numbers for sampling: a uniform from (seed, position, round), no generator state.

Why: a request's draws must not depend on what else shares its batch, on preemption, or on which
device samples. Deriving each uniform by hashing (the sequence's 64-bit seed, the position of the
token being sampled, the draw's round) gives that with nothing to store, advance or copy per step
(vLLM v1 does the same on the GPU for its Gumbel noise). The hash is splitmix64's finaliser; the
CUDA sampler (fdlite/kernels/csrc/ops_sampling.cu) computes the same function, so CPU and GPU draw the
same uniforms (the kernel rounds to float32: `uniforms(..., dtype=np.float32)` is its value exactly):

    splitmix64(z): z += 0x9E3779B97F4A7C15; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9;
                   z = (z ^ z >> 27) * 0x94D049BB133111EB; return z ^ z >> 31      (uint64 wraparound)
    u = ((splitmix64(seed ^ pos * 0x9E3779B97F4A7C15 ^ round * 0xD1B54A32D192ED03) >> 40) + 0.5) * 2^-24
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ROUND = np.uint64(0xD1B54A32D192ED03)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 of each uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):  # the wrap is the point (numpy warns on scalar overflow)
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: np.ndarray, positions: np.ndarray, round_: int = 0, dtype=np.float64) -> np.ndarray:
    """One uniform in (0, 1) per row: a function of (seed, position, round) alone.

    Seeds may be uint64 or signed (a negative int64 counts as its uint64 bits, like C's cast). dtype
    float32 gives the CUDA sampler's own value (`((float)bits + 0.5f) * 2^-24`, rounded in float32),
    bit for bit; float64 keeps the 24 bits exactly.
    """
    s = np.asarray(seeds)
    s = s if s.dtype == np.uint64 else s.astype(np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = s ^ (np.asarray(positions).astype(np.int64).astype(np.uint64) * _GOLDEN) ^ (np.uint64(round_ % 2**64) * _ROUND)
        bits = splitmix64(z) >> np.uint64(40)  # the top 24 bits
    if dtype == np.float32:
        return ((bits.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)).astype(np.float32)
    return (bits.astype(np.float64) + 0.5) * 2.0**-24


def sequence_seed(seed: int | None, child_index: int, fallback: np.random.Generator) -> int:
    """The 64-bit seed of completion `child_index` of a request.

    Seeded requests: a function of (seed, child_index) alone, so results repeat and the n
    completions differ; a negative seed counts as its uint64 fold (seed mod 2**64). Unseeded: drawn
    from `fallback` (the LLM's own generator, itself seeded by the `seed` option).
    """
    if seed is None:
        return int(fallback.integers(0, 2**64, dtype=np.uint64))
    with np.errstate(over="ignore"):
        mixed = splitmix64(np.asarray([seed % 2**64], np.uint64) ^ splitmix64(np.asarray([child_index], np.uint64)))
    return int(mixed[0])
