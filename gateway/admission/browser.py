"""A browser is a stranger: requests a web page makes on the admin and abort routes.

Without admin keys the admin API trusts loopback callers, and a browser on the gateway's host
is one: any page it shows can send requests there. `BrowserGuard.check` runs on every admin
and abort request, right after the caller is identified (`auth.Auth.caller`), and refuses
what only a page would send (docs/SECURITY.md, "Browsers"):

1. Host (403), when the caller is trusted for being on this host (a loopback caller without
   a valid key while no admin key is configured): a name other than `localhost`, the
   `--host` name or an `--allowed-host` name is a DNS-rebinding page's own name resolved to
   this host. IP literals pass: a page reaches this host under an address literal only as a
   page of that address (then its requests are cross-site below, or it is the gateway's own).
   Callers with a key, or from other hosts, may use any Host (load balancers).
2. `Sec-Fetch-Site` other than `same-origin` or `none` (403), on methods other than GET/HEAD.
3. `Origin` whose host:port is not the request's own Host (403), on methods other than
   GET/HEAD; `Origin: null` (sandboxed frames, files) is a stranger too.
4. A body or a declared content type that is not `application/json` (415), on methods other
   than GET/HEAD: a page can send text/plain or form bodies without asking the server first,
   and the gateway answers no CORS preflight with allow headers, so JSON cannot be sent
   cross-site at all.

Clients that are not browsers (curl, SDKs, the tests' rigs) send no Origin or Sec-Fetch-Site
and name the gateway by the address they connected to, so they pass unchanged. A request
without Host is not a browser's (every browser sends one).
"""

from __future__ import annotations

import functools
import ipaddress

from gateway.errors import BadRequest, Forbidden

SAFE_METHODS = frozenset({"GET", "HEAD"})
SAME_ORIGIN = frozenset({b"same-origin", b"none"})  # `none`: the user typed the URL
DEFAULT_PORTS = {"http": 80, "https": 443}
_WATCHED = frozenset({b"host", b"origin", b"sec-fetch-site", b"content-type"})


def host_name(host: str) -> str:
    """The name of a Host value or flag, lowercased, without port, brackets or final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def split_host(host: str, default_port: int | None) -> tuple[str, int | None]:
    """(name, port) of a `host[:port]` value; `default_port` when it names none."""
    name = host_name(host)
    rest = host.strip().rsplit("]", 1)[-1] if host.strip().startswith("[") else host.strip()
    port: int | None = default_port
    if rest.count(":") == 1:
        digits = rest.split(":", 1)[1]
        port = int(digits) if digits.isdigit() and len(digits) <= 5 else -1
    return name, port


@functools.lru_cache(maxsize=256)
def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        return False
    return True


class BrowserGuard:
    """The checks of admin and abort requests against pages in browsers; `names` are the
    names besides IP literals that this gateway answers to (`--host`, `--allowed-host`)."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.names = frozenset({"localhost", *(host_name(n) for n in names if n)})

    def check(self, scope: dict, by_address: bool) -> None:
        """Raise 403/415 when the request is a page's; `by_address`: the caller is trusted
        for being on this host, so its Host must name this gateway."""
        seen: dict[bytes, bytes] = {}
        body = False
        for name, value in scope["headers"]:
            if name in _WATCHED:
                if name in seen:  # proxies disagree on which copy counts: neither does
                    raise Forbidden(f"several {name.decode()} headers")
                seen[name] = value
            elif name == b"content-length":
                body = body or value.strip(b" \t0") != b""
            elif name == b"transfer-encoding":
                body = True
        host = seen.get(b"host")
        if by_address and host is not None:
            self._check_host(host.decode("latin-1"))
        if scope.get("method", "GET") in SAFE_METHODS:
            return
        site = seen.get(b"sec-fetch-site")
        if site is not None and site.strip().lower() not in SAME_ORIGIN:
            raise Forbidden("cross-site request refused (Sec-Fetch-Site is not same-origin): "
                            "the admin and abort routes answer only their own pages and "
                            "non-browser clients")
        origin = seen.get(b"origin")
        if origin is not None:
            _check_origin(origin, host)
        content_type = seen.get(b"content-type")
        if (body or content_type is not None) and not _is_json(content_type):
            raise BadRequest("this route takes a JSON body: send Content-Type: application/json",
                             status=415)

    def _check_host(self, host: str) -> None:
        name = host_name(host)
        if name in self.names or _is_ip_literal(name):
            return
        raise Forbidden("the Host header is not a name of this gateway: without admin keys "
                        "the admin and abort routes answer loopback clients only under its "
                        "address, 'localhost' and --allowed-host names (DNS rebinding)")


def _check_origin(origin: bytes, host: bytes | None) -> None:
    """The Origin's host:port (its scheme's default port when it names none) must be the
    request's own Host."""
    scheme, sep, rest = origin.decode("latin-1").strip().partition("://")
    scheme = scheme.lower()
    if sep and host is not None and scheme in DEFAULT_PORTS and "/" not in rest:
        default = DEFAULT_PORTS[scheme]
        if split_host(rest, default) == split_host(host.decode("latin-1"), default):
            return
    raise Forbidden("cross-origin request refused (Origin is not this gateway's Host): the "
                    "admin and abort routes answer only their own pages and non-browser "
                    "clients")


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    return content_type.split(b";", 1)[0].strip().lower() == b"application/json"
