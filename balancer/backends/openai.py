"""An OpenAI-compatible API (``POST /v1/chat/completions``): vLLM, LiteLLM's proxy, OpenAI."""

from __future__ import annotations

from balancer.backends.base import Completion, Transient
from balancer.backends.http import HttpBackend, require_int


class OpenAIBackend(HttpBackend):
    def complete(self, model: str, prompt: str, max_tokens: int) -> Completion:
        data, remaining = self.post_json(
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens},
        )
        try:
            answer = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise Transient("malformed response: missing choices[0].message.content") from None
        if not isinstance(answer, str):
            raise Transient("malformed response: content is not text")
        return Completion(
            answer, require_int(data, "usage", "prompt_tokens"), require_int(data, "usage", "completion_tokens"), remaining
        )
