"""exitlm.serve: an OpenAI-compatible HTTP server on the decoding engine (``exitlm serve``).

:mod:`~exitlm.serve.app` builds the ASGI application (routes, API key, errors, request log),
:mod:`~exitlm.serve.generation` serves completions and chat completions (streamed as SSE or
not), :mod:`~exitlm.serve.runner` steps the engine on its own thread,
:mod:`~exitlm.serve.protocol` validates request bodies, :mod:`~exitlm.serve.limits` bounds
what one request may ask for, :mod:`~exitlm.serve.prompts` tokenizes prompts off the event
loop, :mod:`~exitlm.serve.formats` shapes
responses (with the ``exit_layers`` / ``early_exit`` extensions),
:mod:`~exitlm.serve.metrics` exports Prometheus counters and :mod:`~exitlm.serve.cli` is the
command. Importing this package does not import the web stack; use the modules.
"""
