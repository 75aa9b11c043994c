"""GRPO rollouts through a colocated vLLM engine (``grpo.rollouts: colocate``), sampled by slurmft's seeded sampler.

TRL's colocate mode (``use_vllm=True, vllm_mode="colocate"``: one engine in every training process, started with
``distributed_executor_backend="external_launcher"``, the FSDP2-sharded policy's weights pushed into it, one full
tensor at a time, before the first generation after each optimizer step) samples with vLLM's own sampler, seeded by
rank, so its completions move with the world size. slurmft keeps TRL's engine, its start and its weight sync, and
changes what the engine samples: it gets one more logits processor (:func:`seeded_processor`), every request
carries its key ``(train.seed, generation point, row in the global generation batch)`` in
``SamplingParams.extra_args``, vLLM samples greedily, and the processor turns the argmax into
:class:`~slurmft.job.seeded_sampling.SeededSampling`'s Gumbel-max draw: the function transformers' ``generate`` calls on the
other path. So ``colocate`` and ``transformers`` give the same completions for the same prompts at the same point
of a run, as far as the two engines' logits agree (fp32 on CPUs: tests/job/test_grpo_vllm_cpu.py).

Besides the processor, what differs from TRL's colocate mode:

- the engine is built from the model's files (``model_dir``: TRL would pass the sharded model's ``name_or_path``)
  in the policy's compute dtype (vLLM's ``auto`` downcasts a float32 checkpoint to the platform's preferred 16-bit
  dtype);
- no importance-sampling correction (``vllm_importance_sampling_correction=False``, grpo.py): the tokens are the
  seeded draws, not vLLM's, so the log-probs vLLM reports for them are not those of the sampling distribution;
  and the engine is asked for none;
- the engine's start leaves the process's random generators as it found them (:func:`generators_kept`);
- LoRA: every sync pushes the base weights with the adapters merged, out of place (:func:`merged_params`);
- **CPU only** (:func:`cpu_sync`): vLLM's CPU backend repacks every linear layer's weight for its GEMM kernel
  (oneDNN, or the SGL/zentorch kernels) once loaded and leaves ``layer.weight`` an empty ``Parameter`` without a
  ``weight_loader`` (vLLM 0.32 ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``), so TRL's sync, the
  model's ``load_weights`` one tensor at a time, fails on the first linear weight (``AttributeError: 'Parameter'
  object has no attribute 'weight_loader'``). On the CPU the same tensors go through vLLM's in-place reload (the
  worker's ``reload_weights``: each layer rebuilt from the metadata vLLM recorded at load, loaded, then processed
  again, which repacks the kernels from the new weights). On GPUs TRL's own sync runs, unchanged.

Not done yet: tensor parallelism inside the engine (TRL's ``vllm_tensor_parallel_size``; 1 here) and sleep mode
(``vllm_enable_sleep_mode``, GPU only): both TRL's defaults (off), untested on a GPU (bench/vllm_colocate_probe.py
is the prepared check).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("slurmft.job")

#: the name of a request's sampling key in ``SamplingParams.extra_args``
EXTRA_KEY = "slurmft_seeded"


def request_key(seed: int, point: int, row: int, temperature: float, top_p: float) -> dict[str, Any]:
    """``extra_args`` of one request: what :func:`seeded_processor` samples it with (plain values)."""
    return {EXTRA_KEY: {"seed": seed, "point": point, "row": row, "temperature": temperature, "top_p": top_p}}


@functools.cache
def seeded_processor() -> type:
    """vLLM's (v1) batch-level logits processor applying :class:`SeededSampling` to every request with a key: the
    token at position ``len(output so far)`` of row ``row`` gets the noise it gets on transformers' path."""
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    from slurmft.job.seeded_sampling import SeededSampling

    class SeededGumbel(LogitsProcessor):
        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            # batch index -> (sampler, the request's output ids: vLLM's own list, which it appends to)
            self.rows: dict[int, tuple[Any, list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False  # it decides the greedy argmax: vLLM applies it before greedy sampling

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, _prompt, output in batch_update.added:
                key = (params.extra_args or {}).get(EXTRA_KEY) if params is not None else None
                if key is None:
                    self.rows.pop(index, None)
                    continue
                sampler = SeededSampling(key["seed"], key["point"], key["row"], 0, key["temperature"], key["top_p"])
                self.rows[index] = (sampler, output)
            for a, b, direction in batch_update.moved:
                entry_a, entry_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if entry_a is not None:
                    self.rows[b] = entry_a
                if direction == MoveDirectionality.SWAP and entry_b is not None:
                    self.rows[a] = entry_b

        def apply(self, logits: Any) -> Any:
            for index, (sampler, output) in self.rows.items():
                logits[index : index + 1] = sampler.at(logits[index : index + 1], len(output))
            return logits

    return SeededGumbel


@contextlib.contextmanager
def engine_as_ours(model_dir: Path, dtype: str) -> Iterator[None]:
    """While TRL builds its colocated engine: from ``model_dir``, in ``dtype``, with the seeded processor (every
    other argument TRL's own)."""
    from trl.generation import vllm_generation

    original = vllm_generation.LLM

    def build(**kwargs: Any) -> Any:
        kwargs.update(model=str(model_dir), dtype=dtype, logits_processors=[seeded_processor()])
        log.info("grpo: vLLM colocated engine: %s", {k: v for k, v in kwargs.items() if k != "logits_processors"})
        with generators_kept():
            llm = original(**kwargs)
        _ENGINES.append(llm)
        return llm

    vllm_generation.LLM = build
    try:
        yield
    finally:
        vllm_generation.LLM = original


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """The process's global random generators (Python's, NumPy's, torch's on the CPU and the device) as they were
    before: vLLM's worker seeds all of them at its start (``set_random_seed(model_config.seed)``, vLLM 0.32, CPU and
    GPU workers), which changed the run's stream, e.g. the order TRL shuffles a generation batch into its
    ``steps_per_generation`` steps: a colocate run trained other halves per step than the same run with
    transformers' rollouts (tests/job/test_grpo_vllm_cpu.py)."""
    import random

    import numpy as np
    import torch

    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        yield
    random.setstate(python)
    np.random.set_state(numpy)


#: the engines this process started (closed by :func:`close_engines`)
_ENGINES: list[Any] = []


def close_engines() -> None:
    """Shut this process's engines down while the process group they were started in still exists (the job's
    teardown, before it leaves the group). vLLM's shutdown destroys its own groups and then the default one; left
    to the interpreter's exit it runs after the job left the group and prints ``ValueError: Invalid process group
    specified`` on every rank."""
    while _ENGINES:
        _ENGINES.pop().llm_engine.engine_core.shutdown()


def driver_worker(llm: Any) -> Any:
    """The engine's worker in this process (colocate: ``external_launcher``, one worker per training process)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def cpu_sync(generation: Any) -> None:
    """CPU only, in place of TRL's ``VLLMGeneration.sync_weights`` (colocate): the policy's full tensors, gathered
    one at a time by TRL's own iterator (a collective: every rank walks it), loaded through vLLM's in-place reload,
    which processes each layer again (the CPU backend repacks its kernels) once all its tensors are in."""
    driver_worker(generation.llm).reload_weights(weights_iterator=generation._iter_named_params(),
                                                 is_checkpoint_format=True)
    generation.llm.reset_prefix_cache()


def merged_params(generation: Any) -> Iterator[tuple[str, Any]]:
    """LoRA: the policy's full tensors under the base model's names, each LoRA layer's weight with its adapter
    merged (``W + scaling * B @ A``, PEFT's ``get_delta_weight`` on the gathered tensors), the adapters' own tensors
    left out: what vLLM, started from the base model's files, loads. Out of place: TRL's ``_iter_named_params``
    merges into the sharded weights and unmerges after (``merge_adapter``/``unmerge_adapter``), which leaves the
    frozen base ``(W + d) - d``, not ``W``, after every sync. A collective like TRL's: every rank walks it, one
    tensor gathered at a time."""
    from peft.tuners.lora import LoraLayer

    model = generation.model
    for name, param in model.named_parameters():
        if ".lora_" in name or "original_module" in name:  # merged below / modules_to_save's untrained copy
            continue
        owner = model.get_submodule(name.rsplit(".", 2)[0]) if ".base_layer." in name else None
        if param.is_cpu and generation.accelerator.device.type != "cpu":  # offloaded: gathered on the device
            param = param.to(generation.accelerator.device)
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param.data
        if isinstance(owner, LoraLayer) and name.endswith(".base_layer.weight"):
            for adapter in owner.active_adapters:
                if owner.use_dora.get(adapter) or adapter not in owner.lora_A:
                    raise NotImplementedError(f"grpo: {name}: only plain LoRA adapters merge into vLLM's weights")
                a, b = (getattr(owner, f"lora_{x}")[adapter].weight for x in "AB")
                a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (a, b))
                delta = (b.float() @ a.float()) * owner.scaling[adapter]
                tensor = (tensor.float() + (delta.T if owner.fan_in_fan_out else delta)).to(tensor.dtype)
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        yield generation._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."]), tensor


def use_merged_adapters(trainer: Any) -> None:
    """A LoRA policy's syncs push :func:`merged_params` (TRL's own sync, or :func:`cpu_sync`, walks it)."""
    generation = trainer.vllm_generation
    generation._iter_named_params = functools.partial(merged_params, generation)


def use_cpu_sync(trainer: Any) -> bool:
    """Give the trainer's engine :func:`cpu_sync` where the engine runs on vLLM's CPU backend; True if it did."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    generation = trainer.vllm_generation
    generation.sync_weights = functools.partial(cpu_sync, generation)
    return True


def generate(trainer: Any, prompt_ids: list[list[int]]) -> list[list[int]]:
    """This rank's completions of ``prompt_ids`` from its colocated engine, each sampled by the seeded processor
    with the key :func:`slurmft.job.grpo.generate_seeded` gives transformers' generate; the weights synced first
    when an optimizer step came since the last sync (as TRL's colocate mode does). Ids up to and including the first
    end of completion (the model files' generation_config EOS ids, as on transformers' path)."""
    from vllm import SamplingParams

    from slurmft.job.seeded_sampling import generation_point

    # TRL's tag starts at -1 in every new trainer: the first generation of an attempt (a requeued one too: its
    # engine starts from the model's files) loads the policy as it is then, the resumed weights
    if trainer.state.global_step != trainer._last_loaded_step:
        trainer.vllm_generation.sync_weights()
        if trainer.accelerator.is_main_process:
            log.info("grpo: vLLM weights synced at step %d (last synced: %d)", trainer.state.global_step,
                     trainer._last_loaded_step)
        trainer._last_loaded_step = trainer.state.global_step
    first_row = trainer.accelerator.process_index * len(prompt_ids)
    point = generation_point(trainer)
    # ignore_eos: the engine's own EOS set (tokenizer and generation config) is not consulted; TRL's is, as on
    # transformers' path
    params = [SamplingParams(n=1, temperature=0.0, max_tokens=trainer.max_completion_length, ignore_eos=True,
                             stop_token_ids=list(trainer.eos_token_ids), logprobs=None,
                             extra_args=request_key(trainer.args.seed, point, first_row + i, trainer.temperature,
                                                    trainer.top_p))
              for i in range(len(prompt_ids))]
    outputs = trainer.vllm_generation.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params,
                                                   use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]
