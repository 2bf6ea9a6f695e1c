"""Peak memory and energy of a benchmark region: NVML on a CUDA GPU, the process's peak RSS on CPU.

NVML (package nvidia-ml-py, module pynvml) is imported lazily; without it, or on a GPU that lacks a
counter, the reading is None rather than a guess.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from quantgate.catalog.settings import settings

DEVICE_INTERVAL_S = 0.01
GROUP_INTERVAL_S = 0.5


class Telemetry:
    """Open around everything the engine does (load included): `with Telemetry(device) as t: ...`.

    GPU memory is sampled in a thread: with `group`, the memory NVML lists for the processes of that process
    group (an engine and vLLM's engine core, while other jobs may share the GPU); else the device's used memory
    minus what was used when the region began. A group none of whose processes NVML lists (its process ids are
    of another PID namespace) reads None, not another job's memory.

    Inside `still()` nothing is sampled: NVML's process query takes milliseconds under the driver's global lock,
    which every process on the GPU needs to submit work, so polling it slows whatever runs there (an engine's
    own measurement, or another's while this one waits for the GPU). Memory is read when a still stretch
    begins, at each reading of a peak, and when it ends; CUDA's caching allocators keep what a run took, so the
    reading after the run holds the run's peak.
    """

    def __init__(self, device: str, interval_s: float | None = None, group: int | None = None) -> None:
        self.device = device
        self._group = group
        self._group_seen = False
        # The device's used memory is a cheap read (~10 us); a group's is the process query (see the class),
        # polled gently while an engine loads beside other work, whose GPU submission it would otherwise stall.
        self._interval_s = interval_s or (GROUP_INTERVAL_S if group is not None else DEVICE_INTERVAL_S)
        self._nvml: Any = None
        self._handle: Any = None
        self._baseline = 0
        self._peak = 0
        # This process's torch allocator (reserved, allocated) held before the measured engine loaded (`rebase`).
        self._torch_base = (0, 0)
        self._stop = threading.Event()
        self._still = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Telemetry:
        if self.device == "cuda":
            self._open_nvml()
        if self._handle is not None:
            self._baseline = 0 if self._group is not None else self._used()
            self._peak = self._used()
            self._thread = threading.Thread(target=self._sample, name="nvml-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._peak = max(self._peak, self._used())
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = self._handle = None

    @contextmanager
    def still(self) -> Iterator[None]:
        """No sampling inside (see the class); its memory read at both ends."""
        self._read()
        self._still.set()
        try:
            yield
        finally:
            self._still.clear()
            self._read()

    def energy_mj(self) -> int | None:
        """The GPU's energy counter (millijoules since the driver loaded); None on CPU or when unsupported."""
        if self._handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except self._nvml.NVMLError:
            return None

    @property
    def peak_memory_bytes(self) -> int | None:
        if self.device == "cuda":
            self._read_if_still()
            seen = self._peak - self._baseline if self._group is None or self._group_seen else 0
            # This process's allocator is the measured work's only where this process is part of it: not for
            # another group (a server's), whose memory this process's own models and KL would stand in for.
            own = self._group is None or self._group == os.getpgrp()
            return max(seen, _torch_reserved_peak() - self._torch_base[0] if own else 0) or None
        # ru_maxrss is in KiB on Linux.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @property
    def nvml_peak_bytes(self) -> int | None:
        """Device memory in use at its highest since the region began (or the last reset_peaks), minus
        what was in use when the region began; None without NVML."""
        if self._handle is None:
            return None
        peak = max(self._peak, self._used()) - self._baseline
        return None if self._group is not None and not self._group_seen else peak

    @property
    def torch_peak_bytes(self) -> int | None:
        """This process's torch allocator at its highest (allocated tensors, not the allocator's cache)."""
        if self.device != "cuda":
            return None
        import torch

        return torch.cuda.max_memory_allocated() - self._torch_base[1] if torch.cuda.is_initialized() else None

    def sm_clock_mhz(self) -> int | None:
        """The GPU's SM clock now (a cheap device query, not the process list); None without NVML."""
        if self._handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))
        except self._nvml.NVMLError:
            return None

    def rebase(self) -> None:
        """From here on, what is in use now is not the region's: an engine loaded before the measured one (the base
        whose passes a variant's alternate with) stays out of the figures."""
        if self._handle is not None:
            self._baseline = self._peak = self._used()
        if self.device == "cuda":
            import torch

            if torch.cuda.is_initialized():
                self._torch_base = (torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
                torch.cuda.reset_peak_memory_stats()

    def reset_peaks(self) -> None:
        """Start the peaks afresh from what is in use now, e.g. between scenarios of one process."""
        if self._handle is not None:
            self._peak = self._used()
        if self.device == "cuda":
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()

    def _open_nvml(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # not installed, or no driver: memory falls back to torch, energy to None
            return
        try:
            self._handle = _visible_device(pynvml)
            self._nvml = pynvml
        except pynvml.NVMLError:
            pynvml.nvmlShutdown()

    def _used(self) -> int:
        if self._group is None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        try:
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except self._nvml.NVMLError:
            return 0
        total = 0
        for p in processes:
            try:
                if os.getpgid(p.pid) != self._group:
                    continue
            except (ProcessLookupError, PermissionError):  # gone, or a process of another namespace
                continue
            self._group_seen = True
            total += int(p.usedGpuMemory or 0)
        return total

    def _read(self) -> None:
        if self._handle is not None:
            self._peak = max(self._peak, self._used())

    def _read_if_still(self) -> None:
        if self._still.is_set():
            self._read()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            if not self._still.is_set():
                self._read()


class PassClocks:
    """Where the CPU went while the block ran (one timed pass): `figures()` after it gives

    - `cpu_s`: CPU seconds of the live processes of this process's group (an engine and its engine core);
    - `front_cpu_s`: of this process alone, all its threads (the front end that submits and collects);
    - `other_cpu_s`: the rest of the machine's busy CPU seconds (/proc/stat's, less `cpu_s`): other work the
      engine's processes shared the CPUs with;
    - `steal_s`: CPU seconds the hypervisor gave to others while this VM wanted them (all CPUs together);
    - `gc_s`, `gc_collections`: this process's cyclic garbage collections (gc.callbacks), time in which a
      CPU-bound front end schedules nothing;
    - `host_cpu_mhz`: the CPUs' mean clock as the block ended.

    Standard library only: `vllm bench throughput`'s process (tasks/adapters/speed/bench_gate.py) times its passes with
    it too. A reading the machine does not offer (no /proc) is None."""

    def __init__(self) -> None:
        self.gc_s = 0.0
        self.gc_collections = 0
        self._gc_began: float | None = None
        self._before: tuple[float | None, float, tuple[float, float] | None] = (None, 0.0, None)
        self._after: tuple[float | None, float, tuple[float, float] | None] = (None, 0.0, None)

    def __enter__(self) -> PassClocks:
        gc.callbacks.append(self._gc_callback)
        self._before = (group_cpu_s(), time.process_time(), host_cpu_s())
        return self

    def __exit__(self, *exc: object) -> None:
        self._after = (group_cpu_s(), time.process_time(), host_cpu_s())
        gc.callbacks.remove(self._gc_callback)

    def figures(self) -> dict[str, Any]:
        (group0, own0, host0), (group1, own1, host1) = self._before, self._after
        group = group1 - group0 if group0 is not None and group1 is not None else None
        busy, steal = (host1[0] - host0[0], host1[1] - host0[1]) if host0 is not None and host1 is not None else (None, None)
        return {
            "cpu_s": _round(group),
            "front_cpu_s": _round(own1 - own0),
            "other_cpu_s": _round(max(0.0, busy - group)) if busy is not None and group is not None else None,
            "steal_s": _round(steal),
            "gc_s": round(self.gc_s, 4),
            "gc_collections": self.gc_collections,
            "host_cpu_mhz": host_cpu_mhz(),
        }

    def _gc_callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            self.gc_s += time.perf_counter() - self._gc_began
            self.gc_collections += 1
            self._gc_began = None


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 2)


def host_cpu_s() -> tuple[float, float] | None:
    """The machine's busy CPU seconds (user, nice, system, irq, softirq) and stolen ones, all CPUs together, since
    boot, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is counted in user already)
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    steal = fields[7] if len(fields) > 7 else 0
    tick = os.sysconf("SC_CLK_TCK")
    return busy / tick, steal / tick


def group_cpu_s(pgid: int | None = None) -> float | None:
    """CPU seconds (user + system) that the live processes of process group `pgid` (default this process's:
    an engine and its engine core) have used so far, from /proc; None where there is no /proc."""
    pgid = os.getpgrp() if pgid is None else pgid
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return None
    ticks, seen = 0, False
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                # After the command's closing parenthesis: state, ppid, pgrp, ..., utime (14th), stime (15th).
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
            seen = True
    return ticks / os.sysconf("SC_CLK_TCK") if seen else None


def host_cpu_mhz() -> float | None:
    """The host CPUs' mean clock now, as /proc/cpuinfo reports it (a VM may report a fixed figure); None
    without it."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":", 1)[1]) for line in f if line.startswith("cpu MHz")]
    except (OSError, ValueError):
        return None
    return round(sum(mhz) / len(mhz), 1) if mhz else None


def visible_gpu() -> str:
    """The GPU this process's CUDA calls device 0, as NVML names it: its index on the host, or its UUID."""
    # NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES says which one CUDA calls device 0.
    return (settings().cuda_visible_devices or "0").split(",")[0].strip() or "0"


def _visible_device(pynvml: Any) -> Any:
    first = visible_gpu()
    if first.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(first))
    return pynvml.nvmlDeviceGetHandleByUUID(first)


def _torch_reserved_peak() -> int:
    import torch

    return torch.cuda.max_memory_reserved() if torch.cuda.is_initialized() else 0


def measure_bandwidth_gbps(nbytes: int = 2 << 30, copies: int = 10, trials: int = 5) -> float:
    """Device memory bandwidth in GB/s (1e9 bytes): a device-to-device copy of `nbytes`, counting the
    bytes read and written, timed with CUDA events over `copies` copies; the median of `trials`."""
    import statistics

    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    try:
        dst.copy_(src)  # first touch and warm-up
        rates = []
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(copies):
                dst.copy_(src)
            end.record()
            end.synchronize()
            rates.append(2 * nbytes * copies / (start.elapsed_time(end) / 1000) / 1e9)
        return statistics.median(rates)
    finally:
        del src, dst
        torch.cuda.empty_cache()


def nvml_gpu_count() -> int | None:
    """How many GPUs NVML finds on this host (all of them, whatever CUDA_VISIBLE_DEVICES shows): 0 without the
    driver, None without the NVML bindings."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return 0
    finally:
        pynvml.nvmlShutdown()


def nvml_device_name() -> str | None:
    """The visible GPU's name through NVML, for processes that must not create a CUDA context."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        name = pynvml.nvmlDeviceGetName(_visible_device(pynvml))
        return name.decode() if isinstance(name, bytes) else str(name)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def device_memory() -> tuple[int, int] | None:
    """The visible GPU's free and total memory in bytes, through NVML (no CUDA context); None without NVML or a GPU.
    Polled while engine starts wait for memory, so NVML stays open after the first call (an init after the last
    shutdown loads it again)."""
    global _MEMORY_NVML
    if _MEMORY_NVML is None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:
            return None
        _MEMORY_NVML = pynvml
    try:
        info = _MEMORY_NVML.nvmlDeviceGetMemoryInfo(_visible_device(_MEMORY_NVML))
        return int(info.free), int(info.total)
    except _MEMORY_NVML.NVMLError:
        return None


_MEMORY_NVML: Any = None


class GpuHolder(NamedTuple):
    """A process with a CUDA context on the visible GPU: its pid, command name ("?" where this host's /proc has no
    such process) and the GPU memory NVML says it uses (None where NVML does not report it)."""

    pid: int
    name: str
    used_bytes: int | None


def gpu_holders() -> list[GpuHolder]:
    """The processes holding memory on the visible GPU (NVML's compute processes), the largest first; empty without
    NVML or a GPU. For a start that cannot have the memory it needs, to say who has it (tasks/runtime/gpu_clock.py).
    NVML reports pids of the host's PID namespace: inside a container that does not share it, a pid names no
    process here, or another one."""
    if device_memory() is None:  # opens NVML where there is one
        return []
    try:
        processes = _MEMORY_NVML.nvmlDeviceGetComputeRunningProcesses(_visible_device(_MEMORY_NVML))
    except _MEMORY_NVML.NVMLError:
        return []
    # Without the rights to see it (or under MIG) NVML reports no figure, which pynvml gives as None.
    holders = [GpuHolder(p.pid, process_name(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
               for p in processes]
    return sorted(holders, key=lambda h: h.used_bytes or 0, reverse=True)


def process_name(pid: int) -> str:
    """A process's command name (/proc/PID/comm: vLLM's engine core names itself there), "?" where there is none."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "?"
    except OSError:
        return "?"


def vllm_start_check_bytes(gpu_memory_utilization: float) -> int | None:
    """The free memory vLLM asks to find at start for `gpu_memory_utilization`: that share of the GPU's total,
    rounded up; None without NVML or a GPU."""
    memory = device_memory()
    return None if memory is None else math.ceil(gpu_memory_utilization * memory[1])


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        model = None
    return f"cpu: {model or platform.machine()} ({os.cpu_count()} cores)"
