"""The OpenAI wire format: request bodies -> (prompt ids, DecodeOptions fields), results -> response bodies.

Validation names the offending field in an OpenAI-style error body
(``{"error": {"message", "type", "param", "code"}}``). Supported beside the OpenAI fields, in the request body
(with the ``openai`` client: ``extra_body={...}``): the FBS decoding options ``tau``, ``kv_policy``,
``batch_policy``, ``force_compute``, ``never_skip``, ``protect_structure``, ``structure_tau``, ``validator``,
``fallback_tau``, ``gate_sampling``, ``kv_cache`` / ``kv_budget`` (a KV cache policy under a budget), ``kv_dtype``
(the cache's storage: fp32, fp16, bf16), ``prefill_chunk`` (prompt tokens per prefill chunk), ``prefill`` (the
prompt's products: fp32, int8), and vLLM's ``top_k``,
``min_tokens``, ``ignore_eos``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from ..engine import VALIDATORS, DecodeOptions
from ..engine.defaults import KV_DTYPE_CHOICES, PREFILL_CHOICES
from ..engine.kvpolicy import POLICIES, make_policy


class APIError(Exception):
    """An error the client gets as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param)


@dataclasses.dataclass
class ServeContext:
    """What validation needs to know about the served model."""

    model_name: str
    tokenizer: object
    context_length: int   # prompt + max_tokens per request
    max_tokens: int       # largest max_tokens a request may ask for
    num_layers: int


@dataclasses.dataclass
class Parsed:
    """A validated request."""

    prompt: list[int]
    options: dict                 # DecodeOptions fields
    stream: bool
    include_usage: bool
    stop: list[str]
    chat: bool


# fields accepted and ignored when they have their neutral value, refused otherwise
_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
            "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None, "tool_choice": None,
            "functions": None, "function_call": None, "parallel_tool_calls": None}
_IGNORED = {"user", "metadata", "store", "service_tier"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "stream", "stream_options", "stop", "seed",
           "tau", "kv_policy", "batch_policy", "force_compute", "never_skip", "protect_structure", "structure_tau",
           "validator", "fallback_tau", "gate_sampling", "top_k", "min_tokens", "ignore_eos", "lossless",
           "kv_cache", "kv_budget", "kv_dtype", "prefill_chunk", "prefill"}
_FIELDS = {False: _COMMON | {"prompt"}, True: _COMMON | {"messages", "max_completion_tokens", "response_format"}}


# --------------------------------------------------------------------------- field readers
def _number(body: dict, name: str, default, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise bad(name, f"'{name}' must be {kind}, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(name, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad(name, f"'{name}' must be <= {hi}, got {v}")
    return v


def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be true or false, got {v!r}")
    return v


def _choice(body: dict, name: str, choices) -> str | None:
    v = body.get(name)
    if v is not None and v not in choices:
        raise bad(name, f"'{name}' must be one of {', '.join(map(repr, choices))}, got {v!r}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise bad("stop", "'stop' must be a non-empty string or a list of at most 16 non-empty strings")
    return stops


def _check_fields(body: dict, chat: bool) -> None:
    for name, v in body.items():
        if name in _NEUTRAL:
            if v not in (_NEUTRAL[name], None) and not (name == "logit_bias" and v == {}):
                raise bad(name, f"'{name}'={v!r} is not supported by this server")
        elif name not in _FIELDS[chat] and name not in _IGNORED:
            raise bad(name, f"unknown field '{name}'")


def _model(body: dict, ctx: ServeContext) -> None:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad("model", "'model' is required: the name of a model from GET /v1/models")
    if name != ctx.model_name:
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{ctx.model_name}'", "model",
                       code="model_not_found")


# --------------------------------------------------------------------------- prompts
def _completion_prompt(body: dict, ctx: ServeContext) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if ctx.tokenizer is None:
            raise bad("prompt", "this model has no tokenizer: send the prompt as a list of token ids")
        ids = list(ctx.tokenizer(p)["input_ids"])
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = p
    elif isinstance(p, list) and len(p) > 1:
        raise bad("prompt", "one prompt per request: this server does not take a batch of prompts")
    else:
        raise bad("prompt", "'prompt' must be a non-empty string or a non-empty list of token ids")
    if not ids:
        raise bad("prompt", "the prompt tokenized to nothing")
    return ids


def _message_text(i: int, m) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad(f"messages[{i}]", "each message must be an object with a 'role' and a 'content'")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
            raise bad(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content", "'content' must be a string or a list of text parts")
    return {"role": m["role"], "content": content}


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, with the assistant turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _chat_prompt(body: dict, ctx: ServeContext) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    msgs = [_message_text(i, m) for i, m in enumerate(msgs)]
    if ctx.tokenizer is None or not getattr(ctx.tokenizer, "chat_template", None):
        raise bad("messages", "this model's tokenizer has no chat template: use /v1/completions")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("response_format", "only response_format {'type': 'text'} is supported")
    try:
        return chat_prompt(ctx.tokenizer, msgs)
    except Exception as e:  # noqa: BLE001 - templates raise anything (jinja errors, their own checks)
        raise bad("messages", f"the chat template rejected the messages: {e}") from e


# --------------------------------------------------------------------------- the request
def parse(body, ctx: ServeContext, chat: bool) -> Parsed:
    """Validate a completions (``chat=False``) or chat completions body."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    _check_fields(body, chat)
    _model(body, ctx)
    prompt = _chat_prompt(body, ctx) if chat else _completion_prompt(body, ctx)
    where = "messages" if chat else "prompt"
    room = ctx.context_length - len(prompt)
    if room < 1:
        raise bad(where, f"the prompt is {len(prompt)} tokens; the context length is {ctx.context_length}, "
                         "so no token could be generated")
    cap = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, cap, None, integer=True)
    if max_tokens is None:
        max_tokens = min(ctx.max_tokens, room) if chat else min(16, room)  # OpenAI's defaults: 16 for completions
    if max_tokens < 1:
        raise bad(cap, f"'{cap}' must be at least 1, got {max_tokens}")
    if max_tokens > ctx.max_tokens:
        raise bad(cap, f"'{cap}' is {max_tokens}; this server allows at most {ctx.max_tokens}")
    if max_tokens > room:
        raise bad(cap, f"the prompt ({len(prompt)} tokens) plus '{cap}' ({max_tokens}) exceeds the context length "
                       f"of {ctx.context_length}")
    stream = _flag(body, "stream")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not stream):
        raise bad("stream_options", "'stream_options' is an object, allowed only with stream=true")
    include_usage = bool(so and so.get("include_usage"))
    return Parsed(prompt, _options(body, ctx, max_tokens, stream), stream, include_usage, _stop(body), chat)


def _options(body: dict, ctx: ServeContext, max_tokens: int, stream: bool) -> dict:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    opts = dict(max_new_tokens=max_tokens, do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else 1.0,  # 0 means greedy; the engine wants > 0
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                top_k=_number(body, "top_k", 0, 0, integer=True),
                seed=_number(body, "seed", None, integer=True), ignore_eos=_flag(body, "ignore_eos"),
                min_new_tokens=_number(body, "min_tokens", 0, 0, max_tokens, integer=True))
    stops = _stop(body)
    if stops:
        opts["stop_strings"] = stops
    for name in ("tau", "structure_tau", "fallback_tau"):
        v = _number(body, name, None, 0.0, 1.0)
        if v is not None:
            opts[name] = float(v)
    opts["kv_policy"] = _choice(body, "kv_policy", ("hole", "project"))
    for name in ("batch_policy",):
        v = _choice(body, name, ("gather", "all", "majority"))
        if v is not None:
            opts[name] = v
    for name in ("force_compute", "protect_structure", "gate_sampling"):
        if body.get(name) is not None:
            opts[name] = _flag(body, name)
    never = body.get("never_skip")
    if never is not None:
        if not isinstance(never, list) or not all(isinstance(l, int) and not isinstance(l, bool) and
                                                  -ctx.num_layers <= l < ctx.num_layers for l in never):
            raise bad("never_skip", f"'never_skip' must be a list of layer indices in [-{ctx.num_layers}, "
                                    f"{ctx.num_layers})")
        opts["never_skip"] = tuple(never)
    validator = _choice(body, "validator", sorted(VALIDATORS))
    if validator is not None:
        if stream:
            raise bad("validator", "'validator' may regenerate the output: it needs stream=false")
        if ctx.tokenizer is None:
            raise bad("validator", "'validator' needs the model's tokenizer")
        opts["validator"] = validator
    if _flag(body, "lossless"):
        if validator is not None:
            raise bad("lossless", "'lossless' output is the full-depth output already: it takes no 'validator'")
        opts["lossless"] = True
    kv = _choice(body, "kv_cache", POLICIES)
    budget = _number(body, "kv_budget", None, 1, integer=True)
    try:
        policy = make_policy(kv, budget)
    except ValueError as e:
        raise bad("kv_budget", str(e)) from None
    if policy is not None:
        if opts.get("lossless"):
            raise bad("kv_cache", "'lossless' rolls rejected drafts back, which an evicting 'kv_cache' cannot")
        opts["kv_cache"], opts["kv_budget"] = policy.name, policy.budget
    kv_dtype = _choice(body, "kv_dtype", list(KV_DTYPE_CHOICES))
    if kv_dtype is not None:
        opts["kv_dtype"] = kv_dtype
    prefill = _choice(body, "prefill", list(PREFILL_CHOICES))
    if prefill is not None:
        opts["prefill"] = prefill
    chunk = _number(body, "prefill_chunk", None, 0, integer=True)
    if chunk is not None:
        opts["prefill_chunk"] = chunk
    if opts.get("protect_structure") and ctx.tokenizer is None:
        raise bad("protect_structure", "'protect_structure' needs the model's tokenizer")
    if stops and ctx.tokenizer is None:
        raise bad("stop", "'stop' needs the model's tokenizer")
    try:
        DecodeOptions(**opts)  # anything the fields above do not catch
    except ValueError as e:
        raise bad(None, str(e)) from e
    return opts


# --------------------------------------------------------------------------- responses
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, summary: dict) -> dict:
    """OpenAI usage plus the FBS trace summary under ``fbs`` (skip ratio, TFLOPs(rel), tau, KV policy, times)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "fbs": summary}


def response(rid: str, model: str, chat: bool, text: str, finish_reason: str, use: dict) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use}


def chunk(rid: str, model: str, chat: bool, text: str | None, finish_reason: str | None = None,
          role: bool = False, use: dict | None = None) -> dict:
    """One streamed chunk: a text delta (``text``), the final one (``finish_reason``), or, with ``use`` and no
    text, the usage chunk of ``stream_options.include_usage`` (no choices)."""
    if use is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use}


class TextStream:
    """Incremental detokenization with stop strings: text deltas that are final (no partial UTF-8 character,
    nothing that might still become a stop string), and the output cut before the first stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0         # characters already handed out
        self.stopped = False  # a stop string was found: the text is final

    def text(self) -> str:
        full = self.tok.decode(self.ids, skip_special_tokens=True) if self.tok is not None else ""
        cuts = [i for i in (full.find(s) for s in self.stop) if i >= 0]
        if cuts:
            self.stopped = True
            return full[:min(cuts)]
        return full

    def add(self, ids: list[int]) -> str:
        """The new final text after appending ``ids``."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        full = self.text()
        end = len(full)
        if not self.stopped:
            while end > self.sent and full[end - 1] == "\ufffd":  # an incomplete multi-byte character
                end -= 1
            for s in self.stop:  # hold back a tail that could grow into a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if full[end - k:end] == s[:k]:
                        end -= k
                        break
        return self._take(full, end)

    def finish(self) -> str:
        """Whatever is left once generation ended."""
        full = self.text()
        return self._take(full, len(full))

    def _take(self, full: str, end: int) -> str:
        out = full[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out
