"""Automatic mixed precision: the forward under `torch.autocast`, the backward through a GradScaler."""

from __future__ import annotations

import torch

from bench.core.errors import UsageError
from strategies import Strategy, Tolerance, register_strategy

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@register_strategy
class Amp(Strategy):
    """Autocast around the forward only (the runner's BCELoss runs on `predicted.float()` outside it).

    Option `dtype`: `auto` (float16 on CUDA, bfloat16 on the CPU, where float16 autocast is very slow), `float16`
    or `bfloat16`. Gradients are scaled by a GradScaler only for float16; bfloat16 has float32's exponent range, so
    its scaler is disabled. The dtype used is written into the row as `amp.dtype`.

    Tolerance: 16-bit matmuls and convolutions do not reproduce fp32. Measured at batch 8 on the CPU (synthetic
    data), bfloat16 against fp32 from the same seed: loss_rel_diff 2.2e-4 (2.4e-4 at batch 2); per-parameter
    gradient relative norm difference max 0.47 (0.45 at batch 2, median 0.37, largest on BatchNorm weights and
    biases, whose gradients are sums with heavy cancellation at initialisation, where 8-bit mantissas lose most
    of the signal); eval output max abs difference 6.6e-5 (softmax probabilities). On other workloads the loss
    differs more: deep_mlp:layers=24:width=8 at batch 8 (MSE of a 24-layer linear chain) 2.9e-3, which is less
    than one bfloat16 rounding step (2**-8 = 3.9e-3). Tolerance, with margin: loss 1e-2 (about 2.5 bfloat16
    steps), gradients 0.75, outputs 1e-3 element by element or 0.05 in relative norm (deep_mlp's regression
    outputs differ by up to 0.033 where they reach 2.6; unet's logits 1.4e-3, gpt_mini's 1.8e-3 at batch 2). The gradient check is thus weak for amp: it catches a missing or
    mis-scaled gradient (a factor of the GradScaler's 65536, or zeros), not bf16 rounding. The weights after one
    step are not compared: Adam's first step is about `lr * sign(g)` for every element, and bf16 rounding flips
    the sign of the tiniest gradients (deep_mlp's zero-initialised biases: 0.71 of their norm at batch 8).

    Limitations: verification is weak for it (the tolerances above): it cannot tell a wrong rounding from bf16's.
    On the CPU `auto` is bfloat16, so a CPU row says nothing of float16's range. With float16 the GradScaler skips
    the optimizer step of a step whose gradients hold an inf or NaN; bfloat16 runs with the scaler disabled, so no
    step is skipped.
    """

    name = "amp"
    keeps_training_state = True
    description = "autocast forward in 16-bit floats; GradScaler on the backward for float16"
    options = {"dtype": "auto"}
    tolerance = Tolerance(loss_rtol=1e-2, grad_rtol=0.75, output_atol=1e-3, output_rtol=0.05, step_rtol=float("inf"))
    priority = 40  # inside no_grad/outer contexts; applies to whatever model the transforms built
    # Train 221,420,444 -> 201,052,956 (0.908) on captcha_resnet18 at batch 8; pinned by comparison in
    # tests/test_strategies.py (test_amp_lowers_train_peak, test_checkpoint_plus_amp_lowest_train_peak)
    memory_effect = {}  # no band on captcha_resnet18: see above

    @classmethod
    def plan_settings(cls, space):
        """On CUDA both 16-bit types (a GPU without bfloat16 is refused by the planner's device figures); on the
        CPU bfloat16, its autocast type."""
        return [{"dtype": "float16"}, {"dtype": "bfloat16"}] if space.context.device == "cuda" else [{}]

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["dtype"] not in ("auto", *DTYPES):
            raise UsageError(f"amp:dtype={self.settings['dtype']!r}; valid choices: auto, {', '.join(DTYPES)}")
        self.scaler: torch.amp.GradScaler | None = None
        self._unscaled: set[int] = set()

    @property
    def device_type(self) -> str:
        return torch.device(self.context.device).type

    @property
    def dtype_name(self) -> str:
        if self.settings["dtype"] != "auto":
            return self.settings["dtype"]
        return "float16" if self.device_type == "cuda" else "bfloat16"

    def _new_scaler(self) -> torch.amp.GradScaler:
        self._unscaled = set()
        return torch.amp.GradScaler(self.device_type, enabled=self.dtype_name == "float16")

    def bind(self, context):
        super().bind(context)
        self.scaler = self._new_scaler()

    def prepare_model(self, model, units):
        self.scaler = self._new_scaler()  # one scaler per session: each pass starts from the same state
        return model

    def forward(self):
        return torch.autocast(self.device_type, dtype=DTYPES[self.dtype_name])

    def _scaler(self) -> torch.amp.GradScaler:
        if self.scaler is None:
            self.scaler = self._new_scaler()
        return self.scaler

    def backward(self, loss):
        self._scaler().scale(loss).backward()

    def unscale_grads(self, optimizer):
        if id(optimizer) in self._unscaled:  # GradScaler raises on a second unscale_ before update()
            return
        self._scaler().unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer):
        scaler = self._scaler()
        scaler.step(optimizer)  # skips its own unscale_ if unscale_grads already ran this step
        scaler.update()
        self._unscaled.clear()

    def describe(self):
        return {"amp.dtype": self.dtype_name}
