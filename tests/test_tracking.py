"""`train.tracker`: metrics.jsonl records, nested ones too, sent to TensorBoard and (offline) to wandb."""

import json
import struct
import time

import pytest

import natsl
from natsl.config import apply_overrides
from natsl.errors import NatslError
from natsl.training.tracking import metrics_log, scalars


def test_scalars_flatten_nested_records():
    record = {"step": 7, "loss": 2.5, "skipped": False, "lr": 1e-3, "note": "x", "bad": float("nan"),
              "kept_fraction": {"layer_1": [0.5, 0.25], "layer_3": {"mean": 0.4}}}
    assert scalars(record) == {"loss": 2.5, "lr": 1e-3, "kept_fraction/layer_1/0": 0.5,
                               "kept_fraction/layer_1/1": 0.25, "kept_fraction/layer_3/mean": 0.4}


def test_unknown_tracker_is_refused(tmp_path):
    with pytest.raises(NatslError, match="train.tracker"):
        metrics_log(tmp_path / "m.jsonl", "mlflow", tmp_path, natsl.load_recipe("tiny_hybrid"))
    with pytest.raises(NatslError, match="train.tracker"):
        apply_overrides(natsl.load_recipe("tiny_hybrid"), ["train.tracker=mlflow"])


def tiny_run(tmp_path, tracker):
    from natsl.training import TrainOptions, train

    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), [
        "train.seq_len=128", "train.micro_batch_size=4", "train.tokens_per_step=512", "train.eval_every=2",
        "train.save_every=1000", "train.eval_tokens=512", f"train.tracker={tracker}"])
    return train(recipe, TrainOptions(out_dir=str(tmp_path / "run"), resume="never", device="cpu", backend="chunked",
                                      max_steps=2, save_final=False, progress=False, log=lambda *_: None))


def test_training_logs_to_tensorboard(tmp_path, monkeypatch, natsl_cache_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("NATSL_CACHE_DIR", natsl_cache_dir)  # the run's shared corpus cache
    run = tiny_run(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
    assert events.Scalars("loss")[-1].value == pytest.approx(run.history[-1]["loss"])
    assert "val_loss" in tags
    # Every number of the trainer's record arrives, nested ones by path, with nothing known of them here.
    assert set(scalars(run.history[-1])) <= set(tags)


def wandb_history(path) -> list[dict]:
    """The `history` records of an offline run file (run-*.wandb): W&B's log of protobuf Records, in
    32 KiB blocks of [crc32c u32][length u16][type u8] chunks after a 7-byte header (type 1 whole, 2-4
    first/middle/last piece of one record)."""
    from wandb.proto import wandb_internal_pb2

    raw, block, pos, piece, out = path.read_bytes(), 1 << 15, 7, b"", []
    assert raw.startswith(b":W&B")
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        piece, pos = piece + raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            piece = b""
            if record.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return out


def test_training_logs_to_wandb_offline(tmp_path, monkeypatch, natsl_cache_dir):
    pytest.importorskip("wandb")
    monkeypatch.setenv("NATSL_CACHE_DIR", natsl_cache_dir)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tiny_run(tmp_path, "wandb")
    (path,) = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*/run-*.wandb")  # WANDB_DIR is honoured
    # wandb's service process writes the file; on a loaded machine it may still be flushing when finish()
    # has returned, so wait for the records, briefly
    deadline, history = time.monotonic() + 60, []
    while len(history) < 2 and time.monotonic() < deadline:
        try:
            history = wandb_history(path)
        except Exception:  # noqa: BLE001 - a record half written; read again
            pass
        if len(history) < 2:
            time.sleep(0.5)
    assert [h["_step"] for h in history] == [1, 2]
    last = history[-1]
    assert last["loss"] == pytest.approx(run.history[-1]["loss"]) and "val_loss" in last
    # every number of the trainer's record, the per-layer and per-group kept fractions included
    expected = scalars(run.history[-1])
    assert any(k.startswith("keep/") for k in expected) and any(k.startswith("keep_groups/") for k in expected)
    assert {k: last[k] for k in expected} == pytest.approx(expected)
