"""Peak resident memory per process of a measured block: the frontend (this
process), vLLM's engine core and its worker."""

from __future__ import annotations

import threading
from typing import Any

ROLES = {"VLLM::EngineCore": "engine_core", "VLLM::Worker": "workers"}


def _role(name: str) -> str:
    for prefix, role in ROLES.items():
        if name.startswith(prefix):
            return role
    return "other"


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakRss:
    """Peak resident memory of this process (the frontend) and of each of its
    descendants (vLLM's engine core and, with the multiprocess executor, its
    worker), separately, over a block.

    Per process the figure is the kernel's high-water mark (`VmHWM`, reset at
    entry by writing 5 to /proc/PID/clear_refs), so no short peak is missed;
    where that cannot be reset it falls back to sampling every `interval`
    seconds. The simultaneous totals (frontend + engine side, and the engine
    side alone) are sampled. RSS counts shared pages (libraries, shared-memory
    queues) in every process that maps them, so sums overstate the machine's use.
    """

    def __init__(self, interval: float = 0.02) -> None:
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self.interval = interval
        self.peak_total = 0
        self.peak_engine = 0
        self.peak_self = 0
        self.by_process: dict[int, dict[str, Any]] = {}
        self.method = "VmHWM"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self) -> list[Any]:
        try:
            return [self._proc, *self._proc.children(recursive=True)]
        except self._psutil.Error:
            return [self._proc]

    def _run(self) -> None:
        while not self._stop.is_set():
            total = engine = 0
            for p in self._tree():
                try:
                    rss = p.memory_info().rss
                    entry = self.by_process.setdefault(
                        p.pid, {"name": p.name(), "sampled": 0, "hwm_reset": False}
                    )
                except self._psutil.Error:
                    continue
                entry["sampled"] = max(entry["sampled"], rss)
                total += rss
                if p.pid != self._proc.pid:
                    engine += rss
            self.peak_total = max(self.peak_total, total)
            self.peak_engine = max(self.peak_engine, engine)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        for p in self._tree():
            try:
                with open(f"/proc/{p.pid}/clear_refs", "w") as f:
                    f.write("5")  # reset VmHWM to the current RSS
                reset = True
            except OSError:
                reset = False
            try:
                self.by_process[p.pid] = {
                    "name": p.name(),
                    "sampled": 0,
                    "hwm_reset": reset,
                }
            except self._psutil.Error:
                pass
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for pid, entry in self.by_process.items():
            hwm = _status_kib(pid, "VmHWM") if entry["hwm_reset"] else None
            entry["peak"] = (
                entry["sampled"] if hwm is None else max(hwm * 1024, entry["sampled"])
            )
            if hwm is None:
                self.method = "sampled"
        own = self.by_process.get(self._proc.pid)
        self.peak_self = own["peak"] if own else 0

    def fields(self) -> dict[str, Any]:
        """Flat keys of a timing record: per-role peaks (sum of the per-process
        peaks of that role), the sampled simultaneous totals, and the method."""
        roles: dict[str, int] = {}
        for pid, entry in self.by_process.items():
            role = "frontend" if pid == self._proc.pid else _role(entry["name"])
            roles[role] = roles.get(role, 0) + entry["peak"]
        return {
            "peak_rss_frontend": self.peak_self,
            "peak_rss_engine_core": roles.get("engine_core", 0),
            "peak_rss_workers": roles.get("workers", 0),
            "peak_rss_engine": self.peak_engine,
            "peak_rss_total": max(self.peak_total, self.peak_self),
            "peak_rss_method": self.method,
        }
