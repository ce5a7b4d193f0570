"""The sampler's counter-based noise, in numpy: u(seed, position, round) in (0, 1).

The GPU sampler (fdl_sample in fdlite/ops/csrc/ops_sampling.cu) draws row s's token with
u(seed_s, position_s, 0); deriving the noise from the request's 64-bit seed and the token's position
(no generator state) makes the draw independent of the batch a request happens to share and of the
device. This module is the same function for the CPU side and the tests:

    splitmix64(z): z += 0x9E3779B97F4A7C15; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9;
                   z = (z ^ z >> 27) * 0x94D049BB133111EB; return z ^ z >> 31      (uint64 wraparound)
    u = ((splitmix64(seed ^ pos * 0x9E3779B97F4A7C15 ^ round * 0xD1B54A32D192ED03) >> 40) + 0.5) * 2^-24
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ROUND = np.uint64(0xD1B54A32D192ED03)


def splitmix64(z) -> np.ndarray:
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniform(seed, position, round_: int = 0) -> np.ndarray:
    """float32 in (0, 1); seed / position may be arrays (negative int64 seeds wrap like C's cast)."""
    s = np.asarray(seed, dtype=np.int64).astype(np.uint64)
    p = np.asarray(position, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = splitmix64(s ^ (p * _GOLDEN) ^ (np.uint64(round_ % 2**64) * _ROUND))
    return (((z >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)).astype(np.float32)
