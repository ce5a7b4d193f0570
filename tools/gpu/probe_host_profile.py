import cProfile, pstats, sys, os, tempfile, time, io
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import host_overhead as h
d = tempfile.mkdtemp(); h.write_models(d, [151936], h.TINY_GPU)
from fdlite import LLM, SamplingParams
for async_ in (False, True):
    llm = LLM(os.path.join(d, "vocab151936"), max_num_seqs=256, max_model_len=128, seed=0, async_scheduling=async_)
    ps = [{"prompt_token_ids": list(range(10, 26))} for _ in range(256)]
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64, ignore_eos=True)
    llm.generate(ps, sp, use_tqdm=False)
    t = time.perf_counter(); llm.generate(ps, sp, use_tqdm=False); w = time.perf_counter() - t
    st = llm.last_generate_stats
    print(f"async={async_}: {w / st['num_steps'] * 1e3:.3f} ms per step over {st['num_steps']} steps")
    pr = cProfile.Profile(); pr.enable(); llm.generate(ps, sp, use_tqdm=False); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
    llm.close()
