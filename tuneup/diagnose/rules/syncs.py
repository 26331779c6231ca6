"""Host-device synchronizations in the training loop."""

from __future__ import annotations

from ...measure.terms import BLOCKING_COPY_KIND, DISTRIBUTION_CHECK_KIND, GRAD_SCALER_KIND, INHERENT_KINDS, OPTIMIZER_KIND
from ...format import read_rate
from ..rule import Evidence, Facts, rule
from .compiled import compile_fix, gpu_busy_share

SYNCS_PER_STEP = 1.0


FRAMEWORK_SYNC = "transformers/trainer.py"  # where the HF Trainer reads each step's loss (nan/inf filter)
# Where transformers reads each forward's attention mask to see whether any token is padding
# (transformers 5 masking_utils `padding_mask.all()`, so that SDPA or FlashAttention can run
# without a mask; 4.x modeling_attn_mask_utils `torch.all(mask == 1)`): two reads a step in a
# BERT fine-tune. It is skipped while tracing (masking_utils: `is_tracing(padding_mask)`, true
# under torch.compile) and where the batch has no mask.
MASK_CHECK_SYNC = ("transformers/masking_utils.py", "transformers/modeling_attn_mask_utils.py")
# Lightning's own reads: the values its progress bar and loggers show, read on each refresh
# (lightning/fabric/utilities/apply_func.py to_item, from the progress bar's get_metrics).
LIGHTNING_SYNC = ("lightning/pytorch/", "lightning/fabric/", "pytorch_lightning/", "lightning_fabric/")


@rule(
    id="host-syncs",
    title="The loop reads device values on the host every step",
    severity="medium",
    inputs="host-device syncs counted on sampled steps, with their source lines",
    threshold=f">= {SYNCS_PER_STEP:g} sync per step on average",
    why="Syncs inside GradScaler.step (it reads whether gradients overflowed) and inside an optimizer's own "
        "code (LBFGS reads its closure's loss) are not counted: the loop cannot remove them; nor are "
        "blocking host-to-device copies (see pageable-copies). "
        "Each sync stops the host until the GPU has finished all queued work, so the host can "
        "no longer run ahead and the GPU idles while the next kernels are launched. One per step "
        "already drains the queue every step.",
    doc="https://docs.pytorch.org/tutorials/recipes/recipes/tuning_guide.html#avoid-unnecessary-cpu-gpu-synchronization",
)
def host_syncs(facts: Facts) -> Evidence | None:
    syncs = facts.syncs
    by_kind = syncs.get("by_kind") or {}
    # torch's own reads are not the loop's to remove; blocking copies have their own fix
    # (the pageable-copies rule).
    elsewhere = INHERENT_KINDS + (BLOCKING_COPY_KIND,)
    per_step = syncs["per_step"] - sum(by_kind.get(kind, 0.0) for kind in elsewhere)
    if per_step < SYNCS_PER_STEP:
        return None
    sources = [s for s in syncs.get("top_sources") or [] if s["kind"] not in elsewhere]
    where = "; ".join(f"{s['kind']} at {s['location']} ({read_rate(s)})" for s in sources[:3])
    on_gpu = syncs.get("backend") == "cuda"
    gain = None
    gain_text = None
    if on_gpu:
        window = facts.window
        gpu = (window.get("gpu_seconds") or {}).get("median")
        step = window["step_seconds"]["median"]
        if gpu is not None and step:
            busy = gpu_busy_share(facts, gpu, step)
            idle = max(0.0, 1 - busy - (window.get("stall_ratio") or 0))
            gain = idle
            gain_text = f"up to {100 * idle:.0f}% shorter steps (the GPU idles {100 * (1 - busy):.0f}% of a step)"
    else:
        gain_text = "on a GPU: the host runs ahead of the GPU instead of waiting for it every step"
    meaning = "syncs" if on_gpu else "host reads that would sync on a GPU"
    fix = ("running_loss += loss.detach()            # stays on the device: no sync\n"
           "if step % 100 == 0:\n"
           "    print(running_loss.item() / 100)     # one sync every 100 steps\n"
           "    running_loss.zero_()")
    if any(s["kind"] == DISTRIBUTION_CHECK_KIND for s in sources[:3]):
        fix = ("torch.distributions.Distribution.set_default_validate_args(False)  # once, at the start: no check\n"
               "# of every distribution's arguments and samples (each a read); or per distribution:\n"
               "# Categorical(probs, validate_args=False)\n" + fix)
    if any(part in s["location"] for s in sources[:1] for part in LIGHTNING_SYNC):
        # Measured on a Lightning 2.6 job logging its loss with prog_bar=True: 2.1 reads a step,
        # 0 with prog_bar=False, 1.1 with TQDMProgressBar(refresh_rate=50) (not offered).
        fix = ("self.log(\"train_loss\", loss, prog_bar=False)   # a progress-bar value is read to the host "
               "every step\n# or: L.Trainer(..., enable_progress_bar=False)")
    # transformers' own reads, where they lead: each one's knob, in the order they rank.
    knobs = [knob for knob in dict.fromkeys(_transformers_read(s["location"]) for s in sources[:3]) if knob]
    if knobs and _transformers_read(sources[0]["location"]):
        fix = "\n".join(NAN_FILTER_FIX if knob == "nan" else compile_fix(facts) + MASK_CHECK_NOTE for knob in knobs)
    return Evidence(
        observed=f"{per_step:.1f} {meaning} per step" + (f": {where}" if where else ""),
        numbers={"syncs_per_step": per_step, "grad_scaler_syncs_per_step": by_kind.get(GRAD_SCALER_KIND, 0.0),
                 "optimizer_syncs_per_step": by_kind.get(OPTIMIZER_KIND, 0.0), "backend": syncs.get("backend"),
                 "sampled_steps": syncs.get("sampled_steps"), "top_sources": sources[:5]},
        fix=fix,
        gain=gain,
        gain_text=gain_text,
        severity="high" if per_step >= 3 and on_gpu else None,
    )


def _transformers_read(location: str) -> str | None:
    """Which of transformers' own reads a source line is: the Trainer's NaN/inf filter ("nan"),
    the attention-mask check ("mask"), or None."""
    if FRAMEWORK_SYNC in location:
        return "nan"
    return "mask" if any(part in location for part in MASK_CHECK_SYNC) else None


NAN_FILTER_FIX = ("TrainingArguments(..., logging_nan_inf_filter=False)   # the Trainer stops reading every step's loss\n"
                  "# (a NaN loss then shows in the logged loss instead of being skipped in it)")
# After compile_fix (in the job's framework's words): transformers skips the check while tracing.
MASK_CHECK_NOTE = ("\n# transformers checks each forward's attention mask for padding (a read), except while tracing;\n"
                   "# or, where batches have no padding (packed, fixed-length sequences), leave attention_mask out of them")
