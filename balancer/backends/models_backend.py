"""The users' Models Backend, as this project defines its API.

* ``POST /single {"model", "prompt", "max_tokens"}`` → ``{"answer", "usage": {"prompt_tokens", "completion_tokens"}}``
* ``POST /batch {"model", "prompts": [...]}`` → ``{"results": [...]}`` after *all* complete
* ``GET /models``
* 429 with ``Retry-After``
* ``x-ratelimit-remaining-tokens`` / ``-requests`` passed through when the
  backend forwards them from its provider (they lower balancer's buckets)

The pipeline uses ``/single`` only: a batch waits for its slowest prompt.
"""

from __future__ import annotations

from balancer.backends.base import Completion, Transient
from balancer.backends.http import HttpBackend, require_int


class ModelsBackend(HttpBackend):
    def complete(self, model: str, prompt: str, max_tokens: int) -> Completion:
        data, remaining = self.post_json("/single", {"model": model, "prompt": prompt, "max_tokens": max_tokens})
        if not isinstance(data, dict) or not isinstance(data.get("answer"), str):
            raise Transient("malformed response: missing answer")
        return Completion(
            data["answer"],
            require_int(data, "usage", "prompt_tokens"),
            require_int(data, "usage", "completion_tokens"),
            remaining,
        )
