"""Redis URLs: the password a stored config must not keep."""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode


def split_redis_password(url: str) -> tuple[str, str | None]:
    """`url` without its password, and the password (None when it names none).

    The password is the userinfo's (`scheme://user:pw@host`, `scheme://:pw@host`; the
    user stays: `scheme://user@host`, `scheme://@host`) or redis-py's `password=` query
    parameter; percent-escapes in it are decoded.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, None
    password = None
    base, q, query = rest.partition("?")
    if q:
        params = parse_qsl(query, keep_blank_values=True)
        for key, value in params:
            if key == "password":
                password = value
        query = urlencode([(k, v) for k, v in params if k != "password"])
    if "@" in base:
        userinfo, host = base.rsplit("@", 1)  # the last @: a password may hold one
        user, colon, secret = userinfo.partition(":")
        if colon:
            password = unquote(secret)
        base = f"{user}@{host}"
    return f"{scheme}://{base}" + (f"?{query}" if query else ""), password
