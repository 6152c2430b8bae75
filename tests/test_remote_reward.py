"""common/infra/remote_reward.py over real loopback HTTP: bearer-token auth, retries of a failing server,
checked replies, reward-file errors that name the failing sample, the server under many clients and
oversized or unauthenticated claims, the server CLI serving a reward model, and generate.py scoring
through a reward server exactly as through the file."""

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import ROOT, read_jsonl, run_script

from common.infra.remote_reward import load_reward_func, make_reward_fn
from launch.reward_server import main, serve_rewards

EXACT_MATCH = os.path.join(ROOT, "launch", "rewards", "exact_match.py")
SERVER = ["-m", "launch.reward_server"]  # run from ROOT, as the docs run it
PROMPTS = ["reverse: a b\n", "reverse: c d\n", "reverse: e f\n"]
QUERIES = [p + r for p, r in zip(PROMPTS, ["b a", "d d", "f e"])]
LABELS = ["b a", "d c", "f e"]
EXPECTED = [1.0, 0.0, 1.0]


@pytest.fixture
def server():
    srv = serve_rewards(make_reward_fn(EXACT_MATCH), token="secret-token")
    yield srv
    srv.shutdown()


def post(url, body, token=None):
    """(status, JSON reply) of a raw POST."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.quick
def test_rewards_with_the_token_and_401_without(server, monkeypatch):
    assert make_reward_fn(server.url, token="secret-token")(QUERIES, PROMPTS, LABELS).tolist() == EXPECTED
    monkeypatch.setenv("MINRLHF_REWARD_TOKEN", "secret-token")
    assert make_reward_fn(server.url)(QUERIES, PROMPTS, LABELS).tolist() == EXPECTED  # token from the environment
    body = json.dumps({"queries": QUERIES, "prompts": PROMPTS, "labels": LABELS}).encode()
    assert post(server.url, body) == (401, {"error": "missing bearer token"})
    assert post(server.url, body, token="guess") == (401, {"error": "wrong bearer token"})
    monkeypatch.delenv("MINRLHF_REWARD_TOKEN")
    with pytest.raises(RuntimeError, match=r"refused the request \(401: missing bearer token\): no token was sent"):
        make_reward_fn(server.url)(QUERIES, PROMPTS, LABELS)
    with pytest.raises(RuntimeError, match=r"\(401: wrong bearer token\): the token was rejected"):
        make_reward_fn(server.url, token="guess", backoff=10)(QUERIES, PROMPTS, LABELS)  # at once: no backoff wait
    status, reply = post(server.url, b"{not json", token="secret-token")
    assert status == 400 and reply["error"].startswith("bad request: JSONDecodeError")
    status, reply = post(server.url, json.dumps({"queries": QUERIES, "prompts": PROMPTS[:2]}).encode(), "secret-token")
    assert status == 400 and "equal length" in reply["error"]
    # OpenRLHF's clients send "query"; the labels may be absent
    status, reply = post(server.url, json.dumps({"query": QUERIES[:1], "prompts": PROMPTS[:1]}).encode(),
                         "secret-token")
    assert (status, reply) == (200, {"rewards": [0.0]})  # label None: no match
    with pytest.raises(ValueError, match="needs a token"):
        serve_rewards(make_reward_fn(EXACT_MATCH), token="")


def test_64_clients_at_once_get_every_reward_without_a_reset(server):
    """Raw http.client, no retry (as other projects' clients): a connection each, all opened together, so a
    small listen backlog resets some of them."""
    port, n = server.server_address[1], 64
    queries, prompts, labels = QUERIES * 22, PROMPTS * 22, LABELS * 22  # 66 queries, the size of a small batch
    body = json.dumps({"queries": queries, "prompts": prompts, "labels": labels}).encode()
    barrier, results = threading.Barrier(n), []

    def client():
        barrier.wait()
        for _ in range(3):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("POST", "/", body, {"Authorization": "Bearer secret-token"})
                reply = conn.getresponse()
                results.append((reply.status, json.loads(reply.read())["rewards"]))
                conn.close()
            except OSError as e:
                results.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 * n
    assert [r for r in results if r != (200, EXPECTED * 22)] == []


def claim(url, headers, length):
    """Headers claiming a body of `length` bytes, then 10 bytes only, the connection kept open:
    (status, reply, seconds to the reply)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=1.0) as s:
        start = time.time()
        s.sendall(f"POST / HTTP/1.1\r\nHost: {host}\r\nContent-Length: {length}\r\n{headers}\r\n0123456789".encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):  # a timeout here fails the test
            reply += s.recv(4096)
        status, payload = int(reply.split()[1]), json.loads(reply.split(b"\r\n\r\n", 1)[1])
        return status, payload, time.time() - start


def test_oversized_and_unauthenticated_claims_are_answered_before_the_body(server):
    status, reply, seconds = claim(server.url, "", 10**9)
    assert (status, reply) == (401, {"error": "missing bearer token"}) and seconds < 1.0
    status, reply, seconds = claim(server.url, "Authorization: Bearer secret-token\r\n", 2**30 + 1)  # the default
    assert status == 413 and seconds < 1.0
    assert reply == {"error": f"a request of {2**30 + 1} bytes exceeds the server's --max_request_bytes {2**30}"}
    # the project's client reads the 413 (its body was read and dropped, not reset) and does not retry it
    calls = []
    srv = serve_rewards(lambda q, p, lab: calls.append(q) or [0.0] * len(q), token="t", max_request_bytes=300)
    try:
        fn = make_reward_fn(srv.url, token="t", backoff=10)
        assert fn(QUERIES[:1], PROMPTS[:1], LABELS[:1]).tolist() == [0.0]  # 100 bytes or so: served
        with pytest.raises(RuntimeError, match=r"answered 413: a request of \d+ bytes exceeds .* 300$"):
            fn(QUERIES * 4, PROMPTS * 4, LABELS * 4)
        assert len(calls) == 1
    finally:
        srv.shutdown()
    with pytest.raises(SystemExit, match=r"^error: --max_request_bytes 0 and --read_timeout 60.0 must be positive$"):
        main(["--reward_func", EXACT_MATCH, "--max_request_bytes", "0"])


def test_a_stalled_client_is_disconnected_after_the_read_timeout():
    srv = serve_rewards(lambda q, p, lab: [0.0] * len(q), token="t", read_timeout=0.3)
    try:
        with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5) as s:
            s.sendall(b"POST / HTTP/1.1\r\nContent-Length: 100\r\nAuthorization: Bearer t\r\n\r\n0123456789")
            start = time.time()
            assert s.recv(4096) == b""  # closed unanswered: the body never came
            assert 0.25 < time.time() - start < 2.0
    finally:
        srv.shutdown()


class ScriptedServer(ThreadingHTTPServer):
    """A real HTTP server that misbehaves as scripted, one action per request: "close" (drop the
    connection unanswered), "slow" (answer after 1 s), "short" (one reward too few), "ok"."""

    daemon_threads = True

    def __init__(self, actions):
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.actions, self.attempts = list(actions), 0
        self.reward_fn = make_reward_fn(EXACT_MATCH)
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class ScriptedHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        action = self.server.actions[min(self.server.attempts, len(self.server.actions) - 1)]
        self.server.attempts += 1
        if action == "close":
            self.close_connection = True
            return
        if action == "slow":
            time.sleep(1.0)
        rewards = self.server.reward_fn(request["queries"], request["prompts"], request["labels"]).tolist()
        body = json.dumps({"rewards": rewards[:-1] if action == "short" else rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.quick
def test_client_retries_a_server_that_fails_twice_with_500():
    calls = []

    def flaky(queries, prompts, labels):
        calls.append(len(queries))
        if len(calls) <= 2:
            raise RuntimeError("GPU fell off the bus")
        return make_reward_fn(EXACT_MATCH)(queries, prompts, labels)

    srv = serve_rewards(flaky, token="t")
    try:
        assert make_reward_fn(srv.url, token="t", backoff=0.01)(QUERIES, PROMPTS, LABELS).tolist() == EXPECTED
        assert calls == [3, 3, 3]  # exactly 3 attempts
        calls.clear()
        with pytest.raises(RuntimeError,
                           match=r"2 attempts failed .* last error: HTTP 500: RuntimeError: GPU fell off"):
            make_reward_fn(srv.url, token="t", retries=1, backoff=0.01)(QUERIES, PROMPTS, LABELS)
        assert len(calls) == 2
    finally:
        srv.shutdown()


@pytest.mark.quick
@pytest.mark.parametrize("failure", ["close", "slow"])
def test_client_retries_dropped_connections_and_timeouts(failure):
    srv = ScriptedServer([failure, failure, "ok"])
    try:
        rewards = make_reward_fn(srv.url, token="t", timeout=0.3, backoff=0.01)(QUERIES, PROMPTS, LABELS)
        assert rewards.tolist() == EXPECTED and srv.attempts == 3
    finally:
        srv.shutdown()


@pytest.mark.quick
def test_client_stops_with_a_clear_error_when_no_server_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # free once closed: nothing listens there
    start = time.time()
    with pytest.raises(RuntimeError, match=rf"reward server {url}: 3 attempts failed .*Connection refused"):
        make_reward_fn(url, token="t", retries=2, backoff=0.01)(QUERIES, PROMPTS, LABELS)
    assert time.time() - start < 5


@pytest.mark.quick
def test_reply_of_the_wrong_length_is_an_error():
    srv = ScriptedServer(["short"])
    try:
        with pytest.raises(ValueError, match=rf"reward server {srv.url}: returned 2 rewards for 3 queries"):
            make_reward_fn(srv.url, token="t")(QUERIES, PROMPTS, LABELS)
        assert srv.attempts == 1  # a wrong reply is not retried
    finally:
        srv.shutdown()


@pytest.mark.quick
def test_reward_file_errors_name_the_file_and_the_sample(tmp_path):
    path = tmp_path / "parse_float.py"
    path.write_text("def reward_func(queries, prompts, labels):\n    return [float(label) for label in labels]\n")
    fn = make_reward_fn(str(path))
    assert fn(QUERIES, PROMPTS, ["1", "2.5", "-3"]).tolist() == [1.0, 2.5, -3.0]
    with pytest.raises(RuntimeError,
                       match=rf"reward_func in {path} raised ValueError.*index 2, prompt 'reverse: e f\\n', "
                                           r"label 'x'") as err:
        fn(QUERIES, PROMPTS, ["1", "2", "x"])
    assert isinstance(err.value.__cause__, ValueError)
    # through a server the same message comes back in the 500 reply
    srv = serve_rewards(fn, token="t")
    try:
        with pytest.raises(RuntimeError, match=r"HTTP 500: RuntimeError: reward_func in .*parse_float.py.*index 1"):
            make_reward_fn(srv.url, token="t", retries=0)(QUERIES, PROMPTS, ["1", "y", "x"])
    finally:
        srv.shutdown()

    nan = tmp_path / "nan.py"
    nan.write_text("def reward_func(queries, prompts, labels):\n    return [0.0, float('nan'), 1.0][:len(queries)]\n")
    with pytest.raises(ValueError, match=rf"reward_func in {nan}: non-finite reward nan for query 1"):
        make_reward_fn(str(nan))(QUERIES, PROMPTS, LABELS)
    with pytest.raises(ValueError, match=rf"reward_func in {nan}: returned 3 rewards for 4 queries"):
        make_reward_fn(str(nan))(QUERIES + QUERIES[:1], PROMPTS + PROMPTS[:1], LABELS + LABELS[:1])


@pytest.mark.quick
def test_reward_file_without_reward_func(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("def score(queries):\n    return [0.0] * len(queries)\n")
    with pytest.raises(ValueError,
                       match=rf"--reward_func {path} defines no function reward_func\(queries, prompts, labels\)"):
        make_reward_fn(str(path))
    with pytest.raises(ValueError, match=rf"--reward_func {tmp_path}/missing.py: no such file"):
        load_reward_func(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match=rf"--remote_rm_url {path} defines no function reward_func"):
        make_reward_fn(str(path), flag="--remote_rm_url")  # the flag the user gave it through


def test_cli_serves_a_reward_model(assets, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.data import reward_model_ids
    from common.infra.reward import score

    # an rm.py export is a sequence-classification model with the eval mean / std in its config
    rm_path = str(tmp_path / "rm")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(f"{assets}/llama-0.5m", num_labels=1).eval()
    rm.config.mean, rm.config.std = 0.25, 2.0
    rm.save_pretrained(rm_path)
    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m")
    tokenizer.save_pretrained(rm_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINRLHF_REWARD_TOKEN": ""}
    cmd = [sys.executable, *SERVER, "--reward_pretrain", rm_path, "--normalize_reward", "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split()[-1]
        token = proc.stdout.readline().split()[1]  # none given: the server made one and printed it
        assert url.startswith("http://127.0.0.1:") and len(token) >= 32
        rewards = make_reward_fn(url, token=token)(QUERIES, PROMPTS, LABELS)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    rm_ids = [reward_model_ids(tokenizer, p, q[len(p):] + tokenizer.eos_token, False) for q, p in zip(QUERIES, PROMPTS)]
    expected = score(rm, rm_ids, normalize=True)  # rm.py's ids: the prompt apart, the response + EOS
    raw = score(rm, rm_ids)
    assert torch.allclose(rewards, expected, atol=1e-5) and torch.allclose(rewards, (raw - 0.25) / 2.0, atol=1e-5)
    assert len(set(rewards.tolist())) == 3  # three texts, three different scores

    bad = subprocess.run([sys.executable, *SERVER, "--reward_func", EXACT_MATCH, "--reward_pretrain", rm_path],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "give exactly one of --reward_func and --reward_pretrain" in bad.stderr


def test_generate_through_a_reward_server_equals_the_file(assets, sft_model, tmp_path):
    seen = []

    def exact_match_logged(queries, prompts, labels):
        seen.extend(queries)
        return make_reward_fn(EXACT_MATCH)(queries, prompts, labels)

    srv = serve_rewards(exact_match_logged, token="gen-token")
    common = ["--pretrain", sft_model, "--dataset", f"{assets}/data/reverse/rl_test.jsonl", "--input_key", "prompt",
              "--label_key", "answer", "--apply_chat_template", "--max_new_tokens", 12, "--temperature", 0.5,
              "--backend", "hf", "--best_of_n", 4, "--max_samples", 8]
    try:
        run_script("generate.py", [*common, "--reward_func", EXACT_MATCH, "--output_path", tmp_path / "file.jsonl"])
        run_script("generate.py", [*common, "--remote_rm_url", srv.url, "--remote_rm_token", "gen-token",
                                   "--output_path", tmp_path / "http.jsonl"])
        proc = run_script("generate.py", [*common, "--remote_rm_url", srv.url, "--output_path", tmp_path / "x.jsonl"],
                          expect_ok=False, env={"MINRLHF_REWARD_TOKEN": ""})
    finally:
        srv.shutdown()
    by_file, by_http = read_jsonl(tmp_path / "file.jsonl"), read_jsonl(tmp_path / "http.jsonl")
    assert by_http == by_file and len(seen) == 8 * 4  # same samples, same rewards, all scored over HTTP
    rewards = [r for row in by_http for r in row["rewards"]]
    assert rewards == [float(resp.strip() == row["label"]) for row in by_http for resp in row["responses"]]
    assert 0 < sum(rewards) < len(rewards)
    # no token: refused before any model is loaded, with the reason
    assert proc.returncode != 0 and "no token was sent" in proc.stderr and not os.path.exists(tmp_path / "x.jsonl")
