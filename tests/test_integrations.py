"""Zero-glue recipes: ``ftopt.Optimizer`` in Hugging Face's ``Trainer``
(``optimizers=(opt, None)``) and in Lightning (``configure_optimizers`` returns it). Each
trains a tiny model built from a config (no download) on the CPU, and a run resumed from
the framework's own checkpoint at step 3 ends bit-identical to an uninterrupted one.
Skipped, saying why, where transformers (with accelerate) or lightning is not installed
(``pip install -e '.[integration]'``; ``make test`` installs it)."""

from __future__ import annotations

import pytest
import torch

import ftopt

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), f"{name} differs after resuming"


def test_hugging_face_trainer_resumes_bit_exactly(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="Trainer needs accelerate, not installed")

    def make_model():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                         n_positions=16)
        return transformers.GPT2LMHeadModel(config)

    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(32):
        ids = torch.randint(0, 64, (16,), generator=gen)
        data.append({"input_ids": ids, "labels": ids})

    def trainer(model, out, max_steps):
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
            save_strategy="steps", save_steps=3, logging_strategy="no", report_to=[],
            use_cpu=True, seed=0, lr_scheduler_type="constant", disable_tqdm=True)
        opt = ftopt.Optimizer(model.named_parameters(), ftopt.adamw, lr=1e-2,
                              weight_decay=0.1)
        return transformers.Trainer(model=model, args=args, train_dataset=data,
                                    optimizers=(opt, None))

    whole = make_model()
    first = trainer(whole, tmp_path / "whole", STEPS)
    first.train()
    assert isinstance(first.optimizer.optimizer if hasattr(first.optimizer, "optimizer")
                      else first.optimizer, ftopt.Optimizer)
    resumed = make_model()
    trainer(resumed, tmp_path / "whole", STEPS).train(
        resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-3"))
    _same_params(whole, resumed)
    assert not torch.equal(whole.transformer.wte.weight, make_model().transformer.wte.weight)


def test_lightning_resumes_bit_exactly(tmp_path):
    lightning = pytest.importorskip("lightning", reason="lightning is not installed")
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return ftopt.Optimizer(self.named_parameters(), ftopt.adamw, lr=1e-2,
                                   weight_decay=0.1)

    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 8, generator=gen),
                                          torch.randn(24, 1, generator=gen))

    def fit(model, root, ckpt_path=None, callbacks=()):
        trainer = lightning.Trainer(
            max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
            enable_checkpointing=bool(callbacks), callbacks=list(callbacks))
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8),
                    ckpt_path=ckpt_path)
        return trainer

    whole = Regression()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = fit(whole, tmp_path / "whole", callbacks=[saver])
    assert isinstance(trainer.optimizers[0], ftopt.Optimizer)
    step3 = sorted((tmp_path / "ckpt").glob("*step=3*"))
    assert len(step3) == 1
    resumed = Regression()
    fit(resumed, tmp_path / "resumed", ckpt_path=str(step3[0]))
    _same_params(whole, resumed)
    assert not torch.equal(whole.net[0].weight, Regression().net[0].weight)
