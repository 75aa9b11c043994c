"""LoRA's facts that the schema, ``validate``, the job and ``status`` share: PEFT's scaling rule, the
``all-linear`` keyword, the embeddings' module names and why an adapter on a tied one is refused.

Standard library only, and no slurmft imports: ``slurmft status`` prints an adapter's scaling without
importing the config's schema (pydantic), and the job names a refused target with ``validate``'s words.
"""

from __future__ import annotations

import math

#: ``lora.target_modules``: every linear layer of the decoder (PEFT's keyword).
ALL_LINEAR = "all-linear"

#: The input and output embeddings as ``target_modules`` names them (Llama-style models).
EMBEDDING_MODULES = ("embed_tokens", "lm_head")


def tied_target_problem(target: str, model: str) -> str:
    """Why an adapter on a tied input/output embedding is refused (the job and ``validate`` say the same)."""
    return (f"lora.target_modules: {target!r} is one of the tied input and output embeddings of {model} "
            "(tie_word_embeddings: one matrix used twice); an adapter there trains a change of one use only, which "
            "the merged model cannot hold. Leave it out (adapt the decoder layers: all-linear, or e.g. q_proj, v_proj)")


def lora_scaling(alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's rule (``LoraLayer.update_layer``): alpha / r, or alpha / sqrt(r) with use_rslora."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r
