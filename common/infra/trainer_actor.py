"""Trust tier: read the faces, trust the body.

The trainer ranks of the RL drivers (grpo.py's trainers; ppo.py's actor, critic and reference ranks): one Ray actor
per rank, a group's ranks one torch.distributed group running DeepSpeed. A rank loads its model, runs per-token
forwards, trains optimizer steps, syncs weights into the vLLM engines, saves checkpoints and exports. The algorithm is
the script's, passed in a TrainerSpec (RL2's split): the micro-batch loss, the step's normalisers, which samples a
micro-batch holds. Functions of a script run as `__main__` (a copied one too) reach the workers pickled by value.
"""

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray
import torch

from common.infra.datasets import load_tokenizer
from common.infra.engine import (
    ModelArgs, TrainArgs, accumulation_steps, all_reduce_sum, backward_step, device, free_port, frozen_engine,
    init_distributed, load_checkpoint, save_checkpoint, save_hf_model, setup, train_engine, uses_bf16,
)
from common.infra.roles import actor_class
from common.packing import collate, to_device, unpack
from common.logprobs import model_settings, token_logps
from common.rollout import make_batch


def next_token_logps(model, batch, args, ring):
    """The default per-token forward: the log-probs of each next token."""
    return token_logps(model, batch, ring=ring)[0]


@dataclass
class TrainerSpec:
    """What a trainer group's ranks load, what their forward fills in, and how they train."""

    model: ModelArgs  # the model the ranks load
    output: str  # the per-response-token key its forward fills: "old_logps", "ref_logps", "values"
    train: Optional[TrainArgs] = None  # None: frozen (DeepSpeed inference)
    forward: Callable = next_token_logps  # (model, batch, args, ring) -> per-token tensor, aligned like loss_mask
    reference: Optional[ModelArgs] = None  # a frozen model in the same ranks whose forward fills "ref_logps"
    # (model, batch, args, ring) -> (loss sum, {metric: sum}); the step reports a metric named *_max as its maximum,
    # *_sequences divided by the samples that ran, any other divided by the metrics' normaliser
    loss: Optional[Callable] = None
    normalisers: Optional[Callable] = None  # (args, counts) -> (the step's loss divisor, its metrics')
    micro_batches: Optional[Callable] = None  # (samples, micro, args) -> (micro-batches, skipped); None: in order
    values: tuple = ()  # the per-response-token values a training micro-batch carries
    extra_loss: Optional[Callable] = None  # (model, extra batch, args, ring) -> (a mean per micro-batch, {metric})
    ckpt_dir: str = ""
    share_prompts: bool = False  # a prompt's samples share its tokens in the row (make_batch), where the kernel can
    offload_states: bool = False  # --deepspeed_enable_sleep: sleep() moves the DeepSpeed states off the device
    load_kwargs: dict = field(default_factory=dict)  # load_causal_lm's (a value model's class and head)


def start_ranks(roles, name, args, spec, world, pad_id, ranks_per_node, cpus, gpus, at):
    """`world` TrainerRank actors, rank r on bundle at(r) with cpus/gpus of it, added to `roles` as '<name> rank r'."""
    return [roles.add(f"{name} rank {r}", actor_class(TrainerRank).options(
                num_cpus=cpus, num_gpus=gpus, scheduling_strategy=at(r)).remote(
                args, spec, r, world, pad_id, ranks_per_node)) for r in range(world)]


def start_group(roles, members, *setup_args):
    """Start every member's setup(addr, port, *setup_args), rendezvous at rank 0; returns the refs to wait on."""
    if not members:
        return []
    addr, port = roles.get(members[0].address.remote())
    return [m.setup.remote(addr, port, *setup_args) for m in members]


def each_ring(members, method, ring_size, per_ring, *same):
    """Start `method(per_ring[r // ring_size], *same)` on every rank r (rank r is in ring r // ring_size); the refs."""
    return [getattr(m, method).remote(per_ring[r // ring_size], *same) for r, m in enumerate(members)]


def per_token(roles, samples, jobs, ring_size):
    """Each group's forward of its keys (jobs: [(ranks, keys)], all started at once, each ring its contiguous shard
    of `samples`, its first rank answering), written into the TrainingSamples' fields of those names."""
    refs = []
    for members, keys in jobs:
        shard = len(samples) // max(len(members) // ring_size, 1)
        shards = [samples[i : i + shard] for i in range(0, len(samples), shard)]
        refs.append(each_ring(members, "forward", ring_size, shards, keys) if members and keys else [])
    for outs in map(roles.get, refs):
        for key in outs[0] if outs else []:
            for s, v in zip(samples, [x for out in outs[::ring_size] for x in out[key]]):
                setattr(s, key, v)


class TrainerRank:
    """One rank of a trainer group, a Ray actor (start_ranks); its TrainerSpec says what it loads and how it trains."""

    def __init__(self, args, spec: TrainerSpec, rank, world, pad_id, ranks_per_node):
        self.args, self.spec, self.rank, self.world, self.pad_id = args, spec, rank, world, pad_id
        self.ranks_per_node, self.asleep = ranks_per_node, False

    def address(self):
        """This node's address and a free port, for the group's rendezvous (asked of its rank 0)."""
        return ray.util.get_node_ip_address(), free_port("")

    def setup(self, master_addr, master_port, num_training_steps=None):
        """Join the group (bounded by --rendezvous_timeout), its rings, and load the models."""
        args, spec = self.args, self.spec
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        init_distributed(timeout_s=args.cluster.rendezvous_timeout)
        if not torch.cuda.is_available():  # Ray gives an actor num_cpus threads: take the node's cores / its ranks
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.ranks_per_node))
        placement = setup(args.ring, args.train.seed)  # the group joined above; its rings; every generator seeded
        self.ring = placement.ring  # None without --ring_attn_size
        if spec.train is None:
            self.engine = frozen_engine(spec.model, args.train, placement, **spec.load_kwargs)
        else:
            self.engine = train_engine(spec.model, spec.train, num_training_steps, placement,
                                       offload_states=spec.offload_states, **spec.load_kwargs)
        self.models = {spec.output: (self.engine, spec.forward)}
        if spec.reference is not None:
            self.models["ref_logps"] = (frozen_engine(spec.reference, args.train, placement), next_token_logps)
        return True

    def setup_weight_sync(self, engines):
        """Rank 0 sends the weights to `engines`; the other ranks take part in the gathers."""
        from common.infra.weight_sync import WeightSync

        args = self.args
        self.weight_sync = WeightSync(engines if self.rank == 0 else [], colocated=args.cluster.colocate_all_models,
                                      tp_size=args.engine.tp_size, host=ray.util.get_node_ip_address(),
                                      timeout_s=args.cluster.rendezvous_timeout,
                                      dtype=torch.bfloat16 if uses_bf16(args.train) else None)
        return True

    def sync_weights(self):
        self._wake()
        return self.weight_sync.sync(self.engine)

    def sleep(self):
        """This rank's DeepSpeed states off the device until a method needs them."""
        if not self.asleep:
            self.engine.offload_states(pin_memory=torch.cuda.is_available())
        self.asleep = True
        return True

    def _wake(self):
        if self.asleep:
            self.engine.reload_states()
        self.asleep = False

    def _max_tokens(self, samples):
        """Packed row length: the longest sample the run can produce (and at least this batch's longest)."""
        args = self.args
        longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        return max(longest, args.prompt_max_len + args.generate_max_len, args.agent.max_episode_tokens or 0)

    def _batch(self, samples, max_tokens, values=()):
        layout = model_settings(self.engine).layout
        share = self.spec.share_prompts and layout.share_prefixes
        return to_device(make_batch(samples, self.pad_id, max_tokens, layout.one_row, values, share), device())

    @torch.no_grad()
    def forward(self, samples, keys):
        """{key: per-response-token values of each sample} for each of `keys` (a key of this rank's models), over
        micro-batches of --micro_rollout_batch_size."""
        self._wake()
        was_training, out = self.engine.training, {key: [] for key in keys}
        self.engine.eval()
        micro, max_tokens = self.args.micro_rollout_batch_size, self._max_tokens(samples)
        for start in range(0, len(samples), micro):
            batch = self._batch(samples[start : start + micro], max_tokens)
            for key in keys:
                model, forward = self.models[key]
                per_sample = unpack(forward(model, batch, self.args, self.ring), batch)
                out[key] += [t[p:].float().cpu().clone() for p, t in zip(batch["response_offsets"], per_sample)]
        self.engine.train(was_training)
        return out

    def train(self, steps, extra_steps=None):
        """steps: this rank's samples of each optimizer step (extra_steps: as many rows of each for the spec's
        extra_loss, PPO-ptx's pretraining text). Returns the step-averaged metrics (rank 0)."""
        self._wake()
        args, spec, engine, t0 = self.args, self.spec, self.engine, time.time()
        micro, ring_size = args.train.micro_train_batch_size, args.ring.ring_attn_size
        micro_count = accumulation_steps(args.train.train_batch_size, micro, self.world // ring_size) * self.world
        totals, grad_norms, lrs, maxima = {}, [], [], {}
        for k, samples in enumerate(steps):
            max_tokens = self._max_tokens(samples)
            chunks, skipped = (spec.micro_batches(samples, micro, args) if spec.micro_batches
                               else ([samples[i : i + micro] for i in range(0, len(samples), micro)], 0))
            batches = [self._batch(chunk, max_tokens, spec.values) for chunk in chunks]
            extras = [to_device(collate(extra_steps[k][i : i + micro], self.pad_id, max_tokens=max_tokens,
                                        one_row=model_settings(engine).layout.one_row), device())
                      for i in range(0, len(samples), micro)] if extra_steps else [None] * len(batches)
            # counted on every rank: the ranks of a ring count their samples ring-size times, as DeepSpeed counts
            # them (common.infra.engine.deepspeed_config), and the loss is the ring's ring-size times. The loss
            # normaliser counts skipped samples too; the metrics' counts only what ran
            counts = dict(zip(("tokens", "sequences", "run_tokens", "run_sequences", "skipped"), all_reduce_sum([
                sum(int(s.loss_tokens().sum()) for s in samples), sum(not s.masked for s in samples),
                sum(b["loss_mask"].sum().item() for b in batches),
                sum(not s.masked for chunk in chunks for s in chunk), skipped / ring_size])))
            normaliser, metric_normaliser = spec.normalisers(args, counts)
            lrs.append(engine.get_lr()[0])
            sums, means = {}, {}
            for batch, extra in zip(batches, extras):
                loss_sum, metrics = spec.loss(engine, batch, args, self.ring)
                averaged = 0.0
                if extra is not None:  # a mean per micro-batch: DeepSpeed's averaging keeps it right
                    averaged, extra_metrics = spec.extra_loss(engine, extra, args, self.ring)
                    for name, v in extra_metrics.items():
                        means[name] = means.get(name, 0.0) + v / micro_count
                grad_norm = backward_step(engine, loss_sum, normaliser, averaged)
                for name in [name for name in metrics if name.endswith("_max")]:
                    maxima[name] = max(maxima.get(name, 0.0), metrics.pop(name))
                for name, v in metrics.items():
                    sums[name] = sums.get(name, 0.0) + v
            reduced = all_reduce_sum(list(sums.values()) + list(means.values()))
            for name, v in zip(sums, reduced):
                divisor = max(counts["run_sequences"], 1) if name.endswith("_sequences") else metric_normaliser
                totals[name] = totals.get(name, 0.0) + v / divisor / len(steps)
            for name, v in zip(means, reduced[len(sums):]):
                totals[name] = totals.get(name, 0.0) + v / len(steps)
            if spec.micro_batches:
                totals["skipped_samples"] = totals.get("skipped_samples", 0.0) + counts["skipped"] / len(steps)
            grad_norms.append(grad_norm)
        totals["grad_norm"] = sum(grad_norms) / len(grad_norms)
        totals["lr"] = sum(lrs) / len(lrs)
        if maxima:  # every rank runs the same loss, so the same names
            reduced = torch.tensor(list(maxima.values()), device=device())
            torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
            totals.update(zip(maxima, reduced.tolist()))
        totals["time_s"] = time.time() - t0
        return totals

    def checkpoint(self, step, client_state):
        self._wake()
        save_checkpoint(self.engine, self.spec.ckpt_dir, step, client_state, self.args.ckpt.max_ckpt_num)
        return True

    def restore(self, step=None):
        """Load `latest`, or the checkpoint of `step` (ppo.py's critic, which saves first: its `latest` may be ahead
        of the actor's, the commit point)."""
        if step is not None:
            tag = os.path.join(self.spec.ckpt_dir, f"global_step{step}")
            if not os.path.isdir(tag):
                raise RuntimeError(f"the actor resumes at step {step} but {tag} does not exist")
            if self.rank == 0:
                with open(os.path.join(self.spec.ckpt_dir, "latest"), "w") as f:
                    f.write(f"global_step{step}")
            torch.distributed.barrier()
        return load_checkpoint(self.engine, self.spec.ckpt_dir)

    def save_model(self, path):
        """A Hugging Face directory of the trained model (a value model as rm.py exports one), with the policy's
        tokenizer."""
        self._wake()
        tokenizer = load_tokenizer(self.args.model.pretrain, self.args)
        save_hf_model(self.engine, tokenizer, path, merge_lora=self.args.ckpt.merge_lora,
                      base_path=self.spec.model.pretrain)
        return True
