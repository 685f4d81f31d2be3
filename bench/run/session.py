"""A session: one pass's fresh model, optimizer, loss and batch with the strategy applied, and the article's steps."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from bench.measure.resident import trim_heap
from bench.run.case import Case, cpu_batch, seed_everything
from strategies import Strategy
from workloads import get_workload, tensors_of, to_device, to_float32


def _no_mark(stage: str) -> None:
    pass


class Session:
    """A fresh model, optimizer, loss and batch for one pass of one case, with the strategy applied.

    The steps are the article's loop, the same for every workload: the workload says what to train (model,
    batch, loss, optimizer), the strategy how (its hooks), and this class runs it. With `observe_grads`,
    `watch_grads()` callbacks see each gradient as it is accumulated, before any hook of the strategy (which may
    step and free it at once); the timed passes leave it off, so that their steps hold nothing but the step.
    """

    def __init__(self, case: Case, strategy: Strategy, observe_grads: bool = False):
        self.workload = workload = get_workload(case.workload)
        seed_everything(workload.seed)
        self.case = case
        self.strategy = strategy
        self.base_model = self.place(self.build_model(workload))
        trim_heap()  # what building it freed (an initializer's temporaries) goes back to the system, not to the step
        self.observe_grads = observe_grads
        self._grad_watchers: OrderedDict[int, Callable[[torch.Tensor], None]] = OrderedDict()  # RemovableHandle's
        if observe_grads:
            watchers = self._grad_watchers

            # A hook that held the session would make a cycle (parameter -> hook -> session -> model ->
            # parameter) that only the cyclic collector frees: every pass's model and state would linger.
            def grad_ready(param: torch.Tensor) -> None:
                for watcher in list(watchers.values()):
                    watcher(param)

            # the parameters hooked, by id, held so that no id is reused while this runs: a strategy that replaces
            # parameters (bf16_weights on fake tensors) frees the old ones, and a new one at a freed one's id went
            # unhooked (its gradient then filed as the backward's, a different parameter at each run)
            watched: dict[int, torch.Tensor] = {}

            def watch_trainable() -> None:
                for param in self.base_model.parameters():
                    if param.requires_grad and id(param) not in watched:
                        param.register_post_accumulate_grad_hook(grad_ready)
                        watched[id(param)] = param

            watch_trainable()  # before the strategy's hooks, so that the watchers see each gradient first
        self.model = strategy.prepare_model(self.base_model, workload.checkpoint_units(self.base_model))
        self.loss_of = strategy.prepare_loss(workload.loss)
        if observe_grads:
            watch_trainable()  # the parameters the strategy added (LoRA's adapters)
        self.optimizer = strategy.wrap_optimizer(workload.make_optimizer(self.base_model), self.base_model)
        self.host_batch = strategy.shard_batch(self.load_host_batch())
        inputs, target = self.host_batch
        self.x, self.y = self.place(inputs), self.place(target)
        self.model.train(case.phase == "train")
        # the loop's variables `predicted` and `loss`: each holds the previous step's value until the statement
        # that rebinds it (see `forward_backward`), unless the strategy drops them at the end of a step
        self.kept: dict[str, Any] = {}
        # dropout draws from the global generator: every pass starts its steps from the same random state
        seed_everything(workload.seed + 1)

    def build_model(self, workload) -> torch.nn.Module:
        """The workload's model; for a case on the meta device built there (a hook point), so that no real copy of a
        full-size model is made to be moved to meta (a checkpoint budget's plan at 8B parameters)."""
        if self.case.device != "meta":
            return workload.build_model()
        try:
            with torch.device("meta"):
                return workload.build_model()
        except Exception:  # noqa: BLE001 - a construction meta tensors cannot run: built on the CPU, then moved
            return workload.build_model()

    def place(self, value: Any) -> Any:
        """The freshly built model, or a (nested) batch, on the case's device (a hook point: the fake-tensor
        engine, `bench.run.fake_pass.FakeSession`, keeps what it built as fake tensors instead)."""
        if isinstance(value, torch.nn.Module):
            return value.to(self.case.device)
        return to_device(value, self.case.device)

    def load_host_batch(self) -> Any:
        """The whole batch of the case in host memory, before the strategy shards it (a hook point)."""
        return cpu_batch(self.case.workload, self.case.batch_size, self.case.data)

    def forward(self, inputs: Any = None) -> Any:
        """The model's output on `inputs` (default: the session's batch), inside the strategy's forward context."""
        with self.strategy.forward():
            return self.workload.run_model(self.model, self.x if inputs is None else inputs)

    def loss(self, predicted: Any, target: torch.Tensor | None = None) -> torch.Tensor:
        """The workload's loss on the output in float32 (losses are not autocast-safe), outside autocast."""
        return self.loss_of(to_float32(predicted), self.y if target is None else target)

    def batch(self) -> tuple[Any, torch.Tensor]:
        """The (inputs, target) of one step, from where the strategy loads it."""
        return self.strategy.load_batch(self.host_batch, (self.x, self.y))

    def forward_backward(self, mark: Callable[[str], None] = _no_mark,
                         seen: Callable[[Any, torch.Tensor], None] | None = None) -> tuple[Any, torch.Tensor]:
        """Forward, loss and backward on each of the strategy's micro-batches of one step's batch (the whole batch
        unless it splits it), each loss weighted as it says; returns the last micro-batch's output and loss, as
        the loop's variables hold them after it. `seen(output, weighted loss)` is told of each micro-batch.

        The lifetimes are those of the literal loop `pred = model(x); loss = criterion(pred, y); loss.backward()`:
        the previous output (in `kept`) is alive during the forward and released when it returns and `pred` is
        rebound; the previous loss is released once the new one exists. Neither is alive during the backward."""
        s = self.strategy
        kept = self.kept
        for inputs, target, weight in s.micro_batches(*self.batch()):
            mark("forward")
            predicted = kept["predicted"] = self.forward(inputs)
            loss = self.loss(predicted, target)
            if weight != 1:
                loss = loss * weight
            kept["loss"] = loss
            mark("backward")
            s.backward(loss)
            if seen is not None:
                seen(predicted, loss)
        return predicted, loss

    def step(self, mark: Callable[[str], None] = _no_mark) -> None:
        """One step of the case's phase; `mark` is told when the forward, backward and optimizer stages begin."""
        if self.case.phase == "train":
            self.train_step(mark)
        else:
            self.eval_step(mark)

    def train_step(self, mark: Callable[[str], None] = _no_mark) -> None:
        """The article's training step: forward, loss, backward (per micro-batch), optimizer step, zero_grad."""
        s = self.strategy
        predicted, loss = self.forward_backward(mark)
        mark("optimizer")
        s.optimizer_step(self.optimizer)
        s.zero_grad(self.optimizer)
        s.accumulate_loss(lambda: loss)
        s.end_step(self.kept)

    def eval_step(self, mark: Callable[[str], None] = _no_mark) -> None:
        """The article's validation step: the model in eval mode, one forward pass (autograd as the strategy says);
        the previous output is released when the forward returns, as `pred = model(x)` rebinds it."""
        mark("forward")
        inputs, target = self.batch()
        predicted = self.kept["predicted"] = self.forward(inputs)
        self.strategy.accumulate_loss(lambda: self.loss(predicted, target))
        self.strategy.end_step(self.kept)

    def watch_grads(self, callback: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """`callback(param)` runs as each parameter's gradient is accumulated, until the handle is removed."""
        if not self.observe_grads:
            raise RuntimeError("watch_grads needs a Session built with observe_grads=True")
        handle = RemovableHandle(self._grad_watchers)
        self._grad_watchers[handle.id] = callback
        return handle

    def parameters(self) -> list[torch.Tensor]:
        return list(self.base_model.parameters())

    def batch_tensors(self) -> list[torch.Tensor]:
        return tensors_of((self.x, self.y))

    def optimizer_state(self) -> list[torch.Tensor]:
        optimizer = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer keeps its shard's here
        return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
