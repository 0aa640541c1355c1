"""The GPU's SM clock, power draw and clock-limiting reasons while a benchmark runs, read by ``nvidia-smi`` every
``interval_ms`` on a thread of its own, so that a timed window can be read beside the clock the GPU held in it.

A kernel's time scales with the SM clock. At its power limit the GPU lowers the clock (the "power cap" reason),
so a step that draws the limit runs its kernels slower than the same kernels in a window that draws less (a
profiled window, whose gaps between kernels lower the power): window to window and card to card, the kernel
time of one code is not one number.

    with ClockSampler(nvidia_smi_id(torch.cuda.get_device_properties(0))) as clocks:
        start = time.perf_counter(); ...; end = time.perf_counter()
        print(clocks.between(start, end))   # {"readings": 11, "mean_mhz": 1885.0, "capped": 0.82, ...}
"""

import signal
import subprocess
import threading
import time
from dataclasses import dataclass

QUERY = ("clocks.sm", "power.draw", "clocks_throttle_reasons.active")
"""nvidia-smi's fields, in the order ``parse`` reads them."""

REASONS = {
    0x1: "idle",
    0x2: "applications clocks setting",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clocks setting",
}
"""The bits of ``clocks_throttle_reasons.active`` (NVML's clocks event reasons)."""

POWER_CAP = 0x4


@dataclass(frozen=True)
class Reading:
    sm_mhz: float | None
    watts: float | None
    reasons: int | None
    """``REASONS`` bits set: why the clock is below its maximum."""


def parse(line: str) -> Reading | None:
    """One line of ``nvidia-smi --query-gpu=<QUERY> --format=csv,noheader,nounits``; None for a line that is
    not one (a message, a blank line). A field nvidia-smi cannot read ("[N/A]") is None."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != len(QUERY):
        return None
    sm, watts = _number(fields[0]), _number(fields[1])
    try:
        reasons = int(fields[2], 16)
    except ValueError:
        reasons = None
    if sm is None and watts is None and reasons is None:
        return None
    return Reading(sm, watts, reasons)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def nvidia_smi_id(properties) -> str:
    """The id nvidia-smi's ``--id`` takes for a CUDA device (``torch.cuda.get_device_properties``): its UUID,
    which names the same GPU whatever CUDA_VISIBLE_DEVICES renumbers."""
    uuid = str(properties.uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def reason_names(bits: int) -> list[str]:
    return [name for bit, name in REASONS.items() if bits & bit]


def summary(readings: list[Reading]) -> dict | None:
    """The readings of a window: their count, the SM clock's mean and least, the mean power, the share of
    readings held at the power cap, and every clock-limiting reason seen; None without readings."""
    if not readings:
        return None
    clocks = [r.sm_mhz for r in readings if r.sm_mhz is not None]
    watts = [r.watts for r in readings if r.watts is not None]
    reasons = [r.reasons for r in readings if r.reasons is not None]
    seen = 0
    for bits in reasons:
        seen |= bits
    return {
        "readings": len(readings),
        "mean_mhz": sum(clocks) / len(clocks) if clocks else None,
        "min_mhz": min(clocks) if clocks else None,
        "watts": sum(watts) / len(watts) if watts else None,
        "capped": sum(bool(bits & POWER_CAP) for bits in reasons) / len(reasons) if reasons else None,
        "reasons": reason_names(seen),
    }


def note(window: dict | None) -> str:
    """A window's summary in a few words: "SM 1885 MHz, 684 W, power-capped 82%"; "" without readings."""
    if not window:
        return ""
    words = []
    if window["mean_mhz"] is not None:
        words.append(f"SM {window['mean_mhz']:.0f} MHz")
    if window["watts"] is not None:
        words.append(f"{window['watts']:.0f} W")
    if window["capped"] is not None:
        words.append(f"power-capped {window['capped']:.0%}")
    return ", ".join(words)


class ClockSampler:
    """``nvidia-smi`` reporting GPU ``gpu`` (an index, a UUID, a PCI bus id) every ``interval_ms``, each line
    stamped with ``time.perf_counter()`` when it arrives. A context manager: the process and its reader thread
    end on exit. Without nvidia-smi (or when it fails) ``error`` says why and every window reads None.
    ``command``: the command to run instead of nvidia-smi (it prints one reading per line)."""

    def __init__(self, gpu: str | int = 0, interval_ms: int = 50, command: list[str] | None = None):
        self.command = command or [
            "nvidia-smi",
            f"--id={gpu}",
            f"--query-gpu={','.join(QUERY)}",
            "--format=csv,noheader,nounits",
            f"--loop-ms={interval_ms}",
        ]
        self.readings: list[tuple[float, Reading]] = []
        self.error: str | None = None
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> "ClockSampler":
        try:
            self._process = subprocess.Popen(
                self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
            )
        except OSError as error:
            self.error = f"{self.command[0]}: {error}"
            return self
        self._reader = threading.Thread(target=self._read, name="gpu-clocks", daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc_info) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._reader.join()
        if process.returncode not in (0, -signal.SIGTERM) and self.error is None:  # killed by the SIGTERM above
            self.error = f"{self.command[0]} exited with {process.returncode}: {process.stderr.read().strip()}"
        process.stderr.close()

    def _read(self) -> None:
        for line in self._process.stdout:
            reading = parse(line)
            if reading is not None:
                with self._lock:
                    self.readings.append((time.perf_counter(), reading))
        self._process.stdout.close()

    def between(self, start: float, end: float) -> dict | None:
        """``summary`` of the readings that arrived between two ``time.perf_counter()`` values."""
        return self.during([(start, end)])

    def during(self, spans: list[tuple[float, float]]) -> dict | None:
        """``summary`` of the readings that arrived inside any of ``spans`` (pairs of ``time.perf_counter()``
        values): several windows read as one."""
        with self._lock:
            inside = [reading for at, reading in self.readings if any(start <= at <= end for start, end in spans)]
        return summary(inside)
