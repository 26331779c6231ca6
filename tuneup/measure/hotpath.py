"""The hot path: everything tuneup runs on every training step, in one place.

A step of `for x, y in loader: opt.zero_grad(); loss = f(model(x), y); loss.backward();
opt.step()` calls, in order (all of it together: about 37,000 instructions per step on the
~0.15 ms CPU step, 4.2% of it, by benchmarks/bench_instructions.py, some 5,000 of them the
gradient norms' share, paced to 0.5% of the step; 28,000 on a plain step, 8,000 of them what
intercepting these calls costs before any work is done (bench_instructions.py --floor); 261
Python operations a step, the paced detail steps' share included (counted by
benchmarks/bench_operations.py, by function), each costing some 30 ns in place there,
and a detail step 1,000 operations more, paced by what detail steps are measured to cost (some
260 µs each on that step, the gradient norm's included: StepTimeline.pace), one in ~900 there):

    next(it)           loader_next       clock x2, data wait, samples; the step boundary
                        └ when an optimizer stepped since the last fetch: StepTimeline.close
                          (one record tuple into the ring; its listeners only on detail
                          steps and on the steps they asked for through `wake_at`)
    opt.zero_grad()    zero_grad_before/after   Optimizer.zero_grad: one attribute test off
                                                hooked steps (Module.zero_grad: a call)
    model(x)           forward_before/after     the root class's forward: a compile check and
                                                two attribute tests off hooked steps, unless
                                                the module is in eval() mode (an evaluation
                                                phase: evaluation_forward .. evaluation_ends)
    loss.backward()    backward_before/after    one attribute test off hooked steps
    opt.step()         optimizer_pre/post       torch's global step hooks: a set test and a
                                                few counters; the boundary rule for loops
                                                without a fetch; optimizer time on detail steps;
                                                a closure passed to step() wrapped (closure_of:
                                                the loop's code, its reads the loop's). The
                                                pre-hook is in torch's registry only on the
                                                steps that need it: in a loop whose steps close
                                                at a fetch, detail and sampled steps
                                                (OptimizerProbe.fit_pre_hook, at due closes)
    x.item() ...       HOST_READ                torch's own off sampled steps (syncs.py install)

On detail steps (the first five, then one drawn at random from every `detail_every`: 4, or
more on steps under a millisecond, StepTimeline.pace; and apply mode's guarded steps) the
wrappers time the forward, backward, zero_grad and optimizer, the input before the first
forward (input_ended), and keep the loss for reading at the close; on those where its
series is due (gradients.py: at most 0.5% of the training time), the optimizer pre-hook (or,
in a loop without one, the backward's end) takes the gradient norm, out of the update's time;
a root's training forward gets a pre-hook on its output's grad_fn (model.ForwardGraphs: is
its graph used by a backward?), about 5 µs a forward, most of it torch's register_prehook.
`hooked`, the wrappers' gate, is True on detail steps, while an evaluation phase is open, and
in loops that update their parameters by hand (every step: their boundary is a forward).

The step boundary is one rule, `StepTimeline.moved_on` (for loops that update their
parameters by hand: `hand_update`, decided by ModelProbe.hand_boundary; for updates no hook
sees, a training step compiled whole: the fetch, or the next backward, after the parameters
changed since a backward, ModelProbe.parameters_moved); the hooks call it only when it has
something to do. Every hook is a closure over its probe and the timeline (no bound-method or
global lookups on the way), reads its clock through the probe (`probe.clock`, so a test can
break one probe alone), and hands any error of its own to the probe's `fail` (one warning,
the probe off), never to the job.

Allocations per step: the wrappers' call tuples (args, and kwargs where given), one record
tuple of six at the close (the totals that move only on detail steps: one tuple those steps'
closes make, steps.py record) and the empty list of the next step's optimizers; on detail
steps the loss's detached tensor. Counters only grow (no
per-step reset): the background thread takes differences between consecutive records
(steps.py: StepRing.columns).

Measured in place, every Python operation here costs several times its warm cost (torch
evicts our code and data between hooks), so these functions do as little as they can; host
reads and calls are looked at only on sampled/watched steps (syncs.py, calls.py).
"""

from __future__ import annotations

import math
from time import perf_counter
from typing import Any, Callable

import torch

from .._patching import CALL_ORIGINAL, COMPILING, compile_check, unwind
from .steps import EARLY_DETAIL_STEPS, StepRing, record, sampled_after

TAG = "_tuneup_measured"  # an iterator of a loader the job named (explicit mode)
DETAIL_EVERY = 4  # one detail step drawn from every 4 (after the first five): StepTimeline.pace
# Paced detail steps (StepTimeline.pace): their extra time at most this share of the training
# time, from what a detail step is measured to cost (windows.detail_cost), DETAIL_COST until then.
DETAIL_BUDGET = 0.002  # (at 0.5%, with the hot path's own ~0.45%, the ~3.3 ms CPU step paid 1.2%)
DETAIL_COST = 150e-6  # seconds: ~130 µs measured on the 0.1 ms CPU step of a 2-core host (bench_overhead.py)
# However short the steps, a detail step at least once in this much training time (ten a second:
# the split, the loss and the sync samples keep coming), and at most one in MAX_DETAIL_EVERY.
DETAIL_PERIOD = 0.1  # seconds
MAX_DETAIL_EVERY = 4096  # (steps.py's table of draws repeats after 4,096 blocks)
MIN_PERIOD_EVERY = 256  # ... but one in 256 is always allowed (a step of 0.4 ms or more: the period is not what binds)
OWN_MIN = 1e-4  # seconds of close listeners, at least, that are left out of the job's step (StepTimeline._notify)
PACED_FROM_STEP = 1000  # before it, one in DETAIL_EVERY: short runs keep their samples of the split
# Batches fetched with no optimizer step seen since the last close, after which the updates are
# watched by the parameters' versions (StepTimeline.unseen_fetch): more than the micro-batches
# of most gradient accumulation.
UNSEEN_FETCHES = 32


# --- DataLoader: next(iterator) --------------------------------------------------------------

def loader_next(probe: Any, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The iterator's `__next__`: time blocked on data, the step boundary, batch size."""
    tl, clock, batch_size = probe.timeline, probe.clock, probe.batch_size
    tensor, sequences = torch.Tensor, frozenset((tuple, list))

    def __next__(iterator):
        if not probe.every and (not probe.on or (probe.tracked is not None and not getattr(iterator, TAG, False))):
            try:
                return original(iterator)
            except BaseException as exc:  # the end of an epoch (StopIteration), a Dataset's error
                unwind(exc)  # the job's own traceback, without this frame (_patching.py)
                raise
        began = clock()
        tl.in_loader = True
        try:
            # A fetch the habits or RNG checks want to see: looked at around it, inside its wait.
            batch = original(iterator) if tl.fetches < probe.next_look else probe.fetch_looked(iterator, original)
        except BaseException as exc:
            tl.in_loader = False
            tl.waited(began, clock(), tl.evaluating)
            unwind(exc)
            raise
        tl.in_loader = False
        try:
            # A batch fetched after an optimizer stepped closes the step: StepTimeline.moved_on's
            # rule for a fetch, written out here (the call it saves is some 15 operations of
            # every step), moved_on itself where no step began yet. `own`: tuneup's time at the
            # close (its listeners), not the loop's wait.
            if tl.group:
                tl.closed_at_update = False
                own = tl.close(began)
            else:  # no optimizer stepped since the last fetch: the first step; accumulation; an update no hook saw
                own = tl.unseen_fetch(began)
                if tl.evaluating:  # an evaluation's, if its forward takes it (evaluation_batch)
                    tl.evaluation_source = iterator
            tl.fetches += 1
            try:
                # shape[0], not len() (a Python function: torch/_tensor.py) nor size(0) (torch's
                # argument parser: 125 ns a call where shape[0], a new torch.Size, took 70 ns);
                # an empty batch or a 0-d first tensor raises IndexError (loader.batch_size).
                if type(batch) in sequences and type(first := batch[0]) is tensor:
                    tl.samples += first.shape[0]
                else:
                    tl.samples += batch_size(batch)
            except IndexError:
                tl.samples += batch_size(batch)
            # Timed after the bookkeeping: data wait is what a timer around the loop's
            # next() shows (the few µs of closing the step count as waiting for it), less
            # tuneup's listeners at the close (a precision trial's second: no stall of the job's).
            tl.data_wait += clock() - began - own
        except Exception as exc:
            probe.fail(exc)
        except BaseException as exc:  # a Ctrl-C landing in the bookkeeping: the job's traceback, no frame of ours
            unwind(exc)
            raise
        return batch

    return __next__


# --- optimizer.step(): torch's global step pre- and post-hooks -----------------------------------

def optimizer_hooks(probe: Any) -> tuple[Callable[..., None], Callable[..., None]]:
    """Off detail steps, when a fetch closed the step, the pre-hook only marks the region and
    the post-hook counts: optimizer time is taken on detail steps, like the rest of the split.
    `probe.measured` holds the ids of the optimizers admitted (on, tracked, first step seen).
    After them, apply mode's guards (`guard_before`/`guard_after`, None while no change has
    any: act/action.py LiveJob.add_guard), for every optimizer; they handle their own errors."""
    tl, clock, measured = probe.timeline, probe.clock, probe.measured
    dynamo, flags = compile_check()  # `dynamo() or flags._is_compiling_flag`: is_compiling(), one call

    # A compiled optimizer step (`opt.step = torch.compile(opt.step)`) has dynamo trace torch's
    # step wrapper and the global hooks in it (torch/optim/optimizer.py profile_hook_step):
    # the compile check first folds to True there, so nothing of tuneup's enters the graph, no
    # graph break, no guard on its state. Such a step's boundaries come from the loop's other
    # calls (a fetch, the next forward after a backward).
    def closure_of(closure: Callable[[], Any]) -> Callable[[], Any]:
        """The step's closure (LBFGS; Lightning's automatic optimization runs training_step
        in one): the loop's code, not the optimizer's. Its host reads are the loop's, the
        optimizer's own after it are not (`in_optimizer` again); on detail steps its time
        outside the forwards and backwards is the loop's ("other"), not the update's."""

        def closure_wrapper() -> Any:
            tl.in_optimizer = False
            detail = tl.detail
            began, forward, backward = (clock(), tl.forward, tl.backward) if detail else (0.0, 0.0, 0.0)
            try:
                return closure()
            except BaseException as exc:
                unwind(exc)  # the job's own traceback, without this frame (_patching.py)
                raise
            finally:
                if detail:
                    tl.closure_other += clock() - began - (tl.forward - forward) - (tl.backward - backward)
                tl.in_optimizer = True

        return closure_wrapper

    def optimizer_pre(optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if dynamo() or flags._is_compiling_flag:
            return None
        result = None
        if (key := id(optimizer)) in measured or probe.admit(optimizer):
            if tl.group or tl.detail or kwargs or args[1:]:  # (a slice of a 1-tuple: the empty one, no call)
                result = step_begins(optimizer, key, args, kwargs)
            else:  # most steps: nothing to close, time or wrap
                tl.in_optimizer = True
        if probe.guard_before is not None:  # apply mode's guards, while a change has some
            probe.guard_before(optimizer)
        return result

    def step_begins(optimizer: Any, key: int, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """The pre-hook where the open step may close here (an optimizer stepped in it), on
        detail steps, and with arguments (a closure to wrap)."""
        result = None
        try:
            if tl.group or tl.detail:
                now = clock()
                # An optimizer that already stepped in the open step closes it (a new
                # iteration began without a DataLoader fetch); after tuneup's listeners
                # at that close, the update starts anew.
                if tl.moved_on(now, key):
                    now = clock()
                tl.in_input = False  # a close here opened no input: the optimizer steps
                # Less the forwards, backwards and the rest of a closure inside it.
                tl.optimizer_start = now - tl.forward - tl.backward - tl.closure_other
            tl.in_optimizer = True
            if tl.detail:  # the gradient norm the update will use, on sampled detail steps
                gradients = probe.gradients
                if gradients is not None and gradients.due.get(key, 0) <= tl.ring.count:
                    tl.optimizer_start += gradients.of_optimizer(optimizer)  # its time is not the update's
            # A closure, as torch's step wrapper passes it on: `args` is (optimizer,
            # closure?) and a pre-hook may return new (args, kwargs) (torch/optim/
            # optimizer.py profile_hook_step).
            if kwargs.get("closure") is not None:
                result = args, dict(kwargs, closure=closure_of(kwargs["closure"]))
            elif len(args) > 1 and callable(args[1]):
                result = (args[0], closure_of(args[1])) + tuple(args[2:]), kwargs
        except Exception as exc:
            probe.fail(exc)
        return result

    def optimizer_post(optimizer: Any, args: Any, kwargs: Any) -> None:
        if dynamo() or flags._is_compiling_flag:
            return
        # Every step that ran is counted (GradScaler's skip detection: OptimizerProbe.total_steps):
        # a measured one in the timeline's optimizer_steps, any other here. An optimizer is
        # admitted here where the pre-hook is out of torch's registry (OptimizerProbe.fit_pre_hook).
        if (key := id(optimizer)) in measured or probe.admit(optimizer):
            try:
                tl.in_optimizer = False
                tl.group.append(key)
                tl.optimizer_steps += 1
                tl.last_optimizer_end = clock()
                if tl.detail:
                    now = tl.last_optimizer_end
                    tl.optimizer += now - tl.forward - tl.backward - tl.closure_other - tl.optimizer_start
                    probe.read_rate(optimizer)  # the learning rate this update used
                    if tl.gpu_timer is not None:  # the step's GPU work is queued up to here
                        tl.gpu_timer.optimizer_ended()
                    # Loops without a fetch: the next forward's input starts here (their step
                    # closes at the next optimizer step, after that forward). A loop that
                    # fetches marks it at the close instead (what runs between is not input).
                    if not tl.fetches:
                        tl.in_input = True
                        tl.input_mark = (now, tl.data_wait, tl.optimizer + tl.evaluation)
                if tl.loss is not None:  # (a loop without a fetch may have kept it on the step before)
                    tl.step_loss, tl.loss, tl.wake_at = tl.loss, None, 0  # the close reads it
            except Exception as exc:
                probe.fail(exc)
        else:
            probe.unmeasured_steps += 1
        if probe.guard_after is not None:
            probe.guard_after(optimizer)

    return optimizer_pre, optimizer_post


# --- zero_grad(), forward, backward: `_patching.measured` wrappers' before/after ----------------

def zero_grad_hooks(probe: Any) -> tuple[Callable[..., Any], Callable[..., None]]:
    """Optimizer/Module.zero_grad on detail steps: the set_to_none the loop uses, and the
    time (optimizer time: zeroing gradients is part of the update)."""
    tl, clock = probe.timeline, probe.clock

    def before(args: tuple, kwargs: dict) -> float | None:
        if not probe.on:
            return None
        owner = args[0] if args else None
        if isinstance(owner, torch.optim.Optimizer) and "step" in vars(owner) \
                and id(owner) not in probe.compiled_steps:  # the job set a step of its own: compiled?
            probe.adopt_compiled_step(owner)
        return clock() if tl.detail else None

    def after(began: float, result: Any, args: tuple, kwargs: dict) -> None:
        probe.set_to_none = bool(args[1] if len(args) > 1 else kwargs.get("set_to_none", True))
        tl.optimizer += clock() - began

    return before, after


def forward_hooks(probe: Any) -> tuple[Callable[..., Any], Callable[..., None]]:
    """A root model class's forward: timed on detail steps (True), else untimed (None): not a
    root, or the model being traced (jit.trace, fx) rather than trained. A forward of a
    trained model in eval() mode is an evaluation forward (EVALUATION): the phase it opens is
    timed apart, ended by the next training forward (train() mode, autograd on). Counts evaluation
    forwards that build autograd graphs on the way."""
    tl, clock, roots, tracing, trained = probe.timeline, probe.clock, probe.roots, probe.tracing, probe.trained
    graphs = probe.graphs

    def before(args: tuple, kwargs: dict) -> Any:
        module = args[0]
        key = id(module)
        if key not in roots or not probe.on:
            return None
        if tl.backward_end is not None and tl.forward_depth == 0:  # parameters updated by hand
            probe.hand_boundary(module)
        if module.training:
            tl.forward_fetches = tl.fetches
            if tl.evaluating and probe.grad_enabled():  # a training forward
                tl.evaluation_ends(clock())
        elif not tracing():
            if probe.grad_enabled():
                probe.eval_with_grad += 1
            if key in trained and tl.forward_depth == 0 and not tl.in_optimizer:
                tl.evaluation_forward(clock())
                if tl.fetches != tl.forward_fetches and not tl.group:
                    tl.evaluation_batch(args, kwargs)
                return EVALUATION
        if not tl.detail or tracing():
            return None
        outermost = tl.forward_depth == 0
        if outermost:
            if probe.captures and module.training:
                probe.give_input(module, args[1:], kwargs)
            if probe.read_config_next_forward:
                probe.read_config(module)
        tl.forward_begin(clock())
        if outermost and module.training:
            if not tl.fetches:  # no DataLoader: the step's samples are the forward's batch
                probe.count_input(args, kwargs)
            if probe.grad_enabled():
                return WATCHED
        return True

    def after(token: Any, result: Any, args: tuple, kwargs: dict) -> None:
        if token is EVALUATION:
            tl.evaluation_forward_ended(clock())
            return
        tl.forward_end(clock())
        if token is WATCHED and result is not None:
            graphs.watch(args[0], result, tl.ring.count + 1)  # is its graph used by a backward?

    return before, after


def first_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A module call's first tensor argument (the module itself, args[0], left out; keywords
    after the positional ones), or None: where the batch dimension of its input is read."""
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _never() -> bool:
    return False


def _nothing() -> None:
    return None


EVALUATION = "evaluation"  # forward_hooks' token for an evaluation forward
WATCHED = "watched"  # ... for a root's training forward (train() mode, grad on): model.ForwardGraphs


def backward_hooks(probe: Any) -> tuple[Callable[..., Any], Callable[..., None]]:
    """Tensor.backward: timed on detail steps, where the loss is kept for reading at the
    close; not again inside itself (a tensor subclass's __torch_function__)."""
    tl, clock, plain = probe.timeline, probe.clock, torch.Tensor

    def before(args: tuple, kwargs: dict) -> float | None:
        if not probe.on or probe.backward_depth:
            return None
        if probe.discovering is not None:  # auto mode's first step: the roots are found by now
            probe.end_discovery()
        if not tl.hooked:
            return None
        if tl.backward_end is not None and not tl.fetches:  # by hand, no fetch: changed since the last backward?
            tl.moved_on(clock())
        if tl.evaluating:  # training went on without a forward seen (a compiled one, say)
            tl.evaluation_ends()
        if tl.detail:
            tensor = args[0]
            if type(tensor) is plain and id(tensor) != tl.scaled_loss_id and tensor.numel() == 1:
                # Read when the step closes: the step's loss is the sum of its backward passes'
                # (accumulation divides each micro-batch's loss by their number, as Lightning, the
                # HF Trainer and nanoGPT do: the sum is the loss they log, not one micro-batch's).
                tl.loss = tensor.detach() if tl.loss is None else tl.loss + tensor.detach()
        probe.backward_depth += 1
        return clock()

    def after(began: float, result: Any, args: tuple, kwargs: dict) -> None:
        probe.backward_depth -= 1
        now = clock()
        if tl.step_start is None:
            tl.step_start = began
        if tl.detail:
            tl.backward += now - began
            tl.backward_passes += 1
        if tl.by_hand:  # no optimizer: the gradients and parameters as this backward left them
            tl.backward_end = now
            probe.mark_gradients(args[0])
            gradients = probe.gradients
            if tl.detail and gradients is not None and gradients.due.get("by hand", 0) <= tl.ring.count:
                gradients.of_models(probe.root_models())

    return before, after


# --- host reads (.item(), ...): a Tensor method, posing as it (syncs.py) ---------------------------
# Like _patching.measured, but it tests counting_reads before anything else. It is in place only
# while a sampled step counts (syncs.py: SyncCounter.install), so the test fails only where it
# outlives the count: a process forked mid-step, a read on another thread. Dynamo never inlines it: it handles tensor
# methods by name (torch/_dynamo/variables/tensor.py call_method), and skips this wrapper's
# frame as one of torch/_tensor.py's.
# The read itself is called from the job's line (_patching.call_site): a warning torch raises
# inside it (float() of a tensor that requires grad) names that line and module, not this one.
HOST_READ = f"""
def host_read(*args, **kwargs):
    if not _tuneup_counter.counting_reads or {COMPILING}:
        return {CALL_ORIGINAL}
    _tuneup_prior = _tuneup_quiet(None)
    try:
        _tuneup_counted = _tuneup_counts()
        _tuneup_site = _tuneup_call_site(_tuneup_getframe(1))
    finally:
        if _tuneup_prior is not None:
            _tuneup_quiet(_tuneup_prior)
    if not _tuneup_counted:
        return _tuneup_site(_tuneup_original, *args, **kwargs)
    try:
        return _tuneup_site(_tuneup_original, *args, **kwargs)
    finally:
        _tuneup_counter._busy = False
"""


# --- the open step, and the step boundary ---------------------------------------------------------


class StepTimeline:
    """Accumulates the open step from hook events and closes it into the ring."""

    def __init__(self, capacity: int, fail: Callable[[str, BaseException], None], detail_every: int | None = None) -> None:
        self.ring = StepRing(capacity)
        self.fail = fail
        # One detail step drawn from every `detail_every`; None: DETAIL_EVERY, paced (`pace`).
        self.detail_every = detail_every or DETAIL_EVERY
        self.paced = detail_every is None
        self.detail = True  # measure the split and the loss on the open step
        # Until an optimizer steps (or the loop marks its steps), a loop may update its
        # parameters by hand: every backward is then watched, and the next forward after it
        # closes the step unless the gradients are accumulating (`hand_boundary`).
        self.by_hand = True
        self.hooked = True  # the forward/backward/zero_grad wrappers look: detail or by_hand
        self.backward_end: float | None = None  # by hand: end of the open step's latest backward
        self.hand_steps = 0  # steps closed by the hand-update boundary
        # Loops whose updates no optimizer hook sees (a whole training step under torch.compile:
        # the hooks are traced away): whether the parameters changed in place since the latest
        # backward (ModelProbe.parameters_moved), and the steps closed on that (moved_on).
        self.parameters_moved: Callable[[], bool] = _never
        self.changed_steps = 0
        # Set by watch_updates: an optimizer stepped before, but updates may no longer be seen;
        # the parameters' versions alone end the steps (ModelProbe.hand_boundary steps aside).
        self.watching = False
        self.unseen_updates: Callable[[], None] = _nothing  # OptimizerProbe.watch_updates
        # An evaluation phase: forwards of a trained model in eval() mode between training
        # forwards (evaluation_forward .. evaluation_ends).
        self.evaluating = False
        self.evaluation_id = 0  # phases opened so far
        self.evaluation_start = self.evaluation_last = 0.0
        self.evaluation_wait = self.evaluation_last_wait = 0.0  # data_wait at both ends
        self.evaluation_last_count = 0  # ring.count at the phase's last forward's end
        self.next_detail = 2  # the next step to be a detail step (after the open one)
        self.detail_until = 0  # every step up to this one is a detail step (apply mode's guarded steps)
        # Whether the latest close came at an optimizer step: the next step's forward and
        # backward had run by then (a loop without a fetch), so what its listeners change
        # (apply mode) takes effect a step later than after a close at a fetch.
        self.closed_at_update = False
        self.attached_at = perf_counter()  # start of the first step when nothing came before it
        self.step_start: float | None = None
        self.last_optimizer_end: float | None = None
        self.group: list[int] = []  # ids of the optimizers stepped in the open step (not the objects)
        # Regions whose host reads are not the user's: inside the loader, inside
        # optimizer.step (its CPU-side step counters), inside tuneup's own bookkeeping.
        self.in_loader = False
        self.in_optimizer = False
        self.in_tuneup = False
        self.forward_start = 0.0
        self.forward_depth = 0
        # Detail steps: the loop's time between the step's start (or its optimizer's end,
        # whichever came later) and its first forward, less data wait and zero_grad in between:
        # input built in the loop (get_batch, tokenizing, .to(device)). `in_input` is set from
        # that mark to the first forward (the stack sampler looks only then).
        self.in_input = False
        self.input_mark = (0.0, 0.0, 0.0)  # (time, data_wait, optimizer + evaluation) at the mark
        self.optimizer_start = 0.0
        self.closure_other = 0.0  # detail steps: closures' time outside their forwards and backwards (total)
        self.gpu_timer: Any = None  # CudaStepTimer once the job uses CUDA
        self.loss: Any = None  # detached loss of the latest backward
        self.step_loss: Any = None  # the loss the step's optimizer update consumed
        self.scaled_loss_id = 0  # id of GradScaler.scale()'s output: backward keeps the unscaled loss
        # Run with the step number at the close of every detail step and of the steps a
        # listener asked for through `wake_at` (the agent: loss reads, sync sampling, CUDA
        # events; 0 when a step's loss waits to be read). A listener that raises is dropped
        # and reported through `fail`.
        self.on_close: tuple[tuple[str, Callable[[int], None]], ...] = ()
        self._wake_at = 1
        # The first step whose close has more to do than write its record (`close`): the
        # earliest of wake_at, the step before the next detail step, and while a detail step
        # is open, 0. Lowered by every writer of wake_at and next_detail, so one comparison
        # tells the common close from the others.
        self.due = 0
        # The totals that move only on detail steps, as the last close that was due left them
        # (steps.py record: plain steps' records share this tuple; `moved` makes a close due).
        self.rest: tuple = record(0.0)[-1]
        # A due close's last act (OptimizerProbe.fit_pre_hook: the pre-hook where the next steps need it).
        self.fit_hooks: Callable[[], None] | None = None
        self.update_closes = 0  # steps closed at an optimizer step in a loop that fetches (moved_on)
        # Running totals since attach (never reset: see the module docstring).
        self.data_wait = 0.0
        self.forward = 0.0
        self.backward = 0.0
        self.optimizer = 0.0
        self.samples = 0
        self.fetches = 0
        self.backward_passes = 0
        self.optimizer_steps = 0
        self.skipped = 0
        self.input = 0.0  # detail steps: the loop's own time before the first forward (input_began)
        self.evaluation = 0.0  # seconds in evaluation phases, their data waits left out
        self.evaluations = 0
        # What tells an evaluation's batches from the training's (evaluation_batch). Last, so the
        # attributes every step reads keep their places: set among them, bench_overhead.py read
        # ~1.3 µs a step more in 3 runs of 3 (same instruction count, bench_instructions.py); set
        # here, none (15.1 and 16.6 µs against 16.0 and 17.6 before the change).
        self.unseen_mark = (-1, 0, 0.0)  # (fetches, samples, data_wait) before the latest unseen_fetch
        self.iter_mark = (-1, 0.0)  # (fetches, wait) at the latest iter(loader): iter_ended
        # The iterator of a fetch inside an open evaluation phase, until a forward takes it; then
        # handed to `evaluation_fetched` (the loader probe's: its loader is an evaluation's).
        self.evaluation_source: Any = None
        self.evaluation_fetched: Callable[[Any], None] = lambda iterator: None
        # Fetches at the latest forward of a root that took the latest fetch: an evaluation's, or
        # a training one on a hooked step (the wrappers see no other). Off hooked steps an
        # optimizer step since the latest fetch (`group`) says a training forward took it.
        self.forward_fetches = 0

    # --- events ---------------------------------------------------------------------------

    def forward_begin(self, now: float) -> None:
        if self.step_start is None:
            self.step_start = now
        if self.in_input:
            self.input_ended(now)
        if self.forward_depth == 0:
            self.forward_start = now
            self.in_optimizer = False
            if self.gpu_timer is not None:
                self.gpu_timer.forward_started()
        self.forward_depth += 1

    def own_time(self, spent: float) -> None:
        """Time tuneup's own work took inside the open step (a capture of its input): kept out
        of the step's time, and of its input phase where that is open."""
        self.ring.put("own_seconds", self.ring.count + 1, spent, add=True)
        if self.in_input:
            began, wait, accounted = self.input_mark
            self.input_mark = (began + spent, wait, accounted)

    def input_ended(self, now: float) -> None:
        """A detail step's first forward: the time since the mark is input, less the data wait
        and the optimizer time (zero_grad) and evaluation phases inside it."""
        self.in_input = False
        began, wait, accounted = self.input_mark
        gap = now - began - self.data_wait + wait - self.optimizer - self.evaluation + accounted
        if gap > 0.0:
            self.input += gap

    def forward_end(self, now: float) -> None:
        if self.forward_depth > 0:
            self.forward_depth -= 1
            if self.forward_depth == 0:
                self.forward += now - self.forward_start

    def moved_on(self, now: float, optimizer: int | None = None) -> float:
        """The step boundary, the one rule (see the module docstring): the loop visibly moved
        on at `now`: a batch fetched, iter(loader), a step function beginning (optimizer
        None), or the optimizer with this id about to step. The open step closes if an
        optimizer stepped in it (for an optimizer: if that same one did; two optimizers
        stepped in one iteration are one step). Otherwise `now` may open the first step.
        Returns the seconds tuneup's listeners took at the close (0.0: none ran)."""
        group = self.group
        if group and (optimizer is None or optimizer in group):  # (loader_next writes out a fetch's case)
            self.closed_at_update = optimizer is not None
            if optimizer is not None and self.fetches:  # (before the close: see OptimizerProbe.fit_pre_hook)
                self.update_closes += 1
            return self.close(now)
        if self.backward_end is not None and optimizer is None and self.parameters_moved():
            # No optimizer step seen, yet the parameters changed since the step's latest
            # backward: an update no hook saw (a training step compiled whole, opt.step()
            # inside it: the step hooks are traced away) or one made by hand. A fetch, or in a
            # loop without one the next backward (ModelProbe's backward wrapper), closes it.
            self.backward_end = None
            self.changed_steps += 1
            return self._close_marked(now)
        if self.step_start is None:
            self.step_start = now
        return 0.0

    def unseen_fetch(self, now: float) -> float:
        """A fetch with no optimizer step since the previous one: the loop's first; a micro-batch
        of gradient accumulation; or a step whose update no hook saw, where moved_on tells it
        by the parameters, once they are watched (by_hand). A loop that fetched UNSEEN_FETCHES
        batches since its last close with no update seen is watched from here on
        (OptimizerProbe.watch_updates): code compiled where tuneup's compile callbacks missed it
        (after a `torch._dynamo.reset()`) may hold the optimizer's step. Gradient accumulation
        over that many batches is watched too, at the cost of a looked-at step until its update.
        Marks the totals before it: an evaluation forward may take the batch (evaluation_batch)."""
        self.unseen_mark = (self.fetches, self.samples, self.data_wait)
        if self.step_start is None or self.backward_end is not None:
            return self.moved_on(now)
        if not self.by_hand and self.fetches - self.ring.closed_total("fetches") >= UNSEEN_FETCHES:
            self.unseen_updates()
        return 0.0

    def waited(self, began: float, ended: float, evaluating: bool = False) -> float:
        """Blocked on data without getting a batch: iter(loader) (worker start-up), or a
        next() that raised (StopIteration at the end of an epoch, the user's exception); returns
        the wait. `evaluating`: a next() that raised inside an evaluation phase (its loader's
        end: workers shut down), whose wait is the evaluation's, not the training's data wait."""
        own = self.moved_on(began)
        wait = max(0.0, ended - began - own)
        if not evaluating:
            self.data_wait += wait
        return wait

    def iter_ended(self, wait: float) -> None:
        """iter(loader) returned after `wait` (worker start-up): an evaluation's, where the
        fetch after it is taken by an evaluation forward (evaluation_batch)."""
        self.iter_mark = (self.fetches, wait)

    def evaluation_forward(self, now: float) -> None:
        """A trained model's forward in eval() mode: it opens an evaluation phase or belongs to
        the open one. While one is open every forward is looked at (`hooked`): the next
        training forward ends it. (A forward under no_grad in train() mode is the step's own:
        an action chosen by the policy being trained, a target computed.)"""
        if self.step_start is None:
            self.step_start = now  # the run's first step opens here: it holds this phase
        if not self.evaluating:
            self.evaluating = True
            self.evaluation_id += 1
            self.hooked = True
            self.evaluation_start = self.evaluation_last = now
            self.evaluation_wait = self.evaluation_last_wait = self.data_wait

    def evaluation_batch(self, args: tuple, kwargs: dict) -> None:
        """An evaluation forward after a fetch that no forward took: the batch fetched last is
        the evaluation's, not a training step's, and comes off the samples and
        fetches (validating each epoch on 80 batches of 128, training on 32, read "61.3 samples
        per batch", and its more than UNSEEN_FETCHES fetches with no update as updates going
        unseen). Only the last one: Lightning's and the HF Trainer's loops fetch the next
        training batch before they validate. Unless the forward's first tensor has no dimension
        of that batch's size: its input is another (a fixed validation set held in memory,
        evaluated between the fetch and the training forward); seq-first inputs keep the size."""
        # The totals before that fetch: a fetch either closed a step (its record holds them)
        # or saw no optimizer step since the one before (unseen_fetch marks them): the hot
        # path writes nothing more for this.
        fetches = self.fetches - 1
        ring = self.ring
        before = (self.unseen_mark if self.unseen_mark[0] == fetches else
                  (ring.closed_total("fetches"), ring.closed_total("samples"), ring.closed_total("data_wait_seconds")))
        self.forward_fetches = self.fetches
        if before[0] != fetches:
            return
        size = self.samples - before[1]
        first = first_input(args, kwargs)
        if first is not None and first.dim() and size not in first.shape:
            return
        # Its wait too, and that of the iter() just before it (a validation loader's workers
        # starting): the evaluation's time, not data wait. The phase opened with data_wait as
        # it stood (evaluation_forward): what comes off it here goes to the phase's time.
        wait = self.iter_mark[1] if self.iter_mark[0] == fetches else 0.0
        self.data_wait = max(before[2] - wait, ring.closed_total("data_wait_seconds"))
        self.samples, self.fetches = before[1], fetches
        self.forward_fetches = fetches
        # (the fetch count goes back: marks made at it are spent, not to be read again)
        self.unseen_mark, self.iter_mark = (-1, 0, 0.0), (-1, 0.0)
        if self.evaluation_source is not None:  # its loader is an evaluation's (LoaderProbe.evaluation_fetch)
            self.evaluation_fetched(self.evaluation_source)
            self.evaluation_source = None

    def evaluation_forward_ended(self, now: float) -> None:
        self.evaluation_last = now
        self.evaluation_last_wait = self.data_wait
        self.evaluation_last_count = self.ring.count

    def evaluation_ends(self, now: float | None = None) -> None:
        """Training goes on: an evaluation phase's time, from its first forward's start to its last
        one's end, less the data waits inside it (they stay data wait), is left out of the step.
        `now`: the training forward that ends it; where no step closed since the evaluation's
        last forward, the phase runs to it: what came after the forwards (metrics from their
        outputs: argmax, accuracies, their reads) is the evaluation's, not input for the next
        step (a full-batch GCN evaluating every epoch read as input-in-loop). A step that closed
        in between (a fetch) ends the phase at its last forward, as before."""
        self.evaluating = False
        self.evaluation_source = None  # (a training batch fetched before the forward that ended it)
        self.hooked = self.detail or self.by_hand
        end, end_wait = self.evaluation_last, self.evaluation_last_wait
        if now is not None and self.ring.count == self.evaluation_last_count:
            end, end_wait = now, self.data_wait
        self.evaluation += max(0.0, (end - self.evaluation_start) - (end_wait - self.evaluation_wait))
        self.evaluations += 1
        self.moved()

    def hand_update(self, now: float) -> None:
        """The step boundary of a loop that updates its parameters by hand: the next forward
        after a backward (ModelProbe.hand_boundary decides) closes the step at `now`."""
        self.backward_end = None
        self.hand_steps += 1
        self._close_marked(now)

    def watch_updates(self) -> None:
        """Watch for updates as in a loop without an optimizer, until one steps where its hooks
        run (OptimizerProbe.watch_updates: a compilation began, or many fetches saw none)."""
        self.by_hand = self.hooked = self.watching = True

    def not_by_hand(self) -> None:
        """An optimizer stepped or the loop marks its steps: no hand-update boundary from now on."""
        if self.by_hand:
            self.by_hand = self.watching = False
            self.backward_end = None
            self.hooked = self.detail or self.evaluating

    def optimizer_skipped(self, optimizer: Any, now: float) -> None:
        """GradScaler skipped optimizer.step(): still one step of the loop."""
        self.not_by_hand()
        self.moved_on(now, id(optimizer))
        self.skipped += 1
        self.moved()
        self.last_optimizer_end = now
        if self.detail and self.gpu_timer is not None:
            self.gpu_timer.optimizer_ended()
        self.group.append(id(optimizer))
        if self.loss is not None:
            self.step_loss, self.loss, self.wake_at = self.loss, None, 0  # the close reads it

    def step_begins(self, now: float) -> None:
        """A @tuneup.step_function call begins: it is a step of its own, so a step the
        loop left open (an optimizer stepped since the last close) closes here."""
        self.not_by_hand()
        self.moved_on(now)

    # --- closing ------------------------------------------------------------------------

    @property
    def wake_at(self) -> int:
        """The next step whose close runs the listeners even off detail steps (0: the next one)."""
        return self._wake_at

    @wake_at.setter
    def wake_at(self, step: int) -> None:
        # Another thread may set it (a revert asked for from the sampler): `_close_due`
        # re-reads it after writing `due`, so a wake-up set meanwhile is never lost.
        self._wake_at = step
        if step < self.due:
            self.due = step

    def close(self, now: float) -> float:
        """Close the open step at `now`; returns the seconds its listeners took (tuneup's own
        time, kept out of the next step's: steps.py own_seconds). Most closes write the
        record and publish it; the rest (`due`) go on in `_close_due`."""
        ring = self.ring
        step = ring.count + 1
        # (steps.py record: the totals that move on plain steps, and `rest` as the last close
        # that was due left it; where it may have moved since, that close is due: `_close_due`)
        ring.records[ring.count % ring.capacity] = (
            now, self.data_wait, self.samples, self.fetches, self.optimizer_steps, self.rest)
        self.group = []  # (a new list: three operations, clear() six)
        if step < self.due:
            ring.count = step  # publish last: readers only see complete records
            return 0.0
        return self._close_due(step, now)

    def moved(self) -> None:
        """A total that plain steps' records share (`rest`) moved off a detail step (an
        evaluation phase ended, GradScaler skipped): the open step's close is due, and writes
        them anew. (Only the training thread calls it: a write of `due` racing a close would
        move the value to a later step's record, not lose it; the totals only grow.)"""
        self.due = 0

    def _close_due(self, step: int, now: float) -> float:
        """The rest of a close that is due: the first step's origin, the listeners (on detail
        steps and those asked for through `wake_at`), the detail steps' turns, `due` anew."""
        ring = self.ring
        if step == 1:
            start = self.step_start if self.step_start is not None else self.attached_at
            ring.origin = record(start, detailed=True)
        # The totals that move on detail steps (and at the events that make a close due:
        # `moved`), as they stand: this step's record, and (as not detailed) the next plain ones'.
        totals = (self.forward, self.backward, self.optimizer, self.input, self.backward_passes, self.skipped,
                  self.evaluation, self.evaluations)
        self.rest = totals + (False,)
        ring.records[ring.count % ring.capacity] = (
            now, self.data_wait, self.samples, self.fetches, self.optimizer_steps,
            totals + (True,) if self.detail else self.rest)
        # An optimizer step that raised left its region open (its post-hook never ran): it is
        # over by a close that is due, at the latest (host reads are counted on detail steps,
        # whose closes those are: syncs.py).
        self.in_optimizer = False
        own = 0.0
        if self.detail or step >= self._wake_at:  # (a loss to read: wake_at 0)
            own = self._notify(step)
            self.step_loss = None  # a loss belongs to the step whose update consumed it
        if step + 1 >= self.next_detail:
            self.detail = self.hooked = self.in_input = True
            # The loop's input starts after tuneup's listeners: their time is neither its wait nor its input.
            self.input_mark = (now + own, self.data_wait, self.optimizer + self.evaluation)
            self.next_detail = self._detail_after(step + 1)
        elif self.detail:  # (after a step that was not one, these are as they should be)
            self.detail = self.in_input = False
            self.hooked = self.by_hand or self.evaluating
        due = 0 if self.detail else min(self._wake_at, self.next_detail - 1)
        self.due = due
        if self._wake_at < due:  # set by another thread since it was read
            self.due = self._wake_at
        ring.count = step  # publish last: readers only see complete records
        if own:
            ring.put("own_seconds", step + 1, own, add=True)  # the open step's time holds it
        if self.fit_hooks is not None:
            self.fit_hooks()
        return own

    def _detail_after(self, step: int) -> int:
        """The first detail step after `step`: the first five, the guarded ones, else one drawn
        at random from each block of `detail_every` (steps.py sampled_after)."""
        following = step + 1
        if following <= EARLY_DETAIL_STEPS or following <= self.detail_until:
            return following
        return sampled_after(step, self.detail_every)

    def pace(self, step_seconds: float, detail_cost: float | None = None) -> None:
        """The automatic detail rate (the detail_every option unset), from the median step time
        and what a detail step costs (`detail_cost`, measured by windows.detail_cost: its own
        extra time and the next step's; DETAIL_COST until measured): DETAIL_EVERY, or more on
        short steps, so that detail steps add at most DETAIL_BUDGET to the training time. A
        detail step runs about 1,000 Python operations more than another (70,000 instructions:
        benchmarks/bench_instructions.py, TUNEUP_DETAIL_EVERY=1 against 1000000), and its close
        runs the listeners (the loss read, a sync-sampled step's start and end: syncs.py
        sample_after puts those on detail steps), but in place it costs more than that count
        says: ~95 µs on a 0.1 ms CPU step, and ~33 µs the step after (torch's code and data
        evicted by tuneup's). Paced by the 35 µs the count suggested (one every 10 ms), they
        cost that step 2.6 µs, of the 13 µs tuneup added; measured in place (windows.
        detail_cost) a paced one costs ~260 µs there, mostly its code and data coming back
        into the caches, so the budget asks for one in ~1,150 steps. They still come one in
        every DETAIL_PERIOD of training (ten a second: on that step one in ~880, 0.3 µs
        a step, where a fixed cap of one in 256 cost 1.0 µs of the 13), so the split, the
        loss and the sync samples keep coming on the shortest steps (hundreds a minute), and
        at most one in MAX_DETAIL_EVERY. Not before PACED_FROM_STEP: a short run's estimates (the
        input share that starts the stack sampler, a rank's backward median) rest on few
        detail steps as it is."""
        if self.paced and step_seconds > 0.0 and self.ring.count >= PACED_FROM_STEP:
            cost = DETAIL_COST if detail_cost is None else detail_cost
            every = math.ceil(cost / (DETAIL_BUDGET * step_seconds) - 1e-9)  # (10.000000000000002 is 10)
            most = min(MAX_DETAIL_EVERY, max(MIN_PERIOD_EVERY, int(DETAIL_PERIOD / step_seconds)))
            self.detail_every = max(DETAIL_EVERY, min(most, every))

    def detail_through(self, step: int) -> None:
        """Every step up to `step` is a detail step (apply mode's guarded steps), from the
        one after the open step on (the open one is measured as it began)."""
        self.detail_until = max(self.detail_until, step)
        self.next_detail = min(self.next_detail, self.ring.count + 2)
        self.due = min(self.due, self.next_detail - 1)

    def _notify(self, step: int) -> float:
        """Run the close listeners; returns the seconds they took where that is OWN_MIN or more
        (a precision trial, a batch shipped: tuneup's work, left out of the job's step), else
        0.0 (reading a loss: a few microseconds, the close's own bookkeeping as before)."""
        self.in_tuneup = True
        began = perf_counter()
        try:
            for name, listener in self.on_close:
                try:
                    listener(step)
                except Exception as exc:
                    self.remove_listener(name)
                    self.fail(name, exc)
        finally:
            self.in_tuneup = False  # also after a KeyboardInterrupt inside a listener
        spent = perf_counter() - began
        return spent if spent >= OWN_MIN else 0.0

    def flush(self) -> None:
        """Close the open step at detach, ending it at its last optimizer step (by hand: at
        its last backward)."""
        if self.evaluating:
            self.evaluation_ends()
        if self.group and self.last_optimizer_end is not None:
            self.close(self.last_optimizer_end)
        elif self.backward_end is not None:
            self.hand_update(self.backward_end)

    def manual_step(self, now: float | None = None) -> None:
        """tuneup.step(): close the step now. Automatic boundaries go on working (the
        optimizers stepped so far are forgotten at every close, so none fires twice)."""
        self.not_by_hand()
        self._close_marked(perf_counter() if now is None else now)

    def _close_marked(self, now: float) -> float:
        """Close at a boundary no optimizer step made (tuneup.step(), a hand update): the loss
        of the latest backward is the step's."""
        if self.step_loss is None and self.loss is not None:
            self.step_loss, self.loss, self.wake_at = self.loss, None, 0  # the close reads it
        self.closed_at_update = False  # (a hand update's close: at the next forward, before it)
        return self.close(now)

    # --- values that arrive late (read asynchronously from the device) ----------------

    def record_skip(self, step: int) -> None:
        """A device-side skip flag for `step`, which may still be open."""
        if step == self.ring.count + 1 and not self.in_tuneup:
            self.skipped += 1  # the open step
            self.moved()
        else:
            self.ring.put("late_skips", step, 1.0, add=True)

    def add_listener(self, name: str, listener: Callable[[int], None]) -> None:
        self.on_close = self.on_close + ((name, listener),)

    def remove_listener(self, name: str) -> None:
        self.on_close = tuple(item for item in self.on_close if item[0] != name)
