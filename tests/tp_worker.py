"""One rank of a tensor-parallel test run: `python -m paddle.distributed.launch --nproc_per_node 2 tp_worker.py SPEC OUT`.

SPEC is a JSON list of cases ({name, model, options, prompts, sampling, rank_options, rank_prompts});
each rank builds an `LLM` per case in turn (the process group is set up once, by the first) and writes
OUT/<name>.rank<r>.json with what the test checks: the tokens rank 0 returned, how many outputs the
other ranks got, the agreed KV block count, the KV heads each rank holds, the all-reduce backend, the
log lines about the custom all-reduce, SOT translations and calls, CUDA-graph use and how many
all-reduces ran inside graph capture, or the error a case raised.
"""

import json
import logging
import os
import sys

from fdlite import LLM, SamplingParams
from fdlite.graph.static_graph import translation_count
from fdlite.kernels.allreduce import is_capturing_custom_allreduce
from fdlite.distributed.communicator import Communicator

ALL_REDUCES = {"total": 0, "capturing": 0}
_real_all_reduce = Communicator.all_reduce


def _counting_all_reduce(self, x):
    ALL_REDUCES["total"] += 1
    ALL_REDUCES["capturing"] += int(is_capturing_custom_allreduce())
    return _real_all_reduce(self, x)


Communicator.all_reduce = _counting_all_reduce


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_case(case: dict, rank: int) -> dict:
    options = {**case.get("options", {}), **case.get("rank_options", {}).get(str(rank), {})}
    prompts = case.get("rank_prompts", {}).get(str(rank), case["prompts"])
    log = Lines()
    logging.getLogger("fdlite").addHandler(log)
    ALL_REDUCES.update(total=0, capturing=0)
    try:
        llm = LLM(case["model"], skip_tokenizer_init=True, **options)
        before = translation_count()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**case["sampling"]),
                            use_tqdm=False)
    except ValueError as e:
        return {"error": str(e)}
    finally:
        logging.getLogger("fdlite").removeHandler(log)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "num_outputs": len(outs),
        # Prompt and sample logprobs as [[token id, logprob] ...] per position (prompt: the first is None).
        "prompt_logprobs": [[None if d is None else sorted([t, lp.logprob] for t, lp in d.items())
                             for d in o.prompt_logprobs] for o in outs if o.prompt_logprobs is not None],
        "logprobs": [[sorted([t, lp.logprob] for t, lp in d.items()) for d in o.outputs[0].logprobs]
                     for o in outs if o.outputs[0].logprobs is not None],
        "is_driver": llm.is_driver,
        "num_blocks": llm.num_blocks,
        "backend": llm.runner.comm.backend,
        "kv_heads_here": llm.runner.tp.num_kv_heads,
        "kv_head_start": llm.runner.tp.kv_head_start,
        "custom_all_reduce_lines": [m for m in log.lines if "custom all-reduce" in m],
        "sot_translations": llm.startup_report["sot_translations"],
        "sot_translations_during_run": translation_count() - before,
        "sot_calls": llm.last_generate_stats["sot_calls"],
        "num_steps": llm.last_generate_stats["num_steps"],
        "cudagraph_sizes": llm.startup_report["cudagraph_sizes"],
        "cudagraph_replays": llm.runner.graph_runner.num_replays if llm.runner.graph_runner else 0,
        "all_reduces": dict(ALL_REDUCES),
    }


def main() -> None:
    spec, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    with open(spec) as f:
        cases = json.load(f)
    for case in cases:
        result = run_case(case, rank)
        with open(os.path.join(out_dir, f"{case['name']}.rank{rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
