"""Tiny, real test assets: a random Llama in safetensors plus a locally trained tokenizer.

Nothing is downloaded: the byte-level BPE tokenizer is trained with ``tokenizers`` on Python source
that ships with the interpreter and with transformers, plus a few chat-style sentences, and carries
a ChatML-style chat template whose assistant turns sit inside ``{% generation %}`` so TRL's
``assistant_only_loss`` can mask everything else. Weights are random but seeded, so two builds are
byte-identical.

``python -m slurmft.tiny OUT_DIR [--size tiny|150m|1b] [--dtype float32|bfloat16]`` writes a
directory that ``from_pretrained`` (and the slurmft job) load like any hub snapshot:
``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``.
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
    # ~170M parameters (~650 MiB in fp32): the memory benchmark's model (docs/design-notes.md).
    "150m": Size(8192, 1024, 2816, 12, 16, 16, 2048),
    # ~1.1B parameters (TinyLlama-like shape): the GPU smoke test's model.
    "1b": Size(8192, 2048, 5632, 22, 32, 4, 4096),
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


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(prog="python -m slurmft.tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", help="directory to write (created)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)
    t0 = time.time()
    out = build(args.out_dir, args.size, args.dtype)
    n_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {args.size} Llama ({n_bytes / 2**20:.1f} MiB of {args.dtype} safetensors) and tokenizer "
          f"to {out} in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
