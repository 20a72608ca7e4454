"""Process-level set-up shared by the launcher, the tests and user scripts.

``init_parallel`` takes a process started by torchrun (or any process whose default process group
is already initialized) to a state where megatron-core models can be built: torch.distributed,
megatron's parallel groups, and seeded RNG streams. On a machine without CUDA it installs the CPU
adaptations from ``_cpu_compat`` and uses gloo.
"""

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from mcore_ext import _cpu_compat

# True when init_parallel created the default process group, so destroy_parallel owns it.
_owns_default_group = False
# The process groups megatron's initialize_model_parallel created (destroy_parallel frees them).
_model_parallel_groups: list = []
# Whether CPU tensors travel in gloo groups made beside megatron's (see cpu_group), and those
# groups by their ranks.
_separate_cpu_groups: bool | None = None
_cpu_groups: dict = {}


def device() -> torch.device:
    """The device this process computes on: its local GPU, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    seed: int = 1234,
    timeout_minutes: int = 10,
    separate_cpu_groups: bool | None = None,
    **model_parallel_kwargs,
) -> None:
    """Initialize torch.distributed, megatron's parallel state and the RNG.

    Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the environment (torchrun
    sets them) unless a default process group already exists. Uses NCCL when CUDA is available,
    gloo otherwise. ``expert_model_parallel_size`` (EP) splits MoE experts over ranks,
    ``expert_tensor_parallel_size`` splits each expert (None = tensor_model_parallel_size); the
    expert layers' ranks are laid out as megatron does (ETP x EP x expert-DP x PP = world).
    ``separate_cpu_groups``: whether collectives on CPU tensors (``cpu_group``) use gloo groups
    made beside megatron's; None: when the default backend is not gloo (NCCL cannot carry CPU
    tensors). True on a CPU machine runs a GPU machine's path. Extra keyword arguments go to
    ``megatron.core.parallel_state.initialize_model_parallel``.
    """
    global _owns_default_group, _separate_cpu_groups
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        _cpu_compat.install()

    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(
            backend="nccl" if on_gpu else "gloo", timeout=timeout, **_restart_store(timeout)
        )
        _owns_default_group = True

    world_size = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) x pipeline_model_parallel_size "
            f"({pipeline_model_parallel_size}) x context_parallel_size ({context_parallel_size})"
        )

    etp = expert_tensor_parallel_size or tensor_model_parallel_size
    expert_parallel = etp * expert_model_parallel_size * pipeline_model_parallel_size
    if expert_model_parallel_size < 1 or etp < 1 or world_size % expert_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size ({etp}) x "
            f"expert_model_parallel_size ({expert_model_parallel_size}) x "
            f"pipeline_model_parallel_size ({pipeline_model_parallel_size})"
        )

    existing = set(_process_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        **model_parallel_kwargs,
    )
    _model_parallel_groups[:] = [g for g in _process_groups() if g not in existing]
    _separate_cpu_groups = (dist.get_backend() != "gloo" if separate_cpu_groups is None
                            else separate_cpu_groups)
    set_seed(seed)


def cpu_group(group=None):
    """A process group over ``group``'s ranks (None: every rank) that carries CPU tensors.

    ``group`` itself where megatron's groups are gloo; otherwise (NCCL on a GPU machine, or
    ``init_parallel(separate_cpu_groups=True)``) a gloo group beside it, made on first use and
    freed by ``destroy_parallel``. Collective the first time: every rank calls it with its own
    group of the same kind (e.g. each its tensor-parallel group), in the same order.
    """
    separate = _separate_cpu_groups
    if separate is None:  # megatron's state was set up without init_parallel
        separate = dist.get_backend() != "gloo"
    if not separate:
        return group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None
                  else range(dist.get_world_size()))
    if ranks not in _cpu_groups:
        # new_group is collective over every rank: each makes every group of this kind, in the
        # same order, and keeps its own.
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, ranks)
        for members in sorted(set(every)):
            made = dist.new_group(list(members), backend="gloo")
            if members == ranks:
                _cpu_groups[ranks] = made
    return _cpu_groups[ranks]


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch, and reset megatron's tensor-parallel RNG streams.

    Pipeline stages get different default streams (as in Megatron-LM) so that layers on different
    stages are not initialized identically.
    """
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron's parallel state (and the default group if init_parallel created it).

    Afterwards the process may call ``init_parallel`` again, with other parallel sizes.
    """
    global _owns_default_group, _separate_cpu_groups
    parallel_state.destroy_model_parallel()
    for group in _cpu_groups.values():
        dist.destroy_process_group(group)
    _cpu_groups.clear()
    _separate_cpu_groups = None
    # megatron only drops its references: each of its ~20 groups keeps gloo threads (3 each) and
    # sockets alive, which a process that initializes repeatedly would accumulate.
    for group in _model_parallel_groups:
        if group in _process_groups():  # megatron tears a few down itself
            dist.destroy_process_group(group)
    _model_parallel_groups.clear()
    _drop_references_to_destroyed_groups()
    if _owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
        _owns_default_group = False


def _drop_references_to_destroyed_groups() -> None:
    """A destroyed gloo group keeps its three threads (one polling, even while idle) for as long
    as anything references it. megatron's ``destroy_model_parallel`` leaves some globals set (0.19:
    the intra-partial data-parallel groups with CP), and its ``RotaryEmbedding.forward`` caches
    (``lru_cache``) hold every rotary module called, with its CP group, and so the whole model."""
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rotary
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    for rotary in (rotary.RotaryEmbedding, yarn.YarnRotaryEmbedding):
        cache_clear = getattr(rotary.forward, "cache_clear", None)
        if cache_clear is not None:  # releases without the cache
            cache_clear()


def raise_unless_all_ok(failure: Exception | None, what: str, error=RuntimeError) -> None:
    """Collective: if ``what`` failed on any rank, raise ``error`` on every rank with the same
    message, "<what> on rank R (<its error>), ...", instead of leaving the other ranks waiting."""
    ok = torch.tensor([0 if failure else 1], dtype=torch.int32, device=device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item():
        return
    reports = [None] * dist.get_world_size()
    mine = f"{type(failure).__name__}: {failure}" if failure is not None else None
    dist.all_gather_object(reports, mine)
    failed = ", ".join(f"rank {r} ({m})" for r, m in enumerate(reports) if m is not None)
    combined = error(f"{what} on {failed}")
    combined.on_every_rank = True  # one rank reporting it is enough (mcore_ext.cli)
    raise combined from failure


def _restart_store(timeout) -> dict:
    """init_process_group arguments for a worker that torchrun restarted: its store, keyed apart.

    torchrun's agent keeps one store for all attempts (static rendezvous: --master_addr/port),
    and process groups publish their peers' addresses under names that repeat in every attempt:
    a restarted worker would read the dead attempt's addresses and fail to connect, or hang.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not attempt or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=False, timeout=timeout,
    )
    return {
        "store": dist.PrefixStore(f"mcore_ext/attempt_{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": world_size,
    }


def _process_groups() -> list:
    """Every process group this rank belongs to (torch keeps no public list of them)."""
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
