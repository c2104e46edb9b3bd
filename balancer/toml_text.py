"""A declaration file's TOML text (the quota file, the sources file) loaded as a table,
its first syntax error told in one line that names the line: ``line N: invalid TOML: ...``."""

from __future__ import annotations

import re
from typing import Any

from balancer.errors import BalancerError

_LINE = re.compile(r"\(at line (\d+), column \d+\)")


def load_toml(text: str, error: type[BalancerError]) -> dict[str, Any]:
    """The table ``text`` holds; ``error`` with the line of the first syntax error if it holds none.

    >>> load_toml('a = 1', BalancerError)
    {'a': 1}
    >>> load_toml('a = 1\\nb = ?\\nc = 2', BalancerError)
    Traceback (most recent call last):
    balancer.errors.BalancerError: line 2: invalid TOML: Invalid value
    """
    import tomllib  # here, not at the top: `status` reads sources (sources/store) but never a sources file

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = _LINE.search(str(exc))
        where = f"line {match.group(1)}: " if match else ""
        raise error(f"{where}invalid TOML: {_LINE.sub('', str(exc)).strip()}") from None
