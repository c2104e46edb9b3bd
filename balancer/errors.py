"""Errors that mean "the user asked for something wrong", not "the code broke".

The CLI prints these as one line and exits 2; anything else is a bug and
keeps its traceback.
"""


class BalancerError(Exception):
    """A user-facing error: the message is the whole story."""


class ConfigError(BalancerError):
    """A setting is malformed or points at something unreachable."""


class QuotaError(BalancerError):
    """A quota value or quota file is invalid."""


class ServiceUnavailable(BalancerError):
    """Redis or PostgreSQL could not be reached; the message names the masked URL."""
