"""A Hugging Face Transformers Trainer job with tuneup (CPU, ~20 s): `pip install tuneup[hf]`.

    python examples/hf_trainer.py [--steps 300] [--workers 0] [--run-dir DIR] [--gpu]

--gpu trains on CUDA with fp16=True (autocast + the Trainer's GradScaler).

A tiny BERT built from a config (nothing is downloaded) on token sequences that take ~1 ms
each to tokenize, in the main process. `TuneupTrainerCallback` measures the Trainer's model,
optimizer (inside Accelerate's wrapper) and training DataLoader, and records the
TrainingArguments that decide speed; the report ranks the same data stall as plain_loop.py.
"""

import argparse
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from tuneup.integrations.hf import TuneupTrainerCallback


class SlowTokens(Dataset):
    """Sequences that take ~1 ms each to tokenize."""

    def __len__(self):
        return 2048

    def __getitem__(self, index):
        time.sleep(0.001)
        generator = torch.Generator().manual_seed(index)
        return {"input_ids": torch.randint(5, 1000, (32,), generator=generator), "labels": index % 2}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--gpu", action="store_true", help="CUDA with fp16 mixed precision")
    args = parser.parse_args()

    config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(config)
    callback = TuneupTrainerCallback(run_dir=args.run_dir)
    with tempfile.TemporaryDirectory() as output:
        training = TrainingArguments(output_dir=output, max_steps=args.steps, per_device_train_batch_size=16,
                                     learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                                     dataloader_num_workers=args.workers, use_cpu=not args.gpu, fp16=args.gpu,
                                     disable_tqdm=True)
        Trainer(model=model, args=training, train_dataset=SlowTokens(), callbacks=[callback]).train()
    print(callback.agent.report())


if __name__ == "__main__":
    main()
