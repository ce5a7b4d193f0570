"""KV exhaustion: preemption by recompute happens, and no output changes."""

import numpy as np

from fdlite import LLM, SamplingParams


def test_preemption_keeps_outputs_identical(model_dirs):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 512, size=int(n)).tolist() for n in rng.integers(90, 200, size=12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(skip_tokenizer_init=True, max_num_seqs=8, block_size=16, max_model_len=256)

    ample = LLM(model_dirs["qwen2"], **common)
    expected = [o.outputs[0].token_ids for o in ample.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert ample.engine.scheduler.num_preemptions == 0

    # 24 blocks of 16 tokens = 384 slots for 8 running sequences of up to 240 tokens each.
    tight = LLM(model_dirs["qwen2"], num_gpu_blocks_override=24, **common)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics["num_preemptions"] for o in outs) == tight.engine.scheduler.num_preemptions
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.engine.allocator.num_free_blocks == 24  # every block came back
