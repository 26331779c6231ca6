"""The records tuneup reads back from outside its own process, and the check each gets where
it enters.

A run log is a file anyone can edit or truncate, or one written by another tuneup version;
`/api/run` may be answered by something that is not tuneup; a node's registry folder is
shared by every user's jobs. Readers past the boundary do arithmetic and formatting on what
they read, so a record is checked against its kind's schema first: `problem(kind, record)`
names the first field that does not fit ("steps.sums.seconds is a string, not a number"),
or returns None. The reader skips a record with a problem, counts it, and names it in one
line of the report; nothing downstream can fail on a record's content.

A schema names the fields readers use. Fields it does not name pass unchecked (a newer
version adds fields; readers reach those with `.get` and a type test). `Opt` marks a field
that may be absent or null; every other named field must be there. Numbers are finite and
within `LIMIT` in size unless a schema says otherwise (losses may be huge or non-finite: that
is a finding, not damage).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

# The run-log schema this version writes (in the run header as "schema"). Bumped when a
# field changes meaning or type; added fields do not bump it.
VERSION = 1

LIMIT = 1e15  # larger is not a measurement (seconds, bytes, counts): it is damage


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (int, float)):
        return repr(value)
    return type(value).__name__


class Spec:
    expected = "a value"
    absent_ok = False  # in an Obj: the field may be missing

    def problem(self, value: Any, path: str) -> str | None:
        raise NotImplementedError

    def _wrong(self, value: Any, path: str) -> str:
        return f"{path} is {_describe(value)}, not {self.expected}"


class Num(Spec):
    """A real number (never a bool), finite and at most LIMIT in size unless `finite=False`,
    at least `low` where given."""

    def __init__(self, low: float | None = None, *, integer: bool = False, finite: bool = True,
                 limit: float = LIMIT) -> None:
        self.low, self.integer, self.finite, self.limit = low, integer, finite, limit
        kind = "a whole number" if integer else "a number"
        self.expected = kind if low is None else f"{kind} >= {low:g}"

    def problem(self, value: Any, path: str) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return self._wrong(value, path)
        if not self.finite and isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, float) and not math.isfinite(value) or abs(value) > self.limit:
            return f"{path} is {_describe(value)}, out of range"
        if self.integer and isinstance(value, float) and not value.is_integer():
            return self._wrong(value, path)
        if self.low is not None and value < self.low:
            return self._wrong(value, path)
        return None


class Str(Spec):
    expected = "a string"

    def __init__(self, max_chars: int = 1 << 20) -> None:
        self.max_chars = max_chars

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str):
            return self._wrong(value, path)
        if len(value) > self.max_chars:
            return f"{path} is a string of {len(value):,} characters, over {self.max_chars:,}"
        return None


class Bool(Spec):
    expected = "true or false"

    def problem(self, value: Any, path: str) -> str | None:
        return None if isinstance(value, bool) else self._wrong(value, path)


class Any_(Spec):
    def problem(self, value: Any, path: str) -> str | None:
        return None


class Opt(Spec):
    """`spec`, or null, or absent (in an Obj)."""

    absent_ok = True

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.expected = f"{spec.expected} or null"

    def problem(self, value: Any, path: str) -> str | None:
        return None if value is None else self.spec.problem(value, path)


class Nullable(Opt):
    """`spec` or null, and there (the key itself is read)."""

    absent_ok = False


class Omissible(Spec):
    """`spec` (never null), or absent (readers default it: older logs lack it)."""

    absent_ok = True

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.expected = spec.expected

    def problem(self, value: Any, path: str) -> str | None:
        return self.spec.problem(value, path)


class OneOf(Spec):
    def __init__(self, *specs: Spec) -> None:
        self.specs = specs
        self.expected = " or ".join(spec.expected for spec in specs)

    def problem(self, value: Any, path: str) -> str | None:
        problems = [spec.problem(value, path) for spec in self.specs]
        return None if None in problems else self._wrong(value, path)


class ListOf(Spec):
    def __init__(self, item: Spec, max_items: int = 100_000, min_items: int = 0) -> None:
        self.item, self.max_items, self.min_items = item, max_items, min_items
        self.expected = "a list"

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, list):
            return self._wrong(value, path)
        if len(value) > self.max_items:
            return f"{path} has {len(value):,} items, over {self.max_items:,}"
        if len(value) < self.min_items:
            return f"{path} has {len(value):,} items, under {self.min_items:,}"
        for index, item in enumerate(value):
            found = self.item.problem(item, f"{path}[{index}]")
            if found:
                return found
        return None


class MapOf(Spec):
    """An object with any keys, every value fitting `value`."""

    def __init__(self, value: Spec) -> None:
        self.value = value
        self.expected = "an object"

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, dict):
            return self._wrong(value, path)
        for key, item in value.items():
            found = self.value.problem(item, f"{path}.{key}")
            if found:
                return found
        return None


class Obj(Spec):
    """An object with these fields (others pass unchecked)."""

    expected = "an object"

    def __init__(self, **fields: Spec) -> None:
        self.fields = fields

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, dict):
            return self._wrong(value, path)
        for name, spec in self.fields.items():
            where = f"{path}.{name}" if path else name
            if name not in value:
                if spec.absent_ok:
                    continue
                return f"{where} is missing"
            found = spec.problem(value[name], where)
            if found:
                return found
        return None


# --- the pieces ----------------------------------------------------------------------------

NUM = Num()
SECONDS = Num(0)  # also any other non-negative amount: bytes, ratios, rates
COUNT = Num(0, integer=True)
TEXT = Str()
FLAG = Bool()
LOSS = Num(finite=False, limit=1e300)  # a diverging loss is data: huge, nan and inf are kept
ANY = Any_()
RANK = Num(0, integer=True)
SCALE = Num(1e-300)  # a GradScaler's scale: positive (its plot is on a log axis)


def _maybe(**fields: Spec) -> Obj:
    """An object whose fields may each be absent or null."""
    return Obj(**{name: Opt(spec) for name, spec in fields.items()})


DIST = Obj(median=Nullable(SECONDS), mean=SECONDS)
STEP_DIST = Obj(median=SECONDS, mean=SECONDS, p90=SECONDS, min=SECONDS, max=SECONDS)
PART = Opt(DIST)

SUMS = Obj(
    steps=COUNT, seconds=SECONDS, data_wait_seconds=SECONDS, samples=COUNT, optimizer_steps=COUNT,
    skipped_steps=COUNT, sync_sampled_steps=COUNT, syncs=SECONDS, detailed_steps=COUNT, detailed_seconds=SECONDS,
    last_loss=Nullable(LOSS),
    # Absent in logs from before each was added (readers default them to 0).
    **{name: Omissible(COUNT) for name in ("fetches", "losses_read", "nonfinite_losses", "evaluations",
                                           "unsampled_steps")},
    **{name: Omissible(SECONDS) for name in ("detailed_data_wait_seconds", "detailed_other_seconds", "evaluation_seconds",
                                             "own_seconds", "input_seconds", "forward_seconds", "backward_seconds",
                                             "optimizer_seconds")},
)

LOSS_SUMMARY = Obj(last=LOSS, median=Opt(LOSS), max=Opt(LOSS), read_steps=COUNT, nonfinite_steps=COUNT,
                   spikes=Opt(COUNT), trend=Opt(LOSS))  # spikes: older logs (loss spikes, no longer judged)

SOURCE = Obj(location=TEXT, function=TEXT, kind=TEXT, per_step=Opt(SECONDS), steps=Opt(COUNT), out_of=Opt(COUNT))
PHASE_SOURCE = Obj(location=TEXT, function=TEXT, kind=TEXT, per_phase=SECONDS)
# Every field is written (null where not measured): measure/syncs.py Syncs.summary.
SYNCS = Obj(measured=FLAG, backend=Nullable(TEXT), meaning=TEXT, sampled_steps=COUNT,
            per_step=Nullable(SECONDS), max_per_step=Nullable(SECONDS), by_kind=MapOf(SECONDS),
            top_sources=ListOf(SOURCE), unattributed_per_step=Nullable(SECONDS), off_reason=Nullable(TEXT),
            evaluation=Opt(_maybe(phases=COUNT, per_phase=SECONDS, top_sources=ListOf(PHASE_SOURCE))))

# Every field is written (null where unknown): measure/scaler.py ScalerProbe.summary.
SCALER = Obj(present=FLAG, enabled=Nullable(FLAG), scale=Nullable(SCALE),
             **{name: Nullable(COUNT) for name in ("steps", "skipped_steps", "longest_skip_run", "growth_events",
                                                   "backoff_events")},
             skip_rate=Nullable(SECONDS))

LOCATED = Obj(location=TEXT)
# torch.compile's work so far (measure/compiled.py)
COMPILE = Obj(compiles=COUNT, seconds=SECONDS, graphs=COUNT, recompiles=COUNT, graph_breaks=COUNT,
              recompile_sites=ListOf(Obj(where=TEXT, count=COUNT, guard=TEXT)),
              graph_break_sites=ListOf(Obj(where=TEXT, count=COUNT, reason=TEXT)))
# What autocast would save, timed once on the job's model (measure/precision.py)
AMP_TRIAL = _maybe(skipped=TEXT, device=TEXT, dtype=TEXT, model=TEXT, pairs=COUNT, faster_pairs=COUNT, fp32_seconds=SECONDS,
                   reduced_seconds=SECONDS, speedup=SECONDS)
# The gradient norms the updates used, on sampled steps (measure/gradients.py)
GRAD_NORMS = _maybe(skipped=TEXT, samples=COUNT, spikes=COUNT, nonfinite=COUNT, series=COUNT, median=LOSS,
                    p90=LOSS, seconds=SECONDS, largest_ratio=LOSS, largest_norm=LOSS, median_before=LOSS,
                    largest_step=COUNT)
# What shipping a batch from a worker costs (measure/transfer.py), and the main process's fetches
BATCH_TRANSFER = _maybe(main_seconds=SECONDS, worker_seconds=SECONDS, bytes=COUNT, tensors=COUNT, reps=COUNT)
MAIN_FETCHES = _maybe(timed=COUNT, seconds=SECONDS, cpu_share=SECONDS, core_wait_share=SECONDS)
WORKER_FETCHES = _maybe(checked=COUNT, ready_share=SECONDS, queue_fill=SECONDS, unready_wait_seconds=SECONDS)
# A training step's FLOPs, counted on the model's shapes (measure/flops.py): past LIMIT for a
# large model (a 7B language model's step on 32k tokens is 1.4e15), so bounded apart.
FLOP_COUNT = Num(0, limit=1e30)
FLOPS = _maybe(skipped=TEXT, stopped=TEXT, model=TEXT, forward_flops=FLOP_COUNT, backward_flops=FLOP_COUNT,
               flops=FLOP_COUNT,
               batch=COUNT, dtype=TEXT, device=TEXT, device_name=TEXT, counts=COUNT, seconds=SECONDS,
               flops_by_kind=MapOf(FLOP_COUNT), precisions=MapOf(TEXT), capability=ListOf(COUNT, max_items=2),
               top_modules=ListOf(Obj(module=TEXT, flops=FLOP_COUNT, share=SECONDS, count=Opt(COUNT), **{"class": Opt(TEXT)}),
                                  max_items=100))
# Python's garbage collections from the first step on, by generation (measure/gc_pauses.py)
BY_GENERATION = 3
GC = Obj(collections=ListOf(COUNT, max_items=BY_GENERATION, min_items=BY_GENERATION),
         seconds=ListOf(SECONDS, max_items=BY_GENERATION, min_items=BY_GENERATION),
         **_maybe(full_median_seconds=SECONDS, full_max_seconds=SECONDS, full_steps=ListOf(COUNT, max_items=64),
                  frozen=COUNT, enabled=FLAG, thresholds=ListOf(COUNT, max_items=BY_GENERATION)).fields)
HABITS = _maybe(
    amp_trial=AMP_TRIAL, gc=GC, flops=FLOPS, grad_norms=GRAD_NORMS, batch_transfer=BATCH_TRANSFER, main_process_fetches=MAIN_FETCHES,
    worker_fetches=WORKER_FETCHES,
    batches=_maybe(inspected=COUNT, devices=ListOf(TEXT), distinct_shapes=COUNT, shape_changes=COUNT,
                   pin_checked=COUNT, pinned=COUNT,
                   inputs=Obj(dtype=Opt(TEXT), shape=Opt(ListOf(COUNT)), mean=NUM, std=SECONDS,
                              abs_max=Opt(SECONDS))),
    input_lines=Obj(samples=Opt(COUNT), top_lines=Opt(ListOf(Obj(function=TEXT, location=TEXT, loop_line=Opt(TEXT),
                                                                share=SECONDS)))),
    step_boundary=TEXT, watched_steps=COUNT, clip_grad_calls=COUNT, clip_grad_calls_per_step=SECONDS,
    eval_forwards_with_grad=COUNT, training_forwards_watched=COUNT, training_forwards_unused=COUNT,
    unused_forward_models=MapOf(COUNT),
    file_writes=COUNT, file_writes_per_step=SECONDS, file_write_seconds_per_step=SECONDS,
    file_write_sources=ListOf(LOCATED),
    numpy_copies=COUNT, numpy_copies_in_loader=COUNT, numpy_copies_per_step=SECONDS, numpy_copy_seconds=SECONDS,
    numpy_copy_seconds_per_step=SECONDS, numpy_copy_sources=ListOf(LOCATED),
)

STEPS = Obj(
    steps=Num(1, integer=True), first_step=COUNT, last_step=COUNT, time=Opt(NUM), seconds=SECONDS,
    step_seconds=STEP_DIST, stall_ratio=Nullable(SECONDS), steps_per_second=Nullable(SECONDS),
    samples_per_second=Nullable(SECONDS), detailed_steps=COUNT, sums=SUMS,
    gpu_seconds=Opt(Obj(median=Opt(SECONDS), mean=SECONDS, p90=SECONDS, min=SECONDS, max=SECONDS)),
    loss=Opt(LOSS_SUMMARY), data_wait_seconds=Opt(DIST),
    **{name: PART for name in ("input_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds",
                               "other_seconds")},
    **{name: Opt(SECONDS) for name in ("batch_size", "fetches_per_step", "syncs_per_step", "backward_passes_per_step",
                                       "input_ratio", "forward_ratio", "backward_ratio", "optimizer_ratio",
                                       "other_ratio")},
    **{name: Opt(COUNT) for name in ("optimizer_steps", "skipped_steps", "sync_sampled_steps")},
    evaluation=Opt(ANY), syncs=Opt(SYNCS), scaler=Opt(SCALER), habits=Opt(HABITS), compile=Opt(COMPILE),
)

RUN = Obj(
    schema=Opt(Num(1, integer=True)), run_id=TEXT, training_job=Opt(TEXT), tuneup=Opt(TEXT),
    started_at=Opt(NUM), pid=Opt(COUNT), host=Opt(TEXT), node=Opt(COUNT), rank=Opt(RANK), local_rank=Opt(RANK),
    world_size=Opt(Num(1, integer=True)), argv=Opt(ListOf(TEXT)), python=Opt(TEXT), torch=Opt(TEXT),
    mode=Opt(TEXT), url=Opt(TEXT), time=Opt(NUM), options=Opt(MapOf(ANY)), run_dir=Opt(TEXT),
    continued=Opt(FLAG),
)

DEVICE = Obj(gpu=COUNT, throttle_reasons=Opt(ListOf(TEXT)), temperature_celsius=Opt(NUM),
             **{name: Nullable(SECONDS) for name in ("utilization_ratio", "memory_used_bytes", "memory_total_bytes")},
             **{name: Opt(SECONDS) for name in ("power_watts", "power_limit_watts", "sm_clock_hz", "sm_clock_max_hz",
                                                "process_memory_bytes")})
HOST = Obj(usable_cores=SECONDS, torch_threads=COUNT, rss_bytes=SECONDS,
           **{name: Opt(SECONDS) for name in ("cpu_ratio", "busy_cores", "workers_cpu_ratio", "wait_cores",
                                              "workers_wait_cores", "workers_rss_bytes", "load_1m",
                                              "memory_available_bytes", "step_cpu_wait_seconds")},
           threads=Opt(COUNT), workers=Opt(COUNT), worker_processes=Opt(ListOf(ANY)))
MEMORY_DEVICE = Obj(device=ANY, allocated_bytes=Nullable(SECONDS), allocated_peak_bytes=Nullable(SECONDS),
                    reserved_bytes=SECONDS, reserved_peak_bytes=SECONDS, total_bytes=Num(1),
                    alloc_retries=COUNT, ooms=COUNT)
SYSTEM = Obj(time=Opt(NUM), host=Opt(HOST),
             gpu=Opt(Obj(available=Opt(FLAG), reason=Opt(TEXT), samples=Opt(ListOf(DEVICE)))),
             memory=Opt(Obj(available=Opt(FLAG), devices=Opt(ListOf(MEMORY_DEVICE)))),
             ddp=Opt(_maybe(allreduce_wait_seconds=SECONDS)))

LOADER = Obj(num_workers=COUNT, prefetch_factor=Opt(COUNT), batch_size=Opt(COUNT), pin_memory=FLAG,
             persistent_workers=FLAG, set_by_tuneup=Opt(MapOf(ANY)))  # (apply mode's settings: the job's own values)
LR_MEASURED = _maybe(changes=COUNT, first=NUM, min=NUM, max=NUM, last=NUM, reads=COUNT)
OPTIMIZER = Obj(**{"class": TEXT}, implementation=TEXT, models=Opt(ListOf(TEXT)), parameters=Opt(COUNT),
                lr_scheduler=Nullable(ANY), lr_measured=Opt(LR_MEASURED), lr=Opt(NUM), devices=Opt(ListOf(TEXT)))
MODEL = Obj(**{"class": TEXT}, parameters=COUNT, dtypes=MapOf(COUNT), devices=ListOf(TEXT),
            convolutions=Opt(COUNT), parallel=Opt(TEXT), conv_bias_before_batchnorm=Opt(ListOf(TEXT)),
            not_multiple_of_8=Opt(ListOf(Obj(module=TEXT, type=TEXT))))
CUDA_DEVICE = Obj(name=TEXT, capability=ListOf(COUNT, max_items=2), tensor_cores=Opt(FLAG), bf16=Opt(FLAG))
CONFIG = Obj(
    loaders=ListOf(LOADER), optimizers=ListOf(OPTIMIZER), models=ListOf(MODEL),
    autocast=Opt(MapOf(Opt(TEXT))), zero_grad_set_to_none=Nullable(FLAG),
    backends=Obj(cudnn_benchmark=FLAG, cudnn_deterministic=Opt(FLAG), float32_matmul_precision=Opt(TEXT),
                 matmul_allow_tf32=Opt(FLAG), cudnn_allow_tf32=Opt(FLAG)),
    hardware=Opt(Obj(cuda_devices=Opt(ListOf(CUDA_DEVICE)), cpu_bf16=Opt(FLAG))),
    debug=Opt(_maybe(anomaly_detection=FLAG, profiler=FLAG)),
    distributed=Opt(Obj(initialized=Opt(FLAG))),
    framework=Opt(_maybe(framework=TEXT)),
)

WARNING = Obj(message=TEXT)

WINDOW_RATES = _maybe(mean_step_seconds=SECONDS, samples_per_second=SECONDS, steps_per_second=SECONDS)
ACTION = Obj(id=Opt(OneOf(TEXT, NUM)), action=Opt(TEXT), title=Opt(TEXT), change=Opt(TEXT), decision=TEXT,
             reason=Opt(TEXT), speedup=Opt(SECONDS), undone=Opt(Obj(reason=TEXT)), slower=Opt(FLAG),
             baseline=Opt(WINDOW_RATES), trial=Opt(WINDOW_RATES))

END = Obj(totals=Opt(Obj(steps=COUNT, seconds=SECONDS, evaluation=Opt(ANY))), syncs=Opt(SYNCS),
          scaler=Opt(SCALER), habits=Opt(HABITS),
          # [step, learning rate] where it changed, per optimizer
          learning_rates=Opt(ListOf(Obj(optimizer=Opt(ANY), curve=ListOf(ListOf(SECONDS, max_items=2))))))

# A run log's events, and the same events in a live agent's /api/run.
EVENTS: Mapping[str, Spec] = {"run": RUN, "config": CONFIG, "system": SYSTEM, "steps": STEPS,
                              "warning": WARNING, "action": ACTION, "end": END}

# A node registry entry (export/discovery.py).
REGISTRY_ENTRY = Obj(pid=Num(1, integer=True), url=Opt(TEXT), run_id=Opt(TEXT), run_dir=Opt(TEXT),
                     rank=Opt(RANK), local_rank=Opt(RANK), argv=Opt(ListOf(TEXT)), started_at=Opt(NUM),
                     host=Opt(TEXT), group=Opt(TEXT), mode=Opt(TEXT), pid_namespace=Opt(OneOf(TEXT, NUM)))

# A live agent's /api/run (export/server.py): its events (each checked as a run-log event by
# the reader, so that one bad event costs only itself) and its current findings.
AGENT_RUN = Obj(events=ListOf(ANY, max_items=1_000_000), attached=Opt(FLAG),
                findings=Opt(Obj(findings=Opt(ListOf(Obj(rule=TEXT))))))

# A node daemon's /api/run (export/daemon.py): each job's registry entry and its agent's
# answer (a payload that does not fit AGENT_RUN is shown as not answering).
DAEMON_RUN = Obj(daemon=FLAG, jobs=ListOf(Obj(run_id=Opt(TEXT), group=Opt(OneOf(TEXT, NUM)), path=TEXT,
                                              agent=Opt(REGISTRY_ENTRY), payload=Opt(ANY), error=Opt(TEXT))))


def problem(event: Any) -> str | None:
    """The first thing in a run event that does not fit its kind's schema, in one phrase; None
    when it fits or its kind is not one the readers use (a newer version's: passed over)."""
    if not isinstance(event, dict):
        return f"the record is {_describe(event)}, not an object"
    kind = event.get("event")
    if not isinstance(kind, str):
        return f"its event kind is {_describe(kind)}, not a string"
    spec = EVENTS.get(kind)
    return None if spec is None else spec.problem(event, kind)


def notes(what: str, source: str, skipped: int, examples: list[str], events: list[dict[str, Any]]) -> list[str]:
    """A report's note lines for records read from `source`: how many `what` (lines, events)
    were skipped, the first `examples` named; and a header from a newer schema."""
    out = []
    if skipped:
        more = "; ..." if skipped > len(examples) else ""
        out.append(f"{skipped} unreadable {what} of {source} skipped ({'; '.join(examples)}{more})")
    header = next((event for event in events if event.get("event") == "run"), None)
    said = header and newer(header)
    if said:
        out.append(f"{source}: {said}")
    return out


def newer(header: Mapping[str, Any]) -> str | None:
    """One line when a run header says a newer tuneup wrote the log, else None."""
    version = header.get("schema")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        return (f"the run log was written by tuneup {header.get('tuneup', '?')} with log schema {version}, newer "
                f"than this tuneup's {VERSION}: what this version does not know is left out (pip install -U tuneup)")
    return None
