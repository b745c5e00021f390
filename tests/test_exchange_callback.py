"""BlobExchangeCallback in real (tiny, CPU) Lightning Trainers: teacher → student (Detectron
semantics: cross-process exchange)."""

from __future__ import annotations

import uuid

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_roidata.exchange import AlignmentError
from lit_roidata.exchange.callback import BlobExchangeCallback, batch_alignment_meta
from lit_roidata.demo.exchange_streams import demo_batches
from lit_roidata.demo.rpn_exchange_model import RPNExchangeDemo


class _Unsized(IterableDataset):
    """A list's items as a stream without ``__len__``."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)

K = 4
RPN_KEYS = [f"rpn_{kind}_fpn{lvl}" for lvl in range(2, 7) for kind in ("cls_probs", "bbox_pred")]


class _RecorderMixin:
    """Keeps what it published and what it received from the peer, per step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sent, self.received = [], []

    def training_step(self, batch, batch_idx):
        peer = self.peer_outputs
        self.received.append(None if peer is None else
                             ({k: v.clone() for k, v in peer.items()}, dict(self.peer_meta)))
        out = super().training_step(batch, batch_idx)
        self.sent.append({k: out[k].clone() for k in RPN_KEYS})
        return out


class Recorder(_RecorderMixin, RPNExchangeDemo):
    __doc__ = _RecorderMixin.__doc__


def _fit(model, seed, callback, tmp_path, ns=pl):
    trainer = ns.Trainer(accelerator="cpu", devices=1, max_steps=K, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback],
                         default_root_dir=str(tmp_path))
    trainer.fit(model, DataLoader(demo_batches(seed, K), batch_size=None))
    return model


@pytest.fixture
def cb_args(tmp_path):
    return {"run_id": f"cb{uuid.uuid4().hex[:8]}", "backend": "embedded",
            "address": str(tmp_path / "exchange"), "timeout": 30.0}


@pytest.mark.parametrize("lag", [0, 1])
def test_teacher_outputs_reach_the_student(tmp_path, cb_args, lag, lightning_ns):
    """In both Lightning namespaces (lit_roidata.lightning's model and callback with
    ``import lightning as L``)."""
    ns = lightning_ns
    rec = type("Recorder", (_RecorderMixin, ns.lit(RPNExchangeDemo)), {})
    exchange = ns.lit(BlobExchangeCallback)
    # The teacher may run ahead by K messages, so the two fits can run one after the other.
    teacher = _fit(rec(role="teacher"), 5, exchange(
        publish="teacher_rpn", publish_keys=RPN_KEYS, capacity=K, **cb_args), tmp_path, ns)
    student = _fit(rec(role="student"), 5, exchange(
        subscribe="teacher_rpn", lag=lag, **cb_args), tmp_path, ns)
    for step, got in enumerate(student.received):
        if lag == 1 and step == 0:
            assert got is None  # nothing from the peer before its first step
            continue
        tensors, meta = got
        assert meta["step"] == step - lag
        assert set(tensors) == set(RPN_KEYS)
        for key in RPN_KEYS:
            torch.testing.assert_close(tensors[key], teacher.sent[step - lag][key],
                                       rtol=0, atol=0)


def test_misaligned_student_fails_naming_the_field(tmp_path, cb_args):
    _fit(Recorder(role="teacher"), 5, BlobExchangeCallback(
        publish="teacher_rpn", publish_keys=RPN_KEYS, capacity=K, **cb_args), tmp_path)
    with pytest.raises(AlignmentError, match="image_ids"):
        _fit(Recorder(role="student"), 6, BlobExchangeCallback(  # another seed: other images
            subscribe="teacher_rpn", lag=0, **cb_args), tmp_path)


def test_callback_argument_checks_and_meta_extraction():
    with pytest.raises(ValueError, match="publish"):
        BlobExchangeCallback(run_id="x")
    with pytest.raises(ValueError, match="publish_keys"):
        BlobExchangeCallback(run_id="x", publish="out")
    batch = demo_batches(1, 1)[0]
    meta = batch_alignment_meta(batch)
    assert set(meta) == {"image_ids", "flipped", "im_scales"}
    assert isinstance(meta["image_ids"], list) and isinstance(meta["flipped"][0], bool)


class CrashAt(Recorder):
    """A student that dies in ``training_step`` of step ``crash_at`` (after the callback
    took that step's message), as a killed or failing trainer would."""

    def __init__(self, crash_at=None, **kw):
        super().__init__(**kw)
        self.crash_at = crash_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise RuntimeError("simulated crash")
        return super().training_step(batch, batch_idx)


def test_exactly_once_with_the_checkpoint(tmp_path, cb_args):
    """A student restarted from its checkpoint receives exactly the messages after it:
    the one it took just before crashing is delivered again, none is skipped."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    teacher = _fit(Recorder(role="teacher"), 5, BlobExchangeCallback(
        publish="teacher_rpn", publish_keys=RPN_KEYS, capacity=K, **cb_args), tmp_path)
    ckpt_dir = tmp_path / "ckpt"

    def student_trainer(cb):
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=K, logger=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[cb, ModelCheckpoint(dirpath=ckpt_dir, save_last=True,
                                                         every_n_train_steps=1,
                                                         save_top_k=-1)],
                          default_root_dir=str(tmp_path))

    data = DataLoader(demo_batches(5, K), batch_size=None)
    first = CrashAt(crash_at=2, role="student")
    with pytest.raises(RuntimeError, match="simulated crash"):
        student_trainer(BlobExchangeCallback(subscribe="teacher_rpn", lag=0,
                                             delivery="exactly_once", **cb_args)
                        ).fit(first, data)
    assert len(first.received) == 2  # steps 0 and 1; step 2's message was taken, unused
    state = torch.load(ckpt_dir / "last.ckpt", weights_only=False)["callbacks"]
    assert next(v for k, v in state.items() if "BlobExchangeCallback" in k)[
        "consumed_seq"] == 2
    second = CrashAt(role="student")
    # This list loader is not resumable: feed the restarted run the batches after the
    # checkpoint (the alignment check would catch anything else). Without a length, so
    # that the restored position in the epoch cannot end the epoch early (Lightning 2.4
    # counts the restored batches against the loader's length).
    rest = DataLoader(_Unsized(list(demo_batches(5, K))[2:]), batch_size=None)
    student_trainer(BlobExchangeCallback(subscribe="teacher_rpn", lag=0,
                                         delivery="exactly_once", **cb_args)
                    ).fit(second, rest, ckpt_path=str(ckpt_dir / "last.ckpt"))
    steps = [meta["step"] for _, meta in second.received]
    assert steps == [2, 3]  # exactly the messages after the checkpoint, in order
    for (tensors, meta) in second.received:
        for key in RPN_KEYS:
            torch.testing.assert_close(tensors[key], teacher.sent[meta["step"]][key],
                                       rtol=0, atol=0)
    assert not list((tmp_path / "exchange").rglob("msg.*"))  # all consumed and cleaned


class SlowValidation(Recorder):
    """Records, during validation, what the peer's consumer sees of this process."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.peer, self.seen = None, []

    def validation_step(self, batch, batch_idx):
        self.seen.append(self.peer.peer_activity())


def test_validation_marks_the_process_busy_for_its_peer(tmp_path, cb_args):
    from lit_roidata.exchange import BlobExchange

    peer_ex = BlobExchange("embedded", cb_args["address"], run_id=cb_args["run_id"])
    peer = peer_ex.channel("teacher_rpn", "consumer")
    model = SlowValidation(role="teacher")
    model.peer = peer
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         val_check_interval=1, limit_val_batches=1,
                         callbacks=[BlobExchangeCallback(publish="teacher_rpn",
                                                         publish_keys=RPN_KEYS, capacity=K,
                                                         **cb_args)],
                         default_root_dir=str(tmp_path))
    data = DataLoader(demo_batches(5, 2), batch_size=None)
    trainer.fit(model, data, DataLoader(demo_batches(5, 1), batch_size=None))
    assert model.seen and all(a["busy"] and a["activity"] == "validation" for a in model.seen)
    peer_ex.close()
