"""Cluster profiles: every shipped one loads, and GLOO_SOCKET_IFNAME is decided for each.

gloo carries the object collectives and barriers, also beside NCCL. Its GLOO_SOCKET_IFNAME takes
interface names only; NCCL_SOCKET_IFNAME's ``^docker,lo`` fails at process-group creation
("Unable to find address for: ^docker", checked with torch 2.13). The real-cluster profiles leave it
to the job (the interface that reaches MASTER_ADDR, tests/test_rendezvous.py); the local test cluster
pins loopback.
"""

from __future__ import annotations

import pytest

from slurmft.config_loading import load_config
from slurmft.config_values import gloo_ifname_problem
from slurmft.errors import ConfigError
from slurmft.profiles import load_profile, profile_names
from slurmft.resources import data_dir


@pytest.mark.parametrize("name", profile_names())
def test_every_profile_decides_gloo_socket_ifname(name: str) -> None:
    profile = load_profile(name)
    var = profile.env.get("GLOO_SOCKET_IFNAME")
    if name == "local-test":
        assert var is not None and var.value == "lo" and "loopback" in var.reason
    else:  # no fixed name: interface names differ by site; the job derives it (and says why in the file)
        assert var is None
        text = (data_dir("configs") / "clusters" / f"{name}.yaml").read_text()
        assert "# GLOO_SOCKET_IFNAME is not set here on purpose" in text and "reaches" in text
    for other in profile.env.values():
        assert other.reason.strip()


@pytest.mark.parametrize(("value", "ok"), [("lo", True), ("eth0", True), ("ens5,ens6", True), ("ib0", True),
                                           ("^docker,lo,veth", False), ("=eth0", False), ("eth0,", False)])
def test_gloo_takes_interface_names_only(value: str, ok: bool) -> None:
    assert (gloo_ifname_problem(value) is None) is ok


def test_an_nccl_style_gloo_value_is_refused_with_the_fix(tmp_path, chat_data) -> None:
    profile = tmp_path / "site.yaml"
    profile.write_text("name: site\ndescription: d\ngpu: {type: A100-80GB, memory_gb: 80}\nnode_memory_gb: 512\n"
                       "env:\n  GLOO_SOCKET_IFNAME: {value: '^docker,lo', reason: copied from NCCL}\n")
    with pytest.raises(ConfigError) as err:
        load_profile(str(profile))
    assert "gloo takes interface names" in err.value.render() and "leave it unset" in err.value.render()
    run = tmp_path / "run.yaml"
    run.write_text(f"name: t\noutput_dir: {tmp_path / 'out'}\nmodel: {{name_or_path: x}}\n"
                   f"data: {{datasets: [{{path: {chat_data}}}]}}\ncluster: {{env: {{GLOO_SOCKET_IFNAME: '^lo'}}}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(run, [])
    assert "cluster.env" in err.value.render() and "gloo takes interface names" in err.value.render()
