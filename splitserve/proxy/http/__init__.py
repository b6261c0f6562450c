"""HTTP/1.1 on asyncio protocols for the proxy: ``server`` with ``server_connection`` and
``messages`` (clients in), ``client`` with ``connection`` and ``response`` (completions out to the
engines) and ``session`` (health checks, /v1/models).

Plain HTTP only: nothing here knows of prefill, decode or OpenAI bodies, so the proxy's P/D logic
(``splitserve.proxy``) sits above it and this package imports nothing from there.
"""
