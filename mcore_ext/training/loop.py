"""Build model, optimizer and scheduler from megatron-core's parts, then train, evaluate, save.

Shapes (megatron notation): b micro batch, s sequence, h hidden, v padded vocab.
"""

import contextlib
import json
import math
import os
import resource
import time
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model

from mcore_ext import _mcore_compat, lora
from mcore_ext._cpu_compat import cuda_to_cpu
from mcore_ext.cli import gpt_deprecation_notice
from mcore_ext.attention.probe import AttentionProbe, attention_layers, layer_order
from mcore_ext.moe import is_moe_layer
from mcore_ext.config import GatedTransformerConfig
from mcore_ext.runtime import destroy_parallel, device, init_parallel
from mcore_ext.models import build_gpt_model, build_hybrid_model
from mcore_ext.training import checkpointing, faults
from mcore_ext.training.data import (
    batch_iterator,
    build_datasets,
    cp_shard,
    first_micro_batch,
    packed_seq_params,
    prepare_tokenizer_and_data,
)
from mcore_ext.training.config.validation import lora_config
from mcore_ext.run_config.megatron_configs import (
    compute_dtype,
    ddp_config,
    optimizer_config,
    transformer_config,
)

# Dense bf16 / fp16 peak TFLOP/s per device, for MFU (logging.peak_tflops overrides); the first
# key in the device's name wins (SXM parts are named without a suffix).
_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H200": 989.0,
                "H100": 989.0, "A100": 312.0}


def pretrain(cfg, config_file: str | None = None, signals=None) -> bool:
    """Run the training job described by a validated ``PretrainConfig`` on this torchrun rank.

    Returns False when it stopped early for a signal or training.exit_duration_mins (saved, or
    before its first step with nothing to save; to be started again:
    ``faults.SAVED_NOT_FINISHED``), else True (finished, or stopped where training.exit_interval
    asked).

    ``config_file``: the YAML file the config was read from, never written over (the resolved
    config goes beside it under another name when it would land on it). ``signals``: the
    ``faults.ExitSignalHandler`` the caller entered (``main``: from its first line); without it
    one is entered here when checkpoint.exit_on_signal is set.
    Raises ``faults.CheckpointSaveError`` on every rank when checkpoint.save cannot be written.
    """
    p = cfg.parallelism
    own_signals = None
    if signals is None and cfg.checkpoint.exit_on_signal:
        signals = own_signals = faults.ExitSignalHandler()
    faults.fault_point("rendezvous")
    with own_signals or contextlib.nullcontext():
        init_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
            seed=cfg.training.seed,
        )
        started = time.monotonic()  # training.exit_duration_mins counts from here
        stop = faults.StopRequest(signals, cfg.training.exit_duration_mins, started)
        try:
            return _pretrain(cfg, config_file, stop)
        finally:
            destroy_parallel()


def _pretrain(cfg, config_file, stop) -> bool:
    save = cfg.checkpoint.save
    made_save_dir = bool(save) and not os.path.exists(save)
    dist.barrier()  # every rank looked before any rank makes it
    resolved = None  # the resolved config.yaml rank 0 wrote

    def remove_what_this_start_made():  # a run refused or stopped before its first save
        if made_save_dir and dist.get_rank() == 0:
            with contextlib.suppress(OSError):
                if resolved and os.listdir(save) == [os.path.basename(resolved)]:
                    os.remove(resolved)  # the run's own resolved config, alone there
                os.rmdir(save)  # only if empty: nothing a save wrote

    try:
        with cuda_to_cpu():  # CPU only: megatron's training path allocates on "cuda" literally
            faults.stop_before_training(stop)  # signalled while importing, validating, meeting
            if save:  # before hours of training, not at the first save
                faults.check_writable(save)
                checkpointing.recover_save_dir(save)  # what a killed save left
                faults.install_checkpoint_writer_queue(cfg.checkpoint.async_save)
            if dist.get_rank() == 0:
                resolved = _announce_config(cfg, config_file)
                _announce_deprecated_model(cfg)
            return _Trainer(cfg, stop).run()
    except faults.StoppedBeforeTraining as reason:  # every rank: nothing trained, nothing to save
        remove_what_this_start_made()
        if dist.get_rank() == 0:
            print(f"[train] stopping before the first step ({reason}): nothing was trained, "
                  f"nothing to save; the next start begins where this one did", flush=True)
        return False
    except BaseException:
        remove_what_this_start_made()
        raise


def padded_vocab_size(vocab_size: int, cfg) -> int:
    """Round up to make_vocab_size_divisible_by (and TP): the same at every TP size dividing it."""
    from mcore_ext.models import padded_vocab_size as padded

    return padded(vocab_size, cfg.model.make_vocab_size_divisible_by,
                  cfg.parallelism.tensor_model_parallel_size)


def build_model(cfg, vocab_size: int) -> DistributedDataParallel:
    """This pipeline stage's GPTModel (or HybridModel: ``model.architecture``), in the compute
    dtype, wrapped in megatron's DDP."""
    config = transformer_config(cfg)
    build = build_hybrid_model if cfg.model.architecture == "hybrid" else build_gpt_model
    gpt = build(
        config,
        vocab_size=vocab_size,
        max_sequence_length=cfg.model.seq_length,
        backend=cfg.model.attention_backend,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        **({"vision": cfg.model.vision} if cfg.model.vision is not None else {}),
    )
    gpt.to(device())
    # Before DDP and the optimizer: frozen base weights get no gradient buffer, optimizer state
    # or fp32 main copy. The base weights load into the same modules afterwards (finetune).
    lora.apply_lora(gpt, lora_config(cfg))
    if compute_dtype(cfg) is not torch.float32:
        gpt = Float16Module(config, gpt)  # casts params to bf16 / fp16, and logits back to fp32
    model = DistributedDataParallel(config, ddp_config(cfg), gpt)
    # The schedules reduce gradients through these hooks after the last micro-batch.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return model


def flops_per_iteration(
    config: GatedTransformerConfig, vocab_size: int, seq_length: int, global_batch_size: int
) -> float:
    """Model FLOPs of one optimizer step (forward + backward = 3 x forward; recompute not counted).

    Counts every GEMM of the model ``config`` describes, including the gate rows of linear_qkv
    (``config.linear_qkv_rows``: the head-wise gate adds num_attention_heads output rows to the
    QKV GEMM), per layer kind (heads, window). Causal attention counts half the scores, a window
    the scores inside it. A MoE layer counts its router, the top-k routed experts each token
    runs through and the shared expert (the FLOPs done, not the parameters held). MTP depths
    count their layer (its kind), eh_proj and logits.
    """
    h, hn, s, ffn = config.hidden_size, config.kv_channels, seq_length, config.ffn_hidden_size
    depths = config.mtp_num_layers or 0
    # output layer, and per MTP depth: eh_proj [h, 2h] and the depth's logits
    macs_per_token = h * vocab_size + depths * (2 * h * h + h * vocab_size)
    for number in range(1, config.num_layers + depths + 1):  # MTP layers follow the main ones
        layer = config.get_config_for_layer(number)  # its kind's heads, groups and window
        heads = layer.num_attention_heads
        keys = s / 2  # keys a query sees on average: half of the s x s scores (causal)
        if layer.window_size is not None:
            keys = sum(min(i + 1, layer.window_size[0] + 1) for i in range(s)) / s
        macs_per_token += (
            h * layer.linear_qkv_rows  # linear_qkv (Q, K, V and gates)
            + 2 * heads * hn * keys  # Q K^T and P V
            + heads * hn * h  # linear_proj
        )
        if is_moe_layer(config, number):
            moe_ffn = config.moe_ffn_hidden_size * config.moe_router_topk + (
                config.moe_shared_expert_intermediate_size or 0)
            macs_per_token += h * config.num_moe_experts + _mlp_macs(config, h, moe_ffn)
        else:
            macs_per_token += _mlp_macs(config, h, ffn)
    return 3 * 2 * macs_per_token * global_batch_size * s


def _mlp_macs(config, h: int, ffn: int) -> int:
    """MACs per token of an MLP of width ``ffn``: linear_fc1 (gate and up with SwiGLU), linear_fc2."""
    return h * ffn * (2 if config.gated_linear_unit else 1) + ffn * h


# The name megatron's router records each load-balancing loss under, per balancing type.
_BALANCING_LOSS_NAMES = {"aux_loss": "load_balancing_loss",
                         "seq_aux_loss": "seq_load_balancing_loss",
                         "global_aux_loss": "global_load_balancing_loss"}


def _forward_step(data_iterator, model):
    """One micro-batch: [b, s] tokens -> [b, s] per-token losses, and how to reduce them.

    A packed micro-batch (chat data) is one THD sequence [1, t] with its documents' boundaries;
    its loss is summed over the loss tokens and normalised by those of the whole global batch.
    Its images, if any, go to the vision-language model as transformers' keywords
    (``pixel_values``, ``pixel_values_local``, ``num_local_patches``: docs/design.md), whole on
    every CP rank, on the first pipeline stage only (the tower's).
    """
    batch = cp_shard(next(data_iterator))  # this CP rank's 2 chunks of every sequence
    dev = device()
    tokens = batch["tokens"].to(dev, non_blocking=True)  # [b, s]
    labels = batch["labels"].to(dev, non_blocking=True)  # [b, s]
    loss_mask = batch["loss_mask"].to(dev, non_blocking=True).float()  # [b, s]
    position_ids = batch["position_ids"].to(dev, non_blocking=True)  # [b, s]
    packed = packed_seq_params(batch, dev)
    if packed is not None:
        losses = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask,
                       packed_seq_params=packed, **_images(batch, dev))  # [1, t]
        return losses, partial(_masked_sum, loss_mask)
    # attention_mask=None: the causal mask is applied inside core attention.
    losses = model(tokens, position_ids, None, labels=labels)  # [b, s]
    return losses, partial(_masked_mean, loss_mask)


def _images(batch: dict, dev) -> dict:
    """The micro-batch's image keywords for the model on the first pipeline stage (pixels on
    the device; ``num_local_patches`` stays on the host, where the model reads it); {} without
    images or on a later stage."""
    if "pixel_values" not in batch or not parallel_state.is_pipeline_first_stage():
        return {}
    images = {key: batch[key].to(dev, non_blocking=True)
              for key in ("pixel_values", "pixel_values_local") if key in batch}
    images["num_local_patches"] = batch["num_local_patches"]
    return images


def schedule_shape(seq_length: int, micro_batch_size: int, packed: bool) -> dict:
    """The lengths megatron's schedule sizes what it sends between pipeline stages by: a
    [seq_length / CP (/ TP with sequence parallelism), micro_batch_size, h] tensor
    (``get_tensor_shapes``). A packed micro-batch is one THD sequence of its b rows side by side,
    [b x s / CP, 1, h]: every one is exactly b x s slots long (a chat row is s slots, padding
    included; text with document masking keeps its samples' s tokens at CP 1, the only CP it
    runs at under PP), so the shape is fixed and megatron's ``variable_seq_lengths`` (a shape
    exchange before every send) is not needed."""
    if packed:
        seq_length, micro_batch_size = seq_length * micro_batch_size, 1
    return dict(seq_length=seq_length, micro_batch_size=micro_batch_size,
                decoder_seq_length=seq_length)


def _masked_mean(loss_mask, losses):
    """This rank's share of the mean loss over the sequence's tokens on all CP ranks.

    The schedule multiplies it by the CP size and DDP averages gradients over DP x CP, so the
    gradient is the full sequence's mean-loss gradient.
    """
    total = (losses.float() * loss_mask).sum()
    sums = torch.stack([total.detach(), loss_mask.sum()])
    cp_group = parallel_state.get_context_parallel_group()
    if cp_group.size() > 1:
        dist.all_reduce(sums, group=cp_group)
    loss = total / sums[1].clamp(min=1)
    return loss, {"lm loss": sums[0] / sums[1].clamp(min=1)}  # the schedule scales loss in place


def _masked_sum(loss_mask, losses):
    """megatron's per-token loss: (loss sum, loss tokens, {"lm loss": [sum, tokens]}). With
    ``calculate_per_token_loss`` the schedule adds up the tokens of every micro-batch and
    ``finalize_model_grads`` divides the gradients by those of the whole global batch."""
    total = (losses.float() * loss_mask).sum()
    count = loss_mask.sum()
    return total, count.int(), {"lm loss": torch.stack([total.detach(), count])}


def _mean_mtp_losses(depths, num_microbatches: int):
    """Per MTP depth, this step's loss, on every rank; None without MTP. megatron tracks each
    micro-batch's loss over its own rolled loss tokens on the last pipeline stage while training
    (``MTPLossLoggingHelper``); logged as megatron-LM logs it: the mean over the micro-batches
    (not weighted by their tokens) and the data-parallel (and CP) ranks. The main loss does not
    include them."""
    if not depths:
        return None
    local = _mcore_compat.take_mtp_losses(depths)
    contributes = local is not None and parallel_state.get_tensor_model_parallel_rank() == 0
    total = torch.zeros(depths + 1, dtype=torch.float64)
    if contributes:
        total[:depths] = local.double().cpu() / num_microbatches
        total[depths] = 1.0
    total = total.to(device())
    dist.all_reduce(total)
    return (total[:depths] / total[depths]).tolist()


class _Trainer:
    def __init__(self, cfg, stop_request=None):
        self.cfg = cfg
        self.stop_request = stop_request  # faults.StopRequest: signals, exit_duration_mins
        self.rank0 = dist.get_rank() == 0
        _mcore_compat.reset_mtp_losses()  # nothing of an earlier run in this process

        tokenizer = prepare_tokenizer_and_data(cfg)
        faults.stop_before_training(stop_request)  # signalled while the data was prepared
        self.vocab_size = padded_vocab_size(tokenizer.vocab_size, cfg)
        self.model = build_model(cfg, self.vocab_size)
        self.optimizer = get_megatron_optimizer(optimizer_config(cfg), [self.model])
        # Scales the loss before backward (fp16 loss scaling; a no-op factor otherwise).
        self.model.config.grad_scale_func = self.optimizer.scale_loss
        o = cfg.optimizer
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_iters,
            lr_decay_steps=o.lr_decay_iters,
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=cfg.training.train_iters,
            wd_incr_style="constant",
        )
        # The run's own checkpoint in checkpoint.save, else checkpoint.load, else from scratch;
        # the line that says which is printed last before training.
        own = checkpointing.start_point(cfg).own
        faults.fault_point("load")
        self.iteration, consumed, self.start_line = checkpointing.load_checkpoint(
            cfg, self.model, self.optimizer, self.scheduler, vocab_size=tokenizer.vocab_size
        )
        if cfg.lora.init_from and not own:  # a new run's adapters start from a PEFT adapter
            from mcore_ext.hf.adapter import load_adapter

            left_new = load_adapter(unwrap_model(self.model), cfg.lora.init_from,
                                    lora_config(cfg))
            self.start_line += f"; LoRA adapters from {cfg.lora.init_from}"
            if left_new:  # a peft-made folder has no MTP layers' file (mcore_ext.hf.adapter)
                self.start_line += (f" (the MTP layers' {left_new} start new: no "
                                    "mtp_adapter_model.safetensors there)")
        self.train_data, self.valid_data = build_datasets(cfg, tokenizer)
        self.train_iterator = batch_iterator(self.train_data, cfg, start_sample=consumed)
        if self.iteration < cfg.training.train_iters:
            # Signalled while the model was built and loaded: every rank stops before its first
            # step (pretrain says so), where the checkpoint it loaded is still the latest.
            faults.stop_before_training(stop_request)

        self.forward_backward = get_forward_backward_func()
        self.balancing_losses = []  # per step since the last log line
        self.flops = flops_per_iteration(
            self.model.config, self.vocab_size, cfg.model.seq_length, cfg.training.global_batch_size
        )
        self.async_queue = None
        if cfg.checkpoint.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.async_queue = AsyncCallsQueue()
        self.metrics = None
        if self.rank0 and cfg.logging.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.logging.metrics_file)), exist_ok=True)
            self.metrics = open(cfg.logging.metrics_file, "a", buffering=1)
        self.tensorboard = self._tensorboard()
        self.gate_statistics = _attach_gate_statistics(self.model) \
            if cfg.logging.gate_statistics else None
        self.attention_probe = AttentionProbe(self.model) if cfg.logging.attention_probe else None
        self.probe_batch = None  # the validation split's first micro-batch, read at first use
        params = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        adapters = lora_config(cfg)
        trainable = (f" ({trainable / 1e6:.3f}M LoRA adapter parameters trained, r "
                     f"{adapters.rank}: {' '.join(adapters.targets)})" if adapters.enabled else "")
        tp = cfg.parallelism.tensor_model_parallel_size
        pp = cfg.parallelism.pipeline_model_parallel_size
        cp = cfg.parallelism.context_parallel_size
        cp = f"CP {cp} x " if cp > 1 else ""
        ep = cfg.parallelism.expert_model_parallel_size
        ep = f" (experts: EP {ep})" if ep > 1 else ""
        dp, t = cfg.data_parallel_size, cfg.training
        self._print(
            f"[setup] world {cfg.world_size} = TP {tp} x {cp}PP {pp} x DP {dp}{ep}; global batch "
            f"{t.global_batch_size} = micro {t.micro_batch_size} x DP {dp} x "
            f"{cfg.num_microbatches} micro-batches; vocab {tokenizer.vocab_size} (padded "
            f"{self.vocab_size}); {params / 1e6:.2f}M parameters on rank 0{trainable}; {t.precision} on "
            f"{device().type}"
        )

    # ------------------------------------------------------------------------------ loop

    def run(self):
        t, c, log_interval = self.cfg.training, self.cfg.checkpoint, self.cfg.logging.log_interval
        first = self.iteration + 1
        self._print(self.start_line)
        if self.iteration >= t.train_iters:
            self._print(run_complete(self.iteration, t.train_iters))
            return True
        self._print(f"[train] iterations {first} .. {t.train_iters}")
        probe_interval = self.cfg.logging.attention_probe
        if self.attention_probe is not None:  # the weights the run starts from
            self._print(f"[probe] iteration {self.iteration} | {_probe_field(self._probe())}")
        window = _Window()
        self.eta = _Eta(first)
        requested = None  # why every rank stops early (faults.StopRequest), if one asked
        while self.iteration < t.train_iters:
            loss, grad_norm, ok = self._train_step()
            self.iteration += 1
            it, last = self.iteration, self.iteration == t.train_iters
            window.add(loss, _mean_mtp_losses(self.cfg.model.mtp_num_layers,
                                              self.cfg.num_microbatches))
            probed = None
            if self.attention_probe is not None and _every(probe_interval, it):
                with window.paused():  # not step time: the record says what it took
                    probed = self._probe()
            if it == first or last or _every(log_interval, it):
                self._log(window, grad_norm, ok, probed)
                window = _Window()
            elif probed is not None:
                self._print(f"[probe] iteration {it} | {_probe_field(probed)}")
            requested = self.stop_request.agreed() if self.stop_request else None
            stop = requested is not None or _every(t.exit_interval, it)
            with window.paused():  # evaluation and saving are not step time
                # Not when preempted: the save must fit in the scheduler's grace period.
                evaluate = requested is None and (last or _every(t.eval_interval, it))
                if t.eval_interval and evaluate:
                    self._evaluate()
                if c.save and (last or stop or _every(c.save_interval, it)):
                    self._save()
                if self.async_queue is not None:
                    self.async_queue.maybe_finalize_async_calls(blocking=False)
            if stop:
                self._print(f"[train] stopping at iteration {it} "
                            f"({requested or 'training.exit_interval'})")
                break
        if self.async_queue is not None:
            self.async_queue.close()  # waits for the last checkpoint and writes its tracker
        for sink in (self.metrics, self.tensorboard):
            if sink is not None:
                sink.close()
        # Finished where training.exit_interval asked, a signal at the same boundary or not.
        return requested is None or self.iteration >= t.train_iters or _every(
            t.exit_interval, self.iteration)

    def _train_step(self):
        cfg = self.cfg
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run_schedule(self.train_iterator, forward_only=False)
        self.balancing_losses.append(self._moe_balancing_losses())
        faults.fault_point("step", self.iteration + 1)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:  # fp16 skips the step (and the schedule) when gradients overflow
            self.scheduler.step(increment=1)
        return self._mean_loss(losses), grad_norm, ok

    def _run_schedule(self, iterator, forward_only: bool):
        """One global batch through megatron's schedule (micro-batches, pipeline stages)."""
        cfg = self.cfg
        packed = cfg.data.source == "chat" or cfg.data.document_masking
        return self.forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iterator,
            model=[self.model],
            num_microbatches=cfg.num_microbatches,
            forward_only=forward_only,
            **schedule_shape(cfg.model.seq_length, cfg.training.micro_batch_size, packed),
        )

    def _moe_balancing_losses(self) -> dict:
        """This step's MoE load-balancing losses (unscaled by their coefficient), each the mean
        over MoE layers and micro-batches, averaged over data-parallel ranks: {name: value}
        (megatron's reduction, on every rank)."""
        config = self.model.config
        types = config.moe_router_load_balancing_type if config.num_moe_experts else []
        types = types if isinstance(types, list) else [types]
        names = [_BALANCING_LOSS_NAMES[t] for t in types if t in _BALANCING_LOSS_NAMES]
        if not names:
            return {}
        layers = config.num_layers + (config.mtp_num_layers or 0)
        pattern = [int(is_moe_layer(config, n)) for n in range(1, layers + 1)]
        return _mcore_compat.reduce_moe_metrics(names, pattern, 1 / self.cfg.num_microbatches)

    def _evaluate(self):
        """Mean loss over the first eval_iters global batches of the validation split."""
        cfg = self.cfg
        self.model.eval()
        iterator = batch_iterator(self.valid_data, cfg, start_sample=0)
        total = 0.0
        with torch.no_grad():
            for _ in range(cfg.training.eval_iters):
                total += self._mean_loss(self._run_schedule(iterator, forward_only=True))
                faults.fault_point("eval", self.iteration)
        self.model.train()
        loss = total / cfg.training.eval_iters
        self._print(
            f"[valid] iteration {self.iteration} | loss {loss:.4f} | "
            f"ppl {math.exp(min(loss, 50)):.2f}"
        )
        self._record({"kind": "valid", "iteration": self.iteration, "loss": loss})

    def _probe(self) -> dict:
        """The attention probe (``logging.attention_probe``, mcore_ext.attention.probe) on the
        validation split's first micro-batch: one forward pass through megatron's schedule with
        the probe's hooks, in eval mode as evaluation runs; every rank's figures combined into one
        "probe" record (metrics file, TensorBoard), returned. Collective over every rank."""
        cfg = self.cfg
        started = time.perf_counter()
        if self.probe_batch is None:
            self.probe_batch = first_micro_batch(self.valid_data, cfg)
        packed = cfg.data.source == "chat" or cfg.data.document_masking
        self.model.eval()
        with torch.no_grad(), self.attention_probe.recording():
            self.forward_backward(
                forward_step_func=_forward_step,
                data_iterator=iter([self.probe_batch]),
                model=[self.model],
                num_microbatches=1,
                forward_only=True,
                **schedule_shape(cfg.model.seq_length, cfg.training.micro_batch_size, packed),
            )
        self.model.train()
        figures = self.attention_probe.gather()
        record = {"kind": "probe", "iteration": self.iteration, **figures,
                  "time_s": time.perf_counter() - started}
        self._record(record)
        return record

    def _mean_loss(self, losses) -> float:
        """Mean loss over the global batch, on every rank: the mean of the micro-batch means, or
        with per-token losses ([sum, tokens] per micro-batch) the global sum over the tokens.

        Only the last pipeline stage has losses, identical across its TP ranks: the first TP
        rank of each data-parallel replica there contributes.
        """
        contributes = parallel_state.is_pipeline_last_stage() and (
            parallel_state.get_tensor_model_parallel_rank() == 0
        )
        total = torch.zeros(2, dtype=torch.float64)
        if contributes:
            values = torch.stack([x["lm loss"] for x in losses]).cpu()
            total = (values.double().sum(0) if values.dim() == 2
                     else torch.tensor([float(values.mean()), 1.0], dtype=torch.float64))
        total = total.to(device())
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def _save(self):
        t0 = time.perf_counter()
        consumed = self.iteration * self.cfg.training.global_batch_size
        checkpointing.save_checkpoint(
            self.cfg, self.iteration, self.model, self.optimizer, self.scheduler, consumed,
            async_queue=self.async_queue,
        )
        what = "scheduled" if self.async_queue else "saved"
        self._print(
            f"[checkpoint] {what} iteration {self.iteration} to "
            f"{checkpointing.iteration_dir(self.cfg.checkpoint.save, self.iteration)} "
            f"({time.perf_counter() - t0:.1f}s)"
        )

    # --------------------------------------------------------------------------- logging

    def _log(self, window, grad_norm, ok, probed=None):
        cfg, t = self.cfg, self.cfg.training
        elapsed = window.elapsed()
        steps = window.steps
        tokens_per_s = steps * t.global_batch_size * cfg.model.seq_length / elapsed
        tflops = steps * self.flops / elapsed / cfg.world_size / 1e12  # per device
        record = {
            "kind": "train",
            "iteration": self.iteration,
            "loss": window.mean(),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "step_time_s": elapsed / steps,
            "peak_memory_gb": _peak_memory_gb(),
        }
        peak = cfg.logging.peak_tflops or _peak_tflops(t.precision)
        if peak:
            record["mfu"] = tflops / peak
        if not ok:
            record["skipped"] = True
        mtp = window.mean_mtp()
        if mtp is not None:
            record["mtp_losses"] = mtp
        if self.gate_statistics is not None:
            record.update(_gate_statistics(self.gate_statistics))
        for name in self.balancing_losses[-1] if self.balancing_losses else {}:
            record[name] = sum(step[name] for step in self.balancing_losses) / len(
                self.balancing_losses)
        self.balancing_losses = []
        self._record(record)

        done = self.iteration / t.train_iters
        bar = "#" * int(20 * done)
        eta = self.eta.seconds_left(self.iteration, steps, elapsed, t.train_iters)
        eta = "" if eta is None else f" | eta {eta:.0f}s"
        mfu = f" | MFU {record['mfu']:.1%}" if "mfu" in record else ""
        self._print(
            f"[{bar:<20}] {self.iteration:>{len(str(t.train_iters))}}/{t.train_iters} "
            f"| loss {record['loss']:.4f}"
            + ("" if mtp is None else " | mtp loss " + " ".join(f"{x:.4f}" for x in mtp))
            + f" | lr {record['lr']:.2e} | grad norm "
            f"{record['grad_norm'] or float('nan'):.3f} | {tokens_per_s:,.0f} tok/s | {tflops:.3f} "
            f"TFLOP/s/device{mfu} | mem {record['peak_memory_gb']:.2f} GB{eta}"
            + "".join(f" | {name} {record[name]:.4f}" for name in _BALANCING_LOSS_NAMES.values()
                      if name in record)
            + ("" if "gate_mean" not in record else
               f" | gate mean {record['gate_mean']:.3f} closed {record['gate_closed']:.3f}")
            + ("" if probed is None else f" | {_probe_field(probed)}")
            + (" | step skipped (fp16 overflow)" if not ok else "")
        )

    def _record(self, record):
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
        if self.tensorboard:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "iteration":
                    self.tensorboard.add_scalar(f"{record['kind']}/{key}", value,
                                                record["iteration"])
                elif key == "gate_mean_per_layer":
                    for layer, mean in value.items():
                        self.tensorboard.add_scalar(f"{record['kind']}/gate_mean_layer_{layer}",
                                                    mean, self.iteration)
                elif key == "mtp_losses":
                    for depth, loss in enumerate(value, start=1):
                        self.tensorboard.add_scalar(f"{record['kind']}/mtp_{depth}_loss", loss,
                                                    self.iteration)
                elif key == "layers":  # the probe's figures per layer (per-head lists left out)
                    for layer, figures in value.items():
                        for name, figure in figures.items():
                            if isinstance(figure, (int, float)):
                                self.tensorboard.add_scalar(
                                    f"{record['kind']}/{name}_layer_{layer}", figure,
                                    record["iteration"])

    def _tensorboard(self):
        if not (self.rank0 and self.cfg.logging.tensorboard_dir):
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: tensorboard is not a dependency
            return None
        return SummaryWriter(self.cfg.logging.tensorboard_dir)

    def _print(self, message):
        if self.rank0:
            print(message, flush=True)


# The first line of the resolved config.yaml the launcher writes: a file without it is not the
# launcher's to replace.
RESOLVED_MARK = "# the resolved configuration of a launch/pretrain.py run"


def _announce_config(cfg, config_file: str | None = None) -> str | None:
    """The resolved configuration into the run directory (config.yaml beside the metrics file,
    else in checkpoint.save), a one-line summary on the console; with neither, all of it there.
    Returns the file written, or None.

    Never over an input: when config.yaml is ``config_file`` (the run's --config) or a file the
    launcher did not write (no ``RESOLVED_MARK`` line first), config.resolved.yaml instead."""
    folder = (os.path.dirname(os.path.abspath(cfg.logging.metrics_file)) if cfg.logging.metrics_file
              else cfg.checkpoint.save)
    m, t, o = cfg.model, cfg.training, cfg.optimizer
    summary = (f"{m.num_layers} layers x {m.hidden_size} hidden, {m.num_attention_heads} heads, "
               f"seq {m.seq_length}, gate {'on' if m.head_wise_attn_gate else 'off'}, "
               f"{m.attention_backend}; {t.train_iters} iterations, lr {o.lr:g} "
               f"({o.lr_decay_style})")
    path = _resolved_config_path(folder, config_file) if folder else None
    if path is None:
        print(f"[config] {summary}; resolved configuration:\n{cfg.to_yaml()}", flush=True)
        return None
    with open(path, "w") as f:
        f.write(f"{RESOLVED_MARK}\n{cfg.to_yaml()}")
    print(f"[config] {summary}; resolved configuration in {path}", flush=True)
    return path


def _announce_deprecated_model(cfg) -> None:
    """One console line when the run builds GPTModel on a megatron-core that deprecates it for
    HybridModel (0.19+; megatron's own notice, logged per GPTModel built, is filtered away)."""
    if cfg.model.architecture == "gpt":
        notice = gpt_deprecation_notice(
            "model.architecture: hybrid builds its successor, HybridModel")
        if notice:
            print(f"[config] model.architecture=gpt: {notice}", flush=True)


def _resolved_config_path(folder: str, config_file: str | None) -> str | None:
    """The first of ``folder``/config.yaml, config.resolved.yaml that is new or a resolved config
    the launcher wrote (not ``config_file``); None if neither."""
    os.makedirs(folder, exist_ok=True)
    for name in ("config.yaml", "config.resolved.yaml"):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            return path
        if config_file and os.path.exists(config_file) and os.path.samefile(path, config_file):
            continue
        with open(path, errors="replace") as f:
            if f.readline().rstrip("\n") == RESOLVED_MARK:
                return path
    return None


class _Eta:
    """Seconds left, from the mean time of the steps after the run's first: that one also
    compiles, allocates and warms caches (an estimate from it alone was 3.5x too long), so the
    first log line has none."""

    def __init__(self, first_iteration: int):
        self.first_iteration = first_iteration
        self.seconds, self.steps = 0.0, 0

    def seconds_left(self, iteration, window_steps, window_seconds, last_iteration):
        if iteration - window_steps < self.first_iteration:  # the window holds the first step
            return None
        self.seconds += window_seconds
        self.steps += window_steps
        return (last_iteration - iteration) * self.seconds / self.steps


def _attach_gate_statistics(model) -> dict:
    """A GateStatistics on every gated attention of this rank's model, by its layer: the GPT
    layer number (a hybrid model's attention layer counted as the GPT layer it stands for),
    ``mtpN`` for the N-th MTP depth's (``attention_layers``, the probe's keys too)."""
    from mcore_ext.attention.gated import GateStatistics

    stats = {}
    for key, (module, _) in attention_layers(model).items():
        if getattr(module, "head_wise_attn_gate", False):
            module.gate_statistics = stats[key] = GateStatistics()
    return stats


def _probe_field(record: dict) -> str:
    """The attention probe's short field of the log line: the first token's mean attention
    share, the sink rate and the residual stream's largest |activation| over the decoder."""
    if "first_token_share" not in record:
        return "probe: no attention layer measured"
    return (f"sink share {record['first_token_share']:.3f} rate {record['sink_rate']:.2f} "
            f"max act {record['max_activation']:.3g}")


def _gate_statistics(stats: dict) -> dict:
    """Every rank's gate sums since the last log line, combined (each rank holds its heads (TP),
    layers (PP) and tokens (DP, CP)): the mean gate, the closed fraction, the mean per layer.
    Collective over every rank: each calls it at each log line."""
    mine = {key: s.take() for key, s in stats.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    layers = {}
    for sums in every:
        for key, (total, closed, count) in sums.items():
            t, c, n = layers.get(key, (0.0, 0.0, 0))
            layers[key] = (t + total, c + closed, n + count)
    count = sum(n for _, _, n in layers.values())
    if not count:
        return {}
    return {
        "gate_mean": sum(t for t, _, _ in layers.values()) / count,
        "gate_closed": sum(c for _, c, _ in layers.values()) / count,
        "gate_mean_per_layer": {key: t / n for key, (t, _, n) in sorted(
            layers.items(), key=lambda kv: layer_order(kv[0])) if n},
    }


def run_complete(iteration: int, train_iters: int, directory: str | None = None) -> str:
    """The line that says a resumed run has nothing left to train, and how to extend it."""
    where = f" (checkpoint {directory})" if directory else ""
    return (f"{checkpointing.START_MARK} run complete at {iteration}; raise training.train_iters "
            f"({train_iters}) to extend it{where}")


def _every(interval, iteration) -> bool:
    return interval is not None and iteration % interval == 0


class _Window:
    """Losses and step wall time since the last log line."""

    def __init__(self):
        self.start, self.losses, self.mtp_losses = time.perf_counter(), [], []

    @contextlib.contextmanager
    def paused(self):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began

    def add(self, loss, mtp_losses=None):
        self.losses.append(loss)
        if mtp_losses is not None:
            self.mtp_losses.append(mtp_losses)

    def mean_mtp(self):
        """Per MTP depth, the mean over the window's steps; None without MTP."""
        if not self.mtp_losses:
            return None
        return [sum(depth) / len(depth) for depth in zip(*self.mtp_losses)]

    @property
    def steps(self):
        return len(self.losses)

    def mean(self):
        return sum(self.losses) / len(self.losses)

    def elapsed(self):
        return time.perf_counter() - self.start


def _peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: peak RSS


def _peak_tflops(precision: str) -> float | None:
    if not torch.cuda.is_available() or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in _PEAK_TFLOPS.items() if key in name), None)
