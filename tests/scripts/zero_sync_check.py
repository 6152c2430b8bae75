"""Driver for tests/test_vllm_engine.py: under torchrun, for each trainer configuration in argv (ZeRO stage and
LoRA rank), train a tiny model a few steps with DeepSpeed, push its weights into one vLLM engine on rank 0, and
write the trainer's and vLLM's log-probs of fixed sequences to a JSON file (a list, one entry per configuration).
The engine starts once; before each configuration after the first it gets the start weights back, so every
configuration syncs over the same engine state."""

import json
import sys

import torch

from common.infra.engine import (
    ModelArgs, TrainArgs, create_train_engine, deepspeed_config, device, finish, init_distributed, load_causal_lm,
    optimizer_step,
)
from common.logprobs import token_logps
from common.packing import collate
from common.infra.vllm_engine import EngineArgs, create_vllm_engine, vllm_sequence_logprobs
from common.infra.weight_sync import WeightSync


def trained_engine(model_path, zero_stage, lora_rank, rank, world, cuda):
    """A DeepSpeed engine after 3 optimizer steps on rank-dependent sequences (weights off the checkpoint)."""
    train = TrainArgs(train_batch_size=2 * world, micro_train_batch_size=2, zero_stage=zero_stage, learning_rate=1e-2,
                      param_dtype="bf16" if cuda else "fp32")
    ds_config = deepspeed_config(train, world)
    model = load_causal_lm(ModelArgs(pretrain=model_path, lora_rank=lora_rank), ds_config)
    engine = create_train_engine(model, train, ds_config, num_training_steps=3)
    sequences = [[3, 100 + i, 101, 102, 103, 104, 105 + rank] for i in range(2)]
    for _ in range(3):
        batch = collate([{"input_ids": s, "loss_mask": [1] * len(s)} for s in sequences], 0, max_tokens=64)
        logps, _ = token_logps(engine, batch)
        engine.backward(-(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
        optimizer_step(engine)
    return engine


if __name__ == "__main__":
    model_path, out_file, configs = sys.argv[1], sys.argv[2], [tuple(map(int, c.split(":"))) for c in sys.argv[3:]]
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cuda = torch.cuda.is_available()  # CUDA: bf16 trainer and engine, bf16 sent; CPU: fp32 throughout
    llm = create_vllm_engine(model_path, EngineArgs(max_model_len=128), bf16=cuda) if rank == 0 else None
    sync = WeightSync([llm] if llm else [], colocated=True)  # in-process: the trainer's device (CUDA: IPC)
    fixed = [[3, 120, 121, 122, 123, 124, 125], [3, 130, 131, 132]]
    results = []
    for i, (zero_stage, lora_rank) in enumerate(configs):
        if i:  # the engine holds the previous configuration's weights: give it the start weights back
            sync.sync(load_causal_lm(ModelArgs(pretrain=model_path)).to(device()))
        engine = trained_engine(model_path, zero_stage, lora_rank, rank, world, cuda)
        cached = vllm_sequence_logprobs(llm, fixed) if llm else None  # prefix cache holds the old weights' KV
        stats = sync.sync(engine)
        engine.eval()
        with torch.no_grad():  # every rank runs the forward (ZeRO-3 gathers across ranks)
            batch = collate([{"input_ids": s, "loss_mask": [1] * len(s)} for s in fixed], 0, max_tokens=64)
            logps, _ = token_logps(engine, batch)
        if rank == 0:
            results.append({"zero_stage": zero_stage, "lora_rank": lora_rank, "stats": stats,
                            "backend": llm.llm_engine.vllm_config.weight_transfer_config.backend,
                            "trainer": [logps[r, s + 1 : s + n].tolist() for r, s, n in batch["spans"]],
                            "vllm": vllm_sequence_logprobs(llm, fixed), "vllm_before": cached})
        torch.distributed.barrier()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    finish()  # exit without interpreter teardown (see common.infra.engine.finish)
