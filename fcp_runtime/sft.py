"""fcp under TRL's SFTTrainer: :class:`FcpSFTTrainer`, with packing (``packing=True``: documents packed into rows with
``seq_lengths``, position ids restarting in each) and context parallelism together, which TRL refuses on its own
(accelerate's context parallelism drops the block-diagonal mask that keeps packed documents apart; trl#6843).

Under fcp each step's packed rows are cut back into their documents (by TRL's ``seq_lengths``), the step's plan is
compiled in the loader's worker, and attention keeps every document apart on every rank. Everything else is
TRL's own: dataset preparation and packing, its fused LM head's loss (over ``shift_labels``, which fcp gives already
shifted inside each document), its metrics. A script changes in two places::

    import fcp_runtime.hf                                  # registers attn_implementation="fcp"
    from fcp_runtime.sft import FcpSFTTrainer

    trainer = FcpSFTTrainer(model=model, args=SFTConfig(..., packing=True, ddp_backend="gloo"),
                            train_dataset=dataset, processing_class=tokenizer, cp_size=4)

Besides what :class:`~fcp_runtime.trainer.FcpTrainer` refuses: ``packing_strategy="wrapped"`` (it cuts documents
and glues them without a boundary, so no position restarts where a document does), vision datasets, and Liger
kernels (``use_liger_kernel``: its fused loss shifts the labels again).
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from fcp_runtime.trainer import FcpTrainerMixin


class FcpSFTTrainer(FcpTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer under fcp: ``FcpSFTTrainer(model=..., args=SFTConfig(...), train_dataset=...,
    processing_class=..., cp_size=..., compile_options={...})``."""

    def _refuse_options(self) -> None:
        super()._refuse_options()
        args = self.args
        if args.packing_strategy == "wrapped" and (args.packing or args.eval_packing):
            raise ValueError("packing_strategy='wrapped' cuts documents and glues them into rows with no boundary "
                             "(no seq_lengths, positions never restart): use 'bfd' or 'bfd_split' under fcp")
        if getattr(self, "_is_vision_dataset", False):
            raise ValueError("a vision dataset: fcp's SFT trainer takes text (language-modeling or "
                             "prompt-completion) datasets")

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """TRL's evaluation step with the Trainer's label count: the step's labels over every rank (TRL divides each
        rank's loss by its own count, which under fcp is its rows' share, not the batch's)."""
        num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            if prediction_loss_only:
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                return loss.detach(), None, None
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True,
                                              num_items_in_batch=num_items_in_batch)
        return loss.detach(), outputs.logits, inputs.get("labels")
