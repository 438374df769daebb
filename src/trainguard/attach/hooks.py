"""The hooks ``trainguard run`` puts into an unmodified script, and the guard they attach.

Installed by the bootstrap once ``torch`` is imported (``install``); nothing else in the script's
process changes. The attach points need no cooperation from the script:

* process-wide module hooks (``prestart.PreStart``) record the first step's top-level module calls
  until the guard exists;
* ``torch.optim.optimizer.register_optimizer_step_pre_hook`` (process-wide): at the first optimizer
  step the guard is made (``discovery`` finds the model; the process group is torch.distributed's
  default group, the watchdog runs on the job's own c10d store), and at every step of that
  optimizer the gradients are checked (``Guard.check_gradients``; one small all-reduce) before the
  optimizer reads them. A skip clears every gradient (``p.grad = None``) so the optimizer's own
  step leaves the weights and its state alone, gives them back after that step (code after
  ``optimizer.step()`` may read them), and puts back the buffers the step's forward changed. A step
  given a closure (Lightning, LBFGS-style loops) is checked when the closure returns, with the loss
  it returns. Under a compiled ``optimizer.step()`` these hooks run eagerly
  (``user_hooks.eager_when_traced``);
* the gradient clipping functions (``clip.ClipWatch``): a script's clip over the guarded
  optimizer's parameters checks the step before it clips, so the guard sees the gradients as
  backward made them;
* ``zero_grad`` of the guarded optimizer and model (``drops.DropWatch``): a step the script leaves
  out itself on some rank (its own ``if``) is checked there, in the all-reduce the other ranks'
  optimizer step joined, and every rank leaves it out;
* a forward pre-hook on the model records each step's micro-batches (the call's arguments, by
  reference; their dataset indices: ``loader_draws``) and marks the loop's progress for the
  watchdog (an evaluation's forwards, through the model or ``model.module``, are progress too: the
  guard's own step-start hook counts them); the post-step hook marks the data phase (a rank stuck
  in its loader is named as such);
* ``torch.distributed.destroy_process_group`` (wrapped) closes the guard first, so that work after
  training is not taken for a hang.

When the guard cannot attach it says why in one line and stands aside: every hook is removed and
the script runs unguarded, as it would without ``trainguard run``.
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from trainguard.attach import first_steps
from trainguard.attach.announce import announce_guarding, announcer
from trainguard.attach.backward_calls import BackwardCalls
from trainguard.attach.clip import ClipWatch
from trainguard.attach.companions import Companions
from trainguard.attach.destroy import close_before_destroy
from trainguard.attach.discovery import describe_module, existing_guard, find_model, in_training
from trainguard.attach.drops import DropWatch
from trainguard.attach.leaving import (
    UNGUARDED,
    AsideReason,
    agree_at_attach,
    agreed_reason,
    disarm,
    peer_reason,
)
from trainguard.attach.loader_draws import LoaderDraws
from trainguard.attach.loss_inputs import LossInputs
from trainguard.attach.options import RunOptions
from trainguard.attach.prestart import PreStart
from trainguard.attach.replace import HANDOVER, adopt_start, hand_over, made_anew
from trainguard.attach.resumed import go_on, updates_of
from trainguard.attach.status import write_reason
from trainguard.capture.batchtree import call_batch as batch_of
from trainguard.distributed.world import rank as job_rank
from trainguard.distributed.world import world_size as job_world
from trainguard.errors import ConfigError
from trainguard.step.guard import Guard
from trainguard.step.join import JOIN_REASON, shadowed_in_join
from trainguard.user_hooks import HookHandle, add_forward_hooks, eager_when_traced

logger = logging.getLogger(__name__)

_attacher: Attacher | None = None


def install(raw: Mapping[str, Any]) -> None:
    """Called by the bootstrap once ``torch`` is imported: install the lazy hooks (once)."""
    global _attacher
    if _attacher is not None:
        return
    try:
        options = RunOptions.from_mapping(raw)
    except (ConfigError, TypeError) as exc:
        announcer().error("trainguard run: not attached: %s", exc)
        return
    _attacher = Attacher(options)
    _attacher.install()


class Attacher:
    """One process's hooks: waiting for the first step, then guarding, or standing aside."""

    def __init__(self, options: RunOptions) -> None:
        self.options = options
        self.guard: Guard | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.model: nn.Module | None = None
        self.aside = False
        self._loader_draws = LoaderDraws()
        self._prestart = PreStart(self._updated_by_hand, self._loader_draws.at_forward)
        self._clip = ClipWatch()
        self._drops = DropWatch()
        self._companions = Companions()  # one model, two optimizers: the second's step
        self._loss_inputs = LossInputs()  # criterion(model(x), y): y joins the micro-batch
        listeners = [self._prestart.loss_inputs.backward_on, self._loss_inputs.backward_on]
        self._backwards = BackwardCalls(listeners, skip=lambda: self._clip.scaled)
        self._stepping: torch.optim.Optimizer | None = None  # the one whose step() runs
        self._first_losses: list[Tensor] | None = None
        """The losses ``PreStart`` saw in the step the guard attached at (``_attach``)."""
        self._handles: list[RemovableHandle | HookHandle] = []
        self._restore_destroy: Callable[[], None] | None = None
        self._leaving: AsideReason | None = None
        """Why this rank stands aside once every rank does (a job of several: ``leaving.py``)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def install(self) -> None:
        atexit.register(self._never_stepped)
        self._prestart.install()
        self._clip.install()
        self._loader_draws.install()
        self._backwards.install()
        self._handles = [
            register_optimizer_step_pre_hook(eager_when_traced(self._pre_step)),
            register_optimizer_step_post_hook(eager_when_traced(self._post_step)),
        ]
        self._restore_destroy = close_before_destroy(self.close)

    def stand_aside(
        self, reason: str, then: str = UNGUARDED, own_guard: bool = False, alone: bool = False
    ) -> None:
        """Remove every hook, close the guard if any, and say why (one line; and in the run
        dir for the command's last word: ``status.py``). ``own_guard``: the script's own
        guard keeps the run. ``alone``: this rank found the reason on its own; in a job of
        several ranks it then waits until every rank stands aside with it (``leaving.py``).
        Otherwise every rank stands aside at this point (a Join, a failure at attach) or the
        process is exiting."""
        if self.aside:
            return
        if alone and job_world() > 1:
            if self._leaving is None:
                self._leaving = AsideReason(reason, then, own_guard)
            return
        self._stand_aside_now(AsideReason(reason, then, own_guard))

    def _stand_aside_now(self, aside: AsideReason) -> None:
        """``stand_aside`` on every rank alike (``aside.origin``: the rank whose reason it
        is, named in the line; its reason is what the command's last word repeats)."""
        if self.aside:
            return
        self.aside = True
        self._remove_hooks()
        said, then = aside.said, aside.then
        announcer().warning("trainguard run: rank %d: not guarding: %s; %s", job_rank(), said, then)
        origin = job_rank() if aside.origin is None else aside.origin
        write_reason(self.options.run_dir, origin, aside.reason, guarded=aside.own_guard)
        if self.guard is not None:  # the run dir says so too: its report is no guarded run
            self.guard.events.write("stand_aside", self.guard.state.step, reason=said, then=then)
        self.close()

    def close(self) -> None:
        """Close the guard (its watchdog stops watching): at the end of training. The exit
        hook goes with it: registered, it kept this attacher, and with it the script's model
        (a DDP module the process's hang probe then still finds), alive until exit."""
        atexit.unregister(self.close)
        leaving = self._leaving
        if leaving is not None and not self.aside:  # the training ended first: say it now
            self._stand_aside_now(leaving)
            return
        guard, self.guard = self.guard, None
        if guard is None:
            return
        for part in (self._clip, self._drops, self._loader_draws, self._backwards):
            part.remove()  # nothing to check before a clip (or a backward) from now on
        try:
            guard.close()
        except Exception as exc:  # NonFiniteError included: the run is over anyway
            logger.warning("trainguard run: the guard did not close cleanly: %s", exc)

    def _remove_hooks(self) -> None:
        atexit.unregister(self._never_stepped)
        for part in (self._prestart, self._clip, self._drops, self._loader_draws, self._backwards):
            part.remove()
        self._loss_inputs.disarm()
        for handle in self._handles:
            if isinstance(handle, RemovableHandle):
                disarm(handle)
            else:
                handle.remove()
        self._handles = []
        if self._restore_destroy is not None:
            self._restore_destroy()
            self._restore_destroy = None

    def _updated_by_hand(self, module: nn.Module) -> None:
        """The parameters changed between two training forwards with no optimizer step."""
        # at once, on every rank alike: such a script reaches no optimizer step to agree at
        self.stand_aside(first_steps.manual_update_reason(describe_module(module)))

    def _never_stepped(self) -> None:
        """At exit: a process that trained but never reached an optimizer step says so."""
        prestart = self._prestart
        reason = first_steps.never_stepped(bool(prestart.calls), prestart.other_thread)
        if reason is not None and self.optimizer is None and not self.aside:
            self.stand_aside(*reason)

    # -- the optimizer's hooks --------------------------------------------------------------

    def _pre_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        # one stepping inside the optimizer's step() is one it holds (ZeRO's shard optimizer)
        if self.aside or self._left() or self._stepping not in (None, optimizer):
            return None
        self._stepping = optimizer
        self._loss_inputs.disarm()  # a functional loss: no loss call came; nothing to read
        if self.optimizer is not None and optimizer is not self.optimizer:
            if self._leaving is not None:
                return None  # leaving after the guarded optimizer's next check: unguarded
            if self._companions.join(optimizer, self.optimizer, self.model, self._clip.scaled):
                return None  # the rest of the guarded model, in the step just checked
            if self.model is None or not made_anew(optimizer, self.optimizer, self.model):
                reason = first_steps.second_optimizer_reason(optimizer, self.optimizer, self.model)
                self.stand_aside(reason, alone=True)
                return None
            if not self._replace(optimizer, self.model):
                return None
        # ``args`` starts with the optimizer itself (torch passes the step's own arguments)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            if not self._clip.take_checked():  # else checked before the script's clip
                self._before_update(optimizer, None)
            return None
        if isinstance(optimizer, torch.optim.LBFGS):
            self.stand_aside(*first_steps.LBFGS_REASON, alone=True)
            if self.guard is None:  # several ranks: every rank's verdict, agreed now
                self._agreed(None, optimizer, None)
            return None
        wrapped = self._checked_closure(optimizer, closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def _checked_closure(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any]
    ) -> Callable[[], Any]:
        """The closure computes the gradients (Lightning's forward and backward): check them
        when it returns, before the optimizer reads them."""

        def checked() -> Any:
            self._clip.in_closure = True  # a clip inside it: checked here, with the loss
            try:
                result = closure()
            finally:
                self._clip.in_closure = False
            loss = result if isinstance(result, Tensor) and result.numel() > 0 else None
            self._before_update(optimizer, loss)
            return result

        return checked

    def _post_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._loss_inputs.disarm()
        if optimizer is self._stepping:
            self._stepping = None
        self._companions.stepped()
        guard = self.guard
        if guard is not None and optimizer is self.optimizer:
            self._clip.stepped()
            guard.internals.give_back_gradients()  # a skipped step's: the script's again
            guard.progress.enter("data")  # next: the loop fetches a batch
            self._left()

    def _before_update(self, optimizer: torch.optim.Optimizer, loss: Tensor | None) -> None:
        self._loss_inputs.disarm()  # a closure's loss (Lightning): the update runs bare
        first = self.guard is None
        if first and not self._attach(optimizer):
            return
        guard = self.guard
        assert guard is not None
        if self.model is not None and shadowed_in_join(self.model):  # every rank, this step
            self.stand_aside(JOIN_REASON, then="the script runs unguarded, its Join as it was")
            return
        self._drops.checking()  # a skip's own zero_grad is not the script leaving it out
        try:
            seen = self._seen_losses(first, guard.state.step)
            if self._leaving is not None:  # every rank stands aside after this step
                applied = guard.internals.check_leaving(loss)
            elif loss is not None:
                applied = guard.check(loss)
            elif seen is not None:  # the micro-batches' losses, each recorded once
                for micro_loss in seen:
                    guard.record_loss(micro_loss)
                applied = guard.check()
            else:
                applied = guard.check_gradients()
            self._companions.checked(applied)
        finally:
            self._drops.busy = False

    def _seen_losses(self, first: bool, step: int) -> list[Tensor] | None:
        """The losses of the step's training calls (``attach/loss_inputs.py``), None when
        some call's was not seen; at the step the guard attached, those ``PreStart`` saw."""
        if first:
            losses, self._first_losses = self._first_losses, None
            return losses
        model = self.model
        return None if model is None else self._loss_inputs.take_losses(step, model)

    # -- attaching ---------------------------------------------------------------------------

    def _attach(self, optimizer: torch.optim.Optimizer) -> bool:
        prestart = self._prestart
        found = find_model(prestart.candidates, optimizer)
        if not prestart.calls and first_steps.updates_nothing(optimizer):
            return False  # a step before any training forward that updates nothing: wait
        prestart.remove()
        model = found.model
        if model is None:
            thread = None if prestart.calls else prestart.other_thread  # it trains elsewhere
            verdict = AsideReason(first_steps.model_not_found(found.reason, thread))
        elif (other := existing_guard(model)) is not None:
            verdict = first_steps.own_guard_reason(describe_module(model), other)
        else:
            verdict = None
        counts = self._agreed(verdict, optimizer, updates_of(optimizer))
        if counts is None or model is None:
            return False
        try:
            guard = self._new_guard(model, optimizer, None)
        except Exception as exc:
            self.stand_aside(f"the guard could not start: {type(exc).__name__}: {exc}")
            return False
        self._use(guard, optimizer, model)
        adopt_start(guard, prestart.calls.get(id(model)), go_on(guard, counts))
        self._first_losses = prestart.loss_inputs.take_losses(0, model)
        prestart.calls.clear()
        # a Hook: a copy of the model (EMA, torch.save) carries an inert one; run eagerly
        # around a model compiled in place (user_hooks.add_forward_hooks)
        self._handles.append(add_forward_hooks(model, pre=self._model_pre, post=self._model_post))
        atexit.register(self.close)
        announce_guarding(guard, optimizer, model, self._first_losses is not None)
        return True

    def _agreed(
        self, verdict: AsideReason | None, optimizer: torch.optim.Optimizer, updates: int | None
    ) -> list[int | None] | None:
        """Every rank's optimizer ``updates`` (``resumed.py``) when every rank can be guarded,
        agreed at attach in one all-gather (``leaving.py``) with this rank's ``verdict`` (or
        the reason it found before); else None: this one stands aside, naming rank and why."""
        mine = self._leaving or verdict
        counts = [updates]
        if job_world() > 1:
            device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
            views = agree_at_attach(mine, updates, device or torch.device("cpu"))
            mine = agreed_reason([reason for reason, _ in views], job_rank())
            counts = [count for _, count in views]
        if mine is None:
            return counts
        self._stand_aside_now(mine)
        return None

    def _left(self) -> bool:
        """Whether this rank stood aside now because the last agreed step said that some rank
        stops guarding (``leaving.py``): at the guarded optimizer's post-step hook, or at the
        next training forward or optimizer step of a rank that left that step out itself."""
        guard = self.guard
        if guard is None or not (ranks := guard.state.leaving_ranks):  # agreed state
            return False
        mine = self._leaving or peer_reason(ranks)
        self._stand_aside_now(mine)
        return True

    def _new_guard(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, run: str | None
    ) -> Guard:
        config = self.options.guard_config(run, HANDOVER if run is not None else None)
        return Guard(model, optimizer, config=config)

    def _use(self, guard: Guard, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Guard ``optimizer``'s steps with ``guard``: its clips and left-out steps too."""
        self.guard, self.optimizer, self.model = guard, optimizer, model
        self._loss_inputs.take_losses(-1, model)  # a new guard's steps: none seen yet
        guard.internals.keep_dropped_gradients()  # given back after the skipped step
        self._clip.attach(optimizer, functools.partial(self._before_update, optimizer, None))
        self._drops.attach(guard, optimizer, model, lambda: self._clip.scaled)
        guard.internals.follow_loader_draws(self._loader_draws.at_forward)

    def _replace(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
        """The script made its optimizer anew (``replace.py``): guard the new one, on the same
        run; False (standing aside) when the new guard cannot start."""
        old = self.guard
        if old is None:
            return False
        self.guard = None
        self._clip.detach()  # its wrappers stay: the new guard checks before a clip too
        self._drops.remove()
        step, before = old.state.step, type(self.optimizer).__name__
        try:
            guard = hand_over(old, optimizer, functools.partial(self._new_guard, model, optimizer))
        except Exception as exc:
            self.stand_aside(f"the guard of the new optimizer could not start: {exc}")
            return False
        self._use(guard, optimizer, model)
        announcer().info(
            "trainguard run: rank %d: the script made a new optimizer (%s, was %s): guarding it "
            "from step %d, the run goes on",
            guard.rank,
            type(optimizer).__name__,
            before,
            step,
        )
        return True

    def _model_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._loss_inputs.disarm()  # the model's next call: the last one's loss was not seen
        if not self._clip.in_closure:
            self._stepping = None  # a step that raised ran no post-step hook
        guard = self.guard
        if guard is None or self._left():
            return
        if not torch.is_grad_enabled() or not in_training(module):
            return  # an evaluation: progress, counted by the guard's step-start hook
        guard.progress.enter("step")
        self._clip.forward()
        self._drops.forward()
        self._companions.forward()
        guard.record_batch(batch_of(args, kwargs))

    def _model_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """After a training call: the loss call that takes its output adds its targets to
        the micro-batch (``attach/loss_inputs.py``)."""
        guard = self.guard
        if guard is None or not torch.is_grad_enabled() or not in_training(module):
            return
        self._loss_inputs.arm(output, guard.internals.recorded_batches(), guard.state.step, module)
