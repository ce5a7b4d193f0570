"""`model` may be a folder or a model id ("Qwen/Qwen3-0.6B", "baidu/ERNIE-4.5-0.3B-PT"), as in vLLM and FastDeploy.

An existing folder always wins (a relative folder named like an id included). Anything that looks like
a path (absolute, `./`, `~`, more than one `/`) is a folder, and a missing one fails later with
"has no config.json". An id is looked up in the local Hugging Face cache first (`huggingface_hub`,
which `tokenizers` already installs; `HF_HUB_CACHE` / `HF_HOME` say where), downloaded through it
when the network is allowed (`HF_HUB_OFFLINE` unset), and otherwise refused with a message that says
where fdlite looked and how to point at a folder. Only the files fdlite reads are fetched (config,
weights, tokenizer and chat-template files), not e.g. a repository's PyTorch `.bin` duplicates.
FastDeploy's other sources (AIStudio, ModelScope) are not wired in: their clients are not light.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger("fdlite")

_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What fdlite reads from a model folder (model_config, weight_loader, tokenizer).
FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]


def is_model_id(model: str) -> bool:
    """True for `org/name`; False for anything path-like (see the module docstring)."""
    return bool(_ID.match(model)) and not model.startswith((".", "~"))


def resolve_model(model: str, weights: bool = True) -> str:
    """The local folder of `model`: itself when it is a folder (or path-like), else the cached or
    downloaded snapshot of the Hugging Face model id. weights=False (`load_format="dummy"`): the
    snapshot's config and tokenizer files suffice, and no weight file is fetched."""
    if os.path.isdir(model) or not is_model_id(model):
        return model
    from huggingface_hub import constants, snapshot_download  # noqa: PLC0415 - only ids need it
    from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415

    cache = constants.HF_HUB_CACHE
    patterns = FILE_PATTERNS if weights else [p for p in FILE_PATTERNS if p != "*.safetensors"]
    try:
        return snapshot_download(model, allow_patterns=patterns, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    hint = (f"model {model!r} is not a folder and not in the Hugging Face cache ({cache}, set by HF_HUB_CACHE "
            f"or HF_HOME)")
    how = (f"; pass the path of a model folder (config.json, *.safetensors, tokenizer files), or fetch it with "
           f"`huggingface-cli download {model}` where the network is reachable")
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"{hint}, and HF_HUB_OFFLINE is set, so nothing was downloaded{how}") from None
    logger.info("downloading %s from the Hugging Face Hub into %s", model, cache)
    try:
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as e:  # noqa: BLE001 - network, auth and not-found errors all end the same way
        raise FileNotFoundError(f"{hint}, and the download failed ({type(e).__name__}: {e}){how}") from e
