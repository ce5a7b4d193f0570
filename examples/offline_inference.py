"""The main job: a batch of prompts through `LLM.generate`, on the built-in default model.

Run: python examples/offline_inference.py [--model PATH]
Several GPUs (one process each, rank 0 prints):
    python -m paddle.distributed.launch --gpus 0,1 examples/offline_inference.py --tensor-parallel-size 2
The default model has random weights (see README), so its text is gibberish; the pipeline is real.
"""

import argparse

from fdlite import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "Write a haiku about the sea:",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model folder (HF layout); default: the built-in model.")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="Processes (GPUs) to split the model across; start them with paddle.distributed.launch.")
    args = ap.parse_args()

    llm = LLM(args.model, max_num_seqs=4, tensor_parallel_size=args.tensor_parallel_size)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=32)
    outputs = llm.generate(PROMPTS * 4, params)  # [] on ranks other than 0
    for out in outputs[: len(PROMPTS)]:
        print(f"Prompt: {out.prompt!r}\nGenerated: {out.outputs[0].text!r}\n")
    if llm.is_driver:
        print("startup:", {k: round(v, 3) if isinstance(v, float) else v for k, v in llm.startup_report.items()})


if __name__ == "__main__":
    main()
