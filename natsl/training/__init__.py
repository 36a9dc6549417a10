"""Training: the loop (`trainer`), AdamW groups and the LR schedule (`optim`), checkpoints with the
full training state (`state`), data parallelism (`distributed`), FLOPs/MFU (`flops`), metrics
(`metrics`) and the crash-test hooks (`faults`). `natsl train` is a thin wrapper over `train`."""

from natsl.training.trainer import TrainOptions, TrainResult, train

__all__ = ["TrainOptions", "TrainResult", "train"]
