"""Connection URLs: the checks every URL setting passes at start, and how a URL
is shown (its scheme, host, port and database; never its user or password)."""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from balancer.errors import ConfigError, printable

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]{0,31}$")

POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg2")


def normalize_database_url(url: str) -> str:
    """Map plain ``postgresql://`` URLs to the psycopg2 driver.

    SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg 3, which is not a
    dependency here.

    >>> normalize_database_url("postgresql://u@h/db")
    'postgresql+psycopg2://u@h/db'
    >>> normalize_database_url("postgres://h/db")
    'postgresql+psycopg2://h/db'
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in POSTGRES_SCHEMES:
        raise ConfigError(
            f"BALANCER_DATABASE_URL must be a postgresql:// URL, got {mask_url(url)!r}"
        )
    return f"postgresql+psycopg2://{rest}"


def mask_url(url: str) -> str:
    """A URL reduced to what an error may show: scheme, host, port and database.

    Never the user name or password, however they are written: the
    credentials end at the *last* ``@`` (a host has none), so a password with
    an unencoded ``#``, ``?``, ``/`` or ``@`` is hidden too; query and fragment
    are dropped (they can carry a password as well).

    >>> mask_url("redis://:hunter2@localhost:6379/0")
    'redis://***@localhost:6379/0'
    >>> mask_url("postgresql://bob:p#w?/@x@db:5432/prod?password=pw")
    'postgresql://***@db:5432/prod'
    >>> mask_url("no-scheme-at-all")
    '<not a URL>'
    """
    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME.match(scheme):
        return "<not a URL>"
    userinfo, at, hostpart = rest.rpartition("@")
    cut = min([i for i in (hostpart.find(c) for c in "/?#") if i >= 0], default=len(hostpart))
    host, path = hostpart[:cut], hostpart[cut:]
    database = re.split(r"[/?#]", path[1:])[0] if path.startswith("/") else ""
    return printable(f"{scheme}://{'***@' if at else ''}{host}{'/' + database if database else ''}")


def scrub(message: str, url: str) -> str:
    """``message`` (a client library's error) without any piece of ``url``'s
    credentials, raw or percent-decoded: libraries quote what they could not
    parse ("port could not be cast", "could not translate host name").

    >>> scrub('could not translate host name "s3cr3t" to address', "postgresql://u:s3cr3t#x@h/db")
    'could not translate host name "***" to address'
    """
    userinfo = url.partition("://")[2].rpartition("@")[0]
    pieces = {userinfo, unquote(userinfo), *re.split(r"[:/?#@]", userinfo), *re.split(r"[:/?#@]", unquote(userinfo))}
    for piece in sorted((p for p in pieces if len(p) >= 3), key=len, reverse=True):
        message = message.replace(piece, "***")
    return message.replace(url, mask_url(url))


def check_url(setting: str, url: str, schemes: tuple[str, ...]) -> str:
    """Refuse a URL its client library would misread, in one line naming the setting.

    >>> check_url("BALANCER_REDIS_URL", "redis://:pw@h:6379/0", ("redis",))
    'redis://:pw@h:6379/0'
    >>> check_url("BALANCER_REDIS_URL", "redis://:p#w@h/0", ("redis",))
    Traceback (most recent call last):
    balancer.errors.ConfigError: BALANCER_REDIS_URL: percent-encode the user name and password (they contain / ? # or @): redis://***@h/0
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        expected = " or ".join(f"{s}://" for s in schemes)
        raise ConfigError(f"{setting} must be a {expected} URL, got {mask_url(url)!r}")
    userinfo, at, hostpart = rest.rpartition("@")
    if at and any(c in userinfo for c in "/?#@"):
        raise ConfigError(f"{setting}: percent-encode the user name and password (they contain / ? # or @): {mask_url(url)}")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise ConfigError(f"{setting} contains spaces or control characters: {mask_url(url)}")
    return url



def _check_database_number(setting: str, url: str) -> None:
    database = urlsplit(url).path.strip("/")
    if database and not database.isdigit():
        raise ConfigError(f"{setting}: the database must be a number (redis://host:6379/0), got {printable(database)!r}")


_UNEXPECTED = re.compile(r"unexpected keyword argument '([^']*)'")


def _unknown_option(setting: str, url: str, exc: Exception, client: str) -> ConfigError:
    """A client library's refusal of a URL's query option, as one line."""
    found = _UNEXPECTED.search(str(exc))
    scheme = url.partition("://")[0].lower()
    if found:
        hint = " (it needs a rediss:// URL)" if found.group(1).startswith("ssl") and scheme == "redis" else ""
        return ConfigError(f"{setting}: {client} does not understand the option {printable(found.group(1))!r} "
                           f"in a {scheme}:// URL{hint}: {mask_url(url)}")
    first = (str(exc).splitlines() or [""])[0]
    return ConfigError(f"{setting}: {client} cannot read the URL ({mask_url(url)}): {scrub(first, url)}")


def check_redis_url(setting: str, url: str) -> None:
    """A Redis URL redis-py reads as meant: its database, if given, a number,
    and only query options its connection class takes.

    >>> check_redis_url("BALANCER_REDIS_URL", "redis://h:6379/abc")
    Traceback (most recent call last):
    balancer.errors.ConfigError: BALANCER_REDIS_URL: the database must be a number (redis://host:6379/0), got 'abc'
    >>> try:
    ...     check_redis_url("BALANCER_REDIS_URL", "redis://h:6379/0?ssl_cert_reqs=none")
    ... except ConfigError as exc:
    ...     print(str(exc).partition(" (")[0])
    BALANCER_REDIS_URL: redis-py does not understand the option 'ssl_cert_reqs' in a redis:// URL
    """
    check_url(setting, url, ("redis", "rediss", "unix"))
    if not url.lower().startswith("unix"):
        _check_database_number(setting, url)
    import redis

    try:  # builds the connection object (no I/O), which is where redis-py refuses an unknown option
        pool = redis.ConnectionPool.from_url(url)
        pool.connection_class(**pool.connection_kwargs)
    except (TypeError, ValueError) as exc:
        raise _unknown_option(setting, url, exc, "redis-py") from None


#: Broker URL schemes kombu reads as Redis or AMQP (kombu.transport.TRANSPORT_ALIASES, and redis+socket).
BROKER_SCHEMES = ("redis", "rediss", "redis+socket", "sentinel", "amqp", "amqps", "pyamqp")


def check_broker_url(setting: str, url: str) -> None:
    """A broker URL kombu accepts for Redis or AMQP: each of a ``;``-separated
    failover list, read by kombu itself (without connecting)."""
    from kombu import Connection

    for part in url.split(";"):
        check_url(setting, part, BROKER_SCHEMES)
        if part.lower().startswith(("redis://", "rediss://")):
            _check_database_number(setting, part)
        try:
            Connection(part)
        except (TypeError, ValueError, KeyError) as exc:
            raise _unknown_option(setting, part, exc, "kombu") from None


def check_database_url(setting: str, url: str) -> None:
    """A PostgreSQL URL libpq reads: only connection parameters it knows in the query."""
    import psycopg2
    from psycopg2.extensions import parse_dsn

    try:
        parse_dsn("postgresql://" + url.partition("://")[2])
    except psycopg2.ProgrammingError as exc:
        raise _unknown_option(setting, url, exc, "libpq") from None
