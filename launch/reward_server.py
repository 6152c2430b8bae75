"""A reward server: a reward function file or rm.py reward models behind a URL, for --remote_rm_url.

    python -m launch.reward_server --reward_func launch/rewards/exact_match.py --port 5000
    python -m launch.reward_server --reward_pretrain outputs/rm --normalize_reward --port 5000

Standard library only (plus torch for the rewards). Requests are POSTs of {"queries", "prompts", "labels"} with
`Authorization: Bearer <token>`; the answer is {"rewards": [...]} (common/infra/remote_reward.py is the client).

Many clients at once (several runs sharing one server): the listen backlog holds 1,024 pending connections. A
request without the token is answered 401 at once, and one whose Content-Length exceeds --max_request_bytes 413,
both before the body is read; the body is then read and dropped (at most --max_request_bytes of it for a client
without the token) so that a client still sending reads the answer, not a reset. Every read waits at most
--read_timeout seconds.
"""

import json
import os
import secrets
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from common.infra.remote_reward import TOKEN_ENV, _file_reward_fn, check_rewards

MAX_REQUEST_BYTES = 1 << 30  # 8,192 queries of 16k tokens' text, sent with their prompts, are ~0.5 GB


# ----------------------------------------------------------------------------------------------
# HTTP server
# ----------------------------------------------------------------------------------------------
class RewardServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer answering reward requests; `.url`, `.shutdown()`."""

    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: the standard library's 5 resets clients that connect together

    def __init__(self, reward_fn, host, port, token, max_request_bytes=MAX_REQUEST_BYTES, read_timeout=60.0):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _RewardHandler)
        self.reward_fn, self.token = reward_fn, token
        self.max_request_bytes, self.read_timeout = max_request_bytes, read_timeout
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
    def setup(self):
        self.timeout = self.server.read_timeout  # a read that waits longer ends the connection (TimeoutError)
        super().setup()

    def do_POST(self):
        server = self.server
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0:
                raise ValueError
        except ValueError:
            return self._reply(400, {"error": "bad Content-Length"})
        given = self.headers.get("Authorization", "")
        if server.token and not secrets.compare_digest(given.encode(), f"Bearer {server.token}".encode()):
            self._reply(401, {"error": "missing bearer token" if not given else "wrong bearer token"})
            return self._discard(min(length, server.max_request_bytes))
        if length > server.max_request_bytes:
            self._reply(413, {"error": f"a request of {length} bytes exceeds the server's --max_request_bytes "
                                       f"{server.max_request_bytes}"})
            return self._discard(length)  # a client with the token is trusted to send what it claims
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

    def _discard(self, length):
        """Read and drop `length` bytes of the body: closing on unread data resets the connection, and a client
        still sending its body would see the reset instead of the answer already sent."""
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 16))
            length = length - len(chunk) if chunk else 0

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


def serve_rewards(reward_fn, host="127.0.0.1", port=0, token=None, allow_no_auth=False,
                  max_request_bytes=MAX_REQUEST_BYTES, read_timeout=60.0):
    """Serve `reward_fn(queries, prompts, labels)` over HTTP from a daemon thread; returns the started
    RewardServer (`.url`, `.shutdown()`). Requests without `Authorization: Bearer <token>` get 401, bodies
    over max_request_bytes 413, malformed JSON 400, an error of reward_fn 500 with its message; a read that
    waits over read_timeout seconds ends its connection. port 0: any free port."""
    if not token and not allow_no_auth:
        raise ValueError("serve_rewards needs a token (or allow_no_auth=True to serve anyone who can connect)")
    server = RewardServer(reward_fn, host, port, token, max_request_bytes, read_timeout)
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
    """Comma list of reward models (rm.py exports) to serve, rewards summed; the tokenizer is the first's. Each
    query is its prompt (which must begin it) and a response, read as rm.py trained on them: the prompt with the
    tokenizer's special tokens (a BOS) and the response + EOS, or under --apply_chat_template both as sent (send
    the template's end of turn)."""
    normalize_reward: bool = False
    """With --reward_pretrain: normalise each model's output with the mean/std rm.py stored in its config."""
    apply_chat_template: bool = False
    """With --reward_pretrain: the prompts were formatted with a chat template, which wrote its own special tokens."""
    host: str = "127.0.0.1"
    """Address to bind (loopback by default; the traffic is plain HTTP, token included)."""
    port: int = 5000
    """Port to listen on (0: any free port)."""
    token: Optional[str] = None
    """Bearer token clients must send (default: $MINRLHF_REWARD_TOKEN, else a new random one, printed)."""
    max_request_bytes: int = MAX_REQUEST_BYTES
    """Largest request body accepted; a larger Content-Length is answered 413 before the body is read."""
    read_timeout: float = 60.0
    """Seconds one read from a connection may wait before the connection is closed."""


def reward_fn_from_args(args: ServeArgs):
    if (args.reward_func is None) == (args.reward_pretrain is None):
        raise ValueError("give exactly one of --reward_func and --reward_pretrain")
    if (args.normalize_reward or args.apply_chat_template) and not args.reward_pretrain:
        raise ValueError("--normalize_reward and --apply_chat_template apply to --reward_pretrain only")
    if args.reward_func:
        return _file_reward_fn(args.reward_func, "--reward_func")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.data import reward_model_ids
    from common.infra.reward import score

    paths = [p for p in args.reward_pretrain.split(",") if p]
    models = [AutoModelForSequenceClassification.from_pretrained(p).eval() for p in paths]
    tokenizer = AutoTokenizer.from_pretrained(paths[0])

    def reward_fn(queries, prompts, labels):
        ids = []
        for i, (query, prompt) in enumerate(zip(queries, prompts)):
            if not (isinstance(prompt, str) and query.startswith(prompt)):
                raise ValueError(f"query {i}: the reward models read its prompt apart (rm.py's rule), so 'prompts' "
                                 f"must hold it and the query begin with it; got prompt {prompt!r}")
            response = query[len(prompt):]
            if not (args.apply_chat_template or response.endswith(tokenizer.eos_token)):
                response += tokenizer.eos_token  # rm.py's plain response + EOS (format_response)
            ids.append(reward_model_ids(tokenizer, prompt, response, args.apply_chat_template))
        return score(models, ids, normalize=args.normalize_reward)

    return reward_fn


def main(argv=None):
    import tyro

    args = tyro.cli(ServeArgs, args=argv, use_underscores=True, description=__doc__)
    try:
        if args.max_request_bytes < 1 or not args.read_timeout > 0:
            raise ValueError(f"--max_request_bytes {args.max_request_bytes} and --read_timeout {args.read_timeout} "
                             "must be positive")
        reward_fn = reward_fn_from_args(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    token = args.token or os.environ.get(TOKEN_ENV)
    server = serve_rewards(reward_fn, args.host, args.port, token=token or secrets.token_urlsafe(32),
                           max_request_bytes=args.max_request_bytes, read_timeout=args.read_timeout)
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
