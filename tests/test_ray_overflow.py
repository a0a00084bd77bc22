"""Cloud overflow through Ray's autoscaler, on Ray's AutoscalingCluster (the real
autoscaler and its fake local node provider, on loopback: bench/ray_clusters.py): the
benchmark's Ray phase (bench/ray_overflow.py) with its checks, not its timings.

Local utilisation past 80% asks the autoscaler for a cloud node; its agent registers as
kind `cloud` and serves the overflow; once it has stayed empty the control plane gives it
back and withdraws the request, and the autoscaler removes the node. No sandbox is lost.
"""

from __future__ import annotations

import argparse
import importlib.util

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs the ray extra: pip install 'dsec[ray]'", allow_module_level=True)

from bench.ray_overflow import failures, ray_phase  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.docker, pytest.mark.asyncio]


async def test_overflow_gets_an_autoscaled_node_that_is_released_after_idle(docker_client):
    args = argparse.Namespace(local_slots=3, burst=5, idle_release_s=2, ray_idle_timeout_s=3)
    report = await ray_phase(args)
    assert failures(report, removal=True) == [], report
    assert report["cloud_paths"] == ["overflow"], report
    assert report["first_cloud_sandbox_s"] < report["given_back_s"] < report["node_removed_s"]
