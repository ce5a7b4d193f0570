"""Structured outputs: a grammar per request (JSON schema, regex, choice, Lark/EBNF) turned into a token mask.

`grammar.py` compiles a `StructuredOutputsParams` to llguidance's grammar text and checks it, with no
tokenizer (so `SamplingParams` can fail at construction); `matcher.py` holds the tokenizer-bound side: one
compiled matcher per distinct constraint, a copy per sequence, and the per-step bitmask of the constrained
rows. The sampler applies the bitmask (`fdlite/sample/sampler.py`, `apply_token_bitmask`).
"""
