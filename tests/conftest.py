import os
import secrets
import zlib

# Four virtual CPU devices for the tests that split fused_dense over several devices
# (test_sharding.py). XLA reads the flag when jax starts; it changes nothing for the GPU.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

import jax  # (after XLA_FLAGS)
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SEED = int(os.environ.get("JAX_EPILOG_TEST_SEED", secrets.randbits(32)))


def _seed_line() -> str:
    return f"jax_epilog test seed: JAX_EPILOG_TEST_SEED={SEED} (set it to replay a run)"


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Under ``-q`` (the README's command) pytest prints no header: name the seed again
    after a failure, so the failing data can be drawn again."""
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        terminalreporter.write_line(_seed_line())


@pytest.fixture
def rng(request):
    """Fresh random data for each test and each run; the header prints the seed to replay."""
    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])
