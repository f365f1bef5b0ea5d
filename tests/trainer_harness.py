"""Training a tiny random Hugging Face causal LM with the Trainer (fcp_runtime.trainer.FcpTrainer) and with TRL's
SFTTrainer (fcp_runtime.sft.FcpSFTTrainer) on forked gloo ranks, and the same training with each framework's own code
in one process (HF's sdpa attention on packed rows, no fcp): what tests/test_trainer.py and tests/test_trl.py
compare.

Building a Trainer needs accelerate (the trainer extra), TRL's the trl extra: the test modules skip what they
cannot run. Every run is a forked process (the ranks through runtime_harness.run_ranks, the reference through
run_alone), so that accelerate's process-wide state never leaks from one run into the next."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import multiprocessing
import os
import traceback

import numpy as np
import torch

transformers = __import__("pytest").importorskip("transformers")

import fcp_runtime.hf as fcp_hf  # noqa: E402  (registers attn_implementation="fcp")
from runtime_harness import run_ranks  # noqa: E402

IGNORE = fcp_hf.IGNORE_INDEX
# What the Trainer logs that depends on the clock, not on the training.
CLOCK_KEYS = ("runtime", "per_second", "preparation_time")


# --- the model and its loss ----------------------------------------------------------------------------------------


def fp64_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = IGNORE,
                        shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss in the logits' own dtype (it upcasts to fp32): the same shift (none where
    `shift_labels` is given), the same sum over the label count."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device)
    return loss


def tiny_model(attn_implementation: str, vocab_size: int = 96, num_layers: int = 2, hf_loss: bool = False,
               arch: str = "llama", dtype: torch.dtype = torch.float64):
    """A random GQA causal LM (4 query heads, 2 KV heads), fp64 unless told, the same weights each call."""
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  attn_implementation=attn_implementation)
    torch.manual_seed(0)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model = model.to(dtype)
    if not hf_loss:
        model.loss_function = fp64_causal_lm_loss
    return model


def state_of(model) -> dict[str, np.ndarray]:
    return {name: value.detach().cpu().double().numpy().copy() for name, value in model.state_dict().items()}


def worst_weight(got: dict, want: dict) -> float:
    return max(float(np.max(np.abs(got[name] - want[name]))) for name in want)


def worst_relative(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) and want, (got, want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


# --- documents -----------------------------------------------------------------------------------------------------


def long_tail_documents(count: int, seed: int, vocab_size: int = 96, long_every: int = 4, long_length: int = 300):
    """`count` documents: every `long_every`-th is `long_length` tokens, the rest lognormal around 30 tokens (2 to
    120): a long tail. Taken in order `long_every` at a time, every step holds one long document, longer than a rank's
    share of the step on 2 or 4 ranks.
    Ids follow a per-document arithmetic progression, so there is something to learn."""
    rng = np.random.default_rng(seed)
    docs = []
    for index in range(count):
        length = long_length if index % long_every == long_every - 1 else \
            int(np.clip(rng.lognormal(np.log(30), 0.9), 2, 120))
        start, stride = (int(x) for x in rng.integers(0, vocab_size, size=2))
        docs.append({"input_ids": (start + (stride % 5 + 1) * torch.arange(length)) % vocab_size})
    return docs


# --- running ranks and one process ---------------------------------------------------------------------------------


def run_alone(task, timeout: float = 600.0):
    """task() in one forked process without torch.distributed (the one-process reference); its result."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def target():
        torch.set_num_threads(1)
        try:
            queue.put(("ok", task()))
        except BaseException as error:  # report every failure to the parent instead of hanging it
            queue.put(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))

    proc = context.Process(target=target)
    proc.start()
    try:
        status, payload = queue.get(timeout=timeout)
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise AssertionError(payload)
    return payload


def as_torchrun_rank(rank: int, world: int) -> None:
    """The environment torchrun gives a rank, so that accelerate (TrainingArguments) sees a distributed CPU run;
    runtime_harness.run_ranks has already initialized the gloo process group, which accelerate keeps."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))


def printed_logs(text: str) -> list[dict]:
    """The dicts the Trainer's PrinterCallback printed (its floats at 4 significant digits), less the clock's."""
    logs = []
    for line in text.splitlines():
        if line.startswith("{") and line.endswith("}"):
            entry = ast.literal_eval(line)
            logs.append({key: value for key, value in entry.items() if not any(c in key for c in CLOCK_KEYS)})
    return logs


def training_args(output_dir: str, **overrides):
    """TrainingArguments for a short CPU run: fp64 weights, AdamW, a linear schedule, a log line every step, no
    reporting, printed logs (PrinterCallback), the gloo backend."""
    options = dict(output_dir=output_dir, use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True,
                   logging_steps=1, learning_rate=3e-3, weight_decay=0.01, warmup_steps=0, seed=0,
                   save_strategy="no", dataloader_num_workers=0, max_steps=4, gradient_accumulation_steps=2,
                   per_device_train_batch_size=4, per_device_eval_batch_size=4,
                   # In order: every replica's micro-step then holds one long document (long_tail_documents).
                   train_sampling_strategy="sequential")
    options.update(overrides)
    return transformers.TrainingArguments(**options)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerRun:
    """One Trainer run: its model, data and arguments. `dp` x `cp` ranks under fcp; the reference runs the same
    global batches in one process (per_device_train_batch_size x dp examples a micro-step)."""

    cp: int = 4
    dp: int = 1
    hf_loss: bool = False  # transformers' own loss (fp32 logits); else fp64_causal_lm_loss
    num_layers: int = 2
    batch: int = 4  # documents per replica and micro-step
    documents: int = 64  # training documents (an epoch: documents / (batch * dp) micro-steps)
    eval_documents: int = 16
    block_size: int = 64
    num_workers: int = 0
    max_steps: int = 4
    eval_steps: int = 2
    save_steps: int | None = None
    mutation: str | None = None  # see mutate()

    def arguments(self, output_dir: str, alone: bool, **overrides):
        batch = self.batch * (self.dp if alone else 1)
        saving = dict(save_strategy="steps", save_steps=self.save_steps) if self.save_steps else {}
        backend = dict(ddp_backend=None) if alone else {}  # one process: no torch.distributed at all
        return training_args(output_dir, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
                             max_steps=self.max_steps, eval_strategy="steps", eval_steps=self.eval_steps,
                             dataloader_num_workers=self.num_workers, **saving, **backend, **overrides)

    def datasets(self):
        return (long_tail_documents(self.documents, seed=1, long_every=self.batch),
                long_tail_documents(self.eval_documents, seed=2, long_every=self.batch))


def recording(trainer_class):
    """The trainer class, keeping each micro-step's loss as training_step returns it (fp64, before the Trainer adds
    it to its fp32 running total): under fcp each rank's share of the step's loss times the world size."""
    class Recording(trainer_class):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.micro_losses = getattr(self, "micro_losses", []) + [float(loss)]
            return loss

    return Recording


def step_losses(results: list[dict], accumulation: int) -> list[float]:
    """Each optimizer step's loss from the ranks' recorded micro-step losses: their mean over the ranks (each is a
    rank's share times the world size), summed over the step's micro-steps."""
    micro = np.mean([result["micro_losses"] for result in results], axis=0)
    return [float(sum(micro[i:i + accumulation])) for i in range(0, len(micro), accumulation)]


def reference_trainer_run(run: TrainerRun, output_dir: str) -> dict:
    """The run in one process with transformers' own code: sdpa attention, DataCollatorWithFlattening (its
    padding-free packing: position ids restart in each document, which sdpa's mask keeps apart)."""
    def task():
        train, evaluation = run.datasets()
        model = tiny_model("sdpa", num_layers=run.num_layers, hf_loss=run.hf_loss)
        trainer = recording(transformers.Trainer)(
            model=model, args=run.arguments(output_dir, alone=True), train_dataset=train, eval_dataset=evaluation,
            data_collator=transformers.DataCollatorWithFlattening())
        return _train(trainer)
    return run_alone(task)


def _train(trainer, resume_from: str | None = None) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.train(resume_from_checkpoint=resume_from)
    history = trainer.state.log_history
    return {"losses": [entry["loss"] for entry in history if "loss" in entry],
            "eval_losses": [entry["eval_loss"] for entry in history if "eval_loss" in entry],
            "grad_norms": [entry["grad_norm"] for entry in history if "grad_norm" in entry],
            "printed": printed_logs(out.getvalue()), "state": state_of(trainer.model),
            "micro_losses": getattr(trainer, "micro_losses", [])}


def fcp_trainer_run(run: TrainerRun, output_dir: str, resume_from: str | None = None) -> list[dict]:
    """The run under FcpTrainer on dp x cp forked gloo ranks; each rank's results."""
    def task(rank, world):
        from fcp_runtime.trainer import FcpTrainer

        as_torchrun_rank(rank, world)
        train, evaluation = run.datasets()
        model = tiny_model(fcp_hf.ATTENTION_NAME, num_layers=run.num_layers, hf_loss=run.hf_loss)
        cls = recording(mutated(FcpTrainer, run.mutation))
        trainer = cls(model=model, args=run.arguments(output_dir, alone=False), train_dataset=train,
                      eval_dataset=evaluation, cp_size=run.cp, compile_options={"block_size": run.block_size})
        if run.mutation:
            trainer.data_collator = MutatedCollator(trainer.data_collator, run.mutation)
        return _train(trainer, resume_from)
    return run_ranks(run.dp * run.cp, task, timeout=300)


# --- mutations: each breaks one thing the parity rests on ----------------------------------------------------------

MUTATIONS = ("labels_across_documents", "rank_mean", "positions_off_by_one")


def mutated(trainer_class, mutation: str | None):
    """The trainer class, or one whose loss breaks the rule: "rank_mean" divides each rank's summed loss by its own
    label count (a per-rank mean) instead of the whole step's."""
    if mutation != "rank_mean":
        return trainer_class

    class RankMean(trainer_class):
        def _get_num_items_in_batch(self, batch_samples, device):
            return sum(batch["shift_labels"].ne(IGNORE).sum() for batch in batch_samples).to(device)

    return RankMean


class MutatedCollator:
    """FcpDataCollator with one thing broken: "labels_across_documents" shifts labels over the packed row (a
    document's last token predicts the next document's first), "positions_off_by_one" counts each rank's positions
    one on from the rank before's (rank r's rows get their position + r: a document that crosses ranks has its
    pieces' positions off by one against each other)."""

    def __init__(self, collator, mutation: str):
        self.collator, self.mutation = collator, mutation

    def __call__(self, examples):
        if self.mutation == "labels_across_documents":
            return self._labels_across_documents(examples)
        batch = self.collator(examples)
        if self.mutation == "positions_off_by_one":
            batch["position_ids"] = batch["position_ids"] + self.collator.collate.planning.rank
        return batch

    def _labels_across_documents(self, examples):
        from fcp_runtime.trainer import example_documents

        docs = [doc for index, example in enumerate(examples) for doc in example_documents(example, index)]
        row = torch.cat([torch.as_tensor(doc["labels"]) for doc in docs])
        shifted = torch.cat([row[1:], torch.tensor([IGNORE])]).split([len(doc["input_ids"]) for doc in docs])
        planning = self.collator.collate.planning
        batch = planning([{"input_ids": torch.as_tensor(doc["input_ids"]).long(), "shift_labels": labels.long()}
                          for doc, labels in zip(docs, shifted)])
        labels = batch["shift_labels"][None]
        return {"input_ids": batch["input_ids"][None], "position_ids": batch["position_ids"][None],
                "labels": labels, "shift_labels": labels, "fcp_plan": batch["plan"], "use_cache": False}


# --- TRL: SFTTrainer with packing ----------------------------------------------------------------------------------

WORDS = ("the a one two red blue green small large cat dog bird fish tree house river stone cloud sun moon runs "
         "sees eats finds makes holds sings walks jumps sleeps under over near behind with without and or but then "
         "today again slowly quickly here there every some many few old new warm cold bright dark").split()
SPECIAL = {"pad": "<pad>", "eos": "</s>", "unk": "[UNK]"}


def local_text(count: int, seed: int, long_every: int = 8, long_words: int = 200) -> list[str]:
    """`count` made-up documents of WORDS: every `long_every`-th has `long_words` words (longer than a rank's share
    of a packed step on 4 ranks), the rest lognormal around 25 words (3 to 90)."""
    rng = np.random.default_rng(seed)
    texts = []
    for index in range(count):
        words = long_words if index % long_every == long_every - 1 else \
            int(np.clip(rng.lognormal(np.log(25), 0.8), 3, 90))
        # A little grammar: each word drawn from the neighbours of the last, so the model has something to learn.
        position = int(rng.integers(len(WORDS)))
        picks = []
        for _ in range(words):
            position = (position + int(rng.integers(1, 4))) % len(WORDS)
            picks.append(WORDS[position])
        texts.append(" ".join(picks))
    return texts


def local_tokenizer():
    """A word-level tokenizer over WORDS, built here (no download), as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate([SPECIAL["pad"], SPECIAL["eos"], SPECIAL["unk"], *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=SPECIAL["pad"],
                                                eos_token=SPECIAL["eos"], unk_token=SPECIAL["unk"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTRun:
    """One SFTTrainer run with packing: `cp` ranks under fcp, or TRL alone in one process."""

    cp: int = 4
    max_length: int = 256  # a packed row
    rows: int = 2  # packed rows a micro-step
    documents: int = 120
    eval_documents: int = 16
    eval_batch: int = 8  # evaluation: documents a step, unpacked (eval_packing=False)
    max_steps: int = 4
    block_size: int = 64
    num_workers: int = 0
    learning_rate: float = 1e-3
    bf16: bool = False  # bf16 weights and TRL's default bf16=True (autocast); else fp64 weights, no autocast
    mutation: str | None = None

    def config(self, output_dir: str, alone: bool, **overrides):
        import trl

        backend = dict(ddp_backend=None) if alone else dict(ddp_backend="gloo")
        options = dict(output_dir=output_dir, use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1,
                       learning_rate=self.learning_rate, weight_decay=0.01, warmup_steps=0, seed=0,
                       save_strategy="no", max_steps=self.max_steps, gradient_accumulation_steps=2, bf16=False,
                       per_device_train_batch_size=self.rows, per_device_eval_batch_size=self.eval_batch,
                       eval_strategy="steps", eval_steps=2, eval_packing=False, packing=True,
                       max_length=self.max_length, dataloader_num_workers=self.num_workers, **backend)
        options.update(overrides)
        return trl.SFTConfig(**options)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float64

    def datasets(self):
        import datasets

        return (datasets.Dataset.from_dict({"text": local_text(self.documents, seed=3)}),
                datasets.Dataset.from_dict({"text": local_text(self.eval_documents, seed=4)}))


def reference_sft_run(run: SFTRun, output_dir: str) -> dict:
    """The run with TRL alone in one process: SFTTrainer(packing=True), its padding-free collator, sdpa."""
    def task():
        import trl

        tokenizer = local_tokenizer()
        train, evaluation = run.datasets()
        model = tiny_model("sdpa", vocab_size=len(tokenizer), hf_loss=True, dtype=run.dtype)
        trainer = recording(trl.SFTTrainer)(model=model, args=run.config(output_dir, alone=True),
                                            train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer)
        result = _train(trainer)
        result["seq_lengths"] = [list(map(int, row)) for row in trainer.train_dataset["seq_lengths"]]
        return result
    return run_alone(task)


def fcp_sft_run(run: SFTRun, output_dir: str) -> list[dict]:
    """The run under FcpSFTTrainer on `cp` forked gloo ranks; each rank's results."""
    def task(rank, world):
        from fcp_runtime.sft import FcpSFTTrainer

        as_torchrun_rank(rank, world)
        tokenizer = local_tokenizer()
        train, evaluation = run.datasets()
        model = tiny_model(fcp_hf.ATTENTION_NAME, vocab_size=len(tokenizer), hf_loss=True, dtype=run.dtype)
        trainer = recording(mutated(FcpSFTTrainer, run.mutation))(
            model=model, args=run.config(output_dir, alone=False), train_dataset=train, eval_dataset=evaluation,
            processing_class=tokenizer, cp_size=run.cp, compile_options={"block_size": run.block_size})
        if run.mutation:
            trainer.data_collator = MutatedCollator(trainer.data_collator, run.mutation)
        return _train(trainer)
    return run_ranks(run.cp, task, timeout=300)
