"""A readable summary of what the agent measured (a snapshot), for terminals."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ..format import flops as flop_text, percent, plural, read_rate, seconds, set_by_apply_mode, size
from ..measure.history import nvml_utilization


def _rate(value: float | None, unit: str) -> str:
    return "–" if value is None else f"{value:,.1f} {unit}"


STEP_PARTS = (("data_wait", "data wait"), ("input", "input (your loop)"), ("forward", "forward"),
              ("backward", "backward"), ("optimizer", "optimizer"), ("other", "other (your loop)"))


def step_parts(window: dict[str, Any]) -> list[tuple[str, str, float | None, float | None]]:
    """(key, label, median seconds, share of step time) for each part of a step; the data
    wait's share is the stall ratio."""
    rows = []
    for key, label in STEP_PARTS:
        entry = window.get(f"{key}_seconds")
        share = window["stall_ratio"] if key == "data_wait" else window.get(f"{key}_ratio")
        rows.append((key, label, entry["median"] if entry else None, share))
    return rows


def step_table(window: dict[str, Any]) -> Group:
    title = Text(f"Where a step's time goes (last {window['steps']} steps; the split from the "
                 f"{window['detailed_steps']} detail steps among them)")
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("part")
    table.add_column("median", justify="right")
    table.add_column("share of step time", justify="right")
    step = window["step_seconds"]
    table.add_row("step", seconds(step["median"]), f"p90 {seconds(step['p90'])}")
    for key, label, middle, share in step_parts(window):
        style = "bold red" if key == "data_wait" and share and share >= 0.1 else None
        table.add_row(Text(label, style=style), seconds(middle), Text(percent(share), style=style))
    return Group(title, table)


CHANGE_COLUMNS = ("#", "change", "decision", "mean step before", "mean step after", "speed-up", "GPU energy a step",
                  "why")


def energy_change(record: dict[str, Any]) -> str:
    """The GPUs' joules a step before and after a change (NVML's energy counters read at both
    ends of each window), or "–" where they were not read."""
    energy = record.get("energy")
    if not isinstance(energy, dict) or not energy.get("before_joules_per_step"):
        return "–"
    return (f"{energy['before_joules_per_step']:.3g} J -> {energy['after_joules_per_step']:.3g} J "
            f"({energy['ratio']:.2f}x)")


def change_rows(actions: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Apply mode's records as table rows (CHANGE_COLUMNS): one per change tried, and one per
    finding it declined to act on. Step times are the windows' means, whose ratio is the
    speed-up (throughput; the medians are in the record)."""
    rows = []
    for record in actions:
        baseline, trial = record.get("baseline") or {}, record.get("trial") or {}
        decision, note = _decision(record)
        if note:
            decision += f" ({note})"
        speedup = record.get("speedup")
        rows.append((str(record.get("id", "")), record.get("change") or f"{record['action']}: {record['title']}",
                     decision, seconds(baseline.get("mean_step_seconds")), seconds(trial.get("mean_step_seconds")),
                     "–" if speedup is None else f"{speedup:.2f}x", energy_change(record), record.get("reason", "")))
    return rows


# The record's decision, as a user reads it once: a trial that did not show a gain was "not
# kept" (nothing was wrong with it); one that made steps slower was "undone".
SPOKEN_DECISIONS = {"reverted": "not kept"}


def _decision(record: dict[str, Any]) -> tuple[str, str | None]:
    """The decision, and what happened to the change since, if anything worth saying (every
    change is undone at detach: that is not)."""
    decision = record["decision"]
    slower = record.get("slower")
    if slower is None:  # a run log from before the judge's flag: the reason's first words said it
        slower = "slower" in str(record.get("reason", "")).split("(")[0]
    if decision == "reverted" and slower:
        decision = "undone"
    decision = SPOKEN_DECISIONS.get(decision, decision)
    if decision in ("kept", "set at start") and record.get("applied_step"):
        # In effect from the first step that ran with it (a numerics change: the steps from
        # which the run differs from one without tuneup); the step after the close it was
        # applied at, in records from before they said.
        decision += f" from step {record.get('effective_step') or record['applied_step'] + 1}"
    undone = record.get("undone")
    if not undone or undone["reason"] == "detach":
        return decision, None
    return decision, f"undone by {undone['reason']}"


CAN_APPLY = "a safe change: tuneup's apply mode can make it as a measured experiment"


def apply_line(finding: dict[str, Any]) -> str | None:
    """A finding's line on apply mode: what it did about the finding in this run (its
    change's record: report/document.py apply_outcome), else whether it can; None: neither."""
    outcome = finding.get("applied")
    if outcome is None:
        return CAN_APPLY if finding.get("can_apply") else None
    decision, note = _decision(outcome)
    change, reason = outcome.get("change"), outcome.get("reason")
    if outcome["decision"] in ("kept", "set at start"):
        if note:  # undone before detach (revert_all(), a rollback)
            return f"apply mode made it (change {outcome['id']}): {change}, {decision}: {reason}; {note}"
        return (f"apply mode made it (change {outcome['id']}): {change}, {decision}: {reason}. "
                "It lasts until detach: write it into the job to keep it")
    if change:
        return f"apply mode tried it (change {outcome['id']}): {change}, {decision}: {reason}"
    return f"apply mode did not make it ({decision}): {reason}"


def net_change(actions: list[dict[str, Any]]) -> str | None:
    """Before the first change against after the last kept one, for the report's headline."""
    decided = [record for record in actions if record.get("baseline") and record.get("trial")]
    kept = [record for record in decided if record["decision"] == "kept"]
    if not kept:
        return None
    before, after = decided[0]["baseline"], kept[-1]["trial"]
    # Trials detach ended before they had measured anything are not among those judged.
    cut = sum(1 for record in actions if record.get("decision") == "reverted" and not record.get("trial")
              and str(record.get("reason", "")).endswith("before the trial ended"))
    more = f" ({cut} more cut short before {'its' if cut == 1 else 'their'} trial ended)" if cut else ""
    line = (f"Kept {len(kept)} of {len(decided)} changes tried{more}: mean step time "
            f"{seconds(before['mean_step_seconds'])} -> {seconds(after['mean_step_seconds'])} "
            f"({before['mean_step_seconds'] / after['mean_step_seconds']:.2f}x the throughput)")
    rate = "samples_per_second" if before.get("samples_per_second") else "steps_per_second"
    if before.get(rate) and after.get(rate):
        line += f", {before[rate]:,.0f} -> {after[rate]:,.0f} {rate.split('_per_')[0]}/s"
    return line


def changes_group(actions: list[dict[str, Any]]) -> Group:
    """Apply mode's changes for a terminal: one line each, the decision first."""
    styles = {"kept": "bold green", "set at start": "bold green", "rolled back": "bold red", "failed": "bold red",
              "undone": "bold red", "trying": "bold yellow"}
    parts: list[Any] = [Text("Changes tuneup made (apply mode)", style="bold")]
    for record, (number, change, _, before, after, _, energy, why) in zip(actions, change_rows(actions)):
        decision, note = _decision(record)
        line = Text(f"{number}. ")
        line.append(decision, style=styles.get(decision.split(" from step")[0], "bold"))
        line.append(f"  {change}")
        if before != "–":
            line.append(f": mean step {before} -> {after}")
        if energy != "–":
            line.append(f", GPU energy a step {energy}")
        line.append(f", {why}" if why else "")
        if note:
            line.append(f"; {note}", style="dim")
        parts.append(Padding(line, (0, 0, 0, 2)))
    net = net_change(actions)
    if net:
        parts.append(Text(net, style="bold green"))
    return Group(*parts)


def sync_lines(syncs: dict[str, Any]) -> list[str]:
    if not syncs.get("measured") or not isinstance(syncs.get("per_step"), (int, float)):
        # (A record may say measured with no rate: the schema lets per_step be null.)
        reason = syncs.get("off_reason") or "no step was sampled"
        return [f"Host-device syncs: not measured ({reason})"]
    lines = [f"Host-device syncs: {syncs['per_step']:.1f} per step ({syncs['meaning']}, "
             f"{plural(syncs['sampled_steps'], 'sampled step')})"]
    for source in syncs["top_sources"][:6]:
        lines.append(f"    {read_rate(source):>8}  {source['kind']:<8} {source['location']}  in {source['function']}()")
    evaluation = syncs.get("evaluation")
    if isinstance(evaluation, dict) and evaluation.get("phases"):
        lines.append(f"  in evaluation phases (not counted above): {evaluation['per_phase']:.1f} per phase "
                     f"({evaluation['phases']} sampled)")
        for source in evaluation.get("top_sources", [])[:3]:
            lines.append(f"    {source['per_phase']:4.1f}/phase {source['kind']:<8} {source['location']}  "
                         f"in {source['function']}()")
    return lines


def evaluation_line(evaluation: dict[str, Any] | None) -> str | None:
    """Evaluation phases, kept out of the step times."""
    if not isinstance(evaluation, dict) or not isinstance(evaluation.get("phases"), int) or evaluation["phases"] < 1:
        return None
    numbers = {key: value if isinstance(value := evaluation.get(key), (int, float)) else None
               for key in ("seconds", "share", "mean_seconds")}
    return (f"Evaluation: {plural(evaluation['phases'], 'phase')}, {seconds(numbers['seconds'])} in all "
            f"({percent(numbers['share'])} of training and evaluation time), "
            f"{seconds(numbers['mean_seconds'])} each; left out of the step times above")


def compile_lines(compiled: dict[str, Any] | None, totals: dict[str, Any] | None) -> list[str]:
    """torch.compile's work: compilations (their time kept out of the step times), graphs,
    recompiles and graph breaks with where and why; nothing for a job that compiled nothing."""
    if not isinstance(compiled, dict):
        return []
    count = lambda key: value if isinstance(value := compiled.get(key), int) else 0  # noqa: E731
    if not any(count(key) for key in ("compiles", "graphs", "recompiles", "graph_breaks")):
        return []  # dynamo loaded (by torch.func, say), nothing compiled
    spent = (totals or {}).get("compile_seconds")
    warmup = (totals or {}).get("warmup_steps")
    kept_out = ""
    if isinstance(spent, (int, float)) and spent > 0:
        kept_out = (f" ({seconds(spent)} of it in the steps measured, kept out of their times; "
                    f"{warmup} warm-up step{'s' if warmup != 1 else ''} left out of the step-time "
                    f"statistics and the split)")
    total = compiled.get("seconds")
    lines = [f"torch.compile: {count('compiles')} compilation{'s' if count('compiles') != 1 else ''}, "
             f"{seconds(total if isinstance(total, (int, float)) else None)}{kept_out}; {count('graphs')} graphs, "
             f"{count('recompiles')} recompiles, {count('graph_breaks')} graph breaks"]
    for site in compiled.get("recompile_sites") or []:
        lines.append(f"    recompiled {site.get('count')}x: {site.get('where')}: {site.get('guard')}")
    for site in compiled.get("graph_break_sites") or []:
        lines.append(f"    graph break {site.get('count')}x at {site.get('where')}: {site.get('reason')}")
    return lines


KIND_NAMES = {"matmul": "matmuls", "conv": "convolutions", "fp8": "fp8 matmuls"}


def compute_lines(compute: dict[str, Any] | None, counted: dict[str, Any] | None) -> list[str]:
    """The work a step does and how much of the device it reaches (measure/flops.py,
    measure/utilization.py): FLOPs per step, achieved FLOP/s, MFU where the device's peak is
    known; the modules that do the FLOPs. Nothing where no count ran yet."""
    if not isinstance(compute, dict):
        return []
    if compute.get("skipped"):
        return [f"Compute: FLOPs not counted: {compute['skipped']}"]
    counted = counted if isinstance(counted, dict) else {}
    per_batch = ""
    if counted.get("forward_flops") is not None and counted.get("backward_flops") is not None:
        batch = f" of {counted['batch']}" if counted.get("batch") else ""
        varying = f"; shapes vary: the median of {counted.get('counts')} counts" if compute.get("estimate") else ""
        per_batch = (f" (forward {flop_text(counted['forward_flops'])} + backward "
                     f"{flop_text(counted['backward_flops'])} a batch{batch}, counted on "
                     f"{counted.get('model') or 'the model'}'s shapes{varying})")
    kinds = [k for k in compute.get("kinds") or [] if isinstance(k, dict)]
    weighted = ""
    if len({k.get("precision") for k in kinds}) > 1:  # kinds in different precisions: the blend's parts
        weighted = " (FLOP-weighted: " + ", ".join(
            f"{KIND_NAMES.get(k.get('kind'), k.get('kind'))} {k.get('precision')} {percent(k.get('share'))}"
            for k in kinds) + ")"
    if compute.get("mfu") is not None:
        peak = flop_text(compute.get("peak_flops_per_second"), "FLOP/s")
        utilization = (f"MFU {compute['mfu']:.1%} of {compute.get('device')}'s {peak} dense "
                       f"{compute.get('precision')} peak{weighted}")
    else:
        utilization = f"MFU: unknown peak for {compute.get('device') or 'this device'} ({compute.get('precision')})"
    lines = [f"Compute: {flop_text(compute.get('flops_per_step'))} a step{per_batch}, "
             f"{flop_text(compute.get('achieved_flops_per_second'), 'FLOP/s')} achieved; {utilization}"]
    modules = [m for m in counted.get("top_modules") or [] if isinstance(m, dict)]
    if modules:
        lines.append("    FLOPs by module: " + ", ".join(
            f"{m.get('module')} ({(str(m['count']) + ' ') if (m.get('count') or 1) > 1 else ''}{m.get('class')}) "
            f"{percent(m.get('share'))}" for m in modules))
    return lines


def energy_line(spent: dict[str, Any] | None) -> str | None:
    """Joules a step and a sample on the job's GPUs (measure/utilization.py energy)."""
    if not isinstance(spent, dict) or spent.get("joules_per_step") is None:
        return None
    sample = spent.get("joules_per_sample")
    gpus = spent.get("gpus") or 1
    return (f"Energy: {spent['joules_per_step']:.3g} J a step"
            + (f", {sample:.3g} J a sample" if sample is not None else "")
            + f" ({gpus} GPU{'s' if gpus != 1 else ''} at {spent.get('watts', 0):.0f} W, {spent.get('source')})")


def gc_line(snapshot: dict[str, Any]) -> str | None:
    """Python's garbage collections while the job trained (measure/gc_pauses.py): the full ones,
    which stop the loop for as long as they walk the process's objects, and the young ones."""
    collector = (snapshot.get("habits") or {}).get("gc")
    if not isinstance(collector, dict) or not any(collector.get("collections") or ()):
        return None
    (young, middle, full), (young_s, middle_s, full_s) = collector["collections"], collector["seconds"]
    trained = (snapshot.get("totals") or {}).get("seconds")
    share = f", {percent(min(1.0, full_s / trained))} of training" if full and trained else ""
    each = ""
    if full and collector.get("full_median_seconds") is not None:
        each = f", {seconds(collector['full_median_seconds'])} each, the longest {seconds(collector.get('full_max_seconds'))}"
    frozen = f"; {collector['frozen']:,} objects frozen (gc.freeze())" if collector.get("frozen") else ""
    return (f"Garbage collection: {full} full ({seconds(full_s)}{each}{share}), {young + middle:,} young "
            f"({seconds(young_s + middle_s)}){frozen}")


def live_line(snapshot: dict[str, Any], findings: list[dict[str, Any]] | None = None) -> str:
    """One line of where the job stands, for a progress display (`tuneup demo`): the median
    step, the stall, achieved FLOP/s and MFU where the peak is known, and the finding ranked
    first (what explains the gap). Empty before the first window."""
    window = snapshot.get("window") or {}
    step = (window.get("step_seconds") or {}).get("median")
    if step is None:
        return ""
    parts = [f"step {seconds(step)}", f"stall {percent(window.get('stall_ratio'))}"]
    compute = snapshot.get("flops")
    if isinstance(compute, dict) and compute.get("achieved_flops_per_second") is not None:
        mfu = compute.get("mfu")
        parts.append(flop_text(compute["achieved_flops_per_second"], "FLOP/s")
                     + (f" (MFU {mfu:.1%})" if mfu is not None else " (MFU: unknown peak)"))
    if findings:
        parts.append(f"top finding: {findings[0]['rule']}")
    return " · ".join(parts)


def work_lines(snapshot: dict[str, Any]) -> list[str]:
    """What a step does and costs, for every report format: compute_lines, gpu_work_line,
    energy_line, gc_line."""
    extra = [line for line in (gpu_work_line(snapshot), energy_line(snapshot.get("energy")), gc_line(snapshot))
             if line]
    counted = (snapshot.get("habits") or {}).get("flops")
    return compute_lines(snapshot.get("flops"), counted) + extra


GAPS = 0.1  # NVML's busy share this far under the events' span: the span holds the GPU's waits


def gpu_work_line(snapshot: dict[str, Any]) -> str | None:
    """The GPU's part of a CUDA step: the span of its kernels (CUDA events, median) and, where
    NVML sampled, the share of time a kernel ran. The span runs from the step's first kernel to
    its last, gaps included: on an H100, a launch-bound job's span was 96% of its step while a
    kernel ran 32% of the time. The lower figure is the GPU's busy share (the rules' too)."""
    window = snapshot.get("window") or {}
    gpu = (window.get("gpu_seconds") or {}).get("median")
    step = (window.get("step_seconds") or {}).get("median")
    if gpu is None or not step:
        return None
    line = f"GPU work: the step's kernels span {seconds(gpu)} of a {seconds(step)} step ({percent(gpu / step)})"
    busy = nvml_utilization(snapshot)
    if busy is not None:
        line += f"; NVML saw a kernel running {percent(busy)} of the time"
        if busy < gpu / step - GAPS:
            line += ": the rest of the span is the GPU waiting for the host (launches, syncs)"
    return line


def scaler_line(scaler: dict[str, Any]) -> str:
    if not scaler.get("present"):
        return "GradScaler: none in this job"
    if not scaler.get("enabled"):
        return "GradScaler: present but disabled (enabled=False)"
    scale = scaler["scale"]
    return (
        f"GradScaler: scale {scale:g}, skipped {scaler['skipped_steps']} of {scaler['steps']} steps "
        f"({percent(scaler['skip_rate'])}), longest run {scaler['longest_skip_run']}, "
        f"{scaler['backoff_events']} back-offs, {scaler['growth_events']} growths"
        if scale is not None else "GradScaler: enabled, no update seen yet"
    )


def system_lines(system: dict[str, Any] | None) -> list[str]:
    if not system:
        return []
    lines = []
    host = system.get("host")
    if host:
        workers = (f", {host['workers']} loader workers using {host['workers_cpu_ratio']:.1f} cores and "
                   f"{size(host['workers_rss_bytes'])}" if host["workers"] else ", no loader workers")
        waited = (host.get("wait_cores") or 0) + (host.get("workers_wait_cores") or 0)
        waiting = f"; waited for {waited:.1f} cores more (run queue)" if waited >= 0.05 else ""
        lines.append(f"CPU: training process {host['cpu_ratio']:.1f} of {host['usable_cores']:g} usable cores, "
                     f"torch threads {host['torch_threads']}, RSS {size(host['rss_bytes'])}{workers}{waiting}")
    memory = system.get("memory") or {}
    if memory.get("available"):
        for device in memory["devices"]:
            lines.append(
                f"GPU memory (cuda:{device['device']}): allocated {size(device['allocated_bytes'])}, reserved "
                f"{size(device['reserved_bytes'])}, peak {size(device['allocated_peak_bytes'])} of "
                f"{size(device['total_bytes'])}; {device['alloc_retries']} allocator retries, {device['ooms']} OOMs"
            )
    gpu = system.get("gpu") or {}
    if gpu.get("available"):
        for sample in gpu["samples"]:
            power = f", {sample['power_watts']:.0f} W" if sample.get("power_watts") is not None else ""
            lines.append(f"GPU {sample['gpu']}: {percent(sample['utilization_ratio'])} busy, "
                         f"{size(sample['memory_used_bytes'])} of {size(sample['memory_total_bytes'])} used{power}")
    else:
        lines.append(f"GPU: {gpu.get('reason', 'not sampled')}")
    return lines


def config_lines(config: dict[str, Any] | None) -> list[str]:
    if not config:
        return []
    lines = []
    # (run logs of earlier versions have no evaluation loaders: they list every loader as training's)
    for name, loader in [*(("DataLoader", loader) for loader in config["loaders"]),
                         *(("Evaluation DataLoader", loader) for loader in config.get("evaluation_loaders") or ())]:
        prefetch = f", prefetch_factor={loader['prefetch_factor']}" if loader["num_workers"] else ""
        by_tuneup = set_by_apply_mode(loader)
        by_tuneup = f"; {by_tuneup}" if by_tuneup else ""
        lines.append(f"{name}: batch_size={loader['batch_size']}, num_workers={loader['num_workers']}, "
                     f"pin_memory={loader['pin_memory']}, persistent_workers={loader['persistent_workers']}{prefetch}"
                     f"{by_tuneup}")
    optimizers = config["optimizers"]
    for number, optimizer in enumerate(optimizers, 1):
        # Several optimizers: each by what it trains (a GAN's two Adams), else by its number.
        name = "Optimizer" if len(optimizers) == 1 else f"Optimizer {number}"
        models = optimizer.get("models") or []
        trains = f" for {', '.join(models)}" if len(optimizers) > 1 and models else ""
        size = f", {optimizer['parameters']:,} parameters" if len(optimizers) > 1 else ""
        lines.append(f"{name}: {optimizer['class']} ({optimizer['implementation']}){trains}{size}, "
                     f"{_lr_text(optimizer)}")
    autocast = config.get("autocast") or {}
    active = [f"{device} {dtype}" for device, dtype in autocast.items() if dtype]
    lines.append(f"AMP: autocast {', '.join(active) if active else 'off'}; "
                 f"zero_grad(set_to_none={config['zero_grad_set_to_none']}); "
                 f"cudnn.benchmark={config['backends']['cudnn_benchmark']}")
    for model in config["models"]:
        dtypes = ", ".join(model["dtypes"])
        lines.append(f"Model: {model['class']}, {model['parameters']:,} parameters ({dtypes}) on "
                     f"{', '.join(model['devices'])}")
    return lines


def batch_text(window: dict[str, Any], config: dict[str, Any] | None) -> str | None:
    """The batch size as the job set it: its DataLoaders' batch_size where they agree (the
    window's mean is lower when an epoch's last batch is short), else the mean per batch (a
    loader built on a batch sampler, as Accelerate's are, says None); with the batches a step
    where there are several (gradient accumulation)."""
    sizes = {loader.get("batch_size") for loader in (config or {}).get("loaders") or []}
    fetches = window.get("fetches_per_step") or 0
    mean = window.get("batch_size")
    if len(sizes) == 1 and None not in sizes:
        size = sizes.pop()
        text = f"batch {size}"
    elif mean and not fetches:  # no DataLoader: the forwards' batch, per step
        return f"{mean:.0f} samples a step, the forward's batch" if mean == round(mean) else \
            f"{mean:.1f} samples a step on average, the forward's batch"
    elif mean:
        size = mean
        text = f"batch {mean:.0f}" if mean == round(mean) else f"{mean:.1f} samples per batch on average"
    else:
        return None
    if fetches >= 1.5 and isinstance(size, (int, float)):  # gradient accumulation: a step is several batches
        batches = round(fetches) if abs(fetches - round(fetches)) < 0.05 else round(fetches, 1)
        text += f", {batches:g} batches a step: {size * batches:.4g} samples"
    return text


def render(snapshot: dict[str, Any]) -> Group:
    if not snapshot.get("enabled"):
        return Group(Text(f"tuneup was not measuring: {snapshot.get('reason')}"))
    totals = snapshot["totals"]
    window = snapshot["window"]
    parts: list[Any] = []
    head = f"tuneup measured {totals['steps']} steps in {seconds(totals['seconds'])}"
    own = totals.get("tuneup_seconds")
    if isinstance(own, (int, float)) and own > 0:  # its one-off trials, on the training thread
        head += f" (plus {seconds(own)} of tuneup's own, kept out)"
    head += f" (run {snapshot['run']['run_id']})"
    parts.append(Text(head, style="bold"))
    if window is None:
        parts.append(Text("No training step was seen: no optimizer.step(), no backward followed by a forward, no "
                          "tuneup.step() (mark the loop's steps with tuneup.step())."))
        return Group(*parts)
    throughput = (f"Throughput: {_rate(window['steps_per_second'], 'steps/s')}, "
                  f"{_rate(window['samples_per_second'], 'samples/s')}")
    batch = batch_text(window, snapshot.get("config"))
    if batch:
        throughput += f" ({batch})"
    parts.append(Text(throughput))
    boundary = (snapshot.get("habits") or {}).get("step_boundary")
    if boundary:
        parts.append(Text(f"Steps counted at: {boundary}"))
    parts.append(step_table(window))
    lines = sync_lines(snapshot["syncs"]) + [scaler_line(snapshot["scaler"])]
    evaluation = evaluation_line(totals.get("evaluation"))
    if evaluation:
        lines.insert(0, evaluation)
    lines[:0] = compile_lines(snapshot.get("compile"), totals)
    lines[:0] = work_lines(snapshot)
    loss = window.get("loss")
    if loss:
        trend = f", trend {loss['trend']:+.0%} over the window" if loss.get("trend") is not None else ""
        lines.append(f"Loss: last {loss['last']:.4g}, {loss['nonfinite_steps']} non-finite of the last "
                     f"{loss['read_steps']}{trend}")
    lines += system_lines(snapshot.get("system")) + config_lines(snapshot.get("config"))
    for warning in snapshot.get("warnings", []):
        lines.append(f"Warning: {warning['message']}")
    parts += [Text(line) for line in lines]
    where = snapshot.get("run_log") or "not written (see warnings)"
    parts.append(Text(f"Run log: {where}", style="bold"))
    return Group(*parts)


def print_summary(snapshot: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(render(snapshot))


def _lr_text(optimizer: dict[str, Any]) -> str:
    """The learning rate as the job ran it, where it was read; else what was declared."""
    measured = optimizer.get("lr_measured") or {}
    if measured.get("changes"):
        return (f"lr {measured['first']:.3g} -> {measured['last']:.3g} (min {measured['min']:.3g}, "
                f"max {measured['max']:.3g}; changed on {measured['changes']} of {measured['reads']} reads)"
                + (", scheduler" if optimizer["lr_scheduler"] else ", set by the loop"))
    lr = measured.get("last", optimizer.get("lr"))
    lr_text = f"lr {lr:.3g}" if isinstance(lr, (int, float)) else "lr ?"
    return f"{lr_text}, scheduler: {'yes' if optimizer['lr_scheduler'] else 'none'}" + (
        ", constant as read" if measured else "")
