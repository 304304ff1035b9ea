"""The embedded engine: a transformers model served behind SGLang's HTTP API (engine, the batched
slot decoder, the service that queues requests and applies weight updates, the HTTP server with
its limits and request parsing, retract-style pauses, FP8 linear layers). It runs in an engine
actor's process (`python -m miles_core.engines.embedded.http_server` or in-process via `serve`).
"""
