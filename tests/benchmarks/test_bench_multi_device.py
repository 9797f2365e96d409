"""benchmarks/multi_device.py on virtual CPU devices: the cases run, match one device and
report the collectives their programs run."""

import jax
import pytest

from benchmarks import multi_device


def test_cases_match_one_device_and_pass_their_checks():
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    devices = jax.devices()[:4]
    cases = {"splits": ("rows", "column", "uneven"), "layers": ("dense gelu", "dense gelu fp8")}
    records = multi_device.measure(devices, 32, 24, 48, **cases)
    records += multi_device.measure(devices, 32, 24, 48, splits=("rows",), layers=("mlp gelu fp8",))
    assert len(records) == 3 * 2 * 2 + 2
    by_case = {(r["split"], r["layer"], r["axis_type"]): r for r in records}
    assert by_case["uneven", "dense gelu", "Explicit"]["error"].startswith("n/a")
    for (split, layer, mode), r in by_case.items():
        if "error" in r:
            continue
        assert r["check"] == "ok", (split, layer, mode, r)
        assert r["forward error"] < 0.05 and r["gradient error"] < 0.05
    # data parallel: the forward runs without a collective, the gradient sums the kernel's
    rows = by_case["rows", "dense gelu", "Auto"]
    assert rows["forward collectives"] == {} and rows["gradient collectives"] == {"all-reduce": 1}
    assert rows["XLA gradient collectives"] == {"all-reduce": 1}
    assert "| rows | dense gelu | Auto |" in multi_device.render(records)


def test_collectives_are_counted_once_per_async_pair():
    text = "%a = f32[] all-reduce-start(%x)\n%b = f32[] all-reduce-done(%a)\n%c = f32[4] all-gather(%y), dims={0}"
    assert multi_device.collectives(text) == {"all-gather": 1, "all-reduce": 1}
