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
    **model_parallel_kwargs,
) -> None:
    """Initialize torch.distributed, megatron's parallel state and the RNG.

    Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the environment (torchrun
    sets them) unless a default process group already exists. Uses NCCL when CUDA is available,
    gloo otherwise. ``expert_model_parallel_size`` (EP) splits MoE experts over ranks,
    ``expert_tensor_parallel_size`` splits each expert (None = tensor_model_parallel_size); the
    expert layers' ranks are laid out as megatron does (ETP x EP x expert-DP x PP = world). Extra
    keyword arguments go to ``megatron.core.parallel_state.initialize_model_parallel``.
    """
    global _owns_default_group
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
    set_seed(seed)


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
    global _owns_default_group
    parallel_state.destroy_model_parallel()
    # megatron only drops its references: each of its ~20 groups keeps gloo threads (3 each) and
    # sockets alive, which a process that initializes repeatedly would accumulate.
    for group in _model_parallel_groups:
        if group in _process_groups():  # megatron tears a few down itself
            dist.destroy_process_group(group)
    _model_parallel_groups.clear()
    if _owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
        _owns_default_group = False


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
