"""``kvtier serve``: OpenAI- and Anthropic-compatible HTTP on one engine.

``app`` is the ASGI app and its endpoints, ``generation`` follows one submitted request
(its text cut at a stop string, its logprobs), ``draining`` the uvicorn server whose
shutdown ends the requests in flight, ``api`` the request bodies and their checks,
``responses`` what goes back, ``prometheus`` the one module that names every metric.
This package imports the engine's core, never the CLI above it.
"""
