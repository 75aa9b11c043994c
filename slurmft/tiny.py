"""Tiny, real test assets: a random Llama in safetensors plus a locally trained tokenizer.

Nothing is downloaded: the byte-level BPE tokenizer is trained with ``tokenizers`` on Python source
that ships with the interpreter and with transformers, plus a few chat-style sentences, and carries
a ChatML-style chat template whose assistant turns sit inside ``{% generation %}`` so TRL's
``assistant_only_loss`` can mask everything else. Weights are random but seeded, so two builds are
byte-identical.

``python -m slurmft.tiny OUT_DIR [--size tiny|150m|1b] [--dtype float32|bfloat16] [--arch MODEL_TYPE]``
writes a directory that ``from_pretrained`` (and the slurmft job) load like any hub snapshot:
``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``. ``--arch`` builds one of :data:`ARCHITECTURES`
instead of the Llama (transformers' own ``AutoConfig.for_model`` at a tiny size, saved by its own
``save_pretrained``, so the files have the layout a hub checkpoint of that architecture has).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SEED = 0

# Special tokens: <|im_end|> ends every turn and is the EOS the model learns to emit.
BOS, EOS, PAD, IM_START = "<|bos|>", "<|im_end|>", "<|pad|>", "<|im_start|>"
SPECIAL_TOKENS = [BOS, PAD, IM_START, EOS]

# ChatML with the assistant's reply *and* its end-of-turn token inside {% generation %}: the loss
# then covers exactly what the model must produce, including when to stop.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Size:
    """Architecture of one preset."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


SIZES = {
    # ~5.3M parameters (20 MiB fp32): fast enough for multi-process CPU tests.
    "tiny": Size(4096, 256, 688, 4, 4, 4, 512),
    # ~0.73M parameters: tiny's tokenizer (so the same data packs into the same sequences) at a quarter of its
    # width. The cluster tests' model (tests/slurm/conftest.py): a 2-rank CPU step takes 0.35 s instead of 0.93 s
    # on a 2-core machine, and CI trains some forty cluster runs.
    "micro": Size(4096, 64, 172, 4, 4, 4, 512),
    # ~170M parameters (~650 MiB in fp32): the memory benchmark's model (docs/design-notes.md).
    "150m": Size(8192, 1024, 2816, 12, 16, 16, 2048),
    # ~1.1B parameters (TinyLlama-like shape): the GPU smoke test's model.
    "1b": Size(8192, 2048, 5632, 22, 32, 4, 4096),
}


# Tiny shapes of architectures transformers ships, for AutoConfig.for_model(model_type, **COMMON, **extra):
# the list docs/first-run.md names as tested (tests/job/test_architectures_cpu.py trains each of them).
ARCH_COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
ARCHITECTURES: dict[str, dict[str, object]] = {
    "qwen3": {},
    "mistral": {},
    "olmo2": {},
    "granite": {},
    "gemma": {"tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True},
    "gemma3_text": {"tie_word_embeddings": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # head size 32: the smallest vLLM's CPU attention takes (tests/job/test_architectures_cpu.py serves it)
    "qwen3_moe": {**_MOE, "num_experts": 4, "decoder_sparse_step": 1, "head_dim": 32},
    "deepseek_v3": {**_MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "n_group": 1, "topk_group": 1,
                    "head_dim": 8, "num_key_value_heads": 4},  # as DeepSeek-V3: rotary dims = qk_rope_head_dim, MHA
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"]},
}


def _corpus_files() -> list[str]:
    """Text that ships with Python and transformers, in a fixed order."""
    import transformers

    llama = Path(transformers.__file__).parent / "models" / "llama"
    stdlib = Path(os.__file__).parent
    files = sorted(str(p) for p in llama.glob("*.py"))
    files += sorted(str(p) for p in stdlib.glob("*.py"))[:120]
    return files


def _chat_sentences() -> list[str]:
    """A few thousand short chat-like lines so words and numbers of the example data get merges."""
    names = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi"]
    lines = []
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            lines.append(f"What is {a} plus {b}? {a} plus {b} is {a + b}.")
            lines.append(f"What is {a} times {b}? {a} times {b} is {a * b}.")
    for n in names:
        lines.append(f"Say hello to {n}. Hello, {n}! Nice to meet you. How are you today? I am fine, thank you.")
    return lines


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE tokenizer locally and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def lines():
        for path in _corpus_files():
            with open(path, encoding="utf-8", errors="replace") as f:
                yield from f
        yield from _chat_sentences()

    tok.train_from_iterator(lines(), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1_000_000
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build(out_dir: str | os.PathLike[str], size: str = "tiny", dtype: str = "float32") -> Path:
    """Write the model and tokenizer of preset ``size`` to ``out_dir`` (created); return the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; use one of {', '.join(SIZES)}")
    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)  # config.json says what the file holds
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_arch(out_dir: str | os.PathLike[str], model_type: str, tokenizer: object | None = None) -> Path:
    """Write a tiny random model of ``model_type`` (one of :data:`ARCHITECTURES`) and the tiny tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {model_type!r}; use one of {', '.join(ARCHITECTURES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(SIZES["tiny"].vocab_size)
    config = AutoConfig.for_model(
        model_type, **{**ARCH_COMMON, **ARCHITECTURES[model_type]}, vocab_size=len(tok),  # type: ignore[arg-type]
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,  # type: ignore[attr-defined]
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id  # type: ignore[attr-defined]
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)  # type: ignore[attr-defined]
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(prog="python -m slurmft.tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", help="directory to write (created)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--arch", choices=sorted(ARCHITECTURES), help="another architecture, at tiny size (float32)")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.arch:
        out = build_arch(args.out_dir, args.arch)
        print(f"wrote a tiny {args.arch} and tokenizer to {out} in {time.time() - t0:.1f}s")
        return 0
    out = build(args.out_dir, args.size, args.dtype)
    n_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {args.size} Llama ({n_bytes / 2**20:.1f} MiB of {args.dtype} safetensors) and tokenizer "
          f"to {out} in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
