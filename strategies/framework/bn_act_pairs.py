"""Finding a model's BatchNorm -> activation pairs (torch.fx) and fusing each into one call, for the BN+act strategies.

`find_pairs(model)` traces the model symbolically with torch.fx and returns every BatchNorm module call whose only
consumer is an activation, possibly through `nn.Identity` modules (timm's `drop_block`): a module (`nn.ReLU` in a
Sequential, timm's `act1`) or a function (`F.relu(x)` in the captcha ResNet's own forward code). Modules that are
not registered as submodules (the captcha ResNet's stage list) are traced through. A BatchNorm or activation module
called more than once, a BatchNorm whose output has another consumer (the residual add before the block's last
ReLU), an activation that is not element-wise: no pair.

`install(model, pairs, fused_forward)` replaces each pair's BatchNorm `forward` with the fused computation and
makes its activation module pass its input through. A functional activation cannot be replaced in the model's
code: `SkipActivations`, a TorchFunctionMode entered around the forward, returns the fused output unchanged when the
model's code applies that activation to it.

Limitations: only what torch.fx can trace is searched (a model with data-dependent control flow is `unsupported`
with the tracer's error); a BatchNorm followed by an add and then an activation is not a pair.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from bench.core.errors import Unsupported

BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)  # exact classes: a subclass may change forward
ACTIVATION_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.SiLU, nn.GELU, nn.Hardswish,
                      nn.Hardtanh, nn.Mish, nn.Tanh, nn.Sigmoid)
ACTIVATION_FUNCTIONS = (F.relu, torch.relu, torch.relu_, F.relu_, F.relu6, F.leaky_relu, F.leaky_relu_, F.elu,
                        F.celu, F.selu, F.silu, F.gelu, F.hardswish, F.hardtanh, F.mish, torch.tanh, torch.sigmoid)
# producers of a fresh tensor that nothing else reads when the BatchNorm is their only user (inplace_abn may
# overwrite it)
FRESH_PRODUCERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                   nn.Linear)


@dataclass
class Pair:
    """One BatchNorm -> activation pair of a model, as traced."""

    bn_name: str
    bn: nn.Module
    act_name: str  # the module's qualified name, or the function's name
    act_module: nn.Module | None  # None: a functional activation in the model's code
    act_function: Callable | None = None
    act_args: tuple = ()  # the functional activation's constant arguments after its input
    act_kwargs: dict = field(default_factory=dict)
    input_exclusive: bool = False  # BatchNorm's input is a fresh conv/linear output read by nothing else

    def kind(self) -> type | Callable:
        """The activation's class (module) or function, for what a strategy accepts."""
        return type(self.act_module) if self.act_module is not None else self.act_function

    def negative_slope(self) -> float | None:
        """0 for ReLU, the slope of a leaky ReLU, None for any other activation."""
        if self.act_module is not None:
            if type(self.act_module) is nn.ReLU:
                return 0.0
            return self.act_module.negative_slope if type(self.act_module) is nn.LeakyReLU else None
        if self.act_function in (F.relu, torch.relu, torch.relu_, F.relu_):
            return 0.0
        if self.act_function in (F.leaky_relu, F.leaky_relu_):
            return float(self.act_kwargs.get("negative_slope", self.act_args[0] if self.act_args else 0.01))
        return None


class _Tracer(fx.Tracer):
    """torch.fx's tracer, tracing through modules the model calls but does not register (a list of stages)."""

    def call_module(self, m, forward, args, kwargs):
        try:
            self.path_of_module(m)
        except NameError:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)


def _is_constant(value: Any) -> bool:
    return not isinstance(value, fx.Node) and not (isinstance(value, (tuple, list)) and
                                                  any(isinstance(v, fx.Node) for v in value))


_HAS_BATCHNORM: dict[str, bool] = {}  # workload spec -> whether its model has a BatchNorm layer


def has_batchnorm(workload: Any) -> bool:
    """Whether `workload`'s model has a BatchNorm layer, looked up on its model that holds no memory
    (`Workload.model_structure`: a check must not build an 8B model to count its layers), once per spec."""
    spec = workload.spec()
    if spec not in _HAS_BATCHNORM:
        _HAS_BATCHNORM[spec] = any(type(m) in BATCHNORMS for m in workload.model_structure().modules())
    return _HAS_BATCHNORM[spec]


def require_batchnorm(name: str, workload: Any) -> None:
    """Unsupported, in any phase, when `workload`'s model has no BatchNorm layer (checked before the phase: the
    row then says why the strategy can never apply to it)."""
    if workload is None:
        return
    if not has_batchnorm(workload):
        raise Unsupported(f"{name}: workload {workload.spec()!r} has no BatchNorm layer, so no BatchNorm->activation "
                          "pair")


def find_pairs(model: nn.Module, owner: str) -> tuple[list[Pair], int]:
    """The model's BatchNorm -> activation pairs and its number of BatchNorm modules; Unsupported when it has no
    BatchNorm or cannot be traced. `owner` names the model in messages."""
    batchnorms = [m for m in model.modules() if type(m) in BATCHNORMS]
    if not batchnorms:
        raise Unsupported(f"{owner} has no BatchNorm layer, so no BatchNorm->activation pair")
    was_training = model.training
    try:
        graph = _Tracer().trace(model)
    except Exception as error:  # noqa: BLE001 - any tracer failure means the same thing here
        raise Unsupported(f"{owner}: pairs are found by tracing with torch.fx, which fails on this model "
                          f"({type(error).__name__}: {str(error).splitlines()[0][:160]})") from None
    finally:
        model.train(was_training)
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or type(modules[node.target]) not in BATCHNORMS or calls[node.target] != 1:
            continue
        previous, consumer = None, node
        while len(consumer.users) == 1:
            previous, consumer = consumer, next(iter(consumer.users))
            if not (consumer.op == "call_module" and type(modules[consumer.target]) is nn.Identity):
                break
        if previous is None or not consumer.args or consumer.args[0] is not previous:
            continue
        producer = node.args[0] if node.args else None
        exclusive = (isinstance(producer, fx.Node) and producer.op == "call_module"
                     and isinstance(modules[producer.target], FRESH_PRODUCERS) and len(producer.users) == 1)
        if consumer.op == "call_module" and type(modules[consumer.target]) in ACTIVATION_MODULES \
                and calls[consumer.target] == 1:
            pairs.append(Pair(node.target, modules[node.target], consumer.target, modules[consumer.target],
                              input_exclusive=exclusive))
        elif consumer.op == "call_function" and consumer.target in ACTIVATION_FUNCTIONS \
                and all(_is_constant(a) for a in consumer.args[1:]) \
                and all(_is_constant(v) for v in consumer.kwargs.values()):
            pairs.append(Pair(node.target, modules[node.target], consumer.target.__name__, None,
                              consumer.target, tuple(consumer.args[1:]), dict(consumer.kwargs),
                              input_exclusive=exclusive))
    return pairs, len(batchnorms)


def _pass_through(x, *args, **kwargs):
    return x


class SkipActivations(TorchFunctionMode):
    """Inside the forward: a functional activation applied to a fused pair's output (already activated) returns
    it unchanged; every other call runs as it is."""

    def __init__(self, marked: dict[int, weakref.ref]):
        super().__init__()
        self.marked = marked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ACTIVATION_FUNCTIONS and args and isinstance(args[0], torch.Tensor):
            ref = self.marked.pop(id(args[0]), None)
            if ref is not None and ref() is args[0]:
                return args[0]
        return func(*args, **kwargs)


class FusedPairs:
    """The pairs of one model, fused: each BatchNorm computes its activation too (`fused_forward(pair, bn_forward,
    activation, x)`), each activation module passes its input through, functional activations are skipped by the
    mode `skipping()` gives (None when the model has none)."""

    def __init__(self, pairs: list[Pair],
                 fused_forward: Callable[[Pair, Callable, Callable, torch.Tensor], torch.Tensor]):
        self.pairs = pairs
        self.marked: dict[int, weakref.ref] = {}  # id(output) -> output, for functional activations to skip
        for pair in pairs:
            bn_forward = pair.bn.forward
            if pair.act_module is not None:
                activation = pair.act_module.forward
                pair.act_module.forward = _pass_through
            else:
                activation = _functional(pair)
            pair.bn.forward = self._fused(pair, bn_forward, activation, fused_forward)

    def _fused(self, pair, bn_forward, activation, fused_forward):
        marked = self.marked

        def forward(x):
            out = fused_forward(pair, bn_forward, activation, x)
            if pair.act_module is None:
                marked[id(out)] = weakref.ref(out)
            return out
        return forward

    def skipping(self) -> SkipActivations | None:
        if all(pair.act_module is not None for pair in self.pairs):
            return None
        self.marked.clear()
        return SkipActivations(self.marked)


def _functional(pair: Pair) -> Callable[[torch.Tensor], torch.Tensor]:
    function, args, kwargs = pair.act_function, pair.act_args, pair.act_kwargs

    def activation(x):
        return function(x, *args, **kwargs)
    return activation


def pair_summary(pairs: list[Pair], batchnorms: int) -> str:
    """`9 of 20 BatchNorms (relu x9)`: how many pairs, of how many BatchNorm layers, with which activations."""
    kinds: dict[str, int] = {}
    for pair in pairs:
        name = type(pair.act_module).__name__ if pair.act_module is not None else pair.act_function.__name__
        kinds[name] = kinds.get(name, 0) + 1
    return f"{len(pairs)} of {batchnorms} BatchNorms ({', '.join(f'{k} x{n}' for k, n in kinds.items())})"


def require_pairs(pairs: list[Pair], batchnorms: int, owner: str, name: str) -> None:
    """Unsupported when the model has BatchNorm layers but none feeds an activation as a pair."""
    if not pairs:
        raise Unsupported(f"{name}: none of the {batchnorms} BatchNorm layers of {owner} feeds an activation "
                          "directly (each is followed by something else, e.g. a residual add)")
