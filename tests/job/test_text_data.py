"""Plain text through the job's own preparation (slurmft/job/data.py, slurmft/job/prepare.py), in this process.

A text corpus (files globbed, one gzipped, documents per file and per blank-line block, a JSON lines source with its
text column renamed) mixed with a chat source: every token of every document is in the prepared set and in the loss
(the tokenizer's own tokens around it, EOS after it), a document longer than ``max_seq_length`` is there as
consecutive pieces, none dropped, the conversations are prepared as before (assistant tokens only), and a file that
went bad after ``validate`` is refused by the job with its source named.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
from collections import Counter
from pathlib import Path

import pytest

from slurmft.errors import JobSetupError

from .helpers import TINY_DATA, write_run

SEQ = 64
WORDS = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which"]


def _prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Files of a small corpus and the documents each source holds, as the job must split them."""
    rng = random.Random(7)
    root = tmp_path_factory.mktemp("corpus")
    (root / "books").mkdir()
    docs: dict[str, list[str]] = {"books": [], "blocks": [], "rows": []}
    for i, words in enumerate((12, 150, 40, 300)):  # two documents longer than SEQ tokens
        text = _prose(rng, words)
        docs["books"].append(text)
        data = (text + "\n").encode()
        name = f"book{i}.txt" + (".gz" if i == 1 else "")
        (root / "books" / name).write_bytes(gzip.compress(data) if i == 1 else data)
    blocks = [_prose(rng, n) for n in (8, 90, 20)]
    docs["blocks"] = blocks
    (root / "blocks.txt").write_text("\n\n".join(blocks) + "\n")
    rows = [_prose(rng, n) for n in (30, 5)]
    docs["rows"] = rows
    (root / "rows.jsonl").write_text("".join(json.dumps({"body": r, "id": i}) + "\n" for i, r in enumerate(rows)))
    return {"root": root, "docs": docs}


@pytest.fixture(scope="module")
def prepared(corpus: dict, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from datasets import load_from_disk

    from slurmft.job.prepare import prepare_run
    from slurmft.job.train import read_config
    from slurmft.rundir import RunPaths

    root = corpus["root"]
    sources = [{"path": str(root / "books" / "*"), "weight": 1.0},
               {"path": str(root / "blocks.txt"), "documents": "blank_line", "weight": 1.0},
               {"path": str(root / "rows.jsonl"), "format": "text", "columns": {"text": "body"}, "weight": 1.0},
               {"path": str(TINY_DATA / "lima.jsonl"), "weight": 0.05}]
    run = write_run(tmp_path_factory.mktemp("text-prep") / "run", tiny_model, [f"data.max_seq_length={SEQ}"],
                    edit=lambda d: d["data"].update(datasets=sources))
    record = prepare_run(str(run), num_proc=1, cfg=read_config(RunPaths.of(run)))
    return {"record": record, "rows": load_from_disk(str(run / "prepared")), "run": run}


def _sequences(rows) -> list[tuple[list[int], list[int]]]:
    """Every packed row split back into its sequences (by seq_lengths): (input_ids, labels)."""
    out = []
    for row in rows:
        start = 0
        for n in row["seq_lengths"]:
            out.append((row["input_ids"][start:start + n], row["labels"][start:start + n]))
            start += n
    return out


def test_every_document_token_is_prepared_in_pieces_none_dropped_all_in_the_loss(prepared: dict, corpus: dict,
                                                                                 tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    sequences = Counter(tuple(ids) for ids, _ in _sequences(prepared["rows"]))
    for ids, labels in _sequences(prepared["rows"]):
        assert all(label in (-100, token) for token, label in zip(ids, labels, strict=True))
    long = 0
    for name, docs in corpus["docs"].items():
        for doc in docs:
            # TRL's language modelling: the tokenizer's own special tokens around the text, then EOS
            ids = tok(doc + tok.eos_token)["input_ids"]
            assert ids[-1] == tok.eos_token_id
            pieces = [tuple(ids[i:i + SEQ]) for i in range(0, len(ids), SEQ)]
            long += len(pieces) > 1
            for piece in pieces:  # each piece a sequence of its own, every token of it a label
                assert sequences[piece] >= 1, (name, doc[:40], len(ids))
    assert long >= 2
    text_rows = [(ids, labels) for ids, labels in _sequences(prepared["rows"]) if list(ids) == list(labels)]
    chat_rows = [(ids, labels) for ids, labels in _sequences(prepared["rows"]) if list(ids) != list(labels)]
    assert text_rows and chat_rows  # the conversations keep their assistant-only labels
    result = prepared["record"]["result"]
    assert result["tokens"] == sum(len(ids) for ids, _ in _sequences(prepared["rows"]))
    assert result["loss_tokens"] == sum(sum(label != -100 for label in labels) for _, labels in
                                        _sequences(prepared["rows"]))


def test_validate_and_estimate_count_the_prepared_tokens_per_epoch(prepared: dict) -> None:
    from slurmft.job.train import read_config
    from slurmft.plan.checks import batch_notes
    from slurmft.plan.estimate import schedule
    from slurmft.rundir import RunPaths

    cfg = read_config(RunPaths.of(prepared["run"]))
    result = prepared["record"]["result"]
    notes = "\n".join(batch_notes(cfg, [], None))
    steps = -(-result["sequences"] // 4)  # 2 ranks x 2 sequences per step
    assert f"data: {result['sequences']:,} packed sequences per epoch (prepared, exact) -> {steps} optimizer" in notes
    assert f"data: {result['tokens']:,} tokens per epoch (prepared, exact)" in notes, notes
    plan = schedule(cfg)
    assert plan is not None and plan["tokens_per_epoch"] == result["tokens"] and plan["steps_per_epoch"] == steps


def test_the_record_names_the_corpus_files(prepared: dict, corpus: dict) -> None:
    from slurmft import prepared as record_of
    from slurmft.job.train import read_config
    from slurmft.rundir import RunPaths

    record = prepared["record"]
    books = record["inputs"]["sources"][0]
    assert books["glob"].endswith("books/*") and [Path(f["file"]).name for f in books["files"]] == [
        "book0.txt", "book1.txt.gz", "book2.txt", "book3.txt"]
    assert record["settings"]["sources"][1]["documents"] == "blank_line"
    assert "documents" not in record["settings"]["sources"][3]  # a chat source's record is as before
    cfg = read_config(RunPaths.of(prepared["run"]))
    assert record_of.differences(record, record_of.expected(cfg)) == []
    extra = corpus["root"] / "books" / "book9.txt"
    extra.write_text("a new book\n")
    try:
        (change,) = record_of.differences(record, record_of.expected(cfg))
        assert change.startswith("data.datasets[0] (") and "1 new (e.g. " in change and "book9.txt" in change
    finally:
        extra.unlink()


def test_a_file_that_went_bad_after_validate_is_refused_by_the_job(tmp_path: Path, tiny_model: Path) -> None:
    from slurmft.job.data import load_mixture
    from slurmft.job.train import read_config
    from slurmft.rundir import RunPaths

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("fine text\n")
    (tmp_path / "c" / "b.txt").write_bytes(b"")
    run = write_run(tmp_path / "run", tiny_model,
                    edit=lambda d: d["data"].update(datasets=[{"path": str(tmp_path / "c" / "*.txt")}]))
    cfg = read_config(RunPaths.of(run))
    with pytest.raises(JobSetupError, match=r"data.datasets\[0\] \(.*\*.txt\): .*b.txt is empty"):
        load_mixture(cfg.data, cfg.train.seed)


def test_a_mixture_keeps_its_order_and_each_kind_is_trls_own_preparation(prepared: dict, tiny_model: Path,
                                                                         tmp_path: Path) -> None:
    """Conversations and documents interleaved: the prepared rows come back in the mixture's order, a conversation
    exactly as TRL prepares it alone, a document as its pieces."""
    import dataclasses

    from datasets import Dataset, Features
    from trl import SFTTrainer

    from slurmft.job.data import _features
    from slurmft.job.inputs import load_tokenizer
    from slurmft.job.prepare import TrlPreparation, prepare_args
    from slurmft.job.train import read_config
    from slurmft.rundir import RunPaths

    cfg = read_config(RunPaths.of(prepared["run"]))
    tok = load_tokenizer(tiny_model, cfg)
    chat = [[{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]
            for i in range(3)]
    long = " ".join(WORDS * 12)  # several pieces
    rows = [{"messages": [], "text": "a short note"}, {"messages": chat[0], "text": None},
            {"messages": [], "text": long}, {"messages": chat[1], "text": None}, {"messages": chat[2], "text": None}]
    mixed = Dataset.from_list(rows, features=Features(_features(text=True)))
    args = dataclasses.replace(prepare_args(cfg, None, tmp_path), packing=False)
    got = TrlPreparation(tok, args, mixed[0])._with_text(mixed, args)
    expected: list[list[int]] = []
    for row in rows:
        if row["text"] is None:
            alone = Dataset.from_list([{"messages": row["messages"]}])
            expected.append(SFTTrainer._prepare_dataset(TrlPreparation(tok, args, alone[0]), alone, tok, args, False,
                                                        None, "train")[0]["input_ids"])
        else:
            ids = tok(row["text"] + tok.eos_token)["input_ids"]
            expected += [ids[i:i + SEQ] for i in range(0, len(ids), SEQ)]
    assert len(expected) > len(rows) + 1  # the long document is several pieces
    assert [list(r) for r in got["input_ids"]] == expected
    tok.eos_token = None  # a tokenizer that defines no EOS: the documents could not be told apart
    with pytest.raises(JobSetupError, match="the tokenizer has no EOS token, which plain text needs"):
        TrlPreparation(tok, args, mixed[0])._with_text(mixed, args)


def test_a_jsonl_zst_corpus_is_prepared_document_by_document(tiny_model: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """``.jsonl.zst`` files (zstandard-compressed JSON lines, ``format: text``): datasets decompresses them in the job;
    every document's tokens are in the prepared set. The prepare job's log calls them documents (it said
    'TRL prepared 4 conversations into ...' of a plain-text corpus)."""
    import zstandard
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from slurmft.job.prepare import prepare_run
    from slurmft.job.train import read_config
    from slurmft.rundir import RunPaths

    rng = random.Random(5)
    docs = [_prose(rng, n) for n in (10, 40, 120, 7)]
    for i in range(2):
        lines = "".join(json.dumps({"text": d}) + "\n" for d in docs[2 * i:2 * i + 2])
        (tmp_path / f"part{i}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    sources = [{"path": str(tmp_path / "*.jsonl.zst"), "format": "text"}]
    run = write_run(tmp_path / "run", tiny_model, [f"data.max_seq_length={SEQ}"],
                    edit=lambda d: d["data"].update(datasets=sources))
    with caplog.at_level(logging.INFO, logger="slurmft.job"):
        record = prepare_run(str(run), num_proc=1, cfg=read_config(RunPaths.of(run)))
    assert record["result"]["conversations"] == len(docs)
    said = "\n".join(r.getMessage() for r in caplog.records if r.name == "slurmft.job")
    assert f"loaded {len(docs)} documents in" in said and f"TRL prepared {len(docs)} documents into" in said, said
    assert "conversations" not in said, said
    tok = AutoTokenizer.from_pretrained(tiny_model)
    sequences = Counter(tuple(ids) for ids, _ in _sequences(load_from_disk(str(run / "prepared"))))
    for doc in docs:
        ids = tok(doc + tok.eos_token)["input_ids"]
        assert all(sequences[tuple(ids[i:i + SEQ])] >= 1 for i in range(0, len(ids), SEQ)), doc[:40]
