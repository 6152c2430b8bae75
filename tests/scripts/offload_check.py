"""Driver for tests/test_ppo.py: one process, a DeepSpeed engine of a tiny model (ZeRO stage from argv) trained
3 steps twice from the same start, once with its states moved off the device and back
between steps (ppo.py's --deepspeed_enable_sleep: engine.offload_states / reload_states), once without;
prints the largest weight difference, whether every reload gave back the offloaded weight partitions bit for bit,
the parameter count, and on CUDA the device memory the first offload freed, as JSON.
argv: model path, ZeRO stage[, fp32 | bf16]."""

import json
import os
import sys

import torch

from common.infra.engine import (
    ModelArgs, TrainArgs, create_train_engine, deepspeed_config, device, gathered_state_dict, init_distributed,
    load_causal_lm, optimizer_step,
)
from common.logprobs import token_logps
from common.packing import collate, to_device


def train(model_path, zero_stage, offload, dtype="fp32"):
    train_args = TrainArgs(train_batch_size=2, micro_train_batch_size=2, zero_stage=zero_stage, learning_rate=1e-2,
                           param_dtype=dtype)
    ds_config = deepspeed_config(train_args, 1)
    engine = create_train_engine(load_causal_lm(ModelArgs(pretrain=model_path), ds_config),
                                 train_args, ds_config, num_training_steps=3, offload_states=offload)
    batch = to_device(collate([{"input_ids": [3, 100 + i, 101, 102, 103], "loss_mask": [1] * 5} for i in range(2)], 0),
                      device())
    freed, reload_equal = [], True
    for _ in range(3):
        logps, _ = token_logps(engine, batch)
        engine.backward(-(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
        optimizer_step(engine)
        if offload:
            held = [_partition(p).clone() for p in engine.module.parameters()]
            before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            engine.offload_states(pin_memory=torch.cuda.is_available())
            freed.append(before - (torch.cuda.memory_allocated() if torch.cuda.is_available() else 0))
            engine.reload_states()
            reload_equal &= all(torch.equal(a, _partition(p)) for a, p in zip(held, engine.module.parameters()))
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    return {k: v.float().cpu().clone() for k, v in gathered_state_dict(engine).items()}, freed[:1], reload_equal, params


def _partition(p):
    """This rank's stored weights of `p`: its ZeRO-3 partition, else the tensor itself."""
    return getattr(p, "ds_tensor", p).detach()


if __name__ == "__main__":
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ["MASTER_PORT"])
    model_path, zero_stage, dtype = sys.argv[1], int(sys.argv[2]), (sys.argv[3:] or ["fp32"])[0]  # fp32 or bf16
    init_distributed()
    (plain, *_), (slept, freed, reload_equal, params) = (train(model_path, zero_stage, offload, dtype)
                                                          for offload in (False, True))
    start = load_causal_lm(ModelArgs(pretrain=model_path)).state_dict()
    print(json.dumps({"max_diff": max((plain[k] - slept[k]).abs().max().item() for k in plain),
                      "moved": max((plain[k] - start[k]).abs().max().item() for k in plain), "freed_bytes": freed[0],
                      "reload_equal": reload_equal, "params": params}))
