"""The OpenAI wire format of a simulated server: reading prompt size and options from a
request body, and writing unary bodies and pre-rendered SSE chunks as vLLM's server does."""

from __future__ import annotations

import json
import math
import time
import uuid

from trimtab_dev.sim.engine import SimRequest

TOKEN_TEXT = " token"
CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16


# ---- OpenAI wire format -----------------------------------------------------------------
def read_prompt_tokens(body: dict, chat: bool) -> int:
    hint = body.get("prompt_tokens")
    if hint is not None:
        return int(hint)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ValueError("messages must be a list")
        chars = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
        return max(1, math.ceil(chars / 4))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        prompt = "".join(str(p) for p in prompt)
    if not isinstance(prompt, str):
        raise ValueError("prompt must be a string or a list")
    return max(1, math.ceil(len(prompt) / 4))


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


class ChunkWriter:
    """Pre-rendered SSE chunks for one streamed response (cheap per token)."""

    def __init__(self, req: SimRequest, model: str, chat: bool, usage: bool) -> None:
        self.req, self.chat, self.usage = req, chat, usage
        kind = "chat.completion.chunk" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.head = (f'data: {{"id":"{rid}","object":"{kind}","created":{int(time.time())},'
                     f'"model":{json.dumps(model)},"choices":')
        text = json.dumps(TOKEN_TEXT)
        if chat:
            self.role = (self.head + '[{"index":0,"delta":{"role":"assistant","content":""},'
                         '"logprobs":null,"finish_reason":null}]}\n\n')
            body = '[{"index":0,"delta":{"content":' + text + '},"logprobs":null,'
        else:
            self.role = ""
            body = '[{"index":0,"text":' + text + ',"logprobs":null,'
        self.token = self.head + body + '"finish_reason":null,"stop_reason":null}]}\n\n'
        self.last = self.head + body + '"finish_reason":"length","stop_reason":null}]}\n\n'
        self.started = False

    def tokens(self, n: int, done: bool) -> bytes:
        parts = []
        if not self.started:
            self.started = True
            parts.append(self.role)
        parts.append(self.token * (n - 1 if done else n))
        if done:
            parts.append(self.last)
        return "".join(parts).encode()

    def trailer(self) -> bytes:
        out = ""
        if self.usage:
            p, g = self.req.prompt_tokens, self.req.generated
            usage = {"prompt_tokens": p, "total_tokens": p + g, "completion_tokens": g}
            out = self.head + "[],\"usage\":" + json.dumps(usage) + "}\n\n"
        return (out + "data: [DONE]\n\n").encode()


def unary_body(req: SimRequest, model: str, chat: bool) -> dict:
    text = TOKEN_TEXT * req.generated
    usage = {"prompt_tokens": req.prompt_tokens, "total_tokens": req.num_tokens,
             "completion_tokens": req.generated}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": "length", "stop_reason": None}
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                  "stop_reason": None}
        kind, prefix = "text_completion", "cmpl-"
    return {"id": prefix + uuid.uuid4().hex, "object": kind, "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage}


