"""GRPO on FSDP2: TRL's ``GRPOTrainer`` on the sharded policy, its completions sampled the same way on every
world size, a sharded frozen reference when ``beta > 0``.

What TRL 1.16 does without vLLM: every rank generates its share of the generation batch with transformers'
``generate`` and samples with the global RNG (``torch.multinomial``), seeded once per rank
(``set_seed(seed, device_specific=True)``: seed + rank). The completions a prompt gets therefore depend on how
many ranks there are and on which rank it lands, and a resumed run does not draw them again (the RNG state is
per rank and moves with every other random call). Under FSDP2 ``generate`` only keeps the ranks in step
(``synced_gpus``) for models transformers wrapped itself (``_is_fsdp_managed_module``), not for ours: a rank that
finishes its completions first would stop calling the collectives its layers need. With ``beta > 0`` it loads a
whole unsharded copy of the model as the reference (``create_model_from_path``) on every rank.

What we do instead:

- **sampling keyed by position, not by RNG stream** (:class:`SeededSampling`): the next token of every completion
  is the Gumbel-max sample ``argmax(logits / T (top-p masked) + Gumbel noise)``, a draw from TRL's sampling
  distribution (with float32 uniforms), the noise drawn from a generator seeded by ``(train.seed, generation point, the
  completion's index in the global generation batch, token position)``. The same prompt at the same place of a
  run gets the same completion on 1, 2 or 16 ranks, after a requeue too, and without any saved RNG state.
  The generation point is the completions trained on before it (``(global_step x gradient_accumulation_steps +
  micro-step) x ranks x per_device_batch_size``), the same on every shape that keeps the global batch;
- ``synced_gpus`` on whenever a process group exists, so every rank runs the same number of forwards;
- **the rollouts in the checkpoint** (:func:`save_rollouts`): TRL generates once per ``steps_per_generation`` steps
  and keeps the scored completions (``_buffered_inputs``: ids, masks, advantages, old log-probabilities) and its
  micro-step count (``_step``) in memory only, so a checkpoint at a step inside a generation resumed into a new
  generation (other completions, the phase shifted). Every rank writes its share and the count beside its RNG
  state (``grpo_rollouts_<rank>.pt``); the next attempt continues the same rollouts at the same place;
- **tokens counted where they are trained** (:func:`trained_tokens`): TRL adds a generation batch's tokens to
  ``num_input_tokens_seen`` when it generates it, so with ``steps_per_generation`` above the accumulation the steps
  that train on its buffered rest logged 0 tokens/s (and a mean over steps about half the truth with 2); each
  micro-step adds the prompt and completion tokens it trains on instead;
- the reference (``beta > 0``, full fine-tuning): the starting model built exactly as DPO's
  (slurmft/job/dpo.py ``reference_model``: meta device, sliced loading, FSDP2 per decoder layer, no gradients),
  handed to TRL in place of the copy it would load;
- LoRA (``lora:`` section): the adapters train on the sharded policy as in LoRA SFT, and with ``beta > 0`` the
  reference is the policy with its adapters disabled (TRL's ``use_adapter(model, None)``: the frozen base, the
  starting model at every step), no second model. TRL, given a PEFT model with ``beta > 0``, would add a "ref"
  adapter copied from the trained one (unsharded tensors inside FSDP2 modules): skipped as DPO skips it
  (slurmft/job/adapters.py ``no_reference_adapter``).

Everything else is the SFT job's: loading, precision, activation checkpointing, the checkpoint callbacks
(COMPLETE markers, preemption saves at a step boundary, resume), consolidation of the policy.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.errors import JobSetupError
from slurmft.job import grpo_server
from slurmft.job.loading import trl_loads_instead
from slurmft.job.seeded_sampling import SeededSampling, generation_point, noise_seed

log = logging.getLogger("slurmft.job")


def grpo_config(cfg: RunConfig, common: dict[str, Any]) -> Any:
    """TRL's GRPOConfig: the Trainer options every method shares (``common``), then the grpo: section."""
    from trl import GRPOConfig

    g = cfg.grpo
    assert g is not None
    common = {k: v for k, v in common.items() if k != "dataset_num_proc"}  # GRPOConfig has none: no preparation
    kwargs = {**common, "num_generations": g.num_generations, "max_completion_length": g.max_completion_length,
              "temperature": g.temperature, "top_p": g.top_p, "beta": g.beta, "loss_type": g.loss_type,
              "epsilon": g.epsilon, "importance_sampling_level": g.importance_sampling_level,
              "steps_per_generation": g.generations_per_step(cfg.train.gradient_accumulation_steps),
              "reward_weights": [r.weight for r in g.rewards],
              **_vllm_options(g.rollouts, g.vllm_gpu_memory_utilization),
              "include_num_input_tokens_seen": "no",  # GRPO's batches are prompt rows, not token ids
              "log_completions": False}
    if grpo_server.is_server(cfg):  # TRL's server mode, the address and time-outs from the batch script
        kwargs.update(grpo_server.server_config(dict(os.environ)))
    try:
        return GRPOConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise JobSetupError(f"grpo: TRL rejected the GRPO options: {exc}") from None


def _vllm_options(rollouts: Any, vllm_share: float) -> dict[str, Any]:
    """TRL's vLLM options for ``grpo.rollouts``: colocate = TRL's colocate mode, sampled by slurmft's seeded
    processor (slurmft/job/vllm_rollouts.py), hence no importance-sampling correction against vLLM's own log-probs
    (the tokens are the seeded draws: vLLM's log-probs of them are not the sampling distribution's); the engine's
    share of the device is ``grpo.vllm_gpu_memory_utilization`` (what ``slurmft estimate`` counted)."""
    from slurmft.config_grpo import Rollouts

    if rollouts != Rollouts.COLOCATE:
        return {"use_vllm": False}  # transformers; server: grpo_config adds grpo_server.server_config
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_importance_sampling_correction": False,
            "vllm_gpu_memory_utilization": vllm_share}


def check_options(cfg: RunConfig) -> None:
    """grpo.loss_type against this node's TRL, the rollouts this job runs, before anything is loaded."""
    from slurmft.config_grpo import Rollouts
    from slurmft.grpoopts import loss_type_problem

    if cfg.grpo is None:
        return
    problems = [p for p in (loss_type_problem(cfg.grpo.loss_type),) if p]
    if grpo_server.is_server(cfg):
        import torch

        from slurmft.job.distributed import collective_timeout_s

        problems += grpo_server.problems(torch.cuda.is_available(), dict(os.environ), collective_timeout_s())
    if cfg.grpo.rollouts == Rollouts.COLOCATE and importlib.util.find_spec("vllm") is None:
        problems.append(f"grpo.rollouts: colocate generates with vLLM, which this Python ({sys.executable}) cannot "
                        "import; install vllm there, or set grpo.rollouts=transformers")
    if problems:
        raise JobSetupError("grpo: options this job cannot run", problems=problems)


def reward_functions(cfg: RunConfig) -> list[Any]:
    """The reward callables, resolved as ``validate`` resolved them (slurmft/grpoopts.py), each named by its index
    when it does not load."""
    from slurmft.grpoopts import load_reward

    assert cfg.grpo is not None
    found = []
    for i, reward in enumerate(cfg.grpo.rewards):
        try:
            found.append(load_reward(reward.function))
        except Exception as exc:  # the user's code: any error, named with the field
            raise JobSetupError(f"grpo.rewards[{i}].function: {reward.function!r} does not load here "
                                f"({type(exc).__name__}: {exc})") from None
    return found


def uses_reference_copy(cfg: RunConfig) -> bool:
    """A second, sharded model: ``beta > 0`` on a full fine-tune (LoRA disables its adapters instead)."""
    return cfg.grpo is not None and cfg.grpo.beta > 0 and cfg.lora is None


# ------------------------------------------------------------------------------------------------ sampling
def generate_seeded(trainer: Any, prompt_ids: list[list[int]]) -> list[list[int]]:
    """This rank's completions of ``prompt_ids`` (its slice of the generation batch), sampled by
    :class:`SeededSampling`; the ids up to and including the first EOS, as TRL keeps them."""
    import torch
    import torch.distributed as dist
    from transformers import GenerationConfig, LogitsProcessorList
    from trl.models import unwrap_model_for_generation
    from trl.trainer.utils import pad

    device = trainer.accelerator.device
    tokenizer = trainer._tokenizer
    rows = len(prompt_ids)
    rank = trainer.accelerator.process_index
    args = trainer.args
    point = generation_point(trainer)
    tensors = [torch.tensor(ids) for ids in prompt_ids]
    inputs = {"input_ids": pad(tensors, padding_value=tokenizer.pad_token_id, padding_side="left"),
              "attention_mask": pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left")}
    inputs = {k: v.to(device) for k, v in inputs.items()}
    prompt_length = inputs["input_ids"].shape[1]
    sampling = SeededSampling(args.seed, point, rank * rows, prompt_length, trainer.temperature, trainer.top_p)
    config = GenerationConfig(max_new_tokens=trainer.max_completion_length, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=trainer.eos_token_ids, disable_compile=True)
    with (unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                      gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs) as model,
          torch.no_grad()):
        out = model.generate(**inputs, generation_config=config, logits_processor=LogitsProcessorList([sampling]),
                             synced_gpus=dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    completion_ids = out[:, prompt_length:]
    is_eos = torch.isin(completion_ids, torch.tensor(trainer.eos_token_ids, device=completion_ids.device))
    kept = []
    for row, eos in zip(completion_ids.cpu(), is_eos.cpu(), strict=True):
        end = int(eos.int().argmax()) + 1 if eos.any() else row.numel()
        kept.append(row[:end].tolist())
    return kept


def trained_tokens(trainer: Any, inputs: dict[str, Any]) -> int:
    """The tokens one micro-step trains on, over every rank: each row's prompt and completion without padding (the
    attention mask of TRL's forward). What ``tokens_per_s`` in metrics.jsonl counts for GRPO, step by step: TRL
    counts the whole generation batch once, at the step that generates it, so with ``steps_per_generation`` above the
    accumulation the steps that reuse its completions showed 0 tokens/s. One gather of one number per micro-step,
    beside the several TRL's loss already makes for its metrics."""
    local = (inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()).reshape(1)
    return int(trainer.accelerator.gather(local).sum().item())


ROLLOUTS_FILE = "grpo_rollouts_{rank}.pt"


def save_rollouts(trainer: Any, checkpoint: Path) -> None:
    """This rank's buffered rollouts and micro-step count, into the checkpoint being saved (beside its RNG state)."""
    import torch

    rank = trainer.accelerator.process_index
    torch.save({"step": trainer._step, "global_step": trainer.state.global_step,
                "world_size": trainer.accelerator.num_processes, "buffered": trainer._buffered_inputs},
               checkpoint / ROLLOUTS_FILE.format(rank=rank))


def load_rollouts(trainer: Any, checkpoint: Path) -> None:
    """The rollouts :func:`save_rollouts` kept, when this attempt has the same ranks (else TRL generates again at
    the checkpoint's step, and the log says so)."""
    import torch

    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    path = checkpoint / ROLLOUTS_FILE.format(rank=rank)
    saved = torch.load(path, weights_only=False) if path.is_file() else None  # our own file, written by save_rollouts
    if saved is None or saved["world_size"] != world:
        if rank == 0:
            log.warning("grpo: %s holds no rollouts for %d ranks: the next step generates again (a checkpoint inside "
                        "steps_per_generation then continues with other completions)", checkpoint.name, world)
        return
    trainer._step, trainer._buffered_inputs = saved["step"], saved["buffered"]


@functools.cache
def trainer_class() -> type:
    """``GRPOTrainer`` generating through :func:`generate_seeded` (text prompts, transformers' generate)."""
    from trl import GRPOTrainer

    class SeededGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: int,
                                  has_tool_images: bool = False) -> Any:
            if images or multimodal_fields:
                raise JobSetupError("grpo: slurmft generates text completions only (no images yet)")
            if self.use_vllm and self.vllm_mode == "server":
                # vLLM's sampling, seeded per generation (slurmft/job/grpo_server.py says what that keeps)
                grpo_server.seed_generation(self, noise_seed(self.args.seed, generation_point(self), -1, -1) >> 32)
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            if self.use_vllm:  # grpo.rollouts: colocate
                from slurmft.job import vllm_rollouts

                return vllm_rollouts.generate(self, prompt_ids), None
            return generate_seeded(self, prompt_ids), None

        def _prepare_inputs(self, generation_batch: Any) -> Any:
            # TRL adds a whole generation batch to num_input_tokens_seen when it generates it, and nothing on the
            # steps that train on its buffered rest: the tokens each micro-step trains on are counted instead
            seen = self.state.num_input_tokens_seen
            inputs = super()._prepare_inputs(generation_batch)
            if self.model.training:
                self.state.num_input_tokens_seen = seen + trained_tokens(self, inputs)
            return inputs

        def _save_rng_state(self, output_dir: str) -> None:
            super()._save_rng_state(output_dir)
            save_rollouts(self, Path(output_dir))

        def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
            # here, not beside the RNG files' load: a resume on another world size reseeds instead of loading them
            # (slurmft/job/elastic.py wraps _load_rng_state), and must still be told its rollouts do not fit
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None:
                load_rollouts(self, Path(checkpoint))

    return SeededGRPOTrainer


def _colocated_engine(cfg: RunConfig, model_dir: Path) -> Any:
    """TRL's colocated vLLM engine as slurmft builds it (slurmft/job/vllm_rollouts.py), in the policy's compute
    dtype (``train.precision`` resolved on this device)."""
    import torch

    from slurmft.job.vllm_rollouts import engine_as_ours
    from slurmft.precision import resolve

    dtype = resolve(cfg.train.precision, torch.cuda.is_available()).compute_dtype
    return engine_as_ours(model_dir, dtype)


def new_trainer(cfg: RunConfig, model: Any, reference: Any, args: Any, dataset: Any, tokenizer: Any,
                callbacks: list[Any], optimizer: Any, model_dir: Path) -> Any:
    """TRL's GRPOTrainer (generating with :func:`generate_seeded`, or its colocated vLLM engine) on the sharded
    policy; ``reference`` is the sharded starting model when ``beta > 0`` on a full fine-tune, else None (LoRA: the
    adapters disabled). Its EOS ids are the model files' generation_config.json's (slurmft/job/loading.py
    ``use_generation_config``), as TRL's would be. ``model_dir``: the model's files, which a colocated engine starts from."""
    from slurmft.job.adapters import no_reference_adapter

    cls = trainer_class()
    server, started = grpo_server.is_server(cfg), time.time()
    with contextlib.ExitStack() as stack:
        # beta > 0 on a full fine-tune: the copy TRL would load from the model's files is our sharded reference
        if reference is not None:
            stack.enter_context(trl_loads_instead("grpo_trainer", reference))
        if args.use_vllm and not server:  # grpo.rollouts: colocate
            stack.enter_context(_colocated_engine(cfg, model_dir))
        stack.enter_context(no_reference_adapter(model, "grpo"))
        if server:
            stack.enter_context(grpo_server.watch_init(dict(os.environ)))
            stack.enter_context(grpo_server.one_client())
        trainer = cls(model=model, reward_funcs=reward_functions(cfg), args=args, train_dataset=dataset,
                      processing_class=tokenizer, callbacks=callbacks)
    if args.use_vllm and not server:
        from slurmft.job.vllm_rollouts import use_cpu_sync, use_merged_adapters

        if cfg.lora is not None:
            use_merged_adapters(trainer)
            log.info("grpo: LoRA: every sync pushes the base weights with the adapters merged (out of place)")
        if use_cpu_sync(trainer):
            log.info("grpo: vLLM runs on its CPU backend: the weights are synced through vLLM's in-place reload")
    if server:  # every weight sync under grpo.server.sync_timeout_s
        grpo_server.watch_syncs(trainer, dict(os.environ))
        if trainer.accelerator.is_main_process:
            grpo_server.log_layout(dict(os.environ), started)
    if trainer.ref_model is not reference:  # LoRA or beta 0: None, never a copy TRL loaded itself
        raise JobSetupError("grpo: TRL built a reference model of its own; this TRL is not supported")
    trainer.optimizer_cls_and_kwargs = optimizer  # GRPOTrainer does not pass it on; the optimizer is made in train()
    return trainer
