"""slurmft/job/batches.py: each step's sequences digested where the batch is collated, on the host.

The training step of a GPU rank must not read the batch back from the device (a ``.cpu()`` per micro-batch makes
the rank wait there for the previous backward: issue 45). The step runs here on a batch moved to the meta device,
whose data cannot be read at all, under the profiler: it must neither fail nor copy nor read a scalar. The hashes
are the ones computed from the host batch, and the token count is the batch's non-padding tokens.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from slurmft.job.batches import HASHES, BatchDigest, sequence_hash, sequences

READ_BACK = ("aten::_to_copy", "aten::copy_", "aten::item", "aten::_local_scalar_dense", "aten::to")


def _trainer(collator: Any) -> SimpleNamespace:
    stepped: list[dict[str, Any]] = []

    def training_step(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> str:
        stepped.append(inputs)
        return "stepped"

    return SimpleNamespace(data_collator=collator, training_step=training_step, stepped=stepped,
                           _track_num_input_tokens=lambda inputs: inputs["input_ids"].sum().item())


def test_a_step_on_device_memory_reads_nothing_back(tmp_path: Path) -> None:
    from accelerate.utils import send_to_device
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    examples = [{"input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, 6, 7, 8, 9, 10], "seq_lengths": [4, 2]},
                {"input_ids": [11, 12, 13], "labels": [11, 12, 13], "seq_lengths": [3]}]
    host = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    expected = [sequence_hash(s) for s in sequences(host)]
    assert len(expected) == 3  # padding-free: three sequences, split where the position ids restart

    digest = BatchDigest(SimpleNamespace(world_size=1, is_main=True), tmp_path / "batches.jsonl", {})
    trainer = _trainer(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True))
    digest.watch(trainer)
    batch = trainer.data_collator(examples)  # on the host, where the DataLoader collates
    on_device = send_to_device(batch, torch.device("meta"))  # what accelerate does with it: only tensors move
    # 9 tokens in 3 sequences of 4, 2 and 3: their first labels masked by the collator, the shift drops one more
    assert on_device["input_ids"].is_meta and on_device[HASHES] == (expected, 9, 6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert trainer.training_step(None, on_device) == "stepped"
    ops = {event.name for event in prof.events()}
    assert not ops & set(READ_BACK), ops & set(READ_BACK)
    assert HASHES not in trainer.stepped[0]  # the model never sees them
    assert digest._hashes == expected and digest._tokens == 9
    assert trainer._track_num_input_tokens(on_device) is None  # the Trainer's own per-micro-batch count: ours now
