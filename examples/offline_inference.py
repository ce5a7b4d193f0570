"""The main job: a batch of prompts through `LLM.generate`, on the built-in default model.

Run: python examples/offline_inference.py [--model PATH]
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
    args = ap.parse_args()

    llm = LLM(args.model, max_num_seqs=4)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=32)
    outputs = llm.generate(PROMPTS * 4, params)
    for out in outputs[: len(PROMPTS)]:
        print(f"Prompt: {out.prompt!r}\nGenerated: {out.outputs[0].text!r}\n")
    print("startup:", {k: round(v, 3) if isinstance(v, float) else v for k, v in llm.startup_report.items()})


if __name__ == "__main__":
    main()
