"""HTTP calls to external services with a timeout and bounded retries.

Every call the toolkit makes to another process (judge and editor models, the retriever, web
search) goes through :func:`post_json` or :func:`get_json`, so that none can hang a run forever
or retry without limit. Connection errors, timeouts, HTTP 429 and 5xx are retried with
exponential backoff; other 4xx answers are the caller's mistake and fail at once.

This module does not cache (see ``etagent.tools``) and never logs request bodies or headers,
which may carry API keys.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


class ExternalCallError(RuntimeError):
    """An external call that failed after its retries (or failed in a way retrying cannot fix).
    ``cause`` is the short kind of failure the stages count (``ConnectError``, ``timeout``,
    ``HTTP 503``, ``invalid response``)."""

    def __init__(self, message: str, cause: str = "invalid response"):
        super().__init__(message)
        self.cause = cause


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


async def _request_json(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    json: Any = None,
    params: dict | None = None,
    headers: dict | None = None,
    timeout: float,
    attempts: int,
    backoff: float,
) -> Any:
    last_error, cause = "no attempt made", "invalid response"
    for attempt in range(1, attempts + 1):
        try:
            response = await client.request(method, url, json=json, params=params, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:  # connection refused, reset, timeout, ...
            last_error = f"{type(exc).__name__}: {exc}"
            cause = "timeout" if isinstance(exc, httpx.TimeoutException) else type(exc).__name__
        else:
            if response.status_code < 400:
                try:
                    return response.json()
                except ValueError as exc:
                    last_error, cause = f"invalid JSON in the response: {exc}", "invalid response"
            elif not _retryable(response.status_code):
                raise ExternalCallError(
                    f"{method} {url} -> HTTP {response.status_code}: {response.text[:300]}", f"HTTP {response.status_code}"
                )
            else:
                last_error, cause = f"HTTP {response.status_code}: {response.text[:300]}", f"HTTP {response.status_code}"
        if attempt < attempts:
            await asyncio.sleep(min(backoff * 2 ** (attempt - 1), 30.0))
    raise ExternalCallError(f"{method} {url} failed after {attempts} attempts: {last_error}", cause)


async def post_json(
    client: httpx.AsyncClient,
    url: str,
    payload: Any,
    *,
    headers: dict | None = None,
    timeout: float = 60.0,
    attempts: int = 3,
    backoff: float = 0.5,
) -> Any:
    """POST a JSON body and return the decoded JSON answer, retrying transient failures."""
    return await _request_json(client, "POST", url, json=payload, headers=headers, timeout=timeout, attempts=attempts, backoff=backoff)


async def get_json(
    client: httpx.AsyncClient,
    url: str,
    *,
    params: dict | None = None,
    headers: dict | None = None,
    timeout: float = 60.0,
    attempts: int = 3,
    backoff: float = 0.5,
) -> Any:
    """GET and return the decoded JSON answer, retrying transient failures."""
    return await _request_json(client, "GET", url, params=params, headers=headers, timeout=timeout, attempts=attempts, backoff=backoff)
