"""What of an engine's configuration changes the KV of the same tokens: the engine's
identity, as both modes put it in their keys (the tiered connector's `KeySpace`,
connector/keys.py; native mode's `engine_identity`, native/tier.py). One module, so that
the two modes agree on what makes two engines' KV interchangeable, and native mode needs
nothing of the connector's internals for it.
"""

from __future__ import annotations

import hashlib
import json


def model_config_hash(model_config) -> str:
    """Everything of vLLM's model config that can change the KV of the same tokens.

    vLLM's `compute_hash()` covers the model, revision, quantization, dtype and the rest of
    the computation graph's factors, but ignores `hf_overrides` (which can change rope
    scaling, head counts, ...): both go in."""
    overrides = getattr(model_config, "hf_overrides", None)
    try:
        overrides_text = json.dumps(overrides, sort_keys=True, default=repr)
    except TypeError:  # a callable override: its name is the best stable identity
        overrides_text = repr(getattr(overrides, "__qualname__", overrides))
    text = f"{model_config.compute_hash()}|{overrides_text}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def pipeline_partition(vllm_config) -> str:
    """The pipeline's layer partition ("0-14,14-28"; "" without pipeline parallelism): two
    engines that split the layers differently store different layers under one stage."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp == 1:
        return ""
    from vllm.distributed.utils import get_pp_indices
    n = vllm_config.model_config.get_total_num_hidden_layers()
    return ",".join("{}-{}".format(*get_pp_indices(n, r, pp)) for r in range(pp))
