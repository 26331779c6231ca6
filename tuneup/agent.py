"""The in-process agent: wires the probes into the training loop, samples the slow probes on
a background thread, writes the run log, runs the advice rules and answers `snapshot()`,
`findings()`, `report()` and the loopback HTTP endpoint.

Data flow: hooks (training thread) → StepTimeline → StepRing → background thread →
interval summaries, system samples, configuration → events → run log + RunHistory →
rules (findings) → report / HTTP endpoint; in apply mode, findings → Experimenter (on the
training thread, at step closes) → changes kept or reverted → action events.
"""

from __future__ import annotations

import atexit
import inspect
import math
import os
import socket
import sys
import threading
import time
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.utils.data import DataLoader

from . import __version__
from ._patching import PatchSet
from .act import Experimenter, Job
from .act.actions import ACTIONS
from .diagnose import Evaluation, evaluate
from .export import registry
from .export.metrics import agent_registry
from .export.push import Pusher
from .export.runlog import RunLog, log_name
from .export.server import AgentServer
from .integrations import framework_of, unwrap_loader, unwrap_optimizer
from .measure.calls import CallWatch
from .measure.config import read_config
from .measure.device_values import DeviceValues, raw_item
from .measure.gpu import open_gpus
from .measure.gpu_time import CudaStepTimer
from .measure.host import HostProbe
from .measure.habits import HabitsProbe
from .measure.history import RunHistory
from .measure.loader import LoaderProbe
from .measure.memory import allocator_stats
from .measure.model import ModelProbe
from .measure.optimizer import OptimizerProbe
from .measure.ranks import RankExchange, compact
from .measure.scaler import ScalerProbe
from .measure.steps import StepTimeline
from .measure.syncs import SyncCounter
from .measure.windows import SPIKE_HISTORY, Totals, summarize
from .options import Options, TuneupWarning, agent_port, default_run_dir

RANKS_WAIT = 2.0  # seconds detach waits for one store operation
RANKS_FINAL_WAIT = 5.0  # seconds rank 0 waits for every rank's final summary
RING_CAPACITY = 16384  # steps held between background reads: > 16 s of 1 ms steps
CONFIG_EVERY_TICKS = 10
FINDINGS_EVERY_TICKS = 5  # the rules run every ~5 s with the default 1 s interval
LIFECYCLE_EVERY_STEPS = 64
MAX_WARNINGS = 50
LOCK_TIMEOUT = 5.0  # detach never waits longer on a background thread stuck in a driver call


def _rank(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


class Tracked:
    """Explicit objects per kind, held weakly. A kind the user named none of is measured in
    full (None)."""

    def __init__(self, kinds: dict[str, list[Any]]) -> None:
        self.loaders = weakref.WeakSet(kinds["loaders"]) if kinds["loaders"] else None
        self.optimizers = weakref.WeakSet(kinds["optimizers"]) if kinds["optimizers"] else None
        self.scalers = weakref.WeakSet(kinds["scalers"]) if kinds["scalers"] else None
        self.models = bool(kinds["models"])

    @staticmethod
    def split(objects: Iterable[Any]) -> dict[str, list[Any]]:
        kinds: dict[str, list[Any]] = {"loaders": [], "models": [], "optimizers": [], "scalers": []}
        for obj in objects:
            if isinstance(obj, DataLoader):
                kinds["loaders"].append(unwrap_loader(obj))  # Accelerate's wrapper: its base loader iterates
            elif isinstance(obj, nn.Module):
                kinds["models"].append(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                kinds["optimizers"].append(unwrap_optimizer(obj))  # Accelerate's wrapper: its inner one steps
            elif isinstance(obj, GradScaler):
                kinds["scalers"].append(obj)
            elif framework_of(obj) is not None:
                continue  # a framework's Trainer: tuneup.attach installs its callback
            elif inspect.isfunction(obj) or inspect.ismethod(obj):
                raise TypeError(
                    "tuneup.attach cannot patch a plain function in place: decorate your step "
                    "function with @tuneup.step_function, or call tuneup.step() at the end of each step"
                )
            else:
                raise TypeError(
                    f"tuneup.attach cannot measure a {type(obj).__name__}: pass DataLoaders, nn.Modules, "
                    "Optimizers or GradScalers, or nothing at all to find them automatically"
                )
        return kinds


class Agent:
    """Handle on the running agent. Use as a context manager, or call detach()."""

    def __init__(self, options: Options, objects: tuple[Any, ...] = (), inert_reason: str | None = None) -> None:
        self.options = options
        self.enabled = inert_reason is None
        self.inert_reason = inert_reason
        self.attached = False
        self.rank = _rank("RANK")
        self.local_rank = _rank("LOCAL_RANK")
        self.warnings: list[dict[str, str]] = []
        self.run_log: RunLog | None = None
        self.run_dir: Path | None = None
        self._warned: set[str] = set()
        self._warnings_logged = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._patches = PatchSet()
        self._drained = 0
        self._totals = Totals()
        self._recent_losses: list[float] = []  # the last losses drained: spikes across intervals
        self._system: dict[str, Any] | None = None
        self._config: dict[str, Any] | None = None
        self._config_seen: tuple = ()
        self._ticks = 0
        self._next_lifecycle = 1
        self._pid = os.getpid()
        self.history = RunHistory()  # the events, in memory: what rules and reports read
        self._evaluation = Evaluation(findings=[])
        self._findings_logged: tuple = ()
        self.server: AgentServer | None = None
        self.pusher: Pusher | None = None
        self._announced: Path | None = None
        self._next_heartbeat = 0.0
        self.run_info = self._run_info()
        if self.enabled:
            self._build(Tracked.split(objects))

    # --- construction ------------------------------------------------------------------

    def _run_info(self) -> dict[str, Any]:
        return {
            "run_id": uuid.uuid4().hex[:12],
            "tuneup": __version__,
            "started_at": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": _rank("WORLD_SIZE"),
            # Attached at interpreter start-up (`tuneup run -m pkg`), sys.argv[0] is still "-m".
            "argv": list(sys.orig_argv[1:] if sys.argv[:1] == ["-m"] and hasattr(sys, "orig_argv") else sys.argv),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "mode": self.options.mode,
        }

    def _build(self, kinds: dict[str, list[Any]]) -> None:
        # The objects themselves are not kept: the job owns them (weak sets only).
        tracked = self.tracked = Tracked(kinds)
        self.timeline = StepTimeline(RING_CAPACITY, self._probe_failed, self.options.detail_every)
        self.values = DeviceValues()
        self.habits = HabitsProbe(self.timeline)
        self.loader = LoaderProbe(self.timeline, tracked.loaders, self.habits)
        self.model = ModelProbe(self.timeline, kinds["models"] or None)
        self.optimizer = OptimizerProbe(self.timeline, tracked.optimizers, self._new_optimizer)
        self.scaler = ScalerProbe(self.timeline, tracked.scalers, self.optimizer, self.values)
        self.syncs = SyncCounter(self.timeline, self.options.sync_sample_every, threading.get_ident())
        self.calls = CallWatch(self.timeline, self.syncs)
        self.host: HostProbe | None = None
        self.gpus = open_gpus(self.options.nvml_module, self.options.gpu)
        self.gpu_timer: CudaStepTimer | None = None
        self._hot_probes = (self.loader, self.model, self.optimizer, self.scaler, self.syncs, self.habits, self.calls)
        self._slow_probes_on = {"host": True, "gpu": self.gpus.available, "memory": True, "config": True}
        self.runner: Experimenter | None = None
        if self.options.mode == "apply":
            self.job = Job(self.timeline, self.loader, self.optimizer, self.model, self.scaler)
            allowed = self.options.actions if self.options.actions is not None else tuple(ACTIONS)
            self.runner = Experimenter(self.job, [ACTIONS[name]() for name in ACTIONS if name in allowed],
                                       self._warn_once)
        self.ranks = RankExchange(self._warn_once)  # the other ranks' summaries, through the job's store
        self._ranks_finished = False
        self._framework: dict[str, Any] | None = None
        self.metrics = agent_registry(self, self._warn_once)  # read at scrape time (endpoint, push gateway)

    def start(self) -> "Agent":
        """Install the probes and start sampling; on any failure undo all of it and raise."""
        if not self.enabled or self.attached:
            return self
        self.attached = True
        try:
            self.timeline.attached_at = time.perf_counter()
            self.timeline.add_listener("syncs", self.syncs.on_close)
            self.timeline.add_listener("calls", self.calls.on_close)  # after syncs: see SyncCounter.step_watched
            self.timeline.add_listener("step_close", self._on_close)
            for probe in (self.loader, self.model, self.optimizer, self.scaler, self.syncs):
                probe.install(self._patches)
            self.calls.install()
            if self.runner is not None:
                self.runner.install(self._patches)
            if torch.distributed.is_available():
                from torch.distributed import distributed_c10d

                for owner in (torch.distributed, distributed_c10d):
                    self._patches.replace(owner, "destroy_process_group", self._before_destroy)
            try:
                self.host = HostProbe()
            except Exception as exc:
                self._slow_probe_failed("host", exc)
            self._serve()
            self._start_pushing()
            self._open_run_log()
            self._thread = threading.Thread(target=self._run, name="tuneup-agent", daemon=True)
            self._thread.start()
            atexit.register(self.detach)
        except BaseException:
            self._stop.set()
            self._stop_probes()
            if self.pusher is not None:
                self.pusher.cancel()
            if self.run_log is not None:
                self.run_log.close()
            self.gpus.close()
            self.attached = False
            raise
        return self

    def _stop_probes(self) -> None:
        """Quiet every probe and undo every patch (detach, or a start that failed)."""
        for probe in self._hot_probes:
            probe.on = False
        self.syncs.close()
        self.calls.close()
        self.model.uninstall_discovery()
        self._patches.undo_all()

    def _serve(self) -> None:
        """Start the loopback endpoint (a failure is one warning: the job goes on)."""
        if not self.options.serve:
            return
        port = agent_port(self.options, self.local_rank)
        # Scrapes closer together than the sampling interval would read the same totals: they
        # get the same rendering (at most 1 s old, so the process metrics stay current).
        server = AgentServer(self._run_payload, self.metrics, fresh_for=min(self.options.interval, 1.0))
        try:
            note = server.start(self.options.host, port)
        except Exception as exc:
            self._warn_once("http", f"no HTTP endpoint: cannot listen on {self.options.host}:{port} ({exc}); "
                                    "measuring continues (set TUNEUP_PORT or TUNEUP_SERVE=0)")
            return
        if note:
            self._warn_once("http", note)
        self.server = server
        self.run_info["url"] = server.url

    def _start_pushing(self) -> None:
        if self.options.push_gateway:
            self.pusher = Pusher(self.options.push_gateway, self.options.push_job, self.metrics, self.rank,
                                 self.options.push_interval, self._warn_once)
            self.pusher.start()

    def _announce(self) -> None:
        if self.server is not None:
            self._announced = registry.announce({
                "pid": self._pid, "url": self.server.url, "run_id": self.run_info["run_id"],
                "run_dir": str(self.run_dir) if self.run_dir else None, "rank": self.rank,
                "local_rank": self.local_rank, "argv": self.run_info["argv"],
                "started_at": self.run_info["started_at"], "host": self.run_info["host"],
                "group": _job_group(self.run_info["run_id"]), "mode": self.options.mode,
            })
            if self._announced is None:
                self._warn_once("registry", f"cannot announce this job in {registry.directory()} (not writable): "
                                            "the node daemon and `tuneup watch` without a URL won't find it; "
                                            f"measuring and {self.server.url} go on (set TUNEUP_REGISTRY_DIR)")

    def _run_payload(self) -> dict[str, Any]:
        """What /api/run answers: the run's events and the current findings."""
        if not self._lock.acquire(timeout=LOCK_TIMEOUT):
            raise RuntimeError("the background sampler is busy")
        try:
            return {"events": self.history.events(), "findings": self._evaluation.to_dict(),
                    "attached": self.attached}
        finally:
            self._lock.release()

    def _open_run_log(self) -> None:
        self.run_dir = (self.options.run_dir or default_run_dir(self.rank)) if self.options.log else None
        header = dict(self.run_info, event="run", time=time.time(), options=_options_dict(self.options),
                      run_dir=str(self.run_dir) if self.run_dir else None)
        self.history.add(header)
        self._announce()
        if not self.options.log:
            return
        log = RunLog(self.run_dir / log_name(self.rank), self.options.log_max_bytes, header)
        if log.open():
            self.run_log = log
            self.history.source = str(log.path)
        else:
            self._run_log_failed(log)

    def focus(self, *, models: Iterable[Any] = (), loaders: Iterable[Any] = (), optimizers: Iterable[Any] = (),
              scalers: Iterable[Any] = ()) -> None:
        """Measure exactly these objects, kind by kind (a framework's training objects: its
        validation loaders are then left out); a kind given nothing stays as it was."""
        if not self.enabled:
            return
        for kind, probe, objects in (("loaders", self.loader, loaders), ("optimizers", self.optimizer, optimizers),
                                     ("scalers", self.scaler, scalers)):
            objects = [obj for obj in objects if obj is not None]
            if objects:
                chosen = weakref.WeakSet(objects)
                setattr(self.tracked, kind, chosen)
                if probe is self.loader:
                    self.loader.focus(chosen)
                else:
                    probe.tracked = chosen
        if self.tracked.models:
            for model in models:
                self.model._hook_root(model)

    def note_framework(self, info: dict[str, Any]) -> None:
        """The training framework's own settings (Lightning, Transformers), for the run log
        and the configuration the rules and reports read."""
        if not self.enabled:
            return
        self._framework = dict(info)
        with self._lock:
            self._log({"event": "framework", "time": time.time(), **self._framework})
            self._refresh_config()

    def add(self, objects: tuple[Any, ...]) -> None:
        """attach() again with more objects: measure those too."""
        if not self.enabled or not objects:
            return
        kinds = Tracked.split(objects)
        for kind in ("loaders", "optimizers", "scalers"):
            current = getattr(self.tracked, kind)
            if current is not None:
                for obj in kinds[kind]:
                    current.add(obj)
        if self.tracked.models:
            for model in kinds["models"]:
                self.model._hook_root(model)

    # --- training-thread callbacks ---------------------------------------------------

    def _new_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if len(self.optimizer.optimizers) > 1:
            self.model.discover()  # a new optimizer usually means a new model

    def _on_close(self, step: int) -> None:
        """At the close of detail steps and of the steps asked for through `wake_at`, on the
        training thread: read the loss, collect device values, plan the next wake-up."""
        syncs = self.syncs
        tl = self.timeline
        loss = tl.step_loss
        if loss is not None:
            ring = tl.ring
            if loss.is_cpu:  # the common case, inline: a CPU read never syncs
                try:
                    value = raw_item(loss)
                except RuntimeError:
                    pass  # not a single value: nothing to read
                else:
                    slot = (step - 1) % ring.capacity
                    ring.loss[slot] = value
                    ring.loss_step[slot] = step
            elif loss.numel() == 1:
                self.values.read(loss, lambda value: ring.put("loss", step, value), step)
        if self.values.pending:
            self.values.poll()
        if step >= self._next_lifecycle:
            self._next_lifecycle = step + LIFECYCLE_EVERY_STEPS
            self._lifecycle(step)
        runner = self.runner
        if runner is not None:
            runner.on_close(step)
        # Wake at the next close that needs us between detail steps.
        if syncs.sampling or self.values.pending or self.gpu_timer is not None:
            wake = step + 1
        elif syncs.on and syncs.next_sample > step:
            wake = syncs.next_sample - 1  # the close that starts the sampled step
        else:
            wake = 1 << 62
        wake = min(wake, self.calls.wake_after(step))
        tl.wake_at = min(wake, runner.wake_at) if runner is not None else wake

    def _lifecycle(self, step: int) -> None:
        """Rare checks that must run on the training thread."""
        if step == 1:
            self.syncs.thread_id = threading.get_ident()  # the thread that really trains
        # is_initialized() alone: is_available() would initialize the CUDA driver in a CPU job.
        if self.gpu_timer is None and torch.cuda.is_initialized():
            self.gpu_timer = CudaStepTimer(self.timeline, self.model.cuda_device())
            self.timeline.gpu_timer = self.gpu_timer
            self.timeline.add_listener("gpu_time", self.gpu_timer.on_close)
        self.model.read_config_next_forward = True

    # --- failures ----------------------------------------------------------------------

    def _probe_failed(self, name: str, exc: BaseException) -> None:
        if name == "syncs":
            self.syncs.close()  # the sampled step under way ends here; "off" says why (see warnings)
        elif name == "step_close":
            # No sampled step may stay open without the listener that ends it.
            self.syncs.turn_off(f"stopped: the {name} listener failed")
        if self.runner is not None and name in ("step_close", "steps", "optimizer", "dataloader", "model"):
            # Apply mode judges and guards its changes through these: without them, none may stay.
            self.runner.on = False
            self.runner.revert_all(f"the {name} probe failed", wait=0)
        self._warn_once(name, f"{name} probe turned off after an internal error: {type(exc).__name__}: {exc}")

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        if len(self.warnings) < MAX_WARNINGS:
            self.warnings.append({"probe": key, "message": message, "time": time.time()})
        warnings.warn(f"tuneup: {message}", TuneupWarning, stacklevel=2)

    # --- background thread -----------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.options.interval):
            if os.getpid() != self._pid:
                return
            try:
                self._tick()
            except Exception as exc:  # the tick itself must never die silently
                self._warn_once("background", f"background sampling stopped after an internal error: {exc!r}")
                return

    def _tick(self, final: bool = False) -> None:
        with self._lock:
            self._ticks += 1
            interval = self._drain(final)
            self._system = self._sample_system()
            seen = self._config_inputs()
            if final or seen != self._config_seen or self._ticks % CONFIG_EVERY_TICKS == 1:
                self._config_seen = seen
                self._refresh_config()
            self._log({"event": "system", **self._system})
            if interval is not None:
                self._log(self._steps_event(interval))
            self._log_warnings()
            now = time.monotonic()
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + registry.HEARTBEAT
                registry.heartbeat(self._announced)
            runner = self.runner
            # Apply mode acts on findings: fresh every tick while it may still act (the rules
            # cost well under a millisecond; the experiments are what it waits for).
            if final or self._ticks % FINDINGS_EVERY_TICKS == 1 or (runner is not None and runner.accepting):
                self._diagnose()
            if runner is not None:
                self.job.system, self.job.config = self._system, self._config or {}
                for record in runner.drain():
                    self._log({"event": "action", **record})

    def _diagnose(self, snapshot: dict[str, Any] | None = None, final: bool = False) -> None:
        """Run the rules over the history (off the training thread); log what changed. In a
        distributed job, publish this rank's summary for the others; rank 0 reads theirs, so
        its rules see every rank (the straggler rule)."""
        ranks = self.ranks
        try:
            if snapshot is None:
                snapshot = self.history.snapshot(self.options.window_steps)
            peers = ranks.peer_snapshots() if ranks.rank == 0 else []
            self._evaluation = evaluate(snapshot, ranks=peers, silence=self.options.silence)
        except Exception as exc:
            self._warn_once("rules", f"advice rules stopped after an internal error: {type(exc).__name__}: {exc}")
            return
        found = [f.to_dict() for f in self._evaluation.findings]
        if not final and ranks.connect():
            ranks.publish(compact(snapshot, found, final=False))
            ranks.gather()  # rank 0 only; read at the next evaluation
        if self.runner is not None:
            self.job.findings = {f["rule"]: f for f in found}
        current = tuple((f["rule"], f["severity"]) for f in found)
        if current != self._findings_logged:
            self._findings_logged = current
            self._log({"event": "findings", "time": time.time(), "findings": found})

    def _finish_ranks(self) -> None:
        """The end of a distributed run: publish this rank's final summary; rank 0 waits a few
        seconds for the others' (no collective: the store), evaluates the rules across every
        rank once more, logs the ranks and prints the summary across ranks."""
        ranks = self.ranks
        if self._ranks_finished or not ranks.active:
            return
        self._ranks_finished = True
        snapshot = self.history.snapshot(self.options.window_steps)
        store_up = ranks.group_alive()  # the job may have destroyed its process group already
        if store_up:
            ranks.publish(compact(snapshot, self.findings(), final=True), wait=RANKS_WAIT)
        if ranks.rank != 0:
            return
        if store_up:
            ranks.gather(wait=RANKS_WAIT + RANKS_FINAL_WAIT, final_within=RANKS_FINAL_WAIT)
        self._diagnose(snapshot, final=True)  # across every rank's final summary
        own = compact(snapshot, self.findings(), final=True)
        everyone = [own] + ranks.peer_snapshots()
        self._log({"event": "ranks", "time": time.time(), "world_size": ranks.world_size, "ranks": everyone,
                   "findings": [f.to_dict() for f in self._evaluation.findings if f.rule == "rank-straggler"]})
        from .report.ranks import rank_summary

        run_dir = str(self.run_dir) if self.run_log is not None else None
        sys.stderr.write(rank_summary(everyone, ranks.world_size, self.findings(), run_dir) + "\n")

    def _before_destroy(self, original: Any) -> Any:
        """torch.distributed.destroy_process_group takes the store with it: exchange the final
        summaries first (the default group only)."""
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            if not args and kwargs.get("group") is None and self.attached:
                try:
                    if self._lock.acquire(timeout=LOCK_TIMEOUT):
                        try:
                            self._tick()  # the steps so far reach the history (and the run log) first
                            self._finish_ranks()
                        finally:
                            self._lock.release()
                except Exception as exc:
                    self._warn_once("ranks", f"the final cross-rank summary failed: {type(exc).__name__}: {exc}")
            return original(*args, **kwargs)

        return destroy_process_group

    def _log_warnings(self) -> None:
        while self._warnings_logged < len(self.warnings):
            self._log(dict(self.warnings[self._warnings_logged], event="warning"))
            self._warnings_logged += 1

    def _drain(self, final: bool = False) -> dict[str, Any] | None:
        """Move closed steps into the totals; return their interval summary. Steps whose
        device values (loss, skips, GPU time) are still in flight wait for the next drain."""
        ring = self.timeline.ring
        last = ring.count
        if not final:
            pending = [self.values.oldest_pending_step()]
            if self.gpu_timer is not None:
                pending.append(self.gpu_timer.oldest_pending_step())
            waiting = [step for step in pending if step is not None]
            if waiting:
                last = min(last, min(waiting) - 1)
        if last <= self._drained:
            return None
        first = self._drained + 1
        oldest_held = ring.count - ring.capacity + 2  # its predecessor's record is needed too
        if first < oldest_held:
            self._totals.dropped_steps += oldest_held - first
            first = oldest_held
        columns = ring.columns(first, last)
        self._drained = last
        interval = summarize(columns, forward_measured=self.model.timed, loss_context=self._recent_losses)
        if interval is not None:
            # The wall-clock end of the last step: its perf_counter close, moved to time.time().
            ended = ring.records[(last - 1) % ring.capacity][0]
            self._totals.add(interval, columns["step_seconds"], time.time() - (time.perf_counter() - ended))
            finite = [value for value, read in zip(columns["loss"], columns["loss_known"])
                      if read and math.isfinite(value)]
            self._recent_losses = (self._recent_losses + finite)[-SPIKE_HISTORY:]
        return interval

    def _steps_event(self, interval: dict[str, Any]) -> dict[str, Any]:
        event = {"event": "steps", "time": time.time(), **interval}
        if self.scaler.seen:
            event["scaler"] = self.scaler.summary()
        if self.syncs.sampled_steps:
            event["syncs"] = self.syncs.summary(top=5)
        event["habits"] = self._habits()
        return event

    def _habits(self) -> dict[str, Any]:
        return dict(self.habits.summary(), **self.calls.summary(), eval_forwards_with_grad=self.model.eval_with_grad)

    def _sample_system(self) -> dict[str, Any]:
        system: dict[str, Any] = {"time": time.time()}
        if self._slow_probes_on["host"] and self.host is not None:
            try:
                system["host"] = self.host.sample(self.loader.worker_pids())
            except Exception as exc:
                self._slow_probe_failed("host", exc)
        if self._slow_probes_on["gpu"]:
            try:
                system["gpu"] = {"available": True, "devices": self.gpus.devices, "samples": self.gpus.sample()}
            except Exception as exc:
                self._slow_probe_failed("gpu", exc)
        if "gpu" not in system:
            reason = self.gpus.reason if not self.gpus.available else "GPU probe turned off after an NVML error"
            system["gpu"] = {"available": False, "reason": reason}
        if self._slow_probes_on["memory"]:
            try:
                system["memory"] = allocator_stats()
            except Exception as exc:
                self._slow_probe_failed("memory", exc)
        return system

    def _slow_probe_failed(self, name: str, exc: BaseException) -> None:
        self._slow_probes_on[name] = False
        self._probe_failed(name, exc)

    def _config_inputs(self) -> tuple:
        """What the probes have seen that the configuration is read from: when it changes
        (a new loader, optimizer or model, autocast first seen), the configuration is read."""
        return (
            len(self.loader.loaders), len(self.optimizer.optimizers), len(self.model.roots),
            self.model.autocast, self.optimizer.set_to_none, self.scaler.seen, self.scaler.enabled,
        )

    def _refresh_config(self) -> None:
        if not self._slow_probes_on["config"]:
            return
        try:
            config = read_config(
                loaders=list(self.loader.loaders),
                optimizers=list(self.optimizer.optimizers),
                models=self.model.root_models(),
                leaf_order=self.model.leaf_order,
                autocast=self.model.autocast,
                set_to_none=self.optimizer.set_to_none,
                grad_scaler=self.scaler.summary(),
                cpu_bf16=self.options.cpu_bf16,
            )
        except RuntimeError:
            return  # a dict changed size while the job mutated it: read again next time
        except Exception as exc:
            self._slow_probe_failed("config", exc)
            return
        if self._config is not None:
            # The job may have dropped its objects (the loop ended): keep what they were.
            for kind in ("loaders", "optimizers", "models"):
                if not config[kind]:
                    config[kind] = self._config[kind]
        if self._framework is not None:
            config["framework"] = self._framework
        if config != self._config:
            self._config = config
            self._log({"event": "config", "time": time.time(), **config})

    def _log(self, event: dict[str, Any]) -> None:
        self.history.add(event)
        log = self.run_log
        if log is not None and not log.write(event):
            self.run_log = None
            self._run_log_failed(log)

    def _run_log_failed(self, log: RunLog) -> None:
        self._warn_once("run_log", f"run log turned off: cannot write {log.error}; measuring continues in memory")

    # --- public API ------------------------------------------------------------------

    @staticmethod
    def check_objects(objects: tuple[Any, ...]) -> None:
        """Raise TypeError, with the fix, for an object attach() cannot measure."""
        Tracked.split(objects)

    def begin_step(self) -> None:
        """Mark the start of a training step (used by @tuneup.step_function)."""
        if self.enabled and self.attached:
            try:
                self.timeline.step_begins(time.perf_counter())
            except Exception as exc:
                self._probe_failed("steps", exc)

    def step(self) -> None:
        """Mark the end of a training step (loops without an optimizer)."""
        if self.enabled and self.attached:
            try:
                self.timeline.manual_step()
            except Exception as exc:
                self._probe_failed("steps", exc)

    def snapshot(self) -> dict[str, Any]:
        """Everything measured so far, as plain data (the run log holds the same). Never
        raises: a failure inside tuneup comes back as {"error": ...} with one warning."""
        if not self.enabled:
            return {"enabled": False, "reason": self.inert_reason, "run": self.run_info}
        if not self._lock.acquire(timeout=LOCK_TIMEOUT):
            return {"enabled": True, "run": self.run_info, "error": "the background sampler is busy"}
        try:
            return self._snapshot()
        except Exception as exc:
            self._warn_once("snapshot", f"snapshot failed: {type(exc).__name__}: {exc}")
            return {"enabled": True, "run": self.run_info, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            self._lock.release()

    def _snapshot(self) -> dict[str, Any]:
        self._drain()
        if self._system is None:
            self._system = self._sample_system()
        if self._config is None or not self.attached:
            self._refresh_config()
        ring = self.timeline.ring
        window = summarize(ring.columns(ring.count - self.options.window_steps + 1, ring.count),
                           forward_measured=self.model.timed)
        return {
            "enabled": True,
            "attached": self.attached,
            "run": self.run_info,
            "run_dir": str(self.run_dir) if self.run_dir else None,
            "run_log": str(self.run_log.path) if self.run_log else None,
            "totals": self._totals_summary(),
            "window": window,
            "syncs": self.syncs.summary(),
            "scaler": self.scaler.summary(),
            "habits": self._habits(),
            "system": self._system,
            "config": self._config,
            "probes": self.probe_states(),
            "warnings": list(self.warnings),
            "actions": self.actions(),
        }

    def actions(self) -> list[dict[str, Any]]:
        """Apply mode's changes, one record each: what changed (before/after settings), the
        baseline and trial windows' numbers, the decision and why. Empty in advise mode."""
        runner = self.runner if self.enabled else None
        return [dict(record) for record in list(runner.records)] if runner is not None else []

    def revert_all(self) -> int:
        """Undo every change apply mode made (newest first) and make no more; returns how many
        were undone. DataLoader settings switch back at the loop's next batch. Never raises."""
        runner = self.runner if self.enabled else None
        if runner is None:
            return 0
        try:
            return runner.revert_all()
        except Exception as exc:
            self._warn_once("apply", f"revert_all could not finish: {type(exc).__name__}: {exc}")
            return 0

    def findings(self) -> list[dict[str, Any]]:
        """The current findings, ranked by estimated gain (the rules run every few seconds
        on the background thread; after detach, on the whole run)."""
        return [finding.to_dict() for finding in self._evaluation.findings]

    def document(self) -> dict[str, Any]:
        """The report document (what every report format renders) of this run so far."""
        from .report.document import build

        with self._lock:
            return build([self.history], source=str(self.run_log.path) if self.run_log else "memory",
                         silence=self.options.silence, window_steps=self.options.window_steps)

    def report(self, format: str = "text") -> str:
        """The advice report (text, markdown, json or html), as `tuneup report` prints it."""
        from .report.render import render_document

        return render_document(self.document(), format)

    def _totals_summary(self) -> dict[str, Any]:
        return dict(self._totals.summary(), device_reads_dropped=self.values.dropped)

    def probe_states(self) -> dict[str, str]:
        """Each probe: "on", "off" (turned off after an error; see warnings) or why it is idle."""
        names = [probe.name for probe in self._hot_probes] + list(self._slow_probes_on)
        states = {name: "off" if name in self._warned else "on" for name in names}
        for name in self._warned:  # listeners and the background sampler
            states.setdefault(name, "off")
        if not self.gpus.available:
            states["gpu"] = "no GPU"
        if not self.options.log:
            states["run_log"] = "turned off (log=False)"
        else:
            states["run_log"] = "off" if "run_log" in self._warned else "on"
        if self.syncs.off_reason:
            states["syncs"] = self.syncs.off_reason
        elif self.options.sync_sample_every == 0:
            states["syncs"] = "turned off (sync_sample_every=0)"
        return states

    def detach(self) -> None:
        """Stop measuring and put every patched object back exactly as it was. Never raises
        (it runs in `with` blocks and at exit, where it must not mask the job's own error)."""
        if not self.attached:
            return
        self.attached = False
        try:
            self._detach()
        except Exception as exc:
            self._warn_once("detach", f"detach could not finish cleanly: {type(exc).__name__}: {exc}")
        finally:
            from . import _forget

            _forget(self)

    def _detach(self) -> None:
        atexit.unregister(self.detach)
        if os.getpid() != self._pid:
            return  # a forked child: the parent owns the log and the patches
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(2.0, 2 * self.options.interval))
        try:
            self.timeline.flush()
        except Exception as exc:
            self._probe_failed("steps", exc)
        if self.runner is not None:  # before the probes go: the changes patch what they patched
            self.runner.revert_all("detach")
            self.runner.close()
            self.runner.on = False
        self._stop_probes()
        if not self._lock.acquire(timeout=LOCK_TIMEOUT):  # the sampler is stuck (e.g. in NVML)
            self._warn_once("background", "the background sampler did not stop; the run log has no end event")
            return
        try:
            self.values.poll()
            self._tick(final=True)
            self._finish_ranks()
            self._log({"event": "end", "time": time.time(), "totals": self._totals_summary(),
                       "syncs": self.syncs.summary(), "scaler": self.scaler.summary(),
                       "habits": self._habits(), "warnings": self.warnings})
        finally:
            self._lock.release()
            if self.run_log is not None:
                self.run_log.close()
            self.gpus.close()
            registry.withdraw(self._announced)
            if self.server is not None:
                self.server.stop()
            if self.pusher is not None:
                self.pusher.stop()  # the final values, after the last drain

    def forked(self) -> None:
        """In a forked child (DataLoader worker): go quiet, touch nothing shared. The
        inherited Event and lock may have been held by the sampler thread at the fork:
        replace them rather than use them."""
        self.attached = False
        self._stop = threading.Event()
        self._lock = threading.RLock()
        if self.server is not None:
            self.server.forget_in_child()
            self.server = None
        self.pusher = None  # its thread stayed in the parent
        self._announced = None
        if self.enabled:
            for probe in self._hot_probes:
                probe.on = False
            self.syncs.sampling = False
            self.syncs.counting_reads = False
            self.calls.close()  # a worker forked during a watched step inherited the profile function
            self.run_log = None
            if self.runner is not None:
                self.runner.on = False

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        if not self.enabled:
            return f"<tuneup.Agent inert: {self.inert_reason}>"
        state = "attached" if self.attached else "detached"
        return f"<tuneup.Agent {state} mode={self.options.mode} steps={self.timeline.ring.count}>"


def _job_group(run_id: str) -> str:
    """What the ranks of one distributed job on this node share (torchrun's rendezvous), so
    the node daemon reports them as one job; a job of one process is its own group."""
    if os.environ.get("WORLD_SIZE") and os.environ.get("MASTER_PORT"):
        return ":".join(os.environ.get(name, "") for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    return run_id


def _options_dict(options: Options) -> dict[str, Any]:
    return {name: (str(value) if isinstance(value, Path) else value) for name, value in vars(options).items()}
