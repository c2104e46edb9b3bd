"""Token estimates: what admission charges before the call.

A cheap heuristic, about 4 characters per token, which is also how the
simulated backend counts. The estimate is prompt tokens plus the output
budget (the ``max_tokens`` sent with the call), the same amount a provider
reserves; the worker reconciles against actual usage afterwards, so a
tokenizer's precision matters little.

>>> heuristic_prompt_tokens("abcdefgh")
2
>>> estimate_task_tokens("abcdefgh", max_tokens=100)
102
"""

from __future__ import annotations

import math


def heuristic_prompt_tokens(prompt: str) -> int:
    """ceil(chars / 4), at least 1."""
    return max(1, math.ceil(len(prompt) / 4))


#: Tokens a chat call adds to its prompt at most (the role markers of its one message).
CHAT_OVERHEAD_TOKENS = 32


def most_prompt_tokens(prompt: str) -> int:
    """The most prompt tokens a call of ``prompt`` can use: a tokenizer's token is at
    least one byte of UTF-8, plus the chat format's overhead. A reply that reports more
    is not believed (balancer.calls.signals.answered).

    >>> most_prompt_tokens("abcdefgh"), most_prompt_tokens("é")
    (40, 34)
    """
    return len(prompt.encode("utf-8", "surrogatepass")) + CHAT_OVERHEAD_TOKENS


def estimate_task_tokens(prompt: str, max_tokens: int) -> int:
    return heuristic_prompt_tokens(prompt) + max_tokens
