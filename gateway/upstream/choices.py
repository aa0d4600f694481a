"""The data-path clients by name (`--upstream-client`), resolved once.

Like uvicorn's `HTTP_PROTOCOLS`: a name maps to "module:Class", imported only when chosen, so
an optional library (aiohttp, the extra `pd-gateway[aiohttp]`) is needed only by those who
choose it. The config rules resolve the choice before the port is bound; the runtime opens it.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

    from gateway.upstream.base import Upstream, UpstreamClass, UpstreamSettings

UPSTREAM_CLIENTS: dict[str, str] = {
    "fast": "gateway.upstream.fast:FastUpstream",
    "aiohttp": "gateway.upstream.aiohttp_client:AiohttpUpstream",
    "httpx": "gateway.upstream.httpx_client:HttpxUpstream",
}
EXTRAS: dict[str, str] = {"aiohttp": "aiohttp"}  # client name -> the extra that installs it


class MissingClient(ImportError):
    """The chosen client's library is not installed (a config error: exit 2)."""


@functools.cache
def upstream_class(name: str) -> UpstreamClass:
    """The adapter class named `name`; raises MissingClient, naming the extra to install."""
    module_name, _, class_name = UPSTREAM_CLIENTS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = EXTRAS.get(name)
        if extra is None or exc.name is None or exc.name.startswith("gateway"):
            raise
        raise MissingClient(
            f"--upstream-client {name} needs the {exc.name!r} package, which is not "
            f"installed: pip install 'pd-gateway[{extra}]'") from exc
    return getattr(module, class_name)


async def open_upstream(name: str, settings: UpstreamSettings,
                        control: httpx.AsyncClient) -> Upstream:
    """The data-path client named `name`, ready to post (`control`: the process's httpx
    client, which the "httpx" choice shares)."""
    return await upstream_class(name).open(settings, control)
