"""Weight sync: moving the trainer's weights into the rollout engines. The transports (object store,
shared memory, disk, NCCL broadcast, CUDA IPC to SGLang), the name/shape layout both sides agree on
and its digest, the shared buffer trainer and engines map, LoRA adapter-only payloads, and block-FP8
quantization with the FP8 starting checkpoint the syncs land in. The sending side runs in the
driver and the trainer actors; the receiving helpers (layout, shared buffer, adapter merge) run in
the engine actors.
"""
