"""Memory-saving strategies, registered by name; `parse_strategy("checkpoint+amp")` composes them."""

from strategies.base import (  # noqa: F401
    EXACT, PHASES, STRATEGIES, StepContext, Strategy, Tolerance, register_strategy,
)
from strategies.composite import Composite  # noqa: F401
from strategies.spec import StrategySpec, bind_strategy, parse_strategy  # noqa: F401

# Importing a strategy module registers it; one module per strategy.
from strategies import baseline  # noqa: E402,F401
from strategies import (  # noqa: E402,F401
    inplace_relu, checkpoint, bn_act_recompute, inplace_abn, amp, del_intermediates, no_grad_eval, cudnn_benchmark,
    selective_checkpoint, offload, compile,
    grad_accumulation, optimizer_in_backward, optimizer, keep_grads, empty_cache, pinned_loader,
    pitfall_loss_sum, pitfall_retain_graph,
    chunked_loss, lora, qlora, bf16_weights,
    ddp, zero1, fsdp,
)
from strategies import offload_activations  # noqa: E402,F401
