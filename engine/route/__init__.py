"""``kvtier route``: one cache-aware router in front of several ``kvtier serve`` backends
that share a Redis L3 (DESIGN §11).

``index`` is what the router knows a backend holds (its L1/L2 pages, the pages of
requests in flight there), ``backend`` a backend's state as its event stream and health
checks report it, ``stream`` the event-stream client, ``health`` the health checks,
``l3`` the shared L3's residency, ``placement`` the policies (the cache-aware one is
``costmodel.fleet.choose``), ``proxy`` the forwarding with retries and the deadline,
``app`` the ASGI app. No model is loaded: a tokenizer renders each prompt as
``kvtier serve`` does (``engine.serve.prompt``), so its page keys are the backends'.
This package imports the engine's serving code for rendering, never the CLI above it.
"""
