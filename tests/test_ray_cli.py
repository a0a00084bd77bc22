"""`dsec up --cloud-nodes`, `dsec ray up`'s bad input and the control plane's cloud
provider setting: no Docker, no Ray cluster."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from pydantic import ValidationError

from controlplane.config import CloudConfig, ControlPlaneConfig, RayConfig
from dsec.cli import build_parser, main
from dsec.cli.common import UsageError
from dsec.cli.up import up_spec

TOKENS = {"admin_tokens": ["a" * 16], "agent_token": "b" * 16}
has_ray = importlib.util.find_spec("ray") is not None
# these need Ray itself (CI installs the extra; without it the rest still run)
needs_ray = pytest.mark.skipif(not has_ray, reason="needs the ray extra")


def test_dsec_up_passes_cloud_nodes_to_the_pool():
    spec = up_spec(build_parser().parse_args(["up", "--cloud-nodes", "2"]))
    assert spec.cloud_nodes == 2
    assert up_spec(build_parser().parse_args(["up"])).cloud_nodes == 0


@pytest.mark.parametrize("value", ["-1", "201"])
def test_dsec_up_refuses_a_cloud_node_count_out_of_range(value, capsys):
    with pytest.raises(UsageError, match="--cloud-nodes must be between 0 and 200"):
        up_spec(build_parser().parse_args(["up", "--cloud-nodes", value]))
    assert main(["up", "--cloud-nodes", value]) == 2
    assert "--cloud-nodes" in capsys.readouterr().err


def test_dsec_ray_up_without_ray_says_which_extra_to_install():
    hide_ray = (
        "import sys; sys.modules['ray'] = None; from dsec.cli import main; "
        "sys.exit(main(['ray', 'up']))"
    )
    done = subprocess.run([sys.executable, "-c", hide_ray], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "dsec ray: needs Ray, which is not installed: pip install 'dsec[ray]'"
    ]


@needs_ray
def test_dsec_ray_up_refuses_an_address_where_no_cluster_listens(capsys):
    assert main(["ray", "up", "--address", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsec ray: no Ray cluster at '127.0.0.1:1'"), err


@needs_ray
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--host", "0.0.0.0"], "--host 0.0.0.0 listens on every address"),
        (["--host", "::"], "say which with --advertise-url"),
        (["--advertise-url", "http://0.0.0.0:8700"], "--advertise-url: 'http://0.0.0.0:8700'"),
        (["--advertise-url", "https://10.0.0.1"], "the control plane serves http://"),
        (["--agent-urls", "http://10.1.0.0/16,ftp://x"], "'ftp://x' is not an agent URL rule"),
    ],
)
def test_dsec_ray_up_refuses_an_address_it_cannot_be_reached_at(flags, says, capsys):
    # refused before any look for the cluster (at an address where none listens)
    assert main(["ray", "up", "--address", "127.0.0.1:1", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "no Ray cluster" not in err, err


@needs_ray
def test_dsec_ray_up_tells_its_control_plane_where_it_listens_and_which_agents_to_take():
    from dsec.launch.ray import RayPool, RayPoolSpec

    spec = RayPoolSpec(
        host="0.0.0.0", advertise_url="http://10.0.0.5", agent_urls=["http://10.1.0.0/16"]
    )
    pool = RayPool(spec)
    settings = pool.controlplane_settings()
    assert settings["host"] == "0.0.0.0"
    assert settings["agent_urls"][-1] == "http://10.1.0.0/16"
    assert "http://127.0.0.0/8" in settings["agent_urls"]  # its own machine's nodes too
    assert pool.controlplane_args() == ["--advertise-url", "http://10.0.0.5"]
    ControlPlaneConfig(**TOKENS, **settings)  # the config it writes is valid


def test_the_cloud_setting_picks_its_provider():
    assert isinstance(ControlPlaneConfig(**TOKENS, cloud={"max_nodes": 2}).cloud, CloudConfig)
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        ControlPlaneConfig(**TOKENS, cloud={"provider": "aws"})
    if has_ray:
        config = ControlPlaneConfig(**TOKENS, cloud={"provider": "ray", "max_nodes": 3})
        assert isinstance(config.cloud, RayConfig) and config.cloud.max_nodes == 3
        again = ControlPlaneConfig.model_validate_json(config.model_dump_json())
        assert again.cloud == config.cloud  # the config file `dsec ray up` writes


def test_the_ray_provider_without_ray_names_the_extra(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    with pytest.raises(ValidationError, match=r"pip install 'dsec\[ray\]'"):
        ControlPlaneConfig(**TOKENS, cloud={"provider": "ray"})


def test_a_ray_node_prefix_leaves_room_for_the_node_id():
    with pytest.raises(ValidationError, match="node_prefix"):
        RayConfig(provider="ray", node_prefix="a-prefix-far-too-long")


@needs_ray
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--name", "Pool"], "--name 'Pool': lowercase letters"),
        (["--name", "a-prefix-far-too-long"], "19 at most"),
        (["--cloud-idle-release-s", "0"], "idle_release_s: Input should be greater than 0"),
        (["--cloud-nodes", "-2"], "--cloud-nodes must be between 0 and 200"),
    ],
)
def test_dsec_ray_up_refuses_bad_flags_before_reaching_for_ray(flags, says, capsys):
    assert main(["ray", "up", "--address", "127.0.0.1:1", *flags]) == 2
    assert says in capsys.readouterr().err
