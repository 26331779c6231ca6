"""What a rule is, what it reads, and what it produces.

A rule is a function of `Facts` (a run's measurements, see `measure.history`) registered
with `@rule(...)`: its stable id, title, severity, a documented threshold with the reason
for it, whether tuneup can apply the fix, and a doc link. It returns `Evidence` when its
threshold is crossed and None when not; when an input it needs was not measured (no GPU,
no model seen, too few steps) it raises `Missing` through the Facts accessors and stays
silent. The engine turns Evidence into a `Finding`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

SEVERITIES = ("high", "medium", "low")
MIN_STEPS = 20  # fewer measured steps than this: too little to judge a rate or a share
# A fix measured to save less than this share of the step is not worth a finding (a finding
# that would save nothing is noise): the rule counts as passed, its gain kept in `slight`.
MIN_GAIN = 0.01


class Missing(Exception):
    """A rule's input was not measured (or does not apply: no CUDA, one rank): the rule stays
    silent, and the report says why with the message, what was wanted ("a CUDA job")."""


@dataclass(frozen=True)
class Evidence:
    """What a rule measured. `observed` reads as a sentence with the numbers; `gain` is the
    estimated share of step time the fix can save (0-1), derived from the measurement, or
    None where it cannot be derived (then `gain_text` says what the fix buys)."""

    observed: str
    numbers: dict[str, Any]
    fix: str
    gain: float | None = None
    gain_text: str | None = None
    severity: str | None = None  # overrides the rule's default (e.g. a larger stall)
    # Overrides the rule's can_apply: False where apply mode's action would refuse this job.
    can_apply: bool | None = None


@dataclass(frozen=True)
class Finding:
    rule: str
    title: str
    severity: str
    observed: str
    threshold: str
    evidence: dict[str, Any]
    gain: float | None
    gain_text: str
    fix: str
    can_apply: bool
    doc: str
    rank: int | None = None  # the distributed rank it was measured on

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    severity: str
    inputs: str
    threshold: str
    why: str
    doc: str
    can_apply: bool
    check: Callable[["Facts"], Evidence | None] = field(repr=False, compare=False)

    def finding(self, evidence: Evidence, rank: int | None = None) -> Finding:
        if evidence.gain is not None:
            gain_text = evidence.gain_text or f"up to {100 * evidence.gain:.0f}% shorter steps"
        else:
            gain_text = evidence.gain_text or "not measurable from step times alone"
        return Finding(
            rule=self.id,
            title=self.title,
            severity=evidence.severity or self.severity,
            observed=evidence.observed,
            threshold=self.threshold,
            evidence=evidence.numbers,
            gain=evidence.gain,
            gain_text=gain_text,
            fix=evidence.fix.strip("\n"),
            can_apply=self.can_apply if evidence.can_apply is None else evidence.can_apply and self.can_apply,
            doc=self.doc,
            rank=rank,
        )


RULES: dict[str, Rule] = {}


def rule(*, id: str, title: str, severity: str, inputs: str, threshold: str, why: str, doc: str,
         can_apply: bool = False) -> Callable[[Callable[["Facts"], Evidence | None]], Rule]:
    """Register a rule function under a stable id."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}")

    def register(check: Callable[["Facts"], Evidence | None]) -> Rule:
        if id in RULES:
            raise ValueError(f"rule id {id!r} registered twice")
        RULES[id] = Rule(id, title, severity, inputs, threshold, why, doc, can_apply, check)
        return RULES[id]

    return register


class Facts:
    """Typed, checked access to a run's measurements (the snapshot shape): every accessor
    raises Missing when what it returns was not measured."""

    def __init__(self, snapshot: dict[str, Any], ranks: Iterable[dict[str, Any]] = ()) -> None:
        self.snapshot = snapshot
        self.ranks = list(ranks)  # other ranks' snapshots of the same job (straggler rule)

    @staticmethod
    def need(value: Any, what: str) -> Any:
        if value is None:
            raise Missing(what)
        return value

    @property
    def window(self) -> dict[str, Any]:
        window = self.snapshot.get("window")
        if not window or window.get("steps", 0) < MIN_STEPS:
            raise Missing(f"{MIN_STEPS} measured steps")
        return window

    @property
    def config(self) -> dict[str, Any]:
        return self.need(self.snapshot.get("config"), "the job's configuration")

    @property
    def host(self) -> dict[str, Any]:
        return self.need((self.snapshot.get("system") or {}).get("host"), "host samples")

    @property
    def habits(self) -> dict[str, Any]:
        habits = self.snapshot.get("habits")
        if not habits:
            raise Missing("a watched step")
        return habits

    @property
    def compiled(self) -> dict[str, Any]:
        """torch.compile's work in the job (measure/compiled.py)."""
        return self.need(self.snapshot.get("compile"), "a job that uses torch.compile")

    @property
    def totals(self) -> dict[str, Any]:
        return self.snapshot.get("totals") or {}

    @property
    def framework(self) -> str | None:
        """The training framework whose settings the job's speed is set through: "lightning",
        "transformers" or "accelerate" (its integration's `framework` event), or None."""
        return ((self.snapshot.get("config") or {}).get("framework") or {}).get("framework")

    def spoken(self, plain: str, **by_framework: str) -> str:
        """A fix in the job's own framework's words where it owns the setting, else `plain`."""
        return by_framework.get(self.framework or "", plain)

    def tuneups(self, action: str) -> dict[str, Any] | None:
        """Apply mode's change of kind `action` that the last steps ran with (on trial, or kept
        and not undone before detach: detach undoes every change after the last step), or None:
        what the configuration shows of it is tuneup's doing, not the job's."""
        for record in reversed(self.snapshot.get("actions") or []):
            undone = record.get("undone")
            if record.get("action") == action and record.get("decision") in ("trying", "kept") \
                    and (not undone or undone.get("reason") == "detach"):
                return record
        return None

    @property
    def scaler(self) -> dict[str, Any]:
        return self.snapshot.get("scaler") or {"present": False}

    @property
    def syncs(self) -> dict[str, Any]:
        syncs = self.snapshot.get("syncs") or {}
        if not syncs.get("measured") or syncs.get("per_step") is None:
            raise Missing("sampled host-device syncs")
        return syncs

    @property
    def gpus(self) -> list[dict[str, Any]]:
        """Per-GPU means over the recent NVML samples."""
        history = self.snapshot.get("gpu_history") or {}
        devices = history.get("devices")
        if not devices:
            raise Missing("NVML GPU samples")
        return devices

    @property
    def allocator(self) -> list[dict[str, Any]]:
        memory = (self.snapshot.get("system") or {}).get("memory") or {}
        if not memory.get("available") or not memory.get("devices"):
            raise Missing("CUDA allocator figures")
        return memory["devices"]

    @property
    def models(self) -> list[dict[str, Any]]:
        models = self.config.get("models")
        if not models:
            raise Missing("a model seen training")
        return models

    @property
    def optimizers(self) -> list[dict[str, Any]]:
        optimizers = self.config.get("optimizers")
        if not optimizers:
            raise Missing("an optimizer")
        return optimizers

    @property
    def loaders(self) -> list[dict[str, Any]]:
        loaders = self.config.get("loaders")
        if not loaders:
            raise Missing("a DataLoader")
        return loaders

    @property
    def on_cuda(self) -> bool:
        """Whether the job trains on CUDA devices (its parameters or batches are there)."""
        config = self.snapshot.get("config") or {}
        devices: set[str] = set()
        for entry in (config.get("models") or []) + (config.get("optimizers") or []):
            devices.update(entry.get("devices") or ())
        batches = (self.snapshot.get("habits") or {}).get("batches") or {}
        devices.update(batches.get("devices") or ())
        return "cuda" in devices

    @property
    def reduced_precision(self) -> str | None:
        """The autocast dtype in use (or the model's own half dtype), else None."""
        return self._precision(job_only=False)

    @property
    def job_precision(self) -> str | None:
        """reduced_precision as the job itself wrote it: less an autocast apply mode switched
        on (an AMP change on trial or kept, undone since or not: at detach every change is
        undone, and the configuration read the autocast in the forwards it wrapped; a trial
        cut short at detach or undone in the last steps too: the autocast is read at forwards)."""
        return self._precision(job_only=True)

    def _precision(self, job_only: bool) -> str | None:
        # (The AMP action is never tried on a job with an autocast of its own: amp_refusal.)
        ours = job_only and any(record.get("action") == "amp" and record.get("applied_step") is not None
                                for record in self.snapshot.get("actions") or [])
        autocast = {} if ours else (self.snapshot.get("config") or {}).get("autocast") or {}
        for dtype in autocast.values():
            if dtype:
                return dtype
        for model in (self.snapshot.get("config") or {}).get("models") or []:
            for dtype in (model.get("dtypes") or {}):
                if dtype in ("float16", "bfloat16"):
                    return dtype
        return None
