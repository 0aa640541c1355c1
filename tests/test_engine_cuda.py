"""The engine on a CUDA device: every task on its plan stream, and cross-stream edges waited on with
per-(task, batch) events. Skipped without CUDA (CI has none); run on the GPU machine.

Each body delays its stream by a random number of GPU cycles before its kernel, so a consumer that did not
wait for its producer's event would read an unfinished result and the exact integer results would differ
from the CPU run.
"""

import random

import pytest
import torch

from lightning_hstu import PRESET_NAMES, Engine, Stream, get_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

P = 1_000_003
N = 1 << 16


class IntegerWorkload:
    def __init__(self, plan, device, seed=0, max_sleep_cycles=0):
        self.plan, self.device = plan, torch.device(device)
        self.rng = random.Random(seed)
        self.max_sleep_cycles = max_sleep_cycles
        self.weights = torch.zeros(N, dtype=torch.int64, device=self.device)
        self.outputs = {}
        self.streams_seen = {}

    def bodies(self):
        return {t.name: self._body(i, t) for i, t in enumerate(self.plan.tasks)}

    def _body(self, position, task):
        def body(batch):
            if self.device.type == "cuda":
                self.streams_seen.setdefault(task.name, set()).add(torch.cuda.current_stream())
                torch.cuda._sleep(self.rng.randrange(self.max_sleep_cycles + 1))
            if task.name == "h2d":
                x = batch["batch"].to(self.device, non_blocking=True)
            else:
                x = torch.zeros(N, dtype=torch.int64, device=self.device)
                for slot in task.reads:
                    x = x + batch[slot]
            if task.name in ("forward", "compute_output_dist"):
                x = x + self.weights
            y = (x * 3 + position + batch.index) % P
            if task.name == "optimizer_step":
                self.weights.add_(y).remainder_(P)
            for slot in task.writes:
                batch[slot] = y
            self.outputs[(task.name, batch.index)] = y

        return body


def host_batches(count):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, P, (N,), generator=gen).pin_memory() for _ in range(count)]


def cpu_reference(batches):
    plan = get_plan("legacy_none")
    workload = IntegerWorkload(plan, "cpu")
    with Engine(plan, workload.bodies()) as engine:
        engine.run([b.clone() for b in batches])
    return workload


@pytest.fixture(scope="module")
def batches():
    return host_batches(12)


@pytest.fixture(scope="module")
def reference(batches):
    return cpu_reference(batches)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_tasks_run_on_their_streams_and_match_the_cpu_run(name, batches, reference):
    plan = get_plan(name)
    workload = IntegerWorkload(plan, "cuda", seed=PRESET_NAMES.index(name), max_sleep_cycles=2_000_000)
    with Engine(plan, workload.bodies(), device="cuda", step_timeout=60) as engine:
        engine.run(batches)
        expected = {t.name: {engine.stream(t.stream)} for t in plan.tasks}
        assert engine.stream(Stream.DEFAULT) == torch.cuda.current_stream()
    torch.cuda.synchronize()
    assert workload.streams_seen == expected
    assert workload.outputs.keys() == reference.outputs.keys()
    for key, value in reference.outputs.items():
        assert torch.equal(workload.outputs[key].cpu(), value), key
    assert torch.equal(workload.weights.cpu(), reference.weights)
