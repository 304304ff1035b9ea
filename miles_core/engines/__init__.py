"""Rollout engines: the processes that generate. `interface` is the protocol an engine actor needs of
the engine it hosts; `sglang/` is SGLang (the HTTP client every engine is driven through, the
launcher of its server process and the server-argument table checked against SGLang's source);
`embedded/` is the in-repo engine (a transformers model behind SGLang's HTTP API). The code here
runs in the engine actors' processes (and, for the client, wherever an engine is called from).
"""
