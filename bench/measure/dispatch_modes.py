"""The base of membench's dispatch modes: torch.compile compiles under them, and they see the compiled code run.

PyTorch's default for a TorchDispatchMode is that dynamo runs a model eagerly under it, so that the mode sees every
operator eager execution would run. membench's modes measure the step as it runs, so they declare
`ignore_compile_internals`: the mode is off while dynamo and AOTAutograd trace, and on while the compiled code runs
(its operators on fake tensors as on real ones).
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class CompiledCodeMode(TorchDispatchMode):
    """A dispatch mode under which a compiled model compiles and runs its compiled code (see the module)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: off while torch.compile traces, on while its compiled code runs."""
        return True
