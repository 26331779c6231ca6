"""The training loop's and model's code: zero_grad, Conv bias before BatchNorm, evaluation
with autograd on, training forwards whose graph no backward uses, debugging tools left on,
single-tensor optimizers, no LR schedule, no gradient clipping, file writes in the step, full
garbage collections."""

from __future__ import annotations

import math

from ...format import percent
from ...measure.terms import SPIKE_FACTOR, SPIKE_FALLBACK, SPIKE_FLOOR, SPIKE_HISTORY
from ..rule import Evidence, Facts, Missing, rule

GUIDE = "https://docs.pytorch.org/tutorials/recipes/recipes/tuning_guide.html"


@rule(
    id="zero-grad-keeps-tensors",
    title="zero_grad() fills gradients with zeros instead of freeing them",
    severity="low",
    inputs="the set_to_none argument of the job's zero_grad calls",
    threshold="zero_grad(set_to_none=False) seen",
    why="Zeroing writes every gradient tensor each step; set_to_none=True (the default since "
        "PyTorch 2.0) frees them and the next backward allocates them with the first write.",
    doc=f"{GUIDE}#use-parameter-grad-none-instead-of-model-zero-grad-or-optimizer-zero-grad",
    can_apply=True,
)
def zero_grad_keeps_tensors(facts: Facts) -> Evidence | None:
    set_to_none = facts.need(facts.config.get("zero_grad_set_to_none"), "a zero_grad call")
    if set_to_none:
        return None
    return Evidence(
        observed="optimizer.zero_grad(set_to_none=False) zeroes every gradient tensor each step",
        numbers={"set_to_none": False},
        fix="optimizer.zero_grad(set_to_none=True)",
        gain_text="one memset per parameter tensor per step less, and less memory between steps",
    )


@rule(
    id="conv-bias-before-bn",
    title="Convolutions with a bias directly followed by BatchNorm",
    severity="low",
    inputs="the model's layers in execution order",
    threshold="any Conv with bias=True whose output goes straight into a BatchNorm of the same channels",
    why="BatchNorm subtracts the per-channel mean, so the conv's bias cancels out: wasted "
        "parameters, gradient and optimizer work.",
    doc=f"{GUIDE}#disable-bias-for-convolutions-directly-followed-by-a-batch-norm",
)
def conv_bias_before_bn(facts: Facts) -> Evidence | None:
    layers = [name for model in facts.models for name in model.get("conv_bias_before_batchnorm") or []]
    if not layers:
        return None
    return Evidence(
        observed=f"{len(layers)} convolution(s) with bias feed a BatchNorm: {', '.join(repr(name) for name in layers[:5])}",
        numbers={"layers": layers},
        fix="nn.Conv2d(in_channels, out_channels, kernel_size, bias=False)   # followed by nn.BatchNorm2d",
        gain_text="fewer parameters and a little less work per step",
    )


@rule(
    id="eval-with-grad",
    title="Evaluation forwards build autograd graphs",
    severity="medium",
    inputs="forwards of the model in eval() mode and whether autograd was recording",
    threshold="any forward of a model in eval() mode with grad enabled",
    why="model.eval() changes dropout and BatchNorm but not autograd: without no_grad the "
        "forward keeps every activation for a backward that never comes (time and memory).",
    doc=f"{GUIDE}#disable-gradient-calculation-for-validation-or-inference",
)
def eval_with_grad(facts: Facts) -> Evidence | None:
    count = facts.habits.get("eval_forwards_with_grad")
    if count is None:
        raise Missing("model forwards")
    if not count:
        return None
    return Evidence(
        observed=f"{count} forwards of the model in eval() mode ran with autograd recording",
        numbers={"eval_forwards_with_grad": count},
        fix="model.eval()\nwith torch.inference_mode():   # or torch.no_grad()\n    outputs = model(x)",
        gain_text="evaluation without saved activations: faster and much less memory",
    )


UNUSED_GRAPHS_MIN = 2  # forwards: one alone may be a warm-up or a model summary at start


@rule(
    id="unused-forward-graph",
    title="Training-mode forwards build autograd graphs that no backward uses",
    severity="medium",
    inputs="the root models' forwards in train() mode with autograd on (detail steps), and whether a "
           "backward reached their output within a step",
    threshold=f"{UNUSED_GRAPHS_MIN} or more such forwards whose output no backward reached",
    why="A forward in train() mode with autograd on records a graph and keeps every activation it "
        "needs for a backward; a forward whose output only feeds a sample image, a log line or a "
        "metric pays for both and frees them unused (pytorch/examples' DCGAN samples its generator "
        "this way every 100 iterations).",
    doc=f"{GUIDE}#disable-gradient-calculation-for-validation-or-inference",
)
def unused_forward_graph(facts: Facts) -> Evidence | None:
    watched = facts.habits.get("training_forwards_watched")
    if not watched:
        raise Missing("training forwards")
    unused = facts.habits.get("training_forwards_unused") or 0
    if unused < UNUSED_GRAPHS_MIN:
        return None
    models = facts.habits.get("unused_forward_models") or {}
    named = ", ".join(f"{name} ({count})" for name, count in sorted(models.items(), key=lambda item: -item[1]))
    name = max(models, key=models.get) if models else "model"
    return Evidence(
        observed=f"{unused} of {watched} training forwards watched built a graph no backward used: {named}",
        numbers={"training_forwards_unused": unused, "training_forwards_watched": watched,
                 "unused_share": unused / watched, "models": models},
        fix=f"with torch.no_grad():   # the {name} forwards whose output no backward uses (samples, logs)\n"
            f"    output = {name.lower()}(inputs)",
        gain_text="those forwards without a recorded graph: no saved activations (memory) and less work",
    )


@rule(
    id="debug-tools-on",
    title="Debugging tools are left on during training",
    severity="high",
    inputs="autograd anomaly detection and profiler state",
    threshold="anomaly detection or the autograd profiler enabled while training",
    why="Anomaly detection records a traceback for every autograd node and checks every "
        "backward output for NaN (commonly 2-10x slower steps); a profiler records every op.",
    doc=f"{GUIDE}#disable-debugging-apis",
)
def debug_tools_on(facts: Facts) -> Evidence | None:
    debug = facts.need(facts.config.get("debug"), "debug state")
    on = [name for name in ("anomaly_detection", "profiler") if debug.get(name)]
    if not on:
        return None
    fixes = {"anomaly_detection": "torch.autograd.set_detect_anomaly(False)   # only while hunting a NaN",
             "profiler": "# stop torch.profiler / autograd.profiler outside the steps you profile"}
    return Evidence(
        observed=" and ".join(name.replace("_", " ") for name in on) + " enabled during training",
        numbers={name: True for name in on},
        fix="\n".join(fixes[name] for name in on),
        gain_text="anomaly detection alone commonly slows steps 2-10x",
    )


@rule(
    id="single-tensor-optimizer",
    title="The optimizer updates parameters one tensor at a time on the GPU",
    severity="medium",
    inputs="the optimizer's implementation (for-loop, foreach, fused) and parameter devices; optimizer share",
    threshold="a for-loop optimizer over CUDA parameters",
    why="The for-loop implementation launches several kernels per parameter tensor; foreach "
        "batches them and fused does the whole update in one kernel per group (about half "
        "the optimizer time or less).",
    doc="https://docs.pytorch.org/docs/stable/optim.html#algorithms",
)
def single_tensor_optimizer(facts: Facts) -> Evidence | None:
    slow = [o for o in facts.optimizers if o.get("implementation") == "for-loop" and "cuda" in (o.get("devices") or ())]
    if not slow:
        if not any("cuda" in (o.get("devices") or ()) for o in facts.optimizers):
            raise Missing("CUDA parameters")
        return None
    share = facts.window.get("optimizer_ratio")
    name = slow[0]["class"]
    return Evidence(
        observed=f"{name} runs its for-loop implementation"
                 + (f"; the optimizer takes {percent(share)} of a step" if share is not None else ""),
        numbers={"optimizer": name, "optimizer_ratio": share},
        fix=f"optimizer = torch.optim.{name}(model.parameters(), lr=..., fused=True)   # or foreach=True",
        gain=share / 2 if share is not None else None,
    )


MIN_STEPS_FOR_SCHEDULE = 100


@rule(
    id="no-lr-schedule",
    title="No learning-rate schedule",
    severity="low",
    inputs="whether an LR scheduler wraps the optimizer; the learning rate read on detail steps",
    threshold=f"no scheduler and an unchanged learning rate after {MIN_STEPS_FOR_SCHEDULE} steps",
    why="A warm-up and decay (OneCycleLR, cosine) usually reaches the same loss in fewer steps; "
        "low severity because a constant LR can be deliberate.",
    doc="https://docs.pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate",
)
def no_lr_schedule(facts: Facts) -> Evidence | None:
    optimizers = facts.optimizers
    steps = (facts.snapshot.get("totals") or {}).get("steps") or 0
    if steps < MIN_STEPS_FOR_SCHEDULE:
        raise Missing("enough steps")
    # A scheduler declared, or a rate that changed as the job ran (a loop that sets
    # group["lr"] itself each iteration: warm-up and cosine written out by hand).
    if any(o.get("lr_scheduler") or (o.get("lr_measured") or {}).get("changes") for o in optimizers):
        return None
    return Evidence(
        observed=f"{optimizers[0]['class']} ran {steps} steps at a constant learning rate",
        numbers={"optimizer": optimizers[0]["class"], "lr": optimizers[0].get("lr"), "steps": steps},
        fix="scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps)\n"
            "# after optimizer.step():\nscheduler.step()",
        gain_text="fewer steps to the same loss",
    )


MIN_NORMS = 8  # gradient norms read before the rule judges them


def _round_up(value: float) -> float:
    """The first one-significant-digit number at or above `value` (2.37 -> 3, 0.046 -> 0.05)."""
    scale = 10.0 ** math.floor(math.log10(value))
    return math.ceil(value / scale - 1e-9) * scale


@rule(
    id="no-grad-clipping",
    title="Exploding gradients without gradient clipping",
    severity="low",
    inputs="the gradient norm each update uses (clip_grad_norm_'s figure), read on sampled steps before "
           "optimizer.step() (after the backward where parameters are updated by hand); gradient-clipping calls "
           "on watched steps; GradScaler",
    threshold=f"no clip_grad_norm_/clip_grad_value_ call and a gradient norm > {SPIKE_FACTOR:g}x the median "
              f"of the {SPIKE_HISTORY} read before it (and >= {percent(SPIKE_FLOOR)} of the largest before it) "
              f"that the next norm read falls back from (under 1/{SPIKE_FALLBACK:g} of it), "
              "or a non-finite norm without a GradScaler; "
              f"at least {MIN_NORMS} norms read",
    why="An exploding gradient (a bad batch, an unstable layer) shows in the gradient's norm, and "
        "clipping bounds the update it would make; within an order of magnitude the norm moves with "
        "minibatch noise alone, and a model that has fit its data has norms near zero, where a tenfold "
        "leap is noise too. Judged on gradients, not losses: a loss near zero that changes sign "
        "(a policy gradient's) leaps tenfold with nothing wrong. Under GradScaler non-finite "
        "gradients are expected and handled (steps skipped). Norms are read on sampled steps: a "
        "spike on one step in a thousand may go unseen.",
    doc="https://docs.pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html",
)
def no_grad_clipping(facts: Facts) -> Evidence | None:
    habits = facts.habits
    if habits.get("clip_grad_calls"):
        return None
    if not habits.get("watched_steps"):
        raise Missing("a watched step (gradient clipping is seen on those)")
    norms = habits.get("grad_norms") or {}
    if norms.get("skipped"):
        raise Missing(f"gradient norms ({norms['skipped']})")
    read = norms.get("samples") or 0
    if read < MIN_NORMS:
        raise Missing(f"{MIN_NORMS} gradient norms (read on sampled steps; {read} so far)")
    spikes = norms.get("spikes") or 0
    nonfinite = norms.get("nonfinite") or 0 if not facts.scaler.get("enabled") else 0
    if not spikes and not nonfinite:
        return None
    parts = []
    if spikes:
        parts.append(f"the gradient norm reached {norms['largest_norm']:.3g}, {norms['largest_ratio']:.0f}x the median of "
                     f"the norms read before it ({norms['median_before']:.3g}), at step {norms['largest_step']}; "
                     f"{spikes} such spike{'s' if spikes > 1 else ''} (> {SPIKE_FACTOR:g}x)")
    if nonfinite:
        parts.append(f"{nonfinite} non-finite norm{'s' if nonfinite > 1 else ''}")
    typical = norms.get("median")  # clip a little above the usual norm: the spikes, not the steps
    max_norm = _round_up(2 * typical) if typical and math.isfinite(typical) and typical > 0 else 1.0
    return Evidence(
        observed="; ".join(parts) + f" among {read} norms read, and no gradient clipping",
        numbers={"spikes": spikes, "nonfinite_norms": nonfinite, "norms_read": read,
                 "largest_norm": norms.get("largest_norm"), "largest_ratio": norms.get("largest_ratio"),
                 "median_before": norms.get("median_before"), "largest_step": norms.get("largest_step"),
                 "median_norm": norms.get("median"), "p90_norm": typical, "max_norm": max_norm},
        fix=facts.spoken(
            "loss.backward()\n"
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={max_norm:g})  # twice its usual norm\n"
            "optimizer.step()",
            lightning=f"trainer = L.Trainer(..., gradient_clip_val={max_norm:g})  # twice the usual norm",
            transformers=f"TrainingArguments(..., max_grad_norm={max_norm:g})  # twice the usual norm",
            accelerate="accelerator.backward(loss)\n"
                       f"accelerator.clip_grad_norm_(model.parameters(), max_norm={max_norm:g})  # twice the usual norm\n"
                       "optimizer.step()"),
        gain_text="steadier training (bounded updates)",
    )


FILE_WRITE_SHARE = 0.05  # of the step time


@rule(
    id="file-writes-in-step",
    title="The training step writes files or figures",
    severity="medium",
    inputs="calls of torch.save, numpy.save/savez/savetxt, matplotlib's savefig, PIL's Image.save and "
           "torchvision's save_image on watched steps, their time and source lines",
    threshold=f"those writes take >= {percent(FILE_WRITE_SHARE)} of the step time (watched steps' mean)",
    why="A write inside the step holds the training loop on the disk (or a network filesystem) and, for "
        "a figure, on rendering: the GPU idles meanwhile. A checkpoint or a sample image every few "
        "hundred steps costs little; every step, it can cost more than the step. Watched steps are a "
        "sample: writes rarer than one in ~50 steps may go unseen.",
    doc="https://docs.pytorch.org/docs/stable/distributed.checkpoint.html",
)
def file_writes_in_step(facts: Facts) -> Evidence | None:
    habits = facts.habits
    per_step = habits.get("file_write_seconds_per_step")
    if per_step is None:
        raise Missing("a watched step")
    step = facts.window["step_seconds"]["median"]
    share = per_step / step if step else 0.0
    if share < FILE_WRITE_SHARE:
        return None
    sources = habits.get("file_write_sources") or []
    where = ", ".join(s["location"] for s in sources[:3])
    return Evidence(
        observed=f"the step writes {habits['file_writes_per_step']:.1f} files or figures per step, taking "
                 f"{per_step * 1e3:.1f} ms of a {step * 1e3:.1f} ms step ({percent(share)})"
                 + (f", at {where}" if where else ""),
        numbers={"writes_per_step": habits["file_writes_per_step"], "write_seconds_per_step": per_step,
                 "share": share, "sources": sources, "watched_steps": habits.get("watched_steps")},
        fix="if step % 500 == 0:   # write every N steps, not every step\n"
            "    torch.save(model.state_dict(), path)\n"
            "# checkpoints off the training thread: torch.distributed.checkpoint.async_save;\n"
            "# figures: log the numbers every step, plot them after (or every N steps)",
        gain=min(1.0, share),
    )


GC_SHARE = 0.02  # of the training time, in full collections
GC_SHARE_HIGH = 0.10
MIN_FULL_COLLECTIONS = 2  # one alone may be the first after set-up: the job's own objects settling


@rule(
    id="gc-pauses",
    title="Full garbage collections stop the training loop",
    severity="medium",
    inputs="Python's garbage collections from the first step on (gc.callbacks: each one's generation and "
           "time, outside evaluation phases); the training time; gc.freeze()'s count",
    threshold=f">= {MIN_FULL_COLLECTIONS} full (generation 2) collections taking >= {percent(GC_SHARE)} of the "
              f"training time (high from {percent(GC_SHARE_HIGH)})",
    why="A full collection traverses every container object the process holds (torch's import alone leaves "
        "some 170,000) with the GIL held: every thread of the job stops, 100 ms or more each time on a CPU "
        "host. It comes whenever enough objects have survived since the last one, so a loop that keeps a "
        "little of each step meets one every few hundred steps. gc.freeze() once set-up is done takes what "
        "exists out of every later collection; what the job makes afterwards is still collected.",
    doc="https://docs.python.org/3/library/gc.html#gc.freeze",
    can_apply=True,
)
def gc_pauses(facts: Facts) -> Evidence | None:
    collector = facts.need(facts.habits.get("gc"), "garbage collections timed")
    trained = facts.totals.get("seconds") or 0.0
    full, spent = collector["collections"][2], collector["seconds"][2]
    ours = collector.get("tuneup_freeze")
    if ours:  # apply mode's gc.freeze() in effect: the job's collections since it, over the time since
        full, spent, trained = ours["full_collections"], ours["full_seconds"], ours["wall_seconds"]
    if full < MIN_FULL_COLLECTIONS or not trained:
        return None
    share = min(1.0, spent / trained)  # (the pauses fall inside the steps they stop)
    if share < GC_SHARE:
        return None
    frozen = collector.get("frozen") or 0
    each = collector.get("full_median_seconds") or spent / full
    longest = collector.get("full_max_seconds") or each
    if ours:
        each = longest = spent / full  # (the pauses the collector keeps reach back before the freeze)
        fix = (f"# apply mode froze {ours.get('objects') or frozen:,} objects from step {ours['from_step']} on, and the full collections since\n"
               "# still take this long: what they traverse is the job's own since then. Keep per-step objects\n"
               "# out of long-lived lists (log Python floats, not dicts of tensors)")
    elif frozen:
        fix = (f"# gc.freeze() has run ({frozen:,} objects frozen), and the full collections still take this long:\n"
               "# what they traverse was made after it. Call it later, once everything set-up builds exists\n"
               "# (datasets loaded, caches filled), and keep per-step objects out of long-lived lists\n"
               "# (log Python floats, not dicts of tensors)")
    else:
        fix = ("import gc\n"
               "# ... build the model, optimizer, datasets and DataLoaders, then, right before the training loop:\n"
               "gc.collect()\n"
               "gc.freeze()   # later collections skip every object that exists now")
    return Evidence(
        observed=f"{full} full garbage collections took {spent:.2f} s of {trained:.1f} s of training "
                 f"({percent(share)}): {each * 1e3:.0f} ms each (median), the longest {longest * 1e3:.0f} ms; "
                 f"the loop stops for each"
                 + (f" since apply mode's gc.freeze() at step {ours['from_step']}" if ours
                    else f" ({frozen:,} objects already frozen by gc.freeze())" if frozen else ""),
        numbers={"full_collections": full, "full_seconds": spent, "training_seconds": trained, "share": share,
                 "full_median_seconds": each, "full_max_seconds": longest, "frozen": frozen,
                 "collections": collector["collections"], "seconds": collector["seconds"]},
        fix=fix,
        gain=min(0.9, share),
        severity="high" if share >= GC_SHARE_HIGH else None,
        can_apply=not (frozen or ours),  # the gc-freeze action leaves a freeze of the job's alone, and is done after its own
    )
