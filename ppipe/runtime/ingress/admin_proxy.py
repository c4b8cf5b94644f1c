"""An ingress process's admin endpoints: passed on to the scheduler's own API.

On a server of ingress processes (``ppipe serve --ingress N``) the clients' port is the
ingresses', while plans are switched where they are scheduled: in the ``ppipe serve``
process, whose plan switcher starts and stops the workers and whose own HTTP API listens on
a loopback port. An ingress answers ``GET`` and ``POST /v2/admin/plan`` (``ppipe apply``)
by sending the same request (method, path and query, body, ``authorization`` header) to
that API and relaying its status and JSON body, so that a switch asked of any ingress is
the one switch of the server, refused or made there with the reasons any server gives.
The scheduler then tells every ingress the new plan
(:class:`~ppipe.runtime.wire.messages.ServedPlan`).
"""

from __future__ import annotations

import asyncio
import json

from ppipe.runtime.client.httpclient import HttpError, RawHttpClient

# a switch answers once the new plan's workers have started (their start timeout is 300 s by default)
SWITCH_TIMEOUT_S = 330.0


class AdminProxy:
    """Passes admin requests to the scheduler's API at ``upstream_url`` (``http://127.0.0.1:PORT``).

    Args:
        upstream_url: the scheduler's own HTTP API.
        timeout_s: the longest an admin request may take there.
    """

    def __init__(self, upstream_url: str, timeout_s: float = SWITCH_TIMEOUT_S):
        self.upstream_url, self.timeout_s = upstream_url, timeout_s

    async def forward(self, method: str, path_and_query: str, body: bytes, authorization: str | None) -> tuple[int, bytes]:
        """(status, JSON body) of the request made at the scheduler; 503 with ``{"error": ...}``
        when the scheduler's API cannot be reached or does not answer within the timeout."""
        client = RawHttpClient(self.upstream_url, timeout_s=self.timeout_s)
        headers = {"authorization": authorization} if authorization else {}
        try:
            status, _, data = await client.request(method, path_and_query, body, headers={**headers, "connection": "close"})
        except (OSError, HttpError, asyncio.TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return 503, json.dumps({"error": f"the scheduler's API at {self.upstream_url}, which switches this server's plans, "
                                             f"did not answer ({why}); GET /v2/admin/plan says which plan it serves"}).encode()
        finally:
            await client.aclose()
        return status, data
