"""The terms the probes record in and the tests over what they recorded, without torch.

The rules, the AMP action and the reports read these; the probes that write the records
(measure/syncs.py, copies.py, gradients.py, precision.py, config.py) import them from here.
Nothing here imports torch, so reading a run log (`tuneup report`, the rules over a recorded
run) never pays torch's import (2.6 s of CPU on this project's CI machine):
tests/test_report_cli.py runs a report with torch made unimportable.
"""

from __future__ import annotations

from typing import Any

from .windows import DETECT

# -- Host reads: the kinds a read is recorded under (measure/syncs.py) ----------------------

# A host-to-device copy from pageable memory that the host waits for (measure/copies.py).
BLOCKING_COPY_KIND = "blocking_copy"

# Reads that torch's own code makes for itself, before any user frame: not the loop's to
# remove. GradScaler.step reads found_inf; a closure optimizer (LBFGS) reads the closure's
# loss and compares tensors on the host (torch/optim/lbfgs.py: `float(orig_loss)`, the
# `<= tolerance` tests), inside the optimizer's step but after the closure's forward has
# left the optimizer's region.
GRAD_SCALER_KIND = "grad_scaler"
OPTIMIZER_KIND = "optimizer"
INHERENT_KINDS = (GRAD_SCALER_KIND, OPTIMIZER_KIND)

# Reads torch.distributions makes to validate arguments and samples (on by default:
# Distribution.__init__ and _validate_sample end in `if not torch._is_all_true(valid): raise`,
# torch/distributions/distribution.py): their own kind, with their own fix (validate_args=False).
DISTRIBUTION_CHECK_KIND = "distribution check"


# -- Gradient norms (measure/gradients.py) -------------------------------------------------

# A spike: a norm over SPIKE_FACTOR times the median of the SPIKE_HISTORY norms read before it
# (at least MIN_BEFORE of them). Minibatch noise moves a norm a few times over (a policy
# gradient's 6x, tests/test_gradients.py); a corrupt batch or an exploding gradient, tens.
SPIKE_FACTOR = 10.0
SPIKE_HISTORY = 8
MIN_BEFORE = 4
# And at least this share of the largest norm read before it: a model that has fit its data
# has norms near zero, where a tenfold leap is noise (2e-4 after 1.5e-5 on a classifier whose
# first norms were ~1: tests/programs/trainer_callbacks.py), not an exploding gradient.
SPIKE_FLOOR = 0.1
# And a step's, not a climb's: the next norm read falls back under 1/SPIKE_FALLBACK of it (the
# last one read stands until then). A conv net with BatchNorm at a stable learning rate
# (benchmarks/advice_scenarios.py "conv bias before BN") has norms that wander from 0.5 to 20
# over its 240 steps (every 8th of the loop's own: ... 0.8, 4.9, 5.9, 3.4, 8.3, 14.7, 8.4, 7.2 ...):
# 8 sampled in a low stretch had a median of 1.2, the next read 14, a "spike" in 1 run of 12.
SPIKE_FALLBACK = 3.0


# -- Autocast: the measured trial (measure/precision.py) and the AMP action's tests --------

# Faster under autocast in this share of the pairs, at least: a clear result (amp-off's test;
# 9 of 12 by chance: 7%). A first block between half and this is unclear: a loaded machine
# flips pairs whichever is faster (a 25% gain measured 8 of 12 beside a busy process, and 12 of
# 12 before and after the run), so one more block of REPS pairs is timed, within the budget
# again, and the result is over both (18 of 24 by chance: 1%).
CONSISTENT = 0.75

# Of the interleaved pairs, those faster under autocast before apply mode changes the job's
# numerics on the strength of it: a switch it would undo leaves its trace (the weights updated
# in bf16 meanwhile), so it is made only where undoing it is unlikely. And at least
# SHADOW_MIN_PAIRS of them: with fewer, "all faster" is a sign test's p of 1/8 to 1/32 (beside
# busy processes, 3 of 3 pairs once said 3.4x faster of a model doing 9 passes under autocast
# against 5 in fp32); from 6 on, p <= 1/64 at any 90% outcome.
SHADOW_CLEAR = 0.9
SHADOW_MIN_PAIRS = MIN_PAIRS = 6


def shadow_refusal(trial: dict[str, Any] | None) -> str | None:
    """Why this measurement is not clear enough for apply mode to switch autocast on (None:
    it is): measured off the job's steps, and faster in at least SHADOW_CLEAR of at least
    SHADOW_MIN_PAIRS pairs."""
    if not trial or trial.get("skipped") or not trial.get("pairs"):
        reason = f" ({trial['skipped']})" if trial and trial.get("skipped") else ""
        return ("its gain was not measured on this job's model" + reason + ", and a trial on the job's own "
                "steps would leave its bf16 updates in the weights if undone; switch it on yourself")
    pairs, faster = trial["pairs"], trial.get("faster_pairs") or 0
    if pairs < SHADOW_MIN_PAIRS or faster < SHADOW_CLEAR * pairs:
        return (f"autocast was faster in {faster} of {pairs} pairs timed off the job's steps, not clear enough "
                "to change the run's numerics (a trial undone would leave its bf16 updates in the weights); "
                "switch it on yourself, or a run on a quieter machine measures it again")
    return None


def small_gain_refusal(gain: float | None, trial: dict[str, Any] | None) -> str | None:
    """Why apply mode leaves autocast to the user although the timing was clear (None: it does
    not): what it saves makes under DETECT of the job's step (amp-off's gain: the model's share
    of the step). A trial's windows would not show it: it would be kept as "not slower" with no
    gain shown (a 1.26x forward + backward, 6% of a step with CPU augmentation beside it: kept
    at 1.01x), or, undone, leave its bf16 updates in the weights; the run's numerics are not
    changed for that."""
    if gain is None or gain >= DETECT:
        return None
    speedup = (trial or {}).get("speedup")
    return ((f"its {speedup:.2f}x on the model's forward + backward" if speedup else "its measured speed-up")
            + f" makes about {gain:.0%} of a step, under the {DETECT:.0%} a trial on the job's steps can confirm; "
            "the run's numerics are not changed for that: switch it on yourself if you want it")


# Optimizers whose step() takes a closure and re-evaluates the model inside it.
CLOSURE_OPTIMIZERS = ("LBFGS",)


def amp_refusal(config: dict[str, Any]) -> str | None:
    """Why apply mode's AMP action cannot try autocast in a job of this configuration (its
    models' amp_facts, its optimizers' classes, `distributed.initialized`), in one phrase; None
    where it can. The one test of it: the action refuses by it (act/actions/amp.py Amp.propose)
    and the amp-off rule asks it, so a finding never says apply mode can make a change the
    action then refuses."""
    models = config.get("models") or []
    for model in models:
        if model.get("compiled"):
            return f"{model.get('class')} is compiled: set autocast in the code before compiling"
    for model in models:
        if model.get("forward_on_instance"):
            return (f"{model.get('class')}.forward is replaced on the instance (a wrapper owns it); "
                    "tuneup leaves it alone")
    if any(model.get("sparse_gradients") for model in models):
        return "the model has sparse gradients (Embedding(sparse=True)), which the guard cannot check"
    closures = sorted({optimizer.get("class") for optimizer in config.get("optimizers") or []} & set(CLOSURE_OPTIMIZERS))
    if closures:
        return f"{', '.join(closures)} re-evaluates the model in its closure"
    if (config.get("distributed") or {}).get("initialized"):
        return "a distributed job: each rank would keep or roll back autocast on its own"
    return None
