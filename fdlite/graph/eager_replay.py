"""A stand-in for a CUDA graph that runs anywhere: "replay" runs the captured function again.

It keeps the properties the rest of the code relies on, and checks the one it cannot reproduce:
- the function reads only the runner's static input buffers, so a replay sees whatever was written
  into them;
- the output tensor keeps its address across replays (the new result is copied into the captured
  output in place);
- a real graph binds the addresses of its inputs when it is captured and reads that memory on every
  replay, whatever the Python names point to later. Re-running the function would read the current
  tensors instead and hide a buffer that was replaced by a new tensor rather than written in place.
  So `capture` records the identity and data pointer of every static input (`static_inputs()`), and
  `replay` raises if any of them changed: there, a real graph would have computed on stale data.
With it, the whole CUDA-graph path (buffers, padding, dispatch by size, the verify step, startup
order) runs in CPU tests. `FDLITE_CUDAGRAPH_BACKEND=eager` selects it on any device.
"""

from __future__ import annotations

from typing import Callable

import paddle


def _addresses(static_inputs: Callable[[], dict[str, paddle.Tensor]] | None) -> dict[str, tuple[int, int]]:
    if static_inputs is None:
        return {}
    return {name: (id(t), t.data_ptr()) for name, t in static_inputs().items()}


class EagerReplayGraph:
    def __init__(self) -> None:
        self._fn: Callable[[], paddle.Tensor] | None = None
        self._static_inputs: Callable[[], dict[str, paddle.Tensor]] | None = None
        self._bound: dict[str, tuple[int, int]] = {}
        self.output: paddle.Tensor | None = None

    def capture(self, fn: Callable[[], paddle.Tensor],
                static_inputs: Callable[[], dict[str, paddle.Tensor]] | None = None) -> paddle.Tensor:
        """Run `fn` once; bind the tensors `static_inputs()` names now, as a real capture binds addresses."""
        self._fn = fn
        self._static_inputs = static_inputs
        self._bound = _addresses(static_inputs)
        self.output = fn()
        return self.output

    def replay(self) -> paddle.Tensor:
        now = _addresses(self._static_inputs)
        moved = sorted(name for name, bound in self._bound.items() if now.get(name) != bound)
        if moved:
            raise RuntimeError(
                f"static graph inputs {moved} are not the tensors captured: a buffer was replaced instead of "
                "written in place, so a real CUDA graph would read the old memory (stale inputs)"
            )
        paddle.assign(self._fn(), output=self.output)
        return self.output

    def close(self) -> None:
        """Drop the captured function (it refers to the runner) and the output, as a real graph frees its pool."""
        self._fn = self._static_inputs = None
        self._bound = {}
        self.output = None
