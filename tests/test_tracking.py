"""`train.tracker`: metrics.jsonl records, nested ones too, sent to TensorBoard."""

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


def test_training_logs_to_tensorboard(tmp_path, monkeypatch, natsl_cache_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from natsl.training import TrainOptions, train

    monkeypatch.setenv("NATSL_CACHE_DIR", natsl_cache_dir)  # the run's shared corpus cache
    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), [
        "train.seq_len=128", "train.micro_batch_size=4", "train.tokens_per_step=512", "train.eval_every=2",
        "train.save_every=1000", "train.eval_tokens=512", "train.tracker=tensorboard"])
    run = train(recipe, TrainOptions(out_dir=str(tmp_path / "run"), resume="never", device="cpu", backend="chunked",
                                     max_steps=2, save_final=False, progress=False, log=lambda *_: None))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
    assert events.Scalars("loss")[-1].value == pytest.approx(run.history[-1]["loss"])
    assert "val_loss" in tags
    # Every number of the trainer's record arrives, nested ones by path, with nothing known of them here.
    assert set(scalars(run.history[-1])) <= set(tags)
