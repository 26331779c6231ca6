"""A Hugging Face Trainer fine-tuning job as the Transformers docs write one, with no tuneup in
it: a model built from its config, a tokenized training set and an evaluation set,
`TrainingArguments` with gradient accumulation, evaluation every N steps and a cosine schedule
with warm-up, `trainer.train()`, and code after it (a parameter digest: host reads).

Ground truth from the code:
- 60 optimizer steps of 2 micro-batches of 8 (gradient_accumulation_steps=2): 120 forwards and
  120 backwards, 16 samples a step;
- the training set "tokenizes" each sample as it is read: 1 ms (a sleep), in the main process
  (dataloader_num_workers=0), so each step waits >= 16 ms for its data;
- evaluation at steps 20, 40 and 60 (eval_strategy="steps", eval_steps=20): 3 phases of 4
  batches from an evaluation set that sleeps 10 ms a sample (>= 320 ms each), not training data;
- the learning rate: 6 warm-up steps, then a cosine decay: it changes every step;
- host reads in the Trainer's own code: its NaN/inf filter (logging_nan_inf_filter, on by
  default) reads each micro-batch's loss, `torch.isnan(loss) or torch.isinf(loss)`: 2 reads a
  micro-batch, 4 a step; each logging step (logging_steps=20) reads the logged loss
  (`_tr_loss.item()`); the loop's own code reads nothing;
- host reads in the model's code: BERT's SDPA mask check (`padding_mask.all()`, transformers'
  masking_utils) once a forward, 2 a step;
- after train(), one .item() per parameter tensor.
Prints the digest; on stderr each dataset's own time reading (the loader's true wait, training
and evaluation apart); with --attach, attaches as `tuneup.attach(trainer)`.
"""

import argparse
import sys
import time
import warnings

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--attach", action="store_true")
parser.add_argument("--run-dir")
parser.add_argument("--out", default="hf_finetune_out")
args = parser.parse_args()
warnings.filterwarnings("ignore")


class Tokenized(Dataset):
    """Sequences of token ids with a label; each read waits `latency` (the tokenizer's time)
    and adds its own time to `spent`."""

    def __init__(self, size: int, latency: float, seed: int) -> None:
        self.size, self.latency, self.seed = size, latency, seed
        self.spent = 0.0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        began = time.perf_counter()
        time.sleep(self.latency)
        generator = torch.Generator().manual_seed(self.seed * 100_000 + index)
        ids = torch.randint(5, 1000, (32,), generator=generator)
        item = {"input_ids": ids, "attention_mask": torch.ones(32, dtype=torch.long), "labels": int(ids[:4].sum()) % 2}
        self.spent += time.perf_counter() - began
        return item


config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, max_position_embeddings=64)
torch.manual_seed(0)
model = BertForSequenceClassification(config)
training_args = TrainingArguments(
    output_dir=args.out,
    max_steps=60,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
    gradient_accumulation_steps=2,
    learning_rate=5e-4,
    lr_scheduler_type="cosine",
    warmup_steps=6,
    eval_strategy="steps",
    eval_steps=20,
    logging_steps=20,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    seed=0,
    disable_tqdm=True,
)
train_set, eval_set = Tokenized(2048, 0.001, 1), Tokenized(32, 0.010, 2)
trainer = Trainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set)
if args.attach:
    import tuneup

    tuneup.attach(trainer, run_dir=args.run_dir)
trainer.train()
digest = [round(p.sum().item(), 5) for p in model.parameters()]
print("digest", digest)
print(f"reads train {train_set.spent:.4f} eval {eval_set.spent:.4f}", file=sys.stderr)
