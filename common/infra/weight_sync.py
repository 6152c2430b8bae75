"""Trust tier: read the faces, trust the body.

Weight sync: push the trainer's current weights into vLLM engines through vLLM's own
weight-transfer API (`vllm.distributed.weight_transfer`), so the handshake and the reload follow
vLLM across upgrades.

One control plane, three transports:
- CPU: `minrlhf_gloo`, defined here and registered with vLLM's factories (the vLLM worker
  imports this module as its `worker_extension_cls`, which registers it there too): a gloo group
  of trainer rank 0 and every engine worker, weights broadcast in buckets.
- CUDA, engines on their own devices: vLLM's `nccl` backend.
- CUDA, engines on the trainer's devices (colocated): vLLM's `ipc` backend (CUDA IPC handles).
The trainer side always runs `HFWeightSource` (ZeRO-3 gathered one layer at a time on every
rank, LoRA merged on the fly) and the same start / update / finish round trip on every engine
(`EngineClient`), which ends by resetting each engine's prefix cache.
"""

import contextlib
import datetime
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import (
    ParamMeta, TrainerWeightTransferEngine, WeightSource, WeightTransferEngine, WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo, WeightTransferUpdateInfo

from common.infra.engine import free_port

GLOO_BACKEND = "minrlhf_gloo"
# tests only (tests/test_failures_rl.py): the weight this names is sent negated, a sync broken on purpose
CORRUPT_WEIGHT_VARIABLE = "MINRLHF_TEST_CORRUPT_SYNC"
DTYPES = {str(t).split(".")[-1]: t for t in (torch.float32, torch.bfloat16, torch.float16)}


def weight_transfer_backend(colocated):
    """The transport for engines created now: gloo on CPU; on CUDA, IPC when the engine shares the
    trainer's devices, else NCCL. Engines and WeightSync must be given the same `colocated`."""
    if not torch.cuda.is_available():
        return GLOO_BACKEND
    return "ipc" if colocated else "nccl"


# ----------------------------------------------------------------------------------------------
# What the trainer sends: HF-named weights, gathered layer by layer, LoRA merged
# ----------------------------------------------------------------------------------------------
def _hf_name(name):
    """Parameter name as a plain HF checkpoint has it (peft wrappers stripped)."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def _gather(params):
    """Context that gathers ZeRO-3 partitioned parameters on every rank (a no-op otherwise)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


class HFWeightSource(WeightSource):
    """Every weight of `model` (a DeepSpeed engine or a module) under its HF name. Iterating
    gathers one layer at a time under ZeRO-3 (a collective: every trainer rank iterates) and folds
    LoRA adapters into their base weights (W + scaling * B @ A). Tensors yielded from a ZeRO-3
    gather are copies (the gathered storage goes when the layer is re-partitioned); others are the
    live parameters, valid until the next optimizer step."""

    def __init__(self, model=None, dtype=None):
        self.module = getattr(model, "module", model)
        self.dtype = dtype  # what the engines hold (bf16 engines beside fp32 CPU training): cast before sending

    def _layers(self):
        """(layer name, own parameters, LoRA adapters) for each layer that holds weights."""
        done = set()
        for name, layer in self.module.named_modules():
            if name in done or "lora_" in name:
                continue
            adapters = []
            if hasattr(layer, "lora_A") and hasattr(layer, "base_layer"):  # a peft LoRA layer
                done.add(f"{name}.base_layer")
                adapters = [(layer.lora_A[a].weight, layer.lora_B[a].weight,
                             layer.scaling[a]) for a in layer.active_adapters]
                layer = layer.base_layer
            params = dict(layer.named_parameters(recurse=False))
            packed = [n for n, p in params.items() if type(p).__name__ == "Params4bit"]
            if packed:  # common.infra.gpu.check_weight_sync_model refuses this before any model loads
                raise ValueError(f"weight sync: {name}.{packed[0]} is a packed 4-bit (QLoRA) weight, which vLLM "
                                 "cannot load; train LoRA on a bf16 base (drop --load_in_4bit)")
            if params:
                yield name, params, adapters

    def metadata(self):
        return [ParamMeta(_hf_name(f"{name}.{pname}"), self.dtype or p.dtype, tuple(getattr(p, "ds_shape", p.shape)))
                for name, params, _ in self._layers() for pname, p in params.items()]

    def __iter__(self):
        for name, params, adapters in self._layers():
            gathered = any(hasattr(p, "ds_id") for p in params.values())
            with _gather(list(params.values()) + [w for a, b, _ in adapters for w in (a, b)]):
                for pname, p in params.items():
                    t = p.data.detach()
                    if pname == "weight" and adapters:
                        t = (t.float() + sum(s * (b.data.float() @ a.data.float()) for a, b, s in adapters)).to(p.dtype)
                    elif gathered:
                        t = t.clone()
                    if _hf_name(f"{name}.{pname}") == os.environ.get(CORRUPT_WEIGHT_VARIABLE):
                        t = -t
                    yield _hf_name(f"{name}.{pname}"), t if self.dtype is None else t.to(self.dtype)


def _buckets(meta, bucket_bytes):
    """Split the parameter list into broadcasts of at most bucket_bytes (one dtype per bucket)."""
    buckets, size = [[]], 0
    for m in meta:
        nbytes = _numel(m.shape) * m.dtype.itemsize
        if buckets[-1] and (size + nbytes > bucket_bytes or m.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(m)
        size += nbytes
    return buckets


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# ----------------------------------------------------------------------------------------------
# The gloo transport (CPU): worker side and trainer side, registered with vLLM's factories
# ----------------------------------------------------------------------------------------------
def _gloo_group(host, port, world_size, rank, timeout_s, member_names=None):
    """A gloo group over a TCPStore that rank 0 hosts. Every wait in it (joining, each broadcast)
    ends after timeout_s; rank 0's error names the members (`member_names`) that did not join."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, wait_for_workers=False, timeout=timeout)
    store.set(f"joined/{rank}", "1")
    if rank == 0:
        deadline = time.time() + timeout_s
        missing = list(range(world_size))
        while missing:
            missing = [r for r in missing if not store.check([f"joined/{r}"])]
            if missing and time.time() > deadline:
                names = member_names or [f"rank {r}" for r in range(world_size)]
                raise TimeoutError(f"weight-sync group: {', '.join(names[r] for r in missing)} did not join "
                                   f"{host}:{port} within {timeout_s:.0f} s")
            time.sleep(0.05)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _broadcast_from_0(group, tensor):
    opts = dist.BroadcastOptions()  # ProcessGroupGloo.broadcast wants options, not a root int
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int  # group rank of this engine's first worker
    world_size: int
    timeout_s: float


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    buckets: list  # [[[name, dtype name, shape], ...], ...]: one broadcast per bucket, in order


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM worker side: receive each bucket and load it with the layerwise reload vLLM's own
    checkpoint-format backends use (initialised in start, finalised in finish)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    group = None

    def init_transfer_engine(self, init_info):
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.group = _gloo_group(init_info.master_address, init_info.master_port, init_info.world_size, rank,
                                 init_info.timeout_s)

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info):
        self.receive_weights(self.parse_update_info(update_info))  # the base class also syncs an accelerator

    def receive_weights(self, update_info):
        for bucket in update_info.buckets:
            flat = torch.empty(sum(_numel(shape) for _, _, shape in bucket), dtype=DTYPES[bucket[0][1]])
            _broadcast_from_0(self.group, flat)
            weights, offset = [], 0
            for name, _, shape in bucket:
                weights.append((name, flat[offset : offset + _numel(shape)].view(shape)))
                offset += _numel(shape)
            self.model.load_weights(weights)

    def shutdown(self):
        self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = GLOO_BACKEND
    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = 64 << 20
    timeout_s: float = 120.0
    tp_size: int = 1


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 broadcasts buckets while the engines receive them (their update RPC
    runs in a thread: both sides meet inside the same broadcasts); other ranks only iterate the
    source, to join its ZeRO-3 gathers."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.bucket_bytes, engine.group = init_info.bucket_bytes, None
        if engine.is_sender:
            worker_info = GlooInitInfo(init_info.master_address, init_info.master_port, 1, init_info.world_size,
                                       init_info.timeout_s)
            joining = _in_thread(client.init_weight_transfer_engine, asdict(worker_info))  # workers wait for rank 0
            tp = init_info.tp_size
            names = ["trainer rank 0"] + [f"vLLM engine {(r - 1) // tp} worker {(r - 1) % tp}"
                                          for r in range(1, init_info.world_size)]
            engine.group = _gloo_group(init_info.master_address, init_info.master_port, init_info.world_size, 0,
                                       init_info.timeout_s, names)
            joining.result()
        return engine

    def send_weights(self):
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        buckets = _buckets(self.source.metadata(), self.bucket_bytes)
        update = GlooUpdateInfo([[[m.name, str(m.dtype).split(".")[-1], list(m.shape)] for m in b] for b in buckets])
        self.client.start_weight_update()
        receiving = _in_thread(self.client.update_weights, asdict(update))
        weights = iter(self.source)
        for bucket in buckets:
            tensors = []
            for m in bucket:
                name, t = next(weights)
                if name != m.name or tuple(t.shape) != m.shape or t.dtype != m.dtype:
                    raise RuntimeError(f"weight sync: expected {m}, got {name} {t.dtype} {tuple(t.shape)}")
                tensors.append(t.reshape(-1).cpu())
            _broadcast_from_0(self.group, torch.cat(tensors))
        receiving.result()
        self.client.finish_weight_update()

    def shutdown(self):
        self.group = None


if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
    WeightTransferTrainerFactory.register_engine(GLOO_BACKEND, GlooTrainerWeightTransferEngine)


class WeightSyncWorker:
    """vLLM's `worker_extension_cls` (see create_vllm_engine): importing this module in the worker
    registers the gloo backend before the worker builds its weight-transfer engine. Also a raw
    broadcast over that group, for benchmarks/bench_sync.py."""

    def receive_raw(self, numel, repeats):
        flat = torch.empty(numel, dtype=torch.float32)
        for _ in range(repeats):
            _broadcast_from_0(self.weight_transfer_engine.group, flat)
        return numel


# ----------------------------------------------------------------------------------------------
# The control plane over our engines, and the trainer's entry point
# ----------------------------------------------------------------------------------------------
class EngineClient:
    """vLLM's VLLMWeightSyncClient protocol over our engines (in-process vllm.LLMs or VLLMActor
    handles): each call goes to every engine at once (their workers meet in the same broadcasts)
    and waits for all. Engine i's workers take group ranks after engine i-1's (vLLM's own NCCL
    backend assumes one engine)."""

    def __init__(self, engines, tp_size=1):
        self.engines, self.tp_size = engines, tp_size

    def _each(self, method, args_per_engine):
        if any(hasattr(e, "llm_call") for e in self.engines):  # VLLMActor handles
            import ray

            return ray.get([e.llm_call.remote(method, *a) for e, a in zip(self.engines, args_per_engine)])
        calls = [_in_thread(getattr(e, method), *a) for e, a in zip(self.engines, args_per_engine)]
        return [c.result() for c in calls]

    def init_weight_transfer_engine(self, init_info):
        if "rank_offset" in init_info:
            infos = [dict(init_info,
                          rank_offset=init_info["rank_offset"] + i * self.tp_size) for i in range(len(self.engines))]
        else:
            infos = [init_info] * len(self.engines)
        self._each("init_weight_transfer_engine", [({"init_info": i},) for i in infos])

    def start_weight_update(self):
        self._each("start_weight_update", [()] * len(self.engines))

    def update_weights(self, update_info):
        self._each("update_weights", [({"update_info": update_info},)] * len(self.engines))

    def finish_weight_update(self, weight_version=None):
        self._each("finish_weight_update", [()] * len(self.engines))
        self._each("reset_prefix_cache", [()] * len(self.engines))


class WeightSync:
    """Pushes the trainer's weights into vLLM engines (in-process LLMs or VLLMActor handles).
    Create and call `sync(model)` on every trainer rank (ZeRO-3 gathers need them all), with the
    engines on rank 0 and [] elsewhere; `colocated`, `tp_size` and `dtype` (None: the trainer's) as the engines
    were created (create_vllm_engine / create_vllm_actor): they pick the transport on CUDA, and fp32 weights
    go to bf16 engines as bf16 (half the bytes). On CPU every wait
    of the weight-sync group (members joining, each broadcast) ends after `timeout_s`."""

    def __init__(self, engines, *, colocated, tp_size=1, host="127.0.0.1", bucket_bytes=64 << 20, timeout_s=120.0,
                 dtype=None):
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        rank = dist.get_rank() if dist.is_initialized() else 0
        backend = weight_transfer_backend(colocated)
        port = free_port(host)
        world = 1 + len(engines) * tp_size
        if backend == GLOO_BACKEND:
            info = GlooTrainerInitInfo(host, port, world, bucket_bytes, timeout_s, tp_size, rank=rank)
        elif backend == "nccl":
            info = NCCLTrainerInitInfo(host, port, world, rank=rank)
        else:
            info = IPCTrainerInitInfo(rank=rank, packed=True)  # bounded memory: chunks through one buffer
        self.source = HFWeightSource(dtype=dtype)
        self.transfer = WeightTransferTrainerFactory.trainer_init(
            info, client=EngineClient(engines, tp_size), source=self.source)

    def sync(self, model):
        """Send every weight of `model` (a DeepSpeed engine or a module), reload it in every engine,
        reset their prefix caches. Returns {"tensors", "bytes", "seconds"} on every rank."""
        start = time.time()
        self.source.module = getattr(model, "module", model)
        self.transfer.send_weights()
        meta = self.source.metadata()
        return {"tensors": len(meta), "bytes": sum(_numel(m.shape) * m.dtype.itemsize for m in meta),
                "seconds": time.time() - start}


class _in_thread:
    """Run fn(*args) in a thread (a blocking RPC that must overlap the caller's collective)."""

    def __init__(self, fn, *args):
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self._result = fn(*args)
        except BaseException as e:  # re-raised in result()
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
