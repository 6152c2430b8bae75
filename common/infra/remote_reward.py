"""Trust tier: read the faces, trust the body.

Rewards from a Python file or over HTTP: one call shape for generate.py and the RL scripts (the server that
puts a reward function or rm.py reward models behind a URL is launch/reward_server.py).

    fn = make_reward_fn("launch/rewards/exact_match.py")            # or "http://host:5000" (+ token)
    rewards = fn(queries, prompts, labels)                          # float32 tensor, one per query

A reward file defines `reward_func(queries, prompts, labels)` (OpenRLHF's convention): queries are
prompt + response texts, prompts the prompt texts, labels the reference answers (or None). Over
HTTP the client POSTs {"queries": [...], "prompts": [...], "labels": [...]} with the header
`Authorization: Bearer <token>` and reads {"rewards": [...]}. Connection errors, timeouts, 429 and
5xx are retried with exponential backoff; a rejected token fails at once; nothing is ever replaced by
a zero reward. An empty batch is answered without calling the function (locally and by the server):
a cheap check that the file loads, or of the URL and token.

"""

import http.client
import importlib.util
import json
import os
import time
import urllib.error
import urllib.request

import torch

TOKEN_ENV = "MINRLHF_REWARD_TOKEN"


# ----------------------------------------------------------------------------------------------
# Reward files
# ----------------------------------------------------------------------------------------------
def load_reward_func(path, flag="--reward_func"):
    """The `reward_func` of a Python file, checked to exist and be callable; errors name `flag`."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")
    spec = importlib.util.spec_from_file_location("user_reward_func", path)
    if spec is None:
        raise ValueError(f"{flag} {path}: not a Python file (expected a .py file or an http(s):// URL)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "reward_func", None)):
        raise ValueError(f"{flag} {path} defines no function reward_func(queries, prompts, labels)")
    return module.reward_func


def check_rewards(rewards, num_queries, source):
    """`rewards` as a float32 tensor of shape (num_queries,), or a ValueError naming `source`."""
    try:
        out = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{source}: rewards must be numbers, got {type(rewards).__name__}: {e}") from e
    if out.numel() != num_queries:
        raise ValueError(f"{source}: returned {out.numel()} rewards for {num_queries} queries")
    bad = (~torch.isfinite(out)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"{source}: non-finite reward {out[bad[0]].item()} for query {bad[0]} "
                         f"({len(bad)} of {num_queries} non-finite)")
    return out


def _file_reward_fn(path, flag):
    func = load_reward_func(path, flag)

    def reward_fn(queries, prompts, labels):
        if not queries:
            return torch.zeros(0)
        try:
            rewards = func(queries, prompts, labels)
        except Exception as e:
            raise RuntimeError(f"reward_func in {path} raised {type(e).__name__}: {e}; "
                               f"{_first_failure(func, queries, prompts, labels)}") from e
        return check_rewards(rewards, len(queries), f"reward_func in {path}")

    return reward_fn


def _first_failure(func, queries, prompts, labels):
    """Which sample makes `func` raise, found by calling it on each sample alone."""
    for i, (q, p, label) in enumerate(zip(queries, prompts, labels)):
        try:
            func([q], [p], [label])
        except Exception as e:
            prompt = p[:200] + "..." if isinstance(p, str) and len(p) > 200 else p
            return f"first failing sample: index {i}, prompt {prompt!r}, label {label!r} ({type(e).__name__}: {e})"
    return f"no sample fails alone (the batch of {len(queries)} does)"


# ----------------------------------------------------------------------------------------------
# HTTP client
# ----------------------------------------------------------------------------------------------
def make_reward_fn(spec, token=None, timeout=60.0, retries=3, backoff=1.0, flag="--reward_func"):
    """fn(queries, prompts, labels) -> float32 tensor of shape (len(queries),).

    spec: an http(s):// URL of a reward server, or a .py file defining reward_func.
    token: bearer token for the server (default: the MINRLHF_REWARD_TOKEN environment variable).
    timeout: seconds one request may take. retries: how many times a failed request is repeated
    (connection error, timeout, 429, 5xx), waiting backoff x 2^k seconds before retry k + 1.
    flag: the command-line flag that gave `spec`, for error messages."""
    if not spec.lower().startswith(("http://", "https://")):
        return _file_reward_fn(spec, flag)
    token = token or os.environ.get(TOKEN_ENV) or None

    def reward_fn(queries, prompts, labels):
        body = json.dumps({"queries": list(queries), "prompts": list(prompts), "labels": list(labels)}).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        last_error = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(backoff * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(urllib.request.Request(spec, body, headers), timeout=timeout) as reply:
                    raw = reply.read()
            except urllib.error.HTTPError as e:
                message = _error_text(e)
                if e.code in (401, 403):
                    raise RuntimeError(f"reward server {spec} refused the request ({e.code}: {message}): "
                                       + ("the token was rejected" if token else "no token was sent")
                                       + f"; pass the server's token (--remote_rm_token or ${TOKEN_ENV})") from None
                if e.code != 429 and e.code < 500:  # the request itself is wrong: repeating it cannot help
                    raise RuntimeError(f"reward server {spec} answered {e.code}: {message}") from None
                last_error = f"HTTP {e.code}: {message}"
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out (URLError is an OSError)
                last_error = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            else:
                try:
                    rewards = json.loads(raw)["rewards"]
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(
                        f"reward server {spec}: reply is not JSON with a 'rewards' list: {raw[:200]!r}") from e
                return check_rewards(rewards, len(queries), f"reward server {spec}")
        raise RuntimeError(f"reward server {spec}: {retries + 1} attempts failed (timeout {timeout} s); "
                           f"last error: {last_error}")

    return reward_fn


def _error_text(error):
    try:
        return json.loads(error.read())["error"]
    except Exception:  # not our server's JSON: the status line says enough
        return error.reason
