"""``benchmarks/gpu_clocks.py``: the GPU clock readings that ``hstu_pipelines.py --clocks`` prints beside each
timed window. The sampler runs a real process (here one that prints nvidia-smi's lines) and reads it on a thread
of its own: each window gets the readings that arrived inside it, and the process and thread end with it."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import gpu_clocks  # noqa: E402
from gpu_clocks import ClockSampler, Reading  # noqa: E402


def test_nvidia_smis_lines_are_read_field_by_field():
    assert gpu_clocks.parse("1830, 684.12, 0x0000000000000004\n") == Reading(1830.0, 684.12, 0x4)
    assert gpu_clocks.parse("1980, [N/A], 0x0000000000000000") == Reading(1980.0, None, 0)
    # anything else nvidia-smi prints is no reading
    assert gpu_clocks.parse("clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active") is None
    assert gpu_clocks.parse("") is None
    assert gpu_clocks.parse("[N/A], [N/A], [N/A]") is None


def test_a_windows_summary_reports_the_clock_the_power_and_the_share_held_at_the_power_cap():
    readings = [Reading(1980, 300, 0x0), Reading(1800, 690, 0x4), Reading(1620, 699, 0x4 | 0x40), Reading(None, 1, 1)]
    window = gpu_clocks.summary(readings)
    assert window == {
        "readings": 4,
        "mean_mhz": 1800.0,  # of the three readings with a clock
        "min_mhz": 1620,
        "watts": pytest.approx((300 + 690 + 699 + 1) / 4),
        "capped": 0.5,
        "reasons": ["idle", "power cap", "hardware thermal slowdown"],
    }
    assert gpu_clocks.note(window) == "SM 1800 MHz, 422 W, power-capped 50%"
    assert gpu_clocks.summary([]) is None and gpu_clocks.note(None) == ""


def test_several_windows_read_as_one_count_every_reading_inside_them_and_none_outside():
    sampler = ClockSampler()  # not started: its readings set by hand, each with its arrival time
    sampler.readings = [
        (1.0, Reading(1980, 100, 0)),
        (2.5, Reading(1000, 50, 0x1)),  # between the two windows
        *[(3.0 + i / 10, Reading(1800, 700, 0x4)) for i in range(3)],
    ]
    both = sampler.during([(0.5, 1.5), (3.0, 4.0)])
    assert both == {
        "readings": 4,
        "mean_mhz": pytest.approx((1980 + 3 * 1800) / 4),
        "min_mhz": 1800,
        "watts": pytest.approx((100 + 3 * 700) / 4),
        "capped": 0.75,
        "reasons": ["power cap"],
    }
    assert sampler.between(0.5, 1.5)["readings"] == 1
    assert sampler.during([(5.0, 6.0)]) is None and sampler.during([]) is None


def _printer(lines, then="sleep"):
    """A command that prints ``lines`` one by one, then sleeps until stopped (as ``nvidia-smi -lms`` runs) or
    exits with an error."""
    tail = "time.sleep(60)" if then == "sleep" else "sys.stderr.write('No devices were found\\n'); sys.exit(6)"
    script = f"""
        import sys, time
        for line in {lines!r}:
            print(line, flush=True)
            time.sleep(0.01)
        {tail}
    """
    return [sys.executable, "-c", textwrap.dedent(script)]


def _wait_for(sampler, count):
    deadline = time.monotonic() + 30
    while len(sampler.readings) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(sampler.readings) == count


def test_each_window_reads_the_readings_that_arrived_inside_it_and_the_sampler_ends_its_process():
    lines = ["1980, 120.5, 0x0000000000000000", "1800, 690.0, 0x0000000000000004", "1830, 684.0, 0x0000000000000004"]
    before = time.perf_counter()
    with ClockSampler(command=_printer(lines)) as sampler:
        _wait_for(sampler, 3)
        after = time.perf_counter()
        window = sampler.between(before, after)
        assert window["readings"] == 3 and window["capped"] == pytest.approx(2 / 3)
        assert sampler.between(after, after + 60) is None  # nothing arrived after
        first, second = sampler.readings[0][0], sampler.readings[1][0]
        assert sampler.between(before, (first + second) / 2)["mean_mhz"] == 1980  # the first reading only
        process, reader = sampler._process, sampler._reader
    # the sleeping process stopped, its reader thread joined, no error reported for the stop
    assert process.poll() is not None and not reader.is_alive()
    assert sampler.error is None


def test_a_sampler_whose_command_is_missing_or_fails_says_why_and_reads_nothing():
    with ClockSampler(command=["/nonexistent/nvidia-smi", "--loop-ms=50"]) as missing:
        assert missing.between(0, time.perf_counter()) is None
    assert missing.error.startswith("/nonexistent/nvidia-smi: ")

    with ClockSampler(command=_printer([], then="fail")) as failing:
        failing._process.wait(timeout=30)
    assert failing.between(0, time.perf_counter()) is None
    assert "exited with 6: No devices were found" in failing.error


def test_the_default_command_asks_nvidia_smi_for_one_gpu_by_uuid():
    class Properties:
        uuid = "5c9d2b1e-0f3a-4c2e-9a61-0d2f7b8c1e42"

    gpu = gpu_clocks.nvidia_smi_id(Properties())
    assert gpu == "GPU-5c9d2b1e-0f3a-4c2e-9a61-0d2f7b8c1e42"
    command = ClockSampler(gpu, interval_ms=50).command
    assert command == [
        "nvidia-smi",
        f"--id={gpu}",
        "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
        "--format=csv,noheader,nounits",
        "--loop-ms=50",
    ]


@pytest.mark.skipif(subprocess.run(["which", "nvidia-smi"], capture_output=True).returncode, reason="no nvidia-smi")
def test_nvidia_smi_gives_readings_of_the_first_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    start = time.perf_counter()
    with ClockSampler(gpu_clocks.nvidia_smi_id(torch.cuda.get_device_properties(0)), interval_ms=50) as sampler:
        time.sleep(1.0)
        window = sampler.between(start, time.perf_counter())
    assert sampler.error is None, sampler.error
    assert window is not None and window["mean_mhz"] > 0
