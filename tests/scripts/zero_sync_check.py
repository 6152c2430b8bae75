"""Driver for tests/test_vllm_engine.py: under torchrun, train a tiny model a few steps with DeepSpeed
(ZeRO stage and LoRA from argv), push its weights into a vLLM engine on rank 0, and write the
trainer's and vLLM's log-probs of fixed sequences to a JSON file."""

import json
import sys

import torch

from common.infra.engine import (
    ModelArgs, TrainArgs, create_train_engine, deepspeed_config, finish, init_distributed, load_causal_lm,
    optimizer_step,
)
from common.logprobs import token_logps
from common.packing import collate
from common.infra.vllm_engine import EngineArgs, create_vllm_engine, vllm_sequence_logprobs
from common.infra.weight_sync import WeightSync

if __name__ == "__main__":
    model_path, zero_stage, lora_rank, out_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cuda = torch.cuda.is_available()  # CUDA: bf16 trainer and engine, bf16 sent; CPU: fp32 throughout
    train = TrainArgs(train_batch_size=2 * world, micro_train_batch_size=2, zero_stage=zero_stage, learning_rate=1e-2,
                      param_dtype="bf16" if cuda else "fp32")
    ds_config = deepspeed_config(train, world)
    model = load_causal_lm(ModelArgs(pretrain=model_path, lora_rank=lora_rank), ds_config)
    engine = create_train_engine(model, train, ds_config, num_training_steps=3)
    llm = create_vllm_engine(model_path, EngineArgs(max_model_len=128), bf16=cuda) if rank == 0 else None
    sync = WeightSync([llm] if llm else [], colocated=True)  # in-process: the trainer's device (CUDA: IPC)
    sequences = [[3, 100 + i, 101, 102, 103, 104, 105 + rank] for i in range(2)]
    for _ in range(3):  # a few real optimizer steps, so the weights differ from the checkpoint
        batch = collate([{"input_ids": s, "loss_mask": [1] * len(s)} for s in sequences], 0, max_tokens=64)
        logps, _ = token_logps(engine, batch)
        engine.backward(-(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
        optimizer_step(engine)
    fixed = [[3, 120, 121, 122, 123, 124, 125], [3, 130, 131, 132]]
    cached = vllm_sequence_logprobs(llm, fixed) if llm else None  # prefix cache holds the old weights' KV
    stats = sync.sync(engine)
    engine.eval()
    with torch.no_grad():  # every rank runs the forward (ZeRO-3 gathers across ranks)
        batch = collate([{"input_ids": s, "loss_mask": [1] * len(s)} for s in fixed], 0, max_tokens=64)
        logps, _ = token_logps(engine, batch)
    if rank == 0:
        trainer = [logps[r, s + 1 : s + n].tolist() for r, s, n in batch["spans"]]
        with open(out_file, "w") as f:
            json.dump({"stats": stats, "backend": llm.llm_engine.vllm_config.weight_transfer_config.backend,
                       "trainer": trainer, "vllm": vllm_sequence_logprobs(llm, fixed),
                       "vllm_before": cached}, f)
    torch.distributed.barrier()
    finish()  # exit without interpreter teardown (see common.infra.engine.finish)
