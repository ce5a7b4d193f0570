"""Structured outputs: decode step time on CPU with 0%, 50% and 100% of a batch of 64 constrained by a nested
JSON schema, and where the grammar's time goes.

One `LLM` (built-in default model, `max_num_seqs=64`), one batch of 64 requests per share, greedy, 48 output
tokens. Constrained requests use a nested schema (objects, arrays, enums, numbers, required) with JSON's
flexible whitespace, so a random-weight model rarely completes it and the batch stays at 64 rows for every
step (the table says how many finished early). Timers wrap the pieces the grammar adds:

- fill: llguidance computing the bitmask of the constrained rows (worker thread, beside the forward);
- wait: how long the sampler waited for that bitmask after the forward (the part the forward did not hide);
- apply: unpacking the bitmask and setting disallowed logits to -inf (`apply_token_bitmask`);
- adjust: all of `adjust_logits` (the copy of the logits it makes, the mask, the bans);
- sample: the whole sampler call; advance: feeding each row's token to its matcher.

    python benchmarks/structured_outputs.py [--batch 64] [--tokens 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fdlite import LLM, SamplingParams  # noqa: E402
from fdlite.sample import sampler as sampler_mod  # noqa: E402
from fdlite.runner import engine as engine_mod  # noqa: E402
from fdlite.sampling_params import StructuredOutputsParams  # noqa: E402
from fdlite.structured import matcher as matcher_mod  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "owner": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city"]}},
            "required": ["name", "address"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty"]}},
    },
    "required": ["id", "name", "status", "owner", "items"],
}

TIMES: dict[str, float] = defaultdict(float)


def _timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name] += time.perf_counter() - t
    return wrapper


class _TimedFuture:
    def __init__(self, future):
        self.future = future

    def result(self):
        t = time.perf_counter()
        out = self.future.result()
        TIMES["wait"] += time.perf_counter() - t
        return out


def instrument(llm: LLM) -> None:
    sampler_mod.apply_token_bitmask = _timed("apply", sampler_mod.apply_token_bitmask)
    sampler_mod.adjust_logits = _timed("adjust", sampler_mod.adjust_logits)
    llm.runner.sampler._forward = _timed("sample", llm.runner.sampler._forward)
    filler = llm.runner.bitmasks
    filler.fill = _timed("fill", filler.fill)
    start = filler.start
    filler.start = lambda *a: _TimedFuture(start(*a))
    engine_mod.Engine._advance_grammars = _timed("advance", engine_mod.Engine._advance_grammars)
    _ = matcher_mod  # the filler's fill runs in its worker thread; its timer adds there


def run(llm: LLM, share: float, batch: int, tokens: int) -> dict:
    so = StructuredOutputsParams(json=SCHEMA)
    n_con = round(share * batch)
    params = [SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=so) for _ in range(n_con)]
    params += [SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True) for _ in range(batch - n_con)]
    prompts = [f"Record {i}: write it as JSON." for i in range(batch)]
    TIMES.clear()
    steps_before = llm.engine.num_steps
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    steps = llm.engine.num_steps - steps_before
    early = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    return {"share": share, "constrained": n_con, "steps": steps, "ms_per_step": 1e3 * elapsed / steps,
            "early": early, **{k: 1e3 * v / steps for k, v in TIMES.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(max_num_seqs=args.batch, max_model_len=256)
    instrument(llm)
    run(llm, 1.0, 8, 4)  # warm-up: the llguidance tokenizer and the schema's matcher are built once
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; batch {args.batch}, "
          f"{args.tokens} tokens, greedy")
    cols = ["ms_per_step", "sample", "adjust", "apply", "fill", "wait", "advance"]
    print("| constrained | steps | finished early | " + " | ".join(f"{c} (ms/step)" for c in cols) + " |")
    print("|---" * (3 + len(cols)) + "|")
    for share in (0.0, 0.5, 1.0):
        best = min((run(llm, share, args.batch, args.tokens) for _ in range(args.repeats)),
                   key=lambda r: r["ms_per_step"])
        print(f"| {best['constrained']}/{args.batch} | {best['steps']} | {best['early']} | "
              + " | ".join(f"{best.get(c, 0.0):.1f}" for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
