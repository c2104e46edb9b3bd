"""Connection URLs: the checks every URL setting passes at start, and how a URL
is shown (its scheme, host, port and database; never its user or password)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from balancer.errors import ConfigError, printable

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]{0,31}$")

POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg2")


def normalize_database_url(url: str, variable: str = "BALANCER_DATABASE_URL") -> str:
    """Map plain ``postgresql://`` URLs to the psycopg2 driver (``variable``: where the URL
    came from, named by the error for any other URL).

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
            f"{variable} must be a postgresql:// URL, got {mask_url(url)!r}"
        )
    return f"postgresql+psycopg2://{rest}"


def mask_url(url: str) -> str:
    """A URL reduced to what an error may show: scheme, host, port and database.
    The scheme without the driver this project adds (:func:`normalize_database_url`:
    a user wrote ``postgresql://``); any other driver is shown, as it was written.

    Never the user name or password, however they are written: the
    credentials end at the *last* ``@`` (a host has none), so a password with
    an unencoded ``#``, ``?``, ``/`` or ``@`` is hidden too; query and fragment
    are dropped (they can carry a password as well).

    >>> mask_url("redis://:hunter2@localhost:6379/0")
    'redis://***@localhost:6379/0'
    >>> mask_url("postgresql://bob:p#w?/@x@db:5432/prod?password=pw")
    'postgresql://***@db:5432/prod'
    >>> mask_url("postgresql+psycopg2://bob:pw@db/prod"), mask_url("postgresql+asyncpg://db/prod")
    ('postgresql://***@db/prod', 'postgresql+asyncpg://db/prod')
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
    return printable(f"{scheme.removesuffix('+psycopg2')}://{'***@' if at else ''}{host}{'/' + database if database else ''}")


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
    if is_sentinel_url(url):
        parse_sentinel_url(url, setting)
        return
    check_url(setting, url, ("redis", "rediss", "unix", "sentinel"))
    if not url.lower().startswith("unix"):
        _check_database_number(setting, url)
    import redis

    try:  # builds the connection object (no I/O), which is where redis-py refuses an unknown option
        pool = redis.ConnectionPool.from_url(url)
        pool.connection_class(**pool.connection_kwargs)
    except (TypeError, ValueError) as exc:
        raise _unknown_option(setting, url, exc, "redis-py") from None


SENTINEL_FORM = "sentinel://[:password@]host1:26379,host2:26379/master-name[/db]"
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelURL:
    """A Redis reached through Sentinel: the Sentinels to ask, the name of the
    master they watch, its database, and the master's (not the Sentinels')
    user name and password."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int
    username: str | None
    password: str | None

    def broker_urls(self) -> str:
        """The same Redis as kombu's sentinel transport names it: one
        ``sentinel://`` URL per Sentinel, joined by ``;``, each with the
        credentials and database (the master's name goes in the transport
        options, :attr:`master`).

        >>> parse_sentinel_url("sentinel://:pw@a:1,b/mymaster/2").broker_urls()
        'sentinel://:pw@a:1/2;sentinel://:pw@b:26379/2'
        """
        auth = ""
        if self.username is not None or self.password is not None:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password or '', safe='')}@"
        return ";".join(f"sentinel://{auth}{_host(host)}:{port}/{self.db}" for host, port in self.sentinels)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_sentinel_url(url: str) -> bool:
    return url.partition("://")[0].lower() == "sentinel"


def parse_sentinel_url(url: str, setting: str = "BALANCER_REDIS_URL") -> SentinelURL:
    """``sentinel://[[user]:password@]host1[:port],host2[:port]/master-name[/db]``,
    read into its parts; anything else is one line naming the setting and the form.
    The port defaults to 26379 (Sentinel's), the database to 0.

    >>> parse_sentinel_url("sentinel://:s%40cret@10.0.0.1:26379,[::1]:26380,h3/mymaster/1")
    SentinelURL(sentinels=(('10.0.0.1', 26379), ('::1', 26380), ('h3', 26379)), master='mymaster', db=1, username=None, password='s@cret')
    >>> parse_sentinel_url("sentinel://h1:26379;sentinel://h2:26379")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    balancer.errors.ConfigError: BALANCER_REDIS_URL: name every Sentinel in one URL, sentinel://...: got 'sentinel://h1:26379'
    >>> parse_sentinel_url("sentinel://h1:26379/")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    balancer.errors.ConfigError: BALANCER_REDIS_URL: the master's name is missing: sentinel://..., got 'sentinel://h1:26379'
    """
    check_url(setting, url, ("sentinel",))
    if ";" in url:
        raise ConfigError(f"{setting}: name every Sentinel in one URL, {SENTINEL_FORM}: got {mask_url(url.split(';')[0])!r}")
    rest = url.partition("://")[2]
    userinfo, at, hostpart = rest.rpartition("@")
    if "?" in hostpart or "#" in hostpart:
        raise ConfigError(f"{setting}: a sentinel:// URL takes no query options ({SENTINEL_FORM}): {mask_url(url)}")
    hosts, _, path = hostpart.partition("/")
    parts = [unquote(p) for p in path.split("/")] if path else []
    if not parts or not parts[0]:
        raise ConfigError(f"{setting}: the master's name is missing: {SENTINEL_FORM}, got {mask_url(url)!r}")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(f"{setting}: after the master's name only a database number may follow: {SENTINEL_FORM}, "
                          f"got {mask_url(url)!r}")
    sentinels = []
    for host in hosts.split(","):
        try:
            parsed = urlsplit(f"//{host}")
            name, port = parsed.hostname, parsed.port or SENTINEL_PORT
        except ValueError:
            name = None
        if not name:
            raise ConfigError(f"{setting}: {printable(host)!r} is not host[:port] ({SENTINEL_FORM}): {mask_url(url)}")
        sentinels.append((name, port))
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    return SentinelURL(tuple(sentinels), parts[0], int(parts[1]) if len(parts) == 2 else 0, username, password)


#: Broker URL schemes kombu reads as Redis or AMQP (kombu.transport.TRANSPORT_ALIASES, and redis+socket).
BROKER_SCHEMES = ("redis", "rediss", "redis+socket", "sentinel", "amqp", "amqps", "pyamqp")


def check_broker_url(setting: str, url: str) -> None:
    """A broker URL kombu accepts for Redis or AMQP: each of a ``;``-separated
    failover list, read by kombu itself (without connecting)."""
    from kombu import Connection

    if is_sentinel_url(url):  # kombu's sentinel transport, given the master's name (celeryconfig.py)
        parse_sentinel_url(url, setting)
        return
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
