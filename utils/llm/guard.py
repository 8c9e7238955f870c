"""The limits `transformers serve` does not enforce itself, enforced inside its own process (lab 05).

    COURSE_SERVER_KEY=... python -m utils.llm.guard --context-limit 2048 --model DIR -- serve DIR --port ...

transformers serve checks no request: an over-long prompt, or ``max_tokens`` beyond its paged KV cache with the
end-of-sequence stop turned off, kills its batching worker, and every later request gets HTTP 503 (measured with
transformers 5.17 to 5.23). This module runs transformers' own command line in this process with one ASGI layer
put in front of the app that uvicorn serves (through ``uvicorn.Config``, uvicorn's public API). That layer:

- serves only what lab 05 uses: ``/health`` (no key needed), ``/v1/models``, ``/v1/chat/completions`` and
  ``/v1/completions``; ``/load_model``, ``/reset`` and the rest are 404;
- asks for this run's key (``Authorization: Bearer KEY``; the key is in the server's environment, which only its
  user can read, never on its command line): other local users cannot use a learner's server;
- refuses a body over ``--max-body`` bytes (413) and a request whose prompt (chat template applied) plus
  ``max_tokens`` does not fit ``--context-limit`` tokens (400, with the numbers); a missing ``max_tokens`` becomes
  what the context leaves; a per-request ``generation_config`` may only set the stop and sampling fields.

vLLM enforces all of this itself (``--max-model-len``, ``--api-key``): the course starts it without this layer.
"""
from __future__ import annotations

import argparse
import hmac
import json
import os
import resource
import sys

KEY_VAR = "COURSE_SERVER_KEY"
OPEN_PATHS = {"/health"}
GENERATING_PATHS = {"/v1/chat/completions", "/v1/completions"}
SERVED_PATHS = OPEN_PATHS | GENERATING_PATHS | {"/v1/models"}
# What a request's own generation_config (JSON) may set: the stop and the sampling, never lengths.
GENERATION_FIELDS = {"eos_token_id", "temperature", "top_p", "top_k", "do_sample", "repetition_penalty"}
DEFAULT_MAX_BODY = 256 * 1024


class Refused(Exception):
    """A request the guard does not pass on: its HTTP status and the reason the client is told."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


def whole_number(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refused(400, f"{name}={value!r} must be a whole number >= 1")
    return value


class Limits:
    """What one request may ask of the engine: prompt tokens (counted with the model's own tokenizer and chat
    template) plus new tokens within ``context_limit``."""

    def __init__(self, context_limit: int, tokenizer):
        self.context_limit, self.tokenizer = context_limit, tokenizer

    def prompt_tokens(self, path: str, body: dict) -> int:
        try:
            if path == "/v1/chat/completions":
                messages = body["messages"]
                if not isinstance(messages, list) or not messages:
                    raise ValueError("messages must be a non-empty list")
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"]
                return len(ids)
            prompt = body["prompt"]
            prompts = [prompt] if isinstance(prompt, str) else prompt
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
                raise ValueError("prompt must be a string or a list of strings")
            return max(len(self.tokenizer(p)["input_ids"]) for p in prompts)
        except Refused:
            raise
        except Exception as exc:   # a body the template or the tokenizer cannot read
            raise Refused(400, f"the request's {'messages' if 'chat' in path else 'prompt'} cannot be read: "
                               f"{type(exc).__name__}: {str(exc)[:200]}") from None

    def bound(self, path: str, body: dict) -> dict:
        """The request as the engine may see it, or Refused."""
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        body = dict(body)
        n = self.prompt_tokens(path, body)
        room = self.context_limit - n
        if room < 1:
            raise Refused(400, f"the prompt takes {n:,} tokens; this server holds {self.context_limit:,} per request")
        asked = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
        wanted = whole_number(body[asked[0]], asked[0]) if asked else room
        if wanted > room:
            raise Refused(400, f"the prompt takes {n:,} tokens and {asked[0]}={wanted:,} more: {n + wanted:,} > the "
                               f"{self.context_limit:,} tokens this server holds per request; lower {asked[0]}")
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = wanted
        if body.get("n") not in (None, 1):
            raise Refused(400, "n must be 1 on this server")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise Refused(400, f"seed={seed!r} must be a whole number from 0 to 2**63 - 1")   # torch's generator range
        if body.get("generation_config") is not None:
            try:
                config = json.loads(body["generation_config"])
            except (TypeError, ValueError):
                raise Refused(400, "generation_config must be a JSON object in a string") from None
            extra = sorted(set(config) - GENERATION_FIELDS) if isinstance(config, dict) else ["(not an object)"]
            if extra:
                raise Refused(400, f"generation_config may set only {', '.join(sorted(GENERATION_FIELDS))}; "
                                   f"not {', '.join(map(str, extra))}")
        return body


class Guard:
    """An ASGI app in front of `app` that passes on only the requests `Limits` allows, with this run's key."""

    def __init__(self, app, limits: Limits, key: str, max_body: int = DEFAULT_MAX_BODY):
        self.app, self.limits, self.key, self.max_body = app, limits, key.encode(), max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        try:
            if path not in SERVED_PATHS:
                raise Refused(404, f"{path} is not served by the course's server")
            if path not in OPEN_PATHS:
                self.check_key(dict(scope.get("headers") or []))
            if path in GENERATING_PATHS and scope["method"] == "POST":
                raw = await self.read_body(receive)
                try:
                    body = json.loads(raw)
                except (ValueError, RecursionError):     # not JSON, or nested past Python's stack
                    raise Refused(400, "the body is not JSON this server reads") from None
                raw = json.dumps(self.limits.bound(path, body)).encode()
                return await self.app(self.with_body(scope, raw), self.replay(raw, receive), send)
        except Refused as refused:
            return await self.refuse(send, refused)
        return await self.app(scope, receive, send)

    def check_key(self, headers: dict) -> None:
        given = headers.get(b"authorization", b"")
        if not hmac.compare_digest(given, b"Bearer " + self.key):
            raise Refused(401, "this server asks for its run's key: Authorization: Bearer <key> "
                               "(utils.llm.serving.Server.api_key)")

    async def read_body(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(400, "the client went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise Refused(413, f"the body is over {self.max_body:,} bytes")
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    @staticmethod
    def with_body(scope, raw: bytes):
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-length"]
        return dict(scope, headers=headers + [(b"content-length", str(len(raw)).encode())])

    @staticmethod
    def replay(raw: bytes, receive):
        """The body once, then the client's own messages (a streaming response listens for its disconnect)."""
        sent = False

        async def replayed():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()
        return replayed

    @staticmethod
    async def refuse(send, refused: Refused) -> None:
        body = json.dumps({"error": {"message": str(refused), "type": "invalid_request_error",
                                     "code": refused.status}}).encode()
        await send({"type": "http.response.start", "status": refused.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def open_files_as_allowed() -> None:
    """Raise this process's open-file limit to its hard limit: with the usual 1,024, another local user holding
    1,100 idle connections starved the engine (and filled its log with accept errors); a connection costs the
    one who opens it a file too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def install(limits: Limits, key: str, max_body: int) -> None:
    """Wrap every app uvicorn is given in this process in a Guard."""
    import uvicorn

    original = uvicorn.Config.__init__

    def guarded(self, app, *args, **kwargs):
        original(self, Guard(app, limits, key, max_body), *args, **kwargs)
    uvicorn.Config.__init__ = guarded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.llm.guard", description=__doc__.splitlines()[0])
    parser.add_argument("--context-limit", type=int, required=True)
    parser.add_argument("--model", required=True, help="the served model's folder (its tokenizer counts tokens)")
    parser.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY)
    parser.add_argument("serve", nargs=argparse.REMAINDER, help="-- then transformers' own arguments")
    args = parser.parse_args(argv)
    key = os.environ.pop(KEY_VAR, "")
    open_files_as_allowed()
    if len(key) < 16:
        parser.error(f"{KEY_VAR} must hold this run's key (16 characters or more)")
    from transformers import AutoTokenizer   # heavy: only once the arguments are known to be right
    from transformers.cli.transformers import main as transformers_main

    install(Limits(args.context_limit, AutoTokenizer.from_pretrained(args.model)), key, args.max_body)
    sys.argv = ["transformers", *(args.serve[1:] if args.serve[:1] == ["--"] else args.serve)]
    return transformers_main()


if __name__ == "__main__":
    raise SystemExit(main())
