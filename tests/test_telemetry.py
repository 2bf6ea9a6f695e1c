"""Telemetry's NVML reads, against a stand-in for pynvml that counts its calls: NVML needs an NVIDIA driver, which
a CPU machine lacks. What this covers is when Telemetry queries NVML (never inside `still()`, where the process
query would stall every process's GPU submission) and what peak it reports from those reads; that the real NVML
lists an engine's processes by group is tested on the device (tests/gpu/test_clock_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from typing import Any

import pytest

from quantgate.tasks.runtime import launch
from quantgate.tasks.runtime import telemetry as telemetry_module
from quantgate.tasks.runtime.telemetry import GROUP_INTERVAL_S, Telemetry


class _StandInNvml(types.ModuleType):
    """The calls Telemetry makes, answering for one process of this process group whose memory the test sets."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.used_by_group = 1 << 30
        self.process_queries = 0
        self.pid = os.getpid()

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self.process_queries += 1
        return [types.SimpleNamespace(pid=self.pid, usedGpuMemory=self.used_by_group)]


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> _StandInNvml:
    stand_in = _StandInNvml()
    monkeypatch.setitem(sys.modules, "pynvml", stand_in)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    return stand_in


def test_a_group_is_not_polled_inside_still_and_its_peak_is_read_at_the_edges(nvml: _StandInNvml) -> None:
    with Telemetry("cuda", interval_s=0.005, group=os.getpgrp()) as telemetry:
        time.sleep(0.1)
        assert nvml.process_queries > 5  # sampled while it loads
        with telemetry.still():
            entered = nvml.process_queries
            nvml.used_by_group = 3 << 30  # what a run takes, and its caching allocator keeps
            time.sleep(0.1)
            assert nvml.process_queries == entered  # nothing polled while it waits or measures
            assert telemetry.peak_memory_bytes == 3 << 30  # a peak asked for is read then
            assert nvml.process_queries == entered + 1
        assert nvml.process_queries == entered + 2  # and the stretch's end
        assert telemetry.nvml_peak_bytes == 3 << 30


def test_a_group_is_polled_gently_by_default(nvml: _StandInNvml) -> None:
    with Telemetry("cuda", group=os.getpgrp()) as telemetry:
        time.sleep(GROUP_INTERVAL_S / 2)
        assert nvml.process_queries == 1  # the read on entering, none yet from the thread
        time.sleep(GROUP_INTERVAL_S)
        assert 2 <= nvml.process_queries <= 3
        assert telemetry.nvml_peak_bytes == 1 << 30


def test_another_groups_memory_is_its_own_not_this_processs_allocator(nvml: _StandInNvml, monkeypatch) -> None:
    # A server in a session of its own, and this process's allocator holding more than it (models loaded here
    # before, e.g. for KL): the server's peak is what NVML lists for its group, read while NVML is open.
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        nvml.pid = server.pid
        monkeypatch.setattr(telemetry_module, "_torch_reserved_peak", lambda: 16 << 30)
        with Telemetry("cuda", group=server.pid) as telemetry, telemetry.still():
            assert telemetry.peak_memory_bytes == 1 << 30
            assert telemetry.nvml_peak_bytes == 1 << 30
        with Telemetry("cuda", group=os.getpgrp()) as own:  # this process's group: its allocator counts
            assert own.peak_memory_bytes == 16 << 30
    finally:
        server.kill()
        server.wait()


def test_group_cpu_s_counts_the_cpu_time_of_every_process_of_the_group():
    """A child of this process group that spins for a second shows in the group's CPU seconds; a group with no
    process reads None. Real /proc, real processes."""
    before = telemetry_module.group_cpu_s()
    spin = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\ninput()"
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE)  # same group as this process
    try:
        deadline = time.monotonic() + 30
        while (telemetry_module.group_cpu_s() or 0) - before < 0.9 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert telemetry_module.group_cpu_s() - before >= 0.9
    finally:
        child.communicate(b"\n", timeout=30)
    lone = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE, start_new_session=True)
    try:
        assert telemetry_module.group_cpu_s(lone.pid) is not None
        assert telemetry_module.group_cpu_s(2**22 + 12345) is None  # no such group
    finally:
        lone.communicate(b"\n", timeout=30)


def test_pass_clocks_count_the_collections_inside_their_block_and_a_frozen_heap_is_left_out_of_them():
    """Real collections of real cycles: PassClocks counts those made inside its block and their time; freeze_heap
    puts what the process holds in the permanent generation, which no collection walks."""
    import gc

    class Node:
        def __init__(self) -> None:
            self.me = self

    held = [Node() for _ in range(20_000)]  # held: frozen, not garbage
    try:
        assert launch.freeze_heap() >= len(held)
        with telemetry_module.PassClocks() as clocks:
            for _ in range(1000):
                Node()  # garbage only a collection frees
            gc.collect()
        figures = clocks.figures()
        assert figures["gc_collections"] >= 1 and figures["gc_s"] > 0
        assert gc.get_freeze_count() >= len(held)  # the held nodes stayed out of those collections
        outside = clocks.gc_collections
        gc.collect()
        assert clocks.gc_collections == outside  # its callback is gone with the block
    finally:
        gc.unfreeze()


def test_pass_clocks_split_the_cpu_between_this_process_its_group_and_the_rest_of_the_machine():
    """This process spins for 0.6 s and a process outside its group for about 1 s inside the block: the first shows
    in `front_cpu_s` and `cpu_s`, the other only in `other_cpu_s` (read from /proc/stat). Real processes, real
    /proc; what else the machine runs meanwhile can only add to `other_cpu_s`."""
    spin = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
    with telemetry_module.PassClocks() as clocks:
        other = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
        end = time.process_time() + 0.6
        while time.process_time() < end:
            pass
        other.wait(timeout=60)
    figures = clocks.figures()
    assert figures["front_cpu_s"] >= 0.55
    assert figures["cpu_s"] >= figures["front_cpu_s"] - 0.05  # the group holds this process
    assert figures["other_cpu_s"] >= 0.8  # the spinner, outside the group
    assert figures["steal_s"] >= 0
