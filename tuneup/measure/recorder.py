"""The recorder: every probe of one job, from the training thread's hooks to the numbers the
rest of tuneup reads.

    hooks (training thread) → StepTimeline → StepRing ─┐
    the step-close listener (loss reads, device values, wake-ups, apply mode's turn)   │
    background thread: drain → Totals + an interval summary ◄──────────────────────────┘
                       slow samplers (host, NVML, allocator) → the system sample
                       configuration, read again when what it is read from changes
                       → events, handed to `emit` (the run log and the in-memory history)

It imports nothing above measure/: what it needs of the rest (a warning, a probe failure,
apply mode's step-close turn) is handed in.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterable

import torch

from .calls import CallWatch
from .compiled import CompileProbe
from .config import read_config
from .device_values import DeviceValues, raw_item
from .ddp import AllReduceWait
from .gpu import NvmlGpus, cuda_uuids, open_gpus
from .gpu_time import CudaStepTimer
from . import transfer
from .gradients import GradientNorms
from .habits import HabitsProbe
from .loader import LoaderProbe
from .memory import allocator_stats
from .model import ModelProbe, is_compiled, tracing
from .objects import Tracked
from .optimizer import OptimizerProbe
from .own_cost import OwnCost
from .flops import FlopCount
from .gc_pauses import GcPauses
from .precision import PrecisionTrial
from .scaler import ScalerProbe
from .stacks import InputSampler
from .hotpath import PACED_FROM_STEP, StepTimeline
from .syncs import SyncCounter
from .terms import CLOSURE_OPTIMIZERS
from .windows import Totals, detail_cost, detail_pairs, summarize

DETAIL_PAIRS_KEPT = 64  # the latest detail steps whose cost paces them (windows.detail_cost)
RING_CAPACITY = 16384  # steps held between background reads: > 16 s of 1 ms steps
CONFIG_EVERY_TICKS = 10
LIFECYCLE_EVERY_STEPS = 64

Warn = Callable[[str, str], None]
Fail = Callable[[str, BaseException], None]
Emit = Callable[[dict[str, Any]], None]


INPUT_SAMPLING_SHARE = 0.05  # input before the forward, of the detail steps' time, that starts the stack sampler
INPUT_WINDOW = 256  # ... over the run, and on the typical detail step of this many latest steps
INPUT_MIN_DETAILED = 3  # ... of at least this many detail steps (a median that one outlier does not make)

# Why the model is not run off the step (precision trial, FLOP count) in a loop whose steps close
# on another thread than the one it trains on.
ELSEWHERE = ("the loop's steps close on another thread than the one its optimizer steps on (a prefetching "
             "thread): the model is not run off the step while it trains")


class Recorder:
    """The probes, their step-close listener, the drain into running totals, the slow
    samplers and the configuration. `fail(name, exc)` is told of a probe that failed (the
    caller decides what else stops); `emit(event)` receives every event."""

    def __init__(self, options: Any, kinds: dict[str, list[Any]], warn: Warn, fail: Fail, emit: Emit) -> None:
        self.options = options
        self.warn, self.fail, self.emit = warn, fail, emit
        self.cost = OwnCost()  # the background thread's time, by part (own_cost.py)
        # The objects themselves are not kept: the job owns them (weak sets only).
        tracked = self.tracked = Tracked(kinds)
        self.timeline = StepTimeline(RING_CAPACITY, fail, options.detail_every)
        self.values = DeviceValues()
        self.habits = HabitsProbe(self.timeline)
        self.loader = LoaderProbe(self.timeline, tracked.loaders, self.habits)
        self.model = ModelProbe(self.timeline, kinds["models"] or None)
        self.optimizer = OptimizerProbe(self.timeline, tracked.optimizers, self._new_optimizer)
        self.scaler = ScalerProbe(self.timeline, tracked.scalers, self.optimizer, self.values)
        self.syncs = SyncCounter(self.timeline, options.sync_sample_every, threading.get_ident())  # (None: paced)
        self.calls = CallWatch(self.timeline, self.syncs)
        self.compile = CompileProbe(self.timeline)
        # The optimizer's pre-hook is out of torch's registry on the steps with nothing for it
        # (OptimizerProbe.fit_pre_hook): not on a step whose host reads are counted, nor where
        # a compilation may have seen the registry.
        self.optimizer.regions_read = lambda: self.syncs.sampling or self.calls.watching
        self.optimizer.compile_quiet = self.compile.quiet
        self.compile.on_begin = self._compile_begins
        self.collector = GcPauses(self.timeline)  # Python's garbage collections, timed
        self.precision = PrecisionTrial(self.timeline, self.model)  # what autocast would save, timed once
        self.flops = FlopCount(self.model)  # a step's FLOPs, counted on shapes when they change
        # The gradient norm each update uses, on sampled steps (exploding gradients).
        self.gradients = self.optimizer.gradients = self.model.gradients = GradientNorms(self.timeline, self.values)
        self.host: Any = None  # host.HostProbe, made at the first sample (psutil: not inside attach())
        self.gpus = open_gpus(options.nvml_module, options.gpu)
        self.gpu_timer: CudaStepTimer | None = None
        self.hot_probes = (self.loader, self.model, self.optimizer, self.scaler, self.syncs, self.habits, self.calls)
        self.allreduce = AllReduceWait()  # DDP's own timers, read each tick
        self.slow_probes_on = {"host": True, "gpu": self.gpus.available, "memory": True, "config": True,
                               "ddp": True, "transfer": True}
        self.batch_transfer: dict[str, Any] | None = None  # what shipping a batch from a worker costs
        # Apply mode's turn at step closes: an object with on_close(step) and wake_at.
        self.experimenter: Any = None
        self.totals = Totals()
        self.input_lines: InputSampler | None = None  # started once the input is worth naming
        self.system: dict[str, Any] | None = None
        self.config: dict[str, Any] | None = None
        self.framework: dict[str, Any] | None = None
        self._drained = 0
        self.detail_cost: float | None = None  # a detail step's measured cost (windows.detail_cost)
        self._detail_pairs: deque[float] = deque(maxlen=DETAIL_PAIRS_KEPT)
        self._plain_steps: deque[float] = deque(maxlen=16 * DETAIL_PAIRS_KEPT)
        self._config_seen: tuple = ()
        self._config_settled = False  # read for the last time (settle_config)
        self._next_lifecycle = 1

    # --- installing ---------------------------------------------------------------------

    def install(self, patches: Any) -> None:
        timeline = self.timeline
        timeline.attached_at = time.perf_counter()
        timeline.add_listener("syncs", self.syncs.on_close)
        timeline.add_listener("calls", self.calls.on_close)  # after syncs: see SyncCounter.step_watched
        timeline.add_listener("step_close", self.on_close)
        for probe in (self.loader, self.model, self.optimizer, self.scaler, self.syncs):
            probe.install(patches)
        self.calls.install()
        self.compile.install(patches)
        self.collector.install()

    def quiet(self) -> None:
        """Every hot probe off (detach, a start that failed, a forked child)."""
        for probe in self.hot_probes:
            probe.on = False
        self.loader.close()
        if self.input_lines is not None:
            self.input_lines.stop()
        self.syncs.close()
        self.calls.close()
        self.compile.on = False
        self.compile.close()
        self.collector.close()
        self.precision.on = False
        self.precision.release()
        self.flops.on = False
        self.flops.release()
        self.model.uninstall_discovery()

    def forked(self) -> None:
        for probe in self.hot_probes:
            probe.on = False
        self.loader.close()
        self.syncs.sampling = False
        self.syncs.counting_reads = False
        self.calls.close()  # a worker forked during a watched step inherited the profile function
        self.collector.close()  # (gc.callbacks is inherited too)

    def close(self) -> None:
        self.gpus.close()

    def focus(self, kinds: dict[str, Iterable[Any]]) -> None:
        """Measure exactly these objects, kind by kind; a kind given nothing stays as it was."""
        for kind, probe in (("loaders", self.loader), ("optimizers", self.optimizer), ("scalers", self.scaler)):
            objects = [obj for obj in kinds.get(kind, ()) if obj is not None]
            if objects:
                chosen = weakref.WeakSet(objects)
                setattr(self.tracked, kind, chosen)
                probe.focus(chosen)
        if self.tracked.models:
            for model in kinds.get("models", ()):
                self.model._hook_root(model)

    def add(self, kinds: dict[str, list[Any]]) -> None:
        """More objects named by the job (attach() again)."""
        for kind in ("loaders", "optimizers", "scalers"):
            current = getattr(self.tracked, kind)
            if current is not None:
                for obj in kinds[kind]:
                    current.add(obj)
        if self.tracked.models:
            for model in kinds["models"]:
                self.model._hook_root(model)

    # --- the training thread --------------------------------------------------------------

    def begin_step(self) -> None:
        try:
            self.timeline.step_begins(time.perf_counter())
        except Exception as exc:
            self.fail("steps", exc)

    def end_step(self) -> None:
        try:
            self.timeline.manual_step()
        except Exception as exc:
            self.fail("steps", exc)

    def _compile_begins(self) -> None:
        """A compilation begins (before dynamo traces): what it compiles may hold the optimizer's
        step (OptimizerProbe.compile_begins) and train another model than the one whose parameter
        tells an update (ModelProbe.forget_watched)."""
        self.optimizer.compile_begins()
        self.model.forget_watched()

    def _new_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if len(self.optimizer.optimizers) > 1:
            self.model.discover()  # a new optimizer usually means a new model

    def on_close(self, step: int) -> None:
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
                    ring.latest["loss"] = step  # (the closing step: none later has a value yet)
            elif loss.numel() == 1:
                self.values.read(loss, lambda value: ring.put("loss", step, value), step)
        if self.values.pending:
            self.values.poll()
        if tl.detail:  # the step whose forward a waiting capture took (or gave up on), closing
            if self.precision.over():
                if self._on_step_thread():
                    self.precision.finish(self.config, self.timeline.ring.recent_step_seconds(64))
                else:
                    self.precision.release()
                    self.precision.skip(ELSEWHERE)
            if self.flops.over():
                if self._on_step_thread():
                    self.flops.finish(step, tl.fail)
                else:
                    self.flops.skip(ELSEWHERE)
        if step >= self._next_lifecycle:
            self._next_lifecycle = step + LIFECYCLE_EVERY_STEPS
            self._lifecycle(step)
        experimenter = self.experimenter
        if experimenter is not None:
            experimenter.on_close(step)
        # Wake at the next close that needs us between detail steps.
        if syncs.sampling or self.values.pending or self.gpu_timer is not None or self.model.discovering is not None:
            wake = step + 1  # (model discovery ends at a close: the backward off detail steps is not seen)
        elif syncs.on and syncs.next_sample > step:
            wake = syncs.next_sample - 1  # the close that starts the sampled step
        else:
            wake = 1 << 62
        wake = min(wake, self.calls.wake_after(step))
        tl.wake_at = min(wake, experimenter.wake_at) if experimenter is not None else wake

    def _lifecycle(self, step: int) -> None:
        """Rare checks that must run on the training thread."""
        if step == 1:
            self.syncs.thread_id = threading.get_ident()  # the thread that really trains
        # is_initialized() alone: is_available() would initialize the CUDA driver in a CPU job.
        if self.gpu_timer is None and torch.cuda.is_initialized():
            self.time_gpu(CudaStepTimer(self.timeline, self.model.cuda_device()))
            if isinstance(self.gpus, NvmlGpus):  # NVML's devices named as torch numbers them
                self.gpus.match_cuda(cuda_uuids())
        self.model.read_config_next_forward = True
        self._measure_transfer()
        # The runs of the model off the step (offstep.py): what autocast would save, the FLOPs.
        due = [capture for capture, wanted in ((self.precision, self.precision.due(step, self.config)),
                                               (self.flops, self.flops.due(step))) if wanted]
        if due and not self._on_step_thread():
            for capture in due:
                capture.skip(ELSEWHERE)
        elif due and not tracing():
            trained = [model for model in self.model.root_models() if id(model) in self.model.trained]
            compiled = self.compile.compiles or any(is_compiled(model) for model in trained)
            for capture in due:
                if compiled:
                    capture.skip("the model is compiled (its graphs run the step, not its forward)")
                elif trained:
                    capture.capture(trained)

    def _on_step_thread(self) -> bool:
        """Whether this close runs on the thread the optimizers step on (or no optimizer stepped
        yet): the model's runs off the step (offstep.py) swap its parameters and hooks for the
        count, and must not while the job's own thread runs it."""
        thread = self.optimizer.step_thread
        return thread is None or thread == threading.get_ident()

    def time_gpu(self, timer: CudaStepTimer) -> None:
        """GPU time per detail step from now on, by `timer`'s events."""
        self.gpu_timer = self.timeline.gpu_timer = timer
        self.timeline.add_listener(timer.name, timer.on_close)

    def flush(self) -> None:
        """The open step closes, the device values in flight are collected (detach): those
        complete by now (queried, never waited for). The last step's GPU time too: the final
        drain does not wait for it, and without it the window's GPU median was over one step
        fewer than its step median (a run of 24 steps: the lower middle step against the mean
        of both, 6 ms apart on a busy machine)."""
        try:
            self.timeline.flush()
        except Exception as exc:
            self.fail("steps", exc)
        self.values.poll()
        if self.gpu_timer is not None:
            try:
                self.gpu_timer.poll()
            except Exception as exc:
                self.fail("gpu_time", exc)

    # --- the background thread ------------------------------------------------------------

    def sample(self, tick: int, final: bool = False) -> None:
        """One background tick: the closed steps drained, the slow probes sampled, the
        configuration read when it may have changed; each as an event."""
        cost = self.cost
        with cost.part("steps"):
            self.compile.watch()  # torch._dynamo loaded since, or reset: its callbacks again
            interval = self.drain(final)
            self._watch_input(interval, final)
        self.system = self.sample_system(final)
        if (not self._config_settled and (final or tick % CONFIG_EVERY_TICKS == 1)) or self._config_stale():
            with cost.part("config"):
                self._read_config()
        with cost.part("outputs"):
            self.emit({"event": "system", **self.system})
            if interval is not None:
                self.emit(self._steps_event(interval))

    def catch_up(self, refresh_config: bool = False) -> None:
        """Before a read (snapshot()): the closed steps into the history, a first system
        sample, the configuration if none was read yet or what it is read from changed since
        (a read just after apply mode undid a num_workers trial reported the trial's count
        until the next tick)."""
        interval = self.drain()
        if interval is not None:
            self.emit(self._steps_event(interval))
        if self.system is None:
            self.system = self.sample_system()
            self.emit({"event": "system", **self.system})
        if self.config is None or refresh_config or self._config_stale():
            self._read_config()

    def drain(self, final: bool = False) -> dict[str, Any] | None:
        """Move closed steps into the totals; return their interval summary. Steps whose
        device values (loss, skips, GPU time) are still in flight wait for the next drain."""
        ring = self.timeline.ring
        last = ring.count
        self.model.graphs.settle(last)
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
            self.totals.dropped_steps += oldest_held - first
            first = oldest_held
        columns = ring.columns(first, last)
        self._drained = last
        ordered = sorted(columns["step_seconds"])  # (one sort for the summary and the histogram)
        interval = summarize(columns, forward_measured=self.model.timed, ordered=ordered)
        if interval is not None:
            # A detail step's cost, measured where they are paced: the early ones, one in
            # DETAIL_EVERY, run with tuneup's code still in the caches and cost a fraction of
            # what a paced one does (37 µs against 285 µs on the 0.1 ms CPU step). Over the
            # latest pairs of the drains so far, not one drain's: a drain's few pairs of 3 ms
            # steps read 1.07 ms, and paced that far apart no later drain had enough to correct it.
            if first > PACED_FROM_STEP:
                pairs, plain = detail_pairs(columns)
                self._detail_pairs.extend(pairs)
                self._plain_steps.extend(plain)
                cost = detail_cost(self._detail_pairs, self._plain_steps)
                self.detail_cost = cost if cost is not None else self.detail_cost  # (None: DETAIL_COST)
            self.timeline.pace(interval["step_seconds"]["median"], self.detail_cost)
            # The wall-clock end of the last step: its perf_counter close, moved to time.time().
            ended = ring.records[(last - 1) % ring.capacity][0]
            self.totals.add(interval, ordered, time.time() - (time.perf_counter() - ended))
        return interval

    def window(self, steps: int) -> dict[str, Any] | None:
        """The last `steps` closed steps, summarized exactly (from the ring)."""
        ring = self.timeline.ring
        return summarize(ring.columns(ring.count - steps + 1, ring.count), forward_measured=self.model.timed)

    def _steps_event(self, interval: dict[str, Any]) -> dict[str, Any]:
        event = {"event": "steps", "time": time.time(), **interval}
        if self.scaler.seen:
            event["scaler"] = self.scaler.summary()
        if self.syncs.sampled_steps:
            event["syncs"] = self.syncs.summary(top=5)
        event["habits"] = self.habits_summary()
        compiled = self.compile.summary()
        if compiled is not None:
            event["compile"] = compiled
        return event

    def _watch_input(self, interval: dict[str, Any] | None, final: bool) -> None:
        """Start the stack sampler (stacks.py) once the loop's input before the forward is
        INPUT_SAMPLING_SHARE of the detail steps' time, both over the run and on the typical
        detail step of the latest INPUT_WINDOW steps (their medians, as input-in-loop judges;
        at least INPUT_MIN_DETAILED detail steps among them): it names the lines that input is.
        (By the time alone, one detail step descheduled between its fetch and its forward on a
        busy machine started it for a DataLoader loop whose input is a few µs: 384 steps of
        0.2 ms hold ~30 ms of detail steps. By one drain's median, so did a drain that held
        that step alone, ticks 0.1 s apart in a full suite.)"""
        if self.input_lines is not None or final or interval is None:
            return
        sums = self.totals.sums
        if not sums["detailed_seconds"] or sums["input_seconds"] < INPUT_SAMPLING_SHARE * sums["detailed_seconds"]:
            return
        recent = self.window(INPUT_WINDOW)
        if recent is None or recent["detailed_steps"] < INPUT_MIN_DETAILED:
            return
        typical = (recent.get("input_seconds") or {}).get("median")
        step = recent["step_seconds"]["median"]
        if typical is not None and step and typical >= INPUT_SAMPLING_SHARE * step:
            self.input_lines = InputSampler(self.timeline, self.syncs.thread_id)
            self.input_lines.start()

    def habits_summary(self) -> dict[str, Any]:
        return dict(self.habits.summary(), **self.calls.summary(), **self.model.graphs.summary(),
                    amp_trial=self.precision.result, grad_norms=self.gradients.summary(), flops=self.flops.summary(),
                    batch_transfer=self.batch_transfer, main_process_fetches=self.loader.fetch_cpu(),
                    worker_fetches=self.loader.ready_batches(),
                    eval_forwards_with_grad=self.model.eval_with_grad, gc=self.collector.summary(),
                    step_boundary=self.step_boundary(),
                    input_lines=self.input_lines.summary() if self.input_lines is not None else None)

    def step_boundary(self) -> str | None:
        """How the steps were found (hotpath.py StepTimeline: the boundary rule), in words."""
        timeline, classes = self.timeline, self.optimizer.classes
        if classes:
            names = list(dict.fromkeys(classes))
            closure = [name for name in names if name in CLOSURE_OPTIMIZERS]
            text = " and ".join(f"{name}.step()" for name in names)
            if len(classes) > 1:
                text += f" ({len(classes)} optimizers: those stepped in one iteration are one step)"
            if closure:
                text += f": one step each, {' and '.join(closure)}'s closure passes inside it"
            return text
        if timeline.changed_steps:
            at = "a DataLoader fetch" if timeline.fetches else "the next backward"
            return (f"parameters changed with no optimizer step seen (an update inside compiled code, or by "
                    f"hand): {at} after they changed")
        if timeline.hand_steps:
            return ("parameters updated by hand (no optimizer): a forward after a backward whose gradients "
                    "were then used or cleared")
        if timeline.ring.count:
            return "tuneup.step() or @tuneup.step_function"
        return None

    def end_event(self, warnings: list[dict[str, Any]]) -> dict[str, Any]:
        """The run log's last event: the run's totals and cumulative sections."""
        return {"event": "end", "time": time.time(), "totals": self.totals_summary(), "syncs": self.syncs.summary(),
                "scaler": self.scaler.summary(), "habits": self.habits_summary(),
                "learning_rates": self.optimizer.rate_curves(), "warnings": warnings}

    def totals_summary(self) -> dict[str, Any]:
        return dict(self.totals.summary(), device_reads_dropped=self.values.dropped)

    def sample_system(self, final: bool = False) -> dict[str, Any]:
        """The slow probes' sample; `final` (detach): a host probe never started stays so."""
        system: dict[str, Any] = {"time": time.time()}
        on = self.slow_probes_on
        if on["host"] and self.host is None and not final:
            try:
                from .host import HostProbe

                self.host = HostProbe(self.options.window_steps)
            except Exception as exc:
                self.slow_probe_failed("host", exc)
        if on["host"] and self.host is not None:
            try:
                with self.cost.part("host"):
                    system["host"] = self.host.sample(self.loader.worker_pids(), self.timeline.ring.count,
                                                      self.loader.worker_starts)
            except Exception as exc:
                self.slow_probe_failed("host", exc)
        if on["gpu"]:
            try:
                with self.cost.part("gpu"):
                    system["gpu"] = {"available": True, "devices": self.gpus.devices, "samples": self.gpus.sample()}
            except Exception as exc:
                self.slow_probe_failed("gpu", exc)
        if "gpu" not in system:
            reason = self.gpus.reason if not self.gpus.available else "GPU probe turned off after an NVML error"
            system["gpu"] = {"available": False, "reason": reason}
        if on["memory"]:
            try:
                with self.cost.part("memory"):
                    system["memory"] = allocator_stats()
            except Exception as exc:
                self.slow_probe_failed("memory", exc)
        if on["ddp"]:
            try:
                ddp = self.allreduce.sample(self.model.root_models())
                if ddp is not None:
                    system["ddp"] = ddp
            except Exception as exc:
                self.slow_probe_failed("ddp", exc)
        return system

    def probe_failed(self, name: str) -> None:
        """What stops with a failed probe inside the recorder (`fail` hears of it first)."""
        if name == "syncs":
            self.syncs.close()  # the sampled step under way ends here; "off" says why (see warnings)
        elif name == "step_close":
            # No sampled step may stay open without the listener that ends it.
            self.syncs.turn_off(f"stopped: the {name} listener failed")

    def _measure_transfer(self) -> None:
        """Once a DataLoader batch was sampled: what shipping one like it from a worker costs
        (transfer.py), once. On the training thread, between two steps: on another thread the
        resource sharer's replies would wait for the GIL the training thread holds (5 ms
        switches: measured 7.7 ms a batch on the agent thread, 0.4 ms here), where in a real
        worker they come from another process."""
        layout = self.habits.layout
        if layout is None or self.batch_transfer is not None or not self.slow_probes_on["transfer"]:
            return
        try:
            self.batch_transfer = transfer.measure(layout)
        except Exception as exc:
            self.slow_probe_failed("transfer", exc)

    def slow_probe_failed(self, name: str, exc: BaseException) -> None:
        self.slow_probes_on[name] = False
        self.fail(name, exc)

    def _config_inputs(self) -> tuple:
        """What the probes have seen that the configuration is read from: when it changes
        (a new loader, optimizer or model, autocast first seen, apply mode's loader settings),
        the configuration is read."""
        return (
            len(self.loader.loaders), len(self.loader.evaluation_loaders), len(self.optimizer.optimizers),
            len(self.model.roots),
            self.model.autocast, self.optimizer.set_to_none, self.scaler.seen, self.scaler.enabled,
            self.loader.settings_changes,
        )

    def _config_stale(self) -> bool:
        """Whether what the configuration is read from changed since it was last read (while it
        is still read: not after settle_config)."""
        return not self._config_settled and self._config_inputs() != self._config_seen

    def _read_config(self) -> None:
        self._config_seen = self._config_inputs()
        self.refresh_config()

    def settle_config(self) -> None:
        """Read the configuration now, and not again: at detach, before apply mode puts the
        job's own settings back, so the final report's evidence describes the settings the run's
        last steps ran with (a kept num_workers 0 -> 2 read back as num_workers=0 beside the
        waits two workers left)."""
        self.refresh_config()
        self._config_settled = True
        self.collector.settle()  # apply mode's gc.freeze(), if kept: what the run's last steps met

    def note_framework(self, info: dict[str, Any]) -> None:
        """The training framework's own settings (Lightning, Transformers)."""
        self.framework = dict(info)
        self.emit({"event": "framework", "time": time.time(), **self.framework})
        self.refresh_config()

    def refresh_config(self) -> None:
        if not self.slow_probes_on["config"]:
            return
        try:
            config = read_config(
                loaders=[loader for loader in self.loader.loaders if loader not in self.loader.evaluation_loaders],
                evaluation_loaders=list(self.loader.evaluation_loaders),
                optimizers=self.optimizer.in_order(),
                rate_of=self.optimizer.rate_of,
                models=self.model.root_models(),
                leaf_order=self.model.leaf_order,
                autocast=self.model.autocast,
                set_to_none=self.optimizer.set_to_none,
                grad_scaler=self.scaler.summary(),
                cpu_bf16=self.options.cpu_bf16,
                loaders_job_own=dict(self.loader.job_own),
            )
        except Exception as exc:
            if isinstance(exc, RuntimeError) and ("changed size" in str(exc) or "mutated during" in str(exc)):
                return  # a dict or set changed size while the job mutated it: read again next time
            self.slow_probe_failed("config", exc)  # (any other: one warning, not a configuration silently never read)
            return
        if self.config is not None:
            # The job may have dropped its objects (the loop ended): keep what they were.
            # (A loader that turned out to be an evaluation's moved lists: not dropped.)
            for kinds in (("loaders", "evaluation_loaders"), ("optimizers",), ("models",)):
                if not any(config[kind] for kind in kinds):
                    for kind in kinds:
                        config[kind] = self.config[kind]
        if self.framework is not None:
            config["framework"] = self.framework
        if config != self.config:
            self.config = config
            self.emit({"event": "config", "time": time.time(), **config})

    def probe_states(self, failed: Iterable[str]) -> dict[str, str]:
        """Each probe: "on", "off" (turned off after an error: `failed` names those; see the
        warnings) or why it is idle."""
        failed = set(failed)
        names = [probe.name for probe in self.hot_probes] + list(self.slow_probes_on)
        states = {name: "off" if name in failed else "on" for name in names}
        for name in failed:  # listeners and the background sampler
            states.setdefault(name, "off")
        if not self.gpus.available:
            states["gpu"] = "no GPU"
        if not self.options.log:
            states["run_log"] = "turned off (log=False)"
        else:
            states["run_log"] = "off" if "run_log" in failed else "on"
        if self.syncs.off_reason:
            states["syncs"] = self.syncs.off_reason
        elif self.options.sync_sample_every == 0:
            states["syncs"] = "turned off (sync_sample_every=0)"
        return states
