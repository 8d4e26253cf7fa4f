"""A node's state read over its management endpoint, for ``p2pshard status --management``.

The command prints what it prints over the cluster port, from the endpoint's JSON instead of a
status request: ``GET /cluster/members``, then ``GET /cluster/shards/{type}`` for each entity
type (``GET /cluster/shards`` lists the types started on the node, unless the caller names
them). Over HTTPS the client presents the certificate of its configuration
and checks that the cluster CA signed the node's (not a host name: node certificates name none,
as between nodes). A bearer token, when given, goes with every request.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from membership import ConfigurationError

from ._config import ClientConfig
from ._status import StatusReply, client_identity, entity_type_from_json, reply_from_json


class ManagementRequestError(Exception):
    """The endpoint could not be reached, refused a request, or answered what it should not."""


def management_url(text: str) -> str:
    """The base URL of a management endpoint, ``http(s)://host:port``, checked.

    Raises:
        ConfigurationError: not an ``http`` or ``https`` URL with a host and no path.

    Example:
        >>> management_url("https://10.0.0.5:8558/")
        'https://10.0.0.5:8558'
    """
    example = "e.g. https://10.0.0.5:8558 or http://127.0.0.1:8558"
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ConfigurationError(f"--management {text!r} is not a URL ({exc}): {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(
            f"--management {text!r} is not an http:// or https:// URL with a host: {example}"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigurationError(
            f"--management {text!r} has a path: give the endpoint's root only, {example}"
        )
    return f"{parts.scheme}://{parts.netloc}"


def client_ssl_context(config: ClientConfig) -> ssl.SSLContext:
    """What a client of an HTTPS management endpoint trusts and presents: its ``[tls]``.

    Raises:
        ConfigurationError: a file is missing or cannot be loaded.
    """
    return client_identity(config).client_context()


async def fetch_status(
    url: str,
    *,
    config: ClientConfig | None,
    token: str | None,
    request_timeout: float,
    types: Sequence[str] = (),
) -> StatusReply:
    """The node's view, as ``p2pshard status`` shows it, read from its management endpoint.

    Args:
        url: The endpoint, ``http(s)://host:port`` (see :func:`management_url`).
        config: The client's configuration; required for ``https`` (its CA and certificate).
        token: The bearer token to send, or None.
        request_timeout: Seconds each request may take.
        types: The entity types to show (default: every one started on the node).

    Raises:
        ConfigurationError: ``https`` without ``config``, or its TLS files cannot be loaded.
        ManagementRequestError: the endpoint cannot be reached, refuses, or answers nonsense.
    """
    base = management_url(url)
    verify: ssl.SSLContext | bool = True
    if base.startswith("https:"):
        if config is None:
            raise ConfigurationError(
                f"{base} is HTTPS: give --config, a client's file (its CA and certificate)"
            )
        verify = client_ssl_context(config)
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(
        base_url=base, verify=verify, timeout=request_timeout, headers=headers
    ) as http:
        members = await _get(http, "/cluster/members")
        names = list(types) if types else await _type_names(http)
        entity_types = [
            entity_type_from_json(await _get(http, f"/cluster/shards/{quote(name, safe='')}"))
            for name in names
        ]
    try:
        return reply_from_json(members, entity_types)
    except (KeyError, TypeError, ValueError, ConfigurationError) as exc:
        raise ManagementRequestError(
            f"{base} answered a document that is not a p2pshard management answer ({exc!r})"
        ) from None


async def _type_names(http: httpx.AsyncClient) -> list[str]:
    listed = await _get(http, "/cluster/shards")
    names = listed.get("entity_types") if isinstance(listed, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ManagementRequestError(
            f"{http.base_url}cluster/shards answered {listed!r}, not a list of entity types"
        )
    return names


async def _get(http: httpx.AsyncClient, path: str, *, ok: Sequence[int] = (200,)) -> Any:
    where = f"{http.base_url.copy_with(path=path)}"
    try:
        response = await http.get(path)
    except httpx.HTTPError as exc:
        raise ManagementRequestError(
            f"cannot reach {where}: {exc or type(exc).__name__} (is the endpoint there, does it "
            "speak this scheme, and does it trust this certificate?)"
        ) from None
    try:
        document = response.json()
    except ValueError:
        document = None
    if response.status_code not in ok:
        reason = document.get("error") if isinstance(document, dict) else None
        raise ManagementRequestError(
            f"{where} answered {response.status_code}: {reason or response.text.strip()}"
        )
    if not isinstance(document, dict):
        raise ManagementRequestError(f"{where} did not answer a JSON object")
    return document
