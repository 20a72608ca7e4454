"""``python -m tests.functional.megatron_lm_exact_log <pretrain_gpt flags>``: the Megatron-LM entry,
with rank 0 also printing each iteration's loss and pre-clipping grad norm at full precision
(megatron's own log line rounds the grad norm to 3 decimals, too coarse to compare layouts):

    exact iteration=3 lm_loss=5.5188159942626953 grad_norm=1.2601234912872314

It observes megatron.training's ``training_log`` (the values it is handed), changes nothing.
"""

import functools
import sys

import torch

from mcore_ext.megatron_lm import pretrain_gpt
from megatron.training import training

_training_log = training.training_log


@functools.wraps(_training_log)
def _exact_training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                        report_memory_flag, skipped_iter, grad_norm, *args, **kwargs):
    if torch.distributed.get_rank() == 0 and "lm loss" in loss_dict:
        loss = float(loss_dict["lm loss"])
        print(f"exact iteration={iteration} lm_loss={loss!r} grad_norm={float(grad_norm)!r}",
              flush=True)
    return _training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                         report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)


training.training_log = _exact_training_log

if __name__ == "__main__":
    sys.exit(pretrain_gpt.main())
