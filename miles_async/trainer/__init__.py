"""The trainer's pieces that are not actors: packing, FSDP2 sharding, the train step, checkpoints.

`miles_async.actors.trainer.TrainerRank` wraps them in an actor, one per rank; everything here is
plain torch and torch.distributed, usable from a torchrun script as well.

- `config.TrainerConfig`: the trainer's typed settings (frozen msgspec Struct).
- `packing`: samples packed into rows without padding, split into micro-batches by a token budget.
- `fsdp`: process-group rendezvous the torchrun way and FSDP2 `fully_shard` per decoder block.
- `loss`: per-token log-probs by the chunked kernel and the RL (PPO/TIS/KL/entropy) or SFT loss
  of one packed micro-batch, with the step metrics' sums.
- `step.Trainer`: model + AdamW + one train step with gradient accumulation; full-tensor export.
- `checkpoint`: torch.distributed.checkpoint save/load, written to a temporary folder then renamed.
"""
