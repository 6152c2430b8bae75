"""Rewards from a Python file or over HTTP: one call shape for generate.py and the RL scripts, and a
small server that puts a reward function or rm.py reward models behind a URL.

    fn = make_reward_fn("launch/rewards/exact_match.py")            # or "http://host:5000" (+ token)
    rewards = fn(queries, prompts, labels)                          # float32 tensor, one per query

A reward file defines `reward_func(queries, prompts, labels)` (OpenRLHF's convention): queries are
prompt + response texts, prompts the prompt texts, labels the reference answers (or None). Over
HTTP the client POSTs {"queries": [...], "prompts": [...], "labels": [...]} with the header
`Authorization: Bearer <token>` and reads {"rewards": [...]}. Connection errors, timeouts, 429 and
5xx are retried with exponential backoff; a rejected token fails at once; nothing is ever replaced by
a zero reward. An empty batch is answered without calling the function (locally and by the server):
a cheap check that the file loads, or of the URL and token.

    python -m common.remote_reward --reward_func launch/rewards/exact_match.py --port 5000
    python -m common.remote_reward --reward_pretrain outputs/rm --normalize_reward --port 5000
"""

import http.client
import importlib.util
import json
import os
import secrets
import socket
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

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


# ----------------------------------------------------------------------------------------------
# HTTP server
# ----------------------------------------------------------------------------------------------
class RewardServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer answering reward requests; `.url`, `.shutdown()`."""

    daemon_threads = True

    def __init__(self, reward_fn, host, port, token):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _RewardHandler)
        self.reward_fn, self.token = reward_fn, token
        self.lock = threading.Lock()  # models and user functions need not be thread-safe: one batch at a time
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def shutdown(self):
        super().shutdown()
        self.server_close()


class _RewardHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        server = self.server
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return self._reply(400, {"error": "bad Content-Length"})
        given = self.headers.get("Authorization", "")
        if server.token and not secrets.compare_digest(given.encode(), f"Bearer {server.token}".encode()):
            while length > 0:  # drain the body: closing on unread data resets the connection before the 401 arrives
                chunk = self.rfile.read(min(length, 1 << 16))
                length = length - len(chunk) if chunk else 0
            return self._reply(401, {"error": "missing bearer token" if not given else "wrong bearer token"})
        try:
            request = json.loads(self.rfile.read(length))
            queries = request["queries"] if "queries" in request else request["query"]  # "query": OpenRLHF's clients
            prompts, labels = request.get("prompts"), request.get("labels")
            prompts = [None] * len(queries) if prompts is None else prompts
            labels = [None] * len(queries) if labels is None else labels
            if not (isinstance(queries, list) and isinstance(prompts, list) and isinstance(labels, list)
                    and len(queries) == len(prompts) == len(labels)):
                raise ValueError("queries, prompts and labels must be lists of equal length")
        except (ValueError, KeyError, TypeError) as e:
            return self._reply(400, {"error": f"bad request: {type(e).__name__}: {e}"})
        if not queries:
            return self._reply(200, {"rewards": []})
        try:
            with server.lock:
                rewards = check_rewards(server.reward_fn(queries, prompts, labels), len(queries), "reward function")
        except Exception as e:
            traceback.print_exc()
            return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
        self._reply(200, {"rewards": rewards.tolist()})

    def _reply(self, code, payload):
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(body)

    def log_request(self, code="-", size="-"):
        if isinstance(code, int) and code >= 400:  # successes would flood the log at one line per batch
            super().log_request(code, size)


def serve_rewards(reward_fn, host="127.0.0.1", port=0, token=None, allow_no_auth=False):
    """Serve `reward_fn(queries, prompts, labels)` over HTTP from a daemon thread; returns the started
    RewardServer (`.url`, `.shutdown()`). Requests without `Authorization: Bearer <token>` get 401,
    malformed JSON 400, an error of reward_fn 500 with its message. port 0: any free port."""
    if not token and not allow_no_auth:
        raise ValueError("serve_rewards needs a token (or allow_no_auth=True to serve anyone who can connect)")
    server = RewardServer(reward_fn, host, port, token)
    server.thread.start()
    return server


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
@dataclass
class ServeArgs:
    reward_func: Optional[str] = None
    """A Python file defining reward_func(queries, prompts, labels) to serve."""
    reward_pretrain: Optional[str] = None
    """Comma list of reward models (rm.py exports) to serve, rewards summed; the tokenizer is the first's.
    Queries are scored as sent: send the full text the model was trained on (chat template included)."""
    normalize_reward: bool = False
    """With --reward_pretrain: normalise each model's output with the mean/std rm.py stored in its config."""
    host: str = "127.0.0.1"
    """Address to bind (loopback by default; the traffic is plain HTTP, token included)."""
    port: int = 5000
    """Port to listen on (0: any free port)."""
    token: Optional[str] = None
    """Bearer token clients must send (default: $MINRLHF_REWARD_TOKEN, else a new random one, printed)."""


def reward_fn_from_args(args: ServeArgs):
    if (args.reward_func is None) == (args.reward_pretrain is None):
        raise ValueError("give exactly one of --reward_func and --reward_pretrain")
    if args.normalize_reward and not args.reward_pretrain:
        raise ValueError("--normalize_reward applies to --reward_pretrain only")
    if args.reward_func:
        return _file_reward_fn(args.reward_func, "--reward_func")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.reward import score

    paths = [p for p in args.reward_pretrain.split(",") if p]
    models = [AutoModelForSequenceClassification.from_pretrained(p).eval() for p in paths]
    tokenizer = AutoTokenizer.from_pretrained(paths[0])
    return lambda queries, prompts, labels: score(models, queries, tokenizer, normalize=args.normalize_reward)


def main(argv=None):
    import tyro

    args = tyro.cli(ServeArgs, args=argv, use_underscores=True, description=__doc__)
    try:
        reward_fn = reward_fn_from_args(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    token = args.token or os.environ.get(TOKEN_ENV)
    server = serve_rewards(reward_fn, args.host, args.port, token=token or secrets.token_urlsafe(32))
    print(f"serving rewards at {server.url}", flush=True)
    if not token:
        print(f"token: {server.token}  (clients: --remote_rm_token or {TOKEN_ENV})", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host} over plain HTTP: the token travels unencrypted", flush=True)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
