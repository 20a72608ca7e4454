"""Make megatron-core run on a CPU-only machine (gloo, no CUDA).

megatron-core 0.19 assumes CUDA in a handful of places that every CPU run hits:

- ``torch.cuda.current_device()`` is used as an allocation device (RoPE, dist-checkpoint
  finalize, the global memory buffer) -> it resolves to ``"cpu"``.
- ``torch.cuda.synchronize()`` is called by dist-checkpoint save -> no-op.
- The CUDA RNG tracker (``model_parallel_cuda_manual_seed`` and ``fork()`` around dropout and
  weight init) reads and writes CUDA generator state -> a tracker over the CPU generator.
- MTP (``MTPLossLoggingHelper``'s tracker, ``roll_tensor`` under context parallelism) allocates on
  ``torch.cuda.current_device()`` too: covered by the same mapping, nothing else to patch.
- RoPE under context parallelism (``get_pos_emb_on_this_cp_rank``) builds its chunk index in
  pinned memory and moves it with ``.cuda()`` -> the index is built on the embedding's device.

The training path (optimizers, grad clipping, pipeline schedules, DDP) adds about twenty places
that allocate with a literal ``device="cuda"``, call ``.cuda()``, wait on CUDA streams, or accept a
parameter only if ``param.type()`` names a CUDA tensor type. Rather than patch each one,
``cuda_to_cpu()`` is a context (a torch function mode) in which a CUDA device argument means the
CPU, ``.cuda()`` is the identity, a CPU tensor's ``type()`` answers with its CUDA name, and the
current CUDA stream is one whose waits do nothing. Wrap training steps in it. That also covers
bf16 / fp16 training: ``Float16Module`` and the mixed-precision optimizers (their fp32 main
weights, fp16 loss scaling and inf checks) accept a CPU ``torch.BFloat16Tensor`` or
``torch.HalfTensor`` parameter by its CUDA name and need nothing else.

MoE (megatron-core 0.16 - 0.19): the router's weight and buffers go to ``current_device()`` (the
CPU, above); the all-to-all token dispatcher creates a class-wide CUDA stream for its
device-to-host copies and waits on it, hands its split sizes to ``all_to_all_single`` as numpy
arrays only when they were CUDA tensors, and 0.16 / 0.17's aux-loss tracker allocates on a literal
"cuda" -> the stream is a null stream, CPU split sizes become numpy arrays as on a GPU, and
``MoELayer.forward`` runs inside ``cuda_to_cpu()``. At TP > 1 it all-gathers and reduce-scatters
tensors of unequal sizes, which gloo refuses -> padded / all-reduced equivalents. Its metric
reduction (``MoEMetricsTracker.report``) averages over data-parallel ranks with
``ReduceOp.AVG``, which gloo lacks -> a sum divided by the group size, on gloo only.

This is the only module that patches megatron-core or torch for a run (``_eager_fusions`` swaps
``torch.compile`` only while megatron-core is imported). ``install()`` and ``cuda_to_cpu()``
are no-ops when CUDA is available, so GPU runs execute megatron-core unmodified.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def install() -> bool:
    """Install the CPU adaptations once per process. Returns True if they are active."""
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed:
        return True

    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None

    # The "CUDA" generator of a CPU process is the CPU generator. Checkpointed recompute
    # (CheckpointFunction) saves and restores it through these two module-level functions.
    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )
    mcore_random._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class(mcore_random.CudaRNGStatesTracker)()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # model_parallel_cuda_manual_seed() would call torch.cuda.manual_seed, which queues a lazy
    # CUDA call that fails later; seed the CPU generator instead.
    torch.cuda.manual_seed = lambda seed: None
    _install_rope_cp()
    _install_moe()
    _install_uneven_collectives()
    _install_layer_wise_param_sync()
    _install_gloo_average()
    _installed = True
    return True


def _install_rope_cp():
    """Replace ``get_pos_emb_on_this_cp_rank`` (pinned memory + ``.cuda()``) where it is bound."""
    import importlib

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        # Same split as megatron's: 2 x CP chunks along seq_dim, this rank keeps r and 2CP-1-r.
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        shape = pos_emb.shape
        chunks = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])
        chunks = chunks.index_select(seq_dim, index)
        return chunks.view(*chunks.shape[:seq_dim], -1, *chunks.shape[seq_dim + 2:])

    prefix = "megatron.core.models.common.embeddings."
    for name in ("rope_utils", "rotary_pos_embedding", "yarn_rotary_pos_embedding"):
        try:
            module = importlib.import_module(prefix + name)
        except ImportError:  # yarn's module is not in every release
            continue
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def _install_moe():
    """MoE on a CPU: the all-to-all dispatcher's DtoH stream, and CUDA devices in the forward."""
    import functools

    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    # Created by the first all-to-all dispatcher (torch.cuda.Stream() fails without CUDA); its
    # copies are no-ops on a CPU, where every tensor already is.
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    if getattr(dispatcher, "cuda_dtoh_stream", None) is None:
        dispatcher.cuda_dtoh_stream = _NullStream()

    # The dispatcher's split sizes reach all_to_all_single as numpy arrays only when they come
    # from a GPU (``maybe_move_tensor_to_cpu(..., as_numpy=True)`` converts CUDA tensors only);
    # torch's all_to_all_single takes no CPU tensor as split sizes.
    move = token_dispatcher.maybe_move_tensor_to_cpu
    if not getattr(move, "_mcore_ext_cpu", False):

        @functools.wraps(move)
        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
                return tensor.numpy()
            return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

        maybe_move_tensor_to_cpu._mcore_ext_cpu = True
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    forward = moe_layer.MoELayer.forward
    if getattr(forward, "_mcore_ext_cpu", False):
        return

    @functools.wraps(forward)
    def forward_on_cpu(self, *args, **kwargs):
        # The dispatcher compares torch.cuda.current_stream() with its stream; the aux-loss
        # tracker of 0.16 / 0.17 allocates on device="cuda".
        with cuda_to_cpu():
            return forward(self, *args, **kwargs)

    forward_on_cpu._mcore_ext_cpu = True
    moe_layer.MoELayer.forward = forward_on_cpu


def _install_uneven_collectives():
    """Uneven all-gather / reduce-scatter over gloo (the all-to-all dispatcher at TP > 1).

    megatron's ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` take per-rank
    split sizes and call ``all_gather`` / ``reduce_scatter`` with tensors of unequal sizes, which
    NCCL accepts and gloo does not (``invalid tensor size``). On a CPU the uneven case pads to the
    largest size, gathers evenly and trims; it reduces by an all-reduce and keeps this rank's rows.
    """
    import functools

    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather = mappings._gather_along_first_dim
    if getattr(gather, "_mcore_ext_cpu", False):
        return
    reduce_scatter = mappings._reduce_scatter_along_first_dim

    @functools.wraps(gather)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.size(0)] = input_
        chunks = gather(padded, group).chunk(len(sizes))
        return torch.cat([chunk[:n] for chunk, n in zip(chunks, sizes)])

    @functools.wraps(reduce_scatter)
    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None,
                                        use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        dist.all_reduce(total, group=group)
        return total.split([int(n) for n in input_split_sizes])[group.rank()].clone()

    _gather_along_first_dim._mcore_ext_cpu = True
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


def _install_layer_wise_param_sync():
    """Muon's layer-wise distributed optimizer (0.19+) shares the parameters each DP rank
    updated by one ``all_gather`` of unequal sizes per group (``allgather_params``: NCCL takes
    them, gloo raises ``invalid tensor size``). On a CPU it sends them by megatron's own
    ``broadcast_params`` instead: every parameter from the rank that updated it, the same
    values. Releases without it: nothing to do."""
    try:
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    except ImportError:  # 0.16 - 0.18
        return
    LayerWiseDistributedOptimizer.allgather_params = LayerWiseDistributedOptimizer.broadcast_params


def _install_gloo_average():
    """``all_reduce(op=ReduceOp.AVG)`` on gloo (which has no AVG): a sum, then a division by the
    group size. Other backends and ops go to torch unchanged."""
    import functools

    import torch.distributed as dist

    all_reduce = dist.all_reduce
    if getattr(all_reduce, "_mcore_ext_cpu", False):
        return

    @functools.wraps(all_reduce)
    def all_reduce_with_gloo_average(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.AVG or async_op or dist.get_backend(group) != "gloo":
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(dist.get_world_size(group))
        return None

    all_reduce_with_gloo_average._mcore_ext_cpu = True
    dist.all_reduce = all_reduce_with_gloo_average


def _cpu_tracker_class(cuda_tracker_class):
    """Subclass megatron's tracker so its isinstance checks (RNG state in checkpoints) still hold."""

    class CpuRNGStatesTracker(_CpuRNGStreams, cuda_tracker_class):
        pass

    return CpuRNGStatesTracker


class _CpuRNGStreams:
    """Named RNG streams over the CPU generator, with megatron's tracker interface.

    megatron forks into the 'model-parallel-rng' stream around weight init and dropout inside
    tensor-parallel regions, so that each TP rank draws different values there while data-parallel
    replicas draw the same ones. On a CPU the forked stream replaces the CPU generator's state for
    the duration of the block, then the caller's state is restored.
    """

    def add(self, name: str, seed: int):
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


@contextlib.contextmanager
def cuda_to_cpu():
    """A context in which CUDA device arguments mean the CPU (a no-op context when CUDA exists)."""
    if torch.cuda.is_available() or _in_cuda_to_cpu():
        yield
        return
    current_stream = torch.cuda.current_stream
    torch.cuda.current_stream = lambda device=None: _NullStream()
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_stream = current_stream


_CPU = torch.device("cpu")


def _in_cuda_to_cpu() -> bool:
    """Whether a ``cuda_to_cpu()`` context is already active (nesting adds nothing but cost)."""
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(mode, _CudaToCpu) for mode in _get_current_function_mode_stack())


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.backward:
            # A mode is suspended while it handles a call, but backward may run forward code
            # again (activation recompute), which needs the mode: handle it inside a new one.
            with _CudaToCpu():
                return _backward(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # torch.FloatTensor -> torch.cuda.FloatTensor
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _backward(tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``Tensor.backward`` on the autograd engine directly, as megatron's schedules call it.

    Dispatching it (``torch.autograd.backward`` does) would hand it to a suspended mode again.
    """
    if gradient is None:
        if tensor.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        gradient = torch.ones_like(tensor)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    torch.autograd.Variable._execution_engine.run_backward(
        (tensor,),
        (gradient,),
        create_graph if retain_graph is None else retain_graph,
        create_graph,
        tuple(inputs or ()),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class _NullStream:
    """megatron's DDP waits on the current stream for CUDA-graph events a CPU run never has."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return self  # an "event" whose synchronize() returns at once

# ----------------------------------------------------------- megatron.training on a CPU
#
# megatron.training (Megatron-LM's training loop, in the megatron-core wheel) assumes CUDA
# beyond megatron-core: initialize_megatron asserts it, creates megatron's parallel groups and
# seeds the model-parallel RNG only when torch.cuda.device_count() > 0, validate_args reads the
# GPU's architecture when TP > 1 and wants CUDA_DEVICE_MAX_CONNECTIONS=1, DDP is built on a
# torch.cuda.Stream, and checkpoints and the rerun state machine save torch.cuda's RNG state.


@contextlib.contextmanager
def megatron_training_on_cpu():
    """A context in which megatron.training's ``parse_and_validate_args`` and ``pretrain`` run on
    a CPU-only machine (gloo). Everything inside runs under ``cuda_to_cpu()``; what it patches is
    restored on exit. A no-op context when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    import os

    from megatron.training import arguments, training

    install()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    initialize_megatron = training.initialize_megatron

    def initialize_megatron_on_cpu(*args, **kwargs):
        from megatron.training.global_vars import get_args

        get_args().distributed_backend = "gloo"
        # With one "device", initialize_megatron creates megatron's parallel groups and seeds
        # the model-parallel RNG (the CPU tracker of install()); set_device has nothing to set.
        with _patched(torch.cuda, device_count=lambda: 1, set_device=lambda device: None):
            return initialize_megatron(*args, **{**kwargs, "allow_no_cuda": True})

    patches = [
        _patched(training, initialize_megatron=initialize_megatron_on_cpu),
        # Only picks CUDA-connection rules; a pre-Blackwell answer keeps megatron's defaults.
        _patched(arguments, get_device_arch_version=lambda: 9),
        _patched(torch.cuda, Stream=lambda *args, **kwargs: _NullStream(),
                 stream=lambda stream=None: contextlib.nullcontext(),
                 get_rng_state=lambda device="cuda": torch.get_rng_state(),
                 set_rng_state=lambda state, device="cuda": torch.set_rng_state(state)),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(cuda_to_cpu())
        yield


@contextlib.contextmanager
def _patched(owner, **attributes):
    """Set attributes of ``owner`` for the duration of the block."""
    saved = {name: getattr(owner, name) for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)
