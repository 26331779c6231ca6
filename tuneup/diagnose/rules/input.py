"""Input pipeline: waiting for batches, batches built in the loop, pageable copies, NumPy
copies, unnormalized inputs, and a CPU oversubscribed by loader workers and torch threads."""

from __future__ import annotations

import math

from ..rule import MIN_GAIN, Evidence, Facts, Missing, rule
from ...format import percent, read_rate, seconds, set_by_apply_mode
from ...measure.terms import BLOCKING_COPY_KIND

GUIDE = "https://docs.pytorch.org/tutorials/recipes/recipes/tuning_guide.html"
STALL_THRESHOLD = 0.10
CPU_BOUND_WORKER = 0.7  # a worker busy this share of the time or more is CPU-bound
# Where the job's threads want this share of the usable cores or more, its CPU per step spread on
# them bounds the gain of loader workers, and a bound below CORES_BOUND_MIN_GAIN is none (_worker_plan).
CORES_WANTED = 0.9
CORES_BOUND_MIN_GAIN = 0.05
SHIPPING_BOUND = 1.5  # a wait per batch within this many times the measured shipping cost is that cost
READY_SHARE = 0.5  # of the worker fetches looked at that found a batch waiting: the workers keep up
# ... and the mean share of the batches asked for that were made, at those looks: workers that idle
# ahead of the loop (their CPU is then their whole making)
QUEUE_FULL = 0.6
MIN_READY_CHECKS = 8  # (measure/loader.py: ready_schedule)


@rule(
    id="data-stall",
    title="The training loop waits for the DataLoader",
    severity="medium",
    inputs="data wait and step time on every step; the loader's configuration; what shipping one of the job's "
           "batches from a worker costs this process, measured once (measure/transfer.py); the workers' and the "
           "machine's measured CPU and usable cores",
    threshold=f"data wait >= {percent(STALL_THRESHOLD)} of step time over the window",
    why="Below 10% the gain is within run-to-run noise and other fixes come first. Above it, worker "
        "processes hide the wait only where making a batch costs more than shipping it from a worker "
        "(a connection and a shared-memory mapping per tensor, in the training process) and there are "
        "cores to run them: the making moves to the workers, its CPU does not go away, so a job whose own "
        "threads already keep the cores busy gains only the time the making sleeps (on storage, the "
        "network: measured as the training thread's time neither on a core nor waiting for one). The "
        "gain stated is predicted from those measured costs.",
    doc=f"{GUIDE}#enable-async-data-loading-and-augmentation",
    can_apply=True,
)
def data_stall(facts: Facts) -> Evidence | None:
    window = facts.window
    stall = facts.need(window.get("stall_ratio"), "the data wait")
    if stall < STALL_THRESHOLD:
        return None
    loader = max(facts.loaders, key=lambda entry: entry.get("num_workers") or 0) if facts.config.get("loaders") else {}
    workers = loader.get("num_workers")
    host = (facts.snapshot.get("system") or {}).get("host") or {}
    cores = host.get("usable_cores")
    suggested = max(2, min(8, cores or 4)) if not workers else min(2 * workers, max(workers + 1, cores or 2 * workers))
    # Workers that want a core nearly all the time are CPU-bound (the CPU they used plus the
    # CPU they waited for: beside other processes a busy worker gets less than it wants): more
    # of them only help where there are free cores to run them (measured: the cores the job and
    # other processes leave idle).
    cpu_bound = bool(workers and host.get("workers")
                     and ((host.get("workers_cpu_ratio") or 0) + (host.get("workers_wait_cores") or 0))
                     / host["workers"] >= CPU_BOUND_WORKER)
    free = cores - sum(_job_cpu(host)) if cores and host else None
    if cpu_bound and free is not None:
        suggested = min(suggested, workers + int(free))
    step, wait = window["step_seconds"]["median"], window["data_wait_seconds"]["median"]
    setting = ", ".join(f"{name}={loader.get(name)}" for name in ("num_workers", "pin_memory", "persistent_workers",
                                                                   "prefetch_factor") if name in loader)
    tuned = set_by_apply_mode(loader)
    if setting and tuned:  # the settings the steps ran with, apply mode's where they are not the job's
        setting += f"; {tuned}"
    # The stall ratio is a ratio of sums (what throughput loses): the sentence gives the means
    # it comes from, and the median wait where the two differ (heavy-tailed waits: on an H100
    # conv net, 1 s stalls among 1.5 ms waits read "1.5 ms ... 36% of a 9.3 ms step").
    mean_wait, mean_step = window["data_wait_seconds"].get("mean"), window["step_seconds"].get("mean")
    if mean_wait is not None and mean_step:
        observed = (f"the loop waited {seconds(mean_wait)} per step on average for its next batch: {percent(stall)} "
                    f"of a {seconds(mean_step)} step")
        if not 0.5 * mean_wait <= wait <= 2 * mean_wait:
            observed += f" (the median wait {seconds(wait)}: a few long waits make most of it)"
    else:
        observed = f"the loop waited {seconds(wait)} per step for its next batch: {percent(stall)} of a {seconds(step)} step"
    if setting:
        observed += f" ({setting})"
    numbers = {"stall_ratio": stall, "data_wait_seconds": wait, "step_seconds": step, "num_workers": workers,
               "usable_cores": cores, "workers_cpu_bound": cpu_bound, "advised_workers": suggested}
    plan = _worker_plan(facts, host, workers, suggested, free)
    if plan is not None:
        numbers.update(plan)
    if plan is not None and plan["suggested_workers"] == 0:
        observed += (f"; its workers use {seconds(plan['make_seconds'] + plan['ship_worker_seconds'])} of CPU per "
                     f"batch, and shipping each batch to this process costs it {seconds(plan['ship_seconds'])}: "
                     f"made here, a batch would take {seconds(plan['make_seconds'])}")
        if plan.get("estimate"):
            observed += f"; a batch was already waiting in the queue at {percent(numbers['ready_share'])} of the fetches looked at"
            if plan.get("queue_fill") is not None:
                observed += (f", {percent(plan['queue_fill'])} of the batches asked for made (its workers idle ahead "
                             "of the loop)")
            observed += ": the wait is receiving them, and more workers would not shorten it"
        gain_text = (f"up to {percent(plan['gain'])} shorter steps: an estimate (if making a batch is all CPU work, "
                     "as its workers' CPU says)" if plan.get("estimate") else _predicted(plan["gain"]))
        # Apply mode's DataLoader search moves down to no workers too, except where the job
        # sets its workers up itself (a worker_init_fn: the dataset may need what it sets).
        return Evidence(observed=observed, numbers=numbers, fix=loader_fix(facts, ["num_workers=0"]),
                        gain=plan["gain"], gain_text=gain_text,
                        severity="high" if plan["gain"] >= 0.3 else None, can_apply=not loader.get("worker_init_fn"))
    if plan is not None and plan["gain"] < MIN_GAIN:
        make, ship = plan["make_seconds"], plan["ship_seconds"]
        if workers and "ready_share" in plan:
            observed += (f"; a batch was already waiting in the queue at {percent(plan['ready_share'])} of the fetches "
                         "looked at: the wait is receiving them, and more workers would not recover it")
        elif workers:
            observed += (f"; shipping each batch from a worker costs this process {seconds(ship)} ({plan['tensors']} "
                         f"tensors), most of that wait: more workers would not recover it")
        else:
            if plan.get("cpu_bound"):
                why = (f"this process's own threads already want {plan['job_cores']:.1f} of the {cores} usable "
                       "cores, so workers would make batches with CPU the step's own work needs")
            elif ship >= 0.5 * make:
                why = f"shipping one from a worker would cost this process {seconds(ship)} ({plan['tensors']} tensors)"
            else:
                why = f"with {plan['runnable_cores']:g} free core(s), workers would make them no faster than this process"
            observed += f"; making a batch takes {seconds(make)}, and {why}: workers would not recover the wait"
        return Evidence(
            observed=observed, numbers=numbers,
            fix=("# the cores are busy with the step and the making: make each sample cheaper to load\n"
                 "# (pre-processed data, lighter decoding and augmentation, or augmentation on the GPU),\n"
                 "# or give the job more cores, one for each loader worker"
                 if plan.get("cpu_bound") else
                 "# make each batch cheaper to build: one indexing per batch rather than per sample\n"
                 "# (a Dataset with __getitems__, or the data as tensors sliced by a BatchSampler),\n"
                 "# or fewer, larger batches"),
            gain_text=f"up to the {percent(stall)} wait, not through loader workers",
            severity="high" if stall >= 0.3 else None, can_apply=False)
    options = (["persistent_workers=True", "prefetch_factor=4"] if suggested <= (workers or 0)
               else [f"num_workers={suggested}", "persistent_workers=True", "prefetch_factor=4"])
    if facts.on_cuda and not loader.get("pin_memory"):
        options.append("pin_memory=True")
    # What apply mode measured in this run and did not keep is not advised again as if untried.
    tried = not_kept_loader_settings(facts)
    if tried:
        options = [option for option in options if option not in tried]
        observed += f"; apply mode measured {', '.join(sorted(tried))} in this run: not kept"
        if not options:
            return Evidence(
                observed=observed, numbers=numbers,
                fix="# the loader settings apply mode tried did not pay here: make each sample cheaper to load\n"
                    "# (pre-processed data, lighter decoding and augmentation), or give the job more cores",
                gain_text=f"up to the {percent(stall)} wait, not through these loader settings",
                severity="high" if stall >= 0.3 else None, can_apply=False)
    if cpu_bound and suggested <= workers:
        observed += (f"; its {workers} workers are CPU-bound ({host['workers_cpu_ratio']:.1f} cores busy) and "
                     f"the {cores} usable cores have no room for more: make each sample cheaper to load "
                     "(pre-processed data, lighter decoding and augmentation, or augment on the GPU)")
    if plan is not None and plan.get("sleep_overlap"):
        observed += (f"; this process's threads want {plan['job_cores']:.1f} of the {cores} usable cores, but the "
                     f"making sleeps {percent(plan['make_asleep_share'])} of its time (storage, the network), "
                     "which workers overlap without a core")
    if plan is not None and suggested > (workers or 0) and plan["gain"] >= MIN_GAIN:
        return Evidence(observed=observed, numbers=numbers, fix=loader_fix(facts, options), gain=plan["gain"],
                        gain_text=_predicted(plan["gain"]), severity="high" if plan["gain"] >= 0.3 else None)
    return Evidence(
        observed=observed,
        numbers=numbers,
        fix=loader_fix(facts, options),
        gain=stall,
        gain_text=f"up to {percent(stall)} shorter steps (the whole wait): an estimate, not predicted from "
                  "measured costs",
        severity="high" if stall >= 0.3 else None,
    )


def not_kept_loader_settings(facts: Facts) -> set[str]:
    """The DataLoader settings ("num_workers=3") apply mode tried in this run and did not keep
    (reverted, rolled back: its `dataloader` records' before and after), less any it kept later."""
    tried, kept = set(), set()
    for record in facts.snapshot.get("actions") or []:
        before, after = record.get("before"), record.get("after")
        if record.get("action") != "dataloader" or not isinstance(before, dict) or not isinstance(after, dict):
            continue
        moved = {f"{name}={value}" for name, value in after.items()
                 if before.get(name) is not None and before.get(name) != value}  # (None: a default filled in)
        (kept if record.get("decision") in ("kept", "trying") else tried).update(moved)
    return tried - kept


def _predicted(gain: float) -> str:
    return (f"{percent(gain)} shorter steps, predicted from this job's measured costs (making a batch, shipping "
            "one between processes, the free cores)")


def _worker_plan(facts: Facts, host: dict, workers: int | None, suggested: int,
                 free: float | None) -> dict | None:
    """The wait per step that `suggested` workers would leave (or none, where fewer are better),
    from measured costs, per batch: making one (the wait itself without workers, else the
    workers' CPU less their shipping), shipping one (this process's part and the worker's:
    measure/transfer.py), and the rest of the step (compute that a prefetching worker overlaps).
    W workers make a batch every max((make_cpu + ship_worker) / min(W, free cores), (make +
    ship_worker) / W) (the CPU part needs a core each; the rest, waiting on I/O, does not), and
    the wait left per batch is ship + max(0, that - compute). None: the shipping cost is not
    measured (no batch sampled yet)."""
    transfer = facts.habits.get("batch_transfer") or {}
    ship, ship_worker = transfer.get("main_seconds"), transfer.get("worker_seconds")
    window = facts.window
    fetches = window.get("fetches_per_step") or 0
    if ship is None or ship_worker is None or fetches <= 0:
        return None
    waits, stall = window["data_wait_seconds"], window["stall_ratio"]
    # Per batch: the wait, and the rest of the step in the window's proportion. With workers, the
    # median wait (the typical receipt: a loaded machine's long steps move the mean only). Without
    # them the wait is the making, and what workers would take over is all of it: the mean, which
    # the stall (a ratio of sums) comes from. On an H100 conv net loading in the main process the
    # median was 1.5 ms against a 7 ms mean (a few 1 s reads): from the median, workers "would not
    # recover the wait"; 0 -> 3 workers then measured 1.98x.
    wait = waits["median"] if workers else waits.get("mean", waits["median"])
    wait_batch = wait / fetches
    compute_batch = wait_batch * (1.0 - stall) / stall
    if workers:
        workers_cpu = host.get("workers_cpu_ratio")
        if workers_cpu is None:
            return None
        # cores x seconds per step, per batch, less their shipping
        make = max(0.0, workers_cpu * window["step_seconds"]["mean"] / fetches - ship_worker)
        plan = {"make_seconds": make, "ship_seconds": ship, "ship_worker_seconds": ship_worker,
                "tensors": transfer.get("tensors"), "fetches_per_step": fetches}
        # Their CPU is what a batch costs only if they want a core all the time (the CPU they
        # used plus what they waited for); else some of their time went to I/O, unmeasured.
        demand = workers_cpu + (host.get("workers_wait_cores") or 0.0)
        cpu_bound = demand >= CPU_BOUND_WORKER * (host.get("workers") or workers)
        if cpu_bound and make < wait_batch:
            # made here, a batch would cost less than the wait for a worker's
            return dict(plan, suggested_workers=0, gain=stall * (1.0 - make / wait_batch))
        if wait_batch <= SHIPPING_BOUND * ship:
            return dict(plan, suggested_workers=workers, gain=0.0, shipping_bound=True)  # the wait is the shipping
        fetched = facts.habits.get("worker_fetches") or {}
        # The fetches that found no batch waiting waited for the next one in transit, not for
        # its making (None: every fetch looked at found one). Workers started together deliver
        # together: a ready share of one half where each second fetch waits out the making.
        unready = fetched.get("unready_wait_seconds")
        if (fetched.get("checked") or 0) >= MIN_READY_CHECKS and fetched["ready_share"] >= READY_SHARE \
                and (unready is None or unready <= SHIPPING_BOUND * ship):
            # Batches were waiting in the queue when the loop asked: the wait is receiving them
            # (under contention, more than `ship` measured alone), and more workers cannot help.
            # Fewer may: made here, a batch would cost its CPU (if its making is all CPU: unmeasured).
            plan.update(ready_share=fetched["ready_share"], shipping_bound=True)
            # Made here, a batch would cost its CPU only where that is all its making: workers
            # that are CPU-bound, or that idle ahead of the loop (most of what was asked for made).
            # Workers that sleep on storage keep one batch or two waiting of the four asked for,
            # and made here each would cost its I/O too: two of them that slept 80 ms a batch,
            # beside six CPU burners, read ready at 80% of the looks and 1.2 ms of CPU a batch,
            # and 2 -> 0 measured 0.38x (tests/test_apply.py: the I/O-bound workers).
            fill = fetched.get("queue_fill")
            if fill is not None:
                plan["queue_fill"] = fill
            if make < wait_batch and (cpu_bound or (fill is not None and fill >= QUEUE_FULL)):
                return dict(plan, suggested_workers=0, gain=stall * (1.0 - make / wait_batch), estimate=True)
            return dict(plan, suggested_workers=workers, gain=0.0)
        return None
    else:
        make = wait_batch  # made in this process, during the wait
        fetched = facts.habits.get("main_process_fetches") or {}
        timed = (fetched.get("timed") or 0) >= 3
        cpu_share = fetched.get("cpu_share", 1.0) if timed else 1.0
        # The share of the making this thread slept (neither on a core nor waiting for one:
        # storage, the network); None where its run-queue wait is not known.
        core_wait = fetched.get("core_wait_share") if timed else None
        asleep = max(0.0, 1.0 - cpu_share - core_wait) if core_wait is not None else None
    plan = {"make_seconds": make, "make_cpu_share": cpu_share, "ship_seconds": ship, "ship_worker_seconds": ship_worker,
            "tensors": transfer.get("tensors"), "fetches_per_step": fetches}
    if asleep is not None:
        plan["make_asleep_share"] = asleep
    runnable = max(1.0, free if free is not None else float(suggested))  # cores for workers
    interval = max((make * cpu_share + ship_worker) / min(suggested, runnable), (make + ship_worker) / suggested)
    after = ship + max(0.0, interval - compute_batch)
    gain = max(0.0, stall * (1.0 - after / wait_batch))
    # The making moves to the workers, it does not go away: where the job's own threads already
    # want nearly all the usable cores (the CPU they used plus the CPU they waited for), its
    # CPU per step stays (plus the shipping) and the cores bound how short a step gets, however
    # the work is shared out. On 2 cores an augmenting loop whose intra-op threads kept both
    # busy (1.98 cores) waited 60% of its step for batches made in it, and the overlap alone
    # read "38% shorter steps": 0 -> 1 and 0 -> 2 workers measured 0.75x and 0.94x
    # (benchmarks/apply_scripts/augment_classifier.py). (Not a job that wants less: one that
    # sleeps on I/O beside busy processes uses little CPU, and workers overlap its waits.)
    #
    # Except the making's sleep: a thread asleep on storage wants no core, and workers overlap
    # that however busy the cores are. What the threads want is no measure of it on a busy
    # machine: an intra-op thread spins between ops and waits for a core to spin. The demo's
    # threads wanted 1.7 of 2 cores beside two busy processes (1.8 beside three), its decode
    # asleep 82-89% of each fetch, and two workers made its steps 1.7x faster (69.9 ms ->
    # 40.9 ms). An augmenting loop's making, asleep 5% beside three, stays bounded.
    wanted = (host.get("cpu_ratio") or 0.0) + (host.get("wait_cores") or 0.0)
    cores, step = host.get("usable_cores"), window["step_seconds"].get("mean") or window["step_seconds"]["median"]
    if cores and step and wanted >= CORES_WANTED * cores:
        bound = 1.0 - (wanted * step + (ship + ship_worker) * fetches) / cores / step
        if bound < gain:
            overlap = stall * asleep - ship * fetches / step if asleep is not None else 0.0
            if overlap >= max(bound, CORES_BOUND_MIN_GAIN):
                gain = min(gain, overlap)
                plan.update(sleep_overlap=True, job_cores=wanted)
            else:
                # A bound, reached only where the cores split the work perfectly: below
                # CORES_BOUND_MIN_GAIN nothing a trial could tell from noise (the loop above,
                # bounded at 2%, measured 0.92x with two workers).
                gain = bound if bound >= CORES_BOUND_MIN_GAIN else 0.0
                plan.update(cpu_bound=True, job_cores=wanted)
    return dict(plan, suggested_workers=suggested, runnable_cores=runnable, predicted_wait_seconds=after * fetches,
                gain=gain)


@rule(
    id="pageable-copies",
    title="Batches are copied to the GPU from pageable memory, or without non_blocking",
    severity="medium",
    inputs="sampled batches (device, pinned) of a job training on CUDA; the loader's pin_memory; "
           "blocking host-to-device copies among the sampled steps' syncs, with their lines",
    threshold="a CUDA job whose sampled CPU batches are not in pinned memory, or that copies to the "
              "GPU without non_blocking=True",
    why="A copy from pageable memory is staged through a pinned buffer by the driver and "
        "cannot overlap with compute; one without non_blocking=True also stops the host until it "
        "is done (a sync every copy). From pinned memory with non_blocking=True it overlaps.",
    doc="https://docs.pytorch.org/docs/stable/data.html#memory-pinning",
    can_apply=True,
)
def pageable_copies(facts: Facts) -> Evidence | None:
    if not facts.on_cuda:
        raise Missing("a CUDA job")
    syncs = facts.syncs
    copies = (syncs.get("by_kind") or {}).get(BLOCKING_COPY_KIND, 0.0) if syncs.get("backend") == "cuda" else 0.0
    batches = facts.habits.get("batches") or {}
    checked = batches.get("pin_checked") or 0
    host_batches = checked and "cpu" in (batches.get("devices") or ())
    if not copies and not host_batches:
        raise Missing("sampled CPU batches or blocking copies")
    pageable = checked - (batches.get("pinned") or 0) if host_batches else 0
    if pageable <= 0 and not copies:
        return None
    said = []
    if pageable > 0:
        said.append(f"{pageable} of {checked} sampled batches were in pageable host memory")
    sources = [s for s in syncs.get("top_sources") or [] if s["kind"] == BLOCKING_COPY_KIND]
    if copies:
        where = "; ".join(f"{s['location']} ({read_rate(s)})" for s in sources[:3])
        said.append(f"{copies:.1f} blocking host-to-device copies per step" + (f" at {where}" if where else ""))
    return Evidence(
        observed="; ".join(said),
        numbers={"pageable_batches": pageable, "sampled_batches": checked, "blocking_copies_per_step": copies,
                 "copy_sources": sources[:5]},
        fix="loader = DataLoader(dataset, ..., pin_memory=True)\n"
            "x = x.to(device, non_blocking=True)\ny = y.to(device, non_blocking=True)",
        gain_text="host-to-device copies overlap with compute" + (", and stop syncing the host" if copies else ""),
    )


INPUT_THRESHOLD = 0.15


@rule(
    id="input-in-loop",
    title="The loop builds its batches itself, on the training thread",
    severity="medium",
    inputs="the detail steps' time before their first forward (data wait and zero_grad left out); "
           "the training thread's stack, sampled in that time",
    threshold=f"input built in the loop >= {percent(INPUT_THRESHOLD)} of step time",
    why="Batches made on the training thread (get_batch() from a memmap, tokenizing, augmenting, "
        "generator pipelines) stop training while they are made, and a data-wait figure never shows "
        "them: no DataLoader waits. Worker processes, or a thread that prefetches, make the next "
        "batches while this one trains. Below 15% the gain is within what other fixes give first.",
    doc=f"{GUIDE}#enable-async-data-loading-and-augmentation",
)
def input_in_loop(facts: Facts) -> Evidence | None:
    window = facts.window
    weighted = facts.need(window.get("input_ratio"), "input time (detail steps)")
    # The rule is about the input every step makes: the typical detail step's input over the
    # typical step, where that is less than the time-weighted share. On a machine busy with other
    # work one descheduled detail step's input weighed 26% of the detail steps' time, its median
    # 536 us of an 18 ms step (3%) in a loop that copies one array a step.
    typical = (window.get("input_seconds") or {}).get("median")
    step = (window.get("step_seconds") or {}).get("median")
    share = min(weighted, typical / step) if typical is not None and step else weighted
    if share < INPUT_THRESHOLD:
        return None
    sampled = (facts.snapshot.get("habits") or {}).get("input_lines") or {}
    lines = sampled.get("top_lines") or []
    where = "; ".join(f"{line['function']}() at {line['location']}"
                      + (f" (from {line['loop_line']})" if line.get("loop_line") else "")
                      + f", {percent(line['share'])} of {sampled['samples']} samples" for line in lines[:3])
    observed = (f"the loop spent {seconds(window['input_seconds']['median'])} per step making its input before "
                f"the forward: {percent(share)} of a {seconds(window['step_seconds']['median'])} step")
    if where:
        observed += f": {where}"
    elif sampled.get("samples"):  # stacks.py MIN_SAMPLES
        observed += f" ({sampled['samples']} samples of its stack so far: too few to name its lines)"
    if window.get("fetches_per_step"):  # a DataLoader already: the work after the fetch belongs in it
        fix = ("# move the per-batch work after `for batch in loader:` into the Dataset or collate_fn,\n"
               "# where the loader's worker processes do it ahead of the step:\n"
               "loader = DataLoader(dataset, batch_size=..., num_workers=4, collate_fn=make_batch, "
               "persistent_workers=True)")
    else:
        fix = ("class Batches(torch.utils.data.IterableDataset):   # the loop's get_batch(), in workers\n"
               "    def __iter__(self):\n"
               "        while True:\n"
               "            yield get_batch()\n"
               "loader = DataLoader(Batches(), batch_size=None, num_workers=4, persistent_workers=True)\n"
               "for step, (x, y) in zip(range(max_steps), loader): ...\n"
               "# (seed each worker: torch.utils.data.get_worker_info() in get_batch)")
    return Evidence(
        observed=observed,
        numbers={"input_ratio": share, "input_seconds": window["input_seconds"]["median"],
                 "step_seconds": window["step_seconds"]["median"], "samples": sampled.get("samples"),
                 "top_lines": lines[:5]},
        fix=fix,
        gain=share,
        gain_text=f"up to {percent(share)} shorter steps (the input is made while the model trains)",
        severity="high" if share >= 0.3 else None,
    )


def loader_fix(facts: Facts, options: list[str]) -> str:
    """The DataLoader settings, where the job sets them: the Hugging Face Trainer builds its
    loader from TrainingArguments (`dataloader_*`)."""
    if (facts.config.get("framework") or {}).get("framework") == "transformers":
        named = [f"dataloader_{option}" for option in options]
        return f"TrainingArguments(..., {', '.join(named)})"
    return f"loader = DataLoader(dataset, batch_size=..., {', '.join(options)})"


NUMPY_COPIES_PER_STEP = 0.5


@rule(
    id="numpy-copies",
    title="torch.tensor(ndarray) copies arrays in the loop",
    severity="low",
    inputs="calls of torch.tensor with a NumPy array on watched steps, their time and source lines",
    threshold=f">= {NUMPY_COPIES_PER_STEP} torch.tensor(ndarray) calls per step",
    why="torch.tensor always copies; torch.as_tensor / torch.from_numpy share the array's "
        "memory. Once per step or more means the copy is in the loop, not in setup.",
    doc="https://docs.pytorch.org/docs/stable/generated/torch.as_tensor.html",
)
def numpy_copies(facts: Facts) -> Evidence | None:
    habits = facts.habits
    per_step = habits.get("numpy_copies_per_step")
    if per_step is None:
        raise Missing("a watched step")
    if per_step < NUMPY_COPIES_PER_STEP:
        return None
    totals = facts.snapshot.get("totals") or {}
    step_seconds = totals["seconds"] / totals["steps"] if totals.get("steps") and totals.get("seconds") else None
    copy_seconds = habits.get("numpy_copy_seconds_per_step") or 0.0
    share = copy_seconds / step_seconds if step_seconds else None
    sources = ", ".join(source["location"] for source in habits.get("numpy_copy_sources") or [])
    return Evidence(
        observed=f"{per_step:.1f} torch.tensor(ndarray) copies per step"
                 + (f" taking {percent(share)} of a step" if share is not None else "")
                 + (f", at {sources}" if sources else ""),
        numbers={"copies_per_step": per_step, "copy_seconds_per_step": copy_seconds,
                 "watched_steps": habits.get("watched_steps"), "sources": habits.get("numpy_copy_sources")},
        fix="x = torch.from_numpy(array)      # shares memory; or torch.as_tensor(array, dtype=...)",
        gain=share,
        # The copies' own time is what is measured; sharing saved more in some runs (freeing each
        # copy's memory after it: 5.3% and 7.9% against 3.1-4.1% of copying) and less in another
        # (1.9%, with pairs from -5% to 9%), benchmarks/bench_gain_calibration.py: an estimate.
        gain_text=(f"about {percent(share)} shorter steps: the copies' own time, an estimate (freeing the "
                   "memory they fill can add to it)") if share is not None else None,
    )


NORMALIZED_MEAN = 3.0
NORMALIZED_STD = 5.0


@rule(
    id="input-not-normalized",
    title="Input features look unnormalized",
    severity="low",
    inputs="mean and standard deviation of sampled float input batches",
    threshold=f"|mean| > {NORMALIZED_MEAN} or std > {NORMALIZED_STD} in a sampled batch",
    why="Standardized inputs have mean ~0 and std ~1 and [0, 1]-scaled ones std < 0.5; values "
        "in raw units (pixels 0-255) slow convergence and overflow fp16 activations sooner.",
    doc="https://docs.pytorch.org/vision/stable/generated/torchvision.transforms.Normalize.html",
)
def input_not_normalized(facts: Facts) -> Evidence | None:
    inputs = facts.need((facts.habits.get("batches") or {}).get("inputs"), "input statistics")
    mean, std = inputs["mean"], inputs["std"]
    if abs(mean) <= NORMALIZED_MEAN and std <= NORMALIZED_STD:
        return None
    return Evidence(
        observed=f"a sampled {inputs['dtype']} input batch {inputs['shape']} has mean {mean:.3g} and std {std:.3g}",
        numbers=dict(inputs),
        fix="mean, std = train_features.mean(0), train_features.std(0)   # once, on the training set\n"
            "x = (x - mean) / std                                         # in the Dataset or transform",
        gain_text="faster, steadier convergence (fewer steps), not shorter steps",
    )


BUSY_SHARE = 0.8  # (not all of them: a reading over a sampling interval averages its busy and idle moments)
OTHERS_MIN_CORES = 0.5  # other processes' load below this is the machine's background
IDLE_CORES = 0.05  # CPU readings this small are a process's idling


def _job_cpu(host: dict) -> tuple[float, float, float]:
    """(cores the job's process uses, cores its loader workers use, cores other processes use)
    on the cores the job may use, from the host probe's measured CPU."""
    own, workers = host.get("cpu_ratio") or 0.0, host.get("workers_cpu_ratio") or 0.0
    return own, workers, max(0.0, (host.get("busy_cores") or 0.0) - own - workers)


@rule(
    id="cpu-oversubscribed",
    title="The job's threads and workers, or other processes, want more CPU than it has",
    severity="medium",
    inputs="usable cores, torch threads, loader workers, the measured CPU of the process, of its workers "
           "and of the machine, and the CPU time the job's threads waited for (Linux run-queue wait)",
    threshold=f"the job's own threads + busy workers > usable cores while the job itself wants >= "
              f"{percent(BUSY_SHARE)} of them (the CPU it used plus the CPU it waited for); or the cores >= "
              f"{percent(BUSY_SHARE)} busy with >= {OTHERS_MIN_CORES:g} cores of other processes' work",
    why="Workers and torch's intra-op threads then preempt each other; the configured demand alone is "
        "not enough (idle I/O workers cost nothing), so the job's own measured demand must be high too: "
        "what it used, and what it waited for, which on a machine busy with other work is what it "
        "did not get. When the load is other processes', the job needs the cores; until it has them, "
        "intra-op threads beyond the cores the others leave free wait for each other at every op: a small "
        "CNN's step on 2 cores with torch's 2 threads against 1 ran 2.1x, 1.4x and 3.5x slower beside 1, 2 "
        "and 3 busy processes, and 0.58x on a quiet machine (benchmarks/bench_threads_busy.py).",
    doc="https://docs.pytorch.org/docs/stable/notes/cpu_threading_torchscript_inference.html",
)
def cpu_oversubscribed(facts: Facts) -> Evidence | None:
    host = facts.host
    cores = facts.need(host.get("usable_cores"), "the usable core count")
    threads = host.get("torch_threads") or 1
    workers = host.get("workers") or 0
    own, workers_cpu, others = _job_cpu(host)
    busy = own + workers_cpu + others
    # What the job wants: what it used plus what it waited for (None: no run-queue figures).
    own_wait, workers_wait = host.get("wait_cores") or 0.0, host.get("workers_wait_cores") or 0.0
    wanted_workers = workers_cpu + workers_wait
    wanted = own + own_wait + wanted_workers
    # Idle workers (I/O-bound, or waiting on a full queue) compete with nobody: count the cores
    # the workers want, averaged over the window, rounded up.
    busy_workers = min(workers, math.ceil(wanted_workers - IDLE_CORES))
    numbers = {"usable_cores": cores, "torch_threads": threads, "workers": workers, "busy_workers": busy_workers,
               "job_cores": own + workers_cpu, "job_wanted_cores": wanted, "other_cores": others, "busy_cores": busy}
    if threads + busy_workers > cores and wanted >= BUSY_SHARE * cores:
        keep = max(1, cores - busy_workers)
        if keep >= threads:
            return None  # already at the fewest threads that leave the workers their cores
        return Evidence(
            observed=f"the job wants {wanted:.1f} of its {cores} usable cores: {threads} torch threads "
                     f"({own + own_wait:.1f} cores) and {busy_workers} busy loader workers ({wanted_workers:.1f} "
                     f"cores) compete for them" + (f", and waited for {own_wait + workers_wait:.1f}"
                                                   if own_wait + workers_wait >= 0.05 else ""),
            numbers=numbers,
            fix=f"torch.set_num_threads({keep})   # leave a core per busy loader worker",
            gain_text="less contention between the loader workers and the training thread",
        )
    if busy >= BUSY_SHARE * cores and others >= OTHERS_MIN_CORES:
        observed = (f"the machine is busy with other work: other processes use {others:.1f} of the job's "
                    f"{cores} usable cores (the job itself {own + workers_cpu:.1f})")
        fix = ("# run the job where its cores are free, or give it cores of its own:\n"
               "#   taskset / numactl --physcpubind, a cgroup cpuset, your scheduler's exclusive CPUs")
        # Its intra-op threads in parallel (the training process wants more than a core) beyond
        # the cores the others leave: each op's threads wait for the one not scheduled.
        keep = max(1, math.floor(cores - others))
        if threads > keep and own + own_wait >= 1.0:
            numbers["advised_threads"] = keep
            observed += (f"; its {threads} torch threads want {own + own_wait:.1f} cores where the others leave "
                         f"{max(0.0, cores - others):.1f}, and wait for each other at every op")
            fix += f"\n# until then, a torch thread per core left free:\ntorch.set_num_threads({keep})"
        return Evidence(observed=observed, numbers=numbers, fix=fix,
                        gain_text="the CPU time other processes take from the training thread and its workers")
    return None
