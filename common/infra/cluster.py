"""Trust tier: read the faces, trust the body.

The Ray side of the RL drivers (grpo.py, ppo.py): the checks of the flags they share, the step count, Ray start-up
and placement, vLLM engines and reward-model actors, the reward function, and the engines' share of a rollout's
prompts (the trainer ranks: common.infra.trainer_actor).
"""

import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Optional

import torch

from common.data import reward_model_ids
from common.infra.engine import ModelArgs, uses_bf16, validate_prompt_args
from common.infra.gpu import check_colocation, check_weight_sync_model
from common.infra.vllm_engine import resolve_max_model_len


@dataclass
class ClusterArgs:
    vllm_num_engines: Optional[int] = None
    """vLLM engines (each --vllm_tensor_parallel_size devices). Default: with --colocate_all_models one per
    trainer device; else 1 on CUDA or with --ray_address (the driver's cores and memory are not the cluster's); on
    CPU one per core (an engine's decode loop keeps one core busy, and the trainers wait while the engines
    generate; with --async_train the cores beside the trainer ranks), at most one per rollout prompt and as many
    as the memory available at start holds beside the trainers and reward models (default_num_engines)."""
    colocate_all_models: bool = False
    """Put every model of the run (trainers, reference, critic, vLLM engines, reward models) on the (actor)
    trainers' devices, one placement-group bundle each."""
    vllm_enable_sleep: bool = False
    """Sleep the vLLM engines while training (CUDA; a logged no-op on CPU)."""
    ray_address: Optional[str] = None
    """Join this Ray cluster (default: start a local Ray)."""
    startup_timeout: float = 900.0
    """Seconds every role (trainers, critic, vLLM engines, reward models) may take to load its models and start."""
    rendezvous_timeout: float = 120.0
    """Seconds a group set-up (trainer groups, weight sync) waits for its members; then it stops naming who did
    not join."""


def validate_rollout_args(args, world, script):
    """The checks of the flags every RL driver shares (world: actor trainer ranks; the script checked its ring
    flags first), pure: resolve_rollout_args then fills the derived settings and loads the files."""
    if args.model.aux_loss_coef > 0:
        raise ValueError(f"--aux_loss_coef (MoE load balancing) is not implemented in {script}")
    n = args.n_samples_per_prompt
    if n < 1:
        raise ValueError(f"--n_samples_per_prompt must be >= 1, got {n}")
    rollout = args.rollout_batch_size * n
    if rollout % args.train.train_batch_size:
        raise ValueError(f"--rollout_batch_size {args.rollout_batch_size} x --n_samples_per_prompt {n} = {rollout} "
                         f"samples must be a multiple of --train_batch_size {args.train.train_batch_size}")
    rings = world // args.ring.ring_attn_size  # the ranks of a ring share their samples (validate_ring_args)
    if rollout % (args.micro_rollout_batch_size * rings):
        raise ValueError(f"{rollout} samples per rollout must be a multiple of --micro_rollout_batch_size "
                         f"{args.micro_rollout_batch_size} x {rings} data-parallel trainer ranks (trainer ranks / "
                         f"--ring_attn_size)")
    if args.agent.agent_func_path:  # the opt-in episodes module, imported where --agent_func_path is set
        from common.episodes import validate_agent_args

        validate_agent_args(args)
    elif not (args.remote_rm_url or args.reward_pretrain):
        raise ValueError("no reward: give --remote_rm_url (a .py reward file or an HTTP URL), --reward_pretrain, "
                         "or an environment (--agent_func_path)")
    if args.engine.max_model_len is not None and args.engine.max_model_len < model_len_needed(args):
        episode = ""
        if args.agent.agent_func_path:
            from common.episodes import episode_tokens

            episode = f" and >= --max_episode_tokens {episode_tokens(args)}"
        raise ValueError(f"--max_model_len {args.engine.max_model_len} must be >= --prompt_max_len "
                         f"{args.prompt_max_len} + --generate_max_len {args.generate_max_len}" + episode)
    if args.overlong_buffer_len >= args.generate_max_len:
        raise ValueError(f"--overlong_buffer_len {args.overlong_buffer_len} must be < --generate_max_len")
    engines = args.cluster.vllm_num_engines
    if engines is not None and engines < 1:
        raise ValueError(f"--vllm_num_engines must be >= 1, got {engines}")
    if args.cluster.colocate_all_models and world % args.engine.tp_size:
        raise ValueError(f"--colocate_all_models puts one engine device on each trainer device: {world} trainer "
                         f"ranks are not a multiple of --vllm_tensor_parallel_size {args.engine.tp_size}")
    if args.cluster.colocate_all_models and engines is not None and engines * args.engine.tp_size != world:
        raise ValueError(f"--colocate_all_models puts one engine device on each trainer device: --vllm_num_engines "
                         f"x --vllm_tensor_parallel_size must equal {world} trainer ranks")
    if args.cluster.vllm_enable_sleep and not args.cluster.colocate_all_models:
        raise ValueError("--vllm_enable_sleep only helps with --colocate_all_models")
    check_colocation(args.cluster.colocate_all_models, args.engine.vllm_gpu_memory_utilization, args.engine.tp_size,
                     torch.cuda.is_available())  # common.infra.gpu: what a CUDA device cannot hold
    check_weight_sync_model(args.model.load_in_4bit, True, script)
    overlap = args.async_rollout
    if overlap.max_staleness < 0:
        raise ValueError(f"--max_staleness must be >= 0, got {overlap.max_staleness}")
    if overlap.async_train and args.cluster.vllm_enable_sleep:
        raise ValueError("--async_train generates while the trainer updates: the engines cannot sleep "
                         "(drop --vllm_enable_sleep)")
    validate_prompt_args(args)


def model_len_needed(args):
    """The longest sequence an RL run's engines hold: prompt and response, or a whole episode."""
    if not args.agent.agent_func_path:
        return args.prompt_max_len + args.generate_max_len
    from common.episodes import episode_tokens

    return max(args.prompt_max_len + args.generate_max_len, episode_tokens(args))


def resolve_rollout_args(args, world, trainer_copies, trainer_ranks=None):
    """The one step after validate_rollout_args that reads files and fills derived settings: the --remote_rm_url
    reward file and the --agent_func_path environment are loaded (a missing file or function fails now, not after
    the models load), --max_episode_tokens, --max_model_len (from the model's config) and --vllm_num_engines
    (default_num_engines, with `trainer_copies` and `trainer_ranks` as it takes them; trainer_ranks None: the
    `world` trainer ranks) are filled, and --temperature != 1 and --top_p < 1 are warned about. Returns a copy of
    args with those filled."""
    if args.remote_rm_url and not args.remote_rm_url.startswith(("http://", "https://")):
        from common.infra.remote_reward import load_reward_func

        load_reward_func(args.remote_rm_url, "--remote_rm_url")
    agent = args.agent
    if agent.agent_func_path:
        from common.episodes import episode_tokens, load_env

        load_env(agent.agent_func_path)
        agent = replace(agent, max_episode_tokens=episode_tokens(args))
    engine = replace(args.engine, max_model_len=resolve_max_model_len(args.model.pretrain, args.engine.max_model_len,
                                                                      model_len_needed(args)))
    if args.temperature != 1:
        print(f"warning: --temperature {args.temperature}: the update reads the untempered policy's log-probs, so it "
              "trains on samples of another distribution, uncorrected", file=sys.stderr)
    if args.top_p < 1:
        print(f"warning: --top_p {args.top_p}: the update reads the whole policy's log-probs (vLLM's too), not the "
              "nucleus the samples were drawn from, so it trains on samples of another distribution, uncorrected",
              file=sys.stderr)
    args = replace(args, agent=agent, engine=engine)
    if args.cluster.vllm_num_engines is None:
        engines, warning = default_num_engines(args, world, trainer_copies, trainer_ranks or world,
                                               len(os.sched_getaffinity(0)), available_memory())
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        args = replace(args, cluster=replace(args.cluster, vllm_num_engines=engines))
    return args


# one CPU engine's process beside its weights and KV cache: a Ray actor with torch and vLLM loaded, tp 1 (the
# engine in-process). benchmarks/bench_engine_memory.py on llama-0.5m after a generation: RSS 816 MiB, of it
# 18 MiB weights and KV cache and 508 MiB the process's own pages (USS), the rest shared libraries
ENGINE_PROCESS_BYTES = 800 << 20


def default_num_engines(args, world, trainer_copies, trainer_ranks, cores, memory):
    """--vllm_num_engines unset (after resolve_max_model_len), and a warning or None: one engine per trainer device
    with --colocate_all_models; 1 with --ray_address (this driver's `cores` and `memory` are not the cluster's
    nodes': a note says so) and on CUDA; on CPU one per core the engines may take of `cores` (all of them, as the
    trainers wait while the engines generate; those beside the `trainer_ranks` ranks that compute while they
    generate with --async_train), at most one per rollout prompt, and no more than `memory` bytes hold once the
    trainers have their `trainer_copies` fp32 copies of the policy's weights (4 per training rank: weights,
    gradients, two AdamW moments; 1 per frozen replica) and every --reward_pretrain model its fp32 weights, each
    engine holding its weights, the KV cache of its share (engine_max_num_seqs, vllm_engine.kv_cache_bytes) and
    its process (ENGINE_PROCESS_BYTES). Where even one engine does not fit, the warning names the sizes."""
    from common.infra.vllm_engine import kv_cache_bytes, weight_bytes

    if args.cluster.colocate_all_models:
        return world // args.engine.tp_size, None
    if args.cluster.ray_address:
        return 1, ("--vllm_num_engines unset with --ray_address: 1 engine (this driver's cores and memory say "
                   "nothing of the cluster's nodes); set --vllm_num_engines to use more")
    if torch.cuda.is_available():
        return 1, None
    cores = cores - (trainer_ranks if args.async_rollout.async_train else 0)
    bf16 = uses_bf16(args.train)  # on CPU the trainers keep fp32 weights either way
    bf16_weights = weight_bytes(args.model.pretrain)
    taken = 2 * bf16_weights * trainer_copies + sum(2 * weight_bytes(p) for p in (args.reward_pretrain or "").split(",")
                                                    if p)

    def need(engines):
        kv = kv_cache_bytes(args.model.pretrain, args.engine.max_model_len, engine_max_num_seqs(args, engines),
                            dtype_bytes=2 if bf16 else 4)
        return engines * (bf16_weights * (1 if bf16 else 2) + kv + ENGINE_PROCESS_BYTES)

    for engines in range(max(1, min(cores, args.rollout_batch_size)), 0, -1):  # the most that fit
        if need(engines) <= memory - taken:
            return engines, None
    return 1, (f"one vLLM engine needs {need(1) / 2**30:.2f} GiB ({'bf16' if bf16 else 'fp32'} weights, the KV cache "
               f"of {engine_max_num_seqs(args, 1)} sequences of --max_model_len {args.engine.max_model_len}, its "
               f"process) beside the trainers' and frozen models' {taken / 2**30:.2f} GiB, and this machine has "
               f"{memory / 2**30:.2f} GiB available: expect swapping or the OOM killer; lower --max_model_len or "
               "--rollout_batch_size, or run on a machine with more memory")


def engine_max_num_seqs(args, engines):
    """Sequences one of `engines` engines holds at once: every sample of its share of a rollout's prompts, or of an
    evaluation round's."""
    from common.infra.vllm_engine import default_max_num_seqs

    per_engine = math.ceil(args.rollout_batch_size / engines)
    return default_max_num_seqs(per_engine * max(args.n_samples_per_prompt, args.eval_n_samples_per_prompt))


def available_memory():
    """Bytes of memory this machine can give without swapping (Linux MemAvailable; else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def rollout_steps(args, num_prompts):
    """(rollout steps of the run, rollout steps per pass over the prompts)."""
    total_steps = args.num_episodes * num_prompts // args.rollout_batch_size
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)
    if total_steps < 1:
        raise ValueError(f"{num_prompts} prompts x --num_episodes {args.num_episodes} is fewer than one "
                         f"--rollout_batch_size {args.rollout_batch_size}")
    return total_steps, max(num_prompts // args.rollout_batch_size, 1)


def start_ray(args, num_roles):
    """Join --ray_address, or start a local Ray with a logical CPU for every role even on a 2-core machine.
    The workers import common/ from the checkout this one came from, wherever the script lives."""
    import ray

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    if args.cluster.ray_address:
        ray.init(address=args.cluster.ray_address, runtime_env={"env_vars": {"PYTHONPATH": path}})
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, num_roles), include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}})


def trainer_bundles(roles, num_nodes, per_node, gpu, timeout_s, name):
    """A placement group of num_nodes x per_node bundles (one per trainer rank), rank r on node r // per_node
    (PACK alone may fill one node: a STRICT_SPREAD probe picks distinct nodes, then each bundle is pinned);
    returns bundle index -> scheduling strategy."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle, world = ({"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}), num_nodes * per_node
    selectors = None
    if num_nodes > 1:
        probe = placement_group([{k: v * per_node for k, v in bundle.items()}] * num_nodes, strategy="STRICT_SPREAD")
        roles.get(probe.ready(), timeout_s=timeout_s)
        node_ids = placement_group_table(probe)["bundles_to_node_id"]
        remove_placement_group(probe)
        selectors = [{"ray.io/node-id": node_ids[r // per_node]} for r in range(world)]
        print(f"{name} group: {world} ranks on {num_nodes} nodes, {per_node} per node")
    pg = placement_group([bundle] * world, strategy="PACK", bundle_label_selector=selectors)
    roles.get(pg.ready(), timeout_s=timeout_s)
    return lambda i: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)


def reference_args(args):
    """The frozen reference model (--init_kl_coef > 0): the start policy, loaded as the policy is (attention
    kernel, 4-bit)."""
    return ModelArgs(pretrain=args.model.pretrain, attn_implementation=args.model.attn_implementation,
                     load_in_4bit=args.model.load_in_4bit)


def start_engines(args, roles, cpus, gpus, at=None):
    """The --vllm_num_engines engine actors (each --vllm_tensor_parallel_size devices; colocated with `at`: engine
    i in trainer rank i x tp size's bundle), added to `roles`."""
    from common.infra.vllm_engine import create_vllm_actor

    max_num_seqs = engine_max_num_seqs(args, args.cluster.vllm_num_engines)
    return [roles.add(f"vLLM engine {i}", create_vllm_actor(
                args.model.pretrain, args.engine, num_cpus=cpus, num_gpus=gpus * args.engine.tp_size,
                enable_sleep=args.cluster.vllm_enable_sleep, colocated=at is not None, max_num_seqs=max_num_seqs,
                bf16=uses_bf16(args.train),
                options={"scheduling_strategy": at(i * args.engine.tp_size)} if at else {}))
            for i in range(args.cluster.vllm_num_engines)]


def start_reward_models(args, roles, cpus, gpus, strategy=None):
    """The --reward_pretrain models in one actor (on `strategy`'s bundle when colocated), or None."""
    from common.infra.roles import actor_class

    if not args.reward_pretrain:
        return None
    return roles.add("reward models", actor_class(RewardModels).options(
        num_cpus=cpus, num_gpus=gpus, **({"scheduling_strategy": strategy} if strategy else {})).remote(
        [p for p in args.reward_pretrain.split(",") if p], args.normalize_reward, args.apply_chat_template))


class RewardModels:
    """Reward models from rm.py in their own Ray actor: one summed score per prompt and response text."""

    def __init__(self, paths, normalize, apply_chat_template):
        from common.infra.engine import device
        from common.infra.reward import load_reward_models

        (self.models, self.tokenizer), self.normalize = load_reward_models(paths, device()), normalize
        self.apply_chat_template = apply_chat_template

    def score(self, prompt_texts, responses):
        from common.infra.reward import score

        chat = self.apply_chat_template
        ids = [reward_model_ids(self.tokenizer, p, r, chat) for p, r in zip(prompt_texts, responses)]
        return score(self.models, ids, normalize=self.normalize).tolist()


def reward_function(args):
    """--remote_rm_url as a function, checked on an empty batch (the URL and token, or the file) before any
    model starts; None without it."""
    if not args.remote_rm_url:
        return None
    from common.infra.remote_reward import make_reward_fn

    reward_fn = make_reward_fn(args.remote_rm_url, token=args.remote_rm_token, flag="--remote_rm_url")
    reward_fn([], [], [])
    return reward_fn


def generate(roles, engines, prompt_ids, sampling, seeds, timeout_s):
    """Split the tokenized prompts over the engines; one list of Sample per prompt, in order. `sampling`: one
    SamplingArgs, or one per prompt; `seeds`: one per prompt, or None (then each SamplingArgs carries its own)."""
    per = math.ceil(len(prompt_ids) / len(engines))
    futures = [e.generate.remote(prompt_ids[i * per : (i + 1) * per],
                                 sampling[i * per : (i + 1) * per] if isinstance(sampling, list) else sampling,
                                 seeds and seeds[i * per : (i + 1) * per])
               for i, e in enumerate(engines) if prompt_ids[i * per : (i + 1) * per]]
    return [group for chunk in roles.get(futures, timeout_s, "vLLM engines (generating)") for group in chunk]


def environment(args):
    """The Env class of --agent_func_path, or None."""
    if not args.agent.agent_func_path:
        return None
    from common.episodes import load_env

    return load_env(args.agent.agent_func_path)


