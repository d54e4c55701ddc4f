"""One HTTP client for every request a bench sends (thread-safe, keep-alive connections).

``httpx.post(...)`` and ``httpx.stream(...)`` build a new client per call, and a client
builds an SSL context (18-40 ms of CPU measured here, even for plain http). Eight bench
threads starting streams at once then spent about 0.2 s in the bench itself before any
request left, time that the benches counted as the server's (its first-token latency,
every stream's wall time). A client built once, before anything is timed, keeps that out
of the measurements; it also reuses connections, as the OpenAI SDK does.
"""

from __future__ import annotations

import httpx

CLIENT = httpx.Client(timeout=900, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
