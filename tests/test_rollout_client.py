"""The trainer's side of a vLLM rollout server, in the main environment (no vLLM here): how the launcher starts vLLM's
server (flags, routes enabled, the token only in the environment), that every prompt of a rank is in flight at once and
shared out over several servers with the completions back in order, and what a server that refuses or does not answer
is reported as. A stand-in speaks the few routes of vLLM's OpenAI API this needs; vLLM itself answers in
tests/test_vllm_serve.py (the vLLM environment)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from finetune.errors import FtError
from finetune.rollout.serve import server_command, server_env, shown
from finetune.rollout.server import Http, RemoteRollout, balance, wait_ready
from finetune.rollout.vllm import EngineSpec
from tests.helpers import ft_here

SECTION = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=3)


class StandIn:
    """A server answering /health, /v1/models and /v1/completions like vLLM: a completion is [last prompt token,
    seed]. `together` requests must be open at the same moment before any is answered (a barrier: a client that sends
    them one after another gets 500s)."""

    def __init__(self, together: int, token: str | None = "s3cret"):
        self.seen, self.barrier, self.token = [], threading.Barrier(together, timeout=10), token
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    return self._reply(200, {})
                if self.headers.get("Authorization") != f"Bearer {stand_in.token}":
                    return self._reply(401, {"error": "Unauthorized"})
                return self._reply(200, {"data": [{"id": "base", "parent": None}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.seen.append(body)
                try:
                    stand_in.barrier.wait()
                except threading.BrokenBarrierError:
                    return self._reply(500, {"error": "the requests came one at a time"})
                ids = [body["prompt"][-1], body["seed"]]
                choice = {"token_ids": ids, "logprobs": {"token_logprobs": [-0.5, -0.25]}}
                return self._reply(200, {"choices": [choice]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def two_servers():
    servers = [StandIn(together=3), StandIn(together=2)]  # 5 prompts: 3 to the first, 2 to the second
    yield servers
    for s in servers:
        s.close()


def test_every_prompt_is_in_flight_at_once_shared_out_over_the_servers_and_answered_in_order(two_servers):
    client = RemoteRollout([s.url for s in two_servers], SECTION, stop=[0], token="s3cret")
    prompts = [[10], [11], [11], [12], [12]]  # three groups: one sample of 10, two of 11, two of 12
    got = client.generate(prompts, seed=100)
    assert [c.ids for c in got] == [[10, 100], [11, 101], [11, 102], [12, 103], [12, 104]]
    assert all(c.logps == [-0.5, -0.25] for c in got)
    first, second = (sorted(b["prompt"][0] for b in s.seen) for s in two_servers)
    # balanced by expected tokens, each group whole on one server: the two groups of two apart, then 10 on the first
    # of the two equally loaded servers
    assert (first, second) == ([10, 11, 11], [12, 12])
    body = two_servers[0].seen[0]
    assert body["model"] == "base" and body["stop_token_ids"] == [0] and body["logprobs"] == 0
    assert body["return_token_ids"] is True and body["max_tokens"] == 3
    client.close()


def test_servers_get_equal_expected_tokens_and_a_prompts_samples_stay_together():
    short, long_ = [1] * 4, [2] * 60
    # two groups of four samples, a long prompt and a short one: each group whole on a server of its own
    assert balance([long_] * 4 + [short] * 4, 2, new_tokens=16) == [0] * 4 + [1] * 4
    # one long group against three short ones: the short ones share the other server (4x76 against 3x4x20 tokens)
    prompts = [long_] * 4 + [short] * 4 + [[3] * 4] * 4 + [[4] * 4] * 4
    where = balance(prompts, 2, new_tokens=16)
    assert where == [0] * 4 + [1] * 12
    # by count alone (equal shares of 8) one server would get 4x76 + 4x20 tokens and the other 8x20
    loads = [sum(len(p) + 16 for p, w in zip(prompts, where) if w == k) for k in (0, 1)]
    assert max(loads) / min(loads) < 1.3
    assert balance([[5]] * 3, 4, new_tokens=8) == [0, 0, 0]  # one group: one server, never split
    assert balance([[1], [2], [3], [4]], 4, new_tokens=8) == [0, 1, 2, 3]  # equal groups: one each, in order


def test_a_wrong_token_and_an_unreachable_server_are_reported_with_the_fix():
    server = StandIn(together=1)
    try:
        with pytest.raises(FtError, match=r"(?s)answered 401.*FT_ROLLOUT_TOKEN"):
            RemoteRollout(server.url, SECTION, stop=[0], token="wrong")
    finally:
        server.close()
    with pytest.raises(FtError, match="did not answer within"):
        wait_ready(Http("http://127.0.0.1:9", None, 1), timeout_s=0.6)
    with pytest.raises(FtError, match=r"(?s)cannot be reached.*rollout-server.log.*--resume"):
        Http("http://127.0.0.1:9", None, 1).call("/v1/completions", {})


def test_a_server_whose_engine_failed_ends_the_job_with_its_log_and_resume():
    class Failing(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = b'{"error": {"message": "EngineCore encountered an issue.", "code": 500}}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(FtError, match=r"(?s)answered 500: .*EngineCore.*rollout-server.log.*--resume"):
            Http(url, None, 5).call("/v1/completions", {})
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_stops_answering_ends_the_request_after_the_timeout():
    server = StandIn(together=2)  # one request alone waits at the barrier: no answer
    try:
        with pytest.raises(FtError, match=r"did not answer within 0.5 s \(method.rollout.timeout_s\)"):
            Http(server.url, "s3cret", 0.5).call("/v1/completions", {"prompt": [1], "seed": 0})
    finally:
        server.close()


def test_the_server_command_carries_the_jobs_engine_settings_and_never_the_token(monkeypatch):
    spec = EngineSpec(model="/m", tokenizer="/t", dtype="fp32", max_model_len=96, seed=3, lora_rank=12)
    cpu = server_command(spec, "127.0.0.1", 8421, "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server", False)
    assert cpu[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cpu[3::2], cpu[4::2]))
    assert flags["--model"] == "/m" and flags["--max-model-len"] == "96" and flags["--max-lora-rank"] == "16"
    assert "--kv-cache-memory-bytes" in cpu and "--weight-transfer-config" not in cpu
    assert cpu[cpu.index("--distributed-executor-backend") + 1] == "uni"  # on a CPU: the worker in the engine process
    assert {"--enforce-eager", "--no-enable-chunked-prefill", "--no-enable-prefix-caching"} <= set(cpu)  # ft generate's
    gpu = server_command(spec, "0.0.0.0", 8421, "vllm serve", True, data_parallel=4)
    assert gpu[:2] == ["vllm", "serve"] and json.loads(gpu[gpu.index("--weight-transfer-config") + 1]) == {
        "backend": "nccl"
    }
    assert gpu[gpu.index("--data-parallel-size") + 1] == "4" and "--distributed-executor-backend" not in gpu
    assert "--no-enable-chunked-prefill" not in gpu and "--enforce-eager" not in gpu
    env = server_env({"PATH": "/bin", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "s3cret", gpu=False)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # else vLLM's CPU platform turns `uni` back into processes
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, None, gpu=True)
    assert env["VLLM_API_KEY"] == "s3cret" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and "s3cret" not in shown(cpu)


def test_ft_rollout_server_prints_vllms_command_for_the_job(tmp_path, capfd):
    from finetune.tiny import prompt_records, write_jsonl

    prompts = write_jsonl(prompt_records(8, seed=5), tmp_path / "prompts.jsonl")
    job = tmp_path / "job.yaml"
    job.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {prompts}, format: prompt_only}}], seq_len: 64, cache_dir: {tmp_path / "cache"}}}
method: {{name: grpo, engine: vllm, num_generations: 4, max_new_tokens: 8, rewards: [{{function: exact_match,
  args: {{column: answer}}}}], rollout: {{placement: server, command: /opt/vllm/bin/vllm serve}}}}
adapter: {{type: lora, r: 8}}
train: {{global_batch_size: 8, max_steps: 2}}
output: {{dir: {tmp_path / "run"}}}
""")
    code, out, err = ft_here(
        capfd, "rollout-server", str(job), "--port", "8555", "--dry-run", env={"FT_ROLLOUT_TOKEN": "s3cret"}
    )
    assert code == 0, err
    assert "listening on http://127.0.0.1:8555" in out and "/opt/vllm/bin/vllm serve --model" in out
    assert "--enable-lora" in out and "s3cret" not in out + err


def test_a_resumed_run_keeps_the_folder_it_sends_and_drops_what_the_stopped_run_wrote_after_it(tmp_path):
    from finetune.rollout.weights import prune

    for v in (19, 20, 23, 24):
        (tmp_path / f"weights-{v:08d}").mkdir()
    (tmp_path / "adapter-00000024").mkdir()  # another kind: not touched
    prune(tmp_path / "weights-00000020")  # resumed from step 20: 23 and 24 are the stopped run's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-00000024", "weights-00000019", "weights-00000020"]


class Routes:
    """A server that records every POST (path and body) and answers as vLLM does: completions naming the model they
    were asked for, `finish_reason` as set, `/reset_prefix_cache` with `reset_ok`."""

    def __init__(self):
        self.posts, self.finish, self.reset_ok = [], "length", True
        routes = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, payload):
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply({"data": [{"id": "base", "parent": None}]} if "models" in self.path else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                routes.posts.append((self.path, body))
                if self.path == "/v1/completions":
                    choice = {"token_ids": [1], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": routes.finish}
                    return self._reply({"choices": [choice]})
                self._reply({"success": routes.reset_ok} if self.path.startswith("/reset_prefix_cache") else {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def paths(self) -> list[str]:
        return [p for p, _ in self.posts if p != "/v1/completions"]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _weights(kind: str, version: int, folder, in_flight=()):
    from finetune.distributed.runtime import Runtime

    return SimpleNamespace(
        kind=kind,
        version=version,
        runtime=Runtime(),
        in_flight=frozenset(in_flight),
        adapter_folder=lambda: folder,
        checkpoint_folder=lambda: folder,
    )


def test_full_weights_change_with_requests_kept_and_recomputed_and_adapters_stay_while_rollouts_name_them(tmp_path):
    server = Routes()
    try:
        client = RemoteRollout(server.url, SECTION, stop=[0])
        client.update(_weights("full", 1, tmp_path))
        assert server.paths() == [
            "/pause?mode=keep",  # requests in flight stay where they are
            "/collective_rpc",
            "/reset_prefix_cache?reset_running_requests=true",  # no KV block of the old weights is read again
            "/resume",
        ]
        server.reset_ok, server.posts[:] = False, []
        with pytest.raises(FtError, match="could not empty its prefix cache"):
            client.update(_weights("full", 2, tmp_path))
        assert server.paths()[-1] == "/resume"  # resumed all the same

        server.posts[:] = []
        client.update(_weights("adapter", 1, tmp_path))
        client.update(_weights("adapter", 2, tmp_path, in_flight={1}))  # a rollout ahead still generates with 1
        assert [p for p in server.paths() if "unload" in p] == []
        client.generate([[5]], seed=0)
        assert server.posts[-1][1]["model"] == "ft-adapter-2"
        client.update(_weights("adapter", 3, tmp_path, in_flight={2}))
        unloaded = [b["lora_name"] for p, b in server.posts if p == "/v1/unload_lora_adapter"]
        assert unloaded == ["ft-adapter-1"]  # 2 stays for the rollout that names it

        server.finish = "abort"
        with pytest.raises(FtError, match="aborted a completion"):
            client.generate([[5]], seed=0)  # a completion cut short is never trained on
        client.close()
    finally:
        server.close()
