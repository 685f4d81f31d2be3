"""FSDP2: parameters, gradients and optimizer state sharded across ranks (`fully_shard` on each unit and the root).

Options: `replicate=R` (hybrid sharding, HSDP: the ranks as an R x N/R mesh, each parameter sharded over the N/R
ranks of a replica group and replicated across the R groups, whose gradients an all-reduce averages),
`offload=cpu` (FSDP2's `CPUOffloadPolicy`: the sharded parameters, their gradients and the optimizer state live
in host memory and the optimizer steps there; the device holds only the units' unsharded parameters in flight;
CUDA only, since on the CPU the host is the device), `reshard_after_forward=false` (each unit keeps its
unsharded parameters from its forward to its backward instead of all-gathering them again: more memory, one
all-gather fewer per unit), and FSDP2's `MixedPrecisionPolicy`: `param_dtype` (the dtype of the unsharded
parameters, so of the all-gather and of the forward and backward's compute; the sharded parameters, their
gradients and the optimizer state keep the model's dtype), `reduce_dtype` (the dtype the gradients are
reduce-scattered in; unset, `param_dtype`'s), `output_dtype` (the dtype each unit's floating outputs are cast to)
and `cast_forward_inputs` (whether each unit's floating inputs are cast to `param_dtype`; default true), each dtype
one of DTYPE_CHOICES (`none`: FSDP2's default, the model's own dtype). A row with any of them 16-bit is verified
with 16-bit tolerances (`MIXED_PRECISION_TOLERANCE`).

The buffers of its collectives are filed as communication in the breakdown (`bench.core.memory_categories`), where
FSDP2 allocates them: the flat all-gather output (its `AllGather.allocate`), the flat reduce-scatter input and
output (`ReduceScatter.allocate`; the output becomes the sharded gradients). The unsharded parameters (each
parameter's own all-gather output, which the flat buffer is copied into) are weights.
"""

import warnings

import torch

from bench.core.errors import Unsupported, UsageError
from bench.core.memory_categories import COMMUNICATION, WEIGHTS, allocating, file_as, listening
from strategies.amp import Amp
from strategies import register_strategy
from strategies.framework.sharding import (Sharded, StoragesSeen, check_divides_ranks, gloo_copy_of_input,
                                          issued_and_released, rank_and_world)

# FSDP2 warns when a wrapped model returns a view (the captcha ResNet's reshaped softmax) that an in-place op could
# break; the runner never modifies a model's output in place, so the warning would only be noise in every run.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning)

OFFLOAD_CHOICES = ("none", "cpu")
DTYPE_CHOICES = ("none", "float32", "bfloat16", "float16")  # "none": FSDP2's default (the parameters' own dtype)
DTYPE_OPTIONS = ("param_dtype", "reduce_dtype", "output_dtype")
SIXTEEN_BIT = ("bfloat16", "float16")
# A 16-bit param_dtype computes the forward and backward in 16 bits, as amp's autocast computes its matmuls (the
# loss and the sharded gradients stay float32); a 16-bit reduce_dtype or output_dtype rounds the gradients or the
# outputs to 16 bits once. amp's tolerances, measured for that rounding, apply (tests/test_ranks.py: the row
# differs from the baseline by more than the exact tolerance, and within these).
MIXED_PRECISION_TOLERANCE = Amp.tolerance


def _communication_comms():
    """FSDP2's default all-gather and reduce-scatter, whose buffers are allocated as communication, and whose real
    collectives end when gloo has let go of them (`issued_and_released`). Imported here: torch.distributed.fsdp
    pulls in DTensor, over a second of every CLI start."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class Released(dist.Work):
        """A collective's work whose `wait()` returns once the process group holds none of its tensors."""

        def __init__(self, issue, tensors, group):
            super().__init__()
            self.work, self.settle = issued_and_released(issue, tensors, group)

        def wait(self, timeout=None):
            with StoragesSeen() as seen:  # gloo copies its own buffers into ours in this thread, here
                done = self.work.wait() if timeout is None else self.work.wait(timeout)
            self.settle(self, seen.storages)
            return done

    class CommunicationAllGather(DefaultAllGather):
        def allocate(self, size, *, dtype, device):
            with allocating(COMMUNICATION):
                return super().allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            issue = lambda output, input: super(CommunicationAllGather, self).__call__(output, input, group,
                                                                                        async_op=True)
            released = Released(issue, (output_tensor, input_tensor), group)
            if async_op:
                return released
            released.wait()
            return None

    class CommunicationReduceScatter(DefaultReduceScatter):
        def allocate(self, size, *, dtype, device):
            with allocating(COMMUNICATION):
                return super().allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            issue = lambda output, input: super(CommunicationReduceScatter, self).__call__(output, input, group,
                                                                                            op, async_op=True)
            gloo_copy = gloo_copy_of_input(input_tensor, group)
            released = Released(issue, (output_tensor, input_tensor), group)
            if async_op:
                return released
            released.wait()
            del gloo_copy  # gloo's own copy lives as long: until its wait() has copied the result out
            return None

    return CommunicationAllGather(), CommunicationReduceScatter()


def _file_unsharded_as_weights(module, args):
    """A forward pre-hook that runs after FSDP2's own (which all-gathers the unit): the unit's parameters are now
    its unsharded ones (each a view of its own all-gather output, a storage FSDP2 keeps and resizes to nothing
    between uses), filed as weights from this first forward on."""
    if listening():  # the units inside it are still sharded (their shards are weights already)
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:  # each parameter's unsharded one (a DTensor on the tp mesh, with tensor parallelism)
            file_as((fsdp_param.unsharded_param for fsdp_param in group.fsdp_params), WEIGHTS)


@register_strategy
class FSDP(Sharded):
    """`torch.distributed.fsdp.fully_shard` on each of the workload's checkpoint units (that owns parameters) and
    on the root: each rank keeps 1/N of every parameter, gradient and optimizer state, and all-gathers a unit's
    parameters just before it runs (freeing them after), so the peak holds one unit's full weights at a time.
    Options: `replicate` (HSDP replica groups), `offload=cpu` (CUDA), `reshard_after_forward`, and the mixed
    precision policy's `param_dtype`, `reduce_dtype`, `output_dtype`, `cast_forward_inputs` (module docstring).
    Composes with checkpoint, amp and lora. Exact up to float summation order (with a 16-bit dtype option, within
    16-bit tolerances); BatchNorm models do not match.

    Limitations: it needs `--ranks 2` or more, which `replicate` must divide, and a BatchNorm model differs from the
    single process (per-rank statistics). It shards the workload's checkpoint units that own parameters, and the
    root: a parameter outside those units is the root's, all-gathered with it. Parameters are split by rows (dim 0,
    torch.chunk's split), so a parameter with fewer rows than shards leaves some ranks an empty chunk and ranks can
    hold unequal shares. `offload=cpu` is CUDA only, and its host memory is not in `peak_mem_bytes`: it is
    `offload_host_peak_bytes`, counted right after each optimizer step."""

    name = "fsdp"
    description = "FSDP2 fully_shard per checkpoint unit and root: parameters, gradients, optimizer state sharded"
    priority = 70
    options = {"replicate": 1, "offload": "none", "reshard_after_forward": True, "param_dtype": "none",
               "reduce_dtype": "none", "output_dtype": "none", "cast_forward_inputs": True}
    row_columns = ("offload_host_peak_bytes",)  # filled with offload=cpu only
    refusals = (*Sharded.refusals, r"fsdp:replicate=\d+ does not divide --ranks",
                r"fsdp:offload=cpu needs device cuda")

    @classmethod
    def plan_settings(cls, space):
        """On several ranks, FSDP2 as it is; on CUDA also with parameters, gradients and optimizer state on the host
        (`offload=cpu`), what lets a model whose sharded states exceed its GPUs train on fewer of them, and each
        with the mixed precision policy FSDP2 is almost always run with (torchtitan's default: parameters
        all-gathered and computed in bfloat16, gradients reduced in float32)."""
        settings = super().plan_settings(space)
        if not settings or space.context.device != "cuda":
            return settings
        mixed = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
        return settings + [{"offload": "cpu"}, mixed, {"offload": "cpu", **mixed}]

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["offload"] not in OFFLOAD_CHOICES:
            raise UsageError(f"fsdp:offload={self.settings['offload']!r}; valid choices: {', '.join(OFFLOAD_CHOICES)}")
        if self.settings["replicate"] < 1:
            raise UsageError(f"fsdp:replicate={self.settings['replicate']} must be at least 1 (1: no replica groups)")
        for option in DTYPE_OPTIONS:
            if self.settings[option] not in DTYPE_CHOICES:
                raise UsageError(f"fsdp:{option}={self.settings[option]!r}; valid choices: {', '.join(DTYPE_CHOICES)}")
        if any(self.settings[option] in SIXTEEN_BIT for option in DTYPE_OPTIONS):
            self.tolerance = MIXED_PRECISION_TOLERANCE  # an instance's: plain fsdp stays exact
        self.optimizer = None
        self.host_peak_bytes = 0

    def check(self, context):
        super().check(context)
        replicate = self.settings["replicate"]
        check_divides_ranks("fsdp:replicate", replicate, context.ranks)
        if self.settings["offload"] == "cpu" and context.device != "cuda":
            raise Unsupported(f"fsdp:offload=cpu needs device cuda, not {context.device}: on the CPU the host is the "
                              "device, so the offload saves nothing")

    def mesh(self, model=None):
        """The ranks as one mesh of the case's device (1-D), or replicate x shard (2-D, HSDP): without a mesh FSDP2
        takes torch's default accelerator (CUDA wherever torch sees a GPU) and moves the model there, so a
        `--device cpu` case would train on the GPU. A model tensor parallelism split (strategies/tp.py, its
        parameters DTensors on the tp dimension of a dp x tp mesh): that mesh's dp dimension, as torchtitan shards."""
        from torch.distributed.device_mesh import DeviceMesh

        _, world = rank_and_world()
        replicate = self.settings["replicate"]
        split = next((p.device_mesh for p in (model.parameters() if model is not None else ())
                      if hasattr(p, "device_mesh")), None)
        if split is not None:
            if replicate != 1:
                raise Unsupported(f"fsdp:replicate={replicate} with tp: hybrid sharding over a dp x tp mesh is not "
                                  "supported; use fsdp+tp")
            return split._get_root_mesh()["dp"]
        if replicate == 1:
            return DeviceMesh(self.context.device, list(range(world)))
        shard = world // replicate  # nested lists, not a tensor: on fake tensors the mesh's table must be real
        table = [[group * shard + i for i in range(shard)] for group in range(replicate)]
        return DeviceMesh(self.context.device, table, mesh_dim_names=("replicate", "shard"))

    def prepare_model(self, model, units):
        """`fully_shard` on each unit with parameters, then on the root, over `mesh()`; the collectives' buffers
        and the unsharded parameters filed for the breakdown (module docstring)."""
        # imported here: torch.distributed.fsdp pulls in DTensor, over a second of every CLI start
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # rows of each parameter as this rank holds it before sharding (a tensor-parallel shard's own, on a tp mesh)
        self.parameter_rows = [getattr(p, "_local_tensor", p).shape[0] if p.dim() else 1 for p in model.parameters()]
        mesh = self.mesh(model)
        # the ranks each parameter is sharded over: a tp mesh's dp dimension, whose place a rank has by its group
        self.shard_ranks = mesh.size() if any(hasattr(p, "device_mesh") for p in model.parameters()) else None
        offload = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.settings["offload"] == "cpu"
                   else OffloadPolicy())
        dtypes = {option: None if self.settings[option] == "none" else getattr(torch, self.settings[option])
                  for option in DTYPE_OPTIONS}
        precision = MixedPrecisionPolicy(**dtypes, cast_forward_inputs=self.settings["cast_forward_inputs"])
        options = {"mesh": mesh, "offload_policy": offload, "mp_policy": precision,
                   "reshard_after_forward": self.settings["reshard_after_forward"]}
        sharded = [unit for unit in units if any(True for _ in unit.parameters())]
        for unit in sharded:
            fully_shard(unit, **options)
        fully_shard(model, **options)
        all_gather, reduce_scatter = _communication_comms()
        for module in (*sharded, model):
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
            module.register_forward_pre_hook(_file_unsharded_as_weights)
        return model

    def wrap_optimizer(self, optimizer, model):
        """The optimizer as it is; with offload=cpu, its steps are followed by a count of the host memory (the
        optimizer's state lives there)."""
        if self.settings["offload"] == "cpu":
            self.optimizer = optimizer
            optimizer.register_step_post_hook(lambda *_: self._count_host_bytes())
        return optimizer

    def _count_host_bytes(self) -> None:
        self.host_peak_bytes = max(self.host_peak_bytes, self._host_bytes())

    def _host_bytes(self) -> int:
        """Bytes of host tensors FSDP2 keeps with `offload=cpu`: the sharded parameters, their gradients and the
        optimizer's state, counted once per storage, right after the optimizer step (all three alive)."""
        tensors = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                tensors += [p, p.grad, *self.optimizer.state.get(p, {}).values()]
        storages = {}  # a storage's C++ object -> its bytes (fake tensors have no data pointer)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t = getattr(t, "_local_tensor", t)
                if t.device.type == "cpu":
                    storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def columns(self):
        return {"offload_host_peak_bytes": self.host_peak_bytes} if self.settings["offload"] == "cpu" else {}

    def rank_signature(self, rank, world):
        """A rank holds dim-0 chunk `rank` of every parameter over its shard group (torch.chunk's split, as FSDP2
        shards: chunks of ceil(rows / shards) rows, the last ones shorter or empty; with `replicate` groups, the
        rank's place in its group) and its share of the batch; ranks whose chunks and share are all the same size
        allocate the same."""
        shards = world // self.settings["replicate"]
        place = rank % shards
        if getattr(self, "shard_ranks", None):  # on a dp x tp mesh (strategies/tp.py): its tp group's dp place
            shards = self.shard_ranks
            place = rank // (world // shards)

        def rows_of_chunk(rows: int) -> int:
            chunk = -(-rows // shards)
            return max(0, min(chunk, rows - place * chunk))

        return ("samples", self.samples_of_rank(rank, world),
                "rows", tuple(rows_of_chunk(rows) for rows in self.parameter_rows))
