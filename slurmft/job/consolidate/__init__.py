"""Consolidation: a sharded DCP checkpoint becomes a deployable Hugging Face model directory.

Training saves sharded checkpoints that cannot be served; consolidation (a CPU job chained after training,
or ``slurmft consolidate``) writes the directory ``from_pretrained``, vLLM and TGI load as is, in memory for
about the largest tensor, not the model. One file per step, in the order the job takes them (job.py):

- checkpoint.py: which checkpoint (the newest complete one, or the one named; a torn save is refused);
- plan.py: what to write, from the DCP metadata and a meta-device model: names, dtypes, shard files, headers;
- read_dcp.py: reading the checkpoint's tensors, one (or a few small ones) at a time;
- shards.py: writing the safetensors files and the index, and reading back what was written;
- model_files.py: ``config.json``, ``generation_config.json`` and the tokenizer;
- lora.py: a LoRA checkpoint read against PEFT's model of it, and its adapter written as PEFT writes one;
- merge.py: the adapters merged into the base model's weights, once the base is the one they trained on;
- output_dir.py: the output filled beside its place and put there once complete, under a lock, disk checked;
- job.py: the job itself, top to bottom, and its summary.

Run by hand: ``python -m slurmft.job.consolidate RUN_DIR [--checkpoint DIR] [--out DIR]`` (__main__.py).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """``from slurmft.job.consolidate import consolidate_run``, the documented way in from Python (docs/consolidation.md),
    as before the package existed; imported on first use, so importing one step's file does not import the job."""
    if name == "consolidate_run":
        from slurmft.job.consolidate.job import consolidate_run

        return consolidate_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
