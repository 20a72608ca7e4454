"""Distributed-checkpoint sharding of the fused ``[QKV ; Gate]`` linear_qkv.

Each TP rank holds ``[QKV_r ; Gate_r]``, so the concatenation of local blocks is
``[QKV_0 ; Gate_0 ; QKV_1 ; Gate_1 ; ...]``, not the global ``[QKV ; Gate]``. Sharding it as one
tensor along axis 0 (``{'weight': 0}``) would re-split that concatenation evenly when loading at
another TP size and silently turn K/V rows into gate rows. Instead the QKV block and the gate
block are saved as two tensors, each sharded along axis 0 on its own, under the keys upstream
Megatron-LM (dev) uses, so checkpoints are interchangeable with it:

    <key>._qkv   global [..., (num_heads + 2 * num_query_groups) * head_dim, ...]
    <key>._gate  global [..., num_heads, ...]

Loading concatenates the local blocks back. Optimizer states of these parameters go through the
same factory (megatron's optimizers replace the factory's data with each state tensor).
"""

from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

QKV_SUFFIX = "._qkv"
GATE_SUFFIX = "._gate"


def qkv_gate_factory(
    original: ShardedTensor, qkv_rows_per_rank: int, sharded_offsets: tuple = ()
) -> "QkvGateFactory":
    """Wrap the ShardedTensor of a linear_qkv weight or bias so it saves as QKV + gate blocks.

    Args:
        original: what megatron's linear layer produced: axis 0 (after the prepended layer axes)
            sharded over TP.
        qkv_rows_per_rank: rows of the local tensor that are QKV; the rest are gate rows.
        sharded_offsets: the prepended (layer) offsets the module received.
    """
    if not isinstance(original, ShardedTensor):
        raise NotImplementedError(
            f"head_wise_attn_gate checkpointing expects a ShardedTensor for {original.key}, "
            f"got {type(original).__name__} (FSDP / DTensor parameters are not supported)"
        )
    row_axis = len(sharded_offsets)  # local axis 0 in global coordinates
    layout = _RowLayout(
        sharded_offsets=tuple(sharded_offsets),
        tp_rank=original.global_offset[row_axis] // original.local_shape[0],
        tp_size=original.axis_fragmentations[row_axis],
        qkv_rows=qkv_rows_per_rank,
    )
    return QkvGateFactory(
        original.key, original.data, layout.build, layout.merge, original.replica_id, layout=layout
    )


@dataclass(frozen=True)
class _RowLayout:
    """Where this rank's [QKV_r ; Gate_r] rows sit in the global QKV and gate blocks."""

    sharded_offsets: tuple
    tp_rank: int
    tp_size: int
    qkv_rows: int

    def _sharded(self, key, block, replica_id):
        row_axis = len(self.sharded_offsets)
        return ShardedTensor.from_rank_offsets(
            key,
            block,
            *self.sharded_offsets,
            (row_axis, self.tp_rank, self.tp_size),
            replica_id=replica_id,
            prepend_axis_num=row_axis,
        )

    @torch.no_grad()
    def build(self, key, data, replica_id, flattened_range):
        if flattened_range is not None:
            raise NotImplementedError(
                f"{key}: flattened optimizer state is not supported by megatron-core's "
                "checkpoints; use distrib_optim_sharding_type='fully_reshardable'"
            )
        return {
            QKV_SUFFIX: self._sharded(key + QKV_SUFFIX, data[: self.qkv_rows], replica_id),
            GATE_SUFFIX: self._sharded(key + GATE_SUFFIX, data[self.qkv_rows :], replica_id),
        }

    @staticmethod
    def merge(loaded):
        return torch.cat([loaded[QKV_SUFFIX], loaded[GATE_SUFFIX]])


@dataclass
class QkvGateFactory(ShardedTensorFactory):
    """The factory for a gated linear_qkv tensor; knows its row layout."""

    layout: _RowLayout = None

    def from_ungated_checkpoint(self) -> ShardedTensorFactory:
        """Load QKV rows from an ungated checkpoint's ``<key>`` and keep the current gate rows.

        For starting a gated model from an ungated checkpoint: the gates keep their init.
        """
        layout, gate_rows = self.layout, self.data[self.layout.qkv_rows :]

        def build(key, data, replica_id, flattened_range):
            return {"": layout._sharded(key, data[: layout.qkv_rows], replica_id)}

        def merge(loaded):
            return torch.cat([loaded[""], gate_rows.detach().clone()])

        return ShardedTensorFactory(self.key, self.data, build, merge, self.replica_id)
