"""OpenAI batch files: request lines in, `chat.completion` / `text_completion` result lines out.

An input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`, the
format of OpenAI's Batch API that vLLM's and FastDeploy's `run-batch` read too. Its body becomes the same
`JobRequest` a plain JSONL line does (`messages` or `prompt`, sampling fields mapped onto
`SamplingParams`), so resume, data parallelism and the summary work unchanged; only the two ends differ.

Nothing a single line holds may stop the job: a line that cannot run becomes an error object in the
output, in OpenAI's shapes. A problem with the batch line itself (invalid JSON, `custom_id` missing or
used twice, an unknown `url`) is `{"response": null, "error": {"code", "message"}}`, as OpenAI reports a
request it never sent; a problem with the body (an unsupported field, a bad value) is the HTTP 400 the
endpoint would have answered, `{"response": {"status_code": 400, "body": {"error": {...}}}, "error": null}`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fdlite.jobs.job_input import JobRequest, LineError
from fdlite.outputs import RequestOutput
from fdlite.sampling_params import SamplingParams, StructuredOutputsParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
_LINE_KEYS = ("custom_id", "method", "url", "body")

# Body fields that map one to one onto SamplingParams.
_SAMPLING_FIELDS = ("temperature", "top_p", "n", "stop", "seed", "frequency_penalty", "presence_penalty", "logit_bias")
# Accepted and without effect on what runs: fdlite serves one model and writes files, it does not stream.
_IGNORED_FIELDS = ("model", "user")
_COMMON_FIELDS = _SAMPLING_FIELDS + _IGNORED_FIELDS + ("max_tokens", "stream", "response_format")
_FIELDS = {
    CHAT_URL: _COMMON_FIELDS + ("messages", "max_completion_tokens", "logprobs", "top_logprobs"),
    COMPLETIONS_URL: _COMMON_FIELDS + ("prompt", "logprobs"),
}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs (chat) and logprobs (completions: 5)


class BodyError(ValueError):
    """A request body fdlite cannot run; `param` is the field at fault."""

    def __init__(self, param: str | None, message: str):
        self.param = param
        super().__init__(message)


def apply_response_format(value: Any, params: SamplingParams) -> SamplingParams:
    """`params` constrained by OpenAI's `response_format` (json_schema, json_object; text: unchanged), through
    fdlite's structured outputs; a format fdlite cannot compile is a 400 naming `response_format`."""
    try:
        constraint = StructuredOutputsParams.from_response_format(value)
        return params if constraint is None else dataclasses.replace(params, structured_outputs=constraint)
    except ValueError as e:
        raise BodyError("response_format", f"invalid 'response_format': {e}") from None


def read_batch_requests(rows: Iterator[tuple[int, dict | LineError]],
                        defaults: SamplingParams) -> Iterator[JobRequest | LineError]:
    """Turn the rows of a JSON-lines reader into requests or OpenAI-shaped line errors, in file order."""
    base = defaults.to_dict()
    first_line: dict[str, int] = {}
    for line, row in rows:
        if isinstance(row, LineError):
            yield LineError(row.line, None, row.reason, code="invalid_json_line")
            continue
        custom_id = row.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            yield LineError(line, custom_id if isinstance(custom_id, (str, int)) else None,
                            f"'custom_id' must be a non-empty string, got {custom_id!r}", code="invalid_custom_id")
            continue
        if custom_id in first_line:
            yield LineError(line, custom_id, f"duplicate custom_id {custom_id!r} (first used on line "
                                             f"{first_line[custom_id]}); custom_id must be unique in a batch",
                            code="duplicate_custom_id")
            continue
        first_line[custom_id] = line
        unknown = [k for k in row if k not in _LINE_KEYS]
        if unknown:
            yield LineError(line, custom_id, f"unknown key {unknown[0]!r} in the batch line (keys: "
                                             f"{', '.join(_LINE_KEYS)})", code="invalid_request_line")
            continue
        if row.get("method", "POST") != "POST":
            yield LineError(line, custom_id, f"method must be \"POST\", got {row.get('method')!r}",
                            code="invalid_method")
            continue
        url = row.get("url")
        if url not in URLS:
            yield LineError(line, custom_id, f"unsupported url {url!r}; fdlite runs {' and '.join(URLS)}",
                            code="invalid_url")
            continue
        body = row.get("body")
        if not isinstance(body, dict):
            yield LineError(line, custom_id, "'body' must be a JSON object", code="invalid_body")
            continue
        try:
            prompt, messages, params, options = _parse_body(url, body, defaults, base)
        except BodyError as e:
            yield LineError(line, custom_id, str(e), code="invalid_request_error", param=e.param or "")
            continue
        yield JobRequest(line, custom_id, prompt, messages, params, url=url, options=options)


def _parse_body(url: str, body: dict, defaults: SamplingParams, base: dict[str, Any]):
    allowed = _FIELDS[url]
    for key in body:
        if key not in allowed:
            raise BodyError(key, f"unsupported field {key!r} for {url}; fdlite supports: {', '.join(allowed)}")
    if body.get("stream") not in (None, False):
        raise BodyError("stream", "'stream': true is not supported in a batch file")
    overrides = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
        raise BodyError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            overrides["max_tokens"] = body[key]
    options: dict[str, Any] = {"model": body.get("model") if isinstance(body.get("model"), str) else None,
                               "logprobs": None}
    prompt, messages = None, None
    if url == CHAT_URL:
        messages = _messages(body.get("messages"))
        if body.get("logprobs"):
            top = body.get("top_logprobs") or 0
            _check_int("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
            overrides["logprobs"] = top
            options["logprobs"] = "chat"
        elif body.get("top_logprobs") is not None:
            raise BodyError("top_logprobs", "top_logprobs needs logprobs: true")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # a list of one prompt: the same request
        if not isinstance(prompt, str) or not prompt:
            raise BodyError("prompt", "'prompt' must be a non-empty string (one prompt per batch line)")
        if body.get("logprobs") is not None:
            _check_int("logprobs", body["logprobs"], 0, 5)
            overrides["logprobs"] = body["logprobs"]
            options["logprobs"] = "completion"
    try:
        params = SamplingParams.from_dict({**base, **overrides}) if overrides else defaults
    except ValueError as e:
        raise BodyError(next((k for k in overrides if k in str(e)), None), str(e)) from None
    if body.get("response_format") is not None:
        params = apply_response_format(body["response_format"], params)
    return prompt, messages, params, options


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BodyError(name, f"'{name}' must be an integer from {lo} to {hi}, got {value!r}")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BodyError("messages", "'messages' must be a non-empty array of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BodyError(f"messages[{i}]", f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BodyError(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise BodyError(f"messages[{i}].content", f"messages[{i}].content must be a string")
        out.append({**m, "content": content or ""})
    return out


# ---- output lines --------------------------------------------------------------------------------------


def _hex() -> str:
    return uuid.uuid4().hex


def result_line(req: JobRequest, out: RequestOutput, model: str) -> dict[str, Any]:
    """The batch output line of a finished request: a 200 response holding the OpenAI body."""
    chat = req.url == CHAT_URL
    logprobs_kind = (req.options or {}).get("logprobs")
    choices = []
    for c in out.outputs:
        lp = _logprobs(c, logprobs_kind, req.sampling.logprobs or 0) if logprobs_kind else None
        if chat:
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            choices.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + _hex(),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": (req.options or {}).get("model") or model,
        "choices": choices,
        "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(out.prompt_token_ids) + completion_tokens},
    }
    return {"id": "batch_req_" + _hex(), "custom_id": req.id,
            "response": {"status_code": 200, "request_id": "req_" + _hex(), "body": body}, "error": None}


def error_line(custom_id: Any, message: str, code: str | None = None, param: str | None = None,
               status_code: int | None = None) -> dict[str, Any]:
    """The batch output line of a request that did not run (see the module docstring for the two shapes)."""
    line = {"id": "batch_req_" + _hex(), "custom_id": custom_id, "response": None, "error": None}
    if status_code is None:
        line["error"] = {"code": code, "message": message}
    else:
        kind = "invalid_request_error" if status_code == 400 else "server_error"
        line["response"] = {"status_code": status_code, "request_id": "req_" + _hex(),
                            "body": {"error": {"message": message, "type": kind, "param": param or None,
                                               "code": None}}}
    return line


def line_error_line(err: LineError) -> dict[str, Any]:
    """The output line of an input line that cannot run."""
    if err.param is not None:
        return error_line(err.id, err.reason, param=err.param, status_code=400)
    return error_line(err.id, err.reason, code=err.code or "invalid_request_line")


def record_tokens(rec: dict[str, Any]) -> tuple[int, int]:
    """(prompt, output) tokens of an output line of either format (progress and summaries read them)."""
    if "custom_id" in rec:
        usage = ((rec.get("response") or {}).get("body") or {}).get("usage") or {}
        return usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return rec.get("prompt_tokens", 0), rec.get("output_tokens", 0)


def _logprobs(c, kind: str, k: int) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    entries = []
    for tok_id, step in zip(c.token_ids, c.logprobs):
        chosen = step.get(tok_id)
        # The step holds the top k and the sampled token, which may rank below them.
        top = sorted(step.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)[:k]
        entries.append((chosen, top))
    if kind == "chat":
        def item(lp):
            text = lp.decoded_token or ""
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(chosen), "top_logprobs": [item(t) for t in top]}
                            for chosen, top in entries if chosen is not None]}
    offsets, pos = [], 0
    for chosen, _ in entries:
        offsets.append(pos)
        pos += len((chosen.decoded_token or "") if chosen else "")
    return {"tokens": [ch.decoded_token if ch else None for ch, _ in entries],
            "token_logprobs": [ch.logprob if ch else None for ch, _ in entries],
            "top_logprobs": [{t.decoded_token: t.logprob for t in top} for _, top in entries],
            "text_offset": offsets}
