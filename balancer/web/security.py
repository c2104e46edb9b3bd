"""The console's guards: the token, CSRF on every change, and response headers.

As the router has it (:mod:`balancer.router.app`): loopback needs no token;
beyond loopback ``balancer web`` refuses to start without
``BALANCER_WEB_TOKEN`` (:func:`start_refusal`, on the guards both share,
:mod:`balancer.httpguard`: the loopback rule, the body limit, and the ``Host``
and ``Origin`` check against DNS rebinding). When a token is set every request
must carry it, as ``Authorization: Bearer <token>`` or as the password of
HTTP basic auth (any user name), so a browser can log in with its own
prompt. Every change is a POST whose form carries a CSRF token bound to a
cookie (:class:`Csrf`); pages are served with a strict Content-Security-Policy
(scripts and styles from the console itself only).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Mapping

from balancer.errors import printable
from balancer.httpguard import ASGIApp, Receive, Scope, Send, is_loopback

#: The cookie a form's CSRF token is bound to.
CSRF_COOKIE = "balancer_csrf"
#: Sent on every response. The referrer policy is ``same-origin``, not ``no-referrer``: under
#: ``no-referrer`` a browser sends ``Origin: null`` with the console's own form posts, which
#: :class:`balancer.httpguard.HostGuard` must refuse; ``same-origin`` still sends no URL to another site.
HEADERS = (
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 b"connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)


def start_refusal(host: str, token: str | None) -> str | None:
    """Why the console must not start on ``host`` (None: it may).

    >>> start_refusal("127.0.0.1", None) is None, start_refusal("0.0.0.0", "t") is None
    (True, True)
    >>> start_refusal("0.0.0.0", None)
    'BALANCER_WEB_TOKEN must be set to serve the web console beyond loopback (--host 0.0.0.0)'
    """
    if token is None and not is_loopback(host):
        return f"BALANCER_WEB_TOKEN must be set to serve the web console beyond loopback (--host {printable(host)})"
    return None


def presented_user(authorization: bytes, token: str) -> str | None:
    """The user an ``Authorization`` header authenticates with ``token``
    (``bearer`` for a bearer token, the basic-auth user name otherwise), or None.

    >>> presented_user(b"Bearer s3cret", "s3cret"), presented_user(b"Bearer nope", "s3cret")
    ('bearer', None)
    >>> presented_user(b"Basic " + base64.b64encode(b"ann:s3cret"), "s3cret")
    'ann'
    >>> presented_user(b"Basic !!", "s3cret") is None
    True
    """
    expected = token.encode()
    scheme, _, value = authorization.partition(b" ")
    if scheme.lower() == b"bearer":
        return "bearer" if hmac.compare_digest(value.strip(), expected) else None
    if scheme.lower() == b"basic":
        try:
            user, _, password = base64.b64decode(value.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return None
        if hmac.compare_digest(password, expected):
            return printable(user.decode("utf-8", "replace"), 60) or "basic"
    return None


class TokenGuard:
    """Every request needs the token (bearer or basic-auth password); a 401 asks the browser to log in.
    The user it authenticates goes into ``scope["state"]["user"]`` for the audit."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            user = presented_user(dict(scope["headers"]).get(b"authorization", b""), self.token)
            if user is None:
                body = b"401: this console needs its token (BALANCER_WEB_TOKEN) as a basic-auth password or bearer token\n"
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Basic realm="balancer", charset="UTF-8"'), *HEADERS]})
                await send({"type": "http.response.body", "body": body})
                return
            scope.setdefault("state", {})["user"] = user
        await self.app(scope, receive, send)


class SecurityHeaders:
    """Adds :data:`HEADERS` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []), *(h for h in HEADERS if h[0] not in names)]
            await send(message)

        await self.app(scope, receive, with_headers)  # type: ignore[arg-type]


class Csrf:
    """CSRF tokens bound to a random per-browser cookie: a form's token is an
    HMAC of the cookie's value under a per-process secret, so another site can
    neither read it nor forge it, and a restart invalidates old forms.

    >>> c = Csrf(b"k" * 32)
    >>> c.valid("nonce", c.token("nonce")), c.valid("nonce", c.token("other")), c.valid(None, "x")
    (True, False, False)
    """

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secret or secrets.token_bytes(32)

    @staticmethod
    def new_nonce() -> str:
        return secrets.token_urlsafe(24)

    def token(self, nonce: str) -> str:
        return hmac.new(self.secret, nonce.encode(), hashlib.sha256).hexdigest()

    def valid(self, nonce: str | None, token: str | None) -> bool:
        if not nonce or not token:
            return False
        return hmac.compare_digest(self.token(nonce), token)

    @staticmethod
    def cookie_nonce(cookies: Mapping[str, str]) -> str | None:
        return cookies.get(CSRF_COOKIE) or None
