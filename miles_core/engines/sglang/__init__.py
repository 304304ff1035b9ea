"""SGLang: the HTTP client every engine (SGLang's server or the embedded one) is driven through,
the launcher that starts SGLang's server as a child of an engine actor, and the table of server
arguments checked against SGLang's source. The client runs wherever an engine is called from (the
router in the driver, weight transports in the trainer); the launcher runs in the engine actor.
"""
