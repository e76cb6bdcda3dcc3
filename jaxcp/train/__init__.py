"""Training pieces for the main job: MQAR data and the (data, seq)-mesh train step."""
from jaxcp.train.mqar import Batch, mqar_batch
from jaxcp.train.step import make_loss, make_optimizer, make_train_step, replicate, shard_batch

__all__ = ["Batch", "mqar_batch", "make_loss", "make_optimizer", "make_train_step", "replicate",
           "shard_batch"]
