"""Plain text on real two-rank FSDP2 (gloo, CPU): packed documents do not attend to each other, every token counts.

One run of the micro model on a small corpus of .txt files (one document per file, one longer than
``max_seq_length``): its pieces pack into exactly one global batch (2 ranks x 2 rows of 64 tokens), so step 1
trains on every piece once (``batches.jsonl``'s digest is the multiset of the pieces tokenized here, independently
of the job). Its step-1 loss must equal transformers' own causal-LM loss of each piece run *alone* (a fresh
model, SDPA, no packing), the pieces' summed losses over their summed targets, within fp32 tolerance: a packed
row whose documents saw each other would give another loss. Every token counted: the targets in the loss are
the tokens of the batch minus one per document (piece).

In process, cheaper: transformers 5.24 builds the block-diagonal mask from ``position_ids`` that restart at 0
(``masking_utils.find_packed_sequence_indices``, used when no attention mask is passed, as TRL's padding-free
collator passes none), on SDPA and on eager alike; the same row with positions that do not restart gives other
logits, so the comparison above can fail.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from .helpers import launch, read_metrics, write_run

pytestmark = pytest.mark.train

SEQ = 64
#: tokens of each document (its EOS included): 100 is cut into 64 + 36; the 7 pieces fill exactly 4 rows of 64 by
#: best fit decreasing (64 | 50 + 14 | 36 + 28 | 30 + 20), one global batch of 2 ranks x 2 rows
LENGTHS = (100, 50, 30, 20, 14, 28)
WORDS = ["river", "stone", "the", "of", "bridge", "night", "and", "rose", "morning", "was", "gone", "by", "a",
         "light", "over", "water", "in", "field", "north", "wind"]


def _documents(tokenizer) -> list[str]:
    """Seeded prose, one document per length of LENGTHS, each tokenizing (with EOS) to exactly that length."""
    rng = random.Random(51)
    docs = []
    for length in LENGTHS:
        while True:
            words: list[str] = []
            while len(tokenizer(" ".join(words) + tokenizer.eos_token)["input_ids"]) < length:
                words.append(rng.choice(WORDS))
            if len(tokenizer(" ".join(words) + tokenizer.eos_token)["input_ids"]) == length:
                docs.append(" ".join(words))
                break
    return docs


def _pieces(tokenizer, docs: list[str]) -> list[list[int]]:
    """TRL's language modelling of each document (the tokenizer's tokens, EOS), cut into pieces of SEQ tokens."""
    out = []
    for doc in docs:
        ids = tokenizer(doc + tokenizer.eos_token)["input_ids"]
        out += [ids[i:i + SEQ] for i in range(0, len(ids), SEQ)]
    return out


@pytest.fixture(scope="module")
def text_run(micro_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(micro_model)
    docs = _documents(tokenizer)
    root = tmp_path_factory.mktemp("text-fsdp")
    (root / "corpus").mkdir()
    for i, doc in enumerate(docs):
        (root / "corpus" / f"doc{i}.txt").write_text(doc + "\n")
    # the product's default, prepare.enabled: the prepare job's work (prepare_run, here in this process), then the
    # train job reads prepared/ and checks its record (the globbed files) on every rank
    run = write_run(root / "run", micro_model, ["prepare.enabled=true", "train.max_steps=1", "checkpoint.every_steps=1",
                                                 f"data.max_seq_length={SEQ}", "train.per_device_batch_size=2",
                                                 "train.gradient_accumulation_steps=1", "train.warmup_ratio=0"],
                    edit=lambda d: d["data"].update(datasets=[{"path": str(root / "corpus" / "*.txt")}]))
    from slurmft.job.prepare import prepare_run

    record = prepare_run(str(run), num_proc=1)
    assert record["result"]["sequences"] == 4 and record["result"]["tokens"] == sum(LENGTHS), record["result"]
    rc, out = launch(run, job_env).wait(timeout=300)
    assert rc == 0, out[-6000:]
    assert len(re.findall(r"slurmft rank \d: completed at step 1", out)) == 2, out[-3000:]
    assert "data: 4 prepared sequences read from" in out, out[-3000:]
    return {"run": run, "pieces": _pieces(tokenizer, docs), "out": out}


def test_fsdp_shards_the_text_run(text_run: dict) -> None:
    for r in (0, 1):
        rep = json.loads((text_run["run"] / "fsdp_report" / f"rank{r}.json").read_text())
        assert rep["distributed_type"] == "DistributedType.FSDP"
        assert rep["param_types"] == ["DTensor"] and rep["placements"] == ["(Shard(dim=0),)"], rep


def test_step_one_trains_every_piece_once_and_counts_every_token(text_run: dict) -> None:
    import torch

    from slurmft.job.batches import digest, sequence_hash

    (step,) = [json.loads(line) for line in (text_run["run"] / "batches.jsonl").read_text().splitlines()]
    pieces = text_run["pieces"]
    assert len(pieces) == 7 and max(len(p) for p in pieces) == SEQ
    assert step["sequences"] == len(pieces)
    assert step["digest"] == digest([sequence_hash(torch.tensor(p)) for p in pieces])  # these pieces, once each
    assert step["tokens"] == sum(LENGTHS)
    assert step["loss_tokens"] == step["tokens"] - len(pieces)  # every token a target but each piece's first


def test_step_one_loss_equals_each_document_run_alone(text_run: dict, micro_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32, attn_implementation="sdpa")
    pieces = text_run["pieces"]
    total, targets = 0.0, 0
    with torch.no_grad():
        for piece in pieces:
            ids = torch.tensor([piece])
            total += float(model(input_ids=ids, labels=ids).loss) * (len(piece) - 1)  # a mean over its targets
            targets += len(piece) - 1
        # the same pieces in one row that lets each see the ones before it (each first label masked all the same)
        row = torch.tensor([sum(pieces, [])])
        labels = row.clone()
        labels[0, torch.tensor([0, *torch.tensor([len(p) for p in pieces]).cumsum(0)[:-1].tolist()])] = -100
        leaky = float(model(input_ids=row, labels=labels).loss)
    (first,) = read_metrics(text_run["run"])
    assert first["step"] == 1
    alone = total / targets
    assert first["loss"] == pytest.approx(alone, rel=1e-6), (first["loss"], alone)
    assert abs(leaky - alone) > 100 * 1e-6 * alone, (leaky, alone)  # what the tolerance tells apart (2026-12-06: 6e-4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_transformers_keeps_packed_documents_apart_when_positions_restart(micro_model: Path, attn: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32, attn_implementation=attn)
    generator = torch.Generator().manual_seed(0)
    docs = [torch.randint(4, 4000, (n,), generator=generator) for n in (9, 5, 12)]
    row = torch.cat(docs)[None]
    restart = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
        packed = model(input_ids=row, position_ids=restart, use_cache=False).logits[0]
        seen = model(input_ids=row, position_ids=torch.arange(row.shape[1])[None], use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (seen[9:] - alone[9:]).abs().max() > 1e-3  # without the restart the later documents see the first


def test_a_model_that_builds_its_own_mask_is_refused_for_packed_text(micro_model: Path) -> None:
    """Not kept apart without transformers' masking_utils (custom code): refused, saying why and the fix."""
    import torch
    from transformers import AutoModelForCausalLM

    from slurmft.job.loading import packed_documents_problem

    # a model class of custom code (its module is not this file, whose text names masking_utils)
    OwnMask = type("OwnMask", (torch.nn.Module,), {"__module__": "transformers_modules.own.modeling_own"})

    problem = packed_documents_problem(OwnMask(), "sdpa", padding_free=True)
    assert problem is not None and "OwnMask" in problem and "documents would attend to each other" in problem
    assert "flash_attention_2" in problem and "data.packing=false" in problem
    assert packed_documents_problem(OwnMask(), "flash_attention_2", padding_free=True) is None  # varlen boundaries
    assert packed_documents_problem(OwnMask(), "sdpa", padding_free=False) is None  # a row per sequence
    llama = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32)
    assert packed_documents_problem(llama, "sdpa", padding_free=True) is None
