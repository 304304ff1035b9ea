"""Megatron-LM (megatron-core) training backend and HF <-> Megatron torch_dist conversion.

megatron-core is an optional extra (`pip install .[megatron]`): import the submodules, which
import it where they need it.

- trainer.py: ``MegatronTrainer``, the FSDPTrainer interface on a megatron-core GPTModel.
- convert.py: ``convert_hf_to_torch_dist`` and ``export_torch_dist_to_hf``.
- model.py: ``build_gpt_model``, ``init_parallel``, ``SUPPORTED_ARCHITECTURES``.
- mapping.py: ``hf_to_megatron``, ``megatron_to_hf``, ``shard``, ``unshard``.
- cpu_compat.py: ``enable_cpu_mode()``, test/CPU-only redirection of megatron's CUDA calls.
"""

import warnings

# megatron-core warns at import time that TransformerEngine and Apex are missing and that it
# falls back to torch implementations. This backend builds megatron's local (torch) layer spec
# on purpose, so the fallback is the intended path and the warnings only bury real ones.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed",
                        category=UserWarning, module=r"megatron\.core")
