"""LoRA on the real two-node cluster: preempted once (the warning signal mid-run), the run ends with the adapter and
the merged model bitwise equal to its uninterrupted run's, and every checkpoint it wrote holds adapters only.

The preempted run's ranks and its consolidation task run in the container test image under podman (Debian's podman
4.3; tests/slurm/images.py), its twin on the host: one run serves the LoRA test and podman's (CI time). So it also
shows that the warning signal reaches the ranks through ``podman run --init --sig-proxy=true``, that the host's batch
script requeues, and that the image trains bitwise as the host does. And (issue 47) that each podman task gets what
the docs promise: a token the user exported before ``submit`` (by name only: its value is in no file of the run) and
a variable ``cluster.setup`` exports, and, the run rendered for GPUs (a profile whose GPUs are not the fake kind, and
a CDI spec giving the test cluster's fake GPUs the NVIDIA toolkit's names), only the GPUs Slurm gave the job, as
CUDA 0 and 1; HF_HOME does not exist until the batch script makes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.conftest import IN_ALLOCATION
from tests.slurm.images import CDI_SPEC, env_marks, fake_gpus_cdi, in_image, ran_in_image
from tests.slurm.jobs import preempted_beside_uninterrupted

pytestmark = pytest.mark.slurm

TRAIN = {"max_steps": 6}
CHECKPOINT = {"every_steps": 3, "keep_last": 2}
RESOURCES = {"nodes": 1, "gpus_per_node": 2}  # 2 ranks on one node: the two runs share the cluster's two nodes
LORA = {"r": 8, "alpha": 16}


#: What the user exported before `slurmft submit`, as the docs tell them to (HF_HUB_OFFLINE=1 keeps it unused).
TOKEN = "hf_slurmftTestToken0123456789abcdefABCDEF"


@pytest.fixture
def fake_gpus_for_podman() -> Iterator[None]:
    """The CDI spec of the test cluster's fake GPUs, while the test runs (podman reads it per container)."""
    CDI_SPEC.parent.mkdir(parents=True, exist_ok=True)
    CDI_SPEC.write_text(fake_gpus_cdi())
    yield
    CDI_SPEC.unlink(missing_ok=True)


def test_lora_preempted_once_in_a_podman_image_ends_bitwise_equal_to_its_uninterrupted_run_on_the_host(
        slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft, sft_image: Path,
        podman_image: str, fake_gpus_for_podman: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from slurmft.checkpoints import is_adapter_name

    monkeypatch.setenv("HF_TOKEN", TOKEN)  # in the submitting shell: sbatch passes it on (--export=ALL)
    podman = in_image(tmp_path / "image", "podman", podman_image)
    profile = tmp_path / "gpu-profile.yaml"  # the test cluster, its gres GPUs said to be real ones: a GPU run
    profile.write_text("base: local-test\nname: local-test-cdi\ngpu: {type: cdi-test-gpu, memory_gb: 80}\n")
    podman.update(profile=str(profile), setup=["export SLURMFT_TEST_FROM_SETUP=from-setup"])
    run, reference, jobs = preempted_beside_uninterrupted(
        slurmft, slurm_cluster, tmp_path, tiny_model, chat_data, cluster=podman, train=TRAIN, checkpoint=CHECKPOINT,
        resources=RESOURCES, lora=LORA, prepare=IN_ALLOCATION)  # adapters through a preemption: no data preparation
    # issue 47: every rank (both attempts) and the consolidation task got the user's token and setup's variable;
    # the ranks saw the two GPUs Slurm gave the job, as CUDA 0 and 1, and no other; the CPU task saw none
    token = hashlib.sha256(TOKEN.encode()).hexdigest()
    seen = {kind: env_marks(tmp_path / "image" / "marks", job) for kind, job in jobs.items()}
    assert len(seen["train"]) == 4 and seen["consolidate"], seen
    for kind, marks in seen.items():
        for mark in marks:
            assert mark["hf_token_sha256"] == token and mark["from_setup"] == "from-setup", (kind, mark)
            if kind == "train":
                given = mark["slurm_gpus"].split(",")
                assert len(given) == 2 and mark["cdi_gpus"] == sorted(given), mark  # not all 8 of the node
                assert mark["cuda_visible_devices"] == "0,1", mark
            else:
                assert mark["cdi_gpus"] == [], mark
    for file in run.rglob("*"):  # by name only: the value reached no script, log or record of the run
        assert not file.is_file() or TOKEN.encode() not in file.read_bytes(), file

    train = (run / "scripts" / "train.sbatch").read_text()
    assert "podman run --rm --init --sig-proxy=true" in train and "#SBATCH --container" not in train
    assert "-m slurmft.job.podman_task --signal=USR2 --gpus=shared podman run" in train
    ran_in_image(tmp_path / "image" / "marks", jobs, sft_image, charliecloud=False)

    adapter, expected = load_file(str(run / "adapter" / "adapter_model.safetensors")), \
        load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert adapter.keys() == expected.keys() and adapter
    for key, tensor in expected.items():
        assert adapter[key].equal(tensor), key
    slurmft.assert_same_model(run / "model", reference / "model")

    base_bytes = (tiny_model / "model.safetensors").stat().st_size
    checkpoints = sorted((run / "checkpoints").glob("checkpoint-*"))
    assert checkpoints
    for checkpoint in checkpoints:
        marker = json.loads((checkpoint / "COMPLETE").read_text())
        assert marker["lora"]["r"] == LORA["r"]
        model_dir = checkpoint / "pytorch_model_fsdp_0"
        keys = list(FileSystemReader(str(model_dir)).read_metadata().state_dict_metadata)
        assert keys and all(is_adapter_name(k) for k in keys), keys[:4]  # no base weight in it
        # the micro model (tests/slurm/conftest.py) has 0.72M parameters, its adapters 39k: their shards measured
        # 0.115x the base's bytes (DCP frames each of the 56 small tensors), the whole checkpoint 0.55x (+ AdamW's
        # two moments, the tokenizer); a copy of the base weights alone would be 1x
        shards = sum(p.stat().st_size for p in model_dir.glob("*.distcp"))
        assert shards < 0.25 * base_bytes, (checkpoint.name, shards, base_bytes)
        whole = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
        assert whole < base_bytes, (checkpoint.name, whole, base_bytes)
