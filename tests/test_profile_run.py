"""The profiling run on CPU: a small prefill of several sequences, not the full step budget (nothing is measured there)."""

from fdlite import LLM
from fdlite.runner.dummy_batch import small_prefill_lengths


def test_small_prefill_lengths():
    assert small_prefill_lengths(8, 2048, 64, 2048) == [65, 33, 2]  # three rows, the first over two blocks
    assert small_prefill_lengths(1, 2048, 64, 2048) == [65]
    assert small_prefill_lengths(8, 40, 64, 2048) == [40, 33, 2]  # no row above max_model_len
    assert small_prefill_lengths(8, 2048, 64, 70) == [65, 5]  # within the step's token budget
    assert small_prefill_lengths(2, 2048, 16, 2) == [2]


def test_cpu_profile_run_is_small_and_runs(model_dirs):
    llm = LLM(model_dirs["qwen2"], max_num_seqs=64, max_model_len=512, block_size=16, skip_tokenizer_init=True)
    assert llm.runner.profile_lengths() == [17, 9, 2]
    assert llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
